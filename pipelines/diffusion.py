"""Diffusion backend: Stable Diffusion 1.x / 2.x / XL and their Turbo versions, on diffusers.

Loading takes what artists have: a Hugging Face id, a diffusers folder, or one A1111/Civitai
`.safetensors` file (converted with diffusers' single-file converters and the configs bundled
in assets/diffusion_configs, so nothing is downloaded). Pickled `.ckpt` files are read with
`torch.load(weights_only=True)` only.

`DiffusionPipeline.generate` reads top to bottom like diffusers' own `__call__`:
check inputs -> encode prompt -> prepare latents and denoise -> decode (with a NaN guard) ->
postprocess. The denoising loop is diffusers' own (called with `output_type="latent"` and a
step-end callback), so with default settings on the CPU an image equals what diffusers gives
for `generator=torch.Generator("cpu").manual_seed(seed)` and the same arguments, bit for bit.
Seeds are always drawn on the CPU, and in float32 then cast (pipelines/diffusion_noise.py, as A1111 does), so a
seed means the same image on every device and at every precision.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import pickle
import re
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

import optim
from core.device import peak_memory_bytes, reset_peak_memory
from core.errors import AtelierError, Cancelled, InputError, ModelLoadError, OutOfMemory, ResourceError, UnsafeModelError
from core.types import SEED_MAX, DiffusionParams, GenerationRequest, GenerationResult, Job, OptimizationFlags
from models import diffusion_catalogue as dcat
from optim import tiny_vae
from pipelines import overlap, switches
from pipelines import request_graph as rgraph
from pipelines.base import module_bytes
from pipelines.diffusion_noise import _diffusers_randn, fp32_noise

ARCHS = dcat.ARCHS
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


# ==================================================================================================
# Loading
# ==================================================================================================

@dataclass
class LoadedDiffusion:
    pipe: Any                     # diffusers StableDiffusionPipeline or StableDiffusionXLPipeline
    arch: str                     # one of ARCHS
    source: str                   # 'hub' | 'hf-cache' | 'folder' | 'single-file'
    ref: str                      # what the request named (id or path)
    path: str | None              # where the weights are on disk
    hash: str                     # 10 hex digits: file sha256 (A1111's "Model hash"), hub commit, or folder fingerprint
    size_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def family(self) -> str:
        return dcat.ARCH_INFO[self.arch].family

    @property
    def sha256(self) -> str:      # same name as the StyleGAN loader's, so shared code can read either
        return self.hash


def load_diffusion(model_ref: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                   cache_dir: str | Path | None = None, *, flags: OptimizationFlags | None = None,
                   hf_cache_dir: str | Path | None = None, single_file_config: str | Path | None = None,
                   check_weights: bool = True) -> LoadedDiffusion:
    """Load a hub id, a diffusers folder or a single-file checkpoint.

    `dtype` of the weights; None = from `flags.precision` (fp16 weights on a GPU, bf16 anywhere, else fp32).
    `cache_dir` is Atelier's own cache (file hashes are remembered there). Hub ids live in the standard
    Hugging Face cache, or in `hf_cache_dir` when given. `single_file_config` replaces the bundled config
    folder for a single file (a diffusers-layout folder of JSON configs). Weights are checked for NaN/Inf
    unless `check_weights` is False. With `device` the pipeline is moved there; otherwise it stays on the CPU.
    """
    ref = str(model_ref or "").strip()
    if not ref:
        raise ModelLoadError("no diffusion model given: name a Hugging Face id (e.g. stabilityai/sd-turbo), "
                             "a diffusers folder, or a .safetensors checkpoint")
    dev = torch.device(device) if device is not None else None
    if dtype is None:
        dtype = weights_dtype(flags, dev)
    hash_cache = Path(cache_dir) / "model_hashes.json" if cache_dir else None
    p = Path(ref).expanduser()
    if p.is_dir():
        loaded = _load_folder(p, dtype, ref, source="folder")
    elif p.is_file():
        loaded = _load_single_file(p, dtype, ref, single_file_config, hash_cache)
    elif _looks_like_path(ref):
        raise ModelLoadError(f"no file or folder at {p}")
    elif HUB_ID.match(ref):
        loaded = _load_hub(ref, dtype, hf_cache_dir)
    else:
        raise ModelLoadError(f"{ref!r} is neither an existing file/folder nor a Hugging Face id (owner/name)")
    if dev is not None:
        loaded.pipe.to(dev)
    if check_weights:     # after the move: on a GPU the sums over 7 GB of weights take milliseconds
        check_finite_weights(_named_weights(loaded.pipe), Path(loaded.path or ref).name)
    return loaded


def weights_dtype(flags: OptimizationFlags | None, device: torch.device | None) -> torch.dtype:
    """Weights in half precision halve the memory of a diffusion model; fp16 kernels only pay off on a GPU."""
    precision = flags.precision if flags is not None else "fp32"
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16" and device is not None and device.type == "cuda":
        return torch.float16
    return torch.float32


def _looks_like_path(ref: str) -> bool:
    return ref.startswith((".", "/", "~", "\\")) or ref.lower().endswith(dcat.SINGLE_FILE_SUFFIXES) or \
        ref.count("/") > 1 or "\\" in ref or (len(ref) > 1 and ref[1] == ":")


def _diffusers():
    from pipelines import preload

    # every path that imports diffusers comes through here: never alongside the studio's background import
    preload.wait()
    if not _STACK_IMPORTED:
        _import_stack_once()
    import diffusers            # imported on first use: it is slow to import and the StyleGAN path never needs it

    return diffusers


_STACK_IMPORTED = False


def _import_stack_once() -> None:
    """The first import of diffusers and its pipeline classes, inside lean_imports: diffusers' names are lazy, and
    transformers' model modules (with the optional imports lean_imports leaves out) load when a pipeline class is
    first touched. Later calls import nothing and patch nothing."""
    global _STACK_IMPORTED
    from pipelines import preload

    with preload.lean_imports():
        preload.import_diffusers_classes()
    _STACK_IMPORTED = True


_FIXED_DEVICE_CLASSES: dict[type, type] = {}


def _fixed_device_class(cls: type) -> type:
    """`cls` whose `_execution_device` is the device the studio placed it on, when one is set.

    diffusers' property looks for offload hooks on every submodule of every component (twice a generation),
    which on the H200's host took longer than SD-Turbo's UNet call. Same class name, so configs read alike."""
    sub = _FIXED_DEVICE_CLASSES.get(cls)
    if sub is None:
        base_prop = cls._execution_device

        def _execution_device(self):
            dev = self.__dict__.get("_atelier_device")
            return dev if dev is not None else base_prop.fget(self)

        sub = type(cls.__name__, (cls,), {"_execution_device": property(_execution_device),
                                          "__module__": cls.__module__, "__doc__": cls.__doc__})
        _FIXED_DEVICE_CLASSES[cls] = sub
    return sub


def _pipeline_class(family: str, task: str = "txt2img"):
    d = _diffusers()
    return {("sd", "txt2img"): d.StableDiffusionPipeline, ("sd", "img2img"): d.StableDiffusionImg2ImgPipeline,
            ("sdxl", "txt2img"): d.StableDiffusionXLPipeline,
            ("sdxl", "img2img"): d.StableDiffusionXLImg2ImgPipeline}[(family, task)]


def _load_folder(folder: Path, dtype: torch.dtype, ref: str, source: str, name_hint: str = "") -> LoadedDiffusion:
    det = dcat.detect_from_folder(folder, name_hint or ref)
    cls = _pipeline_class(dcat.ARCH_INFO[det.arch].family)
    try:
        # local_files_only: the folder is complete or it is not; never reach out from here.
        # diffusers reads safetensors first and .bin files through torch.load(weights_only=True).
        pipe = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"could not load the diffusers folder {folder}: {_first_line(exc)}") from None
    pipe.set_progress_bar_config(disable=True)
    snapshot = _hub_snapshot_of(folder)
    if snapshot is not None:      # a folder inside the HF cache is that hub model: name it by id and commit
        repo_id, commit = snapshot
        return LoadedDiffusion(pipe, det.arch, "hf-cache", ref if HUB_ID.match(ref) else repo_id, str(folder),
                               commit[:10], _folder_size(folder), list(det.notes))
    return LoadedDiffusion(pipe, det.arch, source, ref, str(folder), _folder_fingerprint(folder)[:10],
                           _folder_size(folder), list(det.notes))


def _hub_snapshot_of(folder: Path) -> tuple[str, str] | None:
    """('owner/name', commit) when `folder` is <cache>/models--owner--name/snapshots/<commit>."""
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", parts[-1]) \
            and parts[-3].startswith("models--") and parts[-3].count("--") >= 2:
        owner, name = parts[-3][len("models--"):].split("--", 1)
        return f"{owner}/{name}", parts[-1]
    return None


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return True


def _default_hub_cache() -> str:
    try:
        from huggingface_hub import constants

        return f"the Hugging Face cache, {constants.HF_HUB_CACHE}"
    except ImportError:
        return "the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"


def _load_hub(repo_id: str, dtype: torch.dtype, cache_dir: str | Path | None) -> LoadedDiffusion:
    d = _diffusers()
    where = str(cache_dir) if cache_dir else _default_hub_cache()
    names = [repo_id] + ([dcat.HUB_ALIASES[repo_id]] if repo_id in dcat.HUB_ALIASES else [])
    for name in names:
        folder = _cached_snapshot(name, cache_dir)
        if folder is not None:
            return _load_folder(folder, dtype, repo_id, source="hf-cache", name_hint=name)
    if _hub_offline():
        raise ModelLoadError(
            f"{repo_id} is not in the local cache ({where}) and downloads are off (HF_HUB_OFFLINE=1). "
            f"When online, download it once with `huggingface-cli download {names[-1]}` "
            f"(or run the same command without HF_HUB_OFFLINE).")
    try:
        folder = Path(d.DiffusionPipeline.download(names[-1], cache_dir=cache_dir))
    except Exception as exc:     # network, auth, missing repo: each reported with what to do
        raise ModelLoadError(_hub_error_message(names[-1], exc, where)) from None
    return _load_folder(folder, dtype, repo_id, source="hub", name_hint=names[-1])


def _cached_snapshot(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    """The snapshot folder of a fully downloaded copy of `repo_id`, or None."""
    try:
        folder = _diffusers().DiffusionPipeline.download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except Exception:     # huggingface_hub raises several types for "not (fully) cached"
        return None
    return Path(folder)


_UNREACHABLE = ("couldn't connect", "could not connect", "connection", "name or service not known", "not fully cached",
                "outgoing traffic has been disabled", "offline", "timed out", "temporary failure in name resolution",
                "max retries exceeded", "network is unreachable")


def _exc_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the errors it was raised from (diffusers wraps the hub's connection error in an OSError)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        out.append(exc)
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return out


def _hub_error_message(repo_id: str, exc: Exception, where: str) -> str:
    """What went wrong fetching `repo_id`, whole, and what to do about it."""
    chain = _exc_chain(exc)
    names = " ".join(type(e).__name__ for e in chain)
    text = " ".join(str(e) for e in chain)
    low = text.lower()
    if "RepositoryNotFound" in names or "404" in text:
        return (f"{repo_id} was not found on the Hugging Face Hub. Check the spelling; a private repo needs "
                f"`huggingface-cli login` first.")
    if "Gated" in names or "401" in text or "403" in text:
        return (f"{repo_id} is gated: accept its licence on its Hub page and log in with `huggingface-cli login`, "
                f"then try again.")
    size = next((e.size_bytes for e in dcat.KNOWN_HUB_MODELS if e.id == repo_id and e.size_bytes), None)
    once = f"it downloads once, about {size / 1e9:.1f} GB" if size else "it downloads once"
    todo = (f"To use it: connect this machine to the internet and try again ({once}); or, on a machine that is "
            f"online, run `huggingface-cli download {repo_id}` and copy the downloaded cache into {where}; "
            f"or pick a model that is already here, or add a local diffusers folder or .safetensors checkpoint "
            f"(Add a model, or `--model PATH`).")
    if any(e.__class__.__name__ in ("ConnectionError", "ConnectTimeout", "LocalEntryNotFoundError",
                                    "OfflineModeIsEnabled") for e in chain) or any(w in low for w in _UNREACHABLE):
        return (f"{repo_id} is not downloaded yet (it is not in the local cache, {where}) and the Hugging Face "
                f"Hub cannot be reached from this machine. {todo}")
    return (f"{repo_id} is not in the local cache ({where}) and could not be downloaded "
            f"({type(exc).__name__}: {_first_line(exc)}). {todo}")


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of a module's first floating parameter. diffusers' `ModelMixin.dtype` walks every submodule for
    casting hooks first: ~1 ms a read on a UNet, five reads a generation."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).replace("torch.", ""))


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The error's first line; a long one shortened at a sentence (or else a word) end, never mid-word."""
    s = str(exc).strip().splitlines()
    return _shorten(s[0], limit) if s else type(exc).__name__


