"""Tiny-autoencoder decode: TAESD (SD 1.x/2.x) or TAESDXL (SDXL) in place of the VAE's decoder.

The VAE decoder is the largest single piece of a one-step SD-Turbo request on the H200 (7 of its 12.5 ms of
device time, docs/perf-notes.md 2026-12-03) and of every live preview. TAESD (madebyollin; diffusers'
`AutoencoderTiny`) decodes the same latents with ~1.2 M parameters instead of ~50 M: the picture is close
but softer in fine detail (hair, text, small faces), which is why this is an opt-in toggle and the Compare
tab reports its drift against the full decoder.

What it changes:
- the final decode of txt2img and img2img (img2img still *encodes* with the full VAE: the tiny encoder is
  used by nobody who cares about the starting image);
- live previews (`preview_every`): decoded with the tiny decoder instead of the 4x3 linear latent-to-RGB map,
  as A1111's "TAESD" live-preview mode does.

Weights. They cannot be made here (distilling needs the model's own VAE), so they come from
- `ATELIER_TINY_VAE` (SD 1.x/2.x) / `ATELIER_TINY_VAE_XL` (SDXL): a diffusers folder (config.json +
  diffusion_pytorch_model.safetensors) or a Hugging Face id; default `madebyollin/taesd` / `madebyollin/taesdxl`.
  Hub ids are looked up in the local Hugging Face cache first and downloaded only when it lacks them;
- `random`: the published architecture with random weights. The benchmark uses it (its models are random
  weights from the real configs too): the speed is real, the picture is noise.
The SD 1.x tiny decoder is trained on SD 1.x/2.x latents and TAESDXL on SDXL's; they are not interchangeable,
so each family has its own setting.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from core.types import OptimizationFlags
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target, count_params

ATTR = "atelier_tiny_vae"          # where the loaded decoder lives on the diffusers pipeline object
SOURCE_ATTR = "atelier_tiny_vae_source"   # a pipeline's own default source (the benchmark's random pipelines)
ENV = {"sd": "ATELIER_TINY_VAE", "sdxl": "ATELIER_TINY_VAE_XL"}
DEFAULT = {"sd": "madebyollin/taesd", "sdxl": "madebyollin/taesdxl"}
RANDOM = "random"
STYLEGAN_REASON = "the tiny autoencoder replaces a diffusion model's VAE decoder; StyleGAN has none"


class TinyVAEUnavailable(RuntimeError):
    """The tiny decoder's weights could not be loaded; the message says where they were looked for."""


def family_of(target: Target) -> str:
    """'sdxl' for a pipeline with SDXL's second text encoder or its time-ids UNet, else 'sd'."""
    unet = target.get("unet")
    if target.get("text_encoder_2") is not None:
        return "sdxl"
    if unet is not None and getattr(getattr(unet, "config", None), "addition_embed_type", None) == "text_time":
        return "sdxl"
    return "sd"


def source(family: str, pipe: Any = None) -> str:
    """The folder, hub id or 'random' the family's tiny decoder comes from: the environment, else the pipeline's
    own default (random-weight benchmark pipelines say 'random'), else the published weights."""
    return (os.environ.get(ENV[family], "").strip() or getattr(pipe, SOURCE_ATTR, None) or DEFAULT[family])


def load(src: str, dtype: torch.dtype, device: torch.device) -> Any:
    """An `AutoencoderTiny` from a folder, a hub id (local cache first) or 'random', in `dtype` on `device`."""
    from diffusers import AutoencoderTiny

    if src == RANDOM:
        torch.manual_seed(0)                 # the same random decoder every time: benchmark rows compare
        model = AutoencoderTiny()
    else:
        path = Path(src).expanduser()
        looks_local = path.is_absolute() or src.startswith((".", "~")) or path.exists()
        if looks_local:
            if not (path / "config.json").is_file():
                raise TinyVAEUnavailable(f"{src} is not a diffusers AutoencoderTiny folder (no config.json there)")
            model = _from_pretrained(AutoencoderTiny, str(path), local_files_only=True)
        else:
            try:                             # the Hugging Face cache first: no network on a warm machine
                model = _from_pretrained(AutoencoderTiny, src, local_files_only=True)
            except TinyVAEUnavailable:
                try:
                    model = _from_pretrained(AutoencoderTiny, src, local_files_only=False)
                except TinyVAEUnavailable as exc:
                    raise TinyVAEUnavailable(
                        f"{src} is not in the local Hugging Face cache and could not be downloaded ({exc}). "
                        f"Download it once where the hub is reachable (`hf download {src}`), or point "
                        f"ATELIER_TINY_VAE / ATELIER_TINY_VAE_XL at a folder with its config.json and weights"
                    ) from None
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _from_pretrained(cls, src: str, local_files_only: bool):
    try:
        return cls.from_pretrained(src, local_files_only=local_files_only)
    except Exception as exc:                 # OSError, EnvironmentError, HF hub errors, bad configs
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TinyVAEUnavailable(first[:300]) from None


