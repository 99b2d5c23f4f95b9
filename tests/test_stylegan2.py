"""StyleGAN2 networks and their ops: NVlabs references, op semantics, training-time autograd."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core.errors import InputError, ModelLoadError
from models import ops
from models.nvlabs_pickle import read_network_pickle
from models.stylegan2 import (
    Discriminator,
    Generator,
    discriminator_from_record,
    generator_from_record,
    load_state_strict,
)

SG2_PICKLES = ["sg2_uncond_32", "sg2_cond4_64_fp16"]
TESTDATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata"


def reference_inputs(key: str, z_dim: int, c_dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The README's recipe: seed{S}_psi{P} -> z, one-hot c, psi."""
    seed_part, psi_part = key.split("_psi")
    seed = int(seed_part.removeprefix("seed"))
    z = torch.from_numpy(np.random.RandomState(seed).randn(1, z_dim).astype(np.float32))
    c = torch.zeros([1, c_dim])
    if c_dim:
        c[0, seed % c_dim] = 1
    return z, c, float(psi_part)


def assert_matches_reference(out: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert out.shape == ref.shape, what
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    max_abs = np.abs(out - ref).max()
    assert rel < 1e-4 and max_abs < 1e-3, f"{what}: relative error {rel:.3g}, max abs {max_abs:.3g}"


@pytest.fixture(scope="module")
def networks(testdata):
    return {name: read_network_pickle(testdata / "stylegan" / f"{name}.pkl") for name in SG2_PICKLES}


def reference_cases():
    # Parametrisation happens at collection, before fixtures; same location as conftest's TESTDATA.
    cases = []
    for name in SG2_PICKLES:
        path = TESTDATA / "stylegan" / f"{name}_ref.npz"
        keys = sorted(np.load(path).files) if path.is_file() else ["missing"]
        cases += [(name, k) for k in keys]
    return cases


# ---------------------------------------------------------------------------------------------
# NVlabs references


@pytest.mark.parametrize("name,key", reference_cases())
def test_generator_reproduces_nvlabs_reference(networks, testdata, name, key):
    refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
    assert key in refs.files, f"{name}_ref.npz has no references"
    G = generator_from_record(networks[name]["G_ema"]).eval()
    z, c, psi = reference_inputs(key, G.z_dim, G.c_dim)
    with torch.no_grad():
        out = G(z, c, truncation_psi=psi, truncation_cutoff=None, noise_mode="const", force_fp32=True)
    assert out.dtype == torch.float32
    assert_matches_reference(out[0].numpy(), refs[key], f"{name} {key}")


# Made once with NVlabs' own code (github.com/NVlabs/stylegan3 at c233a919, legacy.load_network_pkl, CPU,
# float32; their code is not part of this repository): for each shared pickle, D and G on seeded inputs
# (img = RandomState(7).randn(4, 3, R, R), z = RandomState(8).randn(4, z_dim), c one-hot at i % c_dim),
# D's logits and the norm of d sum(logits) / d img (R1's gradient) and its dot with probe
# RandomState(10).randn(4, 3, R, R); G in training mode (unfused modulated convs) with const noise: its
# output's norm and dot with the same probe, and the norm of every parameter's gradient of
# sum(G(z) * RandomState(9).randn(4, 3, R, R)). The shared references cover only G_ema's forward pass;
# these cover what training uses (D, its input gradient, G's training path and its backward).
TRAINING_PATH_REF = Path(__file__).resolve().parent / "reference" / "sg2_training_path_ref.npz"


def _close(out: np.ndarray, ref: np.ndarray, what: str, rel: float = 1e-4) -> None:
    err = np.abs(np.asarray(out, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-12)
    assert err < rel, f"{what}: {np.asarray(out).tolist()} vs NVlabs {ref.tolist()} (relative {err:.3g})"


@pytest.mark.parametrize("name", SG2_PICKLES)
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_training_path_reproduces_nvlabs(networks, name, impl):
    """D, R1's input gradient, G's training forward and its parameter gradients equal NVlabs' own code,
    with the reference ops and with the fast kernels the trainer picks on a GPU."""
    ref = np.load(TRAINING_PATH_REF)
    D = discriminator_from_record(networks[name]["D"]).eval()
    G = generator_from_record(networks[name]["G"]).train()
    R = D.img_resolution
    img = torch.from_numpy(np.random.RandomState(7).randn(4, 3, R, R).astype(np.float32))
    z = torch.from_numpy(np.random.RandomState(8).randn(4, G.z_dim).astype(np.float32))
    probe_y = torch.from_numpy(np.random.RandomState(9).randn(4, 3, R, R).astype(np.float32))
    probe_g = torch.from_numpy(np.random.RandomState(10).randn(4, 3, R, R).astype(np.float32))
    c = None
    if D.c_dim:
        c = torch.zeros(4, D.c_dim)
        c[torch.arange(4), torch.arange(4) % D.c_dim] = 1
    choice = {} if impl == "reference" else dict(fir="separable", up="subpixel-fused", down="fused-s2d",
                                                   grad="gradfix")
    with ops.use_impl(**choice):
        x = img.clone().requires_grad_(True)
        logits = D(x, c, force_fp32=True)
        (grad,) = torch.autograd.grad(logits.sum(), x)
        y = G(z, c, noise_mode="const", force_fp32=True)
        (y * probe_y).sum().backward()
    _close(logits.detach()[:, 0].numpy(), ref[f"{name}/d_logits"], f"{name} D logits")
    _close(grad.flatten(1).norm(dim=1).numpy(), ref[f"{name}/d_grad_norm"], f"{name} |dD/dx|")
    _close((grad * probe_g).flatten(1).sum(1).numpy(), ref[f"{name}/d_grad_probe"], f"{name} dD/dx . probe")
    _close(y.detach().flatten(1).norm(dim=1).numpy(), ref[f"{name}/g_train_norm"], f"{name} |G(z)| (training)")
    _close((y.detach() * probe_g).flatten(1).sum(1).numpy(), ref[f"{name}/g_train_probe"], f"{name} G(z) . probe")
    params = dict(G.named_parameters())
    names = [str(n) for n in ref[f"{name}/g_param_names"]]
    assert sorted(names) == sorted(params), "the generator's parameters differ from NVlabs'"
    grads = np.array([params[n].grad.norm().item() for n in names])
    _close(grads, ref[f"{name}/g_param_grad_norm"], f"{name} G parameter gradient norms", rel=1e-3)
    assert (grads[ref[f"{name}/g_param_grad_norm"] > 0] > 0).all()


def _walk(rec, prefix=""):
    yield prefix, rec
    for name, child in rec.children.items():
        yield from _walk(child, f"{prefix}{name}.")


@pytest.mark.parametrize("name", SG2_PICKLES)
@pytest.mark.parametrize("which", ["G_ema", "D"])
def test_precision_settings_match_the_saved_networks(networks, name, which):
    rec = networks[name][which]
    net = generator_from_record(rec) if which == "G_ema" else discriminator_from_record(rec)
    modules = dict(net.named_modules())
    checked = 0
    for prefix, child in _walk(rec):
        ours = modules[prefix.rstrip(".")]
        for attr in ("use_fp16", "conv_clamp", "w_avg_beta", "architecture"):
            if attr in child.attributes:
                assert getattr(ours, attr) == child.attributes[attr], f"{which}.{prefix}{attr}"
                checked += 1
    assert checked > 10


def test_stylegan2_ada_style_record(networks, testdata):
    """stylegan2-ada-pytorch nests synthesis_kwargs and has other defaults; the saved tree decides."""
    rec = networks["sg2_cond4_64_fp16"]["G_ema"]
    ada = dataclasses.replace(rec, init_kwargs={
        "z_dim": 64, "c_dim": 4, "w_dim": 64, "img_resolution": 64, "img_channels": 3,
        "mapping_kwargs": {"num_layers": 2}, "synthesis_kwargs": {"channel_base": 1024, "channel_max": 64}})
    G = generator_from_record(ada).eval()
    assert G.init_kwargs["num_fp16_res"] == 2 and G.init_kwargs["conv_clamp"] == 256
    assert G.synthesis.b64.use_fp16 and not G.synthesis.b16.use_fp16
    assert G.synthesis.b64.conv1.conv_clamp == 256
    assert "synthesis_kwargs" not in G.init_kwargs
    z, c, psi = reference_inputs("seed0_psi1.0", 64, 4)
    with torch.no_grad():
        out = G(z, c, truncation_psi=psi)[0].numpy()
    ref = np.load(testdata / "stylegan" / "sg2_cond4_64_fp16_ref.npz")["seed0_psi1.0"]
    assert_matches_reference(out, ref, "ADA-style record")


def test_fp16_configured_network_runs_fp32_on_cpu(networks):
    G = generator_from_record(networks["sg2_cond4_64_fp16"]["G_ema"]).eval()
    fp16_blocks = [r for r in G.synthesis.block_resolutions if getattr(G.synthesis, f"b{r}").use_fp16]
    assert fp16_blocks == [32, 64], "num_fp16_res=2 must mark the two highest resolutions"
    assert G.synthesis.b64.conv1.conv_clamp == 256
    dtypes = []
    hooks = [m.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
             for m in G.modules() if type(m).__name__ in ("SynthesisLayer", "ToRGBLayer")]
    z = torch.randn(2, G.z_dim)
    c = torch.eye(G.c_dim)[:2]
    with torch.no_grad():
        default = G(z, c)          # force_fp32=False: on the CPU the fp16 blocks still run fp32
        forced = G(z, c, force_fp32=True)
    for h in hooks:
        h.remove()
    assert dtypes and all(d == torch.float32 for d in dtypes)
    assert default.dtype == torch.float32 and torch.isfinite(default).all()
    assert torch.equal(default, forced)


def test_unfused_modconv_matches_fused(networks):
    G = generator_from_record(networks["sg2_uncond_32"]["G_ema"]).eval()
    z = torch.randn(3, G.z_dim)
    with torch.no_grad():
        fused = G(z, fused_modconv=True)
        unfused = G(z, fused_modconv=False)
    assert (fused - unfused).abs().max() < 1e-4


def test_truncation_cutoff_only_moves_the_first_ws(networks):
    G = generator_from_record(networks["sg2_uncond_32"]["G_ema"]).eval()
    z = torch.randn(2, G.z_dim)
    with torch.no_grad():
        full = G.mapping(z, None, truncation_psi=1)
        cut = G.mapping(z, None, truncation_psi=0.5, truncation_cutoff=3)
        all_ = G.mapping(z, None, truncation_psi=0.5)
    w_avg = G.mapping.w_avg
    assert full.shape == (2, G.num_ws, G.w_dim)
    assert torch.allclose(cut[:, :3], w_avg + 0.5 * (full[:, :3] - w_avg), atol=1e-6)
    assert torch.equal(cut[:, 3:], full[:, 3:])
    assert torch.allclose(all_, w_avg.lerp(full, 0.5))
    assert G.mapping(z, None, truncation_psi=0).sub(w_avg).abs().max() == 0


@pytest.mark.slow
def test_whole_networks_compile_without_graph_breaks(networks):
    # fullgraph=True fails on any graph break (host sync, numpy value, data-dependent branch);
    # that is what torch.compile and CUDA graphs on the GPU need.
    G = generator_from_record(networks["sg2_uncond_32"]["G_ema"]).eval()
    D = discriminator_from_record(networks["sg2_uncond_32"]["D"]).eval()
    z = torch.randn(2, G.z_dim)
    with torch.no_grad():
        img = G(z, truncation_psi=0.7)
        compiled_img = torch.compile(G, fullgraph=True, backend="aot_eager")(z, truncation_psi=0.7)
        score = D(img)
        compiled_score = torch.compile(D, fullgraph=True, backend="aot_eager")(img)
    assert torch.allclose(compiled_img, img, atol=1e-5)
    assert torch.allclose(compiled_score, score, atol=1e-5)


def test_noise_modes(networks):
    G = generator_from_record(networks["sg2_uncond_32"]["G_ema"]).eval()
    for layer in G.modules():
        if hasattr(layer, "noise_strength"):
            layer.noise_strength.data.fill_(0.5)  # trained-from-zero strengths may still be 0 in the tiny pickle
    z = torch.randn(1, G.z_dim)
    with torch.no_grad():
        const_a, const_b = G(z, noise_mode="const"), G(z, noise_mode="const")
        rand_a, rand_b = G(z, noise_mode="random"), G(z, noise_mode="random")
        none = G(z, noise_mode="none")
    assert torch.equal(const_a, const_b)
    assert not torch.equal(rand_a, rand_b)
    assert not torch.equal(none, const_a)
    with pytest.raises(InputError, match="noise_mode"):
        G(z, noise_mode="loud")


def test_shape_asserts_at_boundaries(networks):
    G = generator_from_record(networks["sg2_cond4_64_fp16"]["G_ema"]).eval()
    with pytest.raises(InputError, match="z"):
        G(torch.randn(1, G.z_dim + 1), torch.zeros(1, G.c_dim))
    with pytest.raises(InputError, match="class label"):
        G(torch.randn(1, G.z_dim), torch.zeros(1, G.c_dim + 2))
    with pytest.raises(InputError, match="conditional"):
        G(torch.randn(1, G.z_dim))
    with pytest.raises(InputError, match="ws"):
        G.synthesis(torch.randn(1, G.num_ws - 1, G.w_dim))


def test_init_kwargs_are_json_and_rebuild_the_same_network(networks):
    G = generator_from_record(networks["sg2_cond4_64_fp16"]["G_ema"])
    again = Generator(**json.loads(json.dumps(G.init_kwargs)))
    assert again.state_dict().keys() == G.state_dict().keys()
    D = discriminator_from_record(networks["sg2_cond4_64_fp16"]["D"])
    D2 = Discriminator(**json.loads(json.dumps(D.init_kwargs)))
    assert D2.state_dict().keys() == D.state_dict().keys()


def test_record_with_wrong_state_is_a_model_load_error(networks):
    rec = networks["sg2_uncond_32"]["G_ema"]
    G = Generator(**{**rec.init_kwargs, "channel_max": 32})
    with pytest.raises(ModelLoadError, match="wrong shape"):
        load_state_strict(G, rec.state_dict(), "generator")
    state = dict(rec.state_dict())
    del state["mapping.w_avg"]
    with pytest.raises(ModelLoadError, match="missing mapping.w_avg"):
        load_state_strict(Generator(**rec.init_kwargs), state, "generator")
    with pytest.raises(ModelLoadError, match="Discriminator"):
        discriminator_from_record(rec)


@pytest.mark.parametrize("architecture", ["orig", "skip", "resnet"])
def test_generator_architectures(architecture):
    torch.manual_seed(0)
    G = Generator(z_dim=16, c_dim=3, w_dim=16, img_resolution=16, img_channels=3,
                  mapping_kwargs={"num_layers": 2}, channel_base=256, channel_max=32,
                  architecture=architecture, num_fp16_res=1, conv_clamp=256)
    out = G(torch.randn(2, 16), torch.eye(3)[:2], noise_mode="random")
    assert out.shape == (2, 3, 16, 16) and torch.isfinite(out).all()
    keys = G.state_dict().keys()
    assert ("synthesis.b8.skip.weight" in keys) == (architecture == "resnet")
    assert ("synthesis.b8.torgb.weight" in keys) == (architecture == "skip")
    assert "synthesis.b16.torgb.weight" in keys  # the last block always has ToRGB


# ---------------------------------------------------------------------------------------------
# Discriminator


@pytest.mark.parametrize("name", SG2_PICKLES)
def test_discriminator_from_pickle_gives_finite_scores(networks, name):
    D = discriminator_from_record(networks[name]["D"]).eval()
    assert D.state_dict().keys() == networks[name]["D"].state_dict().keys()
    R = D.img_resolution
    c = torch.eye(D.c_dim)[[0, 1, 2, 3]] if D.c_dim else None
    with torch.no_grad():
        score = D(torch.randn(4, 3, R, R), c)
    assert score.shape == (4, 1) and torch.isfinite(score).all()


def test_discriminator_r1_penalty_double_backward(networks):
    D = discriminator_from_record(networks["sg2_cond4_64_fp16"]["D"]).train()
    real = torch.randn(2, 3, 64, 64, requires_grad=True)
    c = torch.eye(4)[[1, 3]]
    logits = D(real, c)
    (r1_grads,) = torch.autograd.grad(logits.sum(), real, create_graph=True)
    r1_penalty = r1_grads.square().sum(dim=[1, 2, 3]).mean()
    (r1_penalty * 5.0 + F.softplus(-logits).mean()).backward()
    grads = [p.grad for p in D.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert D.b64.conv0.weight.grad.abs().sum() > 0


def test_generator_path_length_double_backward():
    torch.manual_seed(0)
    G = Generator(z_dim=16, c_dim=0, w_dim=16, img_resolution=16, img_channels=3,
                  mapping_kwargs={"num_layers": 2}, channel_base=256, channel_max=32,
                  fused_modconv_default="inference_only").train()
    ws = G.mapping(torch.randn(2, 16), None)
    img = G.synthesis(ws, noise_mode="random")
    noise = torch.randn_like(img) / math.sqrt(16 * 16)
    (ws_grad,) = torch.autograd.grad((img * noise).sum(), ws, create_graph=True)
    ws_grad.square().sum(2).mean(1).sqrt().mean().backward()
    assert G.synthesis.b8.conv0.weight.grad is not None
    assert torch.isfinite(G.synthesis.b8.conv0.weight.grad).all()


def test_discriminator_dropout_and_mbstd_options(networks):
    rec = networks["sg2_uncond_32"]["D"]
    plain = discriminator_from_record(rec)
    kwargs = {**rec.init_kwargs, "epilogue_kwargs": {"dropout": 0.3}}
    D = Discriminator(**kwargs)
    load_state_strict(D, rec.state_dict(), "discriminator")   # dropout adds no state-dict keys
    assert D.state_dict().keys() == plain.state_dict().keys()
    assert Discriminator(**rec.init_kwargs, dropout=0.3).b4.dropout_p == 0.3
    x = torch.randn(4, 3, 32, 32)
    D.eval()
    with torch.no_grad():
        # dropout is off in eval mode: the same scores as the D built without it (to rounding: two builds)
        torch.testing.assert_close(D(x), plain(x), rtol=1e-5, atol=1e-6)
        D.train()
        torch.manual_seed(1)
        a = D(x)
        b = D(x)
    assert not torch.equal(a, b)
    with pytest.raises(InputError, match="dropout"):
        Discriminator(**rec.init_kwargs, dropout=1.5)

    D8 = Discriminator(c_dim=0, img_resolution=16, img_channels=3, channel_base=128, channel_max=16,
                       epilogue_kwargs={"mbstd_group_size": 2, "mbstd_num_channels": 2})
    assert D8.b4.conv.weight.shape[1] == 16 + 2
    assert D8(torch.randn(6, 3, 16, 16)).shape == (6, 1)
    with pytest.raises(InputError, match="multiple"):
        D8(torch.randn(3, 3, 16, 16))


@pytest.mark.parametrize("architecture", ["orig", "skip", "resnet"])
def test_discriminator_architectures(architecture):
    D = Discriminator(c_dim=2, img_resolution=16, img_channels=3, channel_base=128, channel_max=16,
                      architecture=architecture, block_kwargs={"freeze_layers": 2})
    out = D(torch.randn(4, 3, 16, 16), torch.eye(2)[[0, 1, 0, 1]])
    assert out.shape == (4, 1) and torch.isfinite(out).all()
    # Freeze-D turns the first layers into buffers under the same names.
    assert "b16.fromrgb.weight" in dict(D.named_buffers()) or architecture == "skip"
    assert "b16.fromrgb.weight" in D.state_dict()


def test_minibatch_std_matches_definition():
    from models.stylegan2 import MinibatchStdLayer

    x = torch.randn(4, 6, 3, 3, dtype=torch.float64)
    y = MinibatchStdLayer(group_size=2, num_channels=2)(x)
    assert y.shape == (4, 8, 3, 3)
    # Sample i is in group i % 2 with sample i + 2; channels split into 2 groups of 3.
    for i in range(4):
        pair = x[[i % 2, i % 2 + 2]]
        for f in range(2):
            std = (pair[:, 3 * f:3 * f + 3].var(dim=0, unbiased=False) + 1e-8).sqrt().mean()
            assert torch.allclose(y[i, 6 + f], std.expand(3, 3))


# ---------------------------------------------------------------------------------------------
# Ops


def upfirdn2d_definition(x, f, up, down, pad, flip, gain):
    """The op by its definition: insert zeros, pad (or crop), convolve, keep every down-th."""
    N, C, H, W = x.shape
    (upx, upy), (downx, downy) = up, down
    px0, px1, py0, py1 = pad
    big = x.new_zeros(N, C, H * upy, W * upx)
    big[:, :, ::upy, ::upx] = x
    big = F.pad(big, [max(px0, 0), max(px1, 0), max(py0, 0), max(py1, 0)])
    big = big[:, :, max(-py0, 0):big.shape[2] - max(-py1, 0), max(-px0, 0):big.shape[3] - max(-px1, 0)]
    f2 = f if f.ndim == 2 else torch.outer(f, f)
    f2 = f2 * gain
    if not flip:
        f2 = f2.flip([0, 1])
    kh, kw = f2.shape
    out = torch.zeros(N, C, big.shape[2] - kh + 1, big.shape[3] - kw + 1, dtype=x.dtype)
    for i, j in itertools.product(range(kh), range(kw)):
        out += f2[i, j] * big[:, :, i:i + out.shape[2], j:j + out.shape[3]]
    return out[:, :, ::downy, ::downx]


@pytest.mark.parametrize("taps", [[1, 3, 3, 1], [1, 2, 4, 3], list(range(1, 9)), [[1, 2], [3, 5], [7, 1]]])
def test_upfirdn2d_matches_its_definition(taps):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64)
    if isinstance(taps[0], list):
        f = torch.tensor(taps, dtype=torch.float64)
    else:
        f = ops.setup_filter(taps, normalize=False).double()
    checked = 0
    for up, down, flip, pad in itertools.product([(1, 1), (2, 2), (3, 2)], [(1, 1), (2, 2), (1, 3)], [False, True],
                                                 [(0, 0, 0, 0), (1, 2, 3, 1), (-1, 2, 0, -2), (3, 3, 3, 3)]):
        try:
            want = upfirdn2d_definition(x, f, up, down, pad, flip, 1.7)
        except RuntimeError:
            continue  # the padded image is smaller than the filter
        if want.numel() == 0:
            continue
        got = ops.upfirdn2d(x, f, up=up, down=down, padding=pad, flip_filter=flip, gain=1.7)
        assert got.shape == want.shape, (up, down, pad)
        assert (got - want).abs().max() < 1e-10, (taps, up, down, pad, flip)
        checked += 1
    assert checked > 50


def test_setup_filter_and_resampling_keep_the_mean():
    f = ops.setup_filter([1, 3, 3, 1])
    assert f.shape == (4, 4) and torch.allclose(f.sum(), torch.tensor(1.0))
    assert ops.setup_filter(list(range(1, 9))).ndim == 1   # long filters stay separable
    x = torch.full([1, 2, 8, 8], 3.0)
    up = ops.upsample2d(x, f)
    down = ops.downsample2d(x, f)
    same = ops.filter2d(x, f)
    assert up.shape == (1, 2, 16, 16) and down.shape == (1, 2, 4, 4) and same.shape == (1, 2, 8, 8)
    assert torch.allclose(up[:, :, 2:-2, 2:-2], torch.tensor(3.0))
    assert torch.allclose(down[:, :, 1:-1, 1:-1], torch.tensor(3.0))
    assert torch.allclose(same[:, :, 2:-2, 2:-2], torch.tensor(3.0))


def test_bias_act_semantics():
    x = torch.tensor([[-2.0, 1.0], [300.0, -300.0]])
    b = torch.tensor([1.0, -1.0])
    out = ops.bias_act(x, b, act="lrelu")
    want = torch.where(x + b >= 0, x + b, 0.2 * (x + b)) * math.sqrt(2)
    assert torch.allclose(out, want)
    assert torch.allclose(ops.bias_act(x, b, act="lrelu", gain=1.0, clamp=10.0),
                          torch.where(x + b >= 0, x + b, 0.2 * (x + b)).clamp(-10, 10))
    assert torch.equal(ops.bias_act(x), x)                                  # linear, gain 1
    assert torch.allclose(ops.bias_act(x, act="relu"), x.relu() * math.sqrt(2))
    with pytest.raises(InputError, match="activation"):
        ops.bias_act(x, act="gelu-ish")


@pytest.mark.parametrize("up,down,kernel", [(1, 1, 3), (2, 1, 3), (1, 2, 3), (1, 2, 1), (2, 1, 1)])
def test_conv2d_resample_matches_its_definition(up, down, kernel):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    w = torch.randn(5, 4, kernel, kernel, dtype=torch.float64)
    f = ops.setup_filter([1, 3, 3, 1]).double()
    pad = kernel // 2
    got = ops.conv2d_resample(x, w, f=f, up=up, down=down, padding=pad, flip_weight=(up == 1))
    # Definition: insert zeros, pad once, then the (valid) conv and the (valid) low-pass filter
    # scaled by up**2, then keep every down-th pixel. Filter taps (4) add (4 - up) or
    # (4 - down) to the padding, split as NVlabs does.
    p0, p1 = pad, pad
    if up > 1:
        p0, p1 = p0 + (4 + up - 1) // 2, p1 + (4 - up) // 2
    if down > 1:
        p0, p1 = p0 + (4 - down + 1) // 2, p1 + (4 - down) // 2
    big = x.new_zeros(2, 4, 8 * up, 8 * up)
    big[:, :, ::up, ::up] = x
    big = F.pad(big, [p0, p1, p0, p1])
    wk = w if up == 1 else w.flip([2, 3])   # flip_weight=False means a true convolution
    y = F.conv2d(big, wk)
    if up > 1 or down > 1:
        y = F.conv2d(y, (f.flip([0, 1]) * up**2).expand(5, 1, 4, 4), groups=5)
    y = y[:, :, ::down, ::down]
    assert got.shape == y.shape == (2, 5, 8 * up // down, 8 * up // down)
    assert (got - y).abs().max() < 1e-9


@pytest.mark.parametrize("up,demodulate,with_noise", [(1, True, False), (2, True, True), (1, False, True)])
def test_modulated_conv2d_fused_equals_unfused(up, demodulate, with_noise):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 8, dtype=torch.float64)
    w = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    s = torch.randn(3, 4, dtype=torch.float64)
    f = ops.setup_filter([1, 3, 3, 1]).double()
    noise = torch.randn(8 * up, 8 * up, dtype=torch.float64) if with_noise else None
    kw = dict(noise=noise, up=up, padding=1, resample_filter=f, demodulate=demodulate, flip_weight=(up == 1))
    fused = ops.modulated_conv2d(x, w, s, fused_modconv=True, **kw)
    unfused = ops.modulated_conv2d(x, w, s, fused_modconv=False, **kw)
    assert fused.shape == (3, 6, 8 * up, 8 * up)
    assert (fused - unfused).abs().max() < 1e-9
    # Per sample, it is a plain conv with the modulated (and demodulated) weight.
    wi = w * s[1].reshape(1, 4, 1, 1)
    if demodulate:
        wi = wi / wi.square().sum(dim=[1, 2, 3], keepdim=True).add(1e-8).sqrt()
    one = ops.conv2d_resample(x[1:2], wi, f=f, up=up, padding=1, flip_weight=(up == 1))
    if noise is not None:
        one = one + noise
    assert (fused[1:2] - one).abs().max() < 1e-9


def test_modulated_conv2d_fp16_prenormalisation_is_scale_free():
    # The fp16 path rescales weight and styles before demodulating; demodulation must cancel it.
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6)
    w = torch.randn(5, 4, 3, 3) * 40
    s = torch.randn(2, 4) * 30
    ref = ops.modulated_conv2d(x.double(), w.double(), s.double(), padding=1)
    try:
        half = ops.modulated_conv2d(x.half(), w, s, padding=1)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this PyTorch build has no float16 conv2d on the CPU")
    assert half.dtype == torch.float16
    assert (half.double() - ref).abs().max() / ref.abs().max() < 5e-3


@pytest.mark.gpu
def test_fp16_blocks_on_cuda_stay_close_to_fp32(testdata):
    rec = read_network_pickle(testdata / "stylegan" / "sg2_cond4_64_fp16.pkl")["G_ema"]
    G = generator_from_record(rec).cuda().eval()
    z = torch.randn(4, G.z_dim, device="cuda")
    c = torch.eye(G.c_dim, device="cuda")
    with torch.no_grad():
        mixed = G(z, c)
        full = G(z, c, force_fp32=True)
    assert mixed.dtype == torch.float32
    rel = (mixed - full).norm() / full.norm()
    assert rel < 2e-2, f"fp16 blocks drift {rel:.3g} from fp32"
