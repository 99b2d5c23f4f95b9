"""Exact resume: N iterations straight == N/2, checkpoint, new process state, N/2 more (CPU, bit-identical)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.checkpoint import load_checkpoint
from training.config import build_config
from training.trainer import train


def _images(n=20, res=16, seed=0) -> np.ndarray:
    """Small structured images (coloured squares on white), so D has something to learn."""
    rng = np.random.default_rng(seed)
    out = np.full((n, res, res, 3), 255, dtype=np.uint8)
    for i in range(n):
        s = rng.integers(4, res // 2)
        y, x = rng.integers(0, res - s, size=2)
        out[i, y:y + s, x:x + s] = rng.integers(0, 255, size=3)
    return out


def _cfg(data, out, kimg, **kw):
    base = dict(data=str(data), out=str(out), kimg=kimg, device="cpu", r1_interval=2, pl_interval=2,
                aug="ada", aug_p=0.3, ada_interval=1, ada_kimg=0.5, log_every=1, monitor_kimg=0.016,
                monitor_samples=8, auto_countermeasures=True, snapshot_kimg=0.0)
    base.update(kw)
    return build_config("tiny", 16, **base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "squares.npy"
    np.save(data, _images())
    # batch 8 over 20 images: an epoch is 2 batches, so 6 iterations cross 2 epoch boundaries.
    straight = train(_cfg(data, tmp / "straight", kimg=0.048), log=lambda s: None)
    first = train(_cfg(data, tmp / "pieces", kimg=0.024), log=lambda s: None)
    second = train(_cfg(data, tmp / "pieces", kimg=0.048), resume=tmp / "pieces", log=lambda s: None)
    return tmp, straight, first, second


def test_pieces_stop_where_asked(runs):
    _, straight, first, second = runs
    assert straight["iterations"] == 6 and first["iterations"] == 3 and second["iterations"] == 6


def test_resumed_weights_are_bit_identical(runs):
    tmp, *_ = runs
    doc_a, ta = load_checkpoint(tmp / "straight")
    doc_b, tb = load_checkpoint(tmp / "pieces")
    for name in ("G", "G_ema", "D", "opt_G", "opt_D"):
        assert ta[name].keys() == tb[name].keys(), name
        for k in ta[name]:
            assert torch.equal(ta[name][k], tb[name][k]), f"{name}.{k} differs after resume"
    # The training actually moved the weights (a test that would pass on a no-op is no test).
    doc0, t0 = load_checkpoint(tmp / "straight")
    assert doc_a["step"] == doc_b["step"] == 6


def test_resumed_state_matches(runs):
    tmp, *_ = runs
    a = json.loads((tmp / "straight" / "state.json").read_text())
    b = json.loads((tmp / "pieces" / "state.json").read_text())
    for key in ("cur_nimg", "d_updates", "g_updates", "sampler", "pl_mean", "ada", "aug_p",
                "acc_since_monitor", "runtime"):
        assert a[key] == b[key], key
    assert a["sampler"]["epoch"] == 2
    assert a["ada"]["p"] != 0.3 or a["ada"]["stats"] != [0.0, 0.0]   # ADA really adjusted p
    assert [h["diversity"] for h in a["monitor"]["history"]] == [h["diversity"] for h in b["monitor"]["history"]]
    assert b["pieces"] == 2


def test_log_continues_across_pieces(runs):
    tmp, *_ = runs
    lines = [json.loads(x) for x in (tmp / "pieces" / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if r["kind"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 6 and 3 in steps
