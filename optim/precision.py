"""Precision: fp32 reference, TF32 matmuls, fp16/bf16 by AMP autocast or by casting the weights.

Which one, and why:
- StyleGAN: AMP autocast (weights stay fp32). The modulated convolution builds per-sample
  weights and demodulation sums that need fp32; autocast drops only the convolutions
  themselves to fp16/bf16. NVlabs' own fp16 blocks (`num_fp16_res`) are switched off so the
  precision comes from this toggle alone (fp32 means fp32 everywhere).
- Diffusion, given the pipeline object, on a GPU: weights cast to fp16/bf16 ("weights-…").
  On the H200 that is faster than autocast (SD1.5 step: bf16 weights 27.9 ms vs AMP 31.4 ms,
  shared/GPU.md) and halves the memory. Given only the UNet, autocast: casting one component
  alone would feed it fp32 text embeddings.
- On the CPU: bf16 autocast (oneDNN has bf16 kernels); fp16 is skipped (no fast CPU kernels).
"""
from __future__ import annotations

import contextlib

import torch

from core.types import OptimizationFlags
from optim.hardware import capability, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

_AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}


def mode_for(flags: OptimizationFlags, device: torch.device, kind: str, is_pipeline: bool) -> tuple[str, str | None]:
    """(mode, skip reason). Modes: fp32 | tf32 | autocast-fp16 | autocast-bf16 | weights-fp16 | weights-bf16."""
    p = flags.precision
    if p == "fp32":
        return "fp32", None
    if p == "tf32":
        cap = capability(device)
        if cap is None or cap < (8, 0):
            return "fp32", f"TF32 needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere+); {where(device)}; ran in fp32"
        return "tf32", None
    if device.type == "cpu" and p == "fp16":
        from core.device import cpu_bf16

        fast, what = cpu_bf16()
        return "fp32", ("fp16 is not useful on the CPU (no fast fp16 kernels); ran in fp32"
                        + (f" — use bf16 on the CPU (it has {what})" if fast else
                           f" — fp32 is the fastest here (this CPU has {what}, so bf16 would be slower still)"))
    if device.type == "cuda" and p == "bf16" and not torch.cuda.is_bf16_supported():
        return "fp32", f"bf16 needs an Ampere or newer GPU; {where(device)}; ran in fp32"
    if kind == "diffusion" and is_pipeline and device.type == "cuda":
        return f"weights-{p}", None
    return f"autocast-{p}", None


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    device = ctx.device
    mode, reason = mode_for(flags, device, target.kind, target.is_pipeline)
    details: dict = {"mode": mode}
    if target.kind == "stylegan" and device.type == "cuda":
        n = _disable_native_fp16(target.root)
        if n:
            details["native_fp16_blocks"] = f"{n} NVlabs fp16 block(s) switched off; precision comes from this toggle"
    if reason is not None:
        return skipped(reason, **details)
    if mode == "fp32":
        return applied("full precision reference", **details)
    if mode == "tf32":
        return applied("TF32 tensor-core matmuls and convolutions (fp32 storage, 10-bit mantissa products)", **details)
    if mode.startswith("weights-"):
        dtype = _AMP[flags.precision]
        comps = {}
        for name, m in target.modules():
            m.to(dtype=dtype)
            comps[name] = str(dtype).replace("torch.", "")
        return applied(f"weights cast to {flags.precision} (faster than autocast on the GPU and half the memory)",
                       components=comps, **details)
    return applied(f"AMP autocast in {flags.precision}: convolutions and matmuls run in {flags.precision}, "
                   "weights and sensitive sums stay fp32", **details)


def _disable_native_fp16(G: torch.nn.Module) -> int:
    n = 0
    for m in G.modules():
        # StyleGAN2 synthesis blocks carry NVlabs' per-block fp16 switch (`use_fp16` + `num_conv`).
        if hasattr(m, "num_conv") and getattr(m, "use_fp16", False):
            m.use_fp16 = False
            n += 1
    return n


def runtime(flags: OptimizationFlags, device: torch.device):
    """Context for one forward call: autocast for fp16/bf16, TF32 switches for tf32."""
    p = flags.precision
    stack = contextlib.ExitStack()
    if device.type == "cuda" and p == "tf32":
        stack.enter_context(tf32_switches(matmul=True, cudnn=True))
    elif p in _AMP and not (device.type == "cpu" and p == "fp16"):
        if not (device.type == "cuda" and p == "bf16" and not torch.cuda.is_bf16_supported()):
            # This is the AMP where weights stay fp32. Where they were cast ("weights-" modes) it adds nothing and
            # would put a model's deliberate fp32 parts back in half precision (an upcast VAE): pipelines skip it.
            stack.enter_context(torch.autocast(device_type=device.type, dtype=_AMP[p]))
    return stack


@contextlib.contextmanager
def tf32_switches(matmul: bool, cudnn: bool):
    """torch's two TF32 switches set for the block and restored after it."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = cudnn
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
