"""--compile-scope full: G's no-grad pass and the augmentation run inside compiled graphs. A real compile on the
CPU (inductor's C++ backend) of the tiny network: the compiled D callable augments (p = 1 changes its logits,
p = 0 gives D's own), and training runs on it."""
from __future__ import annotations

import pytest
import torch

from tests.training_helpers import square_images, tiny_cfg
from training.dataset import DatasetInfo, to_float
from training.trainer import Trainer


def _data():
    imgs = square_images(24, 16)
    return imgs, DatasetInfo(source="squares", count=len(imgs), resolution=16, channels=3, decoder="array")


def test_which_paths_fuse_the_augmentation(tmp_path):
    data = _data()
    build = lambda **kw: Trainer(tiny_cfg("squares", tmp_path, 1.0, batch=8, **kw), data=data,   # noqa: E731
                                 write_outputs=False, log=lambda s: None)
    assert build(compile=True).fused_augment                          # the default scope: full
    assert not build(compile=True, compile_scope="nets").fused_augment
    assert not build(compile=False).fused_augment
    assert not build(compile=True, loss="wgan-gp").fused_augment      # its penalty needs the augmented images


@pytest.mark.timeout(900)
def test_compiled_d_callable_augments_and_trains(tmp_path):
    torch._dynamo.reset()
    tr = Trainer(tiny_cfg("squares", tmp_path, 1.0, batch=8, compile=True, aug="fixed", aug_p=0.0,
                          auto_countermeasures=False, monitor_kimg=0.0), data=_data(), write_outputs=False,
                 log=lambda s: None)
    assert tr.fused_augment
    real = to_float(tr.loader.data[:8], tr.channels_last)
    with torch.no_grad(), tr._scope():
        plain = tr.D(real)
        at_zero = tr.D_train(real)
        tr.aug.p.fill_(1.0)
        torch.manual_seed(0)
        at_one = tr.D_train(real)
    assert torch.allclose(at_zero, plain, atol=1e-4, rtol=1e-4)        # p = 0: the augmentation is the identity
    assert (at_one - plain).abs().max() > 1e-3                         # p = 1: D saw transformed images
    tr.aug.p.fill_(0.5)
    d0 = {k: v.detach().clone() for k, v in tr.D.named_parameters()}
    g0 = {k: v.detach().clone() for k, v in tr.G.named_parameters()}
    for _ in range(4):
        tr.iteration()
    assert torch.isfinite(tr.stats).all()
    assert tr.stats[1] == 32 and tr.stats[3] == 32                     # 4 G steps and 4 D steps of 8
    assert any(not torch.equal(v, tr.D.state_dict()[k]) for k, v in d0.items())
    assert any(not torch.equal(v, dict(tr.G.named_parameters())[k]) for k, v in g0.items())
