"""Models for the benchmark: built from configs with random weights (speed does not depend on
the weights' values, and the GPU machine has no network), or loaded from real weights.

Random weights are drawn on the target device from a fixed seed, so every configuration of a
run (and every process of an isolated run) gets bit-identical networks and the drift numbers
compare like with like. Diffusion networks built this way get their two output convolutions
rescaled once, from a seeded probe input, so the noise prediction has unit spread and the
decoded image fills [-1, 1] roughly as a trained model's would: PyTorch's default init
leaves both near zero, and a denoising loop over near-zero predictions says little about
drift.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
from pathlib import Path

import torch

from core.errors import InputError, ModelLoadError
from models import diffusion_catalogue as dcat
from models.stylegan import LoadedGenerator, build_generator, load_generator
from bench.specs import Workload

_COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


# -- StyleGAN ----------------------------------------------------------------------------------------

def stylegan_generator(workload: Workload, device: torch.device, seed: int, fp32_layers: bool = False,
                       weights: str | None = None) -> LoadedGenerator:
    """The workload's generator on `device` (eval, no grad). `fp32_layers` drops the checkpoint's fp16
    layers (NVlabs' num_fp16_res) so the network runs in fp32 throughout: the drift reference."""
    if weights:
        loaded = load_generator(weights, device="cpu")
        if fp32_layers and "num_fp16_res" in loaded.G.init_kwargs:
            G = build_generator(loaded.arch, {**loaded.G.init_kwargs, "num_fp16_res": 0})
            G.load_state_dict(loaded.G.state_dict())
            loaded.G = G
        loaded.G = loaded.G.to(device).eval().requires_grad_(False)
        return loaded
    kwargs = dict(workload.init_kwargs)
    if fp32_layers:
        kwargs["num_fp16_res"] = 0         # parameters are the same; only the run-time dtype changes
    with torch.device(device):
        torch.manual_seed(seed)
        G = build_generator(workload.arch, kwargs)
    # Some buffers (the FIR filters, SG3's Fourier transform) are made on the CPU explicitly: move
    # everything, as a user's `.to(device)` does, so the baseline row can call G directly.
    G = G.to(device).eval().requires_grad_(False)
    meta = {"z_dim": int(G.z_dim), "c_dim": int(G.c_dim), "w_dim": int(G.w_dim), "num_ws": int(G.num_ws),
            "resolution": int(G.img_resolution), "img_channels": int(G.img_channels), "random_weights_seed": seed}
    config = {"format": "atelier-stylegan/1", "arch": workload.arch, "init_kwargs": kwargs, "metadata": meta}
    return LoadedGenerator(G=G, arch=workload.arch, config=config, source=Path(f"random-{workload.name}"),
                           sha256=f"random{seed:058d}", metadata=meta)


# -- diffusion ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def quiet_diffusers():
    """diffusers warns on every cast of a freshly built model ("modules that should be kept in float32: []")
    and about fp16 on a CPU; in a benchmark those lines bury the progress output."""
    log = logging.getLogger("diffusers")
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the bundled config {path}: {exc}") from None


def diffusion_configs(workload: Workload) -> dict[str, dict]:
    """component -> config dict (the bundled JSON with the workload's overrides) + 'scheduler' and 'pipeline'."""
    folder = dcat.config_dir(workload.arch)
    out = {"pipeline": _read_json(folder / "model_index.json"),
           "scheduler": _read_json(folder / "scheduler" / "scheduler_config.json")}
    for comp in _COMPONENTS:
        path = folder / comp / "config.json"
        if path.is_file():
            out[comp] = {**_read_json(path), **workload.overrides.get(comp, {})}
    return out


@functools.lru_cache(maxsize=8)
def _tokenizer(folder: str):
    from pipelines.diffusion import clip_tokenizer   # tokenizers hold no per-call state: one per process

    return clip_tokenizer(Path(folder))


def _text_encoder(cfg: dict, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    fields = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "architectures"}
    config = CLIPTextConfig(**fields)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config)


@torch.no_grad()
def _rescale_output(conv: torch.nn.Module, output: torch.Tensor, target_std: float) -> float:
    """Scale a final convolution so its output has `target_std`; returns the factor."""
    std = float(output.float().std())
    if not (std > 0 and torch.isfinite(output).all()):
        raise ModelLoadError("the random-weight network produced a constant or non-finite probe output; "
                             "try another --weights-seed")
    factor = target_std / std
    conv.weight.mul_(factor)
    if conv.bias is not None:
        conv.bias.mul_(factor)
    return factor


@torch.no_grad()
def _calibrate(unet, vae, text_encoders: list, family: str, device: torch.device, seed: int) -> dict:
    g = torch.Generator("cpu").manual_seed(seed + 1)
    side = 16
    lat = torch.randn(1, unet.config.in_channels, side, side, generator=g).to(device)
    ctx_dim = unet.config.cross_attention_dim
    ctx = torch.randn(1, 77, ctx_dim, generator=g).to(device)
    kwargs = {}
    if family == "sdxl":
        te2_dim = text_encoders[-1].config.projection_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(1, te2_dim, generator=g).to(device),
                                       "time_ids": torch.tensor([[side * 8, side * 8, 0, 0, side * 8, side * 8]],
                                                                dtype=torch.float32, device=device)}
    t = torch.tensor([500], device=device)
    eps = unet(lat, t, encoder_hidden_states=ctx, return_dict=False, **kwargs)[0]
    f_unet = _rescale_output(unet.conv_out, eps, 1.0)
    img = vae.decode(torch.randn(1, vae.config.latent_channels, side, side, generator=g).to(device) * 4,
                     return_dict=False)[0]
    f_vae = _rescale_output(vae.decoder.conv_out, img, 0.5)
    return {"unet_conv_out": f_unet, "vae_conv_out": f_vae}


