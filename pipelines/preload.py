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

`lean_imports()` (both paths import the stack inside it): transformers and diffusers import torchao (their
quantizers for torchao-quantized checkpoints, at module level) and transformers scikit-learn (assisted
generation) whenever they are installed, though the studio uses none of these: on the H200 machine, under
`python -X importtime`, they took 1.4 s and 1.3 s of the stack's 15.1 s (`docs/results/2026-12-05-3dc88cf-importtime-top40.txt`). Inside it the two
libraries' availability checks answer "not installed" while their modules import; afterwards they answer
truthfully again. The studio's own FP8 toggle imports torchao itself when it is switched on.
`ATELIER_LEAN_IMPORTS=0` turns it off (needed only to load a checkpoint quantized with torchao through
transformers' or diffusers' own quantization configs).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

ENV = "ATELIER_PRELOAD"
LEAN_ENV = "ATELIER_LEAN_IMPORTS"
# transformers' availability check -> the package it looks for
LEAN_HIDDEN = {"is_torchao_available": "torchao", "is_sklearn_available": "sklearn"}
_lean_lock = threading.Lock()


@contextlib.contextmanager
def lean_imports():
    """Import the diffusion stack without the optional packages transformers and diffusers would import for
    features the studio does not use (see the module's docstring). A no-op when turned off, when the stack is
    already imported, or when transformers' checks are not where this version of it keeps them."""
    if os.environ.get(LEAN_ENV, "1").strip() == "0" or "transformers.modeling_utils" in sys.modules:
        yield                            # off, or the stack is already imported: nothing left to leave out
        return
    try:
        from transformers.utils import import_utils as iu
    except Exception:                    # transformers missing or broken: the import itself will say so
        yield
        return
    checks = [getattr(iu, name, None) for name in LEAN_HIDDEN]
    probe = getattr(iu, "_is_package_available", None)
    if probe is None or not all(callable(getattr(c, "cache_clear", None)) for c in checks):
        yield
        return
    hidden = set(LEAN_HIDDEN.values())

    def answer(pkg_name, *args, **kwargs):
        return (False, "N/A") if pkg_name in hidden else probe(pkg_name, *args, **kwargs)

    try:                                 # diffusers keeps its answer in a module constant
        from diffusers.utils import import_utils as diu
    except Exception:
        diu = None
    saved = getattr(diu, "_torchao_available", None)
    with _lean_lock:
        try:
            iu._is_package_available = answer
            for c in checks:             # the cached answers transformers' modules read while they import
                c.cache_clear()
                c()
        finally:
            iu._is_package_available = probe
        if isinstance(saved, bool):
            diu._torchao_available = False
        try:
            yield
        finally:
            for c in checks:             # from here on the checks look again (a later explicit use still works)
                c.cache_clear()
            if isinstance(saved, bool):
                diu._torchao_available = saved

_lock = threading.Lock()
_thread: threading.Thread | None = None
_state: dict = {"started": False, "seconds": None, "error": None}


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def _import_stack() -> None:
    t0 = time.perf_counter()
    try:
        with lean_imports():
            import_diffusers_classes()
    except Exception as exc:          # the loader imports again on first use and reports its own error
        _state["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _state["seconds"] = round(time.perf_counter() - t0, 3)


def import_diffusers_classes() -> None:
    """diffusers and the pipeline and model classes the studio loads (their modules import transformers')."""
    import diffusers

    # diffusers' top-level names are lazy: touching the classes imports their modules (and transformers')
    for name in ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusionImg2ImgPipeline",
                 "StableDiffusionXLImg2ImgPipeline", "AutoencoderKL", "UNet2DConditionModel"):
        getattr(diffusers, name)


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
