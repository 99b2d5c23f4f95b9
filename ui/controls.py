"""Control values <-> requests. No Gradio here: the event handlers pass plain values in,
so the same functions build requests for the browser, the Gradio client and tests."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from core.errors import InputError
from core.types import (SEED_MAX, DiffusionParams, GenerationRequest, OptimizationFlags, StyleGANParams, check_seed,
                        parse_seeds)

SG_MODES = ("images", "style-mix", "interpolate")
SIZE_PRESETS = (
    "512×512 · square",
    "768×768 · square",
    "1024×1024 · square (SDXL)",
    "512×768 · portrait",
    "768×512 · landscape",
    "832×1216 · portrait (SDXL)",
    "1216×832 · landscape (SDXL)",
    "1024×576 · 16:9",
)
# the diffusion pipeline's own names (pipelines.diffusion.SCHEDULER_NAMES), if it cannot be imported
DEFAULT_SCHEDULERS = ("default", "euler", "euler-a", "dpm++2m", "dpm++2m-karras", "ddim", "unipc", "lcm")
MEMORY_SAVERS = ("attention-slicing", "vae-tiling", "vae-slicing", "cpu-offload")


def random_seed() -> int:
    return random.randint(0, 2**31 - 1)


def parse_size(text: str) -> tuple[int, int]:
    """'768×512 · landscape' or '640x480' -> (width, height); multiples of 8 as latent models need."""
    m = re.match(r"\s*(\d+)\s*[x×*]\s*(\d+)", str(text or ""))
    if not m:
        raise InputError(f"size {text!r} is not WIDTHxHEIGHT (e.g. 768x512)")
    w, h = int(m.group(1)), int(m.group(2))
    if not (64 <= w <= 4096 and 64 <= h <= 4096):
        raise InputError(f"size {w}×{h} is out of range: each side must be within 64..4096")
    if w % 8 or h % 8:
        raise InputError(f"size {w}×{h}: width and height must be multiples of 8")
    return w, h


def size_label(width: int, height: int) -> str:
    for p in SIZE_PRESETS:
        if parse_size(p) == (int(width), int(height)):
            return p
    return f"{int(width)}×{int(height)}"


def format_seeds(seeds) -> str:
    """(0, 1, 2, 3, 7) -> '0-3,7'."""
    seeds = [int(s) for s in seeds]
    parts, i = [], 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{seeds[i]}-{seeds[j]}")
        else:
            parts.extend(str(s) for s in seeds[i:j + 1])
        i = j + 1
    return ",".join(parts)


def _opt_int(v) -> int | None:
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise InputError(f"expected a whole number, got {v!r}") from None
    if not f.is_integer():
        raise InputError(f"expected a whole number, got {v!r}")
    return int(f)


def _opt_class(v) -> int | str | None:
    """The Class box: empty = none (the seed picks), a whole number = an index, other text = a class name
    the model's file lists (the pipeline resolves it and says which names exist when it does not match)."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, str) and not v.strip().lstrip("+-").replace(".", "", 1).isdigit():
        return v.strip()
    return _opt_int(v)


def flags_from_controls(precision: str = "fp32", channels_last: bool = False, attention: str = "sdpa",
                        compile_mode: str = "off", fp8: bool = False, prune_amount: float = 0.0,
                        tensorrt: bool = False, memory_savers=(), prune_method: str = "l1-unstructured",
                        fuse_qkv: bool = False, request_graph: bool = False,
                        tiny_vae: bool = False) -> OptimizationFlags:
    return OptimizationFlags(precision=precision or "fp32", channels_last=bool(channels_last),
                             attention=attention or "sdpa", compile=compile_mode or "off", fp8=bool(fp8),
                             prune_amount=float(prune_amount or 0.0), prune_method=prune_method or "l1-unstructured",
                             tensorrt=bool(tensorrt), memory=tuple(memory_savers or ()), fuse_qkv=bool(fuse_qkv),
                             request_graph=bool(request_graph), tiny_vae=bool(tiny_vae))


def stylegan_params(seed_text: str, psi: float, cutoff, noise_mode: str, class_index, batch_size,
                    centre: str | None = "class") -> StyleGANParams:
    return StyleGANParams(seeds=parse_seeds(seed_text or "0"), truncation_psi=float(psi),
                          truncation_cutoff=_opt_int(cutoff) or None, noise_mode=noise_mode or "const",
                          class_index=_opt_class(class_index), batch_size=max(1, _opt_int(batch_size) or 1),
                          truncation_centre=centre if centre not in (None, "") else "class")


