"""Within-class diversity: the check that catches class-wise mode collapse, which FD, the class agreement and the
monitor's overall diversity cannot see (a model drawing one picture per class still spreads over every class).

Three places measure it: evaluation.emoji_metric.within_class_diversity (the emoji metric's features, balanced
per-class samples from scripts/emoji_metrics.py --per-class), the training monitor (a random-projection space,
fixed latents in every class), and scripts/ship_check.py's third numeric check."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from evaluation.emoji_metric import mean_pairwise_distance, within_class_diversity
from tests.test_training_runs import write_tiny_dataset
from training import cli
from training.monitor import CollapseMonitor, MonitorSettings


def _clusters(n_per, classes, dim=16, spread=1.0, seed=0):
    """Feature rows around a class centre each: `n_per` per class, Gaussian spread `spread`."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 10, (classes, dim))
    x = np.concatenate([centres[c] + spread * rng.normal(0, 1, (n_per, dim)) for c in range(classes)])
    return x, np.repeat(np.arange(classes), n_per)


# -- the measure ----------------------------------------------------------------------------------------

def test_mean_pairwise_distance_by_hand():
    x = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 8.0]])
    # the three pairs are 5, 8 and 5 apart: (5 + 8 + 5) / 3
    assert mean_pairwise_distance(x) == pytest.approx(6.0)
    with pytest.raises(InputError, match="at least 2"):
        mean_pairwise_distance(x[:1])


def test_as_varied_as_the_data_is_about_one_and_a_collapsed_class_is_near_zero():
    real, rc = _clusters(40, 4, seed=1)
    fake, fc = _clusters(40, 4, seed=1)            # the data itself, drawn again: exactly its spread
    same = within_class_diversity(fake, fc, real, rc, names=["a", "b", "c", "d"])
    assert same["classes"] == 4 and same["below_half"] == 0
    assert same["mean"] == pytest.approx(1.0, abs=1e-6)
    assert [r["name"] for r in same["per_class"]] == ["a", "b", "c", "d"]
    other, oc = _clusters(40, 4, seed=1)
    fresh = np.concatenate([real[rc == c].mean(0) + np.random.default_rng(c + 5).normal(0, 1, (40, 16))
                            for c in range(4)])
    assert 0.8 < within_class_diversity(fresh, oc, real, rc)["mean"] < 1.2
    # class 2 collapses to one picture (plus a trace of noise): its ratio falls to ~0, the others stay
    collapsed = fresh.copy()
    collapsed[oc == 2] = collapsed[oc == 2][0] + 1e-3 * np.random.default_rng(3).normal(0, 1, (40, 16))
    d = within_class_diversity(collapsed, oc, real, rc)
    by = {r["class"]: r["ratio"] for r in d["per_class"]}
    assert by[2] < 0.01 and min(by[c] for c in (0, 1, 3)) > 0.8
    assert d["below_half"] == 1 and d["mean"] < 0.8
    # the overall spread cannot see it: every class is still drawn, so all samples together look like the data
    overall = mean_pairwise_distance(collapsed) / mean_pairwise_distance(real)
    assert overall > 0.9


def test_classes_without_pairs_are_left_out_and_nothing_to_measure_is_an_error():
    real, rc = _clusters(10, 3, seed=2)
    fake, fc = _clusters(10, 3, seed=3)
    real_one = real[(rc != 1) | (np.arange(len(rc)) == np.flatnonzero(rc == 1)[0])]
    rc_one = rc[(rc != 1) | (np.arange(len(rc)) == np.flatnonzero(rc == 1)[0])]   # class 1: a single image
    d = within_class_diversity(fake, fc, real_one, rc_one)
    assert [r["class"] for r in d["per_class"]] == [0, 2] and d["classes"] == 2
    with pytest.raises(InputError, match="draw more samples"):
        within_class_diversity(fake[::10], fc[::10], real, rc)       # one sample per class
    with pytest.raises(InputError, match="one class per feature row"):
        within_class_diversity(fake, fc[:-1], real, rc)


# -- the training monitor --------------------------------------------------------------------------------

def _imgs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 16, 16, generator=g) * 2 - 1


