"""Generation parameters inside PNG files.

Atelier writes one `tEXt` chunk named `atelier` holding a JSON object with
everything needed to reproduce the image, plus an A1111-style `parameters`
chunk so other tools show something sensible. It reads both, and A1111's
`parameters` chunk from images made elsewhere.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from PIL import Image, PngImagePlugin

from core.atomic import write_atomic
from core.errors import InputError

CHUNK = "atelier"
FORMAT_VERSION = 1


def _png_info(params: dict[str, Any], a1111_text: str | None = None) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    payload = {"format": f"atelier/{FORMAT_VERSION}", **params}
    info.add_text(CHUNK, json.dumps(payload, sort_keys=True, default=_jsonable))
    info.add_text("parameters", a1111_text if a1111_text is not None else to_a1111_text(params))
    return info


def save_png(image: Image.Image, path: str | Path, params: dict[str, Any]) -> Path:
    """Write `image` with `params` embedded; returns the path written.

    Written at a temporary name in the same folder and moved into place (core.atomic), so a kill
    mid-save never leaves a 0-byte or truncated PNG where the gallery serves it."""
    info = _png_info(params)
    # zlib level 1: still lossless, about 10% larger and a quarter faster than the default 6 (1024²:
    # 126 vs 168 ms on the CI CPU), and this write sits between Generate and pixels in the browser.
    return write_atomic(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info, compress_level=1))


def png_bytes(image: Image.Image, params: dict[str, Any], a1111_text: str | None = None) -> bytes:
    """The PNG file `save_png` would write, in memory (`a1111_text` replaces the derived `parameters` text)."""
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=_png_info(params, a1111_text))
    return buf.getvalue()


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def read_png_params(path_or_image: str | Path | Image.Image) -> dict[str, Any]:
    """Parameters from an Atelier or A1111 PNG. Raises InputError when there are none."""
    if isinstance(path_or_image, Image.Image):
        im = path_or_image
        name = "image"
    else:
        p = Path(path_or_image)
        if not p.is_file():
            raise InputError(f"file not found: {p}")
        name = p.name
        try:
            im = Image.open(p)
            im.load()
        except Exception as exc:
            raise InputError(f"{name} is not a readable image: {exc}") from None
    text = getattr(im, "text", None) or im.info
    if CHUNK in text:
        try:
            data = json.loads(text[CHUNK])
        except json.JSONDecodeError:
            raise InputError(f"{name} has a damaged '{CHUNK}' metadata chunk") from None
        data["source"] = "atelier"
        return data
    if "parameters" in text:
        data = parse_a1111(text["parameters"])
        data["source"] = "a1111"
        return data
    raise InputError(f"{name} carries no generation parameters (no '{CHUNK}' or 'parameters' text chunk)")


_KV = re.compile(r'\s*([\w \-/]+):\s*("(?:\\.|[^\\"])*"|[^,]*)(?:,|$)')
_A1111_KEYS = {
    "steps": ("steps", int),
    "sampler": ("sampler", str),
    "schedule type": ("schedule_type", str),
    "cfg scale": ("cfg_scale", float),
    "seed": ("seed", int),
    "model hash": ("model_hash", str),
    "model": ("model", str),
    "denoising strength": ("denoising_strength", float),
    "clip skip": ("clip_skip", int),
}


def parse_a1111(text: str) -> dict[str, Any]:
    """Parse A1111's `parameters` text: prompt lines, 'Negative prompt:' lines, then 'Key: value, …'."""
    lines = text.strip().split("\n")
    settings_line = ""
    if lines and re.match(r"^\s*Steps:\s*\d", lines[-1]):
        settings_line = lines.pop()
    prompt_lines, neg_lines, in_neg = [], [], False
    for line in lines:
        if line.startswith("Negative prompt:"):
            in_neg = True
            line = line[len("Negative prompt:"):].lstrip()
        (neg_lines if in_neg else prompt_lines).append(line)
    out: dict[str, Any] = {
        "prompt": "\n".join(prompt_lines).strip(),
        "negative_prompt": "\n".join(neg_lines).strip(),
    }
    extra: dict[str, str] = {}
    for key, value in _KV.findall(settings_line):
        key, value = key.strip(), value.strip()
        if value.startswith('"') and value.endswith('"'):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = value[1:-1]
        k = key.lower()
        if k == "size":
            m = re.match(r"(\d+)x(\d+)", value)
            if m:
                out["width"], out["height"] = int(m.group(1)), int(m.group(2))
            continue
        if k in _A1111_KEYS:
            name, conv = _A1111_KEYS[k]
            try:
                out[name] = conv(value)
            except ValueError:
                extra[key] = value
        else:
            extra[key] = value
    out["extra"] = extra
    return out


def to_a1111_text(params: dict[str, Any]) -> str:
    """A best-effort A1111 `parameters` text for other tools' PNG-info readers."""
    lines = []
    if params.get("prompt"):
        lines.append(str(params["prompt"]))
    if params.get("negative_prompt"):
        lines.append(f"Negative prompt: {params['negative_prompt']}")
    kv = []
    for key, label in (("steps", "Steps"), ("scheduler", "Sampler"), ("guidance", "CFG scale"), ("seed", "Seed")):
        if params.get(key) is not None:
            kv.append(f"{label}: {params[key]}")
    if params.get("width") and params.get("height"):
        kv.append(f"Size: {params['width']}x{params['height']}")
    if params.get("model_hash"):
        kv.append(f"Model hash: {params['model_hash']}")
    if params.get("model"):
        kv.append(f"Model: {Path(str(params['model'])).stem}")
    if params.get("truncation_psi") is not None:
        kv.append(f"Truncation psi: {params['truncation_psi']}")
    if params.get("truncation_centre"):
        kv.append(f"Truncation centre: {params['truncation_centre']}")
    kv.append(f"Backend: {params.get('backend', '?')}")
    kv.append("Version: atelier")
    if not any(k.startswith("Steps") for k in kv):
        kv.insert(0, "Steps: 1")   # A1111 readers look for 'Steps:' to find the settings line
    lines.append(", ".join(kv))
    return "\n".join(lines)