def diffusion_seed(seed_text: str) -> int:
    """One seed for diffusion; empty or -1 means a fresh random one (recorded in the PNG)."""
    t = str(seed_text or "").strip()
    if t in ("", "-1"):
        return random_seed()
    if not re.fullmatch(r"\d+", t):
        raise InputError(f"the diffusion seed is one whole number in 0..{SEED_MAX} (or empty for random); got {t!r}")
    return check_seed(t)


# the studio's "Preview with" dropdown: (label, DiffusionParams.preview_method)
PREVIEW_CHOICES = [("Auto", "auto"), ("Latent map (fastest)", "latent"), ("TAESD (tiny autoencoder)", "taesd"),
                   ("Full VAE (exact, slowest)", "full")]


def diffusion_params(prompt: str, negative_prompt: str, seed_text: str, steps, guidance, size: str, scheduler: str,
                     batch_size, init_image: str | None, strength, preview_every,
                     preview_method: str | None = "auto") -> DiffusionParams:
    if not str(prompt or "").strip():
        raise InputError("write a prompt first: the diffusion backend needs a text prompt")
    w, h = parse_size(size)
    steps = _opt_int(steps) or 0
    if not (1 <= steps <= 200):
        raise InputError(f"steps must be within 1..200; got {steps}")
    strength = float(strength if strength is not None else 0.75)
    if init_image and not (0.0 < strength <= 1.0):
        raise InputError(f"image-to-image strength must be in (0, 1]; got {strength}")
    return DiffusionParams(prompt=str(prompt).strip(), negative_prompt=str(negative_prompt or "").strip(),
                           seed=diffusion_seed(seed_text), steps=steps, guidance=float(guidance), width=w, height=h,
                           scheduler=scheduler or "default", batch_size=max(1, _opt_int(batch_size) or 1),
                           init_image=init_image or None, strength=strength,
                           preview_every=max(0, _opt_int(preview_every) or 0),
                           preview_method=str(preview_method or "auto").strip().lower())


@dataclass(frozen=True)
class MixSpec:
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    layers: tuple[int, int]


def mix_spec(rows_text: str, cols_text: str, lo, hi) -> MixSpec:
    rows, cols = parse_seeds(rows_text), parse_seeds(cols_text)
    if len(rows) * len(cols) > 256:
        raise InputError(f"style mixing of {len(rows)}×{len(cols)} seeds is too large; keep rows × columns ≤ 256")
    lo_i, hi_i = _opt_int(lo), _opt_int(hi)
    if lo_i is None or hi_i is None:
        raise InputError("give the style layers to mix as from/to numbers, e.g. 0 and 6 for coarse styles")
    return MixSpec(rows, cols, (lo_i, hi_i))


@dataclass(frozen=True)
class JobSpec:
    """What one press of Generate asks for."""

    request: GenerationRequest
    kind: str                                  # images | style-mix | interpolate | diffusion | compare
    mix: MixSpec | None = None
    frames_per_seed: int = 24
    space: str = "w"
    animation_format: str = "gif"
    fps: int = 24


MAX_SEEDS = 10000


