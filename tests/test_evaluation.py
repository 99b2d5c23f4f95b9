"""Quality metrics around the maths: the FID Inception and LPIPS modules (random weights: structure, key
mapping, strict and safe loading), image sources, compute_metrics with its cache, and the CLI.

Agreement with the published implementations is tested in test_metrics_reference.py (networks) and
test_metrics_stats.py (FID/KID/IS maths and closed forms).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image

from core.errors import InputError, ModelLoadError, OptionalDependencyError, UnsafeModelError
from evaluation import weights as metric_weights
from evaluation.inception import (INPUT_SIZE, NUM_LOGITS, POOL_DIM, FIDInceptionV3, InceptionFeatures, _tf_avg_pool3,
                                  preprocess, to_pixels)
from evaluation.lpips import LPIPS, lpips_diversity, lpips_paired
from evaluation.metrics import FeatureStats, compute_metrics, parse_metrics
from evaluation.scores import fid_from_features, inception_score, kid_from_features
from evaluation.sources import ArraySource, FolderSource, GeneratorSource, open_source, paired, quantize
from evaluation.weights import INCEPTION, ENV_VAR
from tests.metrics_weights import random_inception, save_inception_file, save_lpips_files

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- the FID Inception network (random weights)

@pytest.fixture(scope="module")
def inception_file(tmp_path_factory) -> Path:
    """A random-weight file under the published name, without BatchNorm step counters (a TF port's layout;
    test_metrics_reference.py uses one with them)."""
    return save_inception_file(tmp_path_factory.mktemp("weights") / INCEPTION.file_names[0], step_counters=False)


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


def test_inception_input_checks_and_modes():
    u8 = torch.randint(0, 256, (2, 3, 40, 48), dtype=torch.uint8)
    pixels = to_pixels(u8)
    assert torch.equal(pixels, u8.float()) and torch.allclose(to_pixels(u8.float() / 255), pixels, atol=1e-4)
    at299 = torch.rand(1, 3, INPUT_SIZE, INPUT_SIZE) * 255
    for mode in ("tf", "clean"):                                   # already 299: no resampling
        assert torch.allclose(preprocess(at299, mode), (at299 - 128) / 128, atol=1e-6), mode
    assert torch.allclose(preprocess(at299, "pytorch-fid"), at299 / 255 * 2 - 1, atol=1e-6)
    with pytest.raises(InputError, match="unknown Inception input mode"):
        preprocess(at299, "tf2")
    with pytest.raises(InputError, match=r"\[0, 1\]"):
        to_pixels(torch.rand(1, 3, 8, 8) * 2 - 1)                  # generator range: must be converted first
    with pytest.raises(InputError, match=r"\[N, 3, H, W\]"):
        to_pixels(np.zeros((1, 8, 8, 3), np.uint8))


def test_inception_loads_strictly_by_key_name_and_reports_the_file(inception, inception_file):
    reference = random_inception()
    for k, v in reference.state_dict().items():
        if not k.endswith("num_batches_tracked"):
            assert torch.equal(inception.net.state_dict()[k], v), k
    assert inception.weights["path"] == str(inception_file) and len(inception.weights["sha256"]) == 64
    assert inception.weights["published"] is False                  # random values: not the published file
    assert metric_weights.unpublished_note(inception.weights).startswith(str(inception_file))
    assert metric_weights.unpublished_note({**inception.weights, "published": True}) is None


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
    monkeypatch.setattr(metric_weights, "packaged_dirs", lambda spec: [])   # as if lpips were not installed
    with pytest.raises(OptionalDependencyError) as e:
        InceptionFeatures(device="cpu")
    msg = str(e.value)
    for needle in ("pt_inception-2015-12-05-6726825d.pth", "https://github.com/mseitzer/pytorch-fid/releases",
                   "--inception-weights", ENV_VAR, str(empty), INCEPTION.sha256):
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
    assert "--lpips-weights" in str(e.value) and "pip download lpips" in str(e.value)


# ---------------------------------------------------------------- LPIPS (random weights)

@pytest.fixture(scope="module")
def lpips_alex(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lpips")
    b, h, src = save_lpips_files(folder)
    return LPIPS(h, b, net="alex", device="cpu"), src, folder


def test_lpips_identity_symmetry_and_strict_load(lpips_alex):
    lp, src, _ = lpips_alex
    torch.manual_seed(1)
    x, y = torch.rand(3, 3, 64, 64) * 2 - 1, torch.rand(3, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        assert torch.equal(lp(x, x), torch.zeros(3))
        dxy, dyx = lp(x, y), lp(y, x)
    assert torch.allclose(dxy, dyx, rtol=1e-6) and (dxy > 0).all()
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
        assert d.shape == (2,) and torch.equal(src(x, y), d)
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
    import lzma

    with lzma.open(tmp_path / "x.npy.xz", "wb") as f:                                  # as assets/datasets ship
        np.save(f, nhwc)
    for path in ("x.npy", "x.npz", "x.npy.xz"):
        got = np.concatenate(list(open_source(tmp_path / path).batches(2)))
        assert np.array_equal(got, nhwc.transpose(0, 3, 1, 2)), path
    (tmp_path / "broken.npy.xz").write_bytes(b"not xz")
    with pytest.raises(InputError, match="xz-compressed"):
        open_source(tmp_path / "broken.npy.xz")
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
    assert res["kid_mean"] == pytest.approx(kid_from_features(cached.features, fake_pool, subsets=5, subset_size=3).mean,
                                            rel=1e-9)
    assert res["settings"]["inception_input"] == "tf" and set(res["weights"]) == {"inception", "lpips_backbone",
                                                                                 "lpips_heads"}
    assert any("not comparable with published ones" in n for n in res["notes"])      # random weights say so
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
    rc, _, se = run_cli("--real", tmp_path / "imgs", "--model", "emoji64", "--num", 2, "--metrics", "fid",
                        "--truncation-centre", "middle", env=env)
    assert rc == 2 and "truncation centre must be 'class'" in one_error_line(se)


@pytest.mark.slow
def test_cli_samples_a_model_and_writes_json(testdata, inception_file, lpips_alex, tmp_path):
    _, _, lpips_folder = lpips_alex
    real = write_pngs(tmp_path / "real", np.random.default_rng(11).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8))
    out = tmp_path / "m.json"
    rc, so, se = run_cli("--real", real, "--model", testdata / "stylegan" / "sg2_uncond_32.pkl", "--num", 3,
                         "--metrics", "fid,kid,is,lpips", "--inception-weights", inception_file.parent,
                         "--inception-input", "clean",
                         "--lpips-weights", lpips_folder, "--device", "cpu", "--kid-subsets", 3,
                         "--cache-dir", tmp_path / "cache", "--save-real-stats", tmp_path / "real_stats.npz",
                         "--out", out, "--quiet")
    assert rc == 0, se
    summary = json.loads(so.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["n_fake"] == 3 and summary["n_real"] == 2 and summary["fake"]["seeds"] == [0, 2]
    assert summary["fake"]["truncation_centre"] == "global"      # an unconditional model: always the global mean
    for key in ("fid", "kid_mean", "kid_std", "is_mean", "is_std", "lpips_diversity"):
        assert isinstance(summary[key], float) and np.isfinite(summary[key]), key
    assert summary["is_mean"] >= 1.0 and summary["lpips_diversity"] > 0
    assert summary["settings"]["inception_input"] == "clean" and summary["weights"]["inception"]["published"] is False
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
