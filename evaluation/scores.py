"""The statistics behind FID, KID and IS, computed from features in float64.

These functions know nothing about networks or images: they take feature
matrices [N, D] (or logits [N, C]) as numpy arrays or tensors and return
numbers. tests/test_metrics_stats.py checks them against closed forms and
against the published implementations (torch-fidelity, pytorch-fid, clean-fid,
torchmetrics): FID and the Inception Score agree with torch-fidelity to float64
rounding, KID draws the same subsets as torch-fidelity for the same seed.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from core.errors import InputError


class MeanStd(NamedTuple):
    mean: float
    std: float


def _as_f64(x, name: str, ndim: int = 2) -> np.ndarray:
    a = x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)
    a = a.astype(np.float64, copy=False)
    if a.ndim != ndim:
        raise InputError(f"{name} must have {ndim} dimensions; got shape {a.shape}")
    if not np.isfinite(a).all():
        raise InputError(f"{name} contains NaN or infinite values")
    return a


def feature_stats(features) -> tuple[np.ndarray, np.ndarray]:
    """Mean [D] and unbiased covariance [D, D] of features [N, D], in float64 (as pytorch-fid's np.cov)."""
    f = _as_f64(features, "features")
    if f.shape[0] < 2:
        raise InputError(f"FID needs at least 2 images per set; got {f.shape[0]}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def _data_factor(features: np.ndarray) -> np.ndarray:
    """F [D, N] with F F^T = the unbiased covariance of features [N, D]: the centred data itself."""
    centred = features - features.mean(axis=0)
    return centred.T / np.sqrt(features.shape[0] - 1)


def _trace_sqrt_from_factor(f: np.ndarray, sigma: np.ndarray) -> float:
    """tr(sqrt(S_f S)) for S_f = F F^T: the non-zero eigenvalues of F F^T S equal those of the
    symmetric PSD matrix F^T S F, so tr sqrt = sum of sqrt of its eigenvalues (k x k for F [D, k])."""
    m = f.T @ sigma @ f
    ev = np.linalg.eigvalsh((m + m.T) / 2)
    return float(np.sqrt(np.clip(ev, 0, None)).sum())


def _trace_sqrt_from_factors(f1: np.ndarray, f2: np.ndarray) -> float:
    """tr(sqrt(S1 S2)) for S1 = F1 F1^T, S2 = F2 F2^T: the nuclear norm of F1^T F2 (its singular
    values squared are the eigenvalues of F1^T S2 F1)."""
    return float(np.linalg.svd(f1.T @ f2, compute_uv=False).sum())


def _trace_sqrt_from_stats(sigma1: np.ndarray, sigma2: np.ndarray) -> float:
    """tr(sqrt(S1 S2)) from two covariances: a Cholesky factor of whichever is positive definite,
    else eigen factors of S1 (singular covariances, e.g. fewer samples than dimensions)."""
    for a, b in ((sigma1, sigma2), (sigma2, sigma1)):
        try:
            return _trace_sqrt_from_factor(np.linalg.cholesky(a), b)
        except np.linalg.LinAlgError:
            continue
    w, v = np.linalg.eigh(sigma1)
    return _trace_sqrt_from_factor(v * np.sqrt(np.clip(w, 0, None)), sigma2)


def _fid(mu1, mu2, tr1: float, tr2: float, tr_covmean: float) -> float:
    diff = mu1 - mu2
    return float(diff @ diff + tr1 + tr2 - 2 * tr_covmean)


def _check_stats(mu1, sigma1, mu2, sigma2):
    mu1, mu2 = _as_f64(mu1, "mu1", 1), _as_f64(mu2, "mu2", 1)
    sigma1, sigma2 = _as_f64(sigma1, "sigma1"), _as_f64(sigma2, "sigma2")
    d = mu1.shape[0]
    if mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise InputError(f"feature statistics do not match: mu {mu1.shape} vs {mu2.shape}, "
                         f"sigma {sigma1.shape} vs {sigma2.shape} (were they made with the same network?)")
    return mu1, sigma1, mu2, sigma2


def fid_from_stats(mu1, sigma1, mu2, sigma2) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2):
    |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr(sqrt(S1 S2)).

    tr(sqrt(S1 S2)) is the sum of the square roots of the eigenvalues of S1 S2, as in
    torch-fidelity and torchmetrics; here they come from the symmetric F^T S2 F for a factor
    F F^T = S1, which has the same eigenvalues, so they are real and never need pytorch-fid's
    eps on the diagonal or its dropping of an imaginary part.
    """
    mu1, sigma1, mu2, sigma2 = _check_stats(mu1, sigma1, mu2, sigma2)
    return _fid(mu1, mu2, float(np.trace(sigma1)), float(np.trace(sigma2)), _trace_sqrt_from_stats(sigma1, sigma2))


def fid_from_stats_and_features(mu1, sigma1, features2) -> float:
    """FID between precomputed statistics (e.g. a cached real set) and a feature set [N, D].

    With fewer samples than dimensions the features enter through their centred data, so the
    work is an N x N eigenproblem instead of a D x D one.
    """
    f2 = _as_f64(features2, "features")
    mu2, s2 = feature_stats(f2)
    mu1, sigma1, mu2, s2 = _check_stats(mu1, sigma1, mu2, s2)
    if f2.shape[0] > f2.shape[1]:
        return fid_from_stats(mu1, sigma1, mu2, s2)
    return _fid(mu1, mu2, float(np.trace(sigma1)), float(np.trace(s2)),
                _trace_sqrt_from_factor(_data_factor(f2), sigma1))


def fid_from_features(a, b) -> float:
    """FID between two feature sets [N1, D] and [N2, D] (pool3 features for the standard FID).

    A set with no more samples than dimensions enters through its centred data (an N x D
    factor of its covariance), so small evaluations never solve a D x D problem.
    """
    fa, fb = _as_f64(a, "features a"), _as_f64(b, "features b")
    if fa.shape[1] != fb.shape[1]:
        raise InputError(f"feature sets differ in width: {fa.shape[1]} vs {fb.shape[1]}")
    mu1, s1 = feature_stats(fa)
    mu2, s2 = feature_stats(fb)
    d = fa.shape[1]
    small_a, small_b = fa.shape[0] <= d, fb.shape[0] <= d
    if small_a and small_b:
        tr_covmean = _trace_sqrt_from_factors(_data_factor(fa), _data_factor(fb))
    elif small_a:
        tr_covmean = _trace_sqrt_from_factor(_data_factor(fa), s2)
    elif small_b:
        tr_covmean = _trace_sqrt_from_factor(_data_factor(fb), s1)
    else:
        tr_covmean = _trace_sqrt_from_stats(s1, s2)
    return _fid(mu1, mu2, float(np.trace(s1)), float(np.trace(s2)), tr_covmean)


def polynomial_mmd2_unbiased(x, y, degree: int = 3, gamma: float | None = None, coef0: float = 1.0) -> float:
    """Unbiased MMD^2 with k(a, b) = (gamma a.b + coef0)^degree, gamma = 1/D by default (the KID kernel).

    Within-set sums leave out the diagonal (k(x_i, x_i)); the cross term keeps every pair.
    Inputs are used as given (float64 tensors recommended); returns a Python float.
    """
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    assert x.ndim == 2 and y.ndim == 2 and x.shape[1] == y.shape[1], (tuple(x.shape), tuple(y.shape))
    m, n = x.shape[0], y.shape[0]
    if m < 2 or n < 2:
        raise InputError(f"KID needs at least 2 samples per set; got {m} and {n}")
    g = 1.0 / x.shape[1] if gamma is None else gamma
    kxx = (x @ x.T * g + coef0) ** degree
    kyy = (y @ y.T * g + coef0) ** degree
    kxy = (x @ y.T * g + coef0) ** degree
    xx = (kxx.sum() - kxx.diagonal().sum()) / (m * (m - 1))
    yy = (kyy.sum() - kyy.diagonal().sum()) / (n * (n - 1))
    xy = kxy.sum() / (m * n)
    return float(xx + yy - 2 * xy)


KID_SEED = 2020        # torch-fidelity's default rng_seed: the same seed draws the same subsets


def kid_from_features(a, b, subsets: int = 100, subset_size: int = 1000, degree: int = 3, gamma: float | None = None,
                      coef0: float = 1.0, seed: int = KID_SEED, device: str | torch.device | None = None) -> MeanStd:
    """Kernel Inception Distance: unbiased polynomial MMD^2 averaged over random subsets (mean, std).

    As torch-fidelity: for each subset, `subset_size` rows of `a` then of `b` drawn without
    replacement by one np.random.RandomState(seed), so the same seed gives torch-fidelity's
    subsets. Where torch-fidelity refuses a subset larger than a set, the size shrinks to the
    smaller set (then every draw is a permutation of all samples and the std is 0).
    """
    fa, fb = _as_f64(a, "features a"), _as_f64(b, "features b")
    if fa.shape[1] != fb.shape[1]:
        raise InputError(f"feature sets differ in width: {fa.shape[1]} vs {fb.shape[1]}")
    if int(subsets) < 1:
        raise InputError("KID needs at least one subset")
    size = min(int(subset_size), fa.shape[0], fb.shape[0])
    if size < 2:
        raise InputError(f"KID needs at least 2 images per set; got {fa.shape[0]} and {fb.shape[0]}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    ta = torch.from_numpy(fa).to(dev)
    tb = torch.from_numpy(fb).to(dev)
    rng = np.random.RandomState(seed)
    values = np.empty(int(subsets))
    for i in range(int(subsets)):
        ia = torch.from_numpy(rng.choice(fa.shape[0], size, replace=False)).to(dev)
        ib = torch.from_numpy(rng.choice(fb.shape[0], size, replace=False)).to(dev)
        values[i] = polynomial_mmd2_unbiased(ta[ia], tb[ib], degree=degree, gamma=gamma, coef0=coef0)
    return MeanStd(float(values.mean()), float(values.std()))


def inception_score(logits, splits: int = 10, shuffle: bool = True, seed: int = 2020) -> MeanStd:
    """IS = exp(E_x KL(p(y|x) || p(y))) per split of the samples; mean and (population) std over splits.

    `logits` [N, C] are unnormalised class scores (the 1008 Inception logits, without the fc
    bias). p(y) is the mean of p(y|x) within a split. As torch-fidelity: shuffle with
    RandomState(seed).permutation (so sorted inputs, e.g. a class-ordered folder, do not give
    each split one class), then split i holds rows i*N//splits .. (i+1)*N//splits.
    """
    lg = torch.from_numpy(_as_f64(logits, "logits"))
    n = lg.shape[0]
    splits = int(splits)
    if splits < 1:
        raise InputError("the Inception Score needs at least one split")
    if n < splits:
        raise InputError(f"the Inception Score with {splits} splits needs at least {splits} images; got {n}")
    if shuffle:
        lg = lg[torch.from_numpy(np.random.RandomState(seed).permutation(n))]
    log_p = torch.log_softmax(lg, dim=1)
    scores = []
    for i in range(splits):
        chunk = log_p[i * n // splits:(i + 1) * n // splits]
        # log p(y) = log mean_x p(y|x), kept in log space so no class underflows to log(0)
        log_py = torch.logsumexp(chunk, dim=0) - np.log(chunk.shape[0])
        kl = (chunk.exp() * (chunk - log_py)).sum(dim=1).mean()
        scores.append(float(torch.exp(kl)))
    return MeanStd(float(np.mean(scores)), float(np.std(scores)))


def mean_pairwise_distance(feats) -> float:
    """Mean Euclidean distance over all pairs of distinct rows of [N, D] features (a tensor or an array): an
    unbiased estimate of E|x - x'| for any n >= 2, so classes with few samples are not biased, only noisier."""
    f = torch.as_tensor(feats).double()
    n = f.shape[0]
    if n < 2:
        raise InputError(f"a mean pairwise distance needs at least 2 rows; got {n}")
    return float((torch.cdist(f, f).sum() / (n * (n - 1))).item())
