"""Score StyleGAN snapshots of the emoji generator: Fréchet distance and precision/recall (k = 3)
in the emoji classifier's features, per snapshot, against kimg; for a class-conditional snapshot also the class
agreement (the classifier's top-1 on each sample against the class it was drawn in; docs/metrics.md) and the
within-class diversity (--per-class samples of every class, their spread against the data's own images of that
class: 1.0 as varied as the data, near 0 one picture per class).

    python scripts/emoji_metrics.py --snapshots runs/emoji64/snapshots [--n 10000] [--device auto]
                                    [--out metrics.json] [--plot metrics.png]
    python scripts/emoji_metrics.py --generator assets/models/emoji64.safetensors --truncation 0.7

A class-conditional snapshot's truncation (--truncation < 1) pulls towards each class's own mean w by default, as
the studio does (--truncation-centre global: towards the model's mean w over all classes, as results made before the
option were); the JSON records the centre, per snapshot the one used (an unconditional one: always global).

--snapshots takes a folder (every G_ema-*.safetensors in it), a glob or files;
each is loaded with models.stylegan.load_generator, its kimg read from the name
("G_ema-000200kimg") or the JSON's metadata. Every snapshot sees the same latents
(--seed; the same --batch too, as the latents are drawn batch by batch), so the
numbers are comparable along a run. The dataset's features are computed once.

The JSON also has the dataset against itself, split at random into two halves:
the floor a perfect generator would reach (with half as many images per side;
FD grows as samples shrink, so the floor is a slight overestimate of FD's, and a
fair one for precision/recall). The plot (matplotlib, optional) draws both.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.device import pick_device  # noqa: E402
from core.errors import AtelierError, InputError  # noqa: E402
from evaluation.emoji_metric import (DEFAULT_DATA, DEFAULT_LABELS, DEFAULT_WEIGHTS, class_agreement,  # noqa: E402
                                     class_map, features, frechet_distance, heads, load_classifier,
                                     load_emoji_dataset, precision_recall, quantize, within_class_diversity)

KIMG_IN_NAME = re.compile(r"(\d+(?:\.\d+)?)kimg")


def find_snapshots(specs: list[str]) -> list[Path]:
    found: list[Path] = []
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_dir():
            hits = sorted(p.glob("G_ema-*.safetensors")) or sorted(p.glob("*.safetensors"))
            if not hits:
                raise InputError(f"{p} has no G_ema-*.safetensors snapshots (models.stylegan.save_generator writes them)")
            found += hits
        elif p.is_file():
            found.append(p)
        else:
            hits = sorted(Path(h) for h in glob.glob(str(p)) if h.endswith((".safetensors", ".json", ".pkl", ".pt")))
            hits = [h for h in hits if not (h.suffix == ".json" and h.with_suffix(".safetensors").is_file())]
            if not hits:
                raise InputError(f"no snapshot matches {spec!r}; give a folder, a glob or .safetensors files")
            found += hits
    return list(dict.fromkeys(found))


def snapshot_kimg(path: Path, metadata: dict) -> float | None:
    for value in (metadata.get("kimg"), (metadata.get("training") or {}).get("kimg")):
        if isinstance(value, (int, float)):
            return float(value)
    m = KIMG_IN_NAME.search(path.name)
    return float(m.group(1)) if m else None


def _bar(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="img", file=sys.stderr, disable=not enabled, leave=False)


@torch.no_grad()
def generated_features(G: torch.nn.Module, classifier, n: int, batch: int, truncation: float, seed: int,
                       device: torch.device, desc: str = "", progress: bool = True,
                       labels: np.ndarray | None = None, centres=None) -> tuple[np.ndarray, np.ndarray | None]:
    """Classifier features of n samples, and for a class-conditional G the class index each was drawn in (None
    for an unconditional one). A class-conditional G draws each sample's class from `labels` (the data
    set's per-image class indices), so the classes come in the data's proportions, as NVlabs' metrics do.
    `centres` (models.class_centres.ClassCentres): truncate towards each sample's class centre instead of w_avg."""
    c_dim = int(getattr(G, "c_dim", 0))
    if c_dim and labels is None:
        raise InputError("this generator is class-conditional: the metric needs the data set's labels for its classes")
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device) if c_dim else None
    bar = _bar(n, desc, progress)
    out, drawn = [], []
    for i in range(0, n, batch):
        b = min(batch, n - i)
        z = torch.randn([b, G.z_dim], generator=gen, device=device)
        c, centre = None, {}
        if c_dim:
            cls = pool[torch.randint(0, len(pool), (b,), generator=gen, device=device)]
            c = torch.nn.functional.one_hot(cls, c_dim).float()
            drawn.append(cls.cpu().numpy())
            if centres is not None and truncation != 1:
                centre = {"truncation_centre": centres(drawn[-1].tolist())}
        img = G(z, c, truncation_psi=truncation, noise_mode="const", **centre)
        out.append(features(quantize(img), classifier, batch=batch))
        if bar is not None:
            bar.update(b)
    if bar is not None:
        bar.close()
    return np.concatenate(out), (np.concatenate(drawn) if drawn else None)


