"""Augmentation (ADA), losses, the collapse monitor and checkpoint files, each on its own."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from core.errors import InputError, ModelLoadError
from training import checkpoint as ckpt
from training import losses
from training.augment import AdaController, AugmentPipe
from training.monitor import CollapseMonitor, MonitorSettings


def _x(n=8, res=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, res, res, generator=g) * 2 - 1


# -- augmentation ---------------------------------------------------------------------------------

def test_p0_is_identity_and_p1_changes_every_image():
    x = _x()
    assert torch.equal(AugmentPipe("blit", p=0.0)(x), x)                 # pixel-exact ops: exactly unchanged
    assert torch.allclose(AugmentPipe("bgcc", p=0.0)(x), x, atol=1e-5)
    torch.manual_seed(0)
    y = AugmentPipe("bgcc", p=1.0)(x)
    assert y.shape == x.shape
    assert all((y[i] - x[i]).abs().max() > 0.05 for i in range(len(x)))


def test_blit_flips_and_quarter_turns_are_permutations_of_pixels():
    pipe = AugmentPipe("blit", p=1.0)
    pipe.ops = {"xflip": 1, "rotate90": 1}      # no translation: the pixel set is kept exactly
    x = _x(16)
    torch.manual_seed(1)
    y = pipe(x)
    for i in range(len(x)):
        assert torch.equal(torch.sort(y[i].flatten()).values, torch.sort(x[i].flatten()).values)
    assert any(not torch.equal(y[i], x[i]) for i in range(len(x)))


def test_augmentation_is_differentiable_and_seeded():
    x = _x().requires_grad_(True)
    torch.manual_seed(5)
    y = AugmentPipe("bgcc", p=0.7)(x)
    y.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    torch.manual_seed(5)
    assert torch.equal(AugmentPipe("bgcc", p=0.7)(x.detach()), y.detach())


def test_colour_ops_keep_grey_axis():
    pipe = AugmentPipe("color", p=1.0)
    pipe.ops = {"hue": 1}                       # a hue rotation leaves greys grey
    grey = torch.linspace(-1, 1, 16).reshape(1, 1, 4, 4).repeat(4, 3, 1, 1)
    torch.manual_seed(0)
    assert torch.allclose(pipe(grey), grey, atol=1e-5)


def test_ada_moves_p_towards_target_and_clamps():
    pipe = AugmentPipe("bgc", p=0.5)
    ada = AdaController(pipe, target=0.6, interval=4, speed_kimg=1.0, batch=25)   # step 0.1 per update
    ada.accumulate(torch.ones(10, 1))               # D says "real" to every real image: overfitting
    ada.update()
    assert float(pipe.p) == pytest.approx(0.6)
    ada.accumulate(-torch.ones(10, 1))
    ada.update()
    assert float(pipe.p) == pytest.approx(0.5)
    for _ in range(20):
        ada.accumulate(torch.ones(4, 1))
        ada.update()
    assert float(pipe.p) == 1.0
    state = ada.state_dict()
    other = AdaController(AugmentPipe("bgc"), target=0.6)
    other.load_state_dict(state)
    assert float(other.pipe.p) == 1.0 and other.last_rt.item() == 1.0


def test_unknown_pipe_is_an_input_error():
    with pytest.raises(InputError, match="augmentation pipeline"):
        AugmentPipe("bgcx")


# -- losses ------------------------------------------------------------------------------------------

class _LinearD(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return (x * self.w).flatten(1).sum(1, keepdim=True)


def test_r1_and_gradient_penalty_on_a_linear_critic():
    w = torch.randn(3, 4, 4)
    D = _LinearD(w)
    x = _x(5, 4).requires_grad_(True)
    pen = losses.r1_penalty(x, D(x))
    assert torch.allclose(pen, torch.full((5,), float(w.square().sum())), rtol=1e-5)
    D2 = _LinearD(w / w.norm() * 2)               # ||grad|| = 2 everywhere -> GP = (2 - 1)^2
    gp, logits = losses.gradient_penalty(D2, _x(5, 4), _x(5, 4, seed=1))
    assert torch.allclose(gp, torch.ones(5), rtol=1e-5) and logits.shape == (5, 1)
    gp.mean().backward()
    assert D2.w.grad is not None and D2.w.grad.abs().sum() > 0    # the penalty trains the critic
    with pytest.raises(InputError, match="requires_grad"):
        losses.r1_penalty(_x(2, 4), D(_x(2, 4)))


def test_logistic_and_wgan_values():
    l = torch.tensor([[0.0], [2.0]])
    assert torch.allclose(losses.logistic_g(l), torch.tensor([math.log(2), math.log1p(math.exp(-2))]))
    assert torch.allclose(losses.logistic_d_fake(l) - losses.logistic_d_real(l), l.flatten())
    assert torch.equal(losses.wgan_g(l), -l.flatten())
    assert torch.allclose(losses.wgan_d_real(l, drift=0.5), torch.tensor([0.0, -2.0 + 0.5 * 4]))
    with pytest.raises(InputError, match=r"\[N, 1\]"):
        losses.logistic_g(torch.zeros(3))


def test_path_length_penalty_updates_running_mean():
    ws = torch.randn(4, 3, 8, requires_grad=True)
    A = torch.randn(8, 3 * 4 * 4)
    img = torch.tanh((ws.mean(1) @ A)).reshape(4, 3, 4, 4)
    pl_mean = torch.zeros(())
    pen = losses.path_length_penalty(img, ws, pl_mean, decay=0.5)
    assert pen.shape == (4,) and float(pl_mean) > 0
    pen.mean().backward()
    assert ws.grad is not None


# -- monitor -------------------------------------------------------------------------------------------

def test_monitor_flags_collapse_and_high_d_accuracy():
    real = _x(32, 32)
    mon = CollapseMonitor(MonitorSettings(patience=2))
    mon.set_reference(real)
    healthy = mon.evaluate(_x(32, 32, seed=3), kimg=1, d_acc_real=0.7, d_acc_fake=0.6)
    assert healthy["warnings"] == [] and 0.8 < healthy["diversity"] < 1.2 and healthy["duplicate_rate"] == 0
    one = _x(1, 32, seed=4).repeat(32, 1, 1, 1) + 0.001 * _x(32, 32, seed=5)
    collapsed = mon.evaluate(one, kimg=2, d_acc_real=0.99, d_acc_fake=0.99)
    assert collapsed["duplicate_rate"] == 1.0 and collapsed["diversity"] < 0.1
    assert any("diversity dropped" in w for w in collapsed["warnings"])
    assert any("near-identical" in w for w in collapsed["warnings"])
    third = mon.evaluate(_x(32, 32, seed=6), kimg=3, d_acc_real=0.99, d_acc_fake=0.98)
    assert any("accuracy" in w for w in third["warnings"])
    assert mon.choose_countermeasure(third) == "augment"
    mon.record_applied(3, "augment", "x")
    assert mon.choose_countermeasure(third) is None          # cool-down
    state = json.loads(json.dumps(mon.state_dict()))
    again = CollapseMonitor()
    again.load_state_dict(state)
    assert again.state.history == mon.state.history and again.state.applied == mon.state.applied


# -- checkpoint files -------------------------------------------------------------------------------------

def test_checkpoint_round_trip_shards_and_detects_damage(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.0, 0.99))
    net(torch.randn(4, 64)).sum().backward()
    opt.step()
    sizes = ckpt.save_checkpoint(tmp_path, {"net": net}, {"opt": opt}, {"step": 7}, max_file_bytes=20_000)
    assert any("-of-" in f for f in sizes)                     # two 16 kB moments exceed 20 kB: sharded
    assert all(v <= 20_000 + 4_000 for v in sizes.values())    # (plus the safetensors header)
    doc, tensors = ckpt.load_checkpoint(tmp_path)
    assert doc["step"] == 7
    for k, v in net.state_dict().items():
        assert torch.equal(tensors["net"][k], v)
    net2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt2 = torch.optim.Adam(net2.parameters(), lr=5.0)
    ckpt.load_optimizer(opt2, tensors["opt"], doc["optimizers"]["opt"], "test")
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 1e-3
    for pid in s1["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][pid][k], s2["state"][pid][k])
    with pytest.raises(InputError, match="optimizer is Adam"):
        ckpt.load_optimizer(torch.optim.SGD(net2.parameters(), lr=1), tensors["opt"], doc["optimizers"]["opt"], "t")

    victim = tmp_path / next(f for f in sizes if f.startswith("net"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="SHA-256"):
        ckpt.load_checkpoint(tmp_path)
    victim.write_bytes(bytes(data[:-10]))
    with pytest.raises(ModelLoadError, match="bytes"):
        ckpt.load_checkpoint(tmp_path)
    with pytest.raises(InputError, match="no checkpoint"):
        ckpt.read_state(tmp_path / "nowhere")