def test_the_monitor_measures_each_class_and_warns_on_class_wise_collapse():
    real = _imgs(30, 1)
    real_cls = torch.arange(3).repeat_interleave(10)
    mon = CollapseMonitor(MonitorSettings())
    mon.set_reference(real)
    with pytest.raises(InputError, match="set_class_reference"):
        mon.class_diversity(real, real_cls)
    mon.set_class_reference(real, real_cls)
    assert set(mon.state.class_real_distance) == {0, 1, 2}

    samples = _imgs(12, 2)
    cls = torch.arange(3).repeat_interleave(4)
    healthy = mon.evaluate(samples, 1, 0.7, 0.6, class_samples=samples, sample_classes=cls)
    assert 0.7 < healthy["class_diversity"] < 1.3 and healthy["classes_below_half"] == 0
    assert healthy["class_diversity_classes"] == 3 and healthy["warnings"] == []

    # every class draws one picture for all its latents, though the classes differ: the overall diversity
    # stays near the data's, only the class diversity sees it
    one = torch.cat([_imgs(1, 10 + c).repeat(4, 1, 1, 1) + 1e-3 * _imgs(4, 20 + c) for c in range(3)])
    mixed = torch.cat([one, _imgs(20, 4)])
    collapsed = mon.evaluate(mixed, 2, 0.7, 0.6, class_samples=one, sample_classes=cls)
    assert collapsed["class_diversity"] < 0.05 and collapsed["classes_below_half"] == 3
    assert collapsed["diversity"] > 0.7
    assert any("within-class diversity" in w for w in collapsed["warnings"])
    assert collapsed["class_diversity_lowest"]["class"] in (0, 1, 2)
    # an unconditional evaluation records no class keys
    assert "class_diversity" not in mon.evaluate(samples, 3, None, None)

    # the reference survives a checkpoint (JSON keys are strings)
    again = CollapseMonitor()
    again.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert again.state.class_real_distance == pytest.approx(mon.state.class_real_distance)
    with pytest.raises(InputError, match="2 reference images"):
        CollapseMonitor().set_class_reference(real[:3], torch.arange(3))


def test_a_conditional_run_logs_its_class_diversity(tmp_path):
    data = write_tiny_dataset(tmp_path, 24, 16)
    labels = np.array([0] * 12 + [1] * 8 + [2] * 4)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": labels.tolist(), "groups": ["many", "some", "few"]}))
    run = tmp_path / "run"
    assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
                     "--cond", "group", "--labels", str(lab), "--monitor-kimg", "0.008", "--monitor-per-class", "3",
                     "--kimg", "0.016"]) == 0
    mons = [json.loads(r) for r in (run / "log.jsonl").read_text().splitlines() if '"monitor"' in r]
    mons = [m for m in mons if m.get("kind") == "monitor"]
    assert mons, "the monitor ran"
    for m in mons:
        assert m["class_diversity_classes"] == 3 and m["class_diversity"] > 0
        assert 0 <= m["classes_below_half"] <= 3
    state = json.loads((run / "state.json").read_text())
    assert state["config"]["monitor_per_class"] == 3
    assert set(state["monitor"]["class_real_distance"]) == {"0", "1", "2"}


def test_the_cli_refuses_a_single_sample_per_class(tmp_path, capsys):
    data = write_tiny_dataset(tmp_path, 8, 16)
    rc = cli.main(["--config", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
                   "--no-progress", "--monitor-per-class", "1"])
    assert rc != 0
    assert "--monitor-per-class must be 0 (off) or at least 2" in capsys.readouterr().err


