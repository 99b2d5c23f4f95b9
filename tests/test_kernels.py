"""The fused StyleGAN kernels (models/fir_triton.py, models/kernels.py) against the reference ops.

On the CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py), so these tests
check the very kernel source the GPU compiles; the `gpu` tests repeat the checks on CUDA with
the real NVlabs pickles and the full-size layer shapes.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from core.errors import InputError
from models import fir_triton, kernels, ops
from models import stylegan3 as sg3
from models.nvlabs_pickle import read_network_pickle
from models.stylegan import build_generator

triton = pytest.importorskip("triton", reason="Triton is not installed (requirements-dev.txt pins it)")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


# -- the 1-D kernel against upfirdn2d's float64 reference ---------------------------------------

CASES = [  # up, down, taps, pad0, pad1
    (1, 1, 4, 2, 1), (2, 1, 4, 2, 1), (1, 2, 4, 1, 1), (2, 1, 12, 6, 5), (1, 2, 12, 0, 0),
    (2, 2, 12, 5, 4), (1, 1, 3, -1, 2), (4, 1, 8, 3, 4),
]


@pytest.mark.parametrize("up,down,taps,p0,p1", CASES, ids=[f"u{c[0]}d{c[1]}t{c[2]}p{c[3]}_{c[4]}" for c in CASES])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_upfirdn2d_triton_matches_the_reference(up, down, taps, p0, p1, channels_last):
    g = torch.Generator().manual_seed(taps * 7 + up + 3 * down)
    x = torch.randn(2, 5, 17, 15, generator=g)
    f = torch.randn(taps, generator=g)
    pad = [p0, p1, p0 + 1, p1]              # x and y padded differently: catches swapped axes
    want = ops.upfirdn2d(x.double(), f.double(), up=up, down=down, padding=pad, gain=1.7)
    xi = x.to(DEV)
    if channels_last:
        xi = xi.contiguous(memory_format=torch.channels_last)
    with ops.use_impl(fir="triton"), torch.no_grad():
        got = ops.upfirdn2d(xi, f.to(DEV), up=up, down=down, padding=pad, gain=1.7)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)], ids=["bf16", "fp16"])
def test_half_inputs_are_summed_in_float32(dtype, tol):
    # A 16-bit running sum would round after each of 12 taps; float32 sums leave only the
    # rounding of the input and of the output.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 16, 16, generator=g)
    f = torch.randn(12, generator=g)
    want = ops.upfirdn2d(x.to(dtype).double(), f.double(), up=2, padding=[5, 5, 5, 5])
    with ops.use_impl(fir="triton"), torch.no_grad():
        got = ops.upfirdn2d(x.to(DEV, dtype), f.to(DEV), up=2, padding=[5, 5, 5, 5])
    assert got.dtype == dtype and rel(got, want) < tol


def test_fused_bias_activation_gain_and_clamp():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 9, 10, generator=g) * 3
    b = torch.randn(4, generator=g)
    c = torch.randn(6, generator=g)
    # reference: bias on the input, zero-insert by 2, pad, correlate along W, lrelu, gain, clamp
    z = x.double() + b.double().view(1, 4, 1, 1)
    up = torch.zeros(2, 4, 9, 20, dtype=torch.float64)
    up[..., ::2] = z
    up = torch.nn.functional.pad(up, [3, 2])
    ref = sum(c[k].double() * up[..., k:k + up.shape[-1] - 5] for k in range(6))
    ref = (torch.where(ref >= 0, ref, ref * 0.2) * 1.4).clamp(-2.5, 2.5)
    got = fir_triton.fir1d(x.to(DEV), c.to(DEV), dim=3, up=2, pad0=3, pad1=2, bias=b.to(DEV), bias_div=9,
                           slope=0.2, act_gain=1.4, clamp=2.5)
    assert got.shape == ref.shape
    assert rel(got, ref) < 1e-6
    assert float(got.abs().max()) <= 2.5


def test_every_output_element_is_written():
    # Poison a preallocated output: any element the grid misses keeps its NaN.
    x = torch.randn(3, 7, 29, 5, device=DEV)
    taps = torch.randn(5, device=DEV)
    for dim in (1, 2, 3):
        L = x.shape[dim]
        shape = list(x.shape)
        shape[dim] = fir_triton.out_length(L, 5, 2, 1, 2, 2)
        out = torch.full(shape, float("nan"), device=DEV)
        fir_triton._launch(x, taps, dim, 2, 1, 2, 2, None, 1, None, 1.0, None, out=out)
        assert torch.isfinite(out).all(), f"dim {dim}: unwritten outputs"


def test_bad_sizes_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="output length"):
        fir_triton.fir1d(torch.randn(1, 1, 4, 4, device=DEV), torch.ones(12, device=DEV), dim=3)


def test_the_custom_op_is_registered_for_compile_and_cuda_graphs():
    x = torch.randn(1, 2, 8, 8, device=DEV)
    c = torch.randn(4, device=DEV)
    got = fir_triton.fir1d_op(x, c, dim=2, pad0=2, pad1=1)
    assert hasattr(torch.ops.atelier, "fir1d")
    assert rel(got, fir_triton.fir1d(x, c, dim=2, pad0=2, pad1=1)) == 0.0   # same kernel, same input


def test_autograd_falls_back_to_the_differentiable_reference():
    x = torch.randn(1, 3, 8, 8, device=DEV, requires_grad=True)
    f = ops.setup_filter([1, 3, 3, 1], device=DEV)
    with ops.use_impl(fir="triton"):
        y = ops.upsample2d(x, f)
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# -- StyleGAN3's filtered leaky ReLU --------------------------------------------------------------

@pytest.mark.parametrize("up,down,taps", [(2, 2, 12), (1, 2, 6), (2, 1, 8), (1, 1, 6)])
def test_filtered_lrelu_triton_matches_the_reference(up, down, taps):
    g = torch.Generator().manual_seed(up * 10 + down)
    x = torch.randn(2, 4, 18, 18, generator=g) * 2
    fu = sg3.design_lowpass_filter(taps, 4, 2, 32) if up > 1 else None
    fd = sg3.design_lowpass_filter(taps, 4, 2, 32) if down > 1 else None
    b = torch.randn(4, generator=g)
    pad = taps - 1
    args = dict(up=up, down=down, padding=[pad, pad - 1, pad, pad - 1], gain=math.sqrt(2), slope=0.2, clamp=2.0)
    want = sg3.filtered_lrelu(x.double(), *(t.double() if t is not None else None for t in (fu, fd, b)), **args)
    with ops.use_impl(fir="triton"), torch.no_grad():
        got = sg3.filtered_lrelu(x.to(DEV), *(t.to(DEV) if t is not None else None for t in (fu, fd, b)), **args)
    assert got.shape == want.shape
    assert rel(got, want) < 1e-6


# -- whole generators: the fast path against the reference ops ------------------------------------

def _tiny(arch):
    from bench.specs import _SG2_TINY, _SG3T_TINY

    torch.manual_seed(0)
    kw = dict(_SG2_TINY if arch == "stylegan2" else _SG3T_TINY, num_fp16_res=0)
    return build_generator(arch, kw).to(DEV).eval().requires_grad_(False)


@pytest.mark.parametrize("arch", ["stylegan2", "stylegan3"])
def test_auto_kernels_give_the_reference_image(arch):
    G = _tiny(arch)
    z = torch.randn(3, G.z_dim, generator=torch.Generator().manual_seed(5)).to(DEV)
    c = torch.zeros(3, G.c_dim, device=DEV)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False    # on by default for CUDA convolutions: a 3e-4 difference
    try:
        with torch.no_grad():
            want = G(z, c, noise_mode="const")
            with ops.use_impl(fir="triton", up="subpixel-fused", modconv="auto"):
                got = G(z, c, noise_mode="const")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert rel(got, want) < 1e-5


def test_modulated_activations_equal_fused_weights_at_batch_above_one():
    # modconv=auto at N > 1 scales the activations around one shared conv instead of N grouped
    # per-sample weights; the same numbers (float64, so only the order of sums differs).
    g = torch.Generator().manual_seed(3)
    x, w, s = torch.randn(4, 6, 9, 9, generator=g), torch.randn(5, 6, 3, 3, generator=g), torch.randn(4, 6, generator=g)
    want = ops.modulated_conv2d(x.double(), w.double(), s.double(), padding=1)
    with ops.use_impl(modconv="auto"):
        got = ops.modulated_conv2d(x.double(), w.double(), s.double(), padding=1)
    assert rel(got, want) < 1e-12
    sg3_want = sg3.modulated_conv2d(x.double(), w.double(), s.double(), padding=1, demodulate=True)
    with ops.use_impl(modconv="auto"):
        sg3_got = sg3.modulated_conv2d(x.double(), w.double(), s.double(), padding=1, demodulate=True)
    assert rel(sg3_got, sg3_want) < 1e-6       # StyleGAN3 builds its weights in float32 either way


NVLABS = ["sg2_uncond_32", "sg2_cond4_64_fp16", "sg3t_uncond_32", "sg3r_uncond_32"]


@pytest.mark.parametrize("n", [1, 4])
def test_modulated_activations_at_every_batch_equal_fused_weights(n):
    # modconv=activations modulates the activations at batch 1 too; its demodulation is one
    # [N, I] x [I, O] product instead of a sum over per-sample weights: the same numbers.
    g = torch.Generator().manual_seed(5)
    x, w, s = (torch.randn(n, 6, 9, 9, generator=g), torch.randn(5, 6, 3, 3, generator=g),
               torch.randn(n, 6, generator=g))
    x, w, s = x.double(), w.double(), s.double()
    want = ops.modulated_conv2d(x, w, s, padding=1)
    with ops.use_impl(modconv="activations"):
        assert rel(ops.modulated_conv2d(x, w, s, padding=1), want) < 1e-12
    gain = torch.rand(6, generator=g).double()
    sg3_want = sg3.modulated_conv2d(x, w, s, padding=1, input_gain=gain)
    with ops.use_impl(modconv="activations"):
        assert rel(sg3.modulated_conv2d(x, w, s, padding=1, input_gain=gain), sg3_want) < 1e-6


@pytest.mark.parametrize("n, in_ch, out_ch, k", [(1, 13, 11, 3), (2, 16, 3, 1), (1, 8, 24, 3)])
def test_nhwc_modulated_conv_with_ragged_channels_gives_the_same_numbers(n, in_ch, out_ch, k):
    # modconv=activations-nhwc pads StyleGAN3's ragged channel counts (323, 203, 81, 51) to multiples of 8
    # with zero channels, runs the conv channels-last and hands NCHW back: the same sums.
    g = torch.Generator().manual_seed(in_ch * 10 + out_ch)
    x, w, s = (torch.randn(n, in_ch, 10, 9, generator=g).double(), torch.randn(out_ch, in_ch, k, k, generator=g).double(),
               torch.randn(n, in_ch, generator=g).double())
    gain = torch.rand(in_ch, generator=g).double()
    for demodulate in (True, False):
        want = sg3.modulated_conv2d(x, w, s, demodulate=demodulate, padding=k - 1, input_gain=gain)
        with ops.use_impl(modconv="activations-nhwc"):
            got = sg3.modulated_conv2d(x, w, s, demodulate=demodulate, padding=k - 1, input_gain=gain)
        assert got.shape == want.shape and got.is_contiguous()          # NCHW for the fused FIR kernel
        assert rel(got, want) < 1e-6
    # StyleGAN2 takes the choice as modulated activations.
    with ops.use_impl(modconv="activations-nhwc"):
        got2 = ops.modulated_conv2d(x, w, s, padding=k // 2)
    assert rel(got2, ops.modulated_conv2d(x, w, s, padding=k // 2)) < 1e-12


@pytest.mark.parametrize("out_ch, stride, padding", [(3, 1, 0), (5, 2, 1), (13, 1, 1)])
def test_output_channels_padded_to_eight_give_the_plain_conv(out_ch, stride, padding):
    # ToRGB's 3 output channels: fp16/bf16 convs on CUDA pad them to 8 by zero weight rows (ops._convolution).
    g = torch.Generator().manual_seed(out_ch)
    x = torch.randn(2, 16, 11, 12, generator=g).double().to(memory_format=torch.channels_last)
    w = torch.randn(out_ch, 16, 3 if padding else 1, 3 if padding else 1, generator=g).double()
    got = ops.padded_out_conv2d(x, w, stride=stride, padding=padding)
    want = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
    assert got.shape == want.shape
    assert rel(got, want) < 1e-12


def test_demodulation_stays_float32_under_bf16_autocast():
    # The unfused demodulation product must not drop to bf16 with the convolutions.
    g = torch.Generator().manual_seed(6)
    x, w, s = torch.randn(2, 64, 6, 6, generator=g), torch.randn(8, 64, 3, 3, generator=g), torch.randn(2, 64, generator=g)
    seen = []
    real = torch.Tensor.rsqrt

    def spy(t):
        seen.append(t.dtype)
        return real(t)
    with ops.use_impl(modconv="activations"), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.Tensor.rsqrt = spy
        try:
            ops.modulated_conv2d(x, w, s, padding=1)
        finally:
            torch.Tensor.rsqrt = real
    assert seen == [torch.float32]


@pytest.mark.parametrize("name, modconv", [(n, None) for n in NVLABS] + [(n, "activations") for n in NVLABS[:3:2]]
                         + [(n, "activations-nhwc") for n in NVLABS[2:]])
def test_nvlabs_pickles_reproduce_through_the_fast_path(name, modconv, testdata):
    """The fused path in fp32 still gives NVlabs' own outputs within 1e-4 (as the reference ops do)."""
    from models.stylegan import _generator_from_record

    rec = read_network_pickle(testdata / "stylegan" / f"{name}.pkl")["G_ema"]
    G, arch = _generator_from_record(rec)
    G = G.to(DEV).eval().requires_grad_(False)
    extra = {"force_fp32": True} if arch == "stylegan2" else {}     # the references are fp32 throughout
    refs = np.load(testdata / "stylegan" / f"{name}_ref.npz")
    key = sorted(refs.files)[0]
    seed_part, psi_part = key.split("_psi")
    seed = int(seed_part.removeprefix("seed"))
    z = torch.from_numpy(np.random.RandomState(seed).randn(1, G.z_dim).astype(np.float32)).to(DEV)
    c = torch.zeros([1, G.c_dim], device=DEV)
    if G.c_dim:
        c[0, seed % G.c_dim] = 1
    choice, _ = kernels.resolve("auto", "cuda")        # what a CUDA GPU runs
    if modconv:
        choice = dict(choice, modconv=modconv)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad(), ops.use_impl(**choice):
            out = G(z, c, truncation_psi=float(psi_part), truncation_cutoff=None, noise_mode="const", **extra)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    out = out[0].float().cpu().numpy()
    ref = refs[key]
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err < 1e-4, f"{name} {key}: relative error {err:.2e}"


