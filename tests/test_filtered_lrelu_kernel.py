"""The fused filtered_lrelu Triton kernel (models/filtered_lrelu_triton.py) against the float64 reference.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py): the
very source the GPU compiles, at small shapes so the file runs in well under a minute on 2 cores.
The NVlabs pickles through the fast path (which now includes this kernel) are checked by
tests/test_kernels.py::test_nvlabs_pickles_reproduce_through_the_fast_path.
"""
from __future__ import annotations

import math

import pytest
import torch

from models import filtered_lrelu_triton as flt
from models import ops
from models import stylegan3 as sg3

triton = pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt pins it)")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _filter(taps: int, radial: bool = False) -> torch.Tensor | None:
    return sg3.design_lowpass_filter(taps, 4, 2, 32, radial=radial) if taps > 1 else None


def _reference(x, fu, fd, b, **args) -> torch.Tensor:
    """The nc1 reference path in float64 (what NVlabs' `_filtered_lrelu_ref` computes)."""
    d = [t.double() if t is not None else None for t in (fu, fd, b)]
    with ops.use_impl(fir="grouped"):
        return sg3.filtered_lrelu(x.double(), *d, **args)


# (up, down, up taps, down taps, padding [x0, x1, y0, y1], input H, W): StyleGAN3-T/R's layers first.
CASES = [
    (2, 2, 12, 12, [9, 8, 9, 8], 22, 22),        # T, same rate (conv 3x3 output of a 20^2 layer)
    (4, 2, 24, 12, [-6, -9, -6, -9], 19, 21),    # T, rate doubles (the crop of the upsampled image)
    (2, 2, 12, 12, [-11, -12, -11, -12], 27, 26), # T's last layer: crop of the margin
    (2, 2, 12, 12, [11, 10, 11, 10], 17, 18),    # R (1x1 convs), separable critical layers
    (4, 2, 24, 12, [-2, -5, -2, -5], 13, 15),    # R, rate doubles
    (1, 1, 1, 1, [0, 0, 0, 0], 9, 11),           # ToRGB: bias + clamp only
    (2, 1, 8, 1, [4, 3, 5, 3], 11, 9),           # generic: no down filter, odd padding, px != py
    (1, 2, 1, 6, [3, 2, 2, 3], 13, 12),          # generic: no up filter
    (1, 1, 6, 6, [5, 5, 4, 6], 10, 12),          # generic: filters at rate 1
    (1, 4, 1, 8, [3, 4, 3, 4], 21, 18),          # generic: down 4
]
IDS = [f"u{c[0]}d{c[1]}t{c[2]}-{c[3]}p{c[4][0]}_{c[4][1]}" for c in CASES]


@pytest.mark.parametrize("up,down,tu,td,pad,h,w", CASES, ids=IDS)
def test_fused_kernel_matches_the_float64_reference(up, down, tu, td, pad, h, w):
    g = torch.Generator().manual_seed(up * 100 + down * 10 + tu)
    x = torch.randn(2, 3, h, w, generator=g) * 2
    fu, fd, b = _filter(tu), _filter(td), torch.randn(3, generator=g)
    torgb = tu == 1 and td == 1
    args = dict(up=up, down=down, padding=pad, gain=1.0 if torgb else math.sqrt(2), slope=1.0 if torgb else 0.2,
                clamp=2.5)
    want = _reference(x, fu, fd, b, **args)
    cfgs = flt.configs(up, down, tu, td)
    # The default tile, and the one with the fewest outputs a tile: several tiles per image, so
    # tile edges and the halo are checked too.
    for cfg in {cfgs[0], min(cfgs, key=lambda c: c[3])}:
        got = flt.filtered_lrelu(x.to(DEV), *(t.to(DEV) if t is not None else None for t in (fu, fd, b)),
                                 config=cfg, **args)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert rel(got, want) < 1e-6, f"config {cfg}: {rel(got, want):.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)], ids=["bf16", "fp16"])
