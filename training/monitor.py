"""Mode-collapse monitor: sample diversity and discriminator accuracy, with optional counter-measures.

Every `monitor_kimg` the trainer renders a fixed batch of latents (the same z each
time) with G_ema and measures, in a fixed feature space:

- diversity: mean pairwise L2 distance of the samples, divided by the same figure
  for a fixed batch of real images (1.0 = as varied as the data);
- duplicate rate: the fraction of samples whose nearest other sample is closer than
  `dup_threshold` x the real batch's mean pairwise distance (near-identical pairs);
- class diversity (class-conditional runs): a few fixed latents rendered in every class
  (`monitor_per_class` each); per class their mean pairwise distance over that of the
  class's own real images (up to 16 of them), averaged over the classes with at least
  2 real images. The overall diversity cannot see class-wise mode collapse: a model that
  draws one picture per class still spreads over the 98 classes as the data does (the
  2026-12-07 from-scratch emoji run: overall 0.88 throughout, while within its classes
  it fell from 0.93 at 2,000 kimg to 0.83 at 3,277 in the emoji metric's features, the
  shipped model's 0.91);
- D accuracy: the fraction of real images with D(x) > 0 and of generated ones with
  D(G(z)) < 0 over the training steps since the last evaluation (free: the trainer
  already has those logits).

Feature space: images average-pooled to 16x16, flattened, and multiplied by a fixed
Gaussian random projection to 128 dimensions (seeded, never trained). Chosen over the
discriminator's own features because D changes during training: a diversity curve in
D's space moves when D moves, even if the samples do not. Random projections keep
pairwise distances within a small factor (Johnson-Lindenstrauss), the pooling makes
them about shapes and colours rather than pixel noise, and the cost is a few
microseconds per image with no extra network to ship.

Warnings (logged, and shown in the UI from log.jsonl):
- "diversity": diversity fell below `drop_fraction` of its best over the last
  `window` evaluations and below `min_ratio` of the data's, or the duplicate rate
  exceeds `max_dup_rate`;
- "class diversity": the class diversity is below `class_min_ratio` of the data's, or more
  than `class_collapse_share` (20 %) of the classes are below half their own data's spread
  (samples of a class look alike: class-wise mode collapse), *and* it is a loss: the class
  diversity has fallen below `class_fall` (95 %) of its best so far in the run, or it has been
  low for `class_patience` (10) evaluations in a row. A young conditional G draws each class
  alike before it learns to use z; without the second condition the run shipped on 2026-12-07
  warned five times in its first 500 kimg (41 of 97 classes below half at 100 kimg, rising).
  Calibrated on the emoji64 runs: the 3,507-kimg model had 11 of 97 classes below half (mean
  0.78); the class-balanced 2026-12-07 candidate 16 at 2,000 kimg and 21 from 2,800 kimg on
  (mean 0.72, down from 0.79 at 400 kimg), so it would have warned at 2,800 kimg; the shipped
  3,482-kimg run peaked at 0.98 (1,900 kimg) and ended at 0.78 with 9-12 below half: no warning;
- "d_accuracy": D accuracy stayed above `d_acc_threshold` (95%) for `patience`
  evaluations in a row;
- "augmentation leak": the augmentation p (read by the trainer at the evaluation) has
  been >= `leak_p` (0.8) for `leak_patience` (2) evaluations in a row while the pipe
  has x-flips, rotations or the luma flip (training/augment.py LEAK_PRONE_OPS). ADA's
  augmentations are non-leaking only below ~0.8; above it G learns to draw them. The
  diversity measures cannot see this (an emoji64 run with its samples on their side
  kept diversity 0.93), hence a check of the cause rather than of the samples.

Counter-measures (only with auto_countermeasures), one per warning, in this order,
each at most once (and not again for `patience` evaluations): more augmentation
(ADA target +0.1 up to 0.8, or fixed p +0.2), dropout 0.3 before D's last layer,
a larger minibatch-stddev group (group size x2 where the batch allows), one more D
step per G step (up to 5). Each is recorded with its kimg; they are part of the
checkpoint, so a resumed run keeps them. A leak warning picks no counter-measure
(the first one, more augmentation, would feed the leak), and while p is in the leak
zone the augmentation measure is skipped for collapse warnings too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.errors import InputError
from evaluation.scores import mean_pairwise_distance

COUNTERMEASURES = ("augment", "dropout", "mbstd", "d_steps")


class FeatureSpace:
    """Fixed random projection of 16x16-pooled images: [N, C, H, W] in [-1, 1] -> [N, dim]."""

    def __init__(self, channels: int = 3, pool: int = 16, dim: int = 128, seed: int = 12345, device=None):
        g = torch.Generator().manual_seed(seed)
        self.pool = pool
        self.proj = (torch.randn(channels * pool * pool, dim, generator=g) / math.sqrt(dim)).to(device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        if x.shape[2] != self.pool:
            x = F.adaptive_avg_pool2d(x, self.pool)
        return x.flatten(1) @ self.proj.to(x.device)


def pairwise_stats(feats: torch.Tensor, ref_distance: float, dup_threshold: float) -> tuple[float, float]:
    """(mean pairwise distance, duplicate rate) of features [N, dim]."""
    n = feats.shape[0]
    if n < 2:
        raise InputError("the diversity monitor needs at least 2 samples")
    d = torch.cdist(feats.double(), feats.double())
    off = ~torch.eye(n, dtype=torch.bool, device=d.device)
    mean = d[off].mean().item()
    nearest = d.masked_fill(~off, float("inf")).min(dim=1).values
    dup = (nearest < dup_threshold * ref_distance).float().mean().item() if ref_distance > 0 else 0.0
    return mean, dup


@dataclass
class MonitorSettings:
    dup_threshold: float = 0.1       # x real mean pairwise distance: closer pairs are "near-identical"
    drop_fraction: float = 0.6       # diversity below 60% of its recent best ...
    min_ratio: float = 0.5           # ... and below half the data's diversity -> warning
    max_dup_rate: float = 0.1        # more than 10% near-duplicates -> warning
    class_min_ratio: float = 0.5     # within-class diversity below half the data's -> warning
    class_collapse_share: float = 0.2    # ... or more than 20% of the classes below half their own data's
    class_fall: float = 0.95         # ... once it has fallen below 95% of its best so far (collapse is a loss) ...
    class_patience: int = 10         # ... or has stayed low for this many evaluations (classes that never form)
    d_acc_threshold: float = 0.95
    patience: int = 3
    window: int = 10
    leak_p: float = 0.8              # augmentation p at or above this ...
    leak_patience: int = 2           # ... for this many evaluations, with flips/rotations -> warning


@dataclass
class MonitorState:
    history: list = field(default_factory=list)         # one record per evaluation
    real_distance: float = 0.0
    real_dup_rate: float = 0.0
    class_real_distance: dict = field(default_factory=dict)   # class index -> real images' mean pairwise distance
    high_acc_streak: int = 0
    high_p_streak: int = 0                              # evaluations in a row with p >= leak_p and leak ops
    applied: list = field(default_factory=list)         # [{"kimg", "measure", "detail"}]
    cooldown: int = 0


class CollapseMonitor:
    def __init__(self, settings: MonitorSettings | None = None, device=None):
        self.settings = settings or MonitorSettings()
        self.features = FeatureSpace(device=device)
        self.state = MonitorState()

    def set_reference(self, real_images: torch.Tensor) -> None:
        """real_images: a fixed batch in [-1, 1]; its diversity is the yardstick."""
        feats = self.features(real_images)
        mean, _ = pairwise_stats(feats, 0.0, self.settings.dup_threshold)
        self.state.real_distance = mean
        _, dup = pairwise_stats(feats, mean, self.settings.dup_threshold)
        self.state.real_dup_rate = dup

    def set_class_reference(self, real_images: torch.Tensor, classes) -> None:
        """Real images in [-1, 1] with their class indices: each class's own spread (classes with >= 2 images)
        is the yardstick of the class diversity."""
        feats = self.features(real_images)
        cls = torch.as_tensor(classes, dtype=torch.long).cpu()
        if len(cls) != len(feats):
            raise InputError(f"one class per reference image is needed; got {len(cls)} for {len(feats)} images")
        ref = {}
        for c in torch.unique(cls).tolist():
            sel = (cls == c).nonzero().flatten().to(feats.device)
            if len(sel) >= 2:
                ref[int(c)] = mean_pairwise_distance(feats[sel])
        if not ref:
            raise InputError("no class has 2 reference images: the class diversity needs pairs")
        self.state.class_real_distance = ref

    def class_diversity(self, samples: torch.Tensor, classes) -> dict:
        """Per class, the samples' mean pairwise distance over the class's real images'; the mean over classes."""
        ref = self.state.class_real_distance
        if not ref:
            raise InputError("call set_class_reference(real_images, classes) before measuring class diversity")
        feats = self.features(samples)
        cls = torch.as_tensor(classes, dtype=torch.long).cpu()
        ratios = {}
        for c in torch.unique(cls).tolist():
            sel = (cls == c).nonzero().flatten().to(feats.device)
            if len(sel) >= 2 and ref.get(int(c), 0) > 0:
                ratios[int(c)] = mean_pairwise_distance(feats[sel]) / ref[int(c)]
        if not ratios:
            raise InputError("no sampled class has 2 samples and a reference: render at least 2 per class")
        vals = list(ratios.values())
        lowest = min(ratios, key=ratios.get)
        return {"class_diversity": round(sum(vals) / len(vals), 5), "class_diversity_classes": len(vals),
                "classes_below_half": sum(v < 0.5 for v in vals),
                "class_diversity_lowest": {"class": lowest, "ratio": round(ratios[lowest], 5)}}

    def evaluate(self, samples: torch.Tensor, kimg: float, d_acc_real: float | None,
                 d_acc_fake: float | None, aug_p: float | None = None, leak_ops=(),
                 class_samples: torch.Tensor | None = None, sample_classes=None) -> dict:
        """Measure `samples` (the fixed-z batch from G_ema); returns the record with its warnings.

        aug_p: the augmentation p now (None: no augmentation); leak_ops: the leak-prone ops of the
        pipe (training.augment.leak_prone_ops), e.g. ["xflip", "rotate90", "rotate"].
        class_samples, sample_classes: a conditional run's fixed latents rendered in every class, and
        each one's class (set_class_reference first): the record gets the class diversity.
        """
        s = self.settings
        st = self.state
        if st.real_distance <= 0:
            raise InputError("call set_reference(real_images) before evaluate()")
        mean, dup = pairwise_stats(self.features(samples), st.real_distance, s.dup_threshold)
        diversity = mean / st.real_distance
        warnings = []
        recent = [h["diversity"] for h in st.history[-s.window:]]
        best = max(recent) if recent else diversity
        if recent and diversity < s.drop_fraction * best and diversity < s.min_ratio:
            warnings.append(f"diversity dropped sharply: {diversity:.2f} of the data's (recent best {best:.2f})")
        if dup > max(s.max_dup_rate, 2 * st.real_dup_rate):
            warnings.append(f"{dup:.0%} of the fixed samples have a near-identical twin (data: "
                            f"{st.real_dup_rate:.0%})")
        per_class = {}
        if class_samples is not None:
            per_class = self.class_diversity(class_samples, sample_classes)
            if self.class_collapse(per_class):
                warnings.append(f"within-class diversity {per_class['class_diversity']:.2f} of the data's: samples "
                                f"of a class look alike ({per_class['classes_below_half']} of "
                                f"{per_class['class_diversity_classes']} classes below half; class-wise collapse)")
        d_acc = None
        if d_acc_real is not None and d_acc_fake is not None:
            d_acc = 0.5 * (d_acc_real + d_acc_fake)
            st.high_acc_streak = st.high_acc_streak + 1 if d_acc > s.d_acc_threshold else 0
            if st.high_acc_streak >= s.patience:
                warnings.append(f"discriminator accuracy {d_acc:.1%} has stayed above {s.d_acc_threshold:.0%} "
                                f"for {st.high_acc_streak} evaluations (D is winning: overfitting or collapse)")
        leak_ops = sorted(leak_ops)
        leak_zone = aug_p is not None and aug_p >= s.leak_p and bool(leak_ops)
        st.high_p_streak = st.high_p_streak + 1 if leak_zone else 0
        leak_warning = None
        if st.high_p_streak >= s.leak_patience:
            leak_warning = (f"augmentation p {aug_p:.2f} >= {s.leak_p:g} with rotations/flips: they can leak into "
                            f"G (rotated or flipped samples); lower --ada-max-p or use --aug-pipe upright")
            warnings.append(leak_warning)
        record = {"kimg": round(float(kimg), 3), "diversity": round(diversity, 5), "pairwise_distance": mean,
                  "duplicate_rate": dup, **per_class, "d_acc": d_acc, "d_acc_real": d_acc_real, "d_acc_fake": d_acc_fake,
                  "aug_p": None if aug_p is None else round(float(aug_p), 5), "aug_leak_ops": leak_ops,
                  "aug_leak_zone": leak_zone, "leak_warning": leak_warning, "warnings": warnings}
        st.history.append(record)
        return record

    def class_low(self, rec: dict) -> bool:
        """A record's class diversity is low: its mean under class_min_ratio, or too many classes below half."""
        s = self.settings
        below = rec["classes_below_half"] / max(1, rec["class_diversity_classes"])
        return rec["class_diversity"] < s.class_min_ratio or below > s.class_collapse_share

    def class_collapse(self, per_class: dict) -> bool:
        """Low class diversity that is a collapse rather than classes still forming: low now, and either
        fallen below `class_fall` of its best so far in this run, or low for `class_patience` evaluations in a row
        (the module docstring says why)."""
        s = self.settings
        if not self.class_low(per_class):
            return False
        past = [h for h in self.state.history if "class_diversity" in h]
        best = max([h["class_diversity"] for h in past], default=per_class["class_diversity"])
        if per_class["class_diversity"] < s.class_fall * best:
            return True
        streak = 1
        for h in reversed(past):
            if not self.class_low(h):
                break
            streak += 1
        return streak >= s.class_patience

    def choose_countermeasure(self, record: dict) -> str | None:
        """The next counter-measure to apply for this record's collapse warnings, or None.

        A leak warning alone picks nothing: every measure here fights D overfitting, and the first,
        more augmentation, is the cause of a leak. In the leak zone (p >= leak_p with flips/rotations)
        'augment' is skipped for collapse warnings too.
        """
        st = self.state
        if st.cooldown > 0:
            st.cooldown -= 1
            return None
        collapse = [w for w in record["warnings"] if w != record.get("leak_warning")]
        if not collapse:
            return None
        done = {a["measure"] for a in st.applied}
        if record.get("aug_leak_zone"):
            done.add("augment")
        for m in COUNTERMEASURES:
            if m not in done:
                st.cooldown = self.settings.patience
                return m
        return None

    def record_applied(self, kimg: float, measure: str, detail: str) -> None:
        self.state.applied.append({"kimg": round(float(kimg), 3), "measure": measure, "detail": detail})

    def state_dict(self) -> dict:
        st = self.state
        return {"history": st.history, "real_distance": st.real_distance, "real_dup_rate": st.real_dup_rate,
                "class_real_distance": {str(k): v for k, v in st.class_real_distance.items()},
                "high_acc_streak": st.high_acc_streak, "high_p_streak": st.high_p_streak, "applied": st.applied,
                "cooldown": st.cooldown}

    def load_state_dict(self, d: dict) -> None:
        self.state = MonitorState(history=list(d.get("history", [])), real_distance=float(d["real_distance"]),
                                  real_dup_rate=float(d.get("real_dup_rate", 0.0)),
                                  class_real_distance={int(k): float(v)
                                                       for k, v in (d.get("class_real_distance") or {}).items()},
                                  high_acc_streak=int(d.get("high_acc_streak", 0)),
                                  high_p_streak=int(d.get("high_p_streak", 0)),
                                  applied=list(d.get("applied", [])), cooldown=int(d.get("cooldown", 0)))