def job_spec(v: dict[str, Any], device: str | None = None) -> JobSpec:
    """The studio's control values (by name, as `generate` receives them) -> the job to run.
    Raises InputError with a message for the artist when a value is out of range."""
    flags = flags_from_controls(v.get("precision", "fp32"), v.get("channels_last", False), v.get("attention", "sdpa"),
                                v.get("compile_mode", "off"), v.get("fp8", False), v.get("prune_amount", 0.0),
                                v.get("tensorrt", False), v.get("memory_savers", ()),
                                v.get("prune_method", "l1-unstructured"), v.get("fuse_qkv", False),
                                v.get("request_graph", False), v.get("tiny_vae", False))
    backend = v.get("backend") or "stylegan"
    model = (v.get("model") or "").strip() or None
    if backend == "diffusion":
        params = diffusion_params(v.get("prompt", ""), v.get("negative_prompt", ""), v.get("seed", ""),
                                  v.get("steps", 25), v.get("guidance", 7.0), v.get("size", SIZE_PRESETS[0]),
                                  v.get("scheduler", "default"), v.get("batch_size", 1), v.get("init_image"),
                                  v.get("strength", 0.75), v.get("preview_every", 0), v.get("preview_method", "auto"))
        return JobSpec(GenerationRequest("diffusion", model, params, flags, device), "diffusion")
    if backend != "stylegan":
        raise InputError(f"backend must be stylegan or diffusion; got {backend!r}")
    mode = v.get("sg_mode") or "images"
    if mode not in SG_MODES:
        raise InputError(f"StyleGAN mode must be one of {', '.join(SG_MODES)}; got {mode!r}")
    params = stylegan_params(v.get("seed", "0"), v.get("truncation_psi", 1.0), v.get("truncation_cutoff"),
                             v.get("noise_mode", "const"), v.get("class_index"), v.get("sg_batch_size", 8),
                             v.get("truncation_centre", "class"))
    if len(params.seeds) > MAX_SEEDS:
        raise InputError(f"{len(params.seeds)} seeds is too many for one job; keep it under {MAX_SEEDS}")
    request = GenerationRequest("stylegan", model, params, flags, device)
    if mode == "style-mix":
        return JobSpec(request, mode, mix=mix_spec(v.get("mix_rows", ""), v.get("mix_cols", ""),
                                                   v.get("mix_from", 0), v.get("mix_to", 6)))
    if mode == "interpolate":
        if len(params.seeds) < 2:
            raise InputError("interpolation moves through the seeds in order: give at least two, e.g. 0,5,9")
        fmt = (v.get("animation_format") or "gif").lower()
        if fmt not in ("gif", "mp4"):
            raise InputError(f"animation format must be gif or mp4; got {fmt!r}")
        fps = _opt_int(v.get("fps", 24)) or 24
        if not (1 <= fps <= 60):
            raise InputError(f"frames per second must be within 1..60; got {fps}")
        return JobSpec(request, mode, frames_per_seed=_opt_int(v.get("frames_per_seed", 24)) or 24,
                       space=v.get("interp_space") or "w", animation_format=fmt, fps=fps)
    return JobSpec(request, "images")


def compare_spec(v: dict[str, Any], device: str | None = None) -> JobSpec:
    """The Compare button: the same images as Generate would make (StyleGAN: the seeds as plain
    images, whatever tab is open), run with the fp32 reference and with the chosen toggles."""
    spec = job_spec({**v, "sg_mode": "images"}, device)
    return JobSpec(spec.request, "compare")


# -- the reverse: saved parameters -> control values ------------------------------------------
def controls_from_params(meta: dict[str, Any]) -> dict[str, Any]:
    """Control values (by control name) from a PNG's or a result's parameters. Unknown keys are ignored."""
    out: dict[str, Any] = {}
    source = meta.get("source")
    if source == "a1111":
        out["backend"] = "diffusion"
        out["prompt"] = meta.get("prompt", "")
        out["negative_prompt"] = meta.get("negative_prompt", "")
        if meta.get("model"):
            out["model"] = str(meta["model"])       # A1111's `Model:` (the file's stem)
        if meta.get("seed") is not None:
            out["seed"] = str(meta["seed"])
        if meta.get("steps") is not None:
            out["steps"] = int(meta["steps"])
        if meta.get("cfg_scale") is not None:
            out["guidance"] = float(meta["cfg_scale"])
        if meta.get("width") and meta.get("height"):
            out["size"] = size_label(meta["width"], meta["height"])
        if meta.get("denoising_strength") is not None:
            out["strength"] = float(meta["denoising_strength"])
        if meta.get("sampler"):
            out["scheduler_hint"] = str(meta["sampler"])
            if meta.get("schedule_type"):
                out["schedule_type_hint"] = str(meta["schedule_type"])
        return out
    backend = meta.get("backend")
    if backend not in ("stylegan", "diffusion"):
        raise InputError(f"these parameters name no known backend ({backend!r}); nothing to send back")
    out["backend"] = backend
    if meta.get("model"):
        out["model"] = str(meta["model"])
    if backend == "stylegan":
        seeds = meta.get("seeds") or ([meta["seed"]] if meta.get("seed") is not None else None)
        if meta.get("mode") == "style-mix":
            out["sg_mode"] = "style-mix"
            out["mix_rows"] = format_seeds(meta.get("row_seeds", []))
            out["mix_cols"] = format_seeds(meta.get("col_seeds", []))
            lo, hi = meta.get("layers", (0, 6))
            out["mix_from"], out["mix_to"] = int(lo), int(hi)
        elif meta.get("mode") == "interpolate":
            out["sg_mode"] = "interpolate"
            out["frames_per_seed"] = int(meta.get("frames_per_seed", 24))
            out["interp_space"] = meta.get("space", "w")
        else:
            out["sg_mode"] = "images"
        if seeds:
            out["seed"] = format_seeds(seeds)
        for key in ("truncation_psi", "noise_mode"):
            if meta.get(key) is not None:
                out[key] = meta[key]
        out["truncation_cutoff"] = meta.get("truncation_cutoff")
        out["class_index"] = meta.get("class_index")
        # images saved before the centre was recorded were truncated towards w_avg: restore that
        out["truncation_centre"] = meta.get("truncation_centre") or "global"
    else:
        for key in ("prompt", "negative_prompt", "steps", "guidance", "scheduler", "strength"):
            if meta.get(key) is not None:
                out[key] = meta[key]
        if meta.get("seed") is not None:
            out["seed"] = str(meta["seed"])
        if meta.get("width") and meta.get("height"):
            out["size"] = size_label(meta["width"], meta["height"])
    flags = meta.get("flags")
    if isinstance(flags, dict):
        f = OptimizationFlags.from_dict(flags)
        out.update(precision=f.precision, channels_last=f.channels_last, attention=f.attention,
                   compile_mode=f.compile, fp8=f.fp8, prune_amount=f.prune_amount, prune_method=f.prune_method,
                   tensorrt=f.tensorrt, memory_savers=list(f.memory), fuse_qkv=f.fuse_qkv,
                   request_graph=f.request_graph, tiny_vae=f.tiny_vae)
    return out


