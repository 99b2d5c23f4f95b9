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

import os

import torch

from core.errors import AtelierError
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


# -- SDPA backend per kind of call (an A/B switch for the H200: `python -m bench.sdpa` says which wins) -------------
# ATELIER_SDPA_ROUTE=cross=efficient,self=cudnn/flash,vae=efficient: the UNets' self-attention, their
# cross-attention (77 text keys) and the VAE's attention each run under `torch.nn.attention.sdpa_kernel` with the
# backends named (several: in that order of preference). Unset: PyTorch picks per call, as always.
ROUTE_ENV = "ATELIER_SDPA_ROUTE"
ROUTE_PARTS = ("self", "cross", "vae")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def sdpa_routes() -> dict[str, tuple[str, ...]]:
    """part -> backends from ATELIER_SDPA_ROUTE ({} when unset); a malformed value is an error naming the form."""
    raw = os.environ.get(ROUTE_ENV, "").strip()
    if not raw:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for item in raw.split(","):
        part, eq, backends = item.partition("=")
        part = part.strip().lower()
        names = tuple(b.strip().lower() for b in backends.split("/") if b.strip())
        if not eq or part not in ROUTE_PARTS or not names or any(n not in SDPA_BACKENDS for n in names):
            raise AtelierError(f"{ROUTE_ENV} is part=backend[/backend][,part=...] with parts {', '.join(ROUTE_PARTS)} "
                               f"and backends {', '.join(SDPA_BACKENDS)} (e.g. cross=efficient,vae=efficient); "
                               f"got {raw!r}")
        out[part] = names
    return out


def _backend_list(names: tuple[str, ...]) -> list:
    from torch.nn.attention import SDPBackend

    enum = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return [enum[n] for n in names]


class RoutedAttention:
    """A diffusers attention processor whose SDPA calls run under chosen backends: one list for self-attention,
    one for cross-attention (a call with encoder_hidden_states). Traceable by dynamo (sdpa_kernel is)."""

    def __init__(self, inner, self_backends: tuple[str, ...] | None, cross_backends: tuple[str, ...] | None):
        self.inner = inner
        self.self_backends, self.cross_backends = self_backends, cross_backends

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        # the named parameters are the ones diffusers' Attention passes (it drops keywords a processor's signature
        # lacks); temb only when given, since not every processor takes it
        from torch.nn.attention import sdpa_kernel

        kw = dict(kwargs, **({"temb": temb} if temb is not None else {}))
        names = self.cross_backends if encoder_hidden_states is not None else self.self_backends
        if not names:
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, **kw)
        with sdpa_kernel(_backend_list(names)):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, **kw)


def apply_routes(target: Target, routes: dict[str, tuple[str, ...]]) -> ToggleReport:
    """Wrap every attention processor of the UNet (self / cross) and the VAE (vae) with its route. Runs after
    fused QKV and the memory savers, which install processors of their own."""
    from diffusers.models.attention_processor import Attention

    counts: dict[str, int] = {}
    for name, module in target.modules():
        if name == "unet":
            self_b, cross_b = routes.get("self"), routes.get("cross")
        elif name == "vae":
            self_b, cross_b = routes.get("vae"), None
        else:
            continue
        if not (self_b or cross_b):
            continue
        for sub in module.modules():
            if isinstance(sub, Attention) and not isinstance(sub.processor, RoutedAttention):
                sub.processor = RoutedAttention(sub.processor, self_b, cross_b)
                counts[name] = counts.get(name, 0) + 1
    if not counts:
        return skipped(f"{ROUTE_ENV} is set but this model has no UNet/VAE attention layers", mode="sdpa")
    what = ", ".join(f"{p} -> {'/'.join(b)}" for p, b in routes.items())
    return applied(f"SDPA backends routed by call ({what}; {ROUTE_ENV})", mode="sdpa",
                   routes={p: list(b) for p, b in routes.items()}, layers=counts)
