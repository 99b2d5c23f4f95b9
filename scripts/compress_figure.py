"""The figure and the CPU timing behind docs/optimizations.md#compress.

.venv/bin/python app.py compress --model assets/models/emoji64.safetensors --amount 0.3 --steps 300 --out /tmp/p30.safetensors
.venv/bin/python scripts/compress_figure.py --compressed /tmp/p30.safetensors --amount 0.3 --out docs/images/compress_emoji64.png

Rows: the original, the same channels cut without distillation, the compressed file; seeds 0-7, psi 0.7,
const noise. Prints the synthesis time of a batch of 16 (median of 15 calls after 3 warm-ups) for the
original and the compressed model, measured side by side in this process.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _ms_per_batch(G, batch=16, n=15) -> float:
    z = torch.randn(batch, G.z_dim, generator=torch.Generator().manual_seed(0))
    ts = []
    with torch.no_grad():
        ws = G.mapping(z, torch.zeros(batch, G.c_dim))
        for _ in range(n + 3):
            t = time.perf_counter()
            G.synthesis(ws, noise_mode="const")
            ts.append(time.perf_counter() - t)
    return statistics.median(ts[3:]) * 1e3


def main() -> None:
    from models.stylegan import load_generator
    from optim.prune import structured_stylegan

    ap = argparse.ArgumentParser()
    ap.add_argument("--original", default=str(ROOT / "assets" / "models" / "emoji64.safetensors"))
    ap.add_argument("--compressed", required=True)
    ap.add_argument("--amount", type=float, required=True, help="the amount the compressed file was cut by")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images" / "compress_emoji64.png"))
    a = ap.parse_args()
    G0 = load_generator(a.original).G
    cut = copy.deepcopy(G0)
    structured_stylegan(cut, a.amount)
    Gc = load_generator(a.compressed).G
    z = torch.from_numpy(np.stack([np.random.RandomState(s).randn(G0.z_dim) for s in range(8)])).float()
    rows = []
    with torch.no_grad():
        ws = G0.mapping(z, torch.zeros(8, G0.c_dim), truncation_psi=0.7)
        for G in (G0, cut, Gc):
            img = ((G.synthesis(ws, noise_mode="const").clamp(-1, 1) + 1) * 127.5).round().byte()
            rows.append(np.concatenate(list(img.permute(0, 2, 3, 1).numpy()), 1))
    grid = np.concatenate(rows, 0)
    res = G0.img_resolution
    label_w = 190
    canvas = Image.new("RGB", (grid.shape[1] + label_w, grid.shape[0]), "white")
    canvas.paste(Image.fromarray(grid), (label_w, 0))
    draw = ImageDraw.Draw(canvas)
    try:
        font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", 13)
    except OSError:
        font = ImageFont.load_default()
    pct = f"{round(100 * a.amount)}%"
    for i, text in enumerate(["original", f"{pct} of channels cut", "cut + distilled (compress)"]):
        draw.text((8, i * res + res // 2 - 8), text, fill=(0, 0, 0), font=font)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    canvas.save(a.out)
    timing = {"original_ms": round(_ms_per_batch(G0), 1), "compressed_ms": round(_ms_per_batch(Gc), 1)}
    timing["speedup"] = round(timing["original_ms"] / timing["compressed_ms"], 2)
    print(json.dumps({"figure": a.out, "batch": 16, "threads": torch.get_num_threads(), **timing}))


if __name__ == "__main__":
    main()
