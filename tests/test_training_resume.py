"""Exact resume: N iterations straight == N/2, checkpoint, new process state, N/2 more (CPU, bit-identical)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from training.checkpoint import load_checkpoint
from tests.training_helpers import square_images, tiny_cfg
from training.trainer import Trainer, train


_images = square_images
_cfg = tiny_cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    data = tmp / "squares.npy"
    np.save(data, _images())
    # batch 8 over 20 images: an epoch is 2 batches, so 6 iterations cross 2 epoch boundaries.
    # The weights before any step: the trainer seeds its initialisation from the config alone.
    fresh = Trainer(_cfg(data, tmp / "fresh", kimg=0.048), write_outputs=False, log=lambda s: None)
    initial = {name: {k: p.detach().clone() for k, p in getattr(fresh, name).named_parameters()}
               for name in ("G", "G_ema", "D")}
    del fresh
    straight = train(_cfg(data, tmp / "straight", kimg=0.048), log=lambda s: None)
    first = train(_cfg(data, tmp / "pieces", kimg=0.024), log=lambda s: None)
    second = train(_cfg(data, tmp / "pieces", kimg=0.048), resume=tmp / "pieces", log=lambda s: None)
    return tmp, straight, first, second, initial


def test_pieces_stop_where_asked(runs):
    _, straight, first, second, _ = runs
    assert straight["iterations"] == 6 and first["iterations"] == 3 and second["iterations"] == 6


def test_resumed_weights_are_bit_identical(runs):
    tmp, *_ = runs
    doc_a, ta = load_checkpoint(tmp / "straight")
    doc_b, tb = load_checkpoint(tmp / "pieces")
    for name in ("G", "G_ema", "D", "opt_G", "opt_D"):
        assert ta[name].keys() == tb[name].keys(), name
        for k in ta[name]:
            assert torch.equal(ta[name][k], tb[name][k]), f"{name}.{k} differs after resume"
    assert doc_a["step"] == doc_b["step"] == 6


def test_training_actually_moved_the_weights(runs):
    """Bit-identical resume would also hold for a trainer that never steps: check that it does.

    Adam moves a weight by about lr per step wherever its gradient is steady; after 6 iterations
    (measured: ~97 % of the weights by more than lr/10, root-mean-square ~2.5 lr) anything below
    90 % / 1 lr means the optimizers did not really run. G_ema follows G (its EMA ramp-up is short)."""
    tmp, *_, initial = runs
    doc, after = load_checkpoint(tmp / "straight")
    lr = doc["config"]["lr_g"]
    assert lr == doc["config"]["lr_d"] == 0.002
    for name in ("G", "G_ema", "D"):
        assert initial[name] and initial[name].keys() <= after[name].keys()
        d = torch.cat([(after[name][k] - p).abs().flatten() for k, p in initial[name].items()])
        share, rms = float((d > lr / 10).double().mean()), float(d.pow(2).mean().sqrt() / lr)
        assert share > 0.9 and rms > 1, f"{name}: {share:.0%} of weights moved by > lr/10, rms {rms:.2f} lr"
    # Optimizer step counts: one per D / G update plus one per lazy R1 / path-length step
    # (6 iterations, both intervals 2: 3 of each).
    for opt, expected in (("opt_G", 6 + 3), ("opt_D", 6 + 3)):
        steps = {k: int(v) for k, v in after[opt].items() if k.endswith(".step")}
        assert steps and set(steps.values()) == {expected}, (opt, set(steps.values()))
    assert (doc["d_updates"], doc["g_updates"]) == (6, 6)


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


def test_retuned_resume_changes_the_recipe_and_keeps_the_rest(runs, tmp_path):
    """--retune: a resumed run with a new batch, learning rate, PL weight and ADA target. The networks
    and optimizer moments are the checkpoint's; the new values are used and recorded; the sampler
    continues from the saved image position with the new batch."""
    tmp, *_ = runs
    saved_doc, saved = load_checkpoint(tmp / "pieces")
    cfg = _cfg(tmp / "squares.npy", tmp_path / "retuned", kimg=1.0)
    tr = Trainer(cfg, resume=tmp / "pieces", write_outputs=True, log=lambda s: None,
                 retune={"batch": 4, "lr_g": 0.001, "pl_weight": 0.0, "ada_target": 0.7})
    assert tr.cfg.batch == 4 and tr.batch_gpu == 4 and tr.cfg.pl_weight == 0.0
    assert set(tr.retuned) == {"batch", "lr_g", "pl_weight", "ada_target"}
    assert tr.retuned["batch"] == (8, 4)
    # networks, counters and moments carried over
    for k, p in tr.G.named_parameters():
        assert torch.equal(p.detach(), saved["G"][k]), k
    assert tr.cur_nimg == saved_doc["cur_nimg"] and tr.step == saved_doc["step"]
    exp_avg_sq = [v for k, v in saved["opt_G"].items() if k.endswith("exp_avg_sq")]
    assert exp_avg_sq and any(bool((v != 0).any()) for v in exp_avg_sq)
    state_sq = [st["exp_avg_sq"] for st in tr.opt_G.state.values()]
    assert sum(float(v.abs().sum()) for v in state_sq) == pytest.approx(
        sum(float(v.abs().sum()) for v in exp_avg_sq), rel=1e-6)
    # the new learning rate replaced the saved one (G's lazy PL adjustment is gone with pl_weight 0)
    assert [g["lr"] for g in tr.opt_G.param_groups] == [0.001]
    assert [g["betas"] for g in tr.opt_G.param_groups] == [(0.0, 0.99)]
    assert tr.ada.target == 0.7
    # the sampler kept its position in images and hands out batches of the new size
    assert tr.loader.epoch == saved_doc["sampler"]["epoch"] and tr.loader.pos == saved_doc["sampler"]["pos"]
    before = tr.cur_nimg
    tr.iteration()
    assert tr.cur_nimg == before + 4
    records = [json.loads(line) for line in (tmp_path / "retuned" / "log.jsonl").read_text().splitlines()]
    retunes = [r for r in records if r["kind"] == "retune"]
    assert retunes and retunes[-1]["changed"]["batch"] == {"from": 8, "to": 4}


def test_retune_refuses_network_settings_and_needs_resume(runs, tmp_path):
    tmp, *_ = runs
    cfg = _cfg(tmp / "squares.npy", tmp_path / "r", kimg=1.0)
    with pytest.raises(InputError, match="cannot change g_kwargs"):
        Trainer(cfg, resume=tmp / "pieces", write_outputs=False, log=lambda s: None, retune={"g_kwargs": {}})
    with pytest.raises(InputError, match="give --resume"):
        Trainer(cfg, write_outputs=False, log=lambda s: None, retune={"batch": 4})
    # without --retune a resumed run keeps its own recipe, whatever the command line's preset says
    plain = Trainer(_cfg(tmp / "squares.npy", tmp_path / "r2", kimg=1.0, batch=4, pl_weight=0.0),
                    resume=tmp / "pieces", write_outputs=False, log=lambda s: None)
    assert plain.cfg.batch == 8 and plain.cfg.pl_weight > 0 and not plain.retuned


def test_retune_from_the_command_line_takes_only_explicit_values():
    from training.cli import build_parser, retune_from_args

    ns = build_parser().parse_args(["--preset", "emoji64", "--resume", "x", "--retune", "--batch", "256",
                                    "--pl-weight", "0"])
    assert retune_from_args(ns) == {"batch": 256, "pl_weight": 0.0}
    assert retune_from_args(build_parser().parse_args(["--resume", "x", "--batch", "256"])) is None
    with pytest.raises(InputError, match="at least one"):
        retune_from_args(build_parser().parse_args(["--resume", "x", "--retune"]))


def test_resume_takes_an_explicit_value_equal_to_the_default(runs, tmp_path):
    """`--snapshot-kimg 200` on resume is 200 even though 200 is the dataclass default (the saved run
    has 0); without the explicit mark the saved value would win, as it did before."""
    from training.cli import build_parser, given_from_args

    tmp, *_ = runs
    cfg = _cfg(tmp / "squares.npy", tmp_path / "e", kimg=1.0, snapshot_kimg=200.0)
    asked = Trainer(cfg, resume=tmp / "pieces", write_outputs=False, log=lambda s: None, given={"snapshot_kimg"})
    assert asked.cfg.snapshot_kimg == 200.0
    silent = Trainer(cfg, resume=tmp / "pieces", write_outputs=False, log=lambda s: None)
    assert silent.cfg.snapshot_kimg == 0.0
    ns = build_parser().parse_args(["--resume", "x", "--snapshot-kimg", "200", "--compile"])
    assert {"snapshot_kimg", "compile"} <= given_from_args(ns) and "batch" not in given_from_args(ns)
