"""Quality metrics of generated images: FID, KID, IS and LPIPS, with one entry point.

    from evaluation.metrics import compute_metrics
    result = compute_metrics("data/faces", generator_sample_fn, metrics=["fid", "kid", "is"], num=10_000,
                             inception_weights="weights/pt_inception-2015-12-05-6726825d.pth")
    result["fid"], result["kid_mean"], result["is_mean"]

The real set's Inception features are cached on disk (an .npz with mu, sigma and
the features, keyed by the images' fingerprint and the weights' hash), so a
trainer evaluating every few thousand images pays for the real set once.
Everything here runs in fp32 with autocast off, on any device.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from core.errors import InputError
from evaluation.inception import DEFAULT_INPUT_MODE, INPUT_MODES, POOL_DIM, InceptionFeatures
from evaluation.lpips import LPIPS, lpips_diversity, lpips_paired
from evaluation.scores import (KID_SEED, MeanStd, feature_stats, fid_from_features, fid_from_stats,
                               fid_from_stats_and_features, inception_score, kid_from_features)
from evaluation.sources import (ArraySource, FolderSource, GeneratorSource, ImageSource, is_stats_file,
                                open_source)
from evaluation.weights import unpublished_note

__all__ = [
    "InceptionFeatures", "LPIPS", "MeanStd", "FeatureStats", "compute_metrics", "real_statistics",
    "fid_from_features", "fid_from_stats", "fid_from_stats_and_features", "feature_stats", "kid_from_features", "inception_score",
    "lpips_diversity", "lpips_paired", "open_source", "parse_metrics", "METRICS", "INPUT_MODES", "DEFAULT_INPUT_MODE",
    "KID_SEED",
]

METRICS = ("fid", "kid", "is", "lpips", "lpips_paired")
_ALIASES = {"isc": "is", "inception_score": "is", "lpips_diversity": "lpips", "diversity": "lpips",
            "lpips-paired": "lpips_paired", "lpips_drift": "lpips_paired", "drift": "lpips_paired"}
_NEEDS_REAL = {"fid", "kid", "lpips_paired"}
_NEEDS_INCEPTION = {"fid", "kid", "is"}
STATS_VERSION = 1
SMALL_N = 2048   # below this many images the 2048-d covariance is rank-deficient and FID's bias is large


def parse_metrics(metrics: str | Iterable[str]) -> list[str]:
    """'fid,kid' or ['fid', 'kid'] -> validated canonical names, in the given order, without repeats."""
    items = metrics.split(",") if isinstance(metrics, str) else list(metrics)
    out: list[str] = []
    for m in items:
        name = _ALIASES.get(str(m).strip().lower(), str(m).strip().lower())
        if not name:
            continue
        if name not in METRICS:
            raise InputError(f"unknown metric {m!r}; choose from {', '.join(METRICS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise InputError(f"no metrics asked for; choose from {', '.join(METRICS)}")
    return out


@dataclass
class FeatureStats:
    """Inception pool3 statistics of an image set; `features` kept when known (KID needs them)."""

    mu: np.ndarray                          # float64 [D]
    sigma: np.ndarray                       # float64 [D, D]
    n: int
    features: np.ndarray | None = None      # float32 [N, D]
    identity: str = ""                      # source fingerprint | network identity; "" if unknown

    @classmethod
    def from_features(cls, features: np.ndarray, identity: str = "") -> "FeatureStats":
        mu, sigma = feature_stats(features)
        return cls(mu, sigma, int(features.shape[0]), np.asarray(features, dtype=np.float32), identity)

    def save(self, path: str | os.PathLike, with_features: bool = True) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = dict(mu=self.mu, sigma=self.sigma, n=np.int64(self.n), identity=np.str_(self.identity),
                      version=np.int64(STATS_VERSION))
        if with_features and self.features is not None:
            arrays["features"] = self.features
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")   # two evaluations may share a cache
        np.savez(tmp, **arrays)
        os.replace(tmp, path)              # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FeatureStats":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                mu, sigma = z["mu"].astype(np.float64), z["sigma"].astype(np.float64)
                feats = z["features"].astype(np.float32) if "features" in z.files else None
                n = int(z["n"]) if "n" in z.files else (feats.shape[0] if feats is not None else 0)
                identity = str(z["identity"]) if "identity" in z.files else ""
        except (OSError, KeyError, ValueError) as exc:
            raise InputError(f"{path}: not a feature statistics file with mu and sigma ({exc})") from None
        d = mu.shape[0] if mu.ndim == 1 else -1
        if d < 1 or sigma.shape != (d, d) or (feats is not None and feats.shape[1:] != (d,)):
            raise InputError(f"{path}: mu {mu.shape} and sigma {sigma.shape} do not fit together")
        return cls(mu, sigma, n, feats, identity)


def _cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "real-stats" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"


def _default_cache_dir() -> Path:
    from core.settings import Settings

    return Settings.from_env().cache_dir / "metrics"


def real_statistics(real_source, inception: InceptionFeatures, cache_dir: str | os.PathLike | None | bool = None,
                    need_features: bool = True, batch_size: int | None = None, progress: bool | None = None,
                    num: int | None = None) -> tuple[FeatureStats, dict]:
    """Feature statistics of the real set, from the disk cache when the images and weights are unchanged.

    real_source: FeatureStats, a stats .npz (mu, sigma[, features]), or any image source.
    cache_dir: folder for the cache (None: the studio's cache folder; False: no cache).
    Returns (stats, info) with info = {"cache": path or None, "cache_hit": bool}.
    """
    info: dict = {"cache": None, "cache_hit": False}
    if isinstance(real_source, FeatureStats):
        return real_source, info
    if isinstance(real_source, (str, os.PathLike)) and is_stats_file(real_source):
        stats = FeatureStats.load(real_source)
        info.update(cache=str(real_source), cache_hit=True, from_stats_file=True)
        return stats, info
    src = _limit(open_source(real_source, what="real images"), num, "real")
    fp = src.fingerprint()
    path = None
    if cache_dir is not False and fp is not None:
        path = _cache_path(Path(cache_dir) if cache_dir else _default_cache_dir(), f"{fp}|{inception.identity}")
        info["cache"] = str(path)
        if path.is_file():
            try:
                stats = FeatureStats.load(path)
            except InputError:
                stats = None                            # unreadable cache: recompute and overwrite
            if stats is not None and stats.identity == f"{fp}|{inception.identity}" and \
                    (stats.features is not None or not need_features):
                info["cache_hit"] = True
                return stats, info
    pool, _ = inception.extract(src.batches(batch_size or inception.batch_size), total=len(src), progress=progress,
                                desc="inception (real)")
    stats = FeatureStats.from_features(pool, identity=f"{fp}|{inception.identity}" if fp else "")
    if path is not None:
        stats.save(path)
    return stats, info


def _limit(src: ImageSource, num: int | None, what: str) -> ImageSource:
    """The first `num` images of a folder or array (a generator draws exactly `num` already)."""
    if num is None or isinstance(src, GeneratorSource):
        return src
    if int(num) < 1:
        raise InputError(f"the number of {what} images must be at least 1; got {num}")
    if int(num) > len(src):
        raise InputError(f"{num} {what} images asked for but {src.name} holds only {len(src)}")
    if int(num) == len(src):
        return src
    if isinstance(src, FolderSource):
        return FolderSource(src.root, files=src.files[:int(num)], workers=src.workers)
    if isinstance(src, ArraySource):
        fp = src.fingerprint()
        return ArraySource(src.array[:int(num)], src.name, src.value_range, f"{fp}[:{num}]" if fp else None)
    raise InputError(f"cannot take the first {num} images of {src.name}")


def compute_metrics(real_source=None, fake_source=None, metrics: str | Iterable[str] = ("fid", "kid", "is"), *,
                    num: int | None = None, num_real: int | None = None,
                    inception_weights: str | os.PathLike | None = None, lpips_weights: str | os.PathLike | None = None,
                    lpips_backbone: str | os.PathLike | None = None, lpips_net: str = "alex",
                    device: str | torch.device | None = None, batch_size: int = 32,
                    kid_subsets: int = 100, kid_subset_size: int = 1000, is_splits: int = 10,
                    lpips_pairs: int | None = None, seed: int = KID_SEED, input_mode: str = DEFAULT_INPUT_MODE,
                    cache_dir: str | os.PathLike | None | bool = None, value_range: tuple[float, float] = (-1.0, 1.0),
                    progress: bool = True, inception: InceptionFeatures | None = None,
                    lpips: LPIPS | None = None) -> dict:
    """Quality of `fake_source` (against `real_source` where a metric needs it).

    Sources: a folder of images, a .npy/.npz image array (uint8, or floats in `value_range`),
    an array/tensor, an ImageSource, or a sampler `fn(batch_size) -> images` (needs `num`).
    The real set may also be a FeatureStats or a stats .npz. `input_mode` is the FID tool whose
    input path the Inception features reproduce ("tf": torch-fidelity / NVlabs, "torchmetrics",
    "pytorch-fid", "clean": clean-fid); `seed` draws the KID subsets (2020: torch-fidelity's) and
    the LPIPS pairs. Metrics (any of METRICS):
      fid            Fréchet Inception distance (real vs fake)
      kid            Kernel Inception distance, mean and std over subsets (real vs fake)
      is             Inception Score of the fake set, mean and std over splits
      lpips          LPIPS diversity of the fake set (mean distance between random pairs)
      lpips_paired   LPIPS between real[i] and fake[i] (e.g. reference vs toggled outputs)
    Pass `inception` / `lpips` objects to reuse loaded networks across calls.
    Returns a flat dict: fid, kid_mean, kid_std, is_mean, is_std, lpips_diversity(_std),
    lpips_paired(_std) as asked, plus n_real, n_fake, settings, weights (path, sha256, published),
    timings_s, notes.
    """
    names = parse_metrics(metrics)
    if int(batch_size) < 1:
        raise InputError("batch size must be at least 1")
    if fake_source is None:
        raise InputError("no generated images to evaluate: give a fake source (folder, array or model)")
    if _NEEDS_REAL & set(names) and real_source is None:
        raise InputError(f"{', '.join(sorted(_NEEDS_REAL & set(names)))} compare against real images: "
                         f"give a real source (folder, array or stats .npz)")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    notes: list[str] = []
    result: dict = {}

    fake = _limit(open_source(fake_source, num=num, value_range=value_range, what="fake images"), num, "fake")

    # networks first: missing weights should fail before minutes of sampling or reading
    inc = lp = None
    if _NEEDS_INCEPTION & set(names):
        t = time.perf_counter()
        inc = inception or InceptionFeatures(inception_weights, device=device, batch_size=batch_size, progress=progress,
                                             input_mode=input_mode)
        timings["load_inception"] = time.perf_counter() - t
    if {"lpips", "lpips_paired"} & set(names):
        t = time.perf_counter()
        lp = lpips or LPIPS(lpips_weights, lpips_backbone, net=lpips_net, device=device or (inc.device if inc else None))
        timings["load_lpips"] = time.perf_counter() - t
        if isinstance(fake, GeneratorSource):
            t = time.perf_counter()
            fake = fake.materialize(batch_size)          # the same samples for every metric, readable in any order
            timings["generate"] = time.perf_counter() - t

    real_stats = None
    if {"fid", "kid"} & set(names):
        t = time.perf_counter()
        real_stats, cache_info = real_statistics(real_source, inc, cache_dir, need_features="kid" in names,
                                                 batch_size=batch_size, progress=progress, num=num_real)
        timings["real_features"] = time.perf_counter() - t
        result["real_stats"] = cache_info
        if cache_info.get("from_stats_file"):
            notes.append("real statistics read from a stats file: trusted to come from the same Inception weights")
        if real_stats.mu.shape[0] != POOL_DIM:
            raise InputError(f"the real statistics are {real_stats.mu.shape[0]}-d; the FID Inception gives {POOL_DIM}-d")
        result["n_real"] = real_stats.n
        if "kid" in names and real_stats.features is None:
            raise InputError("KID needs the real set's features, and the statistics given hold only mu and sigma; "
                             "pass the real images (or a stats file saved with features)")

    pool = logits = None
    if inc is not None:
        t = time.perf_counter()
        pool, logits = inc.extract(fake.batches(batch_size), total=len(fake), progress=progress,
                                   desc="inception (fake)")
        timings["fake_features"] = time.perf_counter() - t
    result["n_fake"] = len(fake)
    settings: dict = {}

    if "fid" in names:
        t = time.perf_counter()
        if real_stats.features is not None:
            result["fid"] = fid_from_features(real_stats.features, pool)
        else:
            result["fid"] = fid_from_stats_and_features(real_stats.mu, real_stats.sigma, pool)
        timings["fid"] = time.perf_counter() - t
        if min(real_stats.n, len(fake)) < SMALL_N:
            notes.append(f"FID from {min(real_stats.n, len(fake))} images is biased upwards and only comparable with "
                         f"FIDs from the same number of images (papers use 50,000 generated images)")
    if "kid" in names:
        t = time.perf_counter()
        size = min(int(kid_subset_size), real_stats.n, len(fake))
        if size < int(kid_subset_size):
            notes.append(f"KID subsets shrank to {size} images (fewer samples than {kid_subset_size})")
        kid = kid_from_features(real_stats.features, pool, subsets=kid_subsets, subset_size=size, seed=seed,
                                device=inc.device)
        result["kid_mean"], result["kid_std"] = kid.mean, kid.std
        settings.update(kid_subsets=int(kid_subsets), kid_subset_size=size)
        timings["kid"] = time.perf_counter() - t
    if "is" in names:
        t = time.perf_counter()
        # fewer images than splits: one split over all of them (a split of one image always scores 1)
        splits = int(is_splits) if len(fake) >= int(is_splits) else 1
        if splits < int(is_splits):
            notes.append(f"Inception Score over 1 split: only {len(fake)} images for {is_splits} splits")
        score = inception_score(logits, splits=splits)
        result["is_mean"], result["is_std"] = score.mean, score.std
        settings["is_splits"] = splits
        timings["is"] = time.perf_counter() - t

    if lp is not None:
        settings["lpips_net"] = lp.net_name
        if "lpips" in names:
            t = time.perf_counter()
            div = lpips_diversity(fake, lp, num_pairs=lpips_pairs, seed=seed, batch_size=batch_size, progress=progress)
            result["lpips_diversity"], result["lpips_diversity_std"] = div.mean, div.std
            settings["lpips_pairs"] = int(lpips_pairs) if lpips_pairs is not None else len(fake) // 2
            timings["lpips"] = time.perf_counter() - t
        if "lpips_paired" in names:
            t = time.perf_counter()
            real = _limit(open_source(real_source, value_range=value_range, what="real images"), num_real, "real")
            if isinstance(real, GeneratorSource):
                real = real.materialize(batch_size)
            pair, _ = lpips_paired(real, fake, lp, batch_size=batch_size, progress=progress)
            result["lpips_paired"], result["lpips_paired_std"] = pair.mean, pair.std
            result.setdefault("n_real", len(real))
            timings["lpips_paired"] = time.perf_counter() - t

    if inc is not None:
        settings["inception_input"] = inc.input_mode
    result["metrics"] = names
    result["settings"] = settings
    result["device"] = str(inc.device if inc is not None else (lp.shift.device))
    weights = {**({"inception": inc.weights} if inc is not None else {}), **(lp.weights if lp is not None else {})}
    result["weights"] = weights
    notes += [n for n in map(unpublished_note, weights.values()) if n]
    timings["total"] = time.perf_counter() - t_start
    result["timings_s"] = {k: round(v, 4) for k, v in timings.items()}
    result["notes"] = notes
    return result
