"""Fused QKV projections: one matrix product for an attention layer's query, key and value instead of three.

diffusers' `fuse_qkv_projections()` (UNet2DConditionModel, AutoencoderKL) concatenates the weights:
- self-attention (UNet attn1, the VAE's mid-block attention): to_q, to_k, to_v -> one `to_qkv`
  Linear (in C, out 3C); one GEMM reads the activations once instead of three times;
- cross-attention (UNet attn2): to_k, to_v -> one `to_kv` (in = text width, out 2C); to_q stays.
and swaps every attention processor for FusedAttnProcessor2_0, which splits the product and calls
PyTorch SDPA. The numbers are the same products as before, up to summation order: in fp32 the
images agree to ~1e-6 (tests/test_optim_fused_qkv.py). The gain is fewer kernel launches and
larger GEMMs, so it can only show on a GPU (not measured on the H200 yet: `best-fqkv` in the bench).

When it is refused (the pipeline then runs unfused, and the report says why):
- a processor other than diffusers' default SDPA one is installed: FusedAttnProcessor2_0 is SDPA
  only, so fusing would silently undo `--attention math` / `xformers` or attention slicing;
- diffusers refuses models with added-KV processors (AttnAddedKVProcessor: UnCLIP / Kandinsky-style
  UNets), and the VAE only when it is an AutoencoderKL (a tiny autoencoder has no attention).
StyleGAN has no attention: not applicable.

diffusers keeps the separate to_q/to_k/to_v next to the fused layer (so `unfuse_qkv_projections`
can switch back). Here the ones the fused processor never calls are removed: they would double the
projection weights in memory and FP8 would quantize layers that never run. A fused pipeline is
therefore never unfused; the model manager caches it under its own flags.

Order (optim/registry.py): after precision (the fused weights are built in the final dtype) and after
the attention backend and memory savers (it checks their processors), before FP8 (which then sees
`to_qkv` / `to_kv`), TensorRT and compile (which trace the fused graph).
"""
from __future__ import annotations

import torch

from core.types import OptimizationFlags
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

FUSABLE_COMPONENTS = ("unet", "vae")
DEFAULT_PROCESSOR = "AttnProcessor2_0"
FUSED_PROCESSOR = "FusedAttnProcessor2_0"
STYLEGAN_REASON = "not applicable: StyleGAN has no attention layers, so there are no Q/K/V projections to fuse"


def _processors(module: torch.nn.Module) -> dict[str, int]:
    """Processor class name -> how many attention layers use it."""
    out: dict[str, int] = {}
    for p in (getattr(module, "attn_processors", None) or {}).values():
        out[type(p).__name__] = out.get(type(p).__name__, 0) + 1
    return out


def refusal(module: torch.nn.Module) -> str | None:
    """Why this component cannot be fused (None: it can)."""
    if not hasattr(module, "fuse_qkv_projections"):
        return f"{type(module).__name__} has no fuse_qkv_projections in diffusers"
    procs = _processors(module)
    if not procs:
        return "it has no attention layers"
    added = sorted(n for n in procs if "Added" in n)
    if added:
        return (f"diffusers refuses fused QKV for models with added-KV projections ({', '.join(added)}: extra "
                "K/V from the text embedding that its fused processor does not compute)")
    other = sorted(n for n in procs if n not in (DEFAULT_PROCESSOR, FUSED_PROCESSOR))
    if other:
        return (f"its attention runs through {', '.join(other)}; diffusers' fused processor is PyTorch SDPA only, "
                "so fusing would undo that choice (--attention math / xformers, or attention slicing). "
                "Use --attention sdpa without attention-slicing to fuse")
    return None


def _drop_unused(module: torch.nn.Module) -> int:
    """Remove the separate projections FusedAttnProcessor2_0 no longer calls; returns parameters freed."""
    from diffusers.models.attention_processor import Attention

    freed = 0
    for m in module.modules():
        if not isinstance(m, Attention) or not getattr(m, "fused_projections", False):
            continue
        names = ("to_k", "to_v") if m.is_cross_attention else ("to_q", "to_k", "to_v")
        for name in names:
            lin = getattr(m, name, None)
            if isinstance(lin, torch.nn.Module):
                freed += sum(p.numel() for p in lin.parameters())
                delattr(m, name)
    return freed


def fused_layers(module: torch.nn.Module) -> dict[str, int]:
    """How many fused self-attention (to_qkv) and cross-attention (to_kv) layers `module` has."""
    names = [n.rpartition(".")[2] for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    return {"to_qkv": names.count("to_qkv"), "to_kv": names.count("to_kv")}


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    if target.kind == "stylegan":
        return skipped(STYLEGAN_REASON)
    done: dict[str, dict] = {}
    refused: dict[str, str] = {}
    freed = 0
    for name in FUSABLE_COMPONENTS:
        m = target.get(name)
        if m is None:
            continue
        why = refusal(m)
        if why is None:
            try:
                m.fuse_qkv_projections()    # checks for added-KV processors before it changes anything
            except ValueError as exc:
                why = f"diffusers refused: {exc}"
        if why is not None:
            refused[name] = why
            continue
        freed += _drop_unused(m)
        done[name] = fused_layers(m)
    if not done:
        return skipped(f"fused QKV not applied, runs unfused ({_why(refused) or 'no UNet or VAE attention'})",
                       refused=refused)
    details: dict = {"components": done, "processor": FUSED_PROCESSOR, "params_freed": freed,
                     "note": "the separate to_q/to_k/to_v the fused processor no longer calls were removed"}
    if refused:
        details["refused"] = refused
    parts = ", ".join(f"{k} ({v['to_qkv']} to_qkv, {v['to_kv']} to_kv)" for k, v in done.items())
    rest = f"; not fused: {_why(refused)}" if refused else ""
    return applied(f"Q/K/V projections fused into one matrix product per attention layer: {parts}{rest}", **details)


def _why(refused: dict[str, str]) -> str:
    """'unet and vae: reason' when the components share a reason, else one clause each."""
    by_reason: dict[str, list[str]] = {}
    for comp, why in refused.items():
        by_reason.setdefault(why, []).append(comp)
    return "; ".join(f"{' and '.join(comps)}: {why}" for why, comps in by_reason.items())
