"""The request-graph toggle: one CUDA graph per diffusion request instead of one per module call.

The recording and replay live with the pipeline (pipelines/request_graph.py: what a request graph mirrors
and which requests it serves). This toggle says whether it can run here and fixes what it implies for
compile: a module compiled with CUDA graphs (reduce-overhead) cannot be recorded inside another graph,
so with this toggle the compiled modules are built without their own graphs and the request graph replays
their kernels instead. Requests the recorded path does not serve (previews, image-to-image, ancestral
samplers, fp16 SDXL) then run compiled without CUDA graphs.
"""
from __future__ import annotations

import torch

from core.types import OptimizationFlags
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

STYLEGAN_REASON = ("not applicable: StyleGAN requests are one module call, which compile's reduce-overhead mode "
                   "already records as one CUDA graph")


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "CUDA graphs need a CUDA GPU; this machine has none, so requests run the normal path"
    return None


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    if target.kind == "stylegan":
        return skipped(STYLEGAN_REASON)
    reason = unavailable_reason(ctx.device)
    if reason:
        return skipped(reason)
    if ctx.offloaded:
        return skipped("not combined with model CPU offload (weights move between devices during a request)")
    if flags.tensorrt:
        return skipped("not combined with TensorRT engines here")
    note = ""
    if flags.compile == "reduce-overhead":
        note = "; the compiled modules run without their own CUDA graphs, inside the request's"
    return applied("one CUDA graph per request shape (text encoder, every UNet step with the scheduler, VAE, 8-bit "
                   "image), recorded on the first request of a shape and replayed with one launch" + note,
                   recorded=[])
