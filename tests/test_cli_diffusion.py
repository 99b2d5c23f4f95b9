"""`python app.py generate --backend diffusion` on a tiny pipeline the test builds, as a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.diffusion_tiny import build_tiny_sd

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args):
    p = subprocess.run([sys.executable, "app.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_sd") / "pipe"
    build_tiny_sd(folder)
    return folder


def test_txt2img_png_then_from_png_reproduces(tiny_sd, tmp_path):
    out = tmp_path / "a.png"
    rc, so, se = run_cli("generate", "--backend", "diffusion", "--model", tiny_sd, "--prompt", "a red fox",
                         "--negative-prompt", "blurry", "--seed", 7, "--steps", 3, "--guidance", 5, "--width", 64,
                         "--height", 64, "--scheduler", "euler-a", "--out", out, "--quiet")
    assert rc == 0, se
    summary = json.loads(so.strip().splitlines()[-1])
    assert summary["outputs"] == [str(out)] and summary["backend"] == "diffusion"
    assert {"text_encoder", "denoise", "vae_decode"} <= set(summary["latency_ms"])
    meta = json.loads(Image.open(out).text["atelier"])
    for k, v in {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 7, "steps": 3, "width": 64}.items():
        assert meta[k] == v
    again = tmp_path / "b.png"
    rc, so, se = run_cli("generate", "--from-png", out, "--out", again, "--quiet")
    assert rc == 0, se
    assert np.array_equal(np.asarray(Image.open(again)), np.asarray(Image.open(out)))


def test_npy_is_float32_nchw_in_unit_range(tiny_sd, tmp_path):
    out = tmp_path / "a.npy"
    rc, so, se = run_cli("generate", "--backend", "diffusion", "--model", tiny_sd, "--prompt", "x", "--seed", 1,
                         "--steps", 2, "--width", 72, "--height", 64, "--batch-size", 2, "--out", out, "--quiet")
    assert rc == 0, se
    raw = np.load(out)
    assert raw.dtype == np.float32 and raw.shape == (2, 3, 64, 72)
    assert 0.0 <= raw.min() and raw.max() <= 1.0


@pytest.mark.parametrize("args,needle", [
    (["--width", "100"], "multiple of 8"),
    (["--steps", "0"], "steps"),
    (["--strength", "1.5", "--init-image", "nope.png"], ""),
])
def test_bad_diffusion_input(tiny_sd, tmp_path, args, needle):
    rc, so, se = run_cli("generate", "--backend", "diffusion", "--model", tiny_sd, "--prompt", "x",
                         "--out", tmp_path / "o.png", "--quiet", *args)
    assert rc != 0
    lines = [l for l in se.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], se


def test_missing_prompt_and_unknown_hub_id(tmp_path):
    rc, so, se = run_cli("generate", "--backend", "diffusion", "--model", "x/y", "--out", tmp_path / "o.png")
    assert rc == 2 and "--prompt" in se
    rc, so, se = run_cli("generate", "--backend", "diffusion", "--model", "nobody/not-a-model", "--prompt", "x",
                         "--out", tmp_path / "o.png")
    assert rc == 2 and "nobody/not-a-model" in se and "Traceback" not in se
