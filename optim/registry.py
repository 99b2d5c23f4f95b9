"""Applies the toggles named in OptimizationFlags, in a fixed order, and collects their reports.

Order, and why:
 1. placement   the pipeline goes to the device (or, with cpu-offload, gets accelerate's hooks)
 2. prune       on full-precision weights, so the drift it reports is pruning's alone
 3. precision   weight casts before anything that depends on the dtype
 4. channels_last, attention, memory savers   layout and kernel choices
 4b. fuse_qkv   after precision (fused weights in the final dtype) and after attention / memory savers
                (it refuses non-SDPA processors rather than undo them); before FP8, TensorRT and compile,
                which must see the fused layers
 4c. tiny_vae   TAESD loaded next to the VAE in its final dtype and layout (the VAE stays, for encoding)
 4d. sdpa routes ATELIER_SDPA_ROUTE: the SDPA backend per kind of call (self / cross / VAE), an A/B switch
 5. fp8         quantizes the final-dtype linear layers
 6. tensorrt    exports what the steps above produced
 7. compile     last: it traces everything above (and skips what TensorRT serves); under a request graph
                (6b, pipelines/request_graph.py) its modules get no CUDA graphs of their own
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch

from core.errors import OptionalDependencyError
from core.types import OptimizationFlags
from optim import attention as _attention
from optim import channels_last as _channels_last
from optim import compile as _compile
from optim import fp8 as _fp8
from optim import fused_qkv as _fused_qkv
from optim import memory as _memory
from optim import precision as _precision
from optim import prune as _prune
from optim import request_graph as _request_graph
from optim import tensorrt as _tensorrt
from optim import tiny_vae as _tiny_vae
from optim.report import ToggleReport, ordered, skipped
from optim.targets import Context, resolve

Report = dict[str, ToggleReport]


def default_cache_dir() -> Path:
    from core.settings import Settings

    return Settings.from_env().cache_dir


def requested_toggles(flags: OptimizationFlags) -> list[str]:
    """Names of the toggles a request asks for (precision is always reported)."""
    names = ["precision"]
    if flags.channels_last:
        names.append("channels_last")
    if flags.attention != "sdpa":
        names.append("attention")
    if flags.fuse_qkv:
        names.append("fuse_qkv")
    if flags.tiny_vae:
        names.append("tiny_vae")
    if flags.compile != "off":
        names.append("compile")
    if flags.request_graph:
        names.append("request_graph")
    if flags.fp8:
        names.append("fp8")
    if flags.prune_amount > 0:
        names.append("prune")
    if flags.tensorrt:
        names.append("tensorrt")
    if flags.memory:
        names.append("memory")
    return names


class _StepClock:
    """Adds each step's seconds to `timings` (None: does nothing); waits for the device so that asynchronous
    copies and casts count towards the step that issued them."""

    def __init__(self, device: torch.device, timings: dict | None):
        self.device, self.timings = device, timings

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.timings is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timings[name] = round(self.timings.get(name, 0.0) + time.perf_counter() - t0, 3)


def prepare(module: Any, flags: OptimizationFlags, device: torch.device | str, kind: str, *,
            cache_dir: str | Path | None = None, weights_hash: str | None = None,
            on_status: Callable[[str], None] | None = None, timings: dict | None = None) -> tuple[Any, Report]:
    """Apply the module-level toggles once, when a model is loaded for a set of flags.

    module: kind="stylegan": the Generator (already on `device`, eval, no grad).
            kind="diffusion": the diffusers pipeline object (preferred: every component is
            handled and the pipeline is placed on `device`), or the bare UNet.
    cache_dir: root of the compile / TensorRT caches (default: Settings' cache_dir).
    weights_hash: the model file's sha256, for the TensorRT engine cache key.
    on_status: receives "compiling (first run for this size)" and similar messages.
    timings: when given, gets the seconds each toggle's step took (device work included), e.g.
            {"place": 0.31, "precision": 0.82, ...}: where a start's preparation goes.
    Returns (what to use from now on, report). With --strict a requested toggle that cannot
    run raises OptionalDependencyError instead of being skipped.
    """
    device = torch.device(device)
    target = resolve(module, kind)
    ctx = Context(device=device, cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
                  weights_hash=weights_hash, on_status=on_status)
    report: Report = {}
    clock = _StepClock(device, timings)

    # 1. placement (pipelines only; a bare module is where its owner put it). With CPU offload
    #    accelerate places the models itself, after the weight casts below.
    offload = target.is_pipeline and "cpu-offload" in flags.memory
    if target.is_pipeline and not (offload and _memory.offload_reason(target, ctx) is None):
        with clock("place"):
            target.pipe.to(device)
    # 2-3. pruning, precision
    if flags.prune_amount > 0:
        with clock("prune"):
            report["prune"] = _prune.apply(target, flags, ctx)
    with clock("precision"):
        report["precision"] = _precision.apply(target, flags, ctx)
    offload_report = _memory.apply_offload(target, ctx) if offload else None
    # 4. layout, kernels, memory savers
    if flags.channels_last:
        with clock("channels_last"):
            report["channels_last"] = _channels_last.apply(target, flags, ctx)
    if flags.attention != "sdpa":
        with clock("attention"):
            report["attention"] = _attention.apply(target, flags, ctx)
    if flags.memory:
        with clock("memory"):
            report["memory"] = _memory.apply(target, flags, ctx, offload=offload_report)
    if flags.fuse_qkv:
        with clock("fuse_qkv"):
            report["fuse_qkv"] = _fused_qkv.apply(target, flags, ctx)
    if flags.tiny_vae:          # 4c. after precision and channels_last, whose dtype and layout it copies
        with clock("tiny_vae"):
            report["tiny_vae"] = _tiny_vae.apply(target, flags, ctx)
    # 4d. the SDPA backend per kind of call (ATELIER_SDPA_ROUTE, an A/B switch), over whatever processors are set
    routes = _attention.sdpa_routes() if target.kind == "diffusion" and flags.attention == "sdpa" else {}
    if routes:
        report["attention"] = _attention.apply_routes(target, routes)
    # 5-7. FP8, TensorRT, compile
    if flags.fp8:
        with clock("fp8"):
            report["fp8"] = _fp8.apply(target, flags, ctx)
    exclude: dict[str, str] = {}
    if flags.tensorrt:
        with clock("tensorrt"):
            report["tensorrt"] = _tensorrt.apply(target, flags, ctx,
                                                 fp8_applied=bool(report.get("fp8", {}).get("applied")))
        if report["tensorrt"]["applied"]:
            comp = "generator" if target.kind == "stylegan" else "unet"
            exclude[comp] = "the TensorRT engine runs this part; torch.compile is not stacked on it"
    if flags.request_graph:     # before compile: it decides whether the modules get their own CUDA graphs
        with clock("request_graph"):
            report["request_graph"] = _request_graph.apply(target, flags, ctx)
    if flags.compile != "off":
        with clock("compile"):
            report["compile"] = _compile.apply(target, flags, ctx, exclude=exclude,
                                               request_graph=bool(report.get("request_graph", {}).get("applied")))
    report = ordered(report)
    _enforce_strict(flags, report)
    return target.root, report


def runtime(flags: OptimizationFlags, device: torch.device):
    """Context manager for one forward call under the requested precision."""
    return _precision.runtime(flags, torch.device(device))


def availability(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """name -> (can run here, why / what) for every toggle, for the UI's panel."""
    from optim.hardware import NO_GPU, capability, has_package, where

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = capability(dev) is not None
    out: dict[str, tuple[bool, str]] = {}
    if cuda:
        bf16 = torch.cuda.is_bf16_supported()
        out["precision"] = (True, "fp32, tf32, fp16" + (", bf16" if bf16 else "") + " (weights cast for diffusion, "
                            "AMP autocast for StyleGAN)")
    else:
        from core.device import cpu_bf16

        fast, what = cpu_bf16()
        out["precision"] = (True, (f"fp32, or bf16 autocast (this CPU has {what}); tf32 and fp16 need a GPU" if fast else
                                   f"fp32 is the fast one here: this CPU has {what}, so bf16 is emulated and many "
                                   "times slower; tf32 and fp16 need a GPU"))
    out["channels_last"] = (True, "NHWC convolutions" + ("" if cuda else " (gains are largest on GPUs)"))
    xr = _attention.unavailable_reason("xformers", dev)
    out["attention"] = (True, "sdpa, math" + ("" if xr else ", xformers") + (f"; xformers: {xr}" if xr else ""))
    cr = _compile.unavailable_reason(dev)
    out["compile"] = (cr is None, cr or ("default; reduce-overhead (CUDA graphs)" if cuda
                                         else "default (CUDA graphs need a GPU)"))
    fr = _fp8.unavailable_reason(dev)
    out["fp8"] = (fr is None, fr or f"e4m3 UNet linear layers >= {_fp8.min_features()} features, "
                                    f"{_fp8.scaling()} scaling (diffusion; cross-attention K/V and time embeddings "
                                    "stay bf16)")
    out["fuse_qkv"] = (True, "one Q/K/V (cross-attention: K/V) projection per UNet / VAE attention layer "
                             "(diffusion, SDPA attention)")
    rr = _request_graph.unavailable_reason(dev)
    out["tiny_vae"] = (True, "decode and live previews through TAESD / TAESDXL instead of the VAE decoder: "
                             "several times faster, softer fine detail (weights: ATELIER_TINY_VAE / "
                             "ATELIER_TINY_VAE_XL, default madebyollin/taesd / taesdxl)")
    out["request_graph"] = (rr is None, rr or "one CUDA graph per diffusion request (text encoder, all steps, VAE)")
    out["prune"] = (True, "l1-unstructured; structured (StyleGAN channels"
                    + (", UNet ResNet blocks via torch-pruning)" if has_package("torch_pruning")
                       else "; UNet needs torch-pruning)"))
    tr = _tensorrt.unavailable_reason(dev)
    out["tensorrt"] = (tr is None, tr or "ONNX export + engine build, cached per weights/GPU/profile")
    mem = "attention slicing, VAE tiling, VAE slicing (diffusion)"
    out["memory"] = (True, mem + ("; CPU offload" if cuda and has_package("accelerate")
                                  else f"; CPU offload needs a GPU ({where(dev) if torch.cuda.is_available() else NO_GPU})"))
    return out


def _enforce_strict(flags: OptimizationFlags, report: Report) -> None:
    if not flags.strict:
        return
    wanted = set(requested_toggles(flags))
    failed = {k: v.get("reason", "") for k, v in report.items() if k in wanted and not v.get("applied")}
    if failed:
        detail = "; ".join(f"{k}: {r}" for k, r in failed.items())
        raise OptionalDependencyError(f"--strict: requested optimizations could not run here ({detail})")


__all__ = ["prepare", "runtime", "requested_toggles", "availability", "default_cache_dir", "skipped"]
