"""channels_last: NHWC memory format, so cuDNN picks its tensor-core NHWC convolution kernels.

Diffusion: the UNet's and VAE's weights go channels_last; a convolution whose weight is
channels_last returns channels_last activations, so the format propagates by itself.
The text encoder has no convolutions and is left alone. On a GPU this happens only together
with torch.compile: eager CUDA group_norm converts NHWC inputs back to NCHW (two copies per
norm), which costs more than the NHWC convolutions gain.

StyleGAN: the modulated convolutions build their weights per sample, so converting the
parameters is not enough; a pre-hook on each layer turns its input activations NHWC. With
batch > 1 the fused modulated conv folds the batch into channel groups, a reshape PyTorch
can only do by copying back to NCHW: expect the gain mainly at batch 1.
"""
from __future__ import annotations

import torch

from core.types import OptimizationFlags
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target


# Measured on the H200 (shared/gpu-runs/2026-12-01): SD1.5 bf16 + channels_last 2001 ms against fp16 1411 ms.
EAGER_CUDA_REASON = ("channels_last pays only with torch.compile for diffusion: eagerly, CUDA's group_norm makes its "
                     "input contiguous, so each of the UNet's 61 GroupNorms (and the VAE's 30) would copy NHWC to "
                     "NCHW and back; compiled, inductor fuses the norms in NHWC. Turn on compile to use it")


def _to_nhwc(module, args):
    if args and isinstance(args[0], torch.Tensor) and args[0].ndim == 4:
        return (args[0].contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
    return None


def _conv_like(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.ndim == 4


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    if target.kind == "stylegan":
        G = target.root
        G.to(memory_format=torch.channels_last)
        hooked = 0
        for m in G.synthesis.modules():
            if _conv_like(m) and not getattr(m, "_atelier_nhwc", False):
                m.register_forward_pre_hook(_to_nhwc)
                m._atelier_nhwc = True
                hooked += 1
        return applied("NHWC activations into every convolution layer (modulated convs included)",
                       layers=hooked, note="with batch > 1 StyleGAN's fused modulated conv copies back to NCHW; "
                                           "the gain is mainly at batch 1")
    if ctx.device.type == "cuda" and flags.compile == "off":
        return skipped(EAGER_CUDA_REASON, needs="compile")
    comps = []
    for name, m in target.modules():
        if name.startswith("text_encoder"):
            continue
        if any(_conv_like(x) for x in m.modules()):
            m.to(memory_format=torch.channels_last)
            comps.append(name)
    if not comps:
        return skipped("no convolution layers to convert")
    return applied("weights in channels_last; activations follow through the convolutions",
                   components=comps, note="text encoders have no convolutions and are unchanged")
