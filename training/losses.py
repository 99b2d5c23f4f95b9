"""GAN losses and regularizers, as plain functions of logits, images and latents.

Written against the NVlabs network interface (D(img, c) -> logits [N, 1];
G.mapping(z, c) -> ws [N, num_ws, w_dim]; G.synthesis(ws) -> img). The trainer
decides when each runs (lazy regularization) and how gradients are synchronised;
these functions only say what is minimised. Every function returns per-sample
values [N] (or a scalar where noted) in float32, whatever the autocast dtype.

- Non-saturating logistic (StyleGAN2 default):
    G: softplus(-D(G(z)))      D: softplus(D(G(z))) + softplus(-D(x))
- R1 (Mescheder et al. 2018): gamma/2 * ||grad_x D(x)||^2 on real data, lazily every
  16 minibatches with the weight multiplied by 16 (Karras et al. 2020).
- WGAN-GP (Gulrajani et al. 2017): G: -D(G(z)); D: D(G(z)) - D(x) +
  lambda * (||grad D(x_hat)|| - 1)^2 on random interpolates x_hat, lambda = 10, plus
  ProGAN's drift term eps * D(x)^2 that keeps the critic's output from wandering.
- Path length regularization (Karras et al. 2020): (||J_w^T y|| - a)^2 with y ~ N(0, I)
  / sqrt(pixels) and a the running mean of the lengths.
- NoisyTwins (Rangwani et al., CVPR 2023), against class-wise mode collapse of a conditional
  StyleGAN: the same z with two noisy copies of its class embedding gives two w; a Barlow Twins
  loss (Zbontar et al. 2021) on the batch of pairs pulls each w dimension's twin correlation to 1
  (the class's w does not depend on the embedding noise: class-consistent) and the cross
  correlations between dimensions to 0 (w spreads over all its dimensions: diverse).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from core.errors import InputError


def _flat(logits: torch.Tensor) -> torch.Tensor:
    if logits.ndim != 2 or logits.shape[1] != 1:
        raise InputError(f"discriminator logits must be [N, 1]; got {list(logits.shape)}")
    return logits.float().flatten()


# -- non-saturating logistic -----------------------------------------------------------------------

def logistic_g(fake_logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(-_flat(fake_logits))


def logistic_d_fake(fake_logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(_flat(fake_logits))


def logistic_d_real(real_logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(-_flat(real_logits))


def r1_penalty(real_images: torch.Tensor, real_logits: torch.Tensor) -> torch.Tensor:
    """||d sum(D(x)) / dx||^2 per sample. real_images must require grad and have produced real_logits."""
    if not real_images.requires_grad:
        raise InputError("R1 needs real images with requires_grad=True (set before running D)")
    (grads,) = torch.autograd.grad(outputs=real_logits.float().sum(), inputs=real_images, create_graph=True)
    return grads.float().square().sum(dim=[1, 2, 3])


# -- WGAN-GP -----------------------------------------------------------------------------------------

def wgan_g(fake_logits: torch.Tensor) -> torch.Tensor:
    return -_flat(fake_logits)


def wgan_d_fake(fake_logits: torch.Tensor) -> torch.Tensor:
    return _flat(fake_logits)


def wgan_d_real(real_logits: torch.Tensor, drift: float = 0.001) -> torch.Tensor:
    r = _flat(real_logits)
    return -r + drift * r.square()


def gradient_penalty(D: Callable[[torch.Tensor], torch.Tensor], real: torch.Tensor, fake: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """((||grad D(x_hat)||_2 - 1)^2 per sample, D(x_hat)) on x_hat = eps x + (1 - eps) G(z), eps ~ U(0, 1)."""
    if real.shape != fake.shape:
        raise InputError(f"real and fake batches differ in shape: {list(real.shape)} vs {list(fake.shape)}")
    eps = torch.rand(real.shape[0], 1, 1, 1, device=real.device, dtype=real.dtype)
    x_hat = (eps * real.detach() + (1 - eps) * fake.detach()).requires_grad_(True)
    logits = D(x_hat)
    (grads,) = torch.autograd.grad(outputs=logits.float().sum(), inputs=x_hat, create_graph=True)
    norm = grads.float().flatten(1).norm(2, dim=1)
    return (norm - 1).square(), logits


# -- path length -----------------------------------------------------------------------------------------

def path_lengths(images: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """||J_w^T y|| per sample with y ~ N(0, I) / sqrt(H * W): [N]. ws must be in images' graph."""
    noise = torch.randn_like(images) / math.sqrt(images.shape[2] * images.shape[3])
    (grads,) = torch.autograd.grad(outputs=(images.float() * noise).sum(), inputs=ws, create_graph=True)
    return grads.float().square().sum(dim=2).mean(dim=1).sqrt()


def path_length_penalty(images: torch.Tensor, ws: torch.Tensor, pl_mean: torch.Tensor, decay: float = 0.01,
                        ) -> torch.Tensor:
    """(lengths - a)^2 per sample; updates the running mean `pl_mean` (a 0-d buffer) in place."""
    lengths = path_lengths(images, ws)
    with torch.no_grad():
        pl_mean.copy_(pl_mean.lerp(lengths.mean(), decay))
    return (lengths - pl_mean).square()


# -- NoisyTwins ------------------------------------------------------------------------------------

def noisy_twins(wa: torch.Tensor, wb: torch.Tensor, off_diagonal: float = 0.005, eps: float = 1e-5) -> torch.Tensor:
    """Barlow Twins loss between twin batches of w, [N, w_dim] each (row i of both from the same z and class):
    sum_i (C_ii - 1)^2 + off_diagonal * sum_{i != j} C_ij^2, C the cross-correlation matrix of the batch-standardised
    twins. A scalar; 0 for twins that are equal and whose dimensions are uncorrelated."""
    if wa.ndim != 2 or wa.shape != wb.shape:
        raise InputError(f"NoisyTwins needs two [N, w_dim] batches of the same shape; got {list(wa.shape)} and "
                         f"{list(wb.shape)}")
    n = wa.shape[0]
    if n < 2:
        raise InputError("NoisyTwins needs at least 2 twin pairs per step (its correlations are over the batch)")
    a, b = wa.float(), wb.float()
    a = (a - a.mean(0)) / (a.var(0, unbiased=False) + eps).sqrt()
    b = (b - b.mean(0)) / (b.var(0, unbiased=False) + eps).sqrt()
    c = a.t() @ b / n
    diag = torch.diagonal(c)
    on = (diag - 1).square().sum()
    off = c.square().sum() - diag.square().sum()
    return on + off_diagonal * off
