"""What a diffusion checkpoint is, without running it: architecture detection, the
bundled configs that let single files load offline, and the catalogue of models.

Architectures this backend runs (the names travel in metadata and the catalogue):

| arch         | family | native size | what it is                                        |
| ------------ | ------ | ----------- | ------------------------------------------------- |
| `sd15`       | sd     | 512         | SD 1.x and its fine-tunes (CLIP ViT-L text tower) |
| `sd2`        | sd     | 512         | SD 2.x base, ε-prediction (OpenCLIP ViT-H)        |
| `sd2-v`      | sd     | 768         | SD 2.x 768, v-prediction                          |
| `sd-turbo`   | sd     | 512         | SD-Turbo (SD 2.1 distilled, 1–4 steps, no CFG)    |
| `sdxl`       | sdxl   | 1024        | SDXL base and its fine-tunes (two text towers)    |
| `sdxl-turbo` | sdxl   | 512         | SDXL-Turbo                                        |

Detection reads only names, shapes and JSON configs (a safetensors header, a
`model_index.json`), never tensors, so listing a folder of 7 GB files is instant.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from core.errors import ModelLoadError
from models.catalogue_types import CatalogueEntry

ROOT = Path(__file__).resolve().parent.parent
CONFIG_ROOT = ROOT / "assets" / "diffusion_configs"
CLIP_MERGES_FILE = CONFIG_ROOT / "clip_merges.txt.gz"

ARCHS = ("sd15", "sd2", "sd2-v", "sd-turbo", "sdxl", "sdxl-turbo")
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


@dataclass(frozen=True)
class ArchInfo:
    family: str                 # 'sd' | 'sdxl': which diffusers pipeline classes run it
    native_size: int            # the resolution it was trained at
    steps: int                  # sensible defaults for a UI
    guidance: float
    scheduler: str              # the default sampler popular web UIs pick for it
    description: str


ARCH_INFO: dict[str, ArchInfo] = {
    "sd15": ArchInfo("sd", 512, 25, 7.0, "default", "Stable Diffusion 1.x"),
    "sd2": ArchInfo("sd", 512, 25, 7.0, "default", "Stable Diffusion 2.x (512, ε-prediction)"),
    "sd2-v": ArchInfo("sd", 768, 25, 7.0, "default", "Stable Diffusion 2.x (768, v-prediction)"),
    "sd-turbo": ArchInfo("sd", 512, 1, 0.0, "default", "SD-Turbo (1–4 steps, guidance 0)"),
    "sdxl": ArchInfo("sdxl", 1024, 30, 6.0, "default", "Stable Diffusion XL"),
    "sdxl-turbo": ArchInfo("sdxl", 512, 1, 0.0, "default", "SDXL-Turbo (1–4 steps, guidance 0)"),
}


def config_dir(arch: str) -> Path:
    """The bundled diffusers-layout config folder for `arch` (JSON only, no weights)."""
    if arch not in ARCH_INFO:
        raise ModelLoadError(f"unknown diffusion architecture {arch!r}; known: {', '.join(ARCHS)}")
    d = CONFIG_ROOT / arch
    if not (d / "model_index.json").is_file():
        raise ModelLoadError(f"the bundled config for {arch} is missing: {d / 'model_index.json'} "
                             f"(reinstall the app's assets/ folder)")
    return d


# -- the CLIP tokenizer vocabulary ------------------------------------------------------------
# Every SD text tower uses OpenAI CLIP's byte-level BPE. Its merges ship gzipped (200 KB) in
# assets/; vocab.json (49408 tokens) is rebuilt from them the same way CLIP's own tokenizer
# builds it: 256 byte symbols, the same with an end-of-word mark, one token per merge, then
# the two special tokens.

def _byte_symbols() -> list[str]:
    """CLIP/GPT-2 byte-to-unicode table: printable bytes map to themselves, the rest to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of the CLIP BPE tokenizer, from the bundled merges file."""
    if not CLIP_MERGES_FILE.is_file():
        raise ModelLoadError(
            f"the CLIP tokenizer file {CLIP_MERGES_FILE} is missing, so single-file checkpoints cannot be "
            f"tokenized offline. Restore it from the app's assets/, or load a diffusers folder or hub id "
            f"(those carry their own tokenizer files).")
    try:
        lines = gzip.decompress(CLIP_MERGES_FILE.read_bytes()).decode("utf-8").split("\n")
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise ModelLoadError(f"the CLIP tokenizer file {CLIP_MERGES_FILE} is damaged ({exc}); restore it from assets/") from None
    merges = [tuple(line.split()) for line in lines[1:] if line.strip()]
    if len(merges) != 48894 or any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"the CLIP tokenizer file {CLIP_MERGES_FILE} has {len(merges)} merges, expected 48894; restore it")
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges  # type: ignore[return-value]


# -- detection ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Detection:
    arch: str
    needs_v_probe: bool = False           # SD 2.x single file: ε or v cannot be told from names/shapes
    notes: tuple[str, ...] = field(default_factory=tuple)


_TURBO = re.compile(r"turbo", re.I)
_V_HINT = re.compile(r"(^|[^a-z])(v[-_ ]?pred|vpred|768[-_]?v|v[-_]?768)([^a-z]|$)|768", re.I)
_BASE_HINT = re.compile(r"(^|[^a-z0-9])(base|512)([^a-z0-9]|$)", re.I)

UNET = "model.diffusion_model."


def detect_from_keys(shapes: dict[str, tuple[int, ...]], name_hint: str = "") -> Detection:
    """Architecture of an original-layout (LDM / A1111 / Civitai) checkpoint from its key names and shapes.

    `shapes` maps key -> shape; `name_hint` is the file name, used only where the weights cannot tell
    (turbo vs. base, which share a layout).
    """
    keys = shapes.keys()
    has = lambda prefix: any(k.startswith(prefix) for k in keys)  # noqa: E731
    name = Path(name_hint).name
    other = _other_family(keys)
    if other:
        raise ModelLoadError(f"{name or 'this file'} looks like {other}; this backend runs Stable Diffusion "
                             f"1.x/2.x/XL checkpoints (and their Turbo versions)")
    if not has(UNET + "input_blocks."):
        if has("down_blocks.") or has("unet."):
            raise ModelLoadError(f"{name or 'this file'} holds diffusers-layout weights, not a full checkpoint; "
                                 f"give the folder that holds model_index.json instead")
        sample = ", ".join(sorted(keys)[:3]) or "no tensors"
        raise ModelLoadError(f"no Stable Diffusion UNet found in {name or 'this file'} (no '{UNET}*' keys; it starts with {sample}). "
                             f"Is it a LoRA, VAE or embedding rather than a full checkpoint?")
    conv_in = shapes.get(UNET + "input_blocks.0.0.weight")
    in_ch = conv_in[1] if conv_in and len(conv_in) == 4 else 4
    if in_ch != 4:
        what = {9: "an inpainting checkpoint", 8: "an instruct-pix2pix checkpoint"}.get(in_ch, f"a {in_ch}-channel UNet")
        raise ModelLoadError(f"{name or 'this file'} is {what}; this backend runs text-to-image and "
                             f"image-to-image checkpoints with a 4-channel UNet")
    if has("conditioner.embedders.1.model."):
        return Detection("sdxl-turbo" if _TURBO.search(name) else "sdxl")
    if has("conditioner.embedders.0.model."):
        raise ModelLoadError(f"{name or 'this file'} is an SDXL refiner; load the SDXL base model "
                             f"(the refiner only polishes a base model's latents)")
    if has("cond_stage_model.model."):
        if _TURBO.search(name):
            return Detection("sd-turbo")
        if _V_HINT.search(name):
            return Detection("sd2-v")
        if _BASE_HINT.search(name):
            return Detection("sd2")
        return Detection("sd2", needs_v_probe=True)
    if has("cond_stage_model.transformer."):
        return Detection("sd15")
    if has("cond_stage_model."):
        raise ModelLoadError(f"{name or 'this file'} has a text encoder this backend does not know")
    raise ModelLoadError(f"{name or 'this file'} has a UNet but no text encoder (no 'cond_stage_model.*' or "
                         f"'conditioner.embedders.*' keys); full checkpoints carry both")


def _other_family(keys: Iterable[str]) -> str | None:
    ks = list(keys)
    if any(k.startswith(("joint_blocks.", UNET + "joint_blocks.")) for k in ks):
        return "a Stable Diffusion 3 checkpoint"
    if any(k.startswith(("double_blocks.", UNET + "double_blocks.")) for k in ks):
        return "a FLUX checkpoint"
    if any(k.startswith(("lora_unet_", "lora_te")) or ".lora_" in k or "lora_up" in k for k in ks):
        return "a LoRA"
    if any(k.startswith(("encoder.down.", "decoder.up.")) for k in ks):
        return "a VAE on its own"
    return None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc})") from None


SUPPORTED_PIPELINES = {
    "StableDiffusionPipeline": "sd", "StableDiffusionImg2ImgPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl", "StableDiffusionXLImg2ImgPipeline": "sdxl",
    "LatentConsistencyModelPipeline": "sd",
}


def detect_from_folder(folder: str | Path, name_hint: str = "") -> Detection:
    """Architecture of a diffusers folder from model_index.json and the component configs."""
    folder = Path(folder)
    index = _read_json(folder / "model_index.json")
    cls = str(index.get("_class_name", ""))
    family = SUPPORTED_PIPELINES.get(cls)
    if family is None:
        raise ModelLoadError(f"{name_hint or folder} is a {cls or 'unnamed'} model; this backend runs Stable Diffusion "
                             f"1.x/2.x/XL pipelines (StableDiffusionPipeline, StableDiffusionXLPipeline)")
    unet = _read_json(folder / "unet" / "config.json")
    sched_path = folder / "scheduler" / "scheduler_config.json"
    sched = _read_json(sched_path) if sched_path.is_file() else {}
    if int(unet.get("in_channels", 4)) != 4:
        raise ModelLoadError(f"{name_hint or folder} has a {unet.get('in_channels')}-channel UNet (inpainting or "
                             f"instruct-pix2pix); this backend runs 4-channel text-to-image models")
    name = f"{name_hint} {folder}"
    trailing = sched.get("timestep_spacing") == "trailing"
    if family == "sdxl" or unet.get("addition_embed_type") == "text_time":
        if "text_encoder" not in index or index.get("text_encoder") in (None, [None, None]):
            raise ModelLoadError(f"{name_hint or folder} is an SDXL refiner; load the SDXL base model")
        turbo = bool(_TURBO.search(name)) or (trailing and int(unet.get("sample_size", 128)) <= 64)
        return Detection("sdxl-turbo" if turbo else "sdxl")
    v_pred = sched.get("prediction_type") == "v_prediction"
    te_path = folder / "text_encoder" / "config.json"
    te = _read_json(te_path) if te_path.is_file() else {}
    cross = unet.get("cross_attention_dim")
    # SD 2.x uses OpenCLIP (gelu) with linear projections; SD 1.x OpenAI CLIP (quick_gelu). Tiny test models have
    # odd widths, so the activation decides when the width is not one of the real ones.
    sd2 = cross == 1024 or (cross != 768 and (te.get("hidden_act") == "gelu" or unet.get("use_linear_projection")))
    if not sd2:
        return Detection("sd15")
    if _TURBO.search(name) or (trailing and not v_pred):
        return Detection("sd-turbo")
    return Detection("sd2-v" if v_pred else "sd2")


def folder_native_size(folder: str | Path) -> int | None:
    """The resolution a diffusers folder was built for, from its configs: the UNet's latent `sample_size` times
    the VAE's scale factor (2 ** (VAE blocks - 1), 8 in every SD model). None when the configs do not say."""
    folder = Path(folder)
    try:
        unet = json.loads((folder / "unet" / "config.json").read_text())
        vae = json.loads((folder / "vae" / "config.json").read_text())
        sample = unet.get("sample_size")
        sample = sample[0] if isinstance(sample, (list, tuple)) else sample
        blocks = len(vae.get("block_out_channels") or ())
    except (OSError, json.JSONDecodeError, AttributeError, IndexError):
        return None
    if not isinstance(sample, int) or sample <= 0 or blocks < 1:
        return None
    return sample * 2 ** (blocks - 1)


