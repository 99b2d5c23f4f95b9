"""Alternative implementations of the resampling ops (models.ops.set_impl) equal the reference ones.

Every variant is checked against the default implementation in float64 (which
tests/test_stylegan2.py checks against the ops' definitions and the NVlabs references),
differentiated once and twice (gradcheck / gradgradcheck), and used globally inside whole
StyleGAN2 networks. The speed of each is measured on the GPU by bench/ops.py.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.profiler import profile

from core.errors import InputError
from models import ops
from tests.test_stylegan_loader import reference_inputs
from models.nvlabs_pickle import read_network_pickle
from models.stylegan2 import Discriminator, Generator, discriminator_from_record, generator_from_record

FIR_VARIANTS = ops.IMPL_CHOICES["fir"][1:]
UP_VARIANTS = ops.IMPL_CHOICES["up"][1:]
DOWN_VARIANTS = ops.IMPL_CHOICES["down"][1:]

# Every non-default value at least once; the first is the 'all changed' combination.
COMBOS = [
    dict(fir="nc1", up="subpixel-fused", down="fused-s2d", grad="gradfix"),
    dict(fir="shifts", up="transpose-fused", down="fused-stride"),
    dict(fir="separable", up="subpixel", grad="gradfix"),
    dict(up="zero-insert-fused"),
]
SINGLES = [{knob: value} for knob, values in ops.IMPL_CHOICES.items() for value in values[1:]]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def impl_id(impl: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in impl.items())


# ---------------------------------------------------------------------------------------------
# The setting itself


def test_default_is_the_reference_and_settings_are_validated():
    assert ops.get_impl() == ops.DEFAULT_IMPL
    assert ops.DEFAULT_IMPL == {"fir": "grouped", "up": "transpose", "down": "blur-stride", "grad": "aten",
                                "modconv": "as-called"}
    with pytest.raises(InputError, match="unknown ops implementation knob"):
        ops.set_impl(blur="nc1")
    with pytest.raises(InputError, match="choose one of"):
        ops.set_impl(fir="fft")
    assert ops.get_impl() == ops.DEFAULT_IMPL          # a refused setting changes nothing

    previous = ops.set_impl(fir="nc1")
    try:
        assert previous == ops.DEFAULT_IMPL and ops.get_impl()["fir"] == "nc1"
        with pytest.raises(RuntimeError, match="boom"):
            with ops.use_impl(up="subpixel", grad="gradfix") as now:
                assert now == {**ops.DEFAULT_IMPL, "fir": "nc1", "up": "subpixel", "grad": "gradfix"}
                raise RuntimeError("boom")
        assert ops.get_impl() == {**ops.DEFAULT_IMPL, "fir": "nc1"}   # restored despite the error
    finally:
        ops.set_impl(**ops.DEFAULT_IMPL)
    assert ops.get_impl() == ops.DEFAULT_IMPL


def test_separable_taps_only_for_outer_products():
    f = ops.setup_filter([1, 3, 3, 1])
    fy, fx = ops._separable_taps(f)
    assert torch.allclose(torch.outer(fy, fx), f, atol=1e-7)
    assert ops._separable_taps(torch.tensor([[1.0, 2.0], [3.0, 5.0]])) is None
    assert ops._separable_taps(torch.tensor([[1.0, 2.0], [2.0, 4.0]])) is not None
    # Factors come from row/column sums: a zero-sum filter (even an outer product) takes the
    # grouped reference path instead.
    assert ops._separable_taps(torch.tensor([[1.0, -1.0], [-1.0, 1.0]])) is None
    # An in-place edit of the same buffer is noticed (the check is cached by tensor and version).
    g = ops.setup_filter([1, 2, 1])
    assert ops._separable_taps(g) is not None
    g[0, 0] += 1
    assert ops._separable_taps(g) is None


# ---------------------------------------------------------------------------------------------
# upfirdn2d


@pytest.mark.parametrize("kind", FIR_VARIANTS)
def test_fir_variant_equals_reference(kind):
    torch.manual_seed(0)
    filters = [ops.setup_filter([1, 3, 3, 1]).double(),            # 2-D outer product (StyleGAN's)
               ops.setup_filter([1, 2, 1]).double(),               # odd taps
               ops.setup_filter(list(range(1, 9))).double(),       # 1-D (separable) filter
               torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 1.0]], dtype=torch.float64)]  # not separable
    checked = 0
    for f, (H, W) in itertools.product(filters, [(9, 7), (6, 6)]):
        x = torch.randn(2, 3, H, W, dtype=torch.float64)
        for up, down, flip, pad in itertools.product([(1, 1), (2, 2), (3, 2)], [(1, 1), (2, 2), (1, 3)],
                                                     [False, True],
                                                     [(0, 0, 0, 0), (1, 2, 3, 1), (-1, 2, 0, -2), (3, 3, 3, 3)]):
            try:
                want = ops.upfirdn2d(x, f, up=up, down=down, padding=pad, flip_filter=flip, gain=1.7)
            except RuntimeError:
                continue  # the padded image is smaller than the filter
            if want.numel() == 0:
                continue
            with ops.use_impl(fir=kind):
                got = ops.upfirdn2d(x, f, up=up, down=down, padding=pad, flip_filter=flip, gain=1.7)
            assert got.shape == want.shape, (f.shape, up, down, pad)
            assert (got - want).abs().max() < 1e-12 * want.abs().max(), (kind, f.shape, up, down, pad, flip)
            checked += 1
    assert checked > 300


@pytest.mark.parametrize("kind", FIR_VARIANTS)
def test_fir_variant_resampling_helpers_and_channels_last(kind):
    torch.manual_seed(1)
    f = ops.setup_filter([1, 3, 3, 1])
    x = torch.randn(2, 5, 11, 8).to(memory_format=torch.channels_last)
    for op in (lambda t: ops.upsample2d(t, f), lambda t: ops.downsample2d(t, f),
               lambda t: ops.filter2d(t, f, padding=1), lambda t: ops.upfirdn2d(t, None, up=2, padding=1)):
        want = op(x.contiguous())
        with ops.use_impl(fir=kind):
            got = op(x)
        assert rel_err(got, want) < 1e-6
        if kind == "nc1":
            assert got.is_contiguous(memory_format=torch.channels_last)   # handed back in the caller's layout


# ---------------------------------------------------------------------------------------------
# conv2d_resample / modulated_conv2d


def conv_cases(knob: str):
    factors = [(2, 1), (3, 1)] if knob == "up" else [(1, 2), (1, 3)]
    return itertools.product(factors, [3, 2, 4], [0, 1, 2], [True, False], [False, True], [1, 2],
                             [[1, 3, 3, 1], [1, 2, 1], None], [(8, 8), (7, 9)])


@pytest.mark.parametrize("knob,kind", [("up", k) for k in UP_VARIANTS] + [("down", k) for k in DOWN_VARIANTS])
def test_conv_variant_equals_reference(knob, kind):
    torch.manual_seed(0)
    checked = 0
    for (up, down), k, pad, flip_w, flip_f, groups, taps, (H, W) in conv_cases(knob):
        f = ops.setup_filter(taps).double() if taps is not None else None
        x = torch.randn(2, 4, H, W, dtype=torch.float64)
        w = torch.randn(6, 4 // groups, k, k, dtype=torch.float64)
        kw = dict(f=f, up=up, down=down, padding=pad, groups=groups, flip_weight=flip_w, flip_filter=flip_f)
        want = ops.conv2d_resample(x, w, **kw)
        with ops.use_impl(**{knob: kind}):
            got = ops.conv2d_resample(x, w, **kw)
        assert got.shape == want.shape, kw
        assert (got - want).abs().max() < 1e-11 * want.abs().max(), (kind, up, down, k, pad, flip_w, flip_f, groups,
                                                                     taps, H, W)
        checked += 1
    assert checked == 2 * 3 * 3 * 2 * 2 * 2 * 3 * 2


@pytest.mark.parametrize("impl", [{"up": k} for k in UP_VARIANTS] + [{"down": k} for k in DOWN_VARIANTS],
                         ids=impl_id)
def test_conv_variant_channels_last(impl):
    torch.manual_seed(2)
    f = ops.setup_filter([1, 3, 3, 1])
    up, down = (2, 1) if "up" in impl else (1, 2)
    for groups in (1, 2):
        x = torch.randn(2, 6, 9, 8).to(memory_format=torch.channels_last)
        w = torch.randn(4, 6 // groups, 3, 3).to(memory_format=torch.channels_last)
        kw = dict(f=f, up=up, down=down, padding=1, groups=groups, flip_weight=up == 1)
        want = ops.conv2d_resample(x.contiguous(), w.contiguous(), **kw)
        with ops.use_impl(**impl):
            got = ops.conv2d_resample(x, w, **kw)
        assert rel_err(got, want) < 1e-6, groups


@pytest.mark.parametrize("impl", SINGLES, ids=impl_id)
def test_modulated_conv2d_variants(impl):
    torch.manual_seed(0)
    f = ops.setup_filter([1, 3, 3, 1]).double()
    x = torch.randn(3, 4, 7, 7, dtype=torch.float64)
    w = torch.randn(5, 4, 3, 3, dtype=torch.float64)
    s = torch.randn(3, 4, dtype=torch.float64)
    noise = torch.randn(3, 1, 14, 14, dtype=torch.float64)
    for up, fused, demod in itertools.product([1, 2], [True, False], [True, False]):
        kw = dict(up=up, padding=1, resample_filter=f, flip_weight=up == 1, fused_modconv=fused,
                  demodulate=demod, noise=noise if up == 2 else None)
        want = ops.modulated_conv2d(x, w, s, **kw)
        with ops.use_impl(**impl):
            got = ops.modulated_conv2d(x, w, s, **kw)
        assert (got - want).abs().max() < 1e-11 * want.abs().max(), (up, fused, demod)


# ---------------------------------------------------------------------------------------------
# Derivatives: once and twice (R1 and path length use create_graph=True)


def grad_cases():
    cases = []
    for grad in ops.IMPL_CHOICES["grad"]:
        cases += [(dict(up=k, grad=grad), "up3") for k in ops.IMPL_CHOICES["up"]]
        cases += [(dict(down=k, grad=grad), "down3") for k in ops.IMPL_CHOICES["down"]]
        cases += [(dict(fir=k, grad=grad), "up1") for k in ops.IMPL_CHOICES["fir"]]
        cases += [(dict(fir=k, grad=grad), "down1") for k in ops.IMPL_CHOICES["fir"]]
    return cases


@pytest.mark.parametrize("impl,op", grad_cases(), ids=lambda v: impl_id(v) if isinstance(v, dict) else v)
def test_gradcheck_and_gradgradcheck(impl, op):
    torch.manual_seed(0)
    f = ops.setup_filter([1, 3, 3, 1]).double()
    k = int(op[-1])
    up, down = (2, 1) if op.startswith("up") else (1, 2)
    x = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, k, k, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        return ops.conv2d_resample(x, w, f=f, up=up, down=down, padding=k // 2, flip_weight=up == 1)

    with ops.use_impl(**impl):
        assert torch.autograd.gradcheck(fn, (x, w))
        assert torch.autograd.gradgradcheck(fn, (x, w))


@pytest.mark.parametrize("transposed,stride,groups,size", [(False, 2, 1, 7), (False, 2, 2, 8), (True, 2, 2, 5),
                                                           (False, 1, 1, 6), (True, 3, 1, 4)])
def test_gradfix_conv_derivatives(transposed, stride, groups, size):
    torch.manual_seed(0)
    x = torch.randn(1, 2, size, size + 1, dtype=torch.float64, requires_grad=True)
    shape = [2, 4 // groups, 3, 3] if transposed else [4, 2 // groups, 3, 3]
    w = torch.randn(shape, dtype=torch.float64, requires_grad=True)

    def fn(x, w):
        return ops._convolution(x, w, stride=stride, padding=1, groups=groups, transposed=transposed)

    want = fn(x, w)
    with ops.use_impl(grad="gradfix"):
        got = fn(x, w)
        assert got.grad_fn.name().endswith("_ConvFnBackward")
        assert torch.autograd.gradcheck(fn, (x, w))
        assert torch.autograd.gradgradcheck(fn, (x, w))
    assert torch.equal(got, want)


def second_order_conv_calls(impl: dict) -> tuple[int, torch.Tensor]:
    """Convolution launches in the second backward of an R1-style penalty through a D-style layer."""
    torch.manual_seed(0)
    C = 16
    f = ops.setup_filter([1, 3, 3, 1])
    x = torch.randn(4, C, 16, 16, requires_grad=True)
    w = torch.randn(C, C, 3, 3, requires_grad=True)
    with ops.use_impl(**impl):
        y = ops.conv2d_resample(x, w, f=f, down=2, padding=1)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        with profile() as prof:
            g.square().sum().backward()
    calls = sum(e.count for e in prof.key_averages()
                if e.key in ("aten::convolution", "aten::convolution_backward"))
    return calls, w.grad


def test_variants_avoid_the_per_group_double_backward_loop():
    # aten's double backward of the 16-channel depthwise blur runs one conv per channel (gW is
    # computed although the filter needs no gradient); gradfix and groups=1 formulations do not.
    base_calls, base_grad = second_order_conv_calls({})
    assert base_calls > 16
    for impl in (dict(grad="gradfix"), dict(fir="nc1"), dict(down="fused-stride"), dict(down="fused-s2d")):
        calls, grad = second_order_conv_calls(impl)
        assert calls <= 10, (impl, calls)
        assert rel_err(grad, base_grad) < 1e-5, impl


def test_gradfix_under_autocast_keeps_one_dtype():
    torch.manual_seed(0)
    f = ops.setup_filter([1, 3, 3, 1])
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    w = torch.randn(4, 4, 3, 3, requires_grad=True)
    grads = {}
    for impl in ({}, dict(grad="gradfix", up="subpixel-fused")):
        with ops.use_impl(**impl), torch.autocast("cpu", dtype=torch.bfloat16):
            y = ops.conv2d_resample(x, w, f=f, up=2, padding=1, flip_weight=False)
            (g,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
        g.square().sum().backward()
        assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
        grads[impl_id(impl)] = w.grad
        w.grad = None
    a, b = grads.values()
    assert rel_err(b, a) < 0.05   # both bf16; different summation orders


# ---------------------------------------------------------------------------------------------
# Whole networks with a variant set globally


def small_networks(architecture: str):
    torch.manual_seed(0)
    G = Generator(z_dim=16, c_dim=0, w_dim=16, img_resolution=16, img_channels=3, mapping_kwargs={"num_layers": 2},
                  channel_base=256, channel_max=16, architecture=architecture, conv_clamp=256)
    D = Discriminator(c_dim=0, img_resolution=16, img_channels=3, channel_base=256, channel_max=16,
                      architecture=architecture, conv_clamp=256)
    for m in G.modules():
        if hasattr(m, "noise_strength"):
            m.noise_strength.data.fill_(0.3)
    return G, D


@pytest.mark.parametrize("architecture", ["skip", "resnet"])
def test_networks_give_the_same_output_with_every_variant(architecture):
    G, D = small_networks(architecture)
    z = torch.randn(4, 16)
    img_in = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        want = {fused: G(z, fused_modconv=fused) for fused in (True, False)}
        want_d = D(img_in)
    keys_g, keys_d = list(G.state_dict()), list(D.state_dict())
    for impl in SINGLES + COMBOS:
        with ops.use_impl(**impl), torch.no_grad():
            for fused in (True, False):
                assert rel_err(G(z, fused_modconv=fused), want[fused]) < 1e-5, (impl, fused)
            assert rel_err(D(img_in), want_d) < 1e-5, impl
            # Networks built while a variant is set have the same parameters and buffers.
            torch.manual_seed(0)
            G2, D2 = small_networks(architecture)
        assert list(G2.state_dict()) == keys_g and list(D2.state_dict()) == keys_d


def regularizer_grads(G, D, impl: dict) -> list[torch.Tensor]:
    """D's parameter gradients of an R1 penalty and G's of a path-length penalty (double backward)."""
    torch.manual_seed(3)
    real = torch.randn(4, 3, 16, 16, requires_grad=True)
    z = torch.randn(2, 16)
    G.zero_grad(set_to_none=True)
    D.zero_grad(set_to_none=True)
    with ops.use_impl(**impl):
        logits = D(real)
        (r1,) = torch.autograd.grad(logits.sum(), real, create_graph=True)
        r1.square().sum().backward()
        ws = G.mapping(z, None)
        img = G.synthesis(ws, noise_mode="const", fused_modconv=False)
        (pl,) = torch.autograd.grad((img * torch.randn_like(img)).sum(), ws, create_graph=True)
        pl.square().sum(2).mean(1).sqrt().mean().backward()
    return [p.grad.clone() for p in [*D.parameters(), *G.synthesis.parameters()] if p.grad is not None]


@pytest.mark.parametrize("impl", COMBOS, ids=impl_id)
def test_r1_and_path_length_gradients_match(impl):
    G, D = small_networks("resnet")   # blocks compute in float32 whatever the parameters' dtype
    want = regularizer_grads(G, D, {})
    got = regularizer_grads(G, D, impl)
    assert len(got) == len(want) > 20
    for g, w in zip(got, want):
        assert rel_err(g, w) < 5e-5       # float32 summation order (measured up to 8e-6)


def test_nvlabs_references_with_every_variant(testdata):
    """Our loader + every combination still reproduces NVlabs' images for their pickles."""
    checked = 0
    for name in ("sg2_uncond_32", "sg2_cond4_64_fp16"):
        net = read_network_pickle(testdata / "stylegan" / f"{name}.pkl")
        G = generator_from_record(net["G_ema"]).eval()
        D = discriminator_from_record(net["D"]).eval()
        refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
        key = sorted(refs.files)[0]
        z, c, psi = reference_inputs(G, key)
        with torch.no_grad():
            score = D(torch.from_numpy(refs[key])[None], c)
            for impl in COMBOS:
                with ops.use_impl(**impl):
                    out = G(z, c, truncation_psi=psi, noise_mode="const")[0].numpy()
                    assert np.linalg.norm(out - refs[key]) / np.linalg.norm(refs[key]) < 1e-4, (name, impl)
                    assert rel_err(D(torch.from_numpy(refs[key])[None], c), score) < 1e-5, (name, impl)
                checked += 1
    assert checked == 2 * len(COMBOS)


