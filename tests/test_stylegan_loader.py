"""models.stylegan: loading NVlabs pickles, our safetensors + JSON format, weights-only .pt; conversion."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from core.errors import ModelLoadError, UnsafeModelError
from models import stylegan2
from models.stylegan import FORMAT, convert_pickle, load_generator, load_snapshot, save_generator

TESTDATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata"
SG2 = ["sg2_uncond_32", "sg2_cond4_64_fp16"]
SG3 = ["sg3t_uncond_32", "sg3r_uncond_32"]
HAVE_SG3 = importlib.util.find_spec("models.stylegan3") is not None
needs_sg3 = pytest.mark.skipif(not HAVE_SG3, reason="models/stylegan3.py is not there yet (StyleGAN3 is written separately)")


def pickle_path(name: str) -> Path:
    return TESTDATA / "stylegan" / f"{name}.pkl"


def reference_cases(names, first_only: bool = False):
    cases = []
    for name in names:
        path = TESTDATA / "stylegan" / f"{name}_ref.npz"
        keys = sorted(np.load(path).files) if path.is_file() else ["missing"]
        cases += [(name, k) for k in (keys[:1] if first_only else keys)]
    return cases


def reference_inputs(G, key: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """z, c and psi of a reference key 'seed<S>_psi<P>' (the testdata README's recipe)."""
    seed_part, psi_part = key.split("_psi")
    seed = int(seed_part.removeprefix("seed"))
    z = torch.from_numpy(np.random.RandomState(seed).randn(1, G.z_dim).astype(np.float32))
    c = torch.zeros([1, G.c_dim])
    if G.c_dim:
        c[0, seed % G.c_dim] = 1
    return z, c, float(psi_part)


def generate(G, key: str) -> torch.Tensor:
    z, c, psi = reference_inputs(G, key)
    with torch.no_grad():
        return G(z, c, truncation_psi=psi, truncation_cutoff=None, noise_mode="const")


def sample(G, n: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, G.z_dim, generator=g)
    c = torch.eye(G.c_dim)[torch.arange(n) % G.c_dim] if G.c_dim else torch.zeros(n, 0)
    with torch.no_grad():
        return G(z, c, noise_mode="const")


def assert_close_to_reference(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    max_abs = np.abs(out - ref).max()
    assert out.shape == ref.shape and rel < 1e-4 and max_abs < 1e-3, f"{what}: rel {rel:.3g}, max abs {max_abs:.3g}"


@pytest.fixture
def no_pickle(monkeypatch):
    """Make every pickle entry point and torch.load explode while the block runs."""
    def boom(*args, **kwargs):
        raise AssertionError("pickle/torch.load was called while loading our safetensors format")

    class Refused(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            boom()

    for mod in (pickle, sys.modules.get("_pickle")):
        if mod is None:
            continue
        monkeypatch.setattr(mod, "Unpickler", Refused, raising=False)
        monkeypatch.setattr(mod, "load", boom, raising=False)
        monkeypatch.setattr(mod, "loads", boom, raising=False)
    monkeypatch.setattr(torch, "load", boom)
    import models.nvlabs_pickle as nv

    monkeypatch.setattr(nv, "load_pickle_bytes", boom)
    monkeypatch.setattr(nv._RestrictedUnpickler, "load", boom)


# ---------------------------------------------------------------------------------------------
# NVlabs pickles


@pytest.mark.parametrize("name,key", reference_cases(SG2))
def test_load_generator_reproduces_stylegan2_references(testdata, name, key):
    loaded = load_generator(testdata / "stylegan" / f"{name}.pkl")
    refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
    assert_close_to_reference(generate(loaded.G, key)[0].numpy(), refs[key], f"{name} {key}")


# One reference per StyleGAN3 pickle here (through the loader); tests/test_stylegan3.py checks them all.
@needs_sg3
@pytest.mark.parametrize("name,key", reference_cases(SG3, first_only=True))
def test_load_generator_reproduces_stylegan3_references(testdata, name, key):
    loaded = load_generator(testdata / "stylegan" / f"{name}.pkl")
    assert loaded.arch == "stylegan3"
    refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
    assert_close_to_reference(generate(loaded.G, key)[0].numpy(), refs[key], f"{name} {key}")


def test_loaded_generator_fields(testdata):
    path = testdata / "stylegan" / "sg2_cond4_64_fp16.pkl"
    loaded = load_generator(path)
    assert loaded.arch == "stylegan2"
    assert isinstance(loaded.G, stylegan2.Generator)
    assert not loaded.G.training
    assert not any(p.requires_grad for p in loaded.G.parameters())
    assert loaded.source == path
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert loaded.short_hash == loaded.sha256[:10]
    assert (loaded.c_dim, loaded.z_dim, loaded.resolution, loaded.num_ws) == (4, 64, 64, 10)
    assert loaded.metadata["img_channels"] == 3
    assert loaded.config["format"] == FORMAT and loaded.config["arch"] == "stylegan2"
    assert loaded.config["init_kwargs"]["num_fp16_res"] == 2
    json.dumps(loaded.config)  # the config is plain JSON


@pytest.mark.skipif(HAVE_SG3, reason="checks the message shown while models/stylegan3.py is missing")
def test_stylegan3_pickle_without_stylegan3_module_is_a_clear_error(testdata):
    with pytest.raises(ModelLoadError, match="StyleGAN3"):
        load_generator(testdata / "stylegan" / "sg3t_uncond_32.pkl")


def test_stylegan3_support_missing_gives_a_clear_error(testdata, monkeypatch):
    monkeypatch.setitem(sys.modules, "models.stylegan3", None)  # what an install without the file looks like
    with pytest.raises(ModelLoadError, match="StyleGAN3 support"):
        load_generator(testdata / "stylegan" / "sg3t_uncond_32.pkl")


def test_load_snapshot_returns_trainable_networks(testdata):
    snap = load_snapshot(testdata / "stylegan" / "sg2_cond4_64_fp16.pkl")
    assert isinstance(snap.G, stylegan2.Generator) and isinstance(snap.G_ema, stylegan2.Generator)
    assert isinstance(snap.D, stylegan2.Discriminator)
    assert snap.G.training and all(p.requires_grad for p in snap.G.parameters())
    assert snap.D.training and all(p.requires_grad for p in snap.D.parameters())
    assert not snap.G_ema.training and not any(p.requires_grad for p in snap.G_ema.parameters())
    assert snap.arch == "stylegan2" and snap.training_set_kwargs.get("use_labels") is True
    # Separate modules: training G must not move G_ema's weights.
    assert snap.G.mapping.fc0.weight.data_ptr() != snap.G_ema.mapping.fc0.weight.data_ptr()
    img = snap.G_ema(torch.randn(2, 64), torch.eye(4)[:2])
    score = snap.D(img, torch.eye(4)[:2])
    assert score.shape == (2, 1) and torch.isfinite(score).all()
    json.dumps(snap.G_kwargs)
    json.dumps(snap.D_kwargs)


@needs_sg3
def test_load_snapshot_stylegan3_uses_the_stylegan2_discriminator(testdata):
    snap = load_snapshot(testdata / "stylegan" / "sg3r_uncond_32.pkl")
    assert snap.arch == "stylegan3" and isinstance(snap.D, stylegan2.Discriminator)


# ---------------------------------------------------------------------------------------------
# Our format


# StyleGAN3 networks take seconds to build on 2 CPU cores; one of them covers the StyleGAN3 path.
@pytest.mark.parametrize("name", SG2 + ["sg3r_uncond_32"])
def test_convert_then_load_is_bit_identical_without_pickle(testdata, tmp_path, name, request):
    if name in SG3 and not HAVE_SG3:
        pytest.skip("models/stylegan3.py is not there yet")
    original = load_generator(pickle_path(name))
    out = convert_pickle(pickle_path(name), tmp_path)
    assert out == tmp_path / f"{name}.safetensors" and out.is_file()
    config = json.loads((tmp_path / f"{name}.json").read_text())
    assert config["format"] == FORMAT and config["arch"] == original.arch
    assert config["metadata"]["source_sha256"] == original.sha256

    request.getfixturevalue("no_pickle")  # from here on, any pickle use fails the test
    converted = load_generator(out)
    assert converted.arch == original.arch
    assert converted.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    assert converted.G.state_dict().keys() == original.G.state_dict().keys()
    for k, v in original.G.state_dict().items():
        assert torch.equal(converted.G.state_dict()[k], v), k
    n = 1 if name in SG3 else 2   # StyleGAN3 is slow on 2 CPU cores
    assert torch.equal(sample(converted.G, n), sample(original.G, n))
    if name in SG2:  # the .json path names the same model
        by_json = load_generator(tmp_path / f"{name}.json")
        assert by_json.sha256 == converted.sha256 and by_json.source == out


def test_no_pickle_fixture_really_blocks_pickle(testdata, no_pickle):
    with pytest.raises(AssertionError, match="pickle"):
        load_generator(pickle_path("sg2_uncond_32"))


def test_fp16_conversion_for_shipping(testdata, tmp_path):
    full = convert_pickle(pickle_path("sg2_uncond_32"), tmp_path / "full")
    half = convert_pickle(pickle_path("sg2_uncond_32"), tmp_path / "half.safetensors", dtype="fp16")
    assert half.stat().st_size < 0.6 * full.stat().st_size
    assert json.loads(half.with_suffix(".json").read_text())["dtype"] == "float16"
    a, b = load_generator(full), load_generator(half)
    assert next(b.G.parameters()).dtype == torch.float32  # built in fp32 from fp16 weights
    x, y = sample(a.G), sample(b.G)
    assert (x - y).norm() / x.norm() < 1e-2


def test_safetensors_without_sidecar_uses_the_embedded_config(testdata, tmp_path):
    out = convert_pickle(pickle_path("sg2_cond4_64_fp16"), tmp_path, metadata={"description": "tiny test net"})
    out.with_suffix(".json").unlink()
    loaded = load_generator(out)
    assert loaded.metadata["description"] == "tiny test net"
    assert loaded.c_dim == 4


def test_save_generator_of_a_fresh_network(tmp_path):
    torch.manual_seed(0)
    G = stylegan2.Generator(z_dim=8, c_dim=0, w_dim=8, img_resolution=8, img_channels=1,
                            mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8,
                            architecture="resnet")
    path = save_generator(G, tmp_path / "fresh", "stylegan2", metadata={"license": "CC0"})
    assert path == tmp_path / "fresh.safetensors" and (tmp_path / "fresh.json").is_file()
    loaded = load_generator(path)
    assert loaded.metadata["license"] == "CC0" and loaded.metadata["img_channels"] == 1
    assert torch.equal(sample(loaded.G.eval()), sample(G.eval()))


def test_weights_only_checkpoint_with_sidecar(testdata, tmp_path):
    loaded = load_generator(pickle_path("sg2_uncond_32"))
    torch.save(loaded.G.state_dict(), tmp_path / "net.pt")
    (tmp_path / "net.json").write_text(json.dumps(loaded.config))
    again = load_generator(tmp_path / "net.pt")
    assert torch.equal(sample(again.G), sample(loaded.G))
    torch.save({"state_dict": loaded.G.state_dict()}, tmp_path / "wrapped.ckpt")
    (tmp_path / "wrapped.json").write_text(json.dumps(loaded.config))
    assert torch.equal(sample(load_generator(tmp_path / "wrapped.ckpt").G), sample(loaded.G))


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_generator(tmp_path / "nope.pkl")
    with pytest.raises(ModelLoadError, match="not found"):
        load_generator(tmp_path / "nope.safetensors")
    odd = tmp_path / "model.onnx"
    odd.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="unknown model file type"):
        load_generator(odd)


def test_pt_without_sidecar_or_with_wrong_content(testdata, tmp_path):
    loaded = load_generator(pickle_path("sg2_uncond_32"))
    torch.save(loaded.G.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(ModelLoadError, match=r"bare\.json"):
        load_generator(tmp_path / "bare.pt")
    (tmp_path / "list.json").write_text(json.dumps(loaded.config))
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="state dict"):
        load_generator(tmp_path / "list.pt")
    (tmp_path / "junk.json").write_text(json.dumps(loaded.config))
    (tmp_path / "junk.pt").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError):
        load_generator(tmp_path / "junk.pt")


def test_pt_that_asks_for_code_is_refused(testdata, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    loaded = load_generator(pickle_path("sg2_uncond_32"))
    torch.save({"w": torch.zeros(1), "evil": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "evil.json").write_text(json.dumps(loaded.config))
    with pytest.raises(UnsafeModelError, match="refusing"):
        load_generator(tmp_path / "evil.pt")
    assert not marker.exists()


def test_bad_json_configs(testdata, tmp_path):
    out = convert_pickle(pickle_path("sg2_uncond_32"), tmp_path)
    side = out.with_suffix(".json")
    good = json.loads(side.read_text())

    side.write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the model config"):
        load_generator(out)
    side.write_text(json.dumps({**good, "format": "something-else/9"}))
    with pytest.raises(ModelLoadError, match="format"):
        load_generator(out)
    side.write_text(json.dumps({**good, "arch": "stylegan9"}))
    with pytest.raises(ModelLoadError, match="architecture"):
        load_generator(out)
    side.write_text(json.dumps({**good, "init_kwargs": {**good["init_kwargs"], "channel_max": 32}}))
    with pytest.raises(ModelLoadError, match="do not fit"):
        load_generator(out)
    side.write_text(json.dumps({**good, "init_kwargs": {**good["init_kwargs"], "wings": 2}}))
    with pytest.raises(ModelLoadError, match="cannot build"):
        load_generator(out)


def test_garbage_safetensors_and_missing_weights(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a valid safetensors"):
        load_generator(bad)
    (tmp_path / "alone.json").write_text(json.dumps({"format": FORMAT, "arch": "stylegan2", "init_kwargs": {}}))
    with pytest.raises(ModelLoadError, match="weights file"):
        load_generator(tmp_path / "alone.json")


def test_nan_weights_are_refused(testdata, tmp_path):
    out = convert_pickle(pickle_path("sg2_uncond_32"), tmp_path)
    G = load_generator(out).G
    state = {k: v.clone() for k, v in G.state_dict().items()}
    state["synthesis.b8.conv0.weight"][0, 0, 0, 0] = float("nan")
    state["mapping.w_avg"][3] = float("inf")
    save_file(state, str(out))
    with pytest.raises(ModelLoadError, match=r"NaN or Inf.*(synthesis\.b8\.conv0\.weight|mapping\.w_avg)"):
        load_generator(out)


def test_pickle_without_a_generator(tmp_path):
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"G_ema": [1, 2, 3]}))
    with pytest.raises(ModelLoadError, match="no StyleGAN network"):
        load_generator(plain)