def available_locally(src: str) -> bool:
    """Whether `src` can be loaded without the network: 'random', a folder with a config.json, or a hub id whose
    config is in the local Hugging Face cache. (What previews in 'auto' mode use TAESD for: no download there.)"""
    if src == RANDOM:
        return True
    path = Path(src).expanduser()
    if path.is_absolute() or src.startswith((".", "~")) or path.exists():
        return (path / "config.json").is_file()
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(src, "config.json")
    except Exception:                        # a malformed id, an unreadable cache: not available
        return False
    return isinstance(hit, str)


def mismatch(tiny: Any, vae: Any, src: str) -> str | None:
    """Why `tiny` cannot decode `vae`'s latents (channels or upsampling differ), or None."""
    latent = int(getattr(vae.config, "latent_channels", 4))
    got = int(getattr(tiny.config, "latent_channels", 4))
    if got != latent:
        return f"{src} decodes {got}-channel latents; this model's are {latent}-channel"
    up = int(tiny.config.upsampling_scaling_factor) ** (len(tiny.config.decoder_block_out_channels) - 1)
    want = 2 ** (len(vae.config.block_out_channels) - 1)
    if up != want:
        return f"{src} upsamples latents {up}x; this model's VAE {want}x"
    return None


def get(pipe: Any) -> Any | None:
    """The tiny decoder attached to a pipeline by `apply`, or None."""
    return getattr(pipe, ATTR, None)


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    if target.kind == "stylegan":
        return skipped(STYLEGAN_REASON)
    if not target.is_pipeline:
        return skipped("the tiny autoencoder needs the diffusers pipeline object (it replaces the pipeline's "
                       "VAE decode); a bare UNet has no decoder")
    vae = target.get("vae")
    if vae is None:
        return skipped("this pipeline has no VAE to replace")
    family = family_of(target)
    src = source(family, target.pipe)
    latent = int(getattr(vae.config, "latent_channels", 4))
    if latent != 4:
        return skipped(f"the tiny decoders are trained on 4-channel SD latents; this model's VAE has {latent}")
    dtype = next(vae.parameters()).dtype     # the VAE's (after the precision toggle): TAESDXL is fp16-safe
    try:
        tiny = load(src, dtype, ctx.device)  # ~5 MB: it stays on the device even under CPU offload
    except TinyVAEUnavailable as exc:
        return skipped(f"tiny autoencoder not loaded, the full VAE decodes: {exc}", source=src, family=family)
    why = mismatch(tiny, vae, src)
    if why:
        return skipped(why, source=src)
    if flags.channels_last:
        tiny.to(memory_format=torch.channels_last)
    setattr(target.pipe, ATTR, tiny)
    n_tiny, n_full = count_params(tiny.decoder), count_params(vae.decoder) + count_params(
        getattr(vae, "post_quant_conv", torch.nn.Identity()))
    what = "random weights: speed only, the picture is noise" if src == RANDOM else src
    return applied(f"the tiny autoencoder decodes ({what}; {n_tiny / 1e6:.1f} M parameters against the VAE "
                   f"decoder's {n_full / 1e6:.1f} M); live previews use it too",
                   source=src, family=family, params=n_tiny, vae_decoder_params=n_full,
                   dtype=str(dtype).replace("torch.", ""))


def decode(tiny: Any, latents: torch.Tensor) -> torch.Tensor:
    """UNet-space latents -> images in [-1, 1], as the VAE's decode gives them. TAESD takes the latents the UNet
    works in (its scaling factor is 1.0; the SD pipelines divide by it)."""
    lat = latents.to(next(tiny.parameters()).dtype) / float(tiny.config.scaling_factor)
    return tiny.decode(lat, return_dict=False)[0]