@pytest.mark.slow
def test_variants_compile_without_graph_breaks():
    # fullgraph=True fails on any graph break: the eager-only separability check and the
    # gradfix Function must be traceable.
    G, D = small_networks("skip")
    z = torch.randn(2, 16)
    with torch.no_grad():
        want_img = G(z)
        want_score = D(want_img)
    torch._dynamo.reset()
    with ops.use_impl(**COMBOS[0]), torch.no_grad():
        img = torch.compile(G, fullgraph=True, backend="aot_eager")(z)
        score = torch.compile(D, fullgraph=True, backend="aot_eager")(img)
    torch._dynamo.reset()
    with ops.use_impl(fir="shifts", up="transpose-fused", down="fused-stride"), torch.no_grad():
        img2 = torch.compile(G, fullgraph=True, backend="aot_eager")(z)
    torch._dynamo.reset()
    assert rel_err(img, want_img) < 1e-5 and rel_err(img2, want_img) < 1e-5
    assert rel_err(score, want_score) < 1e-5


@pytest.mark.gpu
def test_variants_on_cuda_bf16_channels_last():
    """On the GPU: each variant in bf16 + channels_last stays as close to the fp32 reference as the default."""
    torch.manual_seed(0)
    f = ops.setup_filter([1, 3, 3, 1], device="cuda")
    x = torch.randn(8, 32, 16, 16, device="cuda")
    w = torch.randn(32, 32, 3, 3, device="cuda")
    cl = torch.channels_last
    for up, knob in ((2, "up"), (1, "down")):
        kw = dict(f=f, up=up, down=3 - up, padding=1, flip_weight=up == 1)
        ref = ops.conv2d_resample(x.double(), w.double(), f=f.double(), **{k: v for k, v in kw.items() if k != "f"})
        base = rel_err(ops.conv2d_resample(x.bfloat16().to(memory_format=cl), w.bfloat16(), **kw).double(), ref)
        for kind in ops.IMPL_CHOICES[knob][1:]:
            with ops.use_impl(**{knob: kind}):
                got = ops.conv2d_resample(x.bfloat16().to(memory_format=cl), w.bfloat16(), **kw).double()
            assert rel_err(got, ref) < max(3 * base, 1e-2), (knob, kind)