def test_half_inputs_are_summed_in_float32(dtype, tol):
    # The input and the output are rounded to 16 bits; the 2 x 12 x 12 taps in between are summed in
    # float32 (a 16-bit running sum would round after every one). The bias is rounded as the op rounds it.
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1, 4, 22, 22, generator=g) * 2).to(dtype)
    fu, b = _filter(12), torch.randn(4, generator=g).to(dtype)
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    want = _reference(x, fu, fu, b, **args)
    with ops.use_impl(fir="triton"), torch.no_grad():
        got = sg3.filtered_lrelu(x.to(DEV), fu.to(DEV), fu.to(DEV), b.to(DEV), **args)
    assert got.dtype == dtype and rel(got, want) < tol


@pytest.mark.parametrize("variant", [
    dict(bias=False), dict(slope=1.0), dict(gain=1.0), dict(clamp=None), dict(clamp=0.3), dict(slope=0.0, gain=3.0),
], ids=["no-bias", "linear", "gain1", "no-clamp", "tight-clamp", "relu-gain3"])
def test_bias_activation_gain_and_clamp_variants(variant):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 16, 17, generator=g) * 2
    fu = _filter(12)
    b = None if variant.get("bias") is False else torch.randn(3, generator=g)
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=1.5)
    args.update({k: v for k, v in variant.items() if k != "bias"})
    want = _reference(x, fu, fu, b, **args)
    got = flt.filtered_lrelu(x.to(DEV), fu.to(DEV), fu.to(DEV), None if b is None else b.to(DEV), **args)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("up,down,tu,td", [(2, 2, 12, 12), (4, 2, 24, 12), (1, 1, 1, 1)], ids=["u2d2", "u4d2", "u1d1"])
def test_every_output_element_is_written(up, down, tu, td):
    # Poison a preallocated output: any element no tile stores keeps its NaN.
    x = torch.randn(2, 2, 23, 19, device=DEV)
    fu, fd = (None if f is None else f.to(DEV) for f in (_filter(tu), _filter(td)))
    pad = [5, 4, 6, 4] if up > 1 else [0, 0, 0, 0]
    ho = flt.out_size(23, up, down, tu, td, pad[2], pad[3])
    wo = flt.out_size(19, up, down, tu, td, pad[0], pad[1])
    for cfg in flt.configs(up, down, tu, td)[:3]:
        out = torch.full([2, 2, ho, wo], float("nan"), device=DEV)
        flt.filtered_lrelu(x, fu, fd, None, up=up, down=down, padding=pad, config=cfg, out=out)
        assert torch.isfinite(out).all(), f"config {cfg}: unwritten outputs"


def test_channels_last_input_is_read_as_nchw_and_gives_the_same_numbers():
    # Channels-last tiles load strided by C (3x slower on the H200), so the op makes its input NCHW.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 14, 14, generator=g)
    fu, b = _filter(12), torch.randn(5, generator=g)
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    want = _reference(x, fu, fu, b, **args)
    xi = x.to(DEV).contiguous(memory_format=torch.channels_last)
    assert not xi.is_contiguous()
    got = flt.filtered_lrelu(xi, fu.to(DEV), fu.to(DEV), b.to(DEV), **args)
    assert got.is_contiguous()
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("spec, want", [
    ("bfloat16=tf32,float32=ieee", {torch.bfloat16: "tf32", torch.float32: "ieee"}),
    (" float16 = fp16 ,", {torch.float16: "fp16"}),
    ("", {}),
])
def test_dot_precision_override_is_read_from_the_environment_spec(spec, want):
    assert flt._dot_overrides(spec) == want


@pytest.mark.parametrize("spec", ["bfloat16=fp8", "half16=fp16", "bfloat16"])
def test_a_bad_dot_precision_override_names_the_item_and_the_form(spec):
    with pytest.raises(ValueError, match="ATELIER_FLRELU_DOT.*e.g. bfloat16=fp16"):
        flt._dot_overrides(spec)


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="output size"):
        flt.filtered_lrelu(torch.randn(1, 1, 2, 2, device=DEV), _filter(12).to(DEV), _filter(12).to(DEV), None,
                           up=2, down=2, padding=[-6, -6, -6, -6])


# -- dispatch: which path stylegan3.filtered_lrelu takes ---------------------------------------------

