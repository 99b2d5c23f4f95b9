"""Quality metrics: FID/KID/IS maths against float64 references and closed forms, the FID Inception and
LPIPS networks (random weights: shapes, key mapping, input path), image sources, compute_metrics and the CLI.

The published weights cannot be downloaded here, so no test checks a published number; the networks are
checked structurally (parameter count, key names, strict load) and the maths on random features.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from core.errors import InputError, ModelLoadError, OptionalDependencyError, UnsafeModelError
from evaluation.inception import (INPUT_SIZE, NUM_LOGITS, POOL_DIM, FIDInceptionV3, InceptionFeatures, _tf_avg_pool3,
                                  preprocess, to_unit_float)
from evaluation.lpips import LPIPS, lpips_diversity, lpips_paired
from evaluation.metrics import FeatureStats, compute_metrics, parse_metrics
from evaluation.scores import (fid_from_features, fid_from_stats, fid_from_stats_and_features, inception_score,
                               kid_from_features, polynomial_mmd2_unbiased)
from evaluation.sources import ArraySource, FolderSource, GeneratorSource, open_source, paired, quantize
from evaluation.weights import INCEPTION, ENV_VAR

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- float64 references, written plainly

def ref_fid(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    m1, m2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    return float(((m1 - m2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean).real)


def ref_mmd2_unbiased(x, y):
    d = x.shape[1]

    def k(a, b):
        return (float(a @ b) / d + 1.0) ** 3

    m, n = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return xx + yy - 2 * xy


def ref_inception_score(logits, splits):
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    scores = []
    for chunk in np.array_split(p, splits):
        py = chunk.mean(0)
        kl = (chunk * (np.log(chunk) - np.log(py))).sum(1).mean()
        scores.append(np.exp(kl))
    return np.mean(scores), np.std(scores)


# ---------------------------------------------------------------- FID

def test_fid_of_identical_sets_is_zero():
    x = np.random.default_rng(0).normal(size=(300, 32))
    assert abs(fid_from_features(x, x)) < 1e-9
    assert abs(fid_from_features(x, x, method="sqrtm")) < 1e-6
    few = x[:10]                                     # fewer samples than dimensions: singular covariance
    assert abs(fid_from_features(few, few)) < 1e-9


def test_fid_closed_form_for_gaussians():
    rng = np.random.default_rng(1)
    d = 12
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    v1, v2 = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
    expected = ((mu1 - mu2) ** 2).sum() + (v1 + v2 - 2 * np.sqrt(v1 * v2)).sum()
    for method in ("auto", "sqrtm"):
        assert fid_from_stats(mu1, np.diag(v1), mu2, np.diag(v2), method=method) == pytest.approx(expected, rel=1e-10)
    # the same pair of Gaussians in a rotated basis: FID is rotation invariant, and the covariances are now full
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    s1, s2 = q @ np.diag(v1) @ q.T, q @ np.diag(v2) @ q.T
    for method in ("auto", "sqrtm"):
        assert fid_from_stats(q @ mu1, s1, q @ mu2, s2, method=method) == pytest.approx(expected, rel=1e-9)


def test_fid_from_samples_matches_float64_scipy_reference():
    rng = np.random.default_rng(2)
    for n1, n2, d in [(400, 300, 16), (50, 500, 32), (10, 12, 64)]:   # last: both covariances singular
        a = rng.normal(size=(n1, d))
        b = rng.normal(size=(n2, d)) @ rng.normal(size=(d, d)) * 0.3 + 0.5
        ref = ref_fid(a, b)
        tol = 1e-9 if min(n1, n2) > d else 1e-6   # scipy's sqrtm itself is less exact on singular products
        assert fid_from_features(a, b) == pytest.approx(ref, rel=tol)
        assert fid_from_features(a, b, method="sqrtm") == pytest.approx(ref, rel=tol)
        assert fid_from_features(torch.tensor(a, dtype=torch.float32), b) == pytest.approx(ref, rel=1e-5)
        mu, sigma = a.mean(0), np.cov(a, rowvar=False)                # a cached real set against new features
        assert fid_from_stats_and_features(mu, sigma, b) == pytest.approx(ref, rel=tol)
        assert fid_from_stats(mu, sigma, b.mean(0), np.cov(b, rowvar=False)) == pytest.approx(ref, rel=tol)


def test_fid_from_many_samples_approaches_the_closed_form():
    rng = np.random.default_rng(3)
    mu1, mu2, v1, v2 = np.zeros(3), np.array([1.0, -0.5, 0.0]), np.array([1.0, 2.0, 0.5]), np.array([0.5, 2.0, 2.0])
    expected = ((mu1 - mu2) ** 2).sum() + (v1 + v2 - 2 * np.sqrt(v1 * v2)).sum()
    a = rng.normal(size=(40000, 3)) * np.sqrt(v1) + mu1
    b = rng.normal(size=(40000, 3)) * np.sqrt(v2) + mu2
    assert fid_from_features(a, b) == pytest.approx(expected, abs=0.03)


def test_fid_rejects_bad_inputs():
    with pytest.raises(InputError, match="at least 2"):
        fid_from_features(np.zeros((1, 4)), np.zeros((5, 4)))
    with pytest.raises(InputError, match="width"):
        fid_from_features(np.zeros((5, 4)), np.zeros((5, 3)))
    with pytest.raises(InputError, match="NaN"):
        fid_from_features(np.full((5, 4), np.nan), np.zeros((5, 4)))


# ---------------------------------------------------------------- KID

def test_kid_matches_direct_quadratic_reference():
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(15, 4)), rng.normal(size=(13, 4)) + 0.3
    assert polynomial_mmd2_unbiased(torch.tensor(x), torch.tensor(y)) == pytest.approx(ref_mmd2_unbiased(x, y), rel=1e-12)
    # subsets as large as the smaller set: every draw of y is all of it, x varies -> compare the mean with the reference
    kid = kid_from_features(x[:13], y, subsets=3, subset_size=1000)
    assert kid.mean == pytest.approx(ref_mmd2_unbiased(x[:13], y), rel=1e-12) and kid.std < 1e-12


def test_kid_is_near_zero_for_one_distribution_and_positive_for_a_shift():
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(600, 8)), rng.normal(size=(600, 8))
    c = rng.normal(size=(600, 8)) + 0.5
    same = kid_from_features(a, b, subsets=30, subset_size=150)
    shifted = kid_from_features(a, c, subsets=30, subset_size=150)
    assert abs(same.mean) < 3 * same.std          # unbiased: zero within its spread
    assert shifted.mean > 10 * same.std and shifted.mean > 0
    with pytest.raises(InputError, match="at least 2"):
        kid_from_features(a[:1], b)


# ---------------------------------------------------------------- IS

def test_inception_score_uniform_is_one_and_confident_classes_give_k():
    score = inception_score(np.zeros((20, NUM_LOGITS)), splits=10)
    assert score.mean == pytest.approx(1.0, abs=1e-12) and score.std == pytest.approx(0.0, abs=1e-12)
    k = 5
    logits = 40.0 * np.eye(NUM_LOGITS)[np.arange(50) % k]   # each split of 5 holds the 5 classes once
    score = inception_score(logits, splits=10, shuffle=False)
    assert score.mean == pytest.approx(k, rel=1e-9) and score.std < 1e-9
    assert inception_score(logits, splits=1).mean == pytest.approx(k, rel=1e-9)
    # extreme logits must not turn into NaN (probabilities that underflow to 0)
    assert inception_score(2000.0 * np.eye(NUM_LOGITS)[np.arange(20) % 4], splits=1).mean == pytest.approx(4, rel=1e-9)


def test_inception_score_matches_numpy_reference():
    logits = np.random.default_rng(6).normal(size=(40, 30)) * 3
    score = inception_score(logits, splits=4, shuffle=False)
    ref_mean, ref_std = ref_inception_score(logits, 4)
    assert score.mean == pytest.approx(ref_mean, rel=1e-10) and score.std == pytest.approx(ref_std, rel=1e-8)
    with pytest.raises(InputError, match="at least 10 images"):
        inception_score(logits[:5], splits=10)


# ---------------------------------------------------------------- the FID Inception network (random weights)

def random_inception(seed: int = 0) -> FIDInceptionV3:
    """Random weights with activations of order one (a default init shrinks them to ~1e-7 by pool3)."""
    torch.manual_seed(seed)
    net = FIDInceptionV3()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
        nn.init.normal_(net.fc.weight, std=0.05)
        nn.init.normal_(net.fc.bias, std=0.5)
    return net.eval()


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory) -> Path:
    """A random-weight file laid out as the published one: TF-ported, so no BatchNorm step counters."""
    folder = tmp_path_factory.mktemp("weights")
    state = {k: v for k, v in random_inception().state_dict().items() if not k.endswith("num_batches_tracked")}
    path = folder / INCEPTION.file_names[0]
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def inception(inception_file) -> InceptionFeatures:
    return InceptionFeatures(inception_file, device="cpu", progress=False, batch_size=8)


def test_inception_structure_matches_the_fid_network():
    net = FIDInceptionV3()
    # torchvision's inception_v3 has 27,161,264 parameters; minus AuxLogits (3,326,696) plus 8 more classes
    assert sum(p.numel() for p in net.parameters()) == 27_161_264 - 3_326_696 + 8 * 2049
    keys = net.state_dict().keys()
    for k in ("Conv2d_1a_3x3.conv.weight", "Conv2d_4a_3x3.bn.running_var", "Mixed_5b.branch_pool.conv.weight",
              "Mixed_6e.branch7x7dbl_5.bn.bias", "Mixed_7a.branch7x7x3_4.conv.weight", "Mixed_7c.branch3x3dbl_3b.bn.weight",
              "fc.weight", "fc.bias"):
        assert k in keys, k
    assert not any(k.startswith("AuxLogits") or ".conv.bias" in k for k in keys)
    assert net.fc.weight.shape == (NUM_LOGITS, POOL_DIM)
    assert all(m.eps == 1e-3 for m in net.modules() if isinstance(m, nn.BatchNorm2d))
    assert (net.Mixed_7b.pool, net.Mixed_7c.pool) == ("avg", "max")
    # TF average pooling: border outputs average only real pixels (a torch default pool gives 4/9 at corners)
    assert torch.equal(_tf_avg_pool3(torch.ones(1, 1, 5, 5)), torch.ones(1, 1, 5, 5))


def test_inception_input_path_resize_and_normalisation():
    u8 = torch.randint(0, 256, (2, 3, 40, 48), dtype=torch.uint8)
    x01 = to_unit_float(u8)
    assert torch.equal(x01, u8.float() / 255) and torch.equal(to_unit_float(u8.float() / 255), x01)
    expected = F.interpolate(x01, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False) * 2 - 1
    assert torch.equal(preprocess(x01), expected)
    at299 = torch.rand(1, 3, INPUT_SIZE, INPUT_SIZE)
    assert torch.equal(preprocess(at299), at299 * 2 - 1)          # already 299: no resampling
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        to_unit_float(torch.rand(1, 3, 8, 8) * 2 - 1)              # generator range: must be converted first
    with pytest.raises(InputError, match=r"\[N, 3, H, W\]"):
        to_unit_float(np.zeros((1, 8, 8, 3), np.uint8))


def test_inception_features_shapes_and_strict_load_by_key_name(inception, inception_file):
    reference = random_inception()
    for k, v in reference.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert torch.equal(inception.net.state_dict()[k], v), k
    u8 = np.random.default_rng(7).integers(0, 256, (2, 3, 40, 48), dtype=np.uint8)
    pool, logits = inception.features(u8)
    assert pool.shape == (2, POOL_DIM) and logits.shape == (2, NUM_LOGITS) and pool.dtype == np.float32
    with torch.no_grad():
        x = F.interpolate(torch.from_numpy(u8).float() / 255, size=(299, 299), mode="bilinear", align_corners=False)
        want = reference(x * 2 - 1)
    assert np.allclose(pool, want.numpy(), rtol=1e-5, atol=1e-6)
    assert pool.std() > 1e-2                                       # order-one features, not a degenerate net
    # IS logits: pool3 times the softmax weights, without the bias (as the Inception Score was defined)
    assert np.allclose(logits, pool @ reference.fc.weight.detach().numpy().T, rtol=1e-5, atol=1e-5)


def test_inception_refuses_files_that_do_not_match_or_carry_code(inception_file, tmp_path):
    state = torch.load(inception_file, weights_only=True)
    renamed = {("Mixed_5b.branch1x1.conv.w" if k == "Mixed_5b.branch1x1.conv.weight" else k): v for k, v in state.items()}
    torch.save(renamed, tmp_path / "renamed.pth")
    with pytest.raises(ModelLoadError, match="missing.*Mixed_5b.branch1x1.conv.weight"):
        InceptionFeatures(tmp_path / "renamed.pth", device="cpu")
    torch.save({**state, "AuxLogits.fc.weight": torch.zeros(1000, 768)}, tmp_path / "aux.pth")
    with pytest.raises(ModelLoadError, match="unexpected.*AuxLogits"):
        InceptionFeatures(tmp_path / "aux.pth", device="cpu")
    torch.jit.script(nn.Linear(2, 2)).save(str(tmp_path / "scripted.pt"))
    with pytest.raises(UnsafeModelError, match="TorchScript"):
        InceptionFeatures(tmp_path / "scripted.pt", device="cpu")

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    torch.save({"fc.weight": Payload()}, tmp_path / "code.pth")
    with pytest.raises(UnsafeModelError, match="refusing"):
        InceptionFeatures(tmp_path / "code.pth", device="cpu")


def test_missing_weights_name_the_file_the_url_and_the_ways_to_point_at_it(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(ENV_VAR, str(empty))
    monkeypatch.setenv("ATELIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(OptionalDependencyError) as e:
        InceptionFeatures(device="cpu")
    msg = str(e.value)
    for needle in ("pt_inception-2015-12-05-6726825d.pth", "https://github.com/mseitzer/pytorch-fid/releases",
                   "--inception-weights", ENV_VAR, str(empty)):
        assert needle in msg, needle
    with pytest.raises(OptionalDependencyError, match="does not exist"):
        InceptionFeatures(tmp_path / "nope.pth", device="cpu")
    with pytest.raises(OptionalDependencyError) as e:
        LPIPS(net="alex")
    assert "alexnet-owt-7be5be79.pth" in str(e.value) and "--lpips-backbone" in str(e.value)
    torch.save(LPIPS(load=False, device="cpu").features.state_dict(), empty / "alexnet-owt-7be5be79.pth")
    with pytest.raises(OptionalDependencyError) as e:
        LPIPS(net="alex")
    assert "lpips_alex.pth" in str(e.value) and "richzhang/PerceptualSimilarity" in str(e.value)
    assert "--lpips-weights" in str(e.value)


# ---------------------------------------------------------------- LPIPS (random weights)

def save_lpips_files(folder: Path, net: str = "alex", seed: int = 0) -> tuple[Path, Path, LPIPS]:
    """Random LPIPS weights in the published layouts: torchvision backbone (with its classifier) + lpips heads."""
    torch.manual_seed(seed)
    src = LPIPS(net=net, load=False, device="cpu")
    with torch.no_grad():
        for lin in src.lins:
            lin.weight.copy_(torch.rand_like(lin.weight))          # heads are non-negative in the real file
    backbone = {f"features.{k}": v for k, v in src.features.state_dict().items()}
    backbone["classifier.1.weight"] = torch.zeros(8, 4)             # torchvision keeps the classifier; ignored
    heads = {f"lin{k}.model.1.weight": lin.weight.detach().clone() for k, lin in enumerate(src.lins)}
    folder.mkdir(parents=True, exist_ok=True)
    b, h = folder / ("alexnet-owt-7be5be79.pth" if net == "alex" else "vgg16-397923af.pth"), folder / f"lpips_{net}.pth"
    torch.save(backbone, b)
    torch.save(heads, h)
    return b, h, src


@pytest.fixture(scope="module")
def lpips_alex(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lpips")
    b, h, src = save_lpips_files(folder)
    return LPIPS(h, b, net="alex", device="cpu"), src, folder


def ref_lpips(model: LPIPS, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The LPIPS formula written out in float64 from the layers of `model`."""
    feats = model.features.double()
    shift, scale = torch.tensor([-.030, -.088, -.188]).double(), torch.tensor([.458, .448, .450]).double()
    taps = {"alex": (1, 4, 7, 9, 11), "vgg": (3, 8, 15, 22, 29)}[model.net_name]   # index of each tapped ReLU
    hx, hy = (x.double() - shift.view(1, 3, 1, 1)) / scale.view(1, 3, 1, 1), (y.double() - shift.view(1, 3, 1, 1)) / scale.view(1, 3, 1, 1)
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    k = 0
    for i, layer in enumerate(feats):
        hx, hy = layer(hx), layer(hy)
        if i in taps:
            nx = hx / (hx.norm(dim=1, keepdim=True) + 1e-10)
            ny = hy / (hy.norm(dim=1, keepdim=True) + 1e-10)
            w = model.lins[k].weight.double().view(1, -1, 1, 1)
            total += ((nx - ny) ** 2 * w).sum(1).mean(dim=(1, 2))
            k += 1
    model.features.float()
    return total


