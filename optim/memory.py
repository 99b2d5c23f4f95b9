"""Memory savers for small GPUs (diffusion): attention slicing, VAE tiling / slicing, model CPU offload.

- attention-slicing: attention computed a few heads at a time; lower peak memory, a little
  slower. With SDPA kernels it rarely helps (they never build the full score matrix).
- vae-tiling: the VAE decodes overlapping tiles with blended seams; large images fit in
  little memory. The seams make it not bit-identical to a full decode.
- vae-slicing: a batch of images is decoded one image at a time.
- cpu-offload: accelerate moves each whole model (text encoder, UNet, VAE) to the GPU only
  while it runs; peak memory is the largest model instead of all of them, at the cost of
  host-to-device copies every image. Incompatible with compile, FP8 and TensorRT here.
"""
from __future__ import annotations

from core.types import OptimizationFlags
from optim.hardware import has_package, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

SAVERS = ("attention-slicing", "vae-tiling", "vae-slicing", "cpu-offload")


def offload_reason(target: Target, ctx: Context) -> str | None:
    """Why model CPU offload cannot run here, or None."""
    if ctx.device.type != "cuda":
        return f"model CPU offload moves models to a CUDA GPU only while they run; {where(ctx.device)}"
    if not target.is_pipeline:
        return "model CPU offload needs the whole diffusers pipeline passed to optim.prepare, not one module"
    if not has_package("accelerate"):
        return "model CPU offload needs the accelerate package (pip install accelerate)"
    return None


def apply_offload(target: Target, ctx: Context) -> ToggleReport:
    reason = offload_reason(target, ctx)
    if reason:
        return skipped(reason)
    target.pipe.enable_model_cpu_offload(device=ctx.device)
    ctx.offloaded = True
    return applied("each model is on the GPU only while it runs")


def apply(target: Target, flags: OptimizationFlags, ctx: Context, offload: ToggleReport | None = None) -> ToggleReport:
    """The non-offload savers; `offload` is cpu-offload's report when it was applied earlier (it must
    come before the pipeline is placed on the device)."""
    wanted = list(dict.fromkeys(flags.memory))
    if target.kind == "stylegan":
        return skipped("memory savers are for diffusion pipelines; a StyleGAN generator stays whole on the "
                       "device — lower the batch size to save memory", savers={})
    unknown = [s for s in wanted if s not in SAVERS]
    savers: dict[str, ToggleReport] = {s: skipped(f"unknown memory saver {s!r}; use one of {', '.join(SAVERS)}")
                                       for s in unknown}
    unet, vae = target.get("unet"), target.get("vae")
    for s in wanted:
        if s == "attention-slicing":
            if target.is_pipeline and hasattr(target.pipe, "enable_attention_slicing"):
                target.pipe.enable_attention_slicing("auto")
                savers[s] = applied("attention in slices of half the heads")
            elif hasattr(unet, "set_attention_slice"):
                unet.set_attention_slice("auto")
                savers[s] = applied("attention in slices of half the heads (UNet)")
            else:
                savers[s] = skipped("this model has no sliceable attention")
        elif s in ("vae-tiling", "vae-slicing"):
            method = "enable_tiling" if s == "vae-tiling" else "enable_slicing"
            if vae is None:
                savers[s] = skipped("the VAE is not part of what was passed to optim.prepare (pass the pipeline)")
            else:
                try:
                    # diffusers' AutoencoderMixin gives every VAE the method; one without tiling/slicing
                    # (e.g. AsymmetricAutoencoderKL) raises NotImplementedError from it.
                    getattr(vae, method)()
                    savers[s] = applied("VAE decodes overlapping tiles" if s == "vae-tiling"
                                        else "VAE decodes one image at a time")
                except (AttributeError, NotImplementedError):
                    savers[s] = skipped(f"this VAE ({type(vae).__name__}) does not support {s}")
        elif s == "cpu-offload":
            savers[s] = offload if offload is not None else apply_offload(target, ctx)
    bad = {k: v["reason"] for k, v in savers.items() if not v["applied"]}
    ok = [k for k, v in savers.items() if v["applied"]]
    if bad:
        return skipped("; ".join(f"{k}: {r}" for k, r in bad.items()), savers=savers, mode=",".join(ok) or "none")
    return applied("memory savers on: " + ", ".join(ok), savers=savers, mode=",".join(ok))
