"""StyleGAN3 (T and R): our plain-PyTorch generator against NVlabs' own outputs and structure."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.signal import convolve2d

from core.errors import InputError, ModelLoadError
from models import stylegan3
from models.nvlabs_pickle import read_network_pickle
from models.stylegan3 import Generator, filtered_lrelu, generator_from_record

PICKLES = ["sg3t_uncond_32", "sg3r_uncond_32"]


def _record(testdata, name):
    return read_network_pickle(testdata / "stylegan" / f"{name}.pkl")["G_ema"]


@pytest.fixture(scope="module", params=PICKLES)
def loaded(request, testdata):
    """(name, record, our generator loaded from it)."""
    rec = _record(testdata, request.param)
    return request.param, rec, generator_from_record(rec)


def _z(seed: int, z_dim: int) -> torch.Tensor:
    return torch.from_numpy(np.random.RandomState(seed).randn(1, z_dim).astype(np.float32))


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# --- NVlabs reference outputs -----------------------------------------------------------------

def test_reproduces_every_nvlabs_reference(loaded, testdata):
    name, _, G = loaded
    refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
    assert len(refs.files) >= 4
    for key in refs.files:
        seed = int(key.split("_")[0].removeprefix("seed"))
        psi = float(key.split("_psi")[1])
        with torch.no_grad():
            out = G(_z(seed, G.z_dim), None, truncation_psi=psi, truncation_cutoff=None, noise_mode="const")
        assert out.shape == (1, 3, 32, 32) and out.dtype == torch.float32
        out = out[0].numpy()
        ref = refs[key]
        assert _rel_err(out, ref) < 1e-4, f"{name} {key}: relative error {_rel_err(out, ref):.2e}"
        assert np.abs(out - ref).max() < 1e-3, f"{name} {key}"


def test_truncation_changes_the_image(loaded):
    # Guards the reference test against a generator that ignores psi or w_avg.
    _, _, G = loaded
    z = _z(0, G.z_dim)
    with torch.no_grad():
        a, b = G(z, None, truncation_psi=1.0), G(z, None, truncation_psi=0.7)
        ws = G.mapping(z, None, truncation_psi=0.5, truncation_cutoff=3)
        ws_full = G.mapping(z, None)
    assert _rel_err(a.numpy(), b.numpy()) > 1e-2
    # psi as a 0-d tensor (lets one compiled graph serve a psi slider) means the same.
    with torch.no_grad():
        torch.testing.assert_close(G(z, None, truncation_psi=torch.tensor(0.7)), b, rtol=0, atol=0)
    with pytest.raises(InputError, match="truncation_cutoff"):
        G.mapping(z, None, truncation_psi=0.5, truncation_cutoff=G.num_ws + 1)
    torch.testing.assert_close(ws[:, 3:], ws_full[:, 3:], rtol=0, atol=0)
    torch.testing.assert_close(ws[:, :3], G.mapping.w_avg.lerp(ws_full[:, :3], 0.5))


def test_batch_of_two_equals_two_single_calls(loaded):
    _, _, G = loaded
    z = torch.cat([_z(3, G.z_dim), _z(4, G.z_dim)])
    with torch.no_grad():
        both = G(z, None, truncation_psi=0.8)
        one = torch.cat([G(z[:1], None, truncation_psi=0.8), G(z[1:], None, truncation_psi=0.8)])
    assert both.shape == (2, 3, 32, 32)
    torch.testing.assert_close(both, one, rtol=1e-5, atol=1e-6)
    assert _rel_err(both[0].numpy(), both[1].numpy()) > 1e-2  # two different images


# --- Structure: a fresh network equals NVlabs' ---------------------------------------------------

_LAYER_ATTRS = ["is_torgb", "is_critically_sampled", "use_fp16", "in_channels", "out_channels",
                "in_sampling_rate", "out_sampling_rate", "tmp_sampling_rate", "in_cutoff", "out_cutoff",
                "in_half_width", "out_half_width", "conv_kernel", "up_factor", "up_taps", "down_factor",
                "down_taps", "down_radial", "padding", "magnitude_ema_beta"]


def test_fresh_network_has_nvlabs_layers_filters_and_paddings(loaded):
    name, rec, _ = loaded
    fresh = Generator(**rec.init_kwargs)
    syn_rec = rec.children["synthesis"]
    assert fresh.synthesis.layer_names == syn_rec.attributes["layer_names"]
    assert fresh.num_ws == rec.attributes["num_ws"] == syn_rec.attributes["num_ws"]

    saved = rec.state_dict()
    ours = fresh.state_dict()
    assert sorted(ours) == sorted(saved)
    for key, tensor in saved.items():
        assert tuple(ours[key].shape) == tuple(tensor.shape), key

    n_filters = 0
    for key in saved:
        if key.endswith(("up_filter", "down_filter")):
            torch.testing.assert_close(ours[key], saved[key], rtol=1e-6, atol=1e-7, msg=key)
            n_filters += 1
    assert n_filters == 2 * (len(fresh.synthesis.layer_names) - 1)  # ToRGB has none
    if name.startswith("sg3r"):
        assert any(saved[k].ndim == 2 for k in saved if k.endswith("down_filter"))  # radial filters present

    for layer_name in fresh.synthesis.layer_names:
        layer, layer_rec = getattr(fresh.synthesis, layer_name), syn_rec.children[layer_name].attributes
        for attr in _LAYER_ATTRS:
            want = layer_rec[attr]
            want = list(map(int, want)) if attr == "padding" else want
            assert getattr(layer, attr) == pytest.approx(want), f"{layer_name}.{attr}"
        assert [layer.in_size, layer.out_size] == [int(layer_rec["in_size"][0]), int(layer_rec["out_size"][0])]

    inp, inp_rec = fresh.synthesis.input, syn_rec.children["input"].attributes
    assert inp.size == int(inp_rec["size"][0])
    assert inp.sampling_rate == pytest.approx(float(inp_rec["sampling_rate"]))
    assert inp.bandwidth == pytest.approx(float(inp_rec["bandwidth"]))


def test_init_kwargs_roundtrip_through_json(loaded):
    _, rec, G = loaded
    kwargs = json.loads(json.dumps(G.init_kwargs))
    assert kwargs["img_resolution"] == 32 and kwargs["mapping_kwargs"] == {"num_layers": 2}
    rebuilt = Generator(**kwargs)
    rebuilt.load_state_dict(G.state_dict(), strict=True)
    rebuilt.eval()
    z = _z(7, G.z_dim)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(z), G(z), rtol=0, atol=0)
    assert stylegan3.ARCH == "stylegan3"
    for attr in ("z_dim", "c_dim", "w_dim", "img_resolution", "img_channels", "num_ws"):
        assert getattr(G, attr) == rec.attributes[attr]


# --- Loader errors ---------------------------------------------------------------------------

def test_stylegan2_record_is_refused_with_clear_error(testdata):
    rec = _record(testdata, "sg2_uncond_32")
    with pytest.raises(ModelLoadError, match="StyleGAN2"):
        generator_from_record(rec)


def test_non_generator_record_is_refused(testdata):
    rec = read_network_pickle(testdata / "stylegan" / "sg3t_uncond_32.pkl")["D"]
    with pytest.raises(ModelLoadError, match="G_ema"):
        generator_from_record(rec)


def test_tensor_mismatch_is_reported(testdata):
    rec = _record(testdata, "sg3t_uncond_32")
    del rec.children["mapping"].children["fc1"].parameters["weight"]
    rec.children["synthesis"].children["L0_36_64"].buffers["extra"] = torch.zeros(1)
    with pytest.raises(ModelLoadError, match=r"missing:? mapping\.fc1\.weight.*unexpected:? synthesis\.L0_36_64\.extra"):
        generator_from_record(rec)


def test_bad_settings_are_reported(testdata):
    rec = _record(testdata, "sg3t_uncond_32")
    rec.init_kwargs["not_a_setting"] = 1
    with pytest.raises(ModelLoadError, match="not_a_setting"):
        generator_from_record(rec)


# --- Shape asserts -----------------------------------------------------------------------------

def test_wrong_shapes_raise_input_error(loaded):
    _, _, G = loaded
    with pytest.raises(InputError, match="z has shape"):
        G(torch.zeros(1, G.z_dim + 1))
    with pytest.raises(InputError, match="z has shape"):
        G(torch.zeros(G.z_dim))
    with pytest.raises(InputError, match="ws has shape"):
        G.synthesis(torch.zeros(1, G.num_ws - 1, G.w_dim))
    with pytest.raises(InputError, match="noise_mode"):
        G(torch.zeros(1, G.z_dim), noise_mode="loud")
    layer = getattr(G.synthesis, G.synthesis.layer_names[0])
    with pytest.raises(InputError, match="SynthesisLayer input"):
        layer(torch.zeros(1, layer.in_channels, layer.in_size + 1, layer.in_size), torch.zeros(1, G.w_dim))
    with pytest.raises(InputError, match="w has shape"):
        layer(torch.zeros(2, layer.in_channels, layer.in_size, layer.in_size), torch.zeros(1, G.w_dim))


def _tiny_generator(**overrides) -> Generator:
    kwargs = dict(z_dim=8, c_dim=0, w_dim=8, img_resolution=16, img_channels=3, channel_base=64,
                  channel_max=8, num_layers=4, num_critical=1, margin_size=2, mapping_kwargs={"num_layers": 1})
    kwargs.update(overrides)
    return Generator(**kwargs)


def test_conditional_generator_needs_labels():
    torch.manual_seed(0)
    G = _tiny_generator(c_dim=4)
    z = torch.randn(2, 8)
    c = torch.eye(4)[:2]
    assert G(z, c).shape == (2, 3, 16, 16)
    with pytest.raises(InputError, match="conditional"):
        G(z, None)
    with pytest.raises(InputError, match="c has shape"):
        G(z, torch.eye(3)[:2])


# --- The filtered leaky ReLU against an independent numpy oracle -----------------------------

def _oracle_filtered_lrelu(x, fu, fd, b, up, down, padding, gain, slope, clamp):
    """Straight from the definition: bias, zero-stuff, pad/crop, convolve (scipy), act, convolve, decimate."""
    px0, px1, py0, py1 = padding
    fu2 = np.ones((1, 1)) if fu is None else (np.outer(fu, fu) if fu.ndim == 1 else fu)
    fd2 = np.ones((1, 1)) if fd is None else (np.outer(fd, fd) if fd.ndim == 1 else fd)
    n, c, h, w = x.shape
    out = []
    for i in range(n):
        chans = []
        for j in range(c):
            img = x[i, j] + (0 if b is None else b[j])
            stuffed = np.zeros((h * up, w * up))
            stuffed[::up, ::up] = img
            padded = np.pad(stuffed, ((max(py0, 0), max(py1, 0)), (max(px0, 0), max(px1, 0))))
            padded = padded[max(-py0, 0): padded.shape[0] - max(-py1, 0), max(-px0, 0): padded.shape[1] - max(-px1, 0)]
            y = convolve2d(padded, fu2 * up * up, mode="valid")
            y = np.where(y >= 0, y, y * slope) * gain
            if clamp is not None:
                y = np.clip(y, -clamp, clamp)
            y = convolve2d(y, fd2, mode="valid")[::down, ::down]
            chans.append(y)
        out.append(np.stack(chans))
    return np.stack(out)


@pytest.mark.parametrize("up,down,padding,up_2d,down_2d,clamp", [
    (2, 2, [9, 8, 9, 8], False, False, None),      # SG3-T inner layer
    (4, 2, [-6, -9, -6, -9], False, False, None),  # doubling of the sampling rate
    (2, 2, [-5, -6, -4, -5], False, False, 0.3),   # critically sampled, cropping the margin; clamp
    (2, 2, [11, 10, 11, 10], False, True, None),   # SG3-R: radial 2-D down filter
    (2, 1, [3, 14, 0, 2], False, False, None),     # lopsided padding (fallback crop path)
    (1, 2, [2, 1, 1, 3], False, False, None),      # no upsampling filter
    (2, 2, [5, 4, 6, 3], True, True, 0.5),         # 2-D up filter
    (1, 1, [0, 0, 0, 0], None, None, 2.0),         # ToRGB: bias + clamp only
])
def test_filtered_lrelu_matches_definition(up, down, padding, up_2d, down_2d, clamp):
    rng = np.random.default_rng(up * 10 + down)
    x = rng.standard_normal((2, 3, 17, 15))
    b = rng.standard_normal(3)
    # Asymmetric random filters so that a flipped filter would be caught.
    fu = None if up_2d is None or (up == 1 and not up_2d) else (rng.random((6, 5)) if up_2d else rng.random(4 * up))
    fd = None if down_2d is None or (down == 1 and not down_2d) else (rng.random((7, 6)) if down_2d else rng.random(5 * down))
    gain, slope = (1.0, 1.0) if up_2d is None else (np.sqrt(2), 0.2)
    # The op accepts [th, tw] filters; the oracle uses the same arrays.
    want = _oracle_filtered_lrelu(x, fu, fd, b, up, down, padding, gain, slope, clamp)
    t = lambda a: None if a is None else torch.from_numpy(a)
    got = filtered_lrelu(t(x), t(fu), t(fd), t(b), up=up, down=down, padding=padding,
                         gain=gain, slope=slope, clamp=clamp).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_filtered_lrelu_is_twice_differentiable():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1, 2, 5, 5))).requires_grad_(True)
    b = torch.from_numpy(rng.standard_normal(2)).requires_grad_(True)
    fu, fd = torch.from_numpy(rng.random(8)), torch.from_numpy(rng.random((6, 6)))
    fn = lambda x, b: filtered_lrelu(x, fu, fd, b, up=2, down=2, padding=[3, 2, 3, 2], gain=1.4, slope=0.2)
    assert torch.autograd.gradcheck(fn, (x, b))
    assert torch.autograd.gradgradcheck(fn, (x, b))


# --- Training-side behaviour --------------------------------------------------------------------

def test_generator_supports_double_backward_and_ema_updates():
    torch.manual_seed(0)
    G = _tiny_generator(use_radial_filters=True)
    layer = getattr(G.synthesis, G.synthesis.layer_names[1])
    ema_before, w_avg_before = layer.magnitude_ema.clone(), G.mapping.w_avg.clone()

    ws = G.mapping(torch.randn(2, 8), None, update_emas=True).detach().requires_grad_(True)
    img = G.synthesis(ws, update_emas=True)
    assert not torch.equal(layer.magnitude_ema, ema_before)
    assert not torch.equal(G.mapping.w_avg, w_avg_before)

    # Path-length / R1 style: a penalty on an input gradient, backpropagated into the weights.
    (grad,) = torch.autograd.grad((img * torch.randn_like(img)).sum(), ws, create_graph=True)
    grad.square().sum().backward()
    for name in ("synthesis.L1_16_8.weight", "synthesis.L1_16_8.affine.weight", "synthesis.input.weight"):
        name = name.replace("L1_16_8", G.synthesis.layer_names[1])
        p = dict(G.named_parameters())[name]
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.gpu
def test_reference_on_gpu_fp32(testdata):
    G = generator_from_record(_record(testdata, "sg3t_uncond_32")).cuda()
    ref = np.load(testdata / "stylegan" / "sg3t_uncond_32_ref.npz")["seed1_psi0.7"]
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        out = G(_z(1, G.z_dim).cuda(), None, truncation_psi=0.7)[0].cpu().numpy()
    assert _rel_err(out, ref) < 1e-4


def test_bf16_autocast_keeps_latents_and_fourier_features_in_fp32(loaded):
    # Under AMP only the convolutions drop precision; mapping, Fourier phases and styles stay fp32.
    _, _, G = loaded
    z = _z(1, G.z_dim)
    with torch.no_grad():
        full = G(z)
        ws_full = G.mapping(z, None)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ws = G.mapping(z, None)
            features = G.synthesis.input(ws[:, 0])
            low = G(z)
    torch.testing.assert_close(ws, ws_full, rtol=0, atol=0)
    assert features.dtype == torch.float32
    torch.testing.assert_close(features, G.synthesis.input(ws_full[:, 0]), rtol=0, atol=0)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert 0 < _rel_err(low.numpy(), full.numpy()) < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, {"conv_kernel": 1, "use_radial_filters": True}], ids=["T", "R"])
def test_compiled_generator_matches_eager_on_gpu(config):
    # A full-size layer stack (256 px, NVlabs' default channels) through torch.compile in one graph.
    torch.manual_seed(0)
    G = Generator(z_dim=512, c_dim=0, w_dim=512, img_resolution=256, img_channels=3, **config).cuda().eval()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    z = torch.randn(2, 512, device="cuda")
    with torch.no_grad():
        eager = G(z, None, truncation_psi=0.7)
        compiled = torch.compile(G, fullgraph=True)(z, None, truncation_psi=0.7)
    assert compiled.shape == (2, 3, 256, 256)
    assert _rel_err(compiled.cpu().numpy(), eager.cpu().numpy()) < 1e-4