# the per-class pass draws its own latents, apart from the main pass's (same --seed, another stream)
PER_CLASS_SEED_OFFSET = 1_000_003


@torch.no_grad()
def per_class_features(G: torch.nn.Module, classifier, per_class: int, batch: int, truncation: float, seed: int,
                       device: torch.device, centres=None) -> tuple[np.ndarray, np.ndarray]:
    """Classifier features of `per_class` samples of every class of a class-conditional G (class 0's first, then
    class 1's, ...), and the class of each: the balanced draw the within-class diversity needs (the main pass
    draws classes in the data's proportions, which leaves a class of 6 images 2 or 3 samples at 10,000)."""
    c_dim = int(getattr(G, "c_dim", 0))
    if not c_dim:
        raise InputError("per-class samples need a class-conditional generator")
    if per_class < 2:
        raise InputError(f"--per-class must be at least 2 (a diversity needs pairs) or 0 to skip it; got {per_class}")
    gen = torch.Generator(device=device).manual_seed(seed + PER_CLASS_SEED_OFFSET)
    classes = torch.arange(c_dim, device=device).repeat_interleave(per_class)
    out = []
    for i in range(0, len(classes), batch):
        cls = classes[i:i + batch]
        z = torch.randn([len(cls), G.z_dim], generator=gen, device=device)
        centre = ({"truncation_centre": centres(cls.tolist())} if centres is not None and truncation != 1 else {})
        img = G(z, torch.nn.functional.one_hot(cls, c_dim).float(), truncation_psi=truncation, noise_mode="const",
                **centre)
        out.append(features(quantize(img), classifier, batch=batch))
    return np.concatenate(out), classes.cpu().numpy()


