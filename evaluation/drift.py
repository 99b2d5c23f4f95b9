"""Drift of an optimized image from its reference: PSNR and SSIM on the same seed.

Every optimization toggle is checked against the fp32 reference on the same seed
(DESIGN.md), and the benchmark reports the same numbers. Inputs are image arrays of
equal shape: one image [H, W], [H, W, C] / [C, H, W], or a batch [N, H, W, C] /
[N, C, H, W], as numpy arrays or torch tensors. uint8 images have a data range of 255;
float images of 1.0 unless told otherwise (pass 2.0 for [-1, 1] images).

PSNR is taken over the whole batch (one mean squared error), SSIM is the mean over
images and channels of Wang et al.'s index (Gaussian window 11, σ 1.5, K1 0.01,
K2 0.03, valid region only), computed in float64 so the metric adds no error of its own.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from core.errors import InputError

_CHANNEL_COUNTS = (1, 3, 4)


def _as_nchw(x: Any, layout: str | None, name: str) -> tuple[torch.Tensor, bool]:
    """float64 [N, C, H, W] and whether the input was uint8."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        try:
            t = torch.from_numpy(np.ascontiguousarray(np.asarray(x)))
        except TypeError:
            raise InputError(f"{name} is not an image array (got {type(x).__name__})") from None
    is_uint8 = t.dtype == torch.uint8
    if not (is_uint8 or t.is_floating_point()):
        raise InputError(f"{name} must hold uint8 or floating-point pixels, not {t.dtype}")
    if t.ndim == 2:
        t = t[None, None]
    elif t.ndim == 3:
        t = t[None]
    elif t.ndim != 4:
        raise InputError(f"{name} must be an image [H, W(, C)] or a batch [N, ...]; got shape {tuple(t.shape)}")
    if layout is None:
        layout = "NHWC" if t.shape[-1] in _CHANNEL_COUNTS and t.shape[1] not in _CHANNEL_COUNTS else "NCHW"
    if layout == "NHWC":
        t = t.permute(0, 3, 1, 2)
    elif layout != "NCHW":
        raise InputError(f"layout must be NHWC, NCHW or None (guess); got {layout!r}")
    return t.to(torch.float64), is_uint8


def _pair(reference: Any, candidate: Any, data_range: float | None, layout: str | None):
    a, a8 = _as_nchw(reference, layout, "reference")
    b, b8 = _as_nchw(candidate, layout, "candidate")
    if a.shape != b.shape:
        raise InputError(f"reference and candidate differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}; "
                         f"compare images of the same size, seed and batch")
    if data_range is None:
        data_range = 255.0 if (a8 and b8) else 1.0
    if not (data_range > 0 and math.isfinite(data_range)):
        raise InputError(f"data_range must be a positive number; got {data_range}")
    return a, b, float(data_range)


def psnr(reference: Any, candidate: Any, data_range: float | None = None, layout: str | None = None) -> float:
    """Peak signal-to-noise ratio in dB; inf for identical images, nan if the candidate holds NaN/Inf."""
    a, b, rng = _pair(reference, candidate, data_range, layout)
    if not bool(torch.isfinite(b).all()) or not bool(torch.isfinite(a).all()):
        return float("nan")
    mse = float(((a - b) ** 2).mean())
    if mse == 0.0:
        return float("inf")
    return 10.0 * math.log10(rng * rng / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x ** 2) / (2 * sigma * sigma))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]          # [1, 1, size, size]


def ssim(reference: Any, candidate: Any, data_range: float | None = None, layout: str | None = None,
         window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (1 = identical); nan if either image holds NaN/Inf.

    Images smaller than the window use the largest odd window that fits (SSIM on a
    handful of pixels is coarse, but tiny test models still get a number)."""
    a, b, rng = _pair(reference, candidate, data_range, layout)
    if not bool(torch.isfinite(b).all()) or not bool(torch.isfinite(a).all()):
        return float("nan")
    n, c, h, w = a.shape
    size = min(window, h, w)
    if size % 2 == 0:
        size -= 1
    if size < 1:
        raise InputError(f"images of {h}x{w} pixels are too small for SSIM")
    win = _gaussian_window(size, sigma * size / window if size < window else sigma)
    a = a.reshape(n * c, 1, h, w)
    b = b.reshape(n * c, 1, h, w)
    mu_a, mu_b = F.conv2d(a, win), F.conv2d(b, win)
    var_a = F.conv2d(a * a, win) - mu_a ** 2
    var_b = F.conv2d(b * b, win) - mu_b ** 2
    cov = F.conv2d(a * b, win) - mu_a * mu_b
    c1, c2 = (0.01 * rng) ** 2, (0.03 * rng) ** 2
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(index.mean())


def compare(reference: Any, candidate: Any, data_range: float | None = None, layout: str | None = None) -> dict:
    """PSNR, SSIM and the largest/mean absolute difference (in the images' own units)."""
    a, b, rng = _pair(reference, candidate, data_range, layout)
    finite = bool(torch.isfinite(b).all())
    diff = (a - b).abs()
    return {
        "psnr_db": psnr(a, b, rng, "NCHW"),
        "ssim": ssim(a, b, rng, "NCHW"),
        "max_abs": float(diff.max()) if finite else float("nan"),
        "mean_abs": float(diff.mean()) if finite else float("nan"),
        "finite": finite,
        "data_range": rng,
    }


# A perceptually ordered dark-to-bright ramp (black, indigo, magenta, orange, pale yellow) so that
# a difference map reads at a glance: black where the images agree, bright where they do not.
_RAMP = np.array([[0, 0, 4], [59, 15, 112], [140, 41, 129], [222, 73, 104], [254, 159, 109], [252, 253, 191]],
                 dtype=np.float64)


def difference_map(reference: Any, candidate: Any, gain: float | None = None,
                   layout: str | None = None) -> tuple[np.ndarray, float]:
    """A heat map of |reference - candidate| for the first image pair: uint8 [H, W, 3] and the gain used.

    The per-pixel difference (mean over channels, in units of the data range) is multiplied by
    `gain` and clipped to [0, 1] before colouring. With gain None it is chosen so that the 99.5th
    percentile of the difference fills the ramp (at least 1x, at most 1000x), so small drift is
    visible and the caption can say by how much it was amplified. Identical images give black."""
    a, b, rng = _pair(reference, candidate, None, layout)
    d = ((a[0] - b[0]).abs() / rng).mean(dim=0)                          # [H, W], 0..1
    d = torch.nan_to_num(d, nan=1.0, posinf=1.0, neginf=1.0).numpy()   # NaN pixels show as the brightest
    if gain is None:
        top = float(np.percentile(d, 99.5))
        gain = 1.0 if top <= 0 else float(min(1000.0, max(1.0, 1.0 / top)))
    if not (gain > 0 and math.isfinite(gain)):
        raise InputError(f"gain must be a positive number; got {gain}")
    t = np.clip(d * gain, 0.0, 1.0) * (len(_RAMP) - 1)
    lo = np.floor(t).astype(np.int64).clip(0, len(_RAMP) - 2)
    frac = (t - lo)[..., None]
    rgb = _RAMP[lo] * (1.0 - frac) + _RAMP[lo + 1] * frac
    return np.round(rgb).astype(np.uint8), float(gain)


__all__ = ["psnr", "ssim", "compare", "difference_map"]
