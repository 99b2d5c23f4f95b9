"""Samples against training length: one row of fixed seeds per G_ema snapshot, labelled with its kimg.

    python3 scripts/snapshot_strip.py runs/emoji64/snapshots docs/images/emoji64_progress.png [--rows 8 --seeds 8]

Reads the fp16 snapshots a run keeps with `--snapshot-ema` (RUN/snapshots/G_ema-*kimg.safetensors),
renders seeds 0..N-1 at psi = 0.7 with the studio's seed -> z rule, and writes one PNG. With more
snapshots than rows it takes evenly spaced ones, always the first and the last.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pick(items: list, rows: int) -> list:
    if len(items) <= rows:
        return items
    idx = sorted({round(i * (len(items) - 1) / (rows - 1)) for i in range(rows)})
    return [items[i] for i in idx]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshots", help="folder of G_ema-*kimg.safetensors")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--psi", type=float, default=0.7)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    from core.errors import AtelierError
    from models.stylegan import load_generator

    files = sorted(Path(args.snapshots).glob("G_ema-*kimg.safetensors"))
    if not files:
        print(f"error: no G_ema-*kimg.safetensors in {args.snapshots} (train with --snapshot-ema)", file=sys.stderr)
        return 2
    device = args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu"
    rows = []
    try:
        for f in pick(files, args.rows):
            meta = json.loads(f.with_suffix(".json").read_text()).get("metadata", {})
            G = load_generator(f, device=device).G
            imgs = _render(G, args, device)
            rows.append((meta.get("kimg", f.stem), imgs))
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    res = rows[0][1].shape[1]
    label_w = 72
    canvas = Image.new("RGB", (label_w + res * args.seeds, res * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (kimg, imgs) in enumerate(rows):
        canvas.paste(Image.fromarray(np.concatenate(list(imgs), axis=1)), (label_w, r * res))
        text = f"{kimg:,.0f} kimg" if isinstance(kimg, (int, float)) else str(kimg)
        draw.text((4, r * res + res // 2 - 6), text, fill="black")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    canvas.save(args.out)
    print(f"wrote {args.out}: {len(rows)} snapshots x {args.seeds} seeds")
    return 0


def _render(G, args, device):
    """uint8 [seeds, R, R, 3] rendered on `device`, z = RandomState(seed).randn(z_dim) as the studio does."""
    import numpy as np
    import torch

    from training.dataset import to_uint8_hwc

    z = np.concatenate([np.random.RandomState(s).randn(1, G.z_dim) for s in range(args.seeds)])
    from models.common import seed_class_labels

    c = seed_class_labels(int(getattr(G, "c_dim", 0)), range(args.seeds), device)   # conditional: class s % c_dim
    with torch.no_grad():
        img = G(torch.from_numpy(z).float().to(device), c, truncation_psi=args.psi, noise_mode="const")
    return to_uint8_hwc(img.cpu())


if __name__ == "__main__":
    sys.exit(main())
