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


def retuned_tiny_run(tmp, write_dataset) -> dict:
    """A real tiny CPU run through the CLI with G_ema snapshots: saved at 0.032 kimg (batch 8; the whole folder
    kept as "old", its snapshot kept as run/snapshots/early.*), then resumed with --retune --batch 16 to 0.064.
    Returns {"data", "run", "old", "early", "snap" (the newest G_ema-*kimg snapshot)}."""
    import shutil

    from training import cli

    data = write_dataset(tmp, 24, 16)
    run = tmp / "run"
    base = ["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--snapshot-ema",
            "--no-progress"]
    assert cli.main([*base, "--kimg", "0.032", "--batch", "8"]) == 0
    snaps = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))
    assert snaps, "the run wrote no G_ema snapshot"
    old = tmp / "old"
    shutil.copytree(run, old)
    # sub-kimg runs name every snapshot G_ema-000000kimg: keep the first one under its own name
    early = run / "snapshots" / "early.safetensors"
    shutil.copy(snaps[-1], early)
    shutil.copy(snaps[-1].with_suffix(".json"), early.with_suffix(".json"))
    assert cli.main([*base, "--kimg", "0.064", "--resume", str(run), "--retune", "--batch", "16"]) == 0
    snap = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))[-1]
    return {"data": data, "run": run, "old": old, "early": early, "snap": snap}