# -- the `kernels` setting -----------------------------------------------------------------------

def test_spec_parsing_and_clear_errors():
    assert kernels.parse("auto") == "auto" and kernels.parse("reference") == "reference"
    assert kernels.parse("fir:triton/up:subpixel-fused") == {"fir": "triton", "up": "subpixel-fused"}
    for bad in ("fir:cuda", "blur:triton", "fir", "fir:triton/"):
        with pytest.raises(InputError, match="knob:choice"):
            kernels.parse(bad)


def test_auto_is_the_reference_on_a_cpu_and_says_why(monkeypatch):
    choice, note = kernels.resolve("auto", "cpu")
    assert choice == {} and "CUDA" in note
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choice, note = kernels.resolve("auto", "cpu")
    assert choice == {} and "CUDA" in note
    choice, note = kernels.resolve("fir:triton", "cpu")
    assert choice == {"fir": "triton"} and "falls back" in note
    choice, _ = kernels.resolve("auto", "cuda")
    assert choice["up"] == "subpixel-fused" and choice["modconv"] == "auto"
    # Compiled half precision modulates activations, StyleGAN3's convs channels-last (measured on an H200).
    for precision in ("fp16", "bf16"):
        choice, note = kernels.resolve("auto", "cuda", compiled=True, precision=precision)
        assert choice["modconv"] == "activations-nhwc" and "activations-nhwc" in note
    choice, _ = kernels.resolve("auto", "cuda", compiled=True, precision="fp32")
    assert choice["modconv"] == "auto" and "up" not in choice


