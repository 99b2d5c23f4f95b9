"""NoisyTwins (--noisy-twins): class-embedding noise and a Barlow Twins loss on twin w's.

The loss, the mapping network's noise, the trainer's twin batches and the command line, on the CPU with
fixed seeds; statistical checks have tolerances many standard errors wide."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from models.stylegan2 import MappingNetwork
from tests.test_training_runs import write_tiny_dataset
from training import cli, losses
from training.config import build_config, finalize
from training.dataset import effective_number_scale
from training.trainer import Trainer


# ---------------------------------------------------------------------------------------------
# the loss

def test_the_loss_is_near_zero_for_equal_uncorrelated_twins_and_the_dimension_count_for_independent_ones():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 16, generator=g)
    same = losses.noisy_twins(w, w.clone())
    assert 0 <= same.item() < 0.05              # diagonal exactly 1; off-diagonal ~ 1/sqrt(n) each, x 0.005
    other = losses.noisy_twins(w, torch.randn(4096, 16, generator=g))
    assert 14.0 < other.item() < 16.5           # every twin correlation ~ 0: sum over 16 of (0 - 1)^2
    # a scale or shift of one twin changes nothing (batch-standardised): only correlation counts
    assert losses.noisy_twins(w, 3 * w + 2).item() == pytest.approx(same.item(), abs=1e-3)


def test_the_off_diagonal_term_sees_redundant_dimensions():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 8, generator=g)
    w_red = w.clone()
    w_red[:, 1] = w_red[:, 0]                   # two dimensions saying the same thing
    plain = losses.noisy_twins(w, w, off_diagonal=1.0).item()
    redundant = losses.noisy_twins(w_red, w_red, off_diagonal=1.0).item()
    assert redundant > plain + 1.5              # C_01 = C_10 = 1 add 2
    assert losses.noisy_twins(w_red, w_red, off_diagonal=0.0).item() < 1e-3


def test_the_loss_pulls_twins_together():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(256, 8, generator=g)
    b = (a + torch.randn(256, 8, generator=g)).requires_grad_(True)
    opt = torch.optim.SGD([b], lr=20.0)
    first = None
    for _ in range(30):
        loss = losses.noisy_twins(a, b)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses.noisy_twins(a, b).item() < 0.5 * first


@pytest.mark.parametrize("wa, wb, msg", [
    (torch.zeros(8, 4), torch.zeros(8, 5), "same shape"),
    (torch.zeros(8, 2, 4), torch.zeros(8, 2, 4), r"\[N, w_dim\]"),
    (torch.zeros(1, 4), torch.zeros(1, 4), "at least 2 twin pairs"),
])
def test_the_loss_refuses_mismatched_batches(wa, wb, msg):
    with pytest.raises(InputError, match=msg):
        losses.noisy_twins(wa, wb)


# ---------------------------------------------------------------------------------------------
# the mapping network's embedding noise

def test_embedding_noise_moves_w_in_proportion_and_none_is_the_plain_mapping():
    torch.manual_seed(3)
    m = MappingNetwork(z_dim=16, c_dim=5, w_dim=16, num_ws=3, num_layers=2)
    z = torch.randn(64, 16)
    c = torch.eye(5)[torch.arange(64) % 5]
    plain = m(z, c)
    assert torch.equal(m(z, c, embed_noise=0.0), plain)        # the same module and inputs: no noise drawn
    spread = {}
    for sigma in (0.1, 0.4):
        torch.manual_seed(4)
        spread[sigma] = (m(z, c, embed_noise=sigma) - plain).norm(dim=2).mean().item()
    assert spread[0.1] > 0 and 2.5 < spread[0.4] / spread[0.1] < 5.5      # ~linear for small noise
    # noise draws differ between calls: twins with one z and class get two w's
    assert not torch.allclose(m(z, c, embed_noise=0.25), m(z, c, embed_noise=0.25))


def test_a_per_sample_noise_scale_leaves_rows_of_scale_zero_alone():
    torch.manual_seed(5)
    m = MappingNetwork(z_dim=8, c_dim=3, w_dim=8, num_ws=2, num_layers=2)
    z, c = torch.randn(6, 8), torch.eye(3)[torch.tensor([0, 1, 2, 0, 1, 2])]
    plain = m(z, c)
    scale = torch.tensor([[0.0], [0.5], [0.0], [0.5], [0.0], [0.5]])
    noisy = m(z, c, embed_noise=scale)
    moved = (noisy - plain).abs().amax(dim=(1, 2))
    assert torch.equal(moved == 0, scale[:, 0] == 0)


# ---------------------------------------------------------------------------------------------
# per-class noise: the effective number of samples

def test_the_effective_number_scale_gives_rare_classes_more_noise_with_a_mean_of_one():
    labels = np.array([0] * 100 + [1] * 10 + [2] * 1 + [4] * 10)          # class 3 has no images
    s = effective_number_scale(labels, 0.99, num_classes=5)
    e = (1 - 0.99 ** np.array([100, 10, 1, 10])) / 0.01                    # Cui et al.'s E_n
    want = (1 / e) / (1 / e).mean()
    assert np.allclose(s[[0, 1, 2, 4]], want) and s[3] == 0
    assert s[2] > s[1] == s[4] > s[0] and s[[0, 1, 2, 4]].mean() == pytest.approx(1.0)
    assert np.allclose(effective_number_scale(labels, 0.0, 5), [1, 1, 1, 0, 1])    # beta 0: one std for all


def test_beta_scales_each_classes_noise_in_the_g_step(tmp_path):
    tr, said = _trainer(tmp_path, noisy_twins=0.05, noisy_twins_beta=0.9)
    assert tr.G_step.class_noise is None                   # switched on with the twins, at the first iteration
    tr.iteration()
    scale = tr.G_step.class_noise
    assert scale is not None and scale.shape == (3,) and torch.allclose(scale, torch.ones(3), atol=1e-6)
    assert "per class x1-x1 (beta 0.9)" in tr.describe()   # 8 images per class: the same scale
    lab = np.array([0] * 20 + [1] * 3 + [2] * 1)
    (tmp_path / "labels.json").write_text(json.dumps({"group": lab.tolist(), "groups": ["a", "b", "c"]}))
    cfg = build_config("tiny", 16, data=str(tmp_path / "tiny16.npy"), out=str(tmp_path / "run2"), device="cpu",
                       kimg=1.0, cond="group", labels=str(tmp_path / "labels.json"), monitor_kimg=0.0, aug="none",
                       noisy_twins=0.05, noisy_twins_beta=0.9)
    tr = Trainer(cfg, write_outputs=False, log=lambda s: None)
    tr.iteration()
    scale = tr.G_step.class_noise
    assert scale[2] > scale[1] > scale[0] and torch.allclose(scale.mean(), torch.tensor(1.0))
    # in the G step each row's noise is the class's scale x sigma: rows of the common class move least
    torch.manual_seed(6)
    c = torch.eye(3)[torch.tensor([0, 2] * 32)]
    z = torch.randn(64, tr.G.z_dim)
    with torch.no_grad():
        plain = tr.G.mapping(z, c)
        ws = tr.G_step.G.mapping(z, c, embed_noise=(c @ scale)[:, None] * tr.G_step.embed_noise)
    moved = (ws - plain).norm(dim=2).mean(dim=1)
    assert moved[1::2].mean() > 2 * moved[0::2].mean()


# ---------------------------------------------------------------------------------------------
# the trainer

def _trainer(tmp_path, **kw):
    data = write_tiny_dataset(tmp_path, 24, 16)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": [i % 3 for i in range(24)], "groups": ["a", "b", "c"]}))
    cfg = build_config("tiny", 16, data=str(data), out=str(tmp_path / "run"), device="cpu", kimg=1.0,
                       cond="group", labels=str(lab), monitor_kimg=0.0, aug="none", **kw)
    said = []
    return Trainer(cfg, write_outputs=False, log=said.append), said


def test_twin_batches_share_z_and_class_and_switch_on_at_the_start_kimg(tmp_path):
    tr, said = _trainer(tmp_path, noisy_twins=0.05, noisy_twins_start_kimg=0.008)
    seen = []
    step = tr.G_train

    def spy(z, c, *a, **k):
        seen.append((z.detach().clone(), c.detach().clone(), tr.G_step.embed_noise))
        return step(z, c, *a, **k)

    tr.G_train = spy
    b = tr.batch_gpu
    tr.iteration()                               # from 0 images: before the start
    z, c, noise = seen[-1]
    assert noise == 0.0 and not torch.equal(z[: b // 2], z[b // 2:])
    assert tr.stats[14].item() == 0
    tr.iteration()                               # from 8 images: on, for the D step too
    z, c, noise = seen[-1]
    assert noise == 0.25 and z.shape[0] == b
    assert torch.equal(z[: b // 2], z[b // 2:]) and torch.equal(c[: b // 2], c[b // 2:])
    assert tr.stats[14].item() == 1 and tr.stats[13].item() > 0
    assert any("NoisyTwins on (weight 0.05, class-embedding noise 0.25)" in s for s in said)
    assert tr.describe().endswith("; NoisyTwins weight 0.05, class-embedding noise 0.25, from kimg 0.008")
    # the D step's fakes come from the same noisy embedding (the paper's noise augmentation)
    assert tr.G_step.embed_noise == 0.25 and tr.G_ema is not tr.G


def test_without_the_option_the_g_step_draws_as_before(tmp_path):
    tr, _ = _trainer(tmp_path)
    seen = []
    step = tr.G_train
    tr.G_train = lambda z, c, *a, **k: (seen.append(z.clone()), step(z, c, *a, **k))[1]
    for _ in range(3):
        tr.iteration()
    assert tr.G_step.embed_noise == 0.0 and tr.stats[14].item() == 0 and "NoisyTwins" not in tr.describe()
    b = tr.batch_gpu
    assert all(not torch.equal(z[: b // 2], z[b // 2:]) for z in seen)


@pytest.mark.parametrize("kw, msg", [
    (dict(noisy_twins=-0.1), "loss weight"),
    (dict(noisy_twins_sigma=0.0), "sigma must be > 0"),
    (dict(noisy_twins_start_kimg=-1.0), "start-kimg must be >= 0"),
    (dict(noisy_twins_beta=1.0), r"beta must be in \[0, 1\)"),
    (dict(noisy_twins_beta=-0.5), r"beta must be in \[0, 1\)"),
])
def test_the_config_refuses_bad_settings(kw, msg):
    with pytest.raises(InputError, match=msg):
        finalize(build_config("tiny", 16, **kw), 16)


def test_an_unconditional_run_or_an_odd_batch_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(InputError, match="unconditional: add --cond KEY"):
        finalize(build_config("tiny", 16, noisy_twins=0.01), 16)
    with pytest.raises(InputError, match="even per-GPU batch of at least 4"):
        _trainer(tmp_path, noisy_twins=0.01, batch=6 - 1)


def test_a_twins_run_trains_logs_exports_and_retunes_from_the_command_line(tmp_path, capsys):
    from training.export import export_run

    data = write_tiny_dataset(tmp_path, 24, 16)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": [i % 3 for i in range(24)], "groups": ["a", "b", "c"]}))
    run = tmp_path / "run"
    base = ["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
            "--cond", "group", "--labels", str(lab), "--monitor-kimg", "0", "--log-every", "1"]
    assert cli.main([*base, "--kimg", "0.032", "--noisy-twins", "0.02", "--noisy-twins-sigma", "0.5"]) == 0
    assert "NoisyTwins on (weight 0.02, class-embedding noise 0.5)" in capsys.readouterr().out
    state = json.loads((run / "state.json").read_text())
    assert state["config"]["noisy_twins"] == 0.02 and state["config"]["noisy_twins_sigma"] == 0.5
    recs = [json.loads(r) for r in (run / "log.jsonl").read_text().splitlines()]
    twins = [r["twins"] for r in recs if r.get("kind") == "train" and "twins" in r]
    assert twins and all(np.isfinite(t) and t >= 0 for t in twins)

    paths = export_run(run, tmp_path / "models" / "twins")
    meta = json.loads(paths["config"].read_text())
    assert meta["metadata"]["training"]["noisy_twins"] == {"weight": 0.02, "sigma": 0.5, "start_kimg": 0.0,
                                                           "beta": 0.0}
    assert "NoisyTwins (`--noisy-twins 0.02`) from 0 kimg" in paths["card"].read_text()

    # switched off on a resume with --retune, and the log says so
    assert cli.main([*base, "--kimg", "0.048", "--resume", str(run), "--retune", "--noisy-twins", "0"]) == 0
    assert json.loads((run / "state.json").read_text())["config"]["noisy_twins"] == 0
    retunes = [json.loads(r) for r in (run / "log.jsonl").read_text().splitlines() if '"retune"' in r]
    assert retunes[-1]["changed"] == {"noisy_twins": {"from": 0.02, "to": 0.0}}

    assert cli.main([*base[:5], str(tmp_path / "u"), "--device", "cpu", "--no-progress", "--kimg", "0.016",
                     "--noisy-twins", "0.02"]) == 2
    assert "unconditional: add --cond KEY" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# on a CUDA GPU: compiled, and no host synchronisation added to the inner loop

@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_twins_on_the_gpu_train_compiled_and_never_sync(tmp_path, compile_):
    rng = np.random.default_rng(0)
    data = tmp_path / "d.npy"
    np.save(data, rng.integers(0, 256, size=(256, 64, 64, 3), dtype=np.uint8))
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": [i % 3 for i in range(256)]}))
    cfg = build_config("emoji64", data=str(data), out=str(tmp_path / "t"), kimg=10, batch=32, progress=False,
                       r1_interval=2, pl_interval=2, ada_interval=1, cond="group", labels=str(lab),
                       compile=compile_, noisy_twins=0.01)
    from tests.test_training_gpu import iterate_without_sync

    tr = Trainer(cfg, log=lambda s: None, write_outputs=False)
    iterate_without_sync(tr)
    assert tr.stats[14].item() == 7 and tr.stats[13].item() > 0 and tr.G_step.embed_noise == 0.25