# -- seeds across runs: the field's value per backend, ♻ reuse, the seed a result used --------------
DEFAULT_SEED_TEXT = {"stylegan": "0-7", "diffusion": ""}     # diffusion: empty = a fresh random seed
SEED_LABELS = {"stylegan": "Seeds (e.g. 0-7, 42)", "diffusion": "Seed (empty = random)"}


def seed_label(backend: str) -> str:
    return SEED_LABELS.get(backend, SEED_LABELS["stylegan"])


def _item_seeds(params: dict) -> list[int]:
    if params.get("seeds"):
        return [int(s) for s in params["seeds"]]
    return [int(params["seed"])] if params.get("seed") is not None else []


def last_seed_text(results_params: list[dict], backend: str, selected: int | None = None) -> str:
    """What ♻ puts in the seed field: the seed of the selected result (else the first) for diffusion, as
    A1111 does; the whole run's seeds for StyleGAN, whose field takes a list. Raises InputError when no
    result carries a seed yet."""
    if not results_params:
        raise InputError("no image yet: generate one, then ♻ puts its seed back in the field")
    if backend == "diffusion":
        pick = results_params[selected] if selected is not None and 0 <= selected < len(results_params) else results_params[0]
        seeds = _item_seeds(pick) or next((_item_seeds(p) for p in results_params if _item_seeds(p)), [])
        if not seeds:
            raise InputError("the last result records no seed to reuse")
        return str(seeds[0])
    seeds: list[int] = []
    for p in results_params:
        for s in _item_seeds(p):
            if s not in seeds:
                seeds.append(s)
    if not seeds:
        raise InputError("the last result records no seed to reuse")
    return format_seeds(seeds)


def seeds_used(results_params: list[dict]) -> str:
    """'seed 1234' or 'seeds 1234–1237' for a result line: the seeds the images were made with
    (a random seed is drawn when the field is empty, so the artist needs to read it somewhere)."""
    seeds = [s for p in results_params for s in _item_seeds(p)]
    if not seeds:
        return ""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {format_seeds(seeds)}"


# -- which catalogue entry a saved parameter set names --------------------------------------------
def _names_of(entry) -> set[str]:
    """Every way a saved parameter set may name `entry`: its id, its path (as given and resolved), the
    file or folder name and its stem (A1111 writes `Model: v1-5-pruned-emaonly`, the stem)."""
    from pathlib import Path

    names = {entry.id}
    for ref in (entry.id, entry.path):
        if not ref:
            continue
        p = Path(ref)
        names |= {ref, p.name, p.stem}
        try:
            names.add(str(p.expanduser().resolve()))
        except (OSError, RuntimeError):
            pass
    return {n for n in names if n}


def find_model(entries, name: str | None):
    """The entry among `entries` that `name` (a catalogue id, a path, a file name or an A1111 model name)
    refers to; None when none does. An exact id or path wins over a file-name match, so two files of the
    same name in different folders resolve to the one the parameters name by path."""
    if not name:
        return None
    name = str(name).strip()
    for e in entries:
        if name in (e.id, e.path):
            return e
    from pathlib import Path

    try:
        resolved = str(Path(name).expanduser().resolve())
    except (OSError, RuntimeError):
        resolved = name
    candidates = [e for e in entries if resolved in _names_of(e) or name in _names_of(e)
                  or Path(name).name in _names_of(e) or Path(name).stem in _names_of(e)]
    return candidates[0] if candidates else None
