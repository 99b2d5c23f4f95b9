"""The studio's emoji metric: a small classifier trained on the bundled emoji set's own labels,
and the Fréchet distance and k-NN precision/recall in its penultimate features.

    from evaluation.emoji_metric import load_classifier, features, frechet_distance, precision_recall
    clf = load_classifier(device="cuda")                     # assets/metrics/emoji_classifier.safetensors
    real = features(load_emoji_dataset(), clf)               # uint8 NHWC, float64 [3916, D]
    fake = features(G(z), clf)                               # float NCHW in [-1, 1]
    frechet_distance(real, fake), precision_recall(real, fake, k=3)

Why a classifier of our own (as FID on MNIST uses a LeNet): Inception features
are trained on photographs at 299 px, and 64 px glyphs on white sit in one
corner of that space; a network that tells a "face-smiling" from a
"face-concerned" or a flag from a keycap measures what matters for emoji.
The labels are Unicode's emoji groups and subgroups (scripts/build_emoji_labels.py);
the network is trained by scripts/train_emoji_classifier.py, deterministic on the CPU.

The Fréchet distance is evaluation/scores.py's FID code on these features; its
numbers are not comparable with Inception FID. Precision and recall follow
Kynkäänniemi et al. 2019, "Improved Precision and Recall Metric for Assessing
Generative Models": each sample's ball reaches its k-th nearest neighbour in its
own set; precision is the share of fakes inside some real ball, recall the share
of reals inside some fake ball.
"""
from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.errors import InputError, ModelLoadError
from core.shapes import shape_difference
from evaluation.scores import fid_from_features, mean_pairwise_distance

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WEIGHTS = ROOT / "assets" / "metrics" / "emoji_classifier.safetensors"
DEFAULT_DATA = ROOT / "assets" / "datasets" / "emoji64.npy.xz"
DEFAULT_LABELS = ROOT / "assets" / "datasets" / "emoji64_labels.json"
FORMAT = "atelier-emoji-classifier/1"
RESOLUTION = 64
_HEADER_KEY = "atelier_config"


# ---------------------------------------------------------------------------------------------
# The network


