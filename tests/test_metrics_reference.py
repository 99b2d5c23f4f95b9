"""Atelier's FID Inception and LPIPS against the implementations people publish with, on the CPU.

One weight file (random values, the published layout, written to disk) is loaded into Atelier's network
and into the reference; the same images go through both; the numbers must agree:

- Inception features, "tf" input: torch-fidelity 0.4.0's FeatureExtractorInceptionV3 (what torchmetrics
  runs too); FID, KID and IS from those features against torch-fidelity's own metric functions;
- "pytorch-fid" input: the input code of pytorch-fid 0.3.0's InceptionV3.forward;
- "clean" input: clean-fid 0.1.35's resizer and the normalisation in its InceptionV3W.forward;
- "torchmetrics" input: the input code of torchmetrics 1.9.0's NoTrainInceptionV3 (antialias=True, its default);
- LPIPS: the lpips 0.1.4 package, with the published heads that ship in its wheel.

Images are tiny and few (the Inception costs ~0.5-2 s per image on a loaded 2-core CPU).
"""
import types

import numpy as np
import pytest
import torch

from evaluation.inception import INPUT_MODES, INPUT_SIZE, InceptionFeatures, preprocess, resize_bilinear_tf1
from evaluation.lpips import LPIPS
from evaluation.scores import KID_SEED, fid_from_features, inception_score, kid_from_features
from evaluation.weights import ENV_VAR, LPIPS_ALEX, LPIPS_VGG, file_digest, packaged_dirs
from tests.metrics_reference import _alexnet_features, _vgg16_features, references, torchmetrics_references
from tests.metrics_weights import save_inception_file

FEATURE_RTOL = 1e-4      # fp32 through ~95 layers, two implementations of the same ops
FID_REL = 1e-3           # issue 14's bar for FID; KID and IS are held to the same