def _shorten(text: str, limit: int) -> str:
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[:limit]
    stop = max(head.rfind(". "), head.rfind("; "), head.rfind(": "))
    if stop >= limit // 2:
        return head[:stop + 1].rstrip(":;") + " …"
    return head[:head.rfind(" ")].rstrip(" ,;:(") + " …" if " " in head else head + "…"


# -- single files --------------------------------------------------------------------------------------

def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file: safetensors directly, pickles only through torch.load(weights_only=True)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        dcat.safetensors_shapes(path)                 # a clear error for a damaged header
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path.name} could not be read as safetensors ({_first_line(exc)}); "
                                 f"the file may be truncated: compare its size with the source") from None
    if suffix in PICKLE_SUFFIXES:
        return _torch_load_weights_only(path)
    raise ModelLoadError(f"{path.name}: unknown checkpoint type {suffix!r}; use .safetensors (or .ckpt, read weights-only)")


def _torch_load_weights_only(path: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):       # legacy (non-zip) pickles cannot be memory-mapped; read them plainly
                raise
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeModelError(
            f"{path.name} holds Python objects besides tensors and was refused: unpickling them could run code "
            f"({_first_line(exc, 160)}). Use the model's .safetensors release, or convert the file with a tool you trust."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{path.name} is not a readable PyTorch checkpoint ({_first_line(exc)}); "
                             f"it may be truncated or not a checkpoint at all") from None
    while isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{path.name} does not hold a state dict (found {type(obj).__name__})")
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise ModelLoadError(f"{path.name} holds no tensors")
    return tensors


def _load_single_file(path: Path, dtype: torch.dtype, ref: str, config: str | Path | None,
                      hash_cache: Path | None = None) -> LoadedDiffusion:
    if path.suffix.lower() == ".safetensors":
        det = dcat.detect_from_keys(dcat.safetensors_shapes(path), path.name)
        state = read_state_dict(path)
    elif path.suffix.lower() in PICKLE_SUFFIXES:
        state = read_state_dict(path)
        det = dcat.detect_from_keys({k: tuple(v.shape) for k, v in state.items()}, path.name)
    else:
        raise ModelLoadError(f"{path.name}: unknown checkpoint type {path.suffix!r}; use a .safetensors file "
                             f"(or a .ckpt, which is read weights-only), or a diffusers folder")
    # Check the original tensors, before conversion: the names in the message are the file's own.
    check_finite_weights(state.items(), path.name)
    notes = list(det.notes)
    arch = det.arch
    cfg = Path(config) if config else dcat.config_dir(arch)
    pipe = assemble_single_file(state, arch, dtype, cfg, path.name)
    del state
    if det.needs_v_probe:
        if probe_v_prediction(pipe.unet):
            arch = "sd2-v"
            pipe.scheduler = _scheduler_from_folder(dcat.config_dir("sd2-v"))
            notes.append("SD 2.x checkpoint detected as v-prediction (768) by a one-step probe")
        else:
            notes.append("SD 2.x checkpoint detected as ε-prediction (512 base) by a one-step probe")
    pipe.set_progress_bar_config(disable=True)
    return LoadedDiffusion(pipe, arch, "single-file", ref, str(path), file_sha256(path, hash_cache)[:10],
                           path.stat().st_size, notes)


