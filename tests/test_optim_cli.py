"""The optimization report through the CLI, as a user runs it: JSON, PNG metadata, --strict."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.pnginfo import read_png_params

ROOT = Path(__file__).resolve().parent.parent
FP8_CPU = "FP8 needs compute capability 8.9 or newer (Ada/Hopper); this machine has no CUDA GPU"


def run_cli(*args):
    p = subprocess.run([sys.executable, "app.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip of FP8")
def test_generate_reports_skipped_fp8_and_still_makes_the_image(testdata, tmp_path):
    out = tmp_path / "x.png"
    pkl = testdata / "stylegan" / "sg2_uncond_32.pkl"
    rc, so, se = run_cli("generate", "--backend", "stylegan", "--model", pkl, "--seed", 1, "--precision", "bf16",
                         "--channels-last", "--fp8", "--out", out, "--quiet")
    assert rc == 0, se
    summary = json.loads(so.strip().splitlines()[-1])
    opt = summary["optimizations"]
    assert opt["fp8"] == {"applied": False, "reason": FP8_CPU}
    assert opt["precision"]["applied"] and opt["precision"]["mode"] == "autocast-bf16"
    assert opt["channels_last"]["applied"]
    assert summary["dtype"] == "autocast-bf16"
    meta = read_png_params(out)                          # the same report rides along in the PNG
    assert meta["optimizations"]["fp8"]["reason"] == FP8_CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip of FP8")
def test_strict_fails_with_one_line(testdata, tmp_path):
    out = tmp_path / "x.png"
    pkl = testdata / "stylegan" / "sg2_uncond_32.pkl"
    rc, so, se = run_cli("generate", "--backend", "stylegan", "--model", pkl, "--seed", 1, "--precision", "bf16",
                         "--channels-last", "--fp8", "--strict", "--out", out, "--quiet")
    assert rc != 0
    lines = [ln for ln in se.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --strict") and "fp8" in lines[0], se
    assert not out.exists()
