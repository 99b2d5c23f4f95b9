"""Guards against augmentation leaking into G: the cap on ADA's p, the 'upright' pipe, the monitor's leak warning.

Why they exist: two emoji64 runs leaked augmentations into the generator (the luma flip at p ~0.6: black
backgrounds; 90-degree rotations once ADA's p reached 1.0 with 'bg': emoji on their side), and the
diversity monitor, which measures the samples, could not see it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from training.augment import LEAK_PRONE_OPS, PIPES, AdaController, AugmentPipe, leak_prone_ops
from training.checkpoint import read_state
from training.cli import build_parser, config_from_args, retune_from_args
from training.config import build_config, finalize
from training.monitor import CollapseMonitor, MonitorSettings
from tests.training_helpers import square_images, tiny_cfg
from training.trainer import RESUME_RETUNABLE, Trainer, train

LEAK_TEXT = ("augmentation p 0.91 >= 0.8 with rotations/flips: they can leak into G (rotated or flipped samples); "
             "lower --ada-max-p or use --aug-pipe upright")


def _x(n=8, res=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, res, res, generator=g) * 2 - 1


def _corner(n=256, res=16):
    """Grey images, bright top-left quadrant on black: any flip or quarter turn moves the bright mass."""
    x = -torch.ones(n, 3, res, res)
    x[:, :, :res // 2, :res // 2] = 1.0
    return x


_images = square_images
_cfg = tiny_cfg


# -- the cap on p --------------------------------------------------------------------------------------

def test_ada_p_never_exceeds_max_p_when_d_overfits():
    pipe = AugmentPipe("bg", p=0.1)
    ada = AdaController(pipe, target=0.6, interval=4, speed_kimg=1.0, batch=25, max_p=0.6)   # step 0.1
    seen = []
    for _ in range(50):
        ada.accumulate(torch.ones(16, 1))           # every real logit positive: r_t = 1, p pushed up
        ada.update()
        seen.append(float(pipe.p))
    assert max(seen) == pytest.approx(0.6) and seen[-1] == pytest.approx(0.6)
    assert pipe.p.ndim == 0 and pipe.p.dtype == torch.float32       # still the 0-d buffer ADA updates in place
    for _ in range(3):                                               # and it comes back down from the cap
        ada.accumulate(-torch.ones(16, 1))
        ada.update()
    assert float(pipe.p) == pytest.approx(0.3)
    # the default is NVlabs' behaviour: no cap below 1
    free = AdaController(AugmentPipe("bg", p=0.9), speed_kimg=1.0, batch=25)
    for _ in range(5):
        free.accumulate(torch.ones(4, 1))
        free.update()
    assert float(free.pipe.p) == 1.0


def test_ada_max_p_out_of_range_is_an_input_error():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InputError, match=r"--ada-max-p.*\(0, 1\]"):
            AdaController(AugmentPipe("bg"), max_p=bad)


def test_config_validates_ada_max_p_and_fixed_p_against_it():
    assert build_config("stylegan2").ada_max_p == 1.0 and build_config("stylegan2").aug_pipe == "bgc"
    for bad in (0.0, 1.01):
        with pytest.raises(InputError, match=r"--ada-max-p \(the cap on augmentation p\) must be in \(0, 1\]"):
            finalize(build_config("tiny", 16, ada_max_p=bad), 16)
    with pytest.raises(InputError, match=r"--aug-p 0.7 is above the cap --ada-max-p 0.5; lower --aug-p or raise"):
        finalize(build_config("tiny", 16, aug="fixed", aug_p=0.7, ada_max_p=0.5), 16)
    with pytest.raises(InputError, match="emoji64 preset's cap"):
        finalize(build_config("emoji64", aug="fixed", aug_p=0.8), 64)
    assert finalize(build_config("tiny", 16, aug="fixed", aug_p=0.5, ada_max_p=0.5), 16).aug_p == 0.5
    assert finalize(build_config("tiny", 16, aug="none", aug_p=0.7, ada_max_p=0.5), 16).aug == "none"


def test_emoji64_preset_is_upright_with_p_capped_at_0_6():
    cfg = finalize(build_config("emoji64"), 64)
    assert cfg.aug_pipe == "upright" and cfg.ada_max_p == 0.6
    # explicit flags still win over the preset
    ns = build_parser().parse_args(["--preset", "emoji64", "--ada-max-p", "0.8", "--aug-pipe", "bg"])
    cfg = config_from_args(ns)
    assert cfg.ada_max_p == 0.8 and cfg.aug_pipe == "bg"


def test_retune_accepts_ada_max_p_from_the_command_line():
    assert "ada_max_p" in RESUME_RETUNABLE
    ns = build_parser().parse_args(["--preset", "emoji64", "--resume", "x", "--retune", "--ada-max-p", "0.6",
                                    "--aug-pipe", "upright"])
    assert retune_from_args(ns) == {"ada_max_p": 0.6, "aug_pipe": "upright"}
    assert "--ada-max-p" in build_parser().format_help()


# -- the upright pipe ------------------------------------------------------------------------------------

def test_upright_pipe_has_no_flip_or_rotation():
    assert set(PIPES["upright"]) == {"xint", "scale", "aniso", "xfrac", "brightness", "contrast", "hue",
                                     "saturation"}
    assert leak_prone_ops("upright") == []
    assert leak_prone_ops("bg") == ["xflip", "rotate90", "rotate"]
    assert leak_prone_ops("bgc") == list(LEAK_PRONE_OPS)
    # Every geometric matrix at p = 1 is a positive axis-aligned scale plus a shift: no flip, no turn.
    pipe = AugmentPipe("upright", p=1.0)
    torch.manual_seed(0)
    G = pipe._geometry(512, 16, 16, "cpu")
    assert torch.equal(G[:, 0, 1], torch.zeros(512)) and torch.equal(G[:, 1, 0], torch.zeros(512))
    assert (G[:, 0, 0] > 0).all() and (G[:, 1, 1] > 0).all()
    assert not torch.allclose(G, torch.eye(3).expand_as(G))         # but it does transform
    # No luma flip: the grey axis keeps its direction (light stays light).
    C = pipe._color(512, "cpu")
    v = torch.tensor([1.0, 1.0, 1.0]) / 3**0.5
    assert ((v @ C[:, :3, :3] @ v) > 0).all()


def test_upright_keeps_the_bright_corner_where_bg_moves_it():
    x = _corner()
    results = {}
    for name in ("upright", "bg"):
        torch.manual_seed(0)
        y = AugmentPipe(name, p=1.0)(x)
        left_minus_right = y[..., :8].mean((1, 2, 3)) - y[..., 8:].mean((1, 2, 3))
        top_minus_bottom = y[..., :8, :].mean((1, 2, 3)) - y[..., 8:, :].mean((1, 2, 3))
        results[name] = (left_minus_right > 0) & (top_minus_bottom > 0)
    assert results["upright"].all()                    # every image still has its mass top-left
    assert (~results["bg"]).sum() > 64                 # 'bg' flips or turns a good share away (~half)
    torch.manual_seed(0)
    assert not torch.allclose(AugmentPipe("upright", p=1.0)(x), x, atol=0.05)   # it still augments


# -- the monitor's leak warning ---------------------------------------------------------------------------

def _monitor():
    mon = CollapseMonitor(MonitorSettings(patience=2))
    mon.set_reference(_x(32, 32))
    return mon


def test_monitor_warns_after_two_evaluations_at_high_p_with_flips():
    mon = _monitor()
    healthy = _x(32, 32, seed=3)
    first = mon.evaluate(healthy, kimg=1, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.91, leak_ops=leak_prone_ops("bg"))
    assert first["warnings"] == [] and first["aug_p"] == 0.91        # one evaluation is not a trend
    second = mon.evaluate(healthy, kimg=2, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.91,
                          leak_ops=leak_prone_ops("bg"))
    assert second["warnings"] == [LEAK_TEXT] and second["leak_warning"] == LEAK_TEXT
    assert mon.choose_countermeasure(second) is None                 # never "more augmentation" for a leak
    assert mon.state.cooldown == 0 and mon.state.applied == []
    # p falling below 0.8 resets the streak
    low = mon.evaluate(healthy, kimg=3, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.5, leak_ops=leak_prone_ops("bg"))
    assert low["warnings"] == [] and mon.state.high_p_streak == 0


def test_monitor_does_not_warn_for_upright_or_without_augmentation():
    mon = _monitor()
    for k in range(4):
        rec = mon.evaluate(_x(32, 32, seed=3), kimg=k, d_acc_real=0.7, d_acc_fake=0.6, aug_p=1.0,
                           leak_ops=leak_prone_ops("upright"))
        assert rec["warnings"] == []
    for k in range(4, 7):
        assert mon.evaluate(_x(32, 32, seed=3), kimg=k, d_acc_real=0.7, d_acc_fake=0.6)["warnings"] == []


def test_collapse_warning_in_the_leak_zone_skips_more_augmentation():
    mon = _monitor()
    one = _x(1, 32, seed=4).repeat(32, 1, 1, 1) + 0.001 * _x(32, 32, seed=5)      # collapsed samples
    mon.evaluate(_x(32, 32, seed=3), kimg=1, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.9, leak_ops=["rotate90"])
    rec = mon.evaluate(one, kimg=2, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.9, leak_ops=["rotate90"])
    assert any("near-identical" in w for w in rec["warnings"]) and rec["leak_warning"] in rec["warnings"]
    assert mon.choose_countermeasure(rec) == "dropout"
    # the same collapse with p low still gets more augmentation first, as before
    calm = _monitor()
    calm.evaluate(_x(32, 32, seed=3), kimg=1, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.3, leak_ops=["rotate90"])
    rec = calm.evaluate(one, kimg=2, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.3, leak_ops=["rotate90"])
    assert calm.choose_countermeasure(rec) == "augment"


def test_monitor_leak_streak_survives_save_and_resume():
    mon = _monitor()
    mon.evaluate(_x(32, 32, seed=3), kimg=1, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.91, leak_ops=["xflip"])
    state = json.loads(json.dumps(mon.state_dict()))
    assert state["high_p_streak"] == 1
    resumed = CollapseMonitor(MonitorSettings(patience=2))
    resumed.load_state_dict(state)
    rec = resumed.evaluate(_x(32, 32, seed=3), kimg=2, d_acc_real=0.7, d_acc_fake=0.6, aug_p=0.91,
                           leak_ops=["xflip"])
    assert rec["warnings"] == [LEAK_TEXT]
    assert resumed.state.history[0] == mon.state.history[0]
    old = {k: v for k, v in state.items() if k != "high_p_streak"}       # a checkpoint from before this field
    legacy = CollapseMonitor()
    legacy.load_state_dict(old)
    assert legacy.state.high_p_streak == 0


# -- through the trainer ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("leak")
    path = tmp / "squares.npy"
    np.save(path, _images())
    return tmp, path


def _monitor_records(folder):
    lines = (folder / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "monitor"]


def test_trainer_logs_the_leak_warning_across_a_resume_and_never_raises_augmentation(data):
    tmp, path = data
    out = tmp / "fixed-bg"
    kw = dict(aug="fixed", aug_p=0.91, aug_pipe="bg")
    train(_cfg(path, out, kimg=0.016, **kw), log=lambda s: None)                    # one evaluation
    first = _monitor_records(out)
    assert len(first) == 1 and LEAK_TEXT not in first[0]["warnings"] and first[0]["aug_p"] == 0.91
    train(_cfg(path, out, kimg=0.032, **kw), resume=out, log=lambda s: None)   # one more, after the resume
    records = _monitor_records(out)
    assert len(records) == 2 and LEAK_TEXT in records[1]["warnings"]
    assert all(r.get("countermeasure", {}).get("measure") != "augment" for r in records)
    assert read_state(out)["aug_p"] == pytest.approx(0.91)                      # the warning changed nothing


def test_trainer_caps_ada_p_and_a_retune_lowers_it(data):
    tmp, path = data
    out = tmp / "capped"
    # ada_kimg 0.05: p may move 0.16 per iteration; the tiny D soon says "real" to the reals.
    train(_cfg(path, out, kimg=0.048, aug_p=0.3, ada_max_p=0.35, ada_kimg=0.05), log=lambda s: None)
    p = [r["aug_p"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert max(p) == pytest.approx(0.35) and all(v <= 0.35 + 1e-6 for v in p)     # reached, never passed
    saved_p = read_state(out)["aug_p"]
    assert saved_p > 0.1
    tr = Trainer(_cfg(path, tmp / "retuned", kimg=0.064), resume=out, write_outputs=False, log=lambda s: None,
                 retune={"ada_max_p": 0.1})
    assert tr.cfg.ada_max_p == 0.1 and tr.ada.max_p == 0.1
    assert tr.retuned["ada_max_p"] == (0.35, 0.1) and tr.retuned["aug_p"] == (0.3, 0.1)
    assert float(tr.aug.p) == pytest.approx(0.1)                  # the restored p starts at the new cap