# ---------------------------------------------------------------------------------------------
# bench/ops.py: how it picks winners (the GPU run itself is next session's)


def load_bench():
    from bench import ops as bench_ops

    return bench_ops


def test_bench_picks_the_fastest_accurate_variant():
    bench = load_bench()
    cases = [bench.Case("G.up", "up", "train", None, None, {"fwd": 1, "bwd": 1, "dbl": 0.125})]
    ms = {  # (variant, grad): (fwd, bwd, dbl, accurate)
        ("transpose", "aten"): (1.0, 3.0, 40.0, True), ("transpose", "gradfix"): (1.0, 3.1, 8.0, True),
        ("subpixel-fused", "aten"): (0.4, 1.5, 30.0, True), ("subpixel-fused", "gradfix"): (0.4, 1.6, 6.0, True),
        ("zero-insert-fused", "aten"): (0.1, 0.2, 1.0, False), ("zero-insert-fused", "gradfix"): (0.1, 0.2, 1.0, False),
    }
    rows = []
    for (variant, grad), (fwd, bwd, dbl, ok) in ms.items():
        for mode, t in (("fwd", fwd), ("bwd", bwd), ("dbl", dbl)):
            if mode == "fwd" and grad == "gradfix":
                continue
            rows.append({"case": "G.up", "purpose": "train", "knob": "up", "variant": variant, "grad": grad,
                         "dtype": "bf16", "layout": "CL", "mode": mode, "ms": t, "ok": ok})
    for variant, t in (("transpose", 2.0), ("subpixel", 1.0), ("subpixel-fused", 3.0)):
        rows.append({"case": "G1024.b64", "purpose": "infer", "knob": "up", "variant": variant, "grad": "aten",
                     "dtype": "bf16", "layout": "NCHW", "mode": "fwd", "ms": t, "ok": True})
    best = bench.pick_best(rows, cases)
    assert best["train"]["up"] == {"variant": "subpixel-fused", "grad": "gradfix"}   # inaccurate one excluded
    ranking = best["ranking"]["train.up"]
    assert ranking[0]["speedup"] == pytest.approx((1 + 3 + 40 / 8) / (0.4 + 1.6 + 6 / 8))
    assert all(r["variant"] != "zero-insert-fused" for r in ranking)
    assert best["infer"]["up"] == {"variant": "subpixel"}
    assert bench.combo(best, "train", grad="aten") == {"up": "subpixel-fused", "grad": "aten"}
