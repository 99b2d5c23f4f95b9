"""Random-weight files in the published layouts of the metric networks, for CPU tests.

The published files cannot be downloaded here, so the tests write files with the same key names and
shapes and random values, load one file into Atelier's network and into the reference implementation,
and compare the outputs.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from evaluation.inception import FIDInceptionV3
from evaluation.lpips import LPIPS


def random_inception(seed: int = 0) -> FIDInceptionV3:
    """Random weights with activations of order one (a default init shrinks them to ~1e-7 by pool3)."""
    torch.manual_seed(seed)
    net = FIDInceptionV3()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
        nn.init.normal_(net.fc.weight, std=0.05)
        nn.init.normal_(net.fc.bias, std=0.5)
    return net.eval()


def save_inception_file(path: Path, seed: int = 0, step_counters: bool = True) -> Path:
    """A random FID Inception state dict; with BatchNorm step counters as torch-fidelity's module saves it,
    or without, as a TF port may carry it. Both load into Atelier's network."""
    state = random_inception(seed).state_dict()
    if not step_counters:
        state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def save_lpips_files(folder: Path, net: str = "alex", seed: int = 0) -> tuple[Path, Path, LPIPS]:
    """Random LPIPS weights in the published layouts: torchvision backbone (with its classifier) + lpips heads."""
    torch.manual_seed(seed)
    src = LPIPS(net=net, load=False, device="cpu")
    with torch.no_grad():
        for lin in src.lins:
            lin.weight.copy_(torch.rand_like(lin.weight))          # heads are non-negative in the real file
    backbone = {f"features.{k}": v for k, v in src.features.state_dict().items()}
    backbone["classifier.1.weight"] = torch.zeros(8, 4)             # torchvision keeps the classifier; ignored
    heads = {f"lin{k}.model.1.weight": lin.weight.detach().clone() for k, lin in enumerate(src.lins)}
    folder.mkdir(parents=True, exist_ok=True)
    b, h = folder / ("alexnet-owt-7be5be79.pth" if net == "alex" else "vgg16-397923af.pth"), folder / f"lpips_{net}.pth"
    torch.save(backbone, b)
    torch.save(heads, h)
    return b, h, src