def assemble_single_file(state: dict[str, torch.Tensor], arch: str, dtype: torch.dtype, config: Path, name: str = ""):
    """Build the diffusers pipeline for an original-layout state dict, with configs from `config` (no downloads)."""
    d = _diffusers()
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    family = dcat.ARCH_INFO[arch].family

    def build(component: str, fn):
        try:
            return fn()
        except ModelLoadError:
            raise
        except Exception as exc:   # shape mismatches, missing keys: the file is not the architecture we took it for
            raise ModelLoadError(f"{name}: its {component} weights do not fit the {arch} layout "
                                 f"({_first_line(exc)}); the file may be damaged or a different model type") from None

    common = dict(config=str(config), dtype=dtype, local_files_only=True)
    unet = build("UNet", lambda: d.UNet2DConditionModel.from_single_file(state, subfolder="unet", **common))
    vae = build("VAE", lambda: d.AutoencoderKL.from_single_file(state, subfolder="vae", **common))
    te = build("text encoder", lambda: create_diffusers_clip_model_from_ldm(
        CLIPTextModel, state, subfolder="text_encoder", config=str(config), torch_dtype=dtype, local_files_only=True))
    tok = clip_tokenizer(config / "tokenizer")
    scheduler = _scheduler_from_folder(config)
    if family == "sdxl":
        te2 = build("second text encoder", lambda: create_diffusers_clip_model_from_ldm(
            CLIPTextModelWithProjection, state, subfolder="text_encoder_2", config=str(config), torch_dtype=dtype,
            local_files_only=True))
        tok2 = clip_tokenizer(config / "tokenizer_2")
        return d.StableDiffusionXLPipeline(vae=vae, text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2,
                                           unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
                                           add_watermarker=False)
    return d.StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=scheduler,
                                     safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def clip_tokenizer(folder: Path):
    """A CLIP tokenizer from `folder`: its own tokenizer files if present, else the bundled CLIP BPE."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        return CLIPTokenizer.from_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    vocab, merges = dcat.clip_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=list(merges), pad_token=cfg.get("pad_token", "<|endoftext|>"),
                         model_max_length=int(cfg.get("model_max_length", 77)))


def _scheduler_from_folder(folder: Path):
    d = _diffusers()
    cfg = json.loads((Path(folder) / "scheduler" / "scheduler_config.json").read_text())
    cls = getattr(d, cfg["_class_name"], None)
    if cls is None:
        raise ModelLoadError(f"{folder}: unknown scheduler class {cfg['_class_name']!r}")
    return cls.from_config(cfg)


@torch.no_grad()
def probe_v_prediction(unet) -> bool:
    """Whether an SD 2.x UNet predicts v rather than ε.

    At t=999 the sample is almost pure noise: an ε-model returns about its input, a v-model returns
    about the negated clean image, so on a constant input the mean of (output - input) sits near 0
    for ε and well below -1 for v. (A1111 tells the two apart with the same one-step test.)
    """
    p = next(unet.parameters())
    x = torch.full((1, unet.config.in_channels, 8, 8), 0.5, device=p.device, dtype=p.dtype)
    ctx = torch.full((1, 2, unet.config.cross_attention_dim), 0.5, device=p.device, dtype=p.dtype)
    t = torch.tensor([999], device=p.device)
    out = unet(x, t, encoder_hidden_states=ctx, return_dict=False)[0]
    return float((out.float() - x.float()).mean()) < -1.0


# -- weight checks and identity ---------------------------------------------------------------------------

def _named_weights(pipe) -> Iterator[tuple[str, torch.Tensor]]:
    for comp_name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            for n, t in comp.state_dict().items():
                yield f"{comp_name}.{n}", t


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Refuse weights holding NaN or Inf. One fp32 sum per tensor: fast (bandwidth-bound, no temporaries),
    and non-finite whenever an element is; a rare overflowing sum is confirmed element-wise."""
    bad: list[tuple[str, int]] = []
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
            continue
        if torch.isfinite(t.detach().sum(dtype=torch.float32)):
            continue
        n = int((~torch.isfinite(t.detach())).sum())
        if n:
            bad.append((name, n))
    if bad:
        listed = ", ".join(f"{n} ({c} values)" for n, c in bad[:3]) + (f" and {len(bad) - 3} more tensors" if len(bad) > 3 else "")
        raise ModelLoadError(f"{what} carries NaN/Inf weights in {listed}; the file is damaged. "
                             f"Download it again, or pick another model.")


def file_sha256(path: Path, cache_file: Path | None = None) -> str:
    """SHA-256 of a file, cached by (path, size, mtime) so a 7 GB checkpoint is hashed once.
    The first 10 hex digits are what A1111 writes as 'Model hash'."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}"
    cache_file = cache_file or _hash_cache_file()
    cache: dict = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if cache_file is not None:
        try:
            cache[key] = digest
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_file)
        except OSError:
            pass   # a read-only cache only costs a re-hash next time
    return digest


def _hash_cache_file() -> Path | None:
    try:
        from core.settings import Settings

        return Settings.from_env().cache_dir / "model_hashes.json"
    except Exception:
        return None


def _folder_fingerprint(folder: Path) -> str:
    """Cheap identity of a diffusers folder: every config's text plus each weight file's name and size."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(folder).as_posix()
        h.update(rel.encode())
        if p.suffix == ".json":
            h.update(p.read_bytes())
        else:
            h.update(str(p.stat().st_size).encode())
    return h.hexdigest()


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ==================================================================================================
# Schedulers
# ==================================================================================================

@dataclass(frozen=True)
class SchedulerSpec:
    class_name: str
    overrides: tuple[tuple[str, Any], ...] = ()
    label: str = ""                       # how A1111 names it


SCHEDULERS: dict[str, SchedulerSpec] = {
    "euler": SchedulerSpec("EulerDiscreteScheduler", (), "Euler"),
    "euler-a": SchedulerSpec("EulerAncestralDiscreteScheduler", (), "Euler a"),
    "dpm++2m": SchedulerSpec("DPMSolverMultistepScheduler", (("algorithm_type", "dpmsolver++"), ("solver_order", 2),
                                                            ("use_karras_sigmas", False)), "DPM++ 2M"),
    "dpm++2m-karras": SchedulerSpec("DPMSolverMultistepScheduler", (("algorithm_type", "dpmsolver++"), ("solver_order", 2),
                                                                   ("use_karras_sigmas", True)), "DPM++ 2M Karras"),
    "dpm++2m-sde-karras": SchedulerSpec("DPMSolverMultistepScheduler", (("algorithm_type", "sde-dpmsolver++"),
                                                                       ("solver_order", 2), ("use_karras_sigmas", True)),
                                        "DPM++ 2M SDE Karras"),
    "ddim": SchedulerSpec("DDIMScheduler", (), "DDIM"),
    "lcm": SchedulerSpec("LCMScheduler", (), "LCM"),
    "unipc": SchedulerSpec("UniPCMultistepScheduler", (), "UniPC"),
    "heun": SchedulerSpec("HeunDiscreteScheduler", (), "Heun"),
    "lms": SchedulerSpec("LMSDiscreteScheduler", (("use_karras_sigmas", False),), "LMS"),
    "lms-karras": SchedulerSpec("LMSDiscreteScheduler", (("use_karras_sigmas", True),), "LMS Karras"),
    "pndm": SchedulerSpec("PNDMScheduler", (), "PLMS"),
}
SCHEDULER_NAMES = ("default",) + tuple(SCHEDULERS)

_ALIASES = {"euler_a": "euler-a", "euler ancestral": "euler-a", "k_euler_a": "euler-a", "k_euler": "euler",
            "dpmpp_2m": "dpm++2m", "dpmpp_2m_karras": "dpm++2m-karras", "dpm++ 2m": "dpm++2m",
            "dpm++ 2m karras": "dpm++2m-karras", "dpm++ 2m sde karras": "dpm++2m-sde-karras", "plms": "pndm",
            "automatic": "default", "": "default", "lms karras": "lms-karras"}


_SCHEDULE_TYPES = ("automatic", "uniform", "karras", "exponential", "polyexponential", "sgm uniform", "normal", "simple")


def resolve_scheduler_name(name: str | None, schedule_type: str | None = None) -> str:
    """Our name for a sampler: accepts ours ('dpm++2m-karras'), A1111's ('DPM++ 2M Karras', or 'DPM++ 2M'
    with schedule type 'Karras' as A1111 1.9+ writes it) and a few common spellings."""
    raw = (name or "default").strip()
    key = raw.lower()
    for suffix in _SCHEDULE_TYPES:           # 'DPM++ 2M Karras' as one string, or 'Euler a Automatic'
        if key.endswith(" " + suffix) and key not in _ALIASES and not any(key == s.label.lower() for s in SCHEDULERS.values()):
            key, schedule_type = key[: -len(suffix) - 1].strip(), schedule_type or suffix
            break
    for canon, spec in SCHEDULERS.items():
        if key == spec.label.lower():
            key = canon
            break
    key = _ALIASES.get(key, key).replace(" ", "-")
    if key not in SCHEDULER_NAMES:
        raise InputError(f"unknown scheduler {raw!r}; choose one of: {', '.join(SCHEDULER_NAMES)} "
                         f"(A1111 names such as 'Euler a' or 'DPM++ 2M Karras' work too)")
    st = (schedule_type or "").strip().lower()
    if st == "karras" and not key.endswith("karras") and f"{key}-karras" in SCHEDULERS:
        key = f"{key}-karras"
    return key


