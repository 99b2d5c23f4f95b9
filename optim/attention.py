"""Attention backend: PyTorch SDPA (flash / memory-efficient kernels), xFormers, or plain math.

- sdpa: diffusers' AttnProcessor2_0 -> torch.nn.functional.scaled_dot_product_attention,
  which picks FlashAttention-2 or memory-efficient kernels on the GPU. The default.
- xformers: xFormers' memory-efficient attention (a CUDA package; often not installed,
  and on torch >= 2.0 rarely faster than SDPA).
- math: diffusers' AttnProcessor: baddbmm + softmax + bmm, the textbook reference. Slow and
  memory-hungry ([heads, tokens, tokens] scores), useful to check the others against.

Applies to the UNet and the VAE (its mid-block attention) via `set_attn_processor`, and to
CLIP text encoders via transformers' `set_attn_implementation` ("sdpa" / "eager").
StyleGAN has no attention.
"""
from __future__ import annotations

import torch

from core.types import OptimizationFlags
from optim.hardware import has_package, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

XFORMERS_MISSING = ("xformers is not installed (pip install xformers, matching your torch and CUDA); "
                    "kept PyTorch SDPA attention")


def unavailable_reason(mode: str, device: torch.device) -> str | None:
    if mode != "xformers":
        return None
    if not has_package("xformers"):
        return XFORMERS_MISSING
    if device.type != "cuda":
        return f"xformers attention needs a CUDA GPU; {where(device)}; kept PyTorch SDPA attention"
    return None


def _processor(mode: str):
    from diffusers.models import attention_processor as ap

    if mode == "math":
        return ap.AttnProcessor()
    if mode == "xformers":
        return ap.XFormersAttnProcessor()
    return ap.AttnProcessor2_0()


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    mode = flags.attention
    if target.kind == "stylegan":
        return skipped("StyleGAN has no attention layers; nothing to switch", mode=mode)
    reason = unavailable_reason(mode, ctx.device)
    if reason:
        return skipped(reason, mode="sdpa")
    done: dict[str, str] = {}
    for name, m in target.modules():
        if hasattr(m, "set_attn_processor") and getattr(m, "attn_processors", None):
            m.set_attn_processor(_processor(mode))
            done[name] = type(_processor(mode)).__name__
        elif name.startswith("text_encoder") and hasattr(m, "set_attn_implementation"):
            impl = "eager" if mode == "math" else "sdpa"   # transformers has no xformers path
            try:
                m.set_attn_implementation(impl)
                done[name] = impl
            except (ValueError, NotImplementedError) as exc:
                done[name] = f"unchanged ({exc})"
    if not done:
        return skipped("this model has no attention layers to switch", mode=mode)
    note = {"note": "text encoders stay on SDPA: transformers has no xformers path"} if mode == "xformers" else {}
    return applied({"sdpa": "PyTorch scaled_dot_product_attention (flash / memory-efficient kernels)",
                    "xformers": "xFormers memory-efficient attention",
                    "math": "plain matmul + softmax attention (the slow reference)"}[mode],
                   mode=mode, components=done, **note)