def _conv_bn(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class EmojiClassifier(nn.Module):
    """64x64 RGB in [-1, 1] -> (class logits, group logits); `features` gives the pooled
    penultimate vector [N, widths[-1]] that both heads read.

    A plain VGG-style stack: a stride-2 stem, then per stage a stride-2 conv and a conv at the
    new size (the last stage has only the stride-2 conv), BatchNorm + ReLU after each, global
    average pooling. In eval mode BatchNorm is a fixed affine map, so a sample's features do
    not depend on the batch it came in.
    """

    def __init__(self, num_classes: int, num_groups: int, widths: tuple[int, ...] = (24, 48, 96, 192)):
        super().__init__()
        widths = tuple(int(w) for w in widths)
        self.init_kwargs = {"num_classes": int(num_classes), "num_groups": int(num_groups), "widths": list(widths)}
        layers = [_conv_bn(3, widths[0], 2), _conv_bn(widths[0], widths[0], 1)]       # 64 -> 32
        for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):               # 32 -> 16 -> 8 -> 4
            layers.append(_conv_bn(cin, cout, 2))
            if i < len(widths) - 2:
                layers.append(_conv_bn(cout, cout, 1))
        self.body = nn.Sequential(*layers)
        self.feature_dim = widths[-1]
        self.class_head = nn.Linear(widths[-1], num_classes)
        self.group_head = nn.Linear(widths[-1], num_groups)
        self.classes: list[str] = []     # filled by load_classifier from the file's config
        self.groups: list[str] = []
        self.config: dict = {}
        self.sha256 = ""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        assert x.ndim == 4 and x.shape[1] == 3, tuple(x.shape)
        return self.body(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.class_head(f), self.group_head(f)


# ---------------------------------------------------------------------------------------------
# Inputs


def to_input(images, device: str | torch.device | None = None) -> torch.Tensor:
    """The classifier's input, float32 NCHW in [-1, 1] at 64x64, from either
    uint8 images (NHWC as the dataset stores them, or NCHW) or float NCHW in [-1, 1]
    (what a generator returns; clamped, as saving to PNG would). Other sizes are resized
    with antialiasing; one channel is repeated to three."""
    x = torch.from_numpy(np.ascontiguousarray(images)) if isinstance(images, np.ndarray) else torch.as_tensor(images)
    if device is not None:
        x = x.to(device)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4:
        raise InputError(f"images must be a batch [N, H, W, 3] uint8 or [N, 3, H, W]; got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            x = x.permute(0, 3, 1, 2)
        x = x.to(torch.float32) / 127.5 - 1
    elif x.is_floating_point():
        if x.shape[1] not in (1, 3):
            raise InputError(f"float images must be NCHW with 1 or 3 channels (a generator's output); "
                             f"got shape {tuple(x.shape)}")
        x = x.to(torch.float32)
        if not torch.isfinite(x).all():
            raise InputError("images contain NaN or infinite values")
        x = x.clamp(-1, 1)
    else:
        raise InputError(f"images must be uint8 (0..255) or float in [-1, 1]; got {x.dtype}")
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[1] != 3:
        raise InputError(f"images must have 1 or 3 channels; got shape {tuple(x.shape)}")
    if x.shape[-2:] != (RESOLUTION, RESOLUTION):
        x = torch.nn.functional.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bilinear",
                                            antialias=True, align_corners=False)
    return x.contiguous()


def quantize(images: torch.Tensor) -> torch.Tensor:
    """Generator output in [-1, 1] -> uint8 NCHW, rounded as a saved PNG is (NVlabs' metrics do the same),
    so fakes and the uint8 dataset reach the classifier through the same quantisation."""
    return (images.to(torch.float32) * 127.5 + 128).clamp(0, 255).to(torch.uint8)


def load_emoji_dataset(path: str | Path | None = None) -> np.ndarray:
    """The bundled dataset as uint8 [N, 64, 64, 3] (NHWC RGB on white)."""
    path = Path(path) if path is not None else DEFAULT_DATA
    if not path.is_file():
        raise InputError(f"dataset not found at {path}; the bundled one is assets/datasets/emoji64.npy.xz "
                         "(scripts/build_emoji_dataset.py builds it)")
    try:
        if path.name.endswith(".xz"):
            with lzma.open(path) as f:
                images = np.load(f)
        elif path.suffix == ".npz":
            with np.load(path) as z:
                images = z["images"]
        else:
            images = np.load(path)
    except (OSError, ValueError, lzma.LZMAError, EOFError, KeyError) as exc:
        raise InputError(f"{path} could not be read as an image array ({exc}); expected an .npy.xz, .npy or "
                         ".npz (key 'images') of uint8 [N, H, W, 3]") from None
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise InputError(f"{path} holds {images.dtype} {images.shape}; expected uint8 [N, H, W, 3]")
    return images


def load_labels(path: str | Path | None = None) -> dict:
    path = Path(path) if path is not None else DEFAULT_LABELS
    if not path.is_file():
        raise InputError(f"labels not found at {path}; build them with scripts/build_emoji_labels.py")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------
# Weights


def save_classifier(model: EmojiClassifier, path: str | Path, classes: list[str], groups: list[str],
                    metadata: dict | None = None, dtype: torch.dtype = torch.float16) -> Path:
    """NAME.safetensors with the config (architecture, class and group names, metadata) in its header."""
    from safetensors.torch import save_file

    path = Path(path)
    state = {k: (t.detach().cpu().to(dtype) if t.is_floating_point() else t.detach().cpu()).contiguous()
             for k, t in model.state_dict().items()}
    config = {"format": FORMAT, "init_kwargs": model.init_kwargs, "classes": list(classes), "groups": list(groups),
              "metadata": dict(metadata or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(state, str(tmp), metadata={_HEADER_KEY: json.dumps(config, sort_keys=True), "format": FORMAT})
    tmp.replace(path)
    return path


def load_classifier(path: str | Path | None = None, device: str | torch.device = "cpu") -> EmojiClassifier:
    """The classifier in eval mode, float32 on `device`, without gradients; `.classes`, `.groups`,
    `.config` and `.sha256` say what it is. Default: the shipped assets/metrics/emoji_classifier.safetensors."""
    from safetensors import SafetensorError, safe_open

    path = Path(path).expanduser() if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise ModelLoadError(f"emoji classifier not found at {path}; the shipped one is "
                             "assets/metrics/emoji_classifier.safetensors (scripts/train_emoji_classifier.py "
                             "trains it)")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{path.name} is not a readable safetensors file: {exc}") from None
    try:
        config = json.loads(header[_HEADER_KEY])
        if config.get("format") != FORMAT:
            raise KeyError("format")
        model = EmojiClassifier(**config["init_kwargs"])
    except (KeyError, TypeError, ValueError, json.JSONDecodeError):
        raise ModelLoadError(f"{path.name} is not an Atelier emoji classifier (no {FORMAT!r} config in its "
                             "header); train one with scripts/train_emoji_classifier.py") from None
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    diff = shape_difference(own, {k: tuple(v.shape) for k, v in state.items()})
    if diff:
        raise ModelLoadError(f"{path.name} does not match its own config: {diff}")
    model.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
    model.classes, model.groups, model.config = list(config["classes"]), list(config["groups"]), config
    model.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    return model.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Features and scores


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def features(images, classifier: EmojiClassifier, batch: int = 500) -> np.ndarray:
    """Penultimate features, float64 numpy [N, D], of uint8 NHWC/NCHW or float NCHW [-1, 1] images
    (an array, a tensor on any device, or an iterable of such batches)."""
    if int(batch) < 1:
        raise InputError(f"batch must be at least 1; got {batch}")
    dev = _device_of(classifier)
    chunks = [images] if isinstance(images, (np.ndarray, torch.Tensor)) else images
    out = []
    for chunk in chunks:
        for i in range(0, len(chunk), int(batch)):
            x = to_input(chunk[i:i + int(batch)], dev)
            with torch.autocast(device_type=dev.type, enabled=False):
                out.append(classifier.features(x).double().cpu().numpy())
    if not out:
        raise InputError("no images were given")
    return np.concatenate(out)


@torch.no_grad()
def predict(images, classifier: EmojiClassifier, batch: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 (class index, group index) per image."""
    dev = _device_of(classifier)
    cls, grp = [], []
    for i in range(0, len(images), int(batch)):
        a, b = classifier(to_input(images[i:i + int(batch)], dev))
        cls.append(a.argmax(1).cpu().numpy())
        grp.append(b.argmax(1).cpu().numpy())
    return np.concatenate(cls), np.concatenate(grp)


@torch.no_grad()
def heads(feats, classifier: EmojiClassifier, batch: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 (class index, group index) from penultimate features (as `features` returns them), so a sample
    is rendered and classified once for both the distances and the agreement."""
    dev = _device_of(classifier)
    f = torch.as_tensor(np.asarray(feats), dtype=torch.float32)
    cls, grp = [], []
    for i in range(0, len(f), int(batch)):
        x = f[i:i + int(batch)].to(dev)
        with torch.autocast(device_type=dev.type, enabled=False):
            cls.append(classifier.class_head(x).argmax(1).cpu().numpy())
            grp.append(classifier.group_head(x).argmax(1).cpu().numpy())
    return np.concatenate(cls), np.concatenate(grp)


def class_map(names: list[str], classifier: EmojiClassifier) -> tuple[str, np.ndarray] | None:
    """How a generator's class names map onto the classifier: ("class", index per name) when every name is one
    of its 98 subgroup classes, ("group", ...) when every name is one of its groups, else None."""
    for level, known in (("class", classifier.classes), ("group", classifier.groups)):
        where = {n: i for i, n in enumerate(known)}
        if names and all(n in where for n in names):
            return level, np.array([where[n] for n in names], dtype=np.int64)
    return None


def group_of_class(classifier: EmojiClassifier) -> np.ndarray:
    """The group index of each subgroup class ("Smileys & Emotion/face-smiling" -> "Smileys & Emotion")."""
    where = {g: i for i, g in enumerate(classifier.groups)}
    out = []
    for name in classifier.classes:
        group = name.split("/", 1)[0]
        if group not in where:
            raise ModelLoadError(f"the classifier's class {name!r} names no group it knows")
        out.append(where[group])
    return np.array(out, dtype=np.int64)


def class_agreement(pred_class, pred_group, asked, classifier: EmojiClassifier, level: str = "class") -> dict:
    """How often the classifier names a sample as what it was asked to be: GAN-test accuracy (Shmelkov et al.
    2018, "How good is my GAN?"), a classifier trained on real images applied to generated ones.

    `asked`: per sample the classifier index asked for, at `level` "class" (subgroup: scored at both levels) or
    "group" (only the group can be scored). Returns overall top-1 at each level, and per asked class its count,
    top-1 and what it was most often taken for, and `balanced_top1`, the mean of the per-class top-1s (every asked
    class weighing the same)."""
    pred_class, pred_group, asked = (np.asarray(a, dtype=np.int64) for a in (pred_class, pred_group, asked))
    if not (len(pred_class) == len(pred_group) == len(asked)) or not len(asked):
        raise InputError(f"class_agreement needs one prediction per sample; got {len(pred_class)}, "
                         f"{len(pred_group)} and {len(asked)}")
    if level not in ("class", "group"):
        raise InputError(f"level must be 'class' or 'group'; got {level!r}")
    out: dict = {"level": level, "n": int(len(asked))}
    if level == "group":
        out["group_top1"] = float((pred_group == asked).mean())
        names, hit, pred = classifier.groups, pred_group == asked, pred_group
    else:
        g = group_of_class(classifier)
        out["class_top1"] = float((pred_class == asked).mean())
        out["group_top1"] = float((pred_group == g[asked]).mean())
        names, hit, pred = classifier.classes, pred_class == asked, pred_class
    per = []
    for c in np.unique(asked):
        sel = asked == c
        wrong = pred[sel & ~hit]
        taken = np.bincount(wrong, minlength=len(names)).argmax() if len(wrong) else None
        per.append({"name": names[c], "n": int(sel.sum()), "top1": float(hit[sel].mean()),
                    "most_taken_for": names[taken] if taken is not None else None})
    out["per_class"] = per
    # every asked class weighs the same: the overall top-1 is dominated by the big classes (skin-tone variants of
    # people, flags), the balanced one says how many of the classes are drawn recognisably
    out["balanced_top1"] = float(np.mean([r["top1"] for r in per]))
    return out


def within_class_diversity(fake_feats, fake_classes, real_feats, real_classes, names: list[str] | None = None,
                           min_real: int = 2) -> dict:
    """How varied a conditional generator is inside each class, against the data set's own images of that class.

    Per class with at least 2 samples and `min_real` real images: the samples' mean pairwise feature distance over
    the real images' (1.0: as varied as the data in that class; near 0: one picture per class). A model can draw
    all 98 classes, and so look as varied as the data over the whole set (its overall diversity stays at the data's),
    while drawing nearly the same image for every seed inside a class: the failure NoisyTwins (Rangwani et al.,
    CVPR 2023) names class-wise mode collapse, common in class-conditional StyleGANs on long-tailed data. Returns
    the mean over classes (every class weighing the same), the median, how many classes are below half the data's,
    and per class its counts and ratio. `names`: class names for the per-class rows (else indices)."""
    fake, real = np.asarray(fake_feats), np.asarray(real_feats)
    fc, rc = np.asarray(fake_classes, dtype=np.int64), np.asarray(real_classes, dtype=np.int64)
    if len(fake) != len(fc) or len(real) != len(rc):
        raise InputError(f"one class per feature row is needed; got {len(fake)} rows and {len(fc)} classes for the "
                         f"samples, {len(real)} and {len(rc)} for the real images")
    per = []
    for c in np.unique(fc):
        f, r = fake[fc == c], real[rc == c]
        if len(f) < 2 or len(r) < max(2, int(min_real)):
            continue
        ratio = mean_pairwise_distance(f) / max(mean_pairwise_distance(r), 1e-12)
        per.append({"class": int(c), "name": names[c] if names is not None and c < len(names) else str(int(c)),
                    "n": int(len(f)), "n_real": int(len(r)), "ratio": float(ratio)})
    if not per:
        raise InputError("no class has 2 samples and 2 real images: draw more samples per class")
    ratios = np.array([p["ratio"] for p in per])
    return {"mean": float(ratios.mean()), "median": float(np.median(ratios)),
            "below_half": int((ratios < 0.5).sum()), "classes": len(per), "per_class": per}


def frechet_distance(real_feats, fake_feats) -> float:
    """The Fréchet distance between Gaussians fitted to two feature sets (evaluation/scores.py's FID)."""
    return fid_from_features(real_feats, fake_feats)


def _as_tensor(x, device) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x, dtype=np.float64) if not torch.is_tensor(x) else x)
    if t.ndim != 2:
        raise InputError(f"features must be [N, D]; got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise InputError("features contain NaN or infinite values")
    return t.to(device=device, dtype=torch.float64)


def _sq_dists(a: torch.Tensor, b: torch.Tensor, b_sq: torch.Tensor) -> torch.Tensor:
    return ((a * a).sum(1, keepdim=True) + b_sq[None] - 2 * a @ b.T).clamp_min_(0)


def knn_radii(feats: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """Squared distance from each sample to its k-th nearest other sample of the same set."""
    n = feats.shape[0]
    if n <= k:
        raise InputError(f"k-NN radii with k={k} need more than {k} samples; got {n}")
    sq = (feats * feats).sum(1)
    out = torch.empty(n, dtype=feats.dtype, device=feats.device)
    for i in range(0, n, chunk):
        d = _sq_dists(feats[i:i + chunk], feats, sq)
        d[torch.arange(d.shape[0]), torch.arange(i, i + d.shape[0])] = 0     # itself, exactly
        out[i:i + chunk] = d.kthvalue(k + 1, dim=1).values                    # k + 1: itself comes first
    return out


def _covered(queries: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """For each query, whether it lies in some centre's ball (distance <= that centre's radius)."""
    sq = (centres * centres).sum(1)
    hit = torch.empty(queries.shape[0], dtype=torch.bool, device=queries.device)
    for i in range(0, queries.shape[0], chunk):
        hit[i:i + chunk] = (_sq_dists(queries[i:i + chunk], centres, sq) <= radii[None]).any(1)
    return hit


def precision_recall(real_feats, fake_feats, k: int = 3, device: str | torch.device | None = None,
                     chunk: int = 1024) -> dict[str, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) with k-NN balls, k = 3 by default.

    precision: the share of fakes inside at least one real ball (a real sample's ball reaches its
    k-th nearest real neighbour); recall: the share of reals inside at least one fake ball (radii
    from the fakes). Distances in float64, in row chunks, so 10k x 10k never sits in memory at once.
    """
    k = int(k)
    if k < 1:
        raise InputError(f"k must be at least 1; got {k}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    real, fake = _as_tensor(real_feats, dev), _as_tensor(fake_feats, dev)
    if real.shape[1] != fake.shape[1]:
        raise InputError(f"feature sets differ in width: {real.shape[1]} vs {fake.shape[1]}")
    precision = _covered(fake, real, knn_radii(real, k, chunk), chunk).double().mean().item()
    recall = _covered(real, fake, knn_radii(fake, k, chunk), chunk).double().mean().item()
    return {"precision": float(precision), "recall": float(recall)}
