"""training/parity.py on the CPU: the trainer's path against fp32 reference copies of its own networks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from training.config import build_config
from training.parity import _compare, format_report, path_parity
from training.trainer import Trainer


def _trainer(tmp_path, precision, **kw):
    rng = np.random.default_rng(3)
    p = tmp_path / "d.npy"
    np.save(p, rng.integers(0, 256, size=(16, 32, 32, 3), dtype=np.uint8))
    cfg = build_config("emoji64", data=str(p), out=str(tmp_path / "r"), kimg=1, batch=8, progress=False,
                       style_mixing=0, precision=precision, cbase=512, cmax=32, **kw)
    cfg.preset = "stylegan2"     # 32x32 data; the emoji64 recipe otherwise
    return Trainer(cfg, log=lambda s: None, write_outputs=False)


def test_fp32_trainer_path_is_the_reference(tmp_path):
    """On the CPU in fp32 the trainer runs the reference ops: every compared quantity is the same to rounding."""
    tr = _trainer(tmp_path, "fp32")
    before = {k: v.clone() for k, v in tr.G.state_dict().items()}
    rep = path_parity(tr, batch=4)
    rows = rep["rows"]
    assert {"image", "d_logits", "r1_grad"} <= set(rows)
    assert any(k.startswith("G.") for k in rows) and any(k.startswith("R1.") for k in rows)
    for grp in ("G", "D", "R1"):
        assert rep["groups"][grp]["rel"] < 1e-4, format_report(rep)
    assert rows["image"]["rel"] < 1e-5 and rows["r1_grad"]["rel"] < 1e-4
    # the trainer's weights (noise strengths included) are as they were, and no gradient is left behind
    for k, v in tr.G.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in list(tr.G.parameters()) + list(tr.D.parameters()))


def test_bf16_trainer_path_is_close_but_not_equal(tmp_path):
    """bf16 autocast on the CPU: same directions (cosines near 1) with bf16's rounding visible."""
    rep = path_parity(_trainer(tmp_path, "bf16"), batch=4)
    text = format_report(rep)
    assert rep["rows"]["image"]["cos"] > 0.999, text
    assert rep["groups"]["G"]["cos"] > 0.97 and rep["groups"]["D"]["cos"] > 0.97, text
    assert rep["groups"]["G"]["rel"] > 1e-4, "bf16 must differ from fp32; the comparison ran fp32 on both sides"
    assert "worst 10 by cosine" in text and "all R1 parameter gradients" in text


def test_compare_sees_a_gradient_that_points_elsewhere():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    same = _compare(a * 1.001, a)
    assert same["cos"] > 0.9999 and same["rel"] < 0.002
    other = _compare(torch.randn(1000, generator=g), a)
    assert abs(other["cos"]) < 0.2 and other["rel"] > 1.0
    assert _compare(-a, a)["cos"] == pytest.approx(-1.0)
