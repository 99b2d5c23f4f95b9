"""Shared helpers for the optim/ tests: StyleGAN test networks and the fp32 reference on fixed seeds."""
from __future__ import annotations

import numpy as np
import torch

CPU = torch.device("cpu")
SEEDS = (0, 1, 2, 3)


def load_G(testdata, name: str) -> torch.nn.Module:
    from models.stylegan import load_generator

    return load_generator(testdata / "stylegan" / f"{name}.pkl").G.eval().requires_grad_(False)


def latents(G, seeds=SEEDS) -> tuple[torch.Tensor, torch.Tensor]:
    """z exactly as the StyleGAN pipeline makes it (NVlabs' RandomState(seed).randn); class 1 if labelled."""
    z = torch.from_numpy(np.concatenate([np.random.RandomState(s).randn(1, G.z_dim) for s in seeds]).astype(np.float32))
    c = torch.zeros(len(seeds), G.c_dim)
    if G.c_dim:
        c[:, 1 % G.c_dim] = 1
    return z, c


def generate(G, flags, seeds=SEEDS, device=CPU) -> torch.Tensor:
    import optim

    z, c = latents(G, seeds)
    with torch.no_grad(), optim.runtime(flags, device):
        return G(z.to(device), c.to(device), noise_mode="const").float().cpu()


def prepared(testdata, name: str, flags, device=CPU, **kw):
    import optim

    G = load_G(testdata, name).to(device)
    return optim.prepare(G, flags, device, kind="stylegan", **kw)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def reference_G(testdata, name: str, device=CPU):
    """The fp32 reference generator: prepared with default flags, so on CUDA NVlabs' own fp16 blocks
    are off too (an unprepared sg2_cond4_64_fp16 runs its top blocks in fp16 on a GPU)."""
    from core.types import OptimizationFlags

    return prepared(testdata, name, OptimizationFlags(), device=device)[0]
