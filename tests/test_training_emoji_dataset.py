"""The emoji dataset builder (real font, first glyphs only) and the bundled dataset it produced."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from training.dataset import load_images

ROOT = Path(__file__).resolve().parent.parent
FONT = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
BUNDLED = ROOT / "assets" / "datasets" / "emoji64.npy.xz"


def _builder():
    spec = importlib.util.spec_from_file_location("build_emoji_dataset", ROOT / "scripts" / "build_emoji_dataset.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not FONT.is_file(), reason="fonts-noto-color-emoji is not installed")
def test_builder_renders_centred_glyphs_on_white(tmp_path):
    b = _builder()
    out = tmp_path / "e.npy.xz"
    assert b.main(["--out", str(out), "--limit", "60", "--resolution", "32"]) == 0
    arr, info = load_images(out)
    meta = json.loads((tmp_path / "e.json").read_text())
    assert arr.shape[1:] == (32, 32, 3) and meta["count"] == len(arr) == len(meta["names"]) > 30
    assert meta["license"]["images"] == "Apache-2.0" and "OFL" in meta["license"]["font"]
    assert (tmp_path / "e.LICENSE.txt").read_text().startswith("Images rendered from the Noto Color Emoji")
    corners = arr[:, [0, 0, -1, -1], [0, -1, 0, -1]]
    assert (corners >= 250).all()                               # white background
    ink = (arr.min(axis=3) < 200)
    ys, xs = np.nonzero(ink.any(axis=0))
    assert abs(ys.mean() - 15.5) < 4 and abs(xs.mean() - 15.5) < 4   # glyphs are centred
    assert len({a.tobytes() for a in arr}) == len(arr)              # no duplicates


def test_bundled_dataset_is_complete_and_licensed():
    if not BUNDLED.is_file():
        pytest.skip("assets/datasets/emoji64.npy.xz is not in this checkout")
    arr, info = load_images(BUNDLED)
    meta = json.loads(BUNDLED.with_name("emoji64.json").read_text())
    assert arr.shape == (meta["count"], 64, 64, 3) and meta["count"] > 3500
    assert BUNDLED.stat().st_size < 10 * 2**20
    assert "Apache" in BUNDLED.with_name("emoji64.LICENSE.txt").read_text()