def random_diffusion_pipeline(workload: Workload, device: torch.device, seed: int):
    """A diffusers StableDiffusion(XL)Pipeline with random fp32 weights on `device`, built from the bundled
    configs (with the workload's overrides) and the bundled CLIP tokenizer."""
    import diffusers

    from pipelines.diffusion import make_scheduler

    cfg = diffusion_configs(workload)
    family = dcat.ARCH_INFO[workload.arch].family
    folder = dcat.config_dir(workload.arch)
    with torch.device(device), quiet_diffusers():
        torch.manual_seed(seed)
        unet = diffusers.UNet2DConditionModel.from_config(cfg["unet"])
        vae = diffusers.AutoencoderKL.from_config(cfg["vae"])
        te = _text_encoder(cfg["text_encoder"], with_projection=False)
        te2 = _text_encoder(cfg["text_encoder_2"], with_projection=True) if family == "sdxl" else None
    modules = [m for m in (unet, vae, te, te2) if m is not None]
    for m in modules:
        m.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    calib = _calibrate(unet, vae, [t for t in (te, te2) if t is not None], family, device, seed)
    scheduler = make_scheduler("default", cfg["scheduler"])
    tok = _tokenizer(str(folder / "tokenizer"))
    if family == "sdxl":
        tok2 = _tokenizer(str(folder / "tokenizer_2"))
        pipe = diffusers.StableDiffusionXLPipeline(
            vae=vae, text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2, unet=unet,
            scheduler=scheduler, force_zeros_for_empty_prompt=bool(cfg["pipeline"].get("force_zeros_for_empty_prompt", True)),
            add_watermarker=False)
    else:
        pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=scheduler,
                                                 safety_checker=None, feature_extractor=None,
                                                 requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe._atelier_calibration = calib           # recorded in the benchmark's workload row
    return pipe


def loaded_diffusion(workload: Workload, device: torch.device, seed: int, weights: str | None = None,
                     flags=None):
    """A pipelines.diffusion.LoadedDiffusion for the product path, its weights in the dtype the studio's
    loader picks for `flags` (pipelines.diffusion.weights_dtype): random weights, or `weights`."""
    from pipelines.diffusion import LoadedDiffusion, load_diffusion, weights_dtype

    dtype = weights_dtype(flags, device)
    if weights:
        loaded = load_diffusion(weights, device=device, dtype=dtype)
        if loaded.arch != workload.arch and not workload.tiny:
            raise InputError(f"{weights} is a {loaded.arch} model but the workload {workload.name} is {workload.arch}; "
                             f"pick the matching --workload")
        return loaded
    pipe = random_diffusion_pipeline(workload, device, seed)
    # random UNet/VAE weights: the tiny-VAE toggle gets the published architecture with random weights too (its
    # speed is what a row measures); an ATELIER_TINY_VAE(_XL) set in the environment still wins
    from optim.tiny_vae import RANDOM, SOURCE_ATTR
    setattr(pipe, SOURCE_ATTR, RANDOM)
    if dtype != torch.float32:
        with quiet_diffusers():
            pipe.to(dtype=dtype)
    size = sum(p.numel() * p.element_size() for m in pipe.components.values() if isinstance(m, torch.nn.Module)
               for p in m.parameters())
    return LoadedDiffusion(pipe=pipe, arch=workload.arch, source="random", ref=f"random-{workload.name}", path=None,
                           hash=f"rnd{seed:07d}"[:10], size_bytes=size,
                           notes=[f"random weights (seed {seed}) built from assets/diffusion_configs/{workload.arch}"])


def stock_diffusion_pipeline(workload: Workload, device: torch.device, seed: int, weights: str | None = None):
    """The baseline: a plain diffusers pipeline in fp16 (SDPA is diffusers' default attention; its noise is drawn
    in fp16, as diffusers draws it)."""
    pipe = loaded_diffusion(workload, device, seed, weights).pipe
    with quiet_diffusers():
        pipe.to(device, torch.float16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parameter_counts(pipe_or_module) -> dict[str, int]:
    if isinstance(pipe_or_module, torch.nn.Module):
        return {"generator": sum(p.numel() for p in pipe_or_module.parameters())}
    return {name: sum(p.numel() for p in m.parameters()) for name, m in pipe_or_module.components.items()
            if isinstance(m, torch.nn.Module)}


def save_random_diffusion(workload: Workload, out: Path, device: torch.device, seed: int = 0,
                          dtype: torch.dtype = torch.float16) -> dict:
    """Write the workload's random-weight pipeline (the one every bench row of `seed` builds) as a diffusers
    folder of safetensors, so that `bench --weights FOLDER` loads it from disk the way a real model loads:
    the time to a first image on a second start then includes reading weights, not drawing them."""
    import time

    if workload.kind != "diffusion":
        raise InputError(f"save-random writes diffusion pipelines; {workload.name} is a {workload.kind} workload")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} exists and is not empty; give a new folder")
    t0 = time.perf_counter()
    pipe = random_diffusion_pipeline(workload, device, seed)
    with quiet_diffusers():
        pipe.to(dtype=dtype)
        out.mkdir(parents=True, exist_ok=True)
        pipe.save_pretrained(str(out), safe_serialization=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"folder": str(out), "workload": workload.name, "seed": seed, "dtype": str(dtype).replace("torch.", ""),
            "bytes": size, "seconds": round(time.perf_counter() - t0, 2)}