@pytest.fixture(scope="module")
def inception_pair(tmp_path_factory):
    """A random FID Inception file under torch-fidelity's name, loaded into both networks."""
    path = save_inception_file(tmp_path_factory.mktemp("fid") / "weights-inception-2015-12-05-6726825d.pth")
    reference = references().FeatureExtractorInceptionV3(
        "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(path))
    ours = InceptionFeatures(path, device="cpu", progress=False, batch_size=4)
    return ours, reference


@pytest.fixture(scope="module")
def image_sets():
    """Two small sets unlike each other: smooth gradients and noise (32x32, upsampled to 299 by both)."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    real = np.stack([np.stack([xx * rng.uniform(100, 255), yy * rng.uniform(100, 255),
                               (1 - xx) * rng.uniform(0, 255)]) for _ in range(4)]).astype(np.uint8)
    fake = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    return real, fake


@pytest.fixture(scope="module")
def features(inception_pair, image_sets):
    ours, reference = inception_pair
    out = {}
    for name, images in zip(("real", "fake"), image_sets):
        with torch.no_grad():
            ref_pool, ref_logits = reference(torch.from_numpy(images))
        out[name] = (ours.features(images), (ref_pool.numpy(), ref_logits.numpy()))
    return out


def test_tf_resize_equals_torch_fidelitys_tensorflow_compatible_resize():
    tf_resize = references().fidelity_tf_resize
    torch.manual_seed(0)
    for h, w in ((32, 32), (40, 64), (299, 299), (320, 304), (512, 480)):
        x = torch.randint(0, 256, (2, 3, h, w)).float()
        want = tf_resize(x, size=(INPUT_SIZE, INPUT_SIZE), align_corners=False)
        got = resize_bilinear_tf1(x, INPUT_SIZE)
        assert torch.allclose(got, want, rtol=0, atol=1e-3), (h, w)       # pixel values 0..255
    # and it is not torch's bilinear: TF 1.x has no half-pixel offset
    x = torch.randint(0, 256, (1, 3, 64, 64)).float()
    torch_bilinear = torch.nn.functional.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear",
                                                     align_corners=False)
    assert (resize_bilinear_tf1(x, INPUT_SIZE) - torch_bilinear).abs().max() > 1


def test_inception_features_equal_torch_fidelitys(features):
    for name, ((pool, logits), (ref_pool, ref_logits)) in features.items():
        assert pool.std() > 1e-2, name                               # order-one features: a working network
        assert np.allclose(pool, ref_pool, rtol=FEATURE_RTOL, atol=FEATURE_RTOL * np.abs(ref_pool).max()), name
        assert np.allclose(logits, ref_logits, rtol=FEATURE_RTOL, atol=FEATURE_RTOL * np.abs(ref_logits).max()), name


def test_fid_kid_is_from_these_features_equal_torch_fidelitys(features):
    R = references()
    (real_pool, _), (ref_real_pool, _) = features["real"]
    (fake_pool, fake_logits), (ref_fake_pool, ref_fake_logits) = features["fake"]
    to_stats = lambda f: {"mu": f.mean(0), "sigma": np.cov(f, rowvar=False)}      # noqa: E731 torch-fidelity's
    ref_fid = R.fidelity_fid(to_stats(ref_real_pool), to_stats(ref_fake_pool), verbose=False)
    fid = fid_from_features(real_pool, fake_pool)
    assert fid > 1 and fid == pytest.approx(ref_fid["frechet_inception_distance"], rel=FID_REL)

    kid = kid_from_features(real_pool, fake_pool, subsets=10, subset_size=3)
    ref_kid = R.fidelity_kid(torch.from_numpy(ref_real_pool), torch.from_numpy(ref_fake_pool), kid_subsets=10,
                             kid_subset_size=3, rng_seed=KID_SEED, verbose=False)
    assert kid.mean > 0 and kid.mean == pytest.approx(ref_kid["kernel_inception_distance_mean"], rel=FID_REL)
    assert kid.std == pytest.approx(ref_kid["kernel_inception_distance_std"], rel=FID_REL)

    isc = inception_score(fake_logits, splits=2)
    ref_isc = R.fidelity_isc(torch.from_numpy(ref_fake_logits), splits=2, shuffle=True, rng_seed=2020)
    # random weights give an IS just above 1: hold the part above 1 to the tolerance, not the 1
    assert isc.mean > 1 and isc.mean - 1 == pytest.approx(ref_isc["inception_score_mean"] - 1, rel=FID_REL)
    assert isc.std == pytest.approx(ref_isc["inception_score_std"], rel=FID_REL, abs=1e-6)


def test_pytorch_fid_input_path_is_pytorch_fids():
    """pytorch-fid's own InceptionV3.forward, run with an identity in place of its network blocks, shows
    what its network receives; ours must receive the same. pytorch-fid reads images with ToTensor (u8 / 255)."""
    u8 = torch.randint(0, 256, (2, 3, 40, 56), dtype=torch.uint8)
    stand_in = types.SimpleNamespace(resize_input=True, normalize_input=True, blocks=[torch.nn.Identity()],
                                     output_blocks=[0], last_needed_block=0)
    want = references().PytorchFidInceptionV3.forward(stand_in, u8.float() / 255)[0]
    got = preprocess(u8.float(), "pytorch-fid")
    assert got.shape == (2, 3, INPUT_SIZE, INPUT_SIZE) and torch.allclose(got, want, rtol=0, atol=1e-6)


def test_clean_input_path_is_clean_fids():
    """clean-fid's mode "clean": its resizer on each HWC uint8 image, then its InceptionV3W.forward, run with
    a recorder in place of the TorchScript layers, shows what its network receives."""
    R = references()
    rng = np.random.default_rng(1)
    resize = R.cleanfid_make_resizer("PIL", False, "bicubic", (INPUT_SIZE, INPUT_SIZE))
    for h, w in ((32, 32), (330, 310)):                               # clean-fid's point: antialiased downscaling
        u8 = rng.integers(0, 256, (2, 3, h, w), dtype=np.uint8)
        batch = torch.from_numpy(np.stack([resize(im.transpose(1, 2, 0)).transpose(2, 0, 1) for im in u8]))
        seen = []
        recorder = types.SimpleNamespace(forward=lambda x: seen.append(x) or torch.zeros(x.shape[0], 2048))
        stand_in = types.SimpleNamespace(resize_inside=False, layers=recorder)
        R.CleanFidInceptionV3W.forward(stand_in, batch)
        got = preprocess(torch.from_numpy(u8).float(), "clean")
        assert torch.allclose(got, seen[0], rtol=0, atol=1e-5), (h, w)


class _Received(Exception):
    pass


def test_torchmetrics_input_path_is_torchmetrics():
    """torchmetrics' own forward (its default antialias=True, and antialias=False), run with a recorder as
    its first convolution, shows what its network receives: ours must receive the same."""
    TM = torchmetrics_references()
    u8 = torch.randint(0, 256, (2, 3, 330, 310), dtype=torch.uint8)     # downscaling: antialiasing matters
    for antialias, mode in ((True, "torchmetrics"), (False, "tf")):
        seen = []

        def first_conv(x):
            seen.append(x)
            raise _Received

        stand_in = types.SimpleNamespace(features_list=["2048"], use_antialias=antialias, INPUT_IMAGE_SIZE=INPUT_SIZE,
                                         Conv2d_1a_3x3=first_conv)
        with pytest.raises(_Received):
            TM.NoTrainInceptionV3._torch_fidelity_forward(stand_in, u8)
        got = preprocess(u8.float(), mode)
        assert torch.allclose(got, seen[0], rtol=0, atol=1e-5), mode
    assert (preprocess(u8.float(), "torchmetrics") - preprocess(u8.float(), "tf")).abs().max() > 0.05


def test_input_modes_are_part_of_the_feature_identity(inception_pair):
    ours, _ = inception_pair
    identities = {InceptionFeatures(ours.weights_path, device="cpu", progress=False, input_mode=m).identity
                  for m in INPUT_MODES}
    assert len(identities) == len(INPUT_MODES) and all(file_digest(ours.weights_path) in i for i in identities)
    assert ours.input_mode == "tf" and ours.weights["published"] is False


# ---------------------------------------------------------------- LPIPS

def random_torchvision_backbone(path, net: str, seed: int):
    """A random ImageNet backbone file as torchvision saves it (`features.N.*`), built from torchvision's layout."""
    torch.manual_seed(seed)
    features = _alexnet_features() if net == "alex" else _vgg16_features()
    torch.save({f"features.{k}": v for k, v in features.state_dict().items()}, path)
    return path


def reference_lpips(net: str, heads, backbone):
    """The lpips package's LPIPS with the given heads, its trunk loaded from the same backbone file."""
    ref = references().LPIPS(net=net, pnet_rand=True, model_path=str(heads), verbose=False)
    state = torch.load(backbone, weights_only=True)
    trunk = {k: state[f"features.{k.split('.', 1)[1]}"] for k in ref.net.state_dict()}   # sliceK.N.* <- features.N.*
    ref.net.load_state_dict(trunk)
    return ref.eval()


@pytest.mark.parametrize("net,spec,size", [("alex", LPIPS_ALEX, 64), ("vgg", LPIPS_VGG, 48)])
def test_lpips_equals_the_lpips_package_with_the_published_heads(net, spec, size, tmp_path):
    heads = next(d / f"{net}.pth" for d in packaged_dirs(spec) if (d / f"{net}.pth").is_file())
    assert file_digest(heads) == spec.sha256                            # the published file, from the lpips wheel
    backbone = random_torchvision_backbone(tmp_path / "backbone.pth", net, seed=1)
    ours = LPIPS(heads, backbone, net=net, device="cpu")
    ref = reference_lpips(net, heads, backbone)
    assert ours.weights["lpips_heads"]["published"] and not ours.weights["lpips_backbone"]["published"]
    torch.manual_seed(2)
    x, y = torch.rand(3, 3, size, size) * 2 - 1, torch.rand(3, 3, size, size) * 2 - 1
    y[0] = x[0] + 0.05 * torch.randn_like(x[0])                         # one near pair, two far ones
    with torch.no_grad():
        want = ref(x, y).flatten()
        got = ours(x, y)
    assert (want > 0).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    # uint8 in, as the metric helpers feed it: the same as the package on u8 / 127.5 - 1
    u8x = ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    u8y = ((y + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    with torch.no_grad():
        want = ref(u8x.float() / 127.5 - 1, u8y.float() / 127.5 - 1).flatten()
    assert torch.allclose(ours.distance(u8x, u8y), want, rtol=1e-5, atol=1e-7)


def test_lpips_heads_are_found_in_an_installed_lpips_package(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(ENV_VAR, str(empty))
    monkeypatch.setenv("ATELIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    backbone = random_torchvision_backbone(tmp_path / "alexnet-owt-7be5be79.pth", "alex", seed=3)
    lp = LPIPS(backbone_weights=backbone, net="alex", device="cpu")
    assert lp.weights["lpips_heads"]["published"] and "lpips" in lp.weights["lpips_heads"]["path"]
