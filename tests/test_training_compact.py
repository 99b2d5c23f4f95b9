"""The compact (travel) checkpoint: 16-bit networks without optimizer moments, and resuming from it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import InputError, ModelLoadError
from tests.training_helpers import square_images, tiny_cfg
from training.checkpoint import compact_checkpoint, load_checkpoint
from training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compact")
    data = tmp / "squares.npy"
    np.save(data, square_images())
    train(tiny_cfg(data, tmp / "run", kimg=0.024), log=lambda s: None)
    return tmp, data


def test_compact_keeps_networks_in_16_bit_and_drops_the_moments(full_run, tmp_path):
    tmp, _ = full_run
    sizes = compact_checkpoint(tmp / "run", tmp_path / "c")
    doc_full, full = load_checkpoint(tmp / "run")
    doc, small = load_checkpoint(tmp_path / "c")
    assert set(small) == {"G", "G_ema", "D"} and not any(n.startswith("opt") for n in sizes)
    assert doc["compact"]["dtype"] == "float16" and doc["step"] == doc_full["step"] == 3
    assert doc["cur_nimg"] == doc_full["cur_nimg"] and doc["sampler"] == doc_full["sampler"]
    full_bytes = sum(v["bytes"] for v in doc_full["listing"].values())
    assert sum(sizes.values()) < 0.3 * full_bytes
    for name in ("G", "G_ema", "D"):
        assert small[name].keys() == full[name].keys()
        for k, v in full[name].items():
            w = small[name][k]
            if v.is_floating_point():
                assert w.dtype == torch.float16, f"{name}.{k}"
                torch.testing.assert_close(w.float(), v, rtol=1e-3, atol=1e-4)
            else:
                assert torch.equal(w, v)
    with pytest.raises(InputError, match="already a compact"):
        compact_checkpoint(tmp_path / "c", tmp_path / "c2")
    with pytest.raises(InputError, match="another folder"):
        compact_checkpoint(tmp / "run", tmp / "run")


def test_resume_from_compact_continues_counters_with_fresh_adam(full_run, tmp_path):
    tmp, data = full_run
    compact_checkpoint(tmp / "run", tmp_path / "c")
    said = []
    tr = Trainer(tiny_cfg(data, tmp_path / "c", kimg=0.048), resume=tmp_path / "c", log=said.append)
    assert tr.step == 3 and tr.cur_nimg == 24
    assert any("Adam's moments start afresh" in s for s in said)
    assert not tr.opt_G.state and not tr.opt_D.state
    _, full = load_checkpoint(tmp / "run")
    for k, p in tr.G.named_parameters():                     # fp32 parameters, fp16-rounded values
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), full["G"][k], rtol=1e-3, atol=1e-4)
    before = {k: p.detach().clone() for k, p in tr.G.named_parameters()}
    summary = tr.run()
    assert summary["iterations"] == 6
    moved = [k for k, p in tr.G.named_parameters() if not torch.equal(p.detach(), before[k])]
    assert len(moved) > 5
    assert all(torch.isfinite(p).all() for p in tr.G.parameters())
    # the continued run writes a full checkpoint again (moments included), which resumes exactly
    doc, again = load_checkpoint(tmp_path / "c")
    assert "compact" not in doc and {"opt_G", "opt_D"} <= set(again)


def test_a_damaged_compact_checkpoint_is_refused(full_run, tmp_path):
    tmp, data = full_run
    compact_checkpoint(tmp / "run", tmp_path / "c")
    (tmp_path / "c" / "D.safetensors").write_bytes(b"0" * 10)
    with pytest.raises(ModelLoadError, match="D.safetensors"):
        Trainer(tiny_cfg(data, tmp_path / "c", kimg=0.048), resume=tmp_path / "c", log=lambda s: None)


def test_compact_from_the_command_line(full_run, tmp_path):
    tmp, _ = full_run
    script = ROOT / "scripts" / "train_default_model.py"
    out = subprocess.run([sys.executable, str(script), "--compact", str(tmp / "run"), "--compact-to",
                          str(tmp_path / "c")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(rep["mib"]) == {"G.safetensors", "G_ema.safetensors", "D.safetensors"}
    bad = subprocess.run([sys.executable, str(script), "--compact", str(tmp / "run")], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode != 0 and "--compact-to" in (bad.stderr + bad.stdout)