def test_pipeline_reports_the_kernels_it_runs(tmp_path):
    from core.types import OptimizationFlags
    from pipelines.stylegan import StyleGANPipeline
    from models.stylegan import LoadedGenerator

    G = _tiny("stylegan2").cpu()
    loaded = LoadedGenerator(G=G, arch="stylegan2", config={}, source=tmp_path / "tiny", sha256="0" * 64)
    pipe = StyleGANPipeline(loaded, OptimizationFlags(kernels="fir:triton/modconv:auto"), torch.device("cpu"))
    rep = pipe.optimizations["kernels"]
    assert rep["applied"] and rep["ops"] == {"fir": "triton", "modconv": "auto"}
    with pytest.raises(InputError, match="knob:choice"):
        StyleGANPipeline(loaded, OptimizationFlags(kernels="fir:nope"), torch.device("cpu"))


@pytest.mark.gpu
def test_full_size_layers_on_cuda_match_in_bf16():
    """StyleGAN3-T 1024's widest filtered_lrelu in bf16: the fused kernel is as close to fp32 as bf16 allows."""
    x = torch.randn(1, 32, 276, 276, device="cuda")
    fu = sg3.design_lowpass_filter(12, 256, 128, 1024).cuda()
    b = torch.randn(32, device="cuda")
    args = dict(up=2, down=2, padding=[11, 10, 11, 10], gain=math.sqrt(2), slope=0.2, clamp=256.0)
    with torch.no_grad():
        want = sg3.filtered_lrelu(x.double(), fu.double(), fu.double(), b.double(), **args)
        with ops.use_impl(fir="triton"):
            got = sg3.filtered_lrelu(x.bfloat16(), fu, fu, b, **args)
    assert got.dtype == torch.bfloat16 and rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_padded_convs_on_cuda_half_match_float64(dtype):
    """The CUDA half-precision paths that pad channels: ToRGB's 3 outputs (ops._convolution) and
    StyleGAN3's ragged channels (modconv=activations-nhwc), against float64."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 81, 40, 40, generator=g)
    w = torch.randn(51, 81, 3, 3, generator=g)
    s = torch.randn(1, 81, generator=g)
    want = sg3.modulated_conv2d(x.double(), w.double(), s.double(), padding=2)
    with ops.use_impl(modconv="activations-nhwc"), torch.no_grad():
        got = sg3.modulated_conv2d(x.cuda().to(dtype), w.cuda(), s.cuda(), padding=2)
    assert got.dtype == dtype and got.is_contiguous() and rel(got, want) < 1e-2
    xr = torch.randn(1, 32, 64, 64, generator=g).cuda().to(dtype).to(memory_format=torch.channels_last)
    wr = torch.randn(3, 32, 1, 1, generator=g).cuda().to(dtype)
    got = ops._convolution(xr, wr)
    assert got.shape == (1, 3, 64, 64)
    assert rel(got, torch.nn.functional.conv2d(xr.double(), wr.double())) < 1e-2
