"""Small shared pieces of the CPU training tests: a tiny structured data set and the tiny-run config."""
from __future__ import annotations

import numpy as np

from training.config import build_config


def square_images(n: int = 20, res: int = 16, seed: int = 0) -> np.ndarray:
    """Small structured images (coloured squares on white), so D has something to learn."""
    rng = np.random.default_rng(seed)
    out = np.full((n, res, res, 3), 255, dtype=np.uint8)
    for i in range(n):
        s = rng.integers(4, res // 2)
        y, x = rng.integers(0, res - s, size=2)
        out[i, y:y + s, x:x + s] = rng.integers(0, 255, size=3)
    return out


def tiny_cfg(data, out, kimg, **kw):
    """The tiny preset at 16 px with every moving part on (R1, PL, ADA, monitor, counter-measures)."""
    base = dict(data=str(data), out=str(out), kimg=kimg, device="cpu", r1_interval=2, pl_interval=2,
                aug="ada", aug_p=0.3, ada_interval=1, ada_kimg=0.5, log_every=1, monitor_kimg=0.016,
                monitor_samples=8, auto_countermeasures=True, snapshot_kimg=0.0)
    base.update(kw)
    return build_config("tiny", 16, **base)