def test_lpips_identity_symmetry_and_reference(lpips_alex):
    lp, src, _ = lpips_alex
    torch.manual_seed(1)
    x, y = torch.rand(3, 3, 64, 64) * 2 - 1, torch.rand(3, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        assert torch.equal(lp(x, x), torch.zeros(3))
        dxy, dyx = lp(x, y), lp(y, x)
    assert torch.allclose(dxy, dyx, rtol=1e-6) and (dxy > 0).all()
    assert torch.allclose(dxy.double(), ref_lpips(lp, x, y), rtol=1e-4)
    with torch.no_grad():
        assert torch.equal(src(x, y), dxy)                   # loaded by key name == the module that was saved
    u8 = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    assert torch.allclose(lp.distance(u8, u8), torch.zeros(3))
    assert lp.distance(u8, ((y + 1) * 127.5).round().to(torch.uint8)).shape == (3,)


def test_lpips_vgg_and_key_layouts(tmp_path):
    b, h, src = save_lpips_files(tmp_path / "vgg", net="vgg")
    lp = LPIPS(h, b, net="vgg", device="cpu")
    torch.manual_seed(2)
    x, y = torch.rand(2, 3, 32, 32) * 2 - 1, torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        d = lp(x, y)
    assert d.shape == (2,) and torch.allclose(d.double(), ref_lpips(lp, x, y), rtol=1e-4)
    # heads saved without dropout (lin0.model.0.weight) and as safetensors load the same
    from safetensors.torch import save_file

    heads = torch.load(h, weights_only=True)
    save_file({k.replace("model.1", "model.0"): v for k, v in heads.items()}, str(tmp_path / "heads.safetensors"))
    with torch.no_grad():
        assert torch.equal(LPIPS(tmp_path / "heads.safetensors", b, net="vgg", device="cpu")(x, y), d)
    torch.save({k: v for k, v in heads.items() if not k.startswith("lin4")}, tmp_path / "short.pth")
    with pytest.raises(ModelLoadError, match="lin4.weight"):
        LPIPS(tmp_path / "short.pth", b, net="vgg")
    with pytest.raises(InputError, match="alex' or 'vgg"):
        LPIPS(net="squeeze", load=False)


def test_lpips_diversity_and_paired(lpips_alex, tmp_path):
    lp, _, _ = lpips_alex
    rng = np.random.default_rng(8)
    same = ArraySource(np.repeat(rng.integers(0, 256, (1, 3, 48, 48), dtype=np.uint8), 6, axis=0))
    assert lpips_diversity(same, lp, progress=False).mean == pytest.approx(0, abs=1e-6)
    varied = ArraySource(rng.integers(0, 256, (6, 3, 48, 48), dtype=np.uint8))
    div = lpips_diversity(varied, lp, num_pairs=5, progress=False)
    assert div.mean > 0.01
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    imgs = rng.integers(0, 256, (3, 48, 48, 3), dtype=np.uint8)
    for i, im in enumerate(imgs):
        Image.fromarray(im).save(tmp_path / "a" / f"{i}.png")
        Image.fromarray(im if i != 1 else 255 - im).save(tmp_path / "b" / f"{i}.png")
    (mean, std), per = lpips_paired(FolderSource(tmp_path / "a"), FolderSource(tmp_path / "b"), lp, progress=False)
    assert per[0] == pytest.approx(0, abs=1e-6) and per[2] == pytest.approx(0, abs=1e-6) and per[1] > 0.01
    assert mean == pytest.approx(per.mean())
    (tmp_path / "b" / "2.png").rename(tmp_path / "b" / "9.png")
    with pytest.raises(InputError, match="same file names"):
        lpips_paired(FolderSource(tmp_path / "a"), FolderSource(tmp_path / "b"), lp, progress=False)


# ---------------------------------------------------------------- image sources

def test_sources_read_folders_arrays_and_samplers(tmp_path):
    rng = np.random.default_rng(9)
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    rgb = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "imgs" / "a.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "imgs" / "b.png")                      # grayscale
    Image.fromarray(np.dstack([rgb, np.full((16, 16), 7, np.uint8)])).save(tmp_path / "imgs" / "sub" / "c.png")
    Image.fromarray(rgb[:8]).save(tmp_path / "imgs" / "sub" / "d.jpg")                  # another size
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    src = open_source(tmp_path / "imgs")
    assert len(src) == 4 and src.keys() == ["a", "b", "sub/c", "sub/d"]
    batches = list(src.batches(8))
    assert [b.shape for b in batches] == [(3, 3, 16, 16), (1, 3, 8, 16)]                # a batch never mixes sizes
    assert np.array_equal(batches[0][0], rgb.transpose(2, 0, 1))
    assert np.array_equal(batches[0][1], np.repeat(rgb[None, ..., 0], 3, 0))
    assert np.array_equal(batches[0][2], rgb.transpose(2, 0, 1))                        # alpha dropped
    fp = src.fingerprint()
    os.utime(tmp_path / "imgs" / "a.png", ns=(1, 1))
    assert open_source(tmp_path / "imgs").fingerprint() != fp

    nhwc = rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", nhwc)
    np.savez(tmp_path / "x.npz", arr_0=nhwc.transpose(0, 3, 1, 2))
    for path in ("x.npy", "x.npz"):
        got = np.concatenate(list(open_source(tmp_path / path).batches(2)))
        assert np.array_equal(got, nhwc.transpose(0, 3, 1, 2)), path
    floats = rng.uniform(-1.2, 1.2, (4, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "f.npy", floats)
    want = np.clip(np.floor(floats * 127.5 + 128), 0, 255).astype(np.uint8)             # NVlabs rounding
    assert np.array_equal(next(open_source(tmp_path / "f.npy").batches(8)), want)
    assert np.array_equal(quantize(np.array([0.0, 0.5, 1.0]), (0.0, 1.0)), [0, 128, 255])

    calls = []

    def sample(n):
        calls.append(n)
        return torch.rand(n + 1, 3, 8, 8) * 2 - 1                 # one too many: dropped
    gen = open_source(sample, num=7)
    assert isinstance(gen, GeneratorSource) and sum(b.shape[0] for b in gen.batches(3)) == 7 and calls == [3, 3, 1]
    assert len(gen.materialize(4)) == 7

    with pytest.raises(InputError, match="does not exist"):
        open_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no images"):
        open_source(tmp_path / "empty")
    with pytest.raises(InputError, match="needs the number"):
        open_source(sample)
    np.save(tmp_path / "bad.npy", np.zeros((2, 5, 5, 5), np.uint8))
    with pytest.raises(InputError, match="channel axis"):
        open_source(tmp_path / "bad.npy")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"not a png")
    with pytest.raises(InputError, match="not a readable image"):
        list(open_source(tmp_path / "broken").batches(1))
    with pytest.raises(InputError, match="same number"):
        paired(ArraySource(nhwc), ArraySource(nhwc[:2]))


def test_parse_metrics():
    assert parse_metrics("fid, KID,isc,lpips_diversity,drift") == ["fid", "kid", "is", "lpips", "lpips_paired"]
    with pytest.raises(InputError, match="unknown metric 'psnr'"):
        parse_metrics("fid,psnr")


# ---------------------------------------------------------------- compute_metrics end to end (random weights)

def write_pngs(folder: Path, images: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray(im.transpose(1, 2, 0)).save(folder / f"{i:03d}.png")
    return folder


@pytest.mark.slow
def test_compute_metrics_end_to_end_with_cache(inception, lpips_alex, tmp_path):
    _, _, lpips_folder = lpips_alex
    rng = np.random.default_rng(10)
    real = write_pngs(tmp_path / "real", rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8))
    fake = rng.uniform(-1, 1, (3, 3, 32, 32)).astype(np.float32)          # generator range
    np.save(tmp_path / "fake.npy", fake)
    cache = tmp_path / "cache"
    res = compute_metrics(real, tmp_path / "fake.npy", "fid,kid,is,lpips,lpips_paired", inception=inception,
                          lpips_weights=lpips_folder, cache_dir=cache, progress=False, kid_subsets=5)
    assert res["n_real"] == 3 and res["n_fake"] == 3
    assert res["fid"] > 0 and np.isfinite(res["kid_mean"]) and res["is_mean"] >= 1.0
    assert res["lpips_diversity"] > 0 and res["lpips_paired"] > 0
    assert res["settings"]["kid_subset_size"] == 3 and res["settings"]["is_splits"] == 1
    assert any("biased" in n for n in res["notes"]) and not res["real_stats"]["cache_hit"]
    cached = FeatureStats.load(res["real_stats"]["cache"])
    assert cached.features.shape == (3, POOL_DIM) and cached.sigma.shape == (POOL_DIM, POOL_DIM)
    # the reported numbers are the maths applied to the network's features
    fake_pool, fake_logits = inception.features(next(open_source(tmp_path / "fake.npy").batches(3)))
    assert res["fid"] == pytest.approx(fid_from_features(cached.features, fake_pool), rel=1e-9)
    assert res["is_mean"] == pytest.approx(inception_score(fake_logits, splits=1).mean, rel=1e-9)
    # second run: real statistics from the cache; the real set against itself has FID 0
    again = compute_metrics(real, real, ["fid"], inception=inception, cache_dir=cache, progress=False)
    assert again["real_stats"]["cache_hit"] and abs(again["fid"]) < 1e-6
    # a stats file stands for the real set (FID only needs mu and sigma)
    FeatureStats(cached.mu, cached.sigma, cached.n).save(tmp_path / "stats.npz", with_features=False)
    from_stats = compute_metrics(tmp_path / "stats.npz", tmp_path / "fake.npy", ["fid"],
                                 inception=inception, progress=False)
    assert from_stats["fid"] == pytest.approx(res["fid"], rel=1e-6)
    with pytest.raises(InputError, match="KID needs the real set's features"):
        compute_metrics(tmp_path / "stats.npz", tmp_path / "fake.npy", ["kid"], inception=inception, progress=False)
    with pytest.raises(InputError, match="compare against real images"):
        compute_metrics(None, tmp_path / "fake.npy", ["fid"], inception=inception)


# ---------------------------------------------------------------- CLI

def run_cli(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run([sys.executable, "app.py", "eval", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=full_env)
    return p.returncode, p.stdout, p.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in stderr, stderr
    return lines[0]


def test_cli_is_registered():
    from cli.main import SUBCOMMANDS

    assert "eval" in SUBCOMMANDS


def test_cli_errors_are_one_clear_line(tmp_path):
    write_pngs(tmp_path / "imgs", np.zeros((2, 3, 8, 8), np.uint8))
    env = {ENV_VAR: str(tmp_path / "none"), "ATELIER_CACHE_DIR": str(tmp_path / "cache"),
           "TORCH_HOME": str(tmp_path / "torch")}
    rc, _, se = run_cli("--real", tmp_path / "imgs", "--fake", tmp_path / "imgs", "--metrics", "fid", "--quiet", env=env)
    line = one_error_line(se)
    assert rc == 2 and "--inception-weights" in line and "pt_inception-2015-12-05-6726825d.pth" in line
    rc, _, se = run_cli("--fake", tmp_path / "imgs", "--metrics", "fid,sharpness", env=env)
    assert rc == 2 and "unknown metric 'sharpness'" in one_error_line(se)
    rc, _, se = run_cli("--real", tmp_path / "imgs", "--metrics", "fid", env=env)
    assert rc == 2 and "--fake" in one_error_line(se)


@pytest.mark.slow
def test_cli_samples_a_model_and_writes_json(testdata, inception_file, lpips_alex, tmp_path):
    _, _, lpips_folder = lpips_alex
    real = write_pngs(tmp_path / "real", np.random.default_rng(11).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8))
    out = tmp_path / "m.json"
    rc, so, se = run_cli("--real", real, "--model", testdata / "stylegan" / "sg2_uncond_32.pkl", "--num", 3,
                         "--metrics", "fid,kid,is,lpips", "--inception-weights", inception_file.parent,
                         "--lpips-weights", lpips_folder, "--device", "cpu", "--kid-subsets", 3,
                         "--cache-dir", tmp_path / "cache", "--save-real-stats", tmp_path / "real_stats.npz",
                         "--out", out, "--quiet")
    assert rc == 0, se
    summary = json.loads(so.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["n_fake"] == 3 and summary["n_real"] == 2 and summary["fake"]["seeds"] == [0, 2]
    for key in ("fid", "kid_mean", "kid_std", "is_mean", "is_std", "lpips_diversity"):
        assert isinstance(summary[key], float) and np.isfinite(summary[key]), key
    assert summary["is_mean"] >= 1.0 and summary["lpips_diversity"] > 0
    stats = FeatureStats.load(tmp_path / "real_stats.npz")
    assert stats.n == 2 and stats.features.shape == (2, POOL_DIM)


# ---------------------------------------------------------------- GPU (run by the lead on the GPU machine)

@pytest.mark.gpu
def test_gpu_features_are_fp32_under_a_callers_autocast(inception_file, lpips_alex):
    cpu = InceptionFeatures(inception_file, device="cpu", progress=False)
    gpu = InceptionFeatures(inception_file, device="cuda", progress=False)
    u8 = np.random.default_rng(12).integers(0, 256, (4, 3, 64, 64), dtype=np.uint8)
    want_pool, want_logits = cpu.features(u8)
    torch.backends.cudnn.allow_tf32 = True
    with torch.autocast("cuda", dtype=torch.float16):               # a trainer evaluating inside its AMP context
        pool, logits = gpu.features(u8)
    assert torch.backends.cudnn.allow_tf32                           # the caller's setting is restored
    assert pool.dtype == np.float32
    assert np.allclose(pool, want_pool, rtol=1e-4, atol=1e-4) and np.allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    lp_cpu, _, folder = lpips_alex
    lp = LPIPS(folder, device="cuda")
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    y = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.autocast("cuda", dtype=torch.float16):
        d = lp.distance(x, y)
    assert torch.allclose(d, lp_cpu.distance(x, y), rtol=1e-4, atol=1e-6)