def _count_calls(monkeypatch) -> dict[str, int]:
    """Count the calls of the fused op, the four 1-D passes and the nc1 reference (they still run)."""
    calls = {"fused": 0, "1d": 0, "nc1": 0}

    def counted(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(flt, "filtered_lrelu_op", "fused")
    counted(sg3, "_filtered_lrelu_triton", "1d")
    counted(sg3, "_filtered_lrelu_nc1", "nc1")
    return calls


def test_dispatch_fused_1d_and_fallbacks(monkeypatch):
    calls = _count_calls(monkeypatch)
    x = torch.randn(1, 2, 16, 16, device=DEV)
    fu, b = _filter(12).to(DEV), torch.randn(2, device=DEV)
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    with torch.no_grad():
        with ops.use_impl(fir="triton"):
            fused = sg3.filtered_lrelu(x, fu, fu, b, **args)
        assert calls == {"fused": 1, "1d": 0, "nc1": 0}
        with ops.use_impl(fir="triton-1d"):          # the four 1-D passes, kept for A/B runs
            passes = sg3.filtered_lrelu(x, fu, fu, b, **args)
        assert calls == {"fused": 1, "1d": 1, "nc1": 0}
        with ops.use_impl(fir="triton"):             # StyleGAN3-R's radial down filter: the reference
            sg3.filtered_lrelu(x, fu, _filter(12, radial=True).to(DEV), b, **args)
        assert calls == {"fused": 1, "1d": 1, "nc1": 1}
    assert rel(fused, passes) < 1e-6
    # Recording autograd (training): the differentiable reference, and the gradient reaches x.
    xg = x.clone().requires_grad_(True)
    with ops.use_impl(fir="triton"):
        y = sg3.filtered_lrelu(xg, fu, fu, b, **args)
    y.square().sum().backward()
    assert calls["fused"] == 1 and calls["nc1"] == 2 and xg.grad is not None and torch.isfinite(xg.grad).all()
    bg = b.clone().requires_grad_(True)             # only the bias records a gradient: the reference too
    with ops.use_impl(fir="triton"):
        sg3.filtered_lrelu(x, fu, fu, bg, **args).sum().backward()
    assert calls["fused"] == 1 and calls["nc1"] == 3 and bg.grad is not None


def test_the_custom_op_is_registered_for_compile_and_cuda_graphs():
    from models import fir_triton

    fir_triton.ensure_registered()                   # what models.kernels.resolve calls before compiling
    assert hasattr(torch.ops.atelier, "filtered_lrelu") and hasattr(torch.ops.atelier, "fir1d")
    x = torch.randn(1, 2, 12, 12, device=DEV)
    fu, b = _filter(12).to(DEV), torch.randn(2, device=DEV)
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    got = flt.filtered_lrelu_op(x, fu, fu, b, **args)
    assert rel(got, flt.filtered_lrelu(x, fu, fu, b, config=flt.configs(2, 2, 12, 12)[0], **args)) == 0.0


def test_the_kernel_choice_names_the_1d_path():
    from models import kernels

    assert kernels.parse("fir:triton-1d") == {"fir": "triton-1d"}
    from core.errors import InputError

    with pytest.raises(InputError, match="inference-only"):
        kernels.resolve_training("fir:triton-1d", "cpu")


# -- a whole tiny StyleGAN3-T through the fused kernel ----------------------------------------------

def test_tiny_stylegan3_through_the_fused_kernel_gives_the_reference_image(monkeypatch):
    from bench.specs import _SG3T_TINY
    from models.stylegan import build_generator

    torch.manual_seed(0)
    G = build_generator("stylegan3", dict(_SG3T_TINY, num_fp16_res=0)).to(DEV).eval().requires_grad_(False)
    z = torch.randn(2, G.z_dim, generator=torch.Generator().manual_seed(5)).to(DEV)
    c = torch.zeros(2, G.c_dim, device=DEV)
    calls = _count_calls(monkeypatch)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            want = G(z, c, noise_mode="const")
            with ops.use_impl(fir="triton"):
                got = G(z, c, noise_mode="const")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    layers = len(G.synthesis.layer_names)
    assert calls["fused"] == layers and calls["1d"] == 0      # every layer, ToRGB included, ran fused
    assert rel(got, want) < 1e-5


# -- on the GPU: the real sizes, the tensor-core precisions, compile + CUDA graphs ----------------------

@pytest.mark.gpu
@pytest.mark.parametrize("size,up,taps,pad", [(534, 4, 24, [-6, -9, -6, -9]), (1046, 2, 12, [9, 8, 9, 8])],
                         ids=["L10-up4", "L12-up2"])
def test_full_size_layers_on_cuda(size, up, taps, pad):
    """StyleGAN3-T-1024's widest calls: fp32 (tf32x3 dots) as close to float64 as fp32 is, bf16 (tf32 dots)
    as close as bf16 rounding allows and closer than the four 1-D passes (they round each intermediate)."""
    x = torch.randn(1, 32, size, size, device="cuda") * 2
    fu = sg3.design_lowpass_filter(taps, 256, 128, 2048 if up == 4 else 1024).cuda()
    fd = sg3.design_lowpass_filter(12, 256, 128, 1024).cuda()
    b = torch.randn(32, device="cuda")
    args = dict(up=up, down=2, padding=pad, gain=math.sqrt(2), slope=0.2, clamp=256.0)
    with torch.no_grad():
        for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
            xi, bi = x.to(dtype), b.to(dtype)
            want = _reference(xi, fu, fd, bi, **args)
            with ops.use_impl(fir="triton"):
                got = sg3.filtered_lrelu(xi, fu, fd, bi, **args)
            with ops.use_impl(fir="triton-1d"):
                passes = sg3.filtered_lrelu(xi, fu, fd, bi, **args)
            assert got.dtype == dtype and rel(got, want) < tol
            if dtype == torch.bfloat16:
                assert rel(got, want) < rel(passes, want)


@pytest.mark.gpu
def test_compiled_and_graphed_fused_op_gives_the_eager_numbers():
    from models import kernels

    kernels.resolve("fir:triton", "cuda")            # registers the ops before tracing
    x = torch.randn(1, 16, 54, 54, device="cuda")
    fu = sg3.design_lowpass_filter(12, 16, 8, 64).cuda()
    b = torch.randn(16, device="cuda")
    args = dict(up=2, down=2, padding=[9, 8, 9, 8], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    with torch.no_grad(), ops.use_impl(fir="triton"):
        want = sg3.filtered_lrelu(x, fu, fu, b, **args)
        f = torch.compile(lambda t: sg3.filtered_lrelu(t, fu, fu, b, **args), fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            got = f(x)
    assert rel(got, want) < 1e-6


# -- the measured fixed tile for 16-bit dots ---------------------------------------------------------

@pytest.mark.parametrize("up, tu, want", [(2, 12, (32, 64, 32, 21, 4)), (4, 24, (32, 64, 32, 27, 4)),
                                          (1, 1, (64, 64, 64, 64, 4))])
def test_16bit_dots_take_the_measured_tile_and_others_autotune(up, tu, want, monkeypatch):
    down, td = (2, 12) if up > 1 else (1, 1)
    monkeypatch.delenv("ATELIER_FLRELU_AUTOTUNE", raising=False)
    assert flt.fixed_tile(up, down, tu, td, "fp16") == want
    assert flt.fixed_tile(up, down, tu, td, "bf16") == want
    assert want in flt.configs(up, down, tu, td)            # one of the autotuner's own candidates
    for precision in ("tf32", "tf32x3", "ieee"):
        assert flt.fixed_tile(up, down, tu, td, precision) is None
    monkeypatch.setenv("ATELIER_FLRELU_AUTOTUNE", "1")
    assert flt.fixed_tile(up, down, tu, td, "fp16") is None


@pytest.mark.parametrize("up, down, pad", [(2, 2, [9, 8, 9, 8]), (4, 2, [21, 20, 21, 20])])
def test_the_fixed_tile_gives_the_reference_numbers(up, down, pad):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 3, 40, 40, generator=g)
    fu, fd, b = _filter(12 * up // 2), _filter(12), torch.randn(3, generator=g)
    args = dict(up=up, down=down, padding=pad, gain=math.sqrt(2), slope=0.2, clamp=256.0)
    want = _reference(x, fu, fd, b, **args)
    tile = flt.fixed_tile(up, down, fu.shape[0], fd.shape[0], "fp16")
    got = flt.filtered_lrelu(x.to(DEV), fu.to(DEV), fd.to(DEV), b.to(DEV), config=tile, **args)
    assert rel(got, want) < 1e-6