def reference_floor(real: np.ndarray, k: int, seed: int, device) -> dict:
    perm = np.random.default_rng(seed).permutation(len(real))
    a, b = real[perm[: len(real) // 2]], real[perm[len(real) // 2:]]
    return {"what": "the dataset against itself: two random halves", "images_per_side": [len(a), len(b)],
            "fd": frechet_distance(a, b), **precision_recall(a, b, k=k, device=device)}


def plot(result: dict, path: Path) -> str:
    """Write the plot; returns '' or why it was not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no plot was drawn (pip install matplotlib; the JSON has the numbers)"
    rows = [r for r in result["snapshots"] if r.get("kimg") is not None]
    if not rows:
        return "no snapshot has a kimg (in its name or metadata), so there is nothing to plot against"
    rows.sort(key=lambda r: r["kimg"])
    kimg = [r["kimg"] for r in rows]
    floor = result["reference_floor"]
    # the class agreement gets a fourth panel when the snapshots were scored for it (class-conditional ones)
    agree_key = next((k for k in ("class_top1", "group_top1") if all(k in (r.get("agreement") or {}) for r in rows)),
                     None)
    panels = [("fd", "Fréchet distance (emoji classifier)"), ("precision", "precision (k=3)"),
              ("recall", "recall (k=3)")]
    if agree_key:
        panels.append((agree_key, "class agreement (classifier top-1)" if agree_key == "class_top1"
                       else "group agreement (classifier top-1)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        if key in ("fd", "precision", "recall"):
            ax.plot(kimg, [r[key] for r in rows], marker="o", ms=3)
            ax.axhline(floor[key], ls="--", c="gray", lw=1, label="dataset vs itself (halves)")
        else:
            real = result.get("real_agreement") or {}
            for k, colour, what in ((key, "tab:green", "top-1"), ("balanced_top1", "tab:olive", "per-class mean")):
                ax.plot(kimg, [r["agreement"][k] for r in rows], marker="o", ms=3, c=colour, label=what)
                if real.get(k) is not None:
                    ax.axhline(real[k], ls="--", c=colour, lw=1, alpha=0.7)
            if all(r.get("within_class") for r in rows):
                # 1.0 is the data's own spread inside each class; a fall late in a run is class-wise collapse
                ax.plot(kimg, [r["within_class"]["mean"] for r in rows], marker="s", ms=3, c="tab:purple",
                        label="within-class diversity")
            ax.plot([], [], ls="--", c="gray", lw=1, label="the data set's own images")
            ax.legend(fontsize=8)
        ax.set_xlabel("kimg")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key != "fd":
            top = max([1.02] + [r["within_class"]["mean"] + 0.05 for r in rows if r.get("within_class")])
            ax.set_ylim(0, top if key not in ("precision", "recall") else 1.02)
    axes[0].legend(fontsize=8)
    centre = result.get("truncation_centre") if result["truncation"] != 1 else None
    centre = f" ({centre} centre)" if centre else ""
    fig.suptitle(f"{result['n']} samples per snapshot, truncation {result['truncation']:g}{centre}, seed {result['seed']}",
                 fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def class_plot(result: dict, path: Path) -> str:
    """Per class, the share of samples the classifier names as that class beside the share of the data set's own
    images it names right (the ceiling); returns '' or why it was not drawn. One generator scored (or snapshots):
    the last one. Several --generator files (a candidate beside the shipped model): the first two, class by class,
    each with its own bar, so a ship decision reads which classes each draws better."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no class plot was drawn (the JSON has the numbers)"
    rows = [r for r in result["snapshots"] if (r.get("agreement") or {}).get("per_class")]
    if not rows:
        return "no snapshot was scored for class agreement (it needs a class-conditional generator)"
    shown = rows[:2] if result.get("compare") and len(rows) >= 2 else rows[-1:]
    real = {r["name"]: r["top1"] for r in (result.get("real_agreement") or {}).get("per_class", [])}
    per = shown[0]["agreement"]["per_class"]
    names = [r["name"] for r in per]
    y = np.arange(len(per))[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.16 * len(per)), constrained_layout=True)
    ax.barh(y, [real.get(n, np.nan) for n in names], height=0.8, color="0.85", label="the data set's own images")
    if len(shown) == 1:
        ax.barh(y, [r["top1"] for r in per], height=0.45, color="tab:green", label="generated samples")
    else:
        for k, (row, colour, dy) in enumerate(zip(shown, ("tab:green", "tab:purple"), (0.14, -0.14))):
            top = {r["name"]: r["top1"] for r in row["agreement"]["per_class"]}
            ax.barh(y + dy, [top.get(n, np.nan) for n in names], height=0.26, color=colour,
                    label=f"{'AB'[k]}: {Path(row['file']).name}")
    ax.set_yticks(y, [f"{n} ({r['n']})" for n, r in zip(names, per)], fontsize=6)
    ax.set_ylim(-0.7, len(per) - 0.3)
    ax.set_xlim(0, 1)
    ax.set_xlabel("share the emoji classifier names as the class asked for (top-1)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2, frameon=False)
    lines = []
    for k, row in enumerate(shown):
        a = row["agreement"]
        kimg = f"{row['kimg']:g} kimg, " if row.get("kimg") is not None else ""
        tag = f"{'AB'[k]}: " if len(shown) > 1 else ""
        lines.append(f"{tag}{Path(row['file']).name}: {kimg}top-1 {a.get('class_top1', a.get('group_top1')):.3f}, "
                     f"per-class mean {a['balanced_top1']:.3f}")
    fig.suptitle(f"truncation {result['truncation']:g}, {shown[0]['agreement']['n']} samples (per class in brackets)\n"
                 + "\n".join(lines), fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    # flat colours and text: a 64-colour palette keeps it sharp at about a quarter of the bytes
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    return ""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(args) -> dict:
    from models.stylegan import load_generator

    device = pick_device(None if args.device == "auto" else args.device)
    if args.n < 2 or args.batch < 1:
        raise InputError(f"--n must be at least 2 and --batch at least 1; got {args.n} and {args.batch}")
    if args.per_class == 1 or args.per_class < 0:
        raise InputError(f"--per-class must be 0 (skip) or at least 2 (a diversity needs pairs); got {args.per_class}")
    paths = find_snapshots(args.snapshots or []) + [Path(p) for p in (args.generator or [])]
    if not paths:
        raise InputError("nothing to score: give --snapshots DIR_OR_GLOB or --generator FILE")
    classifier = load_classifier(args.classifier, device=device)
    real_images = load_emoji_dataset(args.data)
    t0 = time.time()
    real = features(real_images, classifier, batch=args.batch)
    result = {
        "metric": "emoji classifier features: Fréchet distance, improved precision/recall (Kynkäänniemi et al. 2019)",
        "classifier": {"path": str(args.classifier), "sha256": classifier.sha256, "feature_dim": int(real.shape[1])},
        "data": {"path": str(args.data), "images": int(len(real_images)), "sha256": _sha256(Path(args.data))},
        "n": args.n, "k": args.k, "truncation": args.truncation, "truncation_centre": args.truncation_centre,
        "seed": args.seed, "batch": args.batch,
        "device": str(device),
        # several --generator files and no snapshot series: models side by side (the class plot draws two)
        "compare": not args.snapshots and len(args.generator or []) > 1,
        "reference_floor": reference_floor(real, args.k, args.seed, device),
        "snapshots": [],
    }
    print(f"real features: {len(real)} images in {time.time() - t0:.1f} s; floor (halves): "
          f"FD {result['reference_floor']['fd']:.3f}, precision {result['reference_floor']['precision']:.3f}, "
          f"recall {result['reference_floor']['recall']:.3f}", file=sys.stderr)
    for path in paths:
        t = time.time()
        loaded = load_generator(path, device)
        meta = loaded.config.get("metadata") or {}
        kimg = snapshot_kimg(path, meta)
        labels = None
        if int(getattr(loaded.G, "c_dim", 0)):
            key = (meta.get("classes") or {}).get("key")
            if not key:
                raise InputError(f"{path} is class-conditional but its metadata names no label key (classes.key)")
            from training.dataset import load_labels
            labels, _ = load_labels(args.labels, key, len(real_images))
        centre = args.truncation_centre if labels is not None else "global"
        fake, drawn = generated_features(loaded.G, classifier, args.n, args.batch, args.truncation, args.seed,
                                         device, desc=path.stem, progress=not args.no_progress, labels=labels,
                                         centres=loaded.class_centres() if centre == "class" else None)
        row = {"file": str(path), "kimg": kimg, "sha256": loaded.sha256, "truncation_centre": centre,
               "fd": frechet_distance(real, fake),
               **precision_recall(real, fake, k=args.k, device=device)}
        names = (meta.get("classes") or {}).get("names") or []
        mapped = class_map(names, classifier) if drawn is not None and len(names) == loaded.G.c_dim else None
        if mapped is not None:
            level, index = mapped
            pc, pg = heads(fake, classifier)
            row["agreement"] = class_agreement(pc, pg, index[drawn], classifier, level)
            if "real_agreement" not in result:
                # the ceiling: the classifier on the data set's own images and labels (it saw every one of them
                # in training, so this is what a generator that reproduced the data would score)
                result["real_agreement"] = class_agreement(*heads(real, classifier), index[labels], classifier, level)
        elif drawn is not None:
            row["agreement"] = None
            print(f"note: {path.name}'s class names are not the classifier's classes or groups, so there is no "
                  "class agreement", file=sys.stderr)
        if labels is not None and args.per_class:
            # inside each class: as varied as the data's own images of it? (class-wise mode collapse)
            pf, pcls = per_class_features(loaded.G, classifier, args.per_class, args.batch, args.truncation, args.seed,
                                          device, centres=loaded.class_centres() if centre == "class" else None)
            row["within_class"] = {"per_class_samples": args.per_class,
                                   **within_class_diversity(pf, pcls, real, labels,
                                                            names if len(names) == loaded.G.c_dim else None)}
        row["seconds"] = round(time.time() - t, 2)
        result["snapshots"].append(row)
        del loaded
        a = row.get("agreement") or {}
        agree = (f"  agreement {a['class_top1']:.3f} (balanced {a['balanced_top1']:.3f})" if "class_top1" in a
                 else f"  group agreement {a['group_top1']:.3f}" if a else "")
        wc = row.get("within_class")
        if wc:
            agree += f"  within-class diversity {wc['mean']:.3f} ({wc['below_half']} of {wc['classes']} classes < 0.5)"
        print(f"{path.name}: kimg {kimg if kimg is not None else '?'}  FD {row['fd']:.3f}  precision "
              f"{row['precision']:.3f}  recall {row['recall']:.3f}{agree}  ({row['seconds']:.1f} s)", file=sys.stderr)
        if args.out:
            _write(result, args.out)            # after each snapshot, so a long run keeps what it has
    result["snapshots"].sort(key=lambda r: (r["kimg"] is None, r["kimg"] or 0))
    if args.out:
        _write(result, args.out)
    for key, draw, target in (("plot", plot, args.plot), ("class_plot", class_plot, args.class_plot)):
        if not target:
            continue
        why = draw(result, target)
        result[key] = None if why else str(target)
        if why:
            print(f"note: {why}", file=sys.stderr)
        if args.out:
            _write(result, args.out)
    return result


def _write(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--snapshots", nargs="+", help="a folder of G_ema-*.safetensors, a glob, or files")
    ap.add_argument("--generator", nargs="+", help="one or more model files to score (kimg from metadata if any)")
    ap.add_argument("--classifier", type=Path, default=DEFAULT_WEIGHTS)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--labels", type=Path, default=DEFAULT_LABELS,
                    help="per-image class indices of --data, for class-conditional generators")
    ap.add_argument("--n", type=int, default=10_000, help="generated samples per snapshot")
    ap.add_argument("--k", type=int, default=3, help="k of the k-NN balls for precision/recall")
    ap.add_argument("--truncation", type=float, default=1.0)
    ap.add_argument("--truncation-centre", "--truncation-center", dest="truncation_centre", default="class",
                    choices=("class", "global"),
                    help="what --truncation < 1 pulls towards for a class-conditional snapshot: each class's own mean "
                         "w (default) or the model's mean w over all classes (w_avg)")
    ap.add_argument("--per-class", type=int, default=16,
                    help="for a class-conditional snapshot, this many samples of every class (their own latents) for "
                         "the within-class diversity; 0 skips it")
    ap.add_argument("--seed", type=int, default=0, help="latents (the same for every snapshot) and the floor's split")
    ap.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("metrics.json"))
    ap.add_argument("--plot", type=Path, default=None, help="PNG of FD, precision and recall against kimg")
    ap.add_argument("--class-plot", type=Path, default=None,
                    help="PNG of the class agreement per class (the last snapshot) against the data set's own images")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        run(args)
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"-> {args.out}" + (f", {args.plot}" if args.plot and args.plot.is_file() else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