def test_the_warning_fires_on_the_share_of_collapsed_classes_too():
    """Most classes fine, the mean above half, but more than a fifth of the classes drawn as one picture each."""
    C = 10
    real = _imgs(10 * C, 7)
    real_cls = torch.arange(C).repeat_interleave(10)
    mon = CollapseMonitor(MonitorSettings())
    mon.set_reference(real)
    mon.set_class_reference(real, real_cls)
    cls = torch.arange(C).repeat_interleave(4)
    parts = []
    for c in range(C):
        if c < 3:      # classes 0-2: one picture each
            parts.append(_imgs(1, 40 + c).repeat(4, 1, 1, 1) + 1e-3 * _imgs(4, 50 + c))
        else:
            parts.append(_imgs(4, 60 + c))
    samples = torch.cat(parts)
    healthy = torch.cat([_imgs(4, 70 + c) for c in range(C)])
    # a healthy evaluation first: the warning is for a loss of diversity (see the warm-up test below)
    assert mon.evaluate(_imgs(40, 99), 1, None, None, class_samples=healthy, sample_classes=cls)["warnings"] == []
    r = mon.evaluate(_imgs(40, 99), 2, None, None, class_samples=samples, sample_classes=cls)
    assert r["classes_below_half"] == 3 and r["class_diversity"] > 0.5
    assert any("3 of 10 classes below half" in w for w in r["warnings"])
    # two of ten (20 %) is not more than the share
    mon2 = CollapseMonitor(MonitorSettings())
    mon2.set_reference(real)
    mon2.set_class_reference(real, real_cls)
    mon2.evaluate(_imgs(40, 99), 1, None, None, class_samples=healthy, sample_classes=cls)
    two = torch.cat([parts[0], parts[1], _imgs(4, 62)] + parts[3:])
    r2 = mon2.evaluate(_imgs(40, 99), 2, None, None, class_samples=two, sample_classes=cls)
    assert r2["classes_below_half"] == 2 and r2["warnings"] == []


def _squeezed(C, k, seed):
    """4 samples in each of C classes, every class's spread scaled by k (k near 0: one picture per class)."""
    parts = []
    for c in range(C):
        centre = _imgs(1, seed + c)
        parts.append((centre + k * (_imgs(4, seed + 100 + c) - centre)).clamp(-1, 1))
    return torch.cat(parts)


def test_classes_still_forming_do_not_warn_but_a_fall_or_a_long_low_stretch_does():
    """A young conditional G draws each class alike and gets more varied as it learns: no warning while the class
    diversity rises. A fall from its best warns at once; classes that never form warn after class_patience."""
    C = 6
    real = _imgs(10 * C, 3)
    real_cls = torch.arange(C).repeat_interleave(10)
    cls = torch.arange(C).repeat_interleave(4)

    def fresh(**kw):
        m = CollapseMonitor(MonitorSettings(**kw))
        m.set_reference(real)
        m.set_class_reference(real, real_cls)
        return m

    def step(m, k, i):
        return m.evaluate(_imgs(24, 5), i, None, None, class_samples=_squeezed(C, k, 200), sample_classes=cls)

    rising = fresh()
    recs = [step(rising, k, i) for i, k in enumerate((0.05, 0.15, 0.3, 0.45))]
    divs = [r["class_diversity"] for r in recs]
    assert divs == sorted(divs) and divs[0] < 0.5, divs                  # low, and rising
    assert all(r["warnings"] == [] for r in recs)
    # then it falls back: a loss, and below half -> a warning
    fell = step(rising, 0.1, 5)
    assert fell["class_diversity"] < 0.95 * max(divs)
    assert any("class-wise collapse" in w for w in fell["warnings"])

    # never forming: flat and low; quiet for class_patience - 1 evaluations, then it warns
    flat = fresh(class_patience=3)
    quiet = [step(flat, 0.1, i)["warnings"] for i in range(2)]
    assert quiet == [[], []]
    assert any("class-wise collapse" in w for w in step(flat, 0.1, 2)["warnings"])


def test_the_shipped_run_s_own_monitor_log_raises_no_class_warning_under_the_rule():
    """The 2026-12-07 run that shipped (docs/results/...-nobal-log.jsonl) warned five times in its first 500 kimg
    under the old rule (41 of 97 classes below half at 100 kimg, while rising); replayed through the rule: none."""
    from pathlib import Path

    log = Path(__file__).resolve().parent.parent / "docs/results/2026-12-07-e009eca-h100-emoji64-nobal-log.jsonl"
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    recs = [r for r in recs if r.get("kind") == "monitor" and "class_diversity" in r]
    assert len(recs) >= 30
    assert sum(bool(r["warnings"]) for r in recs[:5]) == 5       # what the old rule said
    mon = CollapseMonitor(MonitorSettings())
    low = fired = 0
    for r in recs:
        low += mon.class_low(r)
        fired += mon.class_collapse(r)
        mon.state.history.append(r)
    assert low == 5 and fired == 0
