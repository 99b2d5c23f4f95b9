"""Process-wide switches: which are set once per process, which belong to one request, and a snapshot.

torch keeps some settings for the whole process (TF32, cuDNN autotuning, SDPA kernels, thread count,
float32 matmul precision), and so do dynamo/inductor (their config modules, cache folders in the
environment) and our own op-implementation choice (`models.ops.set_impl`). A request that sets one and
leaves it set changes every later request: an fp32 reference that quietly runs in TF32, a "reference"
kernel run that uses the fused one.

Set once, at process start (`configure_process`, from the model manager): the compile cache folders,
inductor's FX-graph cache and dynamo's recompile floors. Their value is the same for every request
(see `optim.compile.configure_process` for why), and inductor reads them when it compiles, which is
later than any scope could hold them.

Per request (`scoped`, `request_scope`): everything in RESTORED. `scoped(...)` sets the switches it is
given and, on the way out, puts back *every* switch in RESTORED to its value at entry, whether the
request or a library it called changed it, and whether the block returned or raised.

These are process state, not thread state: two requests that need different values must not run at the
same time (the studio runs generations one at a time through its queue).

This lives in pipelines/ because it reads both models.ops and optim (DESIGN.md's import rules).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import optim
from models import ops
from optim import compile as _compile

# The environment variables and dynamo/inductor settings that configure_process owns.
PROCESS_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _dynamo_config():
    import torch._dynamo.config as c

    return c


def _inductor_config():
    import torch._inductor.config as c

    return c


def _setter(obj_path: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(get, set) for an attribute such as "cudnn.benchmark" under torch.backends."""
    *parents, attr = obj_path.split(".")

    def owner():
        o = torch.backends
        for p in parents:
            o = getattr(o, p)
        return o

    return (lambda: getattr(owner(), attr)), (lambda v: setattr(owner(), attr, v))


def _sdp(name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    cuda = torch.backends.cuda
    return getattr(cuda, f"{name}_sdp_enabled"), getattr(cuda, f"enable_{name}_sdp")


def _safe(get: Callable[[], Any]) -> Callable[[], Any]:
    """torch >= 2.9 refuses to read a legacy TF32 view once the legacy and the new (fp32_precision) APIs
    were mixed; the snapshot then records that instead of failing."""
    def read():
        try:
            return get()
        except RuntimeError as exc:
            return f"mixed: {str(exc)[:60]}"
    return read


# Switches a request may change and scoped() restores, in restore order: float32_matmul_precision before
# the TF32 switches (on torch >= 2.9 it also moves the per-backend precisions the TF32 switches are views
# of). Only the legacy API is used, to set and to restore, as optim.precision does: restoring through the
# new fp32_precision strings after a legacy write leaves torch in a "mixed" state where the legacy
# getters raise.
RESTORED: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "float32_matmul_precision": (_safe(torch.get_float32_matmul_precision), torch.set_float32_matmul_precision),
    "cuda.matmul.allow_tf32": _setter("cuda.matmul.allow_tf32"),
    "cudnn.allow_tf32": _setter("cudnn.allow_tf32"),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": _setter("cuda.matmul.allow_fp16_reduced_precision_reduction"),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": _setter("cuda.matmul.allow_bf16_reduced_precision_reduction"),
    "cudnn.benchmark": _setter("cudnn.benchmark"),
    "cudnn.deterministic": _setter("cudnn.deterministic"),
    "sdp.flash": _sdp("flash"),
    "sdp.mem_efficient": _sdp("mem_efficient"),
    "sdp.math": _sdp("math"),
    "sdp.cudnn": _sdp("cudnn"),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "deterministic_algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "ops": (ops.get_impl, lambda v: ops.set_impl(**v)),
}
for _name in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32"):
    RESTORED[_name] = (_safe(RESTORED[_name][0]), RESTORED[_name][1])


def _process_values() -> dict[str, Any]:
    d, i = _dynamo_config(), _inductor_config()
    out: dict[str, Any] = {f"env.{k}": os.environ.get(k) for k in PROCESS_ENV}
    for name in ("recompile_limit", "accumulated_recompile_limit", "error_on_recompile"):
        out[f"dynamo.{name}"] = getattr(d, name, None)
    out["inductor.fx_graph_cache"] = getattr(i, "fx_graph_cache", None)
    return out


def snapshot() -> dict[str, Any]:
    """The current value of every switch (RESTORED and the process-wide ones), for comparing."""
    out = {name: get() for name, (get, _) in RESTORED.items()}
    out.update(_process_values())
    return out


def _restore(saved: dict[str, Any]) -> None:
    for name, (get, set_) in RESTORED.items():
        value = saved[name]
        if get() != value and not (isinstance(value, str) and value.startswith("mixed: ")):
            set_(value)


@contextlib.contextmanager
def scoped(*, tf32: bool | None = None, cudnn_benchmark: bool | None = None,
           ops_impl: dict[str, str] | None = None, **switches: Any) -> Iterator[dict[str, Any]]:
    """Set switches for the block; on exit every switch in RESTORED is back to its value at entry.

    tf32: both TF32 switches (matmul and cuDNN). cudnn_benchmark: cuDNN autotuning. ops_impl: knobs for
    models.ops.set_impl. **switches: any other RESTORED name given with "_" for ".", e.g. sdp_flash=False.
    Yields the snapshot taken at entry."""
    saved = {name: get() for name, (get, _) in RESTORED.items()}
    try:
        if tf32 is not None:
            RESTORED["cuda.matmul.allow_tf32"][1](bool(tf32))
            RESTORED["cudnn.allow_tf32"][1](bool(tf32))
        if cudnn_benchmark is not None:
            RESTORED["cudnn.benchmark"][1](bool(cudnn_benchmark))
        if ops_impl:
            ops.set_impl(**ops_impl)
        for key, value in switches.items():
            name = next((n for n in RESTORED if n.replace(".", "_") == key), None)
            if name is None:
                raise TypeError(f"scoped() got an unknown switch {key!r}")
            RESTORED[name][1](value)
        yield dict(saved)
    finally:
        _restore(saved)


def request_scope(flags, device: torch.device, ops_impl: dict[str, str] | None = None,
                  precision: contextlib.AbstractContextManager | None = None) -> contextlib.ExitStack:
    """One request's (or one generator call's) context: the op implementations and the precision runtime
    (`optim.runtime`: autocast, TF32 on CUDA), inside a scope that restores every switch after it.
    ops_impl: the request's knobs; knobs it leaves out run the reference (not whatever is set), so a
    request's ops never depend on what ran before it. None: the ops are left alone (diffusion).
    `precision`: a context to use instead of optim.runtime(flags, device)."""
    stack = contextlib.ExitStack()
    stack.enter_context(scoped(ops_impl=None if ops_impl is None else {**ops.DEFAULT_IMPL, **ops_impl}))
    stack.enter_context(precision if precision is not None else optim.runtime(flags, device))
    return stack


def configure_process(cache_root: Path | str | None = None) -> Path:
    """The settings made once per process (compile cache folders, dynamo limits); idempotent. Called by the
    model manager when it is built, so that no request is the first to set them."""
    if cache_root is None:
        from optim.registry import default_cache_dir

        cache_root = default_cache_dir()
    return _compile.configure_process(cache_root)


__all__ = ["RESTORED", "PROCESS_ENV", "snapshot", "scoped", "request_scope", "configure_process"]