# -- well-known hub models ----------------------------------------------------------------------
# Sizes are the diffusers-format safetensors a download fetches (fp32 unless noted), rounded;
# a user picks by size and licence before downloading.

KNOWN_HUB_MODELS: list[CatalogueEntry] = [
    CatalogueEntry("stable-diffusion-v1-5/stable-diffusion-v1-5", "diffusion", "sd15", "hub", None, 5_480_000_000,
                   "creativeml-openrail-m",
                   "SD 1.5, 512 px (the community copy of runwayml/stable-diffusion-v1-5, which was taken down); "
                   "≈5.5 GB incl. safety checker"),
    CatalogueEntry("stabilityai/stable-diffusion-2-1-base", "diffusion", "sd2", "hub", None, 5_160_000_000,
                   "openrail++", "SD 2.1 base, 512 px, ε-prediction; ≈5.2 GB"),
    CatalogueEntry("stabilityai/stable-diffusion-2-1", "diffusion", "sd2-v", "hub", None, 5_160_000_000,
                   "openrail++", "SD 2.1, 768 px, v-prediction; ≈5.2 GB"),
    CatalogueEntry("stabilityai/sd-turbo", "diffusion", "sd-turbo", "hub", None, 5_200_000_000,
                   "sai-nc-community", "SD-Turbo, 512 px, 1–4 steps, guidance 0; non-commercial licence; ≈5.2 GB"),
    CatalogueEntry("stabilityai/stable-diffusion-xl-base-1.0", "diffusion", "sdxl", "hub", None, 13_900_000_000,
                   "openrail++", "SDXL base 1.0, 1024 px; ≈13.9 GB (≈6.9 GB as the fp16 variant)"),
    CatalogueEntry("stabilityai/sdxl-turbo", "diffusion", "sdxl-turbo", "hub", None, 13_900_000_000,
                   "sai-nc-community", "SDXL-Turbo, 512 px, 1–4 steps, guidance 0; non-commercial licence; ≈13.9 GB"),
    CatalogueEntry("SimianLuo/LCM_Dreamshaper_v7", "diffusion", "sd15", "hub", None, 4_270_000_000,
                   "mit", "Latent Consistency Model (SD 1.5 based): use the lcm scheduler, 4–8 steps, guidance 1–2; ≈4.3 GB"),
]

