"""Train the emoji metric's classifier on the CPU, deterministically, and write the shipped weights.

    python scripts/train_emoji_classifier.py [--epochs 15] [--holdout 0.15] [--seed 0] [--threads 2]
                                             [--out assets/metrics/emoji_classifier.safetensors]

Two runs with one recipe: first on a split that holds out --holdout of the glyph
*families* (a glyph with its skin tones, genders and facing directions is one
family, so a held-out image never has a near twin in training), to report honest
held-out top-1 accuracy for classes and groups; then on all images, which is the
network that ships (the metric compares generators with the whole dataset, so
the network should have seen all of it). --no-final stops after the split run.

Augmentation: small scale (0.9-1.1) and translation (+-4 px) changes with white
fill, and horizontal flips (mirror images keep their subgroup: the "facing right"
glyphs are mirrors of their bases). No colour jitter: colour carries class
information here (skin tones, flags, hearts of every colour).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.errors import InputError  # noqa: E402
from evaluation.emoji_metric import (DEFAULT_DATA, DEFAULT_LABELS, DEFAULT_WEIGHTS, EmojiClassifier,  # noqa: E402
                                     load_classifier, load_emoji_dataset, load_labels, predict,
                                     save_classifier, to_input)

VARIANT_CODEPOINTS = frozenset([0x200D, 0xFE0F, 0x2640, 0x2642, 0x27A1, *range(0x1F3FB, 0x1F400)])
PERSON_BASES = frozenset([0x1F468, 0x1F469, 0x1F9D1])


def family(name: str) -> str:
    """Glyphs that differ only in skin tone, gender or direction share a family key."""
    cps = {int(c, 16) for c in name.split("-")} - VARIANT_CODEPOINTS
    if cps - PERSON_BASES:
        cps -= PERSON_BASES
    return "-".join(f"{c:x}" for c in sorted(cps)) or name


def split(names: list[str], holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    fams = sorted({family(n) for n in names})
    rng = np.random.default_rng(seed)
    held = set(rng.choice(len(fams), size=round(len(fams) * holdout), replace=False).tolist())
    held_fams = {fams[i] for i in held}
    test = np.array([family(n) in held_fams for n in names])
    return np.flatnonzero(~test), np.flatnonzero(test)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random scale, shift and flip of a float [-1, 1] batch, the uncovered border filled with white."""
    n = x.shape[0]
    scale = torch.empty(n).uniform_(0.9, 1.1, generator=gen)
    shift = torch.empty(n, 2).uniform_(-4 / 32, 4 / 32, generator=gen)       # +-4 px in [-1, 1] coordinates
    flip = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    theta = torch.zeros(n, 2, 3)
    theta[:, 0, 0] = flip / scale
    theta[:, 1, 1] = 1 / scale
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    # grid_sample pads with zeros: sample x - 1 (white -> 0) and add the 1 back.
    return F.grid_sample(x - 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + 1


def train(x: torch.Tensor, cls: torch.Tensor, grp: torch.Tensor, num_classes: int, num_groups: int,
          epochs: int, seed: int, batch: int = 128, lr: float = 3e-3, log=print) -> EmojiClassifier:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = EmojiClassifier(num_classes, num_groups)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = math.ceil(len(x) / batch)
    total = epochs * steps_per_epoch
    warmup = steps_per_epoch

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    step = 0
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x), generator=gen)
        t0, loss_sum = time.time(), 0.0
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            if len(idx) < 2:          # BatchNorm needs two samples
                continue
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            a, b = model(augment(x[idx], gen))
            loss = F.cross_entropy(a, cls[idx], label_smoothing=0.1) + 0.5 * F.cross_entropy(b, grp[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            step += 1
        log(f"  epoch {epoch + 1}/{epochs}: loss {loss_sum / len(x):.3f} ({time.time() - t0:.1f} s)")
    return model.eval().requires_grad_(False)


def accuracy(model: EmojiClassifier, images: np.ndarray, cls: np.ndarray, grp: np.ndarray) -> dict[str, float]:
    pc, pg = predict(images, model)
    return {"class_top1": round(float((pc == cls).mean()), 4), "group_top1": round(float((pg == grp).mean()), 4),
            "images": int(len(images))}


def card(meta: dict, classes: list[str], groups: list[str], path: Path) -> str:
    s, f = meta["split"], meta.get("final")
    lines = [
        "# Emoji metric classifier",
        "",
        "A small CNN (evaluation/emoji_metric.py: stride-2 stem, three stages, BatchNorm + ReLU, global "
        f"average pooling to {meta['feature_dim']} features) trained on the bundled emoji set "
        "(assets/datasets/emoji64.npy.xz) to predict each glyph's Unicode emoji subgroup "
        f"({len(classes)} classes; subgroups under {meta['min_class']} images merged into '<group>/(other)') "
        f"and group ({len(groups)}). Its {meta['feature_dim']}-d penultimate features are the space of the "
        "studio's emoji Fréchet distance and precision/recall (scripts/emoji_metrics.py).",
        "",
        f"- weights: `{path.name}`, {meta['params']:,} parameters, fp16, {meta['file_bytes']:,} bytes",
        f"- dataset: {meta['data']['images']} images, sha256 of the .npy.xz `{meta['data']['sha256']}`",
        f"- labels: {meta['labels']['source']}, sha256 `{meta['labels']['sha256']}`",
        f"- training: `{meta['command']}` ({meta['epochs']} epochs, seed {meta['seed']}, CPU, "
        f"torch {meta['torch']})",
        "",
        "## Accuracy",
        "",
        f"Held-out split: {s['holdout_fraction']:.0%} of glyph families (skin-tone, gender and direction variants "
        "of a glyph stay on one side), trained on the rest with the same recipe:",
        "",
        "| set | images | class top-1 | group top-1 |",
        "| --- | ---: | ---: | ---: |",
        f"| held-out families | {s['test']['images']} | {s['test']['class_top1']:.1%} | {s['test']['group_top1']:.1%} |",
        f"| training part of the split | {s['train']['images']} | {s['train']['class_top1']:.1%} | "
        f"{s['train']['group_top1']:.1%} |",
    ]
    if f:
        lines.append(f"| shipped network, all images (seen in training) | {f['train']['images']} | "
                     f"{f['train']['class_top1']:.1%} | {f['train']['group_top1']:.1%} |")
        lines += ["", "The shipped network is the one trained on all images; the held-out row is the honest "
                  "estimate of how it labels glyphs it has not seen."]
    else:
        lines += ["", "The shipped network is the split-trained one (run with --no-final)."]
    lines += ["", "## Classes", "", ", ".join(f"`{c}`" for c in classes), "",
              "Labels derived from Unicode emoji-test.txt (Unicode License); images Apache-2.0 (Noto Color Emoji).",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    ap.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--holdout", type=float, default=0.15, help="fraction of glyph families held out in the split run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-final", action="store_true", help="ship the split-trained network, skip the all-data run")
    args = ap.parse_args(argv)
    if not 0 < args.holdout < 1:
        raise InputError(f"--holdout must be between 0 and 1; got {args.holdout}")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    images = load_emoji_dataset(args.data)
    labels = load_labels(args.labels)
    names = json.loads(args.data.with_name(args.data.name.split(".")[0] + ".json").read_text())["names"]
    if len(labels["class"]) != len(images) or len(names) != len(images):
        raise InputError(f"{args.labels} has {len(labels['class'])} labels and the names list {len(names)} for "
                         f"{len(images)} images; rebuild the labels with scripts/build_emoji_labels.py")
    cls, grp = np.array(labels["class"]), np.array(labels["group"])
    classes, groups = labels["classes"], labels["groups"]
    x = to_input(images)
    tc, tg = torch.from_numpy(cls), torch.from_numpy(grp)

    tr, te = split(names, args.holdout, args.seed)
    print(f"split run: {len(tr)} training images, {len(te)} held out ({args.holdout:.0%} of glyph families)")
    model = train(x[tr], tc[tr], tg[tr], len(classes), len(groups), args.epochs, args.seed)
    split_meta = {"holdout_fraction": args.holdout, "train": accuracy(model, images[tr], cls[tr], grp[tr]),
                  "test": accuracy(model, images[te], cls[te], grp[te])}
    print(f"held out: class top-1 {split_meta['test']['class_top1']:.1%}, group top-1 "
          f"{split_meta['test']['group_top1']:.1%}")
    final = None
    if not args.no_final:
        print(f"final run: all {len(images)} images")
        model = train(x, tc, tg, len(classes), len(groups), args.epochs, args.seed)
        final = {"train": accuracy(model, images, cls, grp)}
        print(f"all images (seen): class top-1 {final['train']['class_top1']:.1%}, group top-1 "
              f"{final['train']['group_top1']:.1%}")

    cmd = "python scripts/train_emoji_classifier.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    meta = {
        "command": cmd, "epochs": args.epochs, "seed": args.seed, "torch": torch.__version__,
        "feature_dim": model.feature_dim, "min_class": labels.get("min_class"),
        "params": sum(p.numel() for p in model.parameters()),
        "data": {"images": int(len(images)), "sha256": hashlib.sha256(args.data.read_bytes()).hexdigest()},
        "labels": {"source": labels["source"], "sha256": hashlib.sha256(args.labels.read_bytes()).hexdigest()},
        "split": split_meta, "final": final, "shipped": "split" if final is None else "final",
    }
    save_classifier(model, args.out, classes, groups, metadata=meta)
    meta["file_bytes"] = args.out.stat().st_size
    save_classifier(model, args.out, classes, groups, metadata=meta)   # again, with its own size in the card
    load_classifier(args.out)                                          # it reads back
    args.out.with_suffix(".md").write_text(card(meta, classes, groups, args.out))
    args.out.with_suffix(".json").write_text(json.dumps({"classes": classes, "groups": groups, **meta}, indent=1) + "\n")
    print(f"-> {args.out} ({meta['file_bytes'] / 2**20:.2f} MiB), card {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
