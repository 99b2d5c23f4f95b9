import json

import numpy as np
from PIL import Image
import pytest

from core.errors import InputError
from core.pnginfo import parse_a1111, read_png_params, save_png


def test_a1111_files_match_expected(testdata):
    expected = json.loads((testdata / "pnginfo" / "expected.json").read_text())
    for name, want in expected.items():
        got = read_png_params(testdata / "pnginfo" / name)
        assert got["source"] == "a1111"
        for k, v in want.items():
            assert got[k] == v, (name, k)


def test_atelier_roundtrip(tmp_path):
    img = Image.fromarray(np.random.RandomState(0).randint(0, 255, (8, 8, 3), dtype=np.uint8))
    params = {"backend": "stylegan", "seed": 42, "truncation_psi": 0.7, "model": "x.pkl", "flags": {"precision": "fp32"}}
    p = save_png(img, tmp_path / "a.png", params)
    got = read_png_params(p)
    assert got["source"] == "atelier" and got["seed"] == 42 and got["truncation_psi"] == 0.7
    # Other tools' readers see an A1111-style chunk too.
    other = parse_a1111(Image.open(p).text["parameters"])
    assert other["seed"] == 42


def test_no_params_is_clear_error(tmp_path):
    p = tmp_path / "plain.png"
    Image.new("RGB", (4, 4)).save(p)
    with pytest.raises(InputError, match="no generation parameters"):
        read_png_params(p)
    with pytest.raises(InputError, match="not found"):
        read_png_params(tmp_path / "missing.png")
    (tmp_path / "junk.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match="not a readable image"):
        read_png_params(tmp_path / "junk.png")


def test_quoted_values_with_commas():
    text = 'a cat\nSteps: 5, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 64x64, Lora hashes: "a: 1, b: 2", Model: m'
    d = parse_a1111(text)
    assert d["extra"]["Lora hashes"] == "a: 1, b: 2" and d["model"] == "m" and d["sampler"] == "Euler a"