# Hub ids that moved: the old name still appears in A1111 metadata and tutorials.
HUB_ALIASES = {"runwayml/stable-diffusion-v1-5": "stable-diffusion-v1-5/stable-diffusion-v1-5"}


# -- scanning ---------------------------------------------------------------------------------------

def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape from a safetensors header, without reading any tensor data."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types; all mean the same to a user
        raise ModelLoadError(f"{Path(path).name} is not a readable safetensors file ({exc}); "
                             f"the download may be incomplete: compare its size with the source") from None


def _folder_size(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total


def _is_stylegan_file(p: Path) -> bool:
    side = p.with_suffix(".json")
    if not side.is_file():
        return False
    try:
        return str(json.loads(side.read_text()).get("format", "")).startswith("atelier-stylegan")
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def scan_diffusion_models(dirs: Iterable[str | Path], include_hf_cache: bool = True) -> list[CatalogueEntry]:
    """Diffusers folders and single-file checkpoints in `dirs` (one level down), plus models in the HF cache."""
    out: list[CatalogueEntry] = []
    for d in dirs:
        d = Path(d)
        if d.is_file():
            candidates = [d]
        elif d.is_dir():
            candidates = [d] + sorted(d.iterdir())
            candidates += sorted(c for sub in candidates[1:] if sub.is_dir() for c in sub.iterdir())
        else:
            continue
        for p in candidates:
            entry = _entry_for_path(p)
            if entry is not None:
                out.append(entry)
    if include_hf_cache:
        out.extend(scan_hf_cache())
    seen, uniq = set(), []
    for e in out:
        if e.id not in seen:
            seen.add(e.id)
            uniq.append(e)
    return uniq


def _entry_for_path(p: Path) -> CatalogueEntry | None:
    try:
        if p.is_dir() and (p / "model_index.json").is_file():
            try:
                det = detect_from_folder(p)
                kind, desc = det.arch, f"diffusers folder ({ARCH_INFO[det.arch].description})"
            except ModelLoadError as exc:
                return CatalogueEntry(str(p), "diffusion", "unsupported", "local", str(p), _folder_size(p), None, str(exc))
            return CatalogueEntry(str(p), "diffusion", kind, "local", str(p), _folder_size(p), _license_of(p), desc)
        if not p.is_file() or p.suffix.lower() not in (".safetensors", ".ckpt"):
            return None
        if p.suffix.lower() == ".safetensors":
            if _is_stylegan_file(p):
                return None
            try:
                det = detect_from_keys(safetensors_shapes(p), p.name)
            except ModelLoadError:
                return None    # a LoRA, VAE or embedding next to the checkpoints: not something to pick here
            kind = det.arch
            desc = f"single-file checkpoint ({ARCH_INFO[kind].description}" + (", ε or v decided at load" if det.needs_v_probe else "") + ")"
        else:
            kind, desc = "sd (ckpt)", "pickled checkpoint: read weights-only, architecture detected at load"
        return CatalogueEntry(str(p), "diffusion", kind, "local", str(p), p.stat().st_size, None, desc)
    except OSError:
        return None


def _license_of(folder: Path) -> str | None:
    readme = folder / "README.md"
    if readme.is_file():
        try:
            m = re.search(r"^license:\s*(\S+)", readme.read_text(errors="replace")[:4000], re.M)
            return m.group(1) if m else None
        except OSError:
            return None
    return None


def scan_hf_cache(cache_dir: str | Path | None = None) -> list[CatalogueEntry]:
    """Diffusion pipelines already in the Hugging Face cache (usable offline)."""
    try:
        from huggingface_hub import scan_cache_dir
        info = scan_cache_dir(cache_dir)
    except Exception:   # no cache yet (CacheNotFound), or an unreadable one: nothing to list
        return []
    known = {e.id: e for e in KNOWN_HUB_MODELS}
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            snap = Path(rev.snapshot_path)
            if not (snap / "model_index.json").is_file():
                continue
            try:
                kind = detect_from_folder(snap, repo.repo_id).arch
            except ModelLoadError:
                break
            k = known.get(repo.repo_id)
            out.append(CatalogueEntry(repo.repo_id, "diffusion", kind, "hf-cache", str(snap), int(repo.size_on_disk),
                                      k.license if k else _license_of(snap),
                                      f"in the Hugging Face cache ({ARCH_INFO[kind].description})"))
            break
    return out
