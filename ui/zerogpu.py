"""ZeroGPU Spaces: a GPU only inside functions decorated with `spaces.GPU`, for a duration asked per call.

On a ZeroGPU Space (`SPACES_ZERO_GPU=true`, the `spaces` package installed by the platform)
the studio's one GPU entry point, `StudioRuntime`'s job body, is decorated with `spaces.GPU`
and a duration sized from the request (`gpu_seconds`). ZeroGPU runs a decorated call in a
worker process forked from the studio, with the arguments and the result pickled across, so:

- `spaces` is imported before anything could start CUDA (app.py does it first), and nothing
  here or at import elsewhere initialises CUDA;
- the call takes only a `JobSpec` and returns plain data (items, result, timings);
- Stop and the step counter cross the process boundary through a multiprocessing event and
  queue made before the first fork (`GpuBridge`);
- models load inside the worker and stay cached while ZeroGPU keeps that worker; compile
  caches on disk (inductor, TensorRT engines) survive, CUDA graphs do not outlive a worker.

Anywhere else (`spaces` missing, or installed but not on ZeroGPU) nothing is decorated and the
job runs on the studio's own worker thread as always.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import queue as queue_mod
import threading
from typing import Any, Callable

log = logging.getLogger("atelier.ui")

MIN_S, DEFAULT_MAX_S = 15, 300            # ZeroGPU durations we ask for, in seconds
_spaces: Any = None


def on_zerogpu() -> bool:
    """True on a ZeroGPU Space (the platform sets SPACES_ZERO_GPU)."""
    return os.environ.get("SPACES_ZERO_GPU", "").strip().lower() in ("1", "t", "true")


def import_spaces_early():
    """Import `spaces` on a ZeroGPU Space, before torch can touch CUDA (it patches torch at import).
    Returns the module, or None when not on ZeroGPU or the package is missing (then we say so)."""
    global _spaces
    if _spaces is None and on_zerogpu():
        try:
            _spaces = importlib.import_module("spaces")
        except ImportError as exc:
            log.warning("SPACES_ZERO_GPU is set but the `spaces` package cannot be imported (%s): "
                        "jobs will run without asking ZeroGPU for a GPU", exc)
    return _spaces


def max_seconds() -> int:
    try:
        return max(MIN_S, int(os.environ.get("ATELIER_ZEROGPU_MAX_S", DEFAULT_MAX_S)))
    except ValueError:
        return DEFAULT_MAX_S


def gpu_seconds(spec) -> int:
    """How long to ask ZeroGPU for, from what the job will do: a first-call allowance (loading the model
    onto the GPU) plus a generous per-image or per-step estimate for an H200 slice, doubled for a
    comparison (two runs), plus compile or engine-build time when those toggles are on. Clamped to
    [MIN_S, ATELIER_ZEROGPU_MAX_S]: a shorter ask gets a visitor through ZeroGPU's queue sooner."""
    req = spec.request
    p = req.params
    work = 0.0
    if req.backend == "diffusion":
        pixels = p.width * p.height / (512 * 512)
        per_step = 0.06 * pixels * (2 if p.guidance > 1 else 1)       # SD 1.5 at 512²: ~25 steps/s with CFG
        if "xl" in str(req.model or "").lower() or max(p.width, p.height) > 768:
            per_step *= 2.5
        work = p.steps * max(1, p.batch_size) * per_step + 2.0 * max(1, p.batch_size)   # + VAE decode
        load = 40.0
    else:
        images = len(p.seeds)
        if spec.kind == "style-mix" and spec.mix is not None:
            images = (len(spec.mix.rows) + 1) * (len(spec.mix.cols) + 1)
        elif spec.kind == "interpolate":
            images = len(p.seeds) * spec.frames_per_seed
        work = 0.05 * images
        load = 15.0
    if spec.kind == "compare":
        work *= 2
    flags = req.flags
    if flags.compile != "off":
        load += 120.0
    if flags.tensorrt:
        load += 240.0
    return int(min(max_seconds(), max(MIN_S, load + 1.5 * work)))


class GpuBridge:
    """Stop and progress for a job body that runs in a ZeroGPU worker process. Made in the studio's process
    before any worker is forked, so every worker inherits the same event and queue."""

    def __init__(self):
        ctx = multiprocessing.get_context("fork")
        self.cancel_event = ctx.Event()
        self.progress = ctx.Queue()

    # -- studio side -----------------------------------------------------------------------------
    def begin(self) -> None:
        self.cancel_event.clear()
        self.drain(lambda *_: None)

    def drain(self, on_event: Callable[..., None]) -> None:
        while True:
            try:
                item = self.progress.get_nowait()
            except (queue_mod.Empty, OSError, EOFError):
                return
            on_event(*item)

    # -- worker side -------------------------------------------------------------------------------
    def report(self, ev) -> None:
        try:
            self.progress.put_nowait((ev.stage, int(ev.step), int(ev.total), ev.step_ms, ev.message or ""))
        except Exception:   # a full or closed queue must never fail the job itself
            pass

    def watch_cancel(self, job, stop: threading.Event) -> threading.Thread:
        """In the worker: a thread that cancels `job` when the studio sets the event (until `stop`)."""
        def loop():
            while not stop.is_set():
                if self.cancel_event.wait(0.1):
                    job.cancel()
                    return
        t = threading.Thread(target=loop, name="zerogpu-cancel", daemon=True)
        t.start()
        return t


def decorate(fn: Callable, duration: Callable) -> Callable | None:
    """`spaces.GPU(duration=...)(fn)` on ZeroGPU; None elsewhere (the caller then runs in-process)."""
    spaces = import_spaces_early()
    if spaces is None:
        return None
    return spaces.GPU(duration=duration)(fn)