def make_scheduler(name: str, base_config: dict):
    """A new scheduler, configured from the model's own scheduler config so its betas, timestep spacing and
    prediction type carry over. The studio builds one per (task, scheduler) and reuses it: its per-run state is
    reset by set_timesteps at the start of every diffusers call."""
    d = _diffusers()
    canon = resolve_scheduler_name(name)
    base = dict(base_config)
    if canon == "default":
        return getattr(d, base["_class_name"]).from_config(base)
    spec = SCHEDULERS[canon]
    overrides = dict(spec.overrides)
    if spec.class_name in ("DDIMScheduler", "LCMScheduler") and "clip_sample" not in base:
        overrides["clip_sample"] = False      # latents are not in [-1, 1]; diffusers' SD pipelines fix this too
    return getattr(d, spec.class_name).from_config(base, **overrides)


# ==================================================================================================
# Previews: a linear map from the 4 latent channels to RGB, good enough to watch an image form
# ==================================================================================================

# Least-squares fits of decoded RGB on latents, as published by the community (keturn; ComfyUI uses the same).
LATENT_RGB: dict[str, tuple[list[list[float]], list[float]]] = {
    "sd": ([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350],
            [-0.2829, 0.1762, 0.2721], [-0.2120, -0.2616, -0.7177]], [0.0, 0.0, 0.0]),
    "sdxl": ([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068],
              [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]], [0.1084, -0.0175, -0.0011]),
}


def latent_preview(latents: torch.Tensor, family: str, size: tuple[int, int] | None = None) -> Image.Image:
    """First latent of the batch as a rough RGB picture (no VAE), optionally resized to `size` (w, h)."""
    assert latents.ndim == 4, f"expected [N, C, h, w] latents, got {tuple(latents.shape)}"
    lat = latents[0].detach().float().cpu()
    if lat.shape[0] == 4:
        factors, bias = LATENT_RGB[family]
        rgb = torch.einsum("chw,cr->rhw", lat, torch.tensor(factors)) + torch.tensor(bias)[:, None, None]
    else:   # a model with another latent width: show three channels, normalised
        rgb = lat[:3] if lat.shape[0] >= 3 else lat[:1].expand(3, -1, -1)
        rgb = rgb / (rgb.abs().amax() + 1e-6)
    return rgb_image(rgb, size)


