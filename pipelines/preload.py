"""Import the diffusion stack in the background while the studio starts.

Importing diffusers' pipeline classes (and the transformers, scipy and dynamo modules they pull in) took 9.7 s
of a 16.8 s second start of SD1.5 on the H200 machine (docs/benchmarks/runs/2026-12-04-b-6b90d0d-sd15-aot-warm.jsonl,
`prepare_parts_s.import`); on this 2-core machine it is ~5 s. The StyleGAN path never needs them, so
`pipelines.diffusion` imports diffusers on first use. The studio server starts this thread right after it
begins serving: by the time an artist picks a diffusion model the import is done, and loading the model
is the model's own time (1.4 s from disk, 2.5 s of toggles, 3.1 s to the first image with AOT parts).

`wait()` is called by the diffusion loader before it imports diffusers itself, so the two never import the
same modules at once (a concurrent import of a package with circular imports can raise a deadlock error).
`ATELIER_PRELOAD=0` turns it off (a StyleGAN-only host saves the memory the modules take).
"""
from __future__ import annotations

import os
import threading
import time

ENV = "ATELIER_PRELOAD"

_lock = threading.Lock()
_thread: threading.Thread | None = None
_state: dict = {"started": False, "seconds": None, "error": None}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def _import_stack() -> None:
    t0 = time.perf_counter()
    try:
        import diffusers

        # diffusers' top-level names are lazy: touching the classes imports their modules (and transformers')
        for name in ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusionImg2ImgPipeline",
                     "StableDiffusionXLImg2ImgPipeline", "AutoencoderKL", "UNet2DConditionModel"):
            getattr(diffusers, name)
    except Exception as exc:          # the loader imports again on first use and reports its own error
        _state["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _state["seconds"] = round(time.perf_counter() - t0, 3)


def start() -> bool:
    """Start the background import (once per process); False when turned off or already started."""
    global _thread
    if not enabled():
        return False
    with _lock:
        if _thread is not None:
            return False
        # torch first, in the caller's thread: a package whose import is under way in two threads at once can
        # come out half-initialised (a CI run saw importlib fail with "name 'sys' is not defined" when a test's
        # main thread imported torch while this thread did). The studio has torch loaded long before it serves.
        import torch  # noqa: F401

        _state["started"] = True
        _thread = threading.Thread(target=_import_stack, name="atelier-preload", daemon=True)
        _thread.start()
        return True


def wait(timeout: float | None = None) -> None:
    """Block until a started background import has finished (at once when none was started)."""
    t = _thread
    if t is not None and t is not threading.current_thread():
        t.join(timeout)


def status() -> dict:
    """{'started', 'running', 'seconds' (when done), 'error'} of the background import."""
    t = _thread
    return {**_state, "running": bool(t is not None and t.is_alive())}
