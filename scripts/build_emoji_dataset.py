"""Build the bundled emoji training set from Debian's fonts-noto-color-emoji.

    python scripts/build_emoji_dataset.py [--font PATH] [--resolution 64] [--out assets/datasets/emoji64.npz]

Every glyph of Noto Color Emoji is reached through a character sequence (the
font's cmap for single code points, its GSUB ligatures for ZWJ sequences, flags,
keycaps and skin tones), rendered with Pillow's colour-bitmap support at the
font's only strike (109 ppem), centred on a fixed square canvas, composited on
white and resized with LANCZOS.

Why white: emoji are drawn to sit on light page backgrounds, Noto's light and
white glyphs carry grey outlines made for that, and a constant white border
is the easiest possible background for a small generator to learn, so its
capacity goes to the glyphs. Why a fixed canvas (not crop-and-zoom): all
glyphs share one em box, so small glyphs stay small and the data keeps the
font's consistent scale.

The default output is `emoji64.npy.xz`: an xz-compressed .npy of (N, R, R, 3)
uint8 (xz: 7 MiB where zlib .npz needs 11 MiB and PNGs 12 MiB), read back with
`np.load(lzma.open(path))`, plus a JSON sidecar with the count, the glyph
names (code points, e.g. "1f469-200d-1f4bb"), the source and the license
text. `.npz` and `.zip` (the NVlabs dataset_tool layout, PNG files) outputs
are also supported.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, features

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.errors import InputError, OptionalDependencyError  # noqa: E402

DEFAULT_FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
FONT_SIZE = 109        # the only bitmap strike in NotoColorEmoji.ttf; other sizes fail to load
CANVAS = 144           # square canvas at 109 ppem; the widest glyph bitmaps are 136 px
BACKGROUND = (255, 255, 255)

LICENSE_TEXT = """\
Images rendered from the Noto Color Emoji font (Debian package fonts-noto-color-emoji,
https://github.com/googlefonts/noto-emoji).
The emoji images are licensed under the Apache License, Version 2.0
(https://www.apache.org/licenses/LICENSE-2.0); the font file is licensed under the
SIL Open Font License, Version 1.1 (https://openfontlicense.org). Flag images are
in the public domain or otherwise exempt from copyright per upstream notes.
Copyright 2013-2023 Google LLC. Redistributed here as a derived, resized image set."""


def glyph_sequences(font_path: Path) -> list[str]:
    """One character string per glyph of the font, in glyph order.

    fontTools gives the full set (cmap + ligatures); without it only the cmap's
    single code points are reachable, through Pillow's own font reader."""
    try:
        from fontTools.ttLib import TTFont
    except ImportError:
        return _cmap_only_sequences(font_path)
    font = TTFont(str(font_path))
    strings: dict[str, str] = {}
    for cp, glyph in font.getBestCmap().items():
        strings.setdefault(glyph, chr(cp))
    ligatures: list[tuple[list[str], str]] = []
    if "GSUB" in font:
        for lookup in font["GSUB"].table.LookupList.Lookup:
            for sub in lookup.SubTable:
                if type(sub).__name__ == "ExtensionSubst":
                    sub = sub.ExtSubTable
                if type(sub).__name__ != "LigatureSubst":
                    continue
                for first, ligs in sub.ligatures.items():
                    for lig in ligs:
                        ligatures.append(([first, *lig.Component], lig.LigGlyph))
    # Ligatures are built from other ligatures (ZWJ families), so repeat until nothing new resolves.
    changed = True
    while changed:
        changed = False
        for parts, out in ligatures:
            if out not in strings and all(p in strings for p in parts):
                strings[out] = "".join(strings[p] for p in parts)
                changed = True
    return [strings[g] for g in font.getGlyphOrder() if g in strings]


def _cmap_only_sequences(font_path: Path) -> list[str]:
    print("fontTools is not installed: using single code points only (about 1,400 glyphs, no ZWJ "
          "sequences); `pip install fonttools` for the full set", file=sys.stderr)
    font = ImageFont.truetype(str(font_path), FONT_SIZE)
    out = []
    for cp in list(range(0x20, 0x3000)) + list(range(0x1F000, 0x1FB00)):
        ch = chr(cp)
        try:
            if font.getmask(ch).getbbox():
                out.append(ch)
        except OSError:
            continue
    return out


def render(font: ImageFont.FreeTypeFont, text: str, resolution: int) -> np.ndarray | str:
    """(R, R, 3) uint8 on white, or the reason it was dropped ("empty", "not_single_glyph")."""
    layer = Image.new("RGBA", (CANVAS * 2, CANVAS * 2), (0, 0, 0, 0))
    ImageDraw.Draw(layer).text((CANVAS // 2, CANVAS // 2), text, font=font, embedded_color=True)
    bbox = layer.getchannel("A").getbbox()
    if bbox is None:
        return "empty"
    glyph = layer.crop(bbox)
    if glyph.width > CANVAS or glyph.height > CANVAS:
        return "not_single_glyph"  # a sequence that did not shape into one glyph (two emoji side by side)
    canvas = Image.new("RGBA", (CANVAS, CANVAS), BACKGROUND + (255,))
    canvas.alpha_composite(glyph, ((CANVAS - glyph.width) // 2, (CANVAS - glyph.height) // 2))
    small = canvas.convert("RGB").resize((resolution, resolution), Image.LANCZOS)
    return np.asarray(small, dtype=np.uint8)


def build(font_path: Path, resolution: int, limit: int | None = None) -> tuple[np.ndarray, list[str], dict]:
    if not font_path.is_file():
        raise InputError(f"font not found at {font_path}; install it with "
                         "`apt-get install fonts-noto-color-emoji` or pass --font PATH")
    if not features.check("raqm"):
        raise OptionalDependencyError("Pillow was built without libraqm, so emoji ZWJ sequences would not "
                                      "shape into single glyphs; install libraqm0 (Debian: libraqm0)")
    try:
        font = ImageFont.truetype(str(font_path), FONT_SIZE, layout_engine=ImageFont.Layout.RAQM)
    except OSError as exc:
        raise InputError(f"{font_path} could not be opened at size {FONT_SIZE}: {exc}") from None
    sequences = glyph_sequences(font_path)
    if limit:
        sequences = sequences[:limit]
    images, names, seen = [], [], set()
    stats = {"glyph_sequences": len(sequences), "empty": 0, "duplicate": 0, "not_single_glyph": 0}
    for text in sequences:
        img = render(font, text, resolution)
        if isinstance(img, str):
            stats[img] += 1
            continue
        if (img.min(axis=2) >= 250).all():   # only faint antialiasing left after downsampling
            stats["empty"] += 1
            continue
        digest = hashlib.sha1(img.tobytes()).hexdigest()
        if digest in seen:
            stats["duplicate"] += 1
            continue
        seen.add(digest)
        images.append(img)
        names.append("-".join(f"{ord(c):x}" for c in text))
    return np.stack(images), names, stats


def save(out: Path, images: np.ndarray, names: list[str], meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.name.endswith(".npy.xz"):
        import lzma

        buf = io.BytesIO()
        np.save(buf, images)
        out.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    elif out.suffix == ".npz":
        np.savez_compressed(out, images=images, names=np.array(names))
    elif out.suffix == ".zip":
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
            for i, img in enumerate(images):
                buf = io.BytesIO()
                Image.fromarray(img).save(buf, format="PNG", optimize=True)
                zf.writestr(f"{i // 1000:05d}/img{i:08d}.png", buf.getvalue())
            zf.writestr("dataset.json", json.dumps({"labels": None}))
            zf.writestr("LICENSE.txt", LICENSE_TEXT)
    else:
        raise InputError(f"output must end in .npy.xz, .npz or .zip; got {out.name}")
    stem = out.name.split(".")[0]
    out.with_name(stem + ".json").write_text(json.dumps({**meta, "names": names}, indent=1) + "\n")
    out.with_name(stem + ".LICENSE.txt").write_text(LICENSE_TEXT + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--font", type=Path, default=DEFAULT_FONT)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "datasets" / "emoji64.npy.xz")
    ap.add_argument("--limit", type=int, default=None, help="only the first N glyphs (for tests)")
    args = ap.parse_args(argv)
    if args.resolution < 8 or args.resolution & (args.resolution - 1):
        raise InputError(f"--resolution must be a power of two >= 8; got {args.resolution}")
    images, names, stats = build(args.font, args.resolution, args.limit)
    import PIL

    meta = {
        "count": int(len(images)),
        "resolution": args.resolution,
        "shape": list(images.shape),
        "dtype": "uint8",
        "layout": "NHWC RGB",
        "format": "xz-compressed .npy; np.load(lzma.open(path))" if args.out.name.endswith(".xz") else args.out.suffix,
        "background": "white",
        "source": "Noto Color Emoji (" + str(args.font) + "), rendered at 109 ppem, LANCZOS-resized",
        "font_sha256": hashlib.sha256(args.font.read_bytes()).hexdigest(),
        "pillow": PIL.__version__,
        "stats": stats,
        "license": {"images": "Apache-2.0", "font": "OFL-1.1", "text": LICENSE_TEXT},
    }
    save(args.out, images, names, meta)
    size = args.out.stat().st_size / 2**20
    print(f"{len(images)} images {images.shape[1]}x{images.shape[2]} -> {args.out} "
          f"({size:.2f} MiB); dropped: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
