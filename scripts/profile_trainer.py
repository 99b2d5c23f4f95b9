"""Where does a training iteration spend its time? torch.profiler over N iterations of the emoji64 preset.

python3 scripts/profile_trainer.py --iters 20 --out $OUT/profile.txt
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="profile.txt")
    a = ap.parse_args()
    from training.cli import build_parser, config_from_args
    from training.trainer import Trainer
    from training.dataset import load_images  # noqa: F401  (keeps the import cost out of the profile)

    cfg = config_from_args(build_parser().parse_args(["--preset", "emoji64", "--out", "/tmp/prof", "--no-progress"]))
    tr = Trainer(cfg, write_outputs=False)
    for _ in range(20):
        tr.iteration()
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(a.iters):
        tr.iteration()
    torch.cuda.synchronize()
    per_it = (time.time() - t) / a.iters
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.iters):
            tr.iteration()
        torch.cuda.synchronize()
    lines = [f"wall per iteration (unprofiled): {per_it * 1e3:.1f} ms, batch {cfg.batch}"]
    lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    Path(a.out).write_text("\n".join(lines))
    print(lines[0])


if __name__ == "__main__":
    main()