def rgb_image(rgb: torch.Tensor, size: tuple[int, int] | None = None) -> Image.Image:
    """A [3, h, w] picture in [-1, 1] (any device or dtype) as an 8-bit PIL image, resized to `size` (w, h)."""
    arr = ((rgb.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    im = Image.fromarray(arr, "RGB")
    return im.resize(size, Image.BILINEAR) if size and im.size != tuple(size) else im


# ==================================================================================================
# Generation
# ==================================================================================================

MAX_STEPS = 150                  # A1111's slider range; more steps stop changing the image
MAX_GUIDANCE = 30.0
MAX_BATCH = 16
MAX_PROMPT_CHARS = 4000          # anything longer is a paste accident; the encoder reads 77 tokens anyway
MAX_SIDE = 4096
HARD_PIXEL_CAP = 4096 * 4096
VAE_DECODE_BYTES_PER_PIXEL = 2000   # ≈ live activation values per output pixel in the VAE decoder (fp16: ×1, fp32: ×2)


@dataclass
class CheckedInputs:
    task: str                              # 'txt2img' | 'img2img'
    scheduler: str                         # our canonical name
    init_image: Image.Image | None
    notes: list[str]
    prompt_tokens: int
    negative_tokens: int


def pixel_cap(device: torch.device, dtype: torch.dtype, flags: OptimizationFlags, batch: int = 1) -> tuple[int, int]:
    """(largest width*height per image the free memory allows for one decode, free bytes)."""
    if device.type == "cuda":
        free = int(torch.cuda.mem_get_info(device)[0])
    else:
        try:
            import psutil

            free = int(psutil.virtual_memory().available)
        except ImportError:
            return HARD_PIXEL_CAP, 0
    per_px = VAE_DECODE_BYTES_PER_PIXEL * max(2, torch.finfo(dtype).bits // 8)
    if "vae-tiling" in flags.memory:
        per_px //= 8                       # tiles are decoded one at a time
    images_at_once = 1 if "vae-slicing" in flags.memory else max(1, batch)
    cap = int(free * 0.9 / (per_px * images_at_once))
    return max(0, min(HARD_PIXEL_CAP, cap)), free


class DiffusionPipeline:
    """One loaded diffusion model on one device, with the request's optimization flags applied."""

    backend = "diffusion"

    def __init__(self, loaded: LoadedDiffusion, flags: OptimizationFlags, device: torch.device | str,
                 cache_dir: str | Path | None = None):
        self.loaded = loaded
        self.cache_dir = cache_dir       # compile / TensorRT caches live under it
        self.model_id = loaded.ref
        self.arch = loaded.arch
        self.family = loaded.family
        self.device = torch.device(device)
        self.flags = flags
        self.pipe = loaded.pipe
        self.pipe.set_progress_bar_config(disable=True)
        self._base_scheduler_config = dict(self.pipe.scheduler.config)
        self.optimizations = self._apply_flags(flags)
        # Per-request objects, built once: a diffusers pipeline view per (task, scheduler) and a token count per
        # prompt. Building them cost ~10 ms a request on the H200's host, more than a 1-step SD-Turbo UNet call.
        # A scheduler's per-run state is reset by set_timesteps at the start of every diffusers call, and
        # generations on one pipeline are serialised by the GPU lock, so reuse is safe.
        self._views: dict[tuple[str, str], Any] = {}
        self._token_counts: dict[str, int] = {}
        # the tiny decoder loaded for previews alone (preview_method 'taesd'/'auto' without the toggle), or why not
        self._preview_tiny: Any = None
        self._preview_tiny_error: str | None = None
        # One CUDA graph per request shape (pipelines/request_graph.py): "capture" on a GPU when the flag asks for it;
        # "eager" runs the same static-buffer function without recording (the CPU tests use it); None: off.
        self._graphs = rgraph.RequestGraphs()
        self._request_graph_mode: str | None = None
        if flags.request_graph:
            rep = self.optimizations.get("request_graph", {})
            if rep.get("applied"):
                self._request_graph_mode = "capture"
        if self.device.type == "cuda":           # the UNet takes CPU timesteps without a sync (pipelines/overlap.py)
            overlap.install_timestep_hook(self.pipe.unet)

    # -- optimization flags -------------------------------------------------------------------------
    def _apply_flags(self, flags: OptimizationFlags) -> dict:
        """Place the pipeline and hand it to optim/, which owns every toggle (precision, channels_last,
        attention, compile, memory savers incl. CPU offload) and reports what ran and why not."""
        offload = "cpu-offload" in flags.memory and self.device.type == "cuda"
        self.prepare_timings: dict = {}     # seconds per toggle step (the bench's prepare_parts_s.toggles)
        t0 = time.perf_counter()
        if not offload:                 # with offload, accelerate places each model only while it runs
            self.pipe.to(self.device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.prepare_timings["place"] = round(time.perf_counter() - t0, 3)
        root, report = optim.prepare(self.pipe, flags, self.device, kind="diffusion", cache_dir=self.cache_dir,
                                     weights_hash=self.loaded.hash, timings=self.prepare_timings)
        if root is not self.pipe and hasattr(root, "unet"):
            self.pipe = root
        report = dict(report)
        report["precision"] = dict(report.get("precision", {}), weights=_dtype_name(self.pipe.unet.dtype))
        return report

    def memory_bytes(self) -> int:
        tiny = tiny_vae.get(self.pipe) or self._preview_tiny      # the toggle's decoder, or the previews' own
        return (sum(module_bytes(m) for m in self.pipe.components.values() if isinstance(m, torch.nn.Module))
                + (module_bytes(tiny) if tiny is not None else 0))

    def _preview_decoder(self, method: str, notes: list[str]) -> tuple[str, Any]:
        """What draws this request's live previews: ('latent', None), ('full', None) or ('taesd', decoder).
        'auto' takes the tiny decoder when the toggle loaded it or its weights are on disk (no download), as
        ComfyUI's auto preview does; 'taesd' loads it (downloading if it must) and, failing that, says why in the
        result's notes and previews with the latent map: a preview is never worth failing the job for."""
        if method in ("latent", "full"):
            return method, None
        tiny = tiny_vae.get(self.pipe) or self._preview_tiny
        if tiny is not None:
            return "taesd", tiny
        vae = getattr(self.pipe, "vae", None)
        if vae is None or int(getattr(vae.config, "latent_channels", 4)) != 4:
            if method == "taesd":
                notes.append("previews: the tiny autoencoder decodes 4-channel SD latents only; the latent map was used")
            return "latent", None
        src = tiny_vae.source(self.family if self.family == "sdxl" else "sd", self.pipe)
        if self._preview_tiny_error is None and (method == "taesd" or tiny_vae.available_locally(src)):
            try:
                cand = tiny_vae.load(src, _param_dtype(vae), self.device)
                self._preview_tiny_error = tiny_vae.mismatch(cand, vae, src)
                if self._preview_tiny_error is None:
                    self._preview_tiny = cand
                    return "taesd", cand
            except tiny_vae.TinyVAEUnavailable as exc:
                self._preview_tiny_error = str(exc)
        if method == "taesd":
            notes.append(f"previews: tiny autoencoder not loaded ({self._preview_tiny_error or 'not available'}); "
                         f"the latent map was used")
        return "latent", None

    def _preview(self, latents: torch.Tensor, size: tuple[int, int], decoder: tuple[str, Any]) -> Image.Image:
        """A live preview of the first image, drawn as `_preview_decoder` chose: the tiny autoencoder (A1111's
        TAESD preview mode), the full VAE, or the linear latent-to-RGB map (also the fallback of a non-finite
        decode: SDXL's fp16 VAE can overflow on a mid-denoise latent)."""
        kind, tiny = decoder
        if kind == "latent":
            return latent_preview(latents, self.family, size)
        with torch.no_grad(), self._runtime():
            if kind == "taesd":
                img = tiny_vae.decode(tiny, latents[:1])[0]
            else:
                img = self._vae_decode(self.pipe, latents[:1], None, full=True)[0]
        if not torch.isfinite(img).all():
            return latent_preview(latents, self.family, size)
        return rgb_image(img, size)

    # -- 1. input checks (no device work) ---------------------------------------------------------------
    def check_inputs(self, p: DiffusionParams, task: str | None = None) -> CheckedInputs:
        notes: list[str] = []
        if task is None:
            task = "txt2img" if p.init_image is None else "img2img"
        if task not in ("txt2img", "img2img"):
            raise InputError(f"task must be txt2img or img2img; got {task!r}")
        if not isinstance(p.prompt, str) or not isinstance(p.negative_prompt or "", str):
            raise InputError("prompt and negative prompt must be text")
        if len(p.prompt) > MAX_PROMPT_CHARS or len(p.negative_prompt or "") > MAX_PROMPT_CHARS:
            raise InputError(f"prompts are limited to {MAX_PROMPT_CHARS} characters (the text encoder reads at most 77 tokens)")
        try:
            steps = int(p.steps)
            guidance = float(p.guidance)
            batch = int(p.batch_size)
            w, h = int(p.width), int(p.height)
        except (TypeError, ValueError):
            raise InputError("steps, batch size, width and height must be whole numbers and guidance a number") from None
        if not (1 <= steps <= MAX_STEPS) or steps != p.steps:
            raise InputError(f"steps must be a whole number from 1 to {MAX_STEPS}; got {p.steps}")
        if not math.isfinite(guidance) or not (0.0 <= guidance <= MAX_GUIDANCE):
            raise InputError(f"guidance scale must be between 0 and {MAX_GUIDANCE:g}; got {p.guidance}")
        if not (1 <= batch <= MAX_BATCH):
            raise InputError(f"batch size must be from 1 to {MAX_BATCH}; got {p.batch_size}")
        mult = int(getattr(self.pipe, "vae_scale_factor", 8))
        for label, v in (("width", w), ("height", h)):
            if v < 64 or v > MAX_SIDE or v % mult:
                raise InputError(f"{label} must be a multiple of {mult} between 64 and {MAX_SIDE}; got {v} "
                                 f"(nearest valid: {max(64, min(MAX_SIDE, round(v / mult) * mult))})")
        try:
            scheduler = resolve_scheduler_name(p.scheduler)
        except InputError:
            raise
        # A request that replays a graph already recorded runs inside that graph's memory pool: nothing new is
        # allocated, so the free-memory query (a driver call on the request's critical path) is skipped.
        replays = (self._request_graph_mode is not None and task == "txt2img" and not int(p.preview_every or 0)
                   and self._graph_key(p, scheduler) in self._graphs.graphs)
        cap, free = (w * h, 0) if replays else pixel_cap(self.device, _param_dtype(self.pipe.vae), self.flags, batch)
        if w * h > cap:
            where = f"{free / 2**30:.1f} GiB free on {self.device}" if free else str(self.device)
            # OutOfMemory: the same request would fail again (the A1111 API answers 422, not a 503 to retry)
            raise OutOfMemory(f"{w}x{h} × batch {batch} is too large to decode with {where} (cap: about "
                                f"{cap / 1e6:.2f} megapixels per image). Lower the size or batch, or turn on "
                                f"vae-tiling / vae-slicing.")
        init = None
        if task == "img2img":
            if p.init_image is None or (isinstance(p.init_image, str) and not p.init_image.strip()):
                raise InputError("image-to-image needs an init image: pass --init-image FILE (or upload one)")
            s = float(p.strength)
            if not math.isfinite(s) or not (0.0 < s <= 1.0):
                raise InputError(f"strength must be in (0, 1]: 1 repaints fully, small values keep the init image; got {p.strength}")
            if int(steps * s) < 1:
                raise InputError(f"strength {s:g} × {steps} steps runs no denoising step; raise the strength or the steps "
                                 f"(at least {math.ceil(1 / s)} steps at this strength)")
            init = self._load_init_image(p.init_image, w, h, notes)
        n_pos = self._count_tokens(p.prompt, "prompt", notes)
        n_neg = self._count_tokens(p.negative_prompt or "", "negative prompt", notes)
        cfg_on = guidance > 1.0 and self.pipe.unet.config.get("time_cond_proj_dim") is None
        if (p.negative_prompt or "").strip() and not cfg_on:
            notes.append(f"negative prompt has no effect at guidance {guidance:g} (classifier-free guidance is off at ≤ 1)")
        if self.arch.endswith("turbo") and guidance > 1.0:
            notes.append(f"{self.arch} is distilled to run without guidance; guidance 0 and 1–4 steps is its intended setting")
        if scheduler == "lcm" and not self._is_lcm_model():
            notes.append("the LCM scheduler suits latent-consistency models (LCM weights or LoRA); on this model expect "
                         "blurry results — use 4–8 steps and guidance 1–2 with an LCM model")
        return CheckedInputs(task, scheduler, init, notes, n_pos, n_neg)

    def _is_lcm_model(self) -> bool:
        return self.pipe.unet.config.get("time_cond_proj_dim") is not None or "lcm" in self.model_id.lower() \
            or type(self.pipe.scheduler).__name__ == "LCMScheduler"

    def _count_tokens(self, text: str, label: str, notes: list[str]) -> int:
        tok = self.pipe.tokenizer
        n = self._token_counts.get(text)
        if n is None:
            n = len(tok(text, truncation=False, add_special_tokens=True).input_ids)
            if len(self._token_counts) >= 256:
                self._token_counts.clear()
            self._token_counts[text] = n
        limit = int(tok.model_max_length)
        if n > limit:
            notes.append(f"{label} truncated: {n} tokens > {limit} (start and end tokens included); "
                         f"the words past token {limit - 2} were ignored")
        return n

    @staticmethod
    def _load_init_image(src: Any, w: int, h: int, notes: list[str]) -> Image.Image:
        if isinstance(src, Image.Image):
            im = src
        else:
            path = Path(str(src)).expanduser()
            if not path.is_file():
                raise InputError(f"init image not found: {path}")
            try:
                im = Image.open(path)
                im.load()
            except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
                raise InputError(f"{path.name} is not a readable image ({_first_line(exc)})") from None
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            flat = Image.new("RGB", rgba.size, (255, 255, 255))
            flat.paste(rgba, mask=rgba.getchannel("A"))
            im = flat
            notes.append("init image had transparency; flattened onto white")
        elif im.mode != "RGB":
            notes.append(f"init image converted from {im.mode} to RGB")
            im = im.convert("RGB")
        if im.size != (w, h):
            notes.append(f"init image resized from {im.size[0]}x{im.size[1]} to {w}x{h}")
            im = im.resize((w, h), Image.LANCZOS)
        return im

    # -- helpers for the steps below -----------------------------------------------------------------------
    def _view(self, task: str, scheduler_name: str):
        """The cached diffusers pipeline for (task, scheduler): built on first use, then reused."""
        key = (task, scheduler_name)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 32:          # every task × scheduler is 2 × 13; never grows past that
                self._views.clear()
            view = self._task_pipeline(task, make_scheduler(scheduler_name, self._base_scheduler_config))
            if self.device.type == "cuda":       # scheduler arithmetic on the host: no sync per step
                overlap.host_timesteps(view.scheduler)
            self._views[key] = view
        return view

    def _task_pipeline(self, task: str, scheduler):
        """A diffusers pipeline for `task` sharing the loaded modules, with its own scheduler (see `_view`)."""
        cls = _pipeline_class(self.family, task)
        accepted = inspect.signature(cls.__init__).parameters
        comps = {k: v for k, v in self.pipe.components.items() if k in accepted}
        comps["scheduler"] = scheduler
        if self.family == "sd":
            comps["requires_safety_checker"] = False
        else:
            comps["force_zeros_for_empty_prompt"] = bool(self.pipe.config.get("force_zeros_for_empty_prompt", True))
            comps["add_watermarker"] = False
        view = _fixed_device_class(cls)(**comps)
        view.set_progress_bar_config(disable=True)
        if "cpu-offload" not in self.flags.memory:      # with offload, accelerate's hooks decide per module
            view._atelier_device = self.device
        return view

    @staticmethod
    def _generators(seed: int, batch: int):
        seeds = [(int(seed) + i) % (SEED_MAX + 1) for i in range(batch)]
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        return seeds, (gens[0] if batch == 1 else gens)

    def _encode_prompt(self, view, p: DiffusionParams, device, do_cfg: bool) -> dict:
        neg = p.negative_prompt or None        # empty -> None, as a plain diffusers call (SDXL then uses zeros)
        if self.family == "sdxl":
            pe, npe, ppe, nppe = view.encode_prompt(p.prompt, None, device, 1, do_cfg, neg, None)
            return {"prompt_embeds": pe, "negative_prompt_embeds": npe, "pooled_prompt_embeds": ppe,
                    "negative_pooled_prompt_embeds": nppe}
        pe, npe = view.encode_prompt(p.prompt, device, 1, do_cfg, neg)
        return {"prompt_embeds": pe, "negative_prompt_embeds": npe}

    @contextlib.contextmanager
    def _vae_dtype(self, vae, dtype: torch.dtype | None):
        orig = _param_dtype(vae)
        if dtype is None or orig == dtype:
            yield
            return
        vae.to(dtype=dtype)
        try:
            yield
        finally:
            vae.to(dtype=orig)

    def _vae_decode(self, view, latents: torch.Tensor, generator, full: bool = False) -> torch.Tensor:
        tiny = None if full else tiny_vae.get(self.pipe)
        if tiny is not None:                 # the tiny-autoencoder toggle: TAESD decodes the UNet's latents
            return tiny_vae.decode(tiny, latents)
        vae = view.vae
        lat = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        if self.family == "sdxl":
            mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
            if mean is not None and std is not None:
                mean_t = torch.tensor(mean).view(1, 4, 1, 1).to(lat.device, lat.dtype)
                std_t = torch.tensor(std).view(1, 4, 1, 1).to(lat.device, lat.dtype)
                lat = lat * std_t / vae.config.scaling_factor + mean_t
            else:
                lat = lat / vae.config.scaling_factor
            from diffusers.utils.torch_utils import get_module_execution_device

            return vae.decode(lat.to(get_module_execution_device(vae)), return_dict=False)[0]
        return vae.decode(lat / vae.config.scaling_factor, return_dict=False, generator=generator)[0]

    def _decode(self, view, latents: torch.Tensor, generator, embed_dtype, device) -> tuple[torch.Tensor, list[str], list | None]:
        """VAE decode with the NaN guard, then the safety checker if the model has one."""
        notes: list[str] = []
        vae = view.vae
        tiny = tiny_vae.get(self.pipe)
        # SDXL's VAE overflows in fp16; diffusers' SDXL pipeline decodes it in fp32 when its config says so, and so
        # do we. (SD 1.x/2.x configs default to force_upcast too, but diffusers decodes those as they are.)
        # TAESDXL, when it decodes instead, is fp16-safe.
        vae_dtype = _param_dtype(vae)
        upcast = (tiny is None and self.family == "sdxl" and vae_dtype == torch.float16
                  and vae.config.get("force_upcast", False))
        first = torch.float32 if upcast else None
        # The fp32 copy must decode outside the request's autocast, which would run its convolutions in fp16
        # again (the overflow the upcast avoids; the NaN guard below would then blame the weights).
        precision = torch.autocast(self.device.type, enabled=False) if upcast else self._runtime()
        with self._vae_dtype(vae, first), precision:
            used = ("autocast-" + self.flags.precision if self._autocast_on() and not upcast
                    else _dtype_name(_param_dtype(tiny if tiny is not None else vae)))
            image = self._vae_decode(view, latents, generator)
        # One check (one host/device sync) after the decode: NaN latents decode to a NaN image, so the latents are
        # only examined when the image is bad. Checking them before the decode would stall the host until the
        # denoiser had finished, instead of letting it queue the decoder behind it.
        if not bool(torch.isfinite(image).all()):
            if not bool(torch.isfinite(latents).all()):
                hint = ("FP8 is on: turn it off, or report the model (FP8 layers are floored against zero rows)"
                        if self.flags.fp8 else "this happens with fp16 on some SD 2.x models: try bf16 or fp32 "
                                               "precision, or another scheduler")
                raise AtelierError(f"the denoiser produced NaN/Inf latents, so there is no image to decode; {hint}.")
            if used != "fp32" or tiny is not None:
                with self._vae_dtype(vae, torch.float32), torch.autocast(device.type, enabled=False):
                    image = self._vae_decode(view, latents.float(), generator, full=True)
                if torch.isfinite(image).all():
                    notes.append(f"the tiny autoencoder produced NaN/Inf in {used}; the VAE decoded again in fp32"
                                 if tiny is not None else f"VAE produced NaN/Inf in {used}; decoded again in fp32")
            if not torch.isfinite(image).all():
                raise AtelierError("the VAE produced NaN/Inf even in fp32: its weights look damaged. Try another VAE "
                                   "or re-download the model. (No image was returned rather than a black one.)")
        nsfw = None
        if self.family == "sd" and getattr(view, "safety_checker", None) is not None:
            image, nsfw = view.run_safety_checker(image, device, embed_dtype)
        return image, notes, nsfw

    def _autocast_on(self) -> bool:
        mode = str(self.optimizations.get("precision", {}).get("mode", ""))
        return mode.startswith("autocast")

    def _runtime(self):
        """The request's precision context. Weights already cast to fp16/bf16 (the GPU's mode) run as diffusers
        runs them, without autocast: autocast would only put diffusers' deliberate fp32 islands back in half
        precision (SDXL's VAE upcast for the img2img encode, upcast attention)."""
        if str(self.optimizations.get("precision", {}).get("mode", "")).startswith("weights-"):
            return switches.scoped()
        return switches.request_scope(self.flags, self.device)

    # -- the main entry point -------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest, job: Job, task: str | None = None) -> GenerationResult:
        p = request.params
        if not isinstance(p, DiffusionParams):
            raise InputError("the diffusion backend needs diffusion parameters (prompt, steps, guidance, …)")
        t0 = time.perf_counter()
        # 1. check inputs: everything that can be wrong with the request fails here, before any device work
        chk = self.check_inputs(p, task)
        job.check_cancelled()
        optim.set_status_callback(self.pipe, job.status)   # "compiling (first run for this size)"
        reset_peak_memory(self.device)
        view = self._view(chk.task, chk.scheduler)
        device = view._execution_device
        seeds, generator = self._generators(p.seed, p.batch_size)
        if self._request_graph_mode is not None:
            done = self._generate_recorded(request, job, chk, view, seeds, generator, t0)
            if done is not None:
                return done
        do_cfg = float(p.guidance) > 1.0 and self.pipe.unet.config.get("time_cond_proj_dim") is None

        # 2. encode the prompt (once; diffusers repeats the embeddings for the batch)
        with job.stage("text_encoder"), torch.no_grad(), self._runtime():
            embeds = self._encode_prompt(view, p, device, do_cfg)

        # 3+4. prepare latents from the CPU generators and run diffusers' own denoising loop. Every random draw
        # in it is made in float32 and cast (fp32_noise), so a seed gives the same picture at every precision.
        # The step-end callback reports progress and previews; a cancel flips the pipeline's interrupt
        # flag, so no further UNet call happens after the step in flight.
        state = {"done": 0, "total": 0, "cancelled": False}
        pacer = overlap.StepPacer(self.device)

        asked = sampler_steps(p.steps, p.strength if chk.task == "img2img" else None)
        previewer = (self._preview_decoder(p.preview_method, chk.notes) if int(p.preview_every or 0) > 0
                     else ("latent", None))

        def on_step_end(pipe, i, t, kw):
            pacer.step()             # on a GPU: wait for step i-2, so progress is at most two steps early
            done, total = step_counter(i, int(getattr(pipe, "num_timesteps", 0) or asked), asked)
            repeat = done == state["done"]       # an extra sampler callback within the same step: no new event
            state["done"], state["total"] = done, total
            preview = None
            k = int(p.preview_every or 0)
            if k > 0 and not repeat and (done % k == 0 or done == total):
                preview = self._preview(kw["latents"], (int(p.width), int(p.height)), previewer)
            try:
                job.check_cancelled() if repeat else job.step(done, total, preview)
            except Cancelled:
                state["cancelled"] = True
                pipe._interrupt = True
            return {}

        call = dict(embeds, num_inference_steps=int(p.steps), guidance_scale=float(p.guidance),
                    num_images_per_prompt=int(p.batch_size), generator=generator, output_type="latent",
                    callback_on_step_end=on_step_end)
        if chk.task == "img2img":
            call.update(image=chk.init_image, strength=float(p.strength))
        else:
            call.update(height=int(p.height), width=int(p.width))
        with job.stage("denoise"), torch.no_grad(), self._runtime(), fp32_noise():
            latents = view(**call).images
        partial = False
        if state["cancelled"]:
            if not (p.partial_on_cancel and state["done"] > 0):
                return self._cancelled_result(request, job, chk, state, t0)
            partial = True           # A1111: an interrupted job decodes the latents it had

        # 5. decode, with the NaN guard (and the model's safety checker, if it ships one)
        with job.stage("vae_decode"), torch.no_grad():
            image, decode_notes, nsfw = self._decode(view, latents, generator, embeds["prompt_embeds"].dtype, device)

        # 6. postprocess: [0, 1] floats exactly as diffusers returns them, and 8-bit images rounded as diffusers does
        with job.stage("postprocess"):
            n = image.shape[0]
            do_denorm = [True] * n if nsfw is None else [not x for x in nsfw]
            pt = view.image_processor.postprocess(image, output_type="pt", do_denormalize=do_denorm).detach().float()
            # 8-bit on the device (the same float32 multiply and round-half-even as diffusers' numpy_to_pil), so the
            # host receives a quarter of the bytes for the PIL images and does no per-pixel work.
            u8 = (pt * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()
            raw = pt.cpu().numpy()
            images = [Image.fromarray(u8[i], "RGB") for i in range(n)]
        assert raw.ndim == 4 and raw.shape[1] == 3, f"expected [N, 3, H, W], got {raw.shape}"
        notes = chk.notes + decode_notes
        if nsfw is not None:
            for i, flagged in enumerate(nsfw):
                if flagged:
                    notes.append(f"image {i} (seed {seeds[i]}) was blacked out by the model's safety checker "
                                 f"(a content filter, not a NaN)")
        latency_ms = (time.perf_counter() - t0) * 1e3
        peak = peak_memory_bytes(self.device)
        meta = self._metadata(request, chk, seeds, raw, latency_ms, peak, nsfw)
        if partial:
            notes.append(f"cancelled after step {state['done']} of {state['total']}; the partly denoised "
                         f"latents were decoded, as A1111 does (a noisy image)")
            for m in meta:
                m["interrupted_at_step"] = state["done"]
        return GenerationResult(images=images, raw=raw.astype(np.float32, copy=False), timings_ms=dict(job.timings_ms),
                                peak_memory_bytes=peak, device=str(self.device),
                                dtype=str(_param_dtype(self.pipe.unet)).replace("torch.", ""),
                                optimizations=self.optimizations, notes=notes, metadata=meta, cancelled=partial)

    # -- the recorded path: one CUDA graph per request shape (pipelines/request_graph.py) ---------------------
    def request_graph_reason(self, p: DiffusionParams, chk: CheckedInputs, view) -> str | None:
        """Why this request runs the normal path instead of the recorded one, or None."""
        if self.family not in ("sd", "sdxl"):
            return f"the recorded request covers SD 1.x/2.x and SDXL, not {self.family}"
        if self.family == "sdxl":
            vae = self.pipe.vae
            if getattr(self.pipe, "text_encoder", None) is None or getattr(self.pipe, "text_encoder_2", None) is None:
                return "SDXL models without both text encoders (refiners) run the normal path"
            if (_param_dtype(vae) == torch.float16 and vae.config.get("force_upcast", False)
                    and tiny_vae.get(self.pipe) is None):     # TAESDXL, when it decodes, runs in fp16 as it is
                return "SDXL's VAE decodes in fp32 under fp16 weights (a weight cast per request); use bf16"
            if vae.config.get("latents_mean") is not None:
                return "VAEs with latent mean/std normalisation run the normal path"
            if getattr(self.pipe.text_encoder_2.config, "use_attention_mask", False):
                return "text encoders that take an attention mask run the normal path"
        if chk.task != "txt2img":
            return "image-to-image runs the normal path"
        if int(p.preview_every or 0) > 0:
            return "live previews need the step loop on the host"
        if getattr(view, "safety_checker", None) is not None:
            return "the model's safety checker runs on the host"
        if self.pipe.unet.config.get("time_cond_proj_dim") is not None:
            return "guidance-embedding (LCM-style) UNets run the normal path"
        if getattr(self.pipe.text_encoder.config, "use_attention_mask", False):
            return "text encoders that take an attention mask run the normal path"
        if set(self.flags.memory) & {"cpu-offload", "vae-tiling", "attention-slicing"}:
            return "memory savers (offload, tiling, slicing) run the normal path"
        if self.flags.tensorrt:
            return "TensorRT engines run the normal path"
        return rgraph.scheduler_reason(view.scheduler)

    def _aot_parts(self, rep: dict):
        """The ahead-of-time compiled parts (ATELIER_REQUEST_GRAPH_AOT: auto / 1, pipelines/aot_parts.py), or None."""
        from pipelines import aot_parts

        if not aot_parts.enabled():
            if aot_parts.mode() not in aot_parts.MODES:
                rep["aot_note"] = (f"{aot_parts.ENV}={aot_parts.mode()!r} is not one of auto, 1, 0: "
                                   "AOT parts are off")
            return None
        if getattr(self, "_aot", None) is None:
            from optim.registry import default_cache_dir

            flags = json.dumps({k: v for k, v in self.flags.to_dict().items() if k != "strict"}, sort_keys=True)
            self._aot = aot_parts.AotParts(Path(self.cache_dir) if self.cache_dir else default_cache_dir(),
                                           self.loaded.hash or self.model_id, flags, rep)
        return self._aot

    def _graph_key(self, p: DiffusionParams, scheduler: str) -> rgraph.GraphKey:
        """The recorded-graph shape a text-to-image request needs (its scheduler name already resolved)."""
        cfg = float(p.guidance) > 1.0
        zero_negative = self.family == "sdxl" and cfg and not (p.negative_prompt or "") and bool(
            self.pipe.config.get("force_zeros_for_empty_prompt", True))
        return rgraph.GraphKey(int(p.batch_size), int(p.height), int(p.width), int(p.steps), scheduler, cfg,
                               zero_negative)

    def _generate_recorded(self, request, job: Job, chk: CheckedInputs, view, seeds, generator, t0):
        """The request through its recorded graph; None when it must take the normal path (the reason is
        reported under optimizations['request_graph'])."""
        p: DiffusionParams = request.params
        rep = self.optimizations.setdefault("request_graph", {})
        why = self.request_graph_reason(p, chk, view)
        if why is not None:
            rep["last_fallback"] = why
            return None
        key = self._graph_key(p, chk.scheduler)
        cfg, xl, zero_negative = key.cfg, self.family == "sdxl", key.zero_negative
        if key in self._graphs.failed:
            rep["last_fallback"] = self._graphs.failed[key]
            return None
        toks = (view.tokenizer, view.tokenizer_2) if xl else (view.tokenizer,)
        ids_pos = tuple(self._graphs.ids(t, p.prompt) for t in toks)
        ids_neg = tuple(self._graphs.ids(t, p.negative_prompt or "") for t in toks) if cfg and not zero_negative else None

        def build() -> rgraph.RecordedRequest:
            sched = make_scheduler(chk.scheduler, self._base_scheduler_config)
            job.status("recording the request graph (first run for this size)")
            rec = rgraph.RecordedRequest(key, view, sched, self.device, lambda v, lat: self._vae_decode(v, lat, None),
                                         self._runtime, capture=self._request_graph_mode == "capture",
                                         aot=None if xl else self._aot_parts(rep))
            rec.load(ids_pos, ids_neg, noise, float(p.guidance))
            return rec

        shape = (int(p.batch_size), int(view.unet.config.in_channels), int(p.height) // int(view.vae_scale_factor),
                 int(p.width) // int(view.vae_scale_factor))
        noise = _diffusers_randn()(shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32)
        job.check_cancelled()
        with job.stage("request_graph"):
            try:
                rec, new = self._graphs.get(key, build)
            except (AtelierError, Cancelled):
                raise
            except Exception as exc:                 # recording failed: this shape runs the normal path from now on
                reason = f"recording failed ({type(exc).__name__}: {' '.join(str(exc).split())[:240]}); normal path"
                self._graphs.failed[key] = reason
                rep["failures"] = dict(rep.get("failures", {}), **{_graph_key_str(key): reason})
                rep["last_fallback"] = reason
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return None
            if new:          # the shapes recorded so far, the latest last (a few: shapes are evicted past MAX_GRAPHS)
                rep["recorded"] = (rep.get("recorded", []) + [_graph_key_str(key)])[-2 * rgraph.MAX_GRAPHS:]
                if rec.record_s:       # where a first request's time went: warm-up passes, capture (the live
                    rep.setdefault("record_s", {})[_graph_key_str(key)] = rec.record_s   # dict: a deferred one too)
            else:                      # a new one was built with this request's inputs (its first pass may be it)
                rec.load(ids_pos, ids_neg, noise, float(p.guidance))
            u8, raw, finite = rec.run()
            images = [Image.fromarray(u8[i], "RGB") for i in range(u8.shape[0])] if finite else []
        if not finite:          # the normal path has the NaN guard's fp32 retries and its messages
            rep["last_fallback"] = "non-finite image from the recorded request; ran the normal path"
            return None
        rep.pop("last_fallback", None)
        job.step(int(p.steps), int(p.steps), None)
        latency_ms = (time.perf_counter() - t0) * 1e3
        peak = peak_memory_bytes(self.device)
        meta = self._metadata(request, chk, seeds, raw, latency_ms, peak, None)
        return GenerationResult(images=images, raw=raw, timings_ms=dict(job.timings_ms), peak_memory_bytes=peak,
                                device=str(self.device), dtype=str(_param_dtype(self.pipe.unet)).replace("torch.", ""),
                                optimizations=self.optimizations, notes=list(chk.notes), metadata=meta)

    def _metadata(self, request, chk: CheckedInputs, seeds, raw, latency_ms, peak, nsfw) -> list[dict]:
        p: DiffusionParams = request.params
        common = {
            "backend": "diffusion", "model": self.model_id, "model_hash": self.loaded.hash, "arch": self.arch,
            "prompt": p.prompt, "negative_prompt": p.negative_prompt or "", "steps": int(p.steps),
            "guidance": float(p.guidance), "scheduler": chk.scheduler,
            "width": int(raw.shape[-1]), "height": int(raw.shape[-2]), "batch_size": int(p.batch_size),
            "task": chk.task, "flags": request.flags.to_dict(), "latency_ms": round(latency_ms, 3),
            "peak_vram_bytes": int(peak), "device": str(self.device),
            "dtype": str(_param_dtype(self.pipe.unet)).replace("torch.", ""),
        }
        if chk.task == "img2img":
            common["strength"] = float(p.strength)
            common["init_image"] = p.init_image if isinstance(p.init_image, str) else None
        out = []
        for i, s in enumerate(seeds):
            m = dict(common, seed=int(s), batch_index=i)
            if nsfw is not None and nsfw[i]:
                m["safety_checker_blacked_out"] = True
            out.append(m)
        return out

    def _cancelled_result(self, request, job, chk, state, t0) -> GenerationResult:
        p: DiffusionParams = request.params
        note = (f"cancelled after step {state['done']} of {state['total']}; no image returned "
                f"(a half-denoised image is mostly noise)")
        return GenerationResult(images=[], raw=np.zeros((0, 3, int(p.height), int(p.width)), np.float32),
                                timings_ms=dict(job.timings_ms), peak_memory_bytes=peak_memory_bytes(self.device),
                                device=str(self.device), dtype=str(_param_dtype(self.pipe.unet)).replace("torch.", ""),
                                optimizations=self.optimizations, notes=chk.notes + [note], metadata=[], cancelled=True)


def _graph_key_str(key) -> str:
    return f"{key.batch}x{key.height}x{key.width}, {key.steps} steps, {key.scheduler}" + (", CFG" if key.cfg else "")


# ==================================================================================================
# PNG round trip: parameters read back from an Atelier or A1111 PNG
# ==================================================================================================

def params_from_png(meta: dict) -> dict:
    """DiffusionParams keyword arguments (plus 'model') from `core.pnginfo.read_png_params` output.

    Atelier PNGs carry our own names; A1111 PNGs carry 'sampler' (+ 'schedule_type'), 'cfg_scale',
    'denoising_strength'. Unknown A1111 samplers raise InputError naming the ones we have.
    """
    out: dict[str, Any] = {}
    if meta.get("source") == "a1111":
        out["scheduler"] = resolve_scheduler_name(meta.get("sampler"), meta.get("schedule_type"))
        if "cfg_scale" in meta:
            out["guidance"] = float(meta["cfg_scale"])
    else:
        if meta.get("scheduler"):
            out["scheduler"] = resolve_scheduler_name(meta["scheduler"])
        if "guidance" in meta:
            out["guidance"] = float(meta["guidance"])
        if meta.get("task") == "img2img" and meta.get("strength") is not None:
            out["strength"] = float(meta["strength"])
            if meta.get("init_image"):
                out["init_image"] = meta["init_image"]
    for key in ("prompt", "negative_prompt", "seed", "steps", "width", "height"):
        if meta.get(key) is not None:
            out[key] = meta[key]
    if meta.get("model"):
        out["model"] = meta["model"]
    if meta.get("model_hash"):
        out["model_hash"] = meta["model_hash"]
    return out


def sampler_steps(steps: int, strength: float | None = None) -> int:
    """The steps a person asked for: `steps`, or for img2img the part `strength` keeps (as diffusers and A1111)."""
    steps = int(steps)
    if strength is None:
        return steps
    return max(1, min(int(steps * float(strength)), steps))


def step_counter(i: int, timesteps: int, asked: int) -> tuple[int, int]:
    """(done, total) for the step counter after callback `i` of `timesteps` callbacks, counted in the steps asked for.

    Some samplers call back more often than there are steps: PNDM (SD 1.x's default) once more for its warm-up,
    Heun twice per step. The counter reads N/N for N steps either way (N only at the last callback), rising by
    at most one per callback."""
    total = max(1, min(int(asked), int(timesteps)))
    n = max(1, int(timesteps))
    if n == 1:
        return 1, 1
    # 1 at the first callback, N only at the last, never a jump: (N-1)/(n-1) <= 1
    return min(total, 1 + (min(i, n - 1) * (total - 1)) // (n - 1)), total


def defaults_for(arch: str, path: str | None = None) -> dict:
    """UI defaults for a model: its native size, steps and guidance. A diffusers folder's own configs know its
    size better than its family does (a tiny test model, a 768 px fine-tune of SD 1.5)."""
    info = dcat.ARCH_INFO[arch]
    size = (dcat.folder_native_size(path) if path and Path(path).is_dir() else None) or info.native_size
    return {"width": size, "height": size, "steps": info.steps, "guidance": info.guidance,
            "scheduler": info.scheduler}
