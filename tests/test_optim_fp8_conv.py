"""FP8 convolutions (optim/fp8_conv.py, ATELIER_FP8_CONV=triton): the Triton implicit-GEMM kernel against a
convolution of the same quantized operands, the static layer against the unquantized one, the swap inside a real
(tiny) diffusers UNet. On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, conftest.py);
the GPU tests run it compiled, under torch.compile and CUDA graphs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import optim
from core.errors import InputError
from core.types import OptimizationFlags as Flags
from optim import fp8, fp8_conv
from optim.targets import resolve
from tests.optim_helpers import CPU, rel_err
from tests.test_optim_fp8 import _big_unet, _big_unet_reference, _graphed_calls, _tiny_unet

CASES = [  # (batch, C, H, W, Cout, kernel, stride, padding, bias, channels_last)
    (2, 32, 7, 5, 48, 3, 1, 1, True, False),
    (1, 64, 9, 8, 16, 3, 2, 1, False, True),
    (2, 32, 6, 6, 32, 1, 1, 0, True, True),
    (1, 96, 5, 7, 64, 3, 1, 1, True, False),
    (1, 32, 8, 8, 32, 3, 2, 1, True, True),
]


def _dequantized_reference(layer: fp8_conv.StaticFP8Conv2d, conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The convolution of exactly the e4m3 values the kernel multiplies, in fp32."""
    xq = layer.quantize_input(x).float() / layer.input_scale_inv                       # NHWC, dequantized
    wq, ws = fp8_conv.quantize_weight(conv.weight)
    k = conv.kernel_size[0]
    wd = (wq.float() * ws[:, None]).reshape(conv.out_channels, k, k, conv.in_channels).permute(0, 3, 1, 2)
    return F.conv2d(xq.permute(0, 3, 1, 2), wd, conv.bias, stride=conv.stride, padding=conv.padding)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}x{c[5]}-s{c[6]}-c{c[1]}-{c[4]}")
def test_kernel_is_the_convolution_of_the_quantized_operands(case):
    n, c, h, w, co, k, stride, pad, bias, cl = case
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w)
    if cl:
        x = x.to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(c, co, k, stride=stride, padding=pad, bias=bias)
    layer = fp8_conv.StaticFP8Conv2d(conv, input_amax=float(x.abs().max()))
    with torch.no_grad():
        got = layer(x)
        want = _dequantized_reference(layer, conv, x)
    assert got.shape == want.shape == conv(x).shape
    assert got.is_contiguous(memory_format=torch.channels_last)
    # the same products summed in another order: fp32 rounding only
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()


def test_static_layer_is_close_to_the_convolution_and_never_overflows():
    torch.manual_seed(1)
    conv = torch.nn.Conv2d(64, 32, 3, padding=1)
    x = torch.randn(2, 64, 6, 6)
    layer = fp8_conv.StaticFP8Conv2d(conv, input_amax=float(x.abs().max()))
    with torch.no_grad():
        assert rel_err(conv(x), layer(x)) < 0.08                 # e4m3's 3 mantissa bits on both operands
        zero = layer(torch.zeros_like(x))                         # an all-zero input gives the bias
        assert torch.allclose(zero, conv.bias.view(1, -1, 1, 1).expand_as(zero), atol=1e-6)
        loud = layer(100 * x)                                     # far beyond the calibrated range: saturates
        assert torch.isfinite(loud).all()
    assert layer.weight.dtype == torch.float8_e4m3fn and "e4m3" in repr(layer)


def test_the_layer_compiles_as_one_graph_around_the_custom_op():
    """torch.compile traces StaticFP8Conv2d with no graph break: the input's quantization and layout as graph
    ops, the kernel as the registered op atelier::conv2d_fp8 (on a GPU inductor also traces into the kernel)."""
    torch.manual_seed(2)
    conv = torch.nn.Conv2d(64, 32, 3, padding=1)
    x = torch.randn(2, 64, 6, 6).to(memory_format=torch.channels_last)
    layer = fp8_conv.StaticFP8Conv2d(conv, float(x.abs().max()))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        want, got = layer(x), compiled(x)
    assert hasattr(torch.ops.atelier, "conv2d_fp8")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_which_convolutions_the_kernel_takes():
    ok = torch.nn.Conv2d(320, 640, 3, padding=1)
    assert fp8_conv.eligible(ok) is None
    assert fp8_conv.eligible(torch.nn.Conv2d(320, 320, 1)) is None
    assert fp8_conv.eligible(torch.nn.Conv2d(320, 320, 3, stride=2, padding=1)) is None
    assert "multiple of 32" in fp8_conv.eligible(torch.nn.Conv2d(4, 320, 3, padding=1))    # conv_in
    assert "narrower" in fp8_conv.eligible(torch.nn.Conv2d(128, 320, 3, padding=1))
    assert "kernel 5" in fp8_conv.eligible(torch.nn.Conv2d(320, 320, 5, padding=2))
    assert "grouped" in fp8_conv.eligible(torch.nn.Conv2d(320, 320, 3, padding=1, groups=2))
    assert "stride" in fp8_conv.eligible(torch.nn.Conv2d(320, 320, 3, stride=3))
    assert "multiple of 32" in fp8_conv.eligible(torch.nn.Conv2d(328, 320, 3, padding=1))
    assert fp8_conv.eligible(torch.nn.Linear(320, 320)) == "not a Conv2d"
    with pytest.raises(ValueError, match="cannot run in the FP8 kernel"):
        fp8_conv.StaticFP8Conv2d(torch.nn.Conv2d(320, 320, 5, padding=2), 1.0)


def test_conv_mode_is_off_unless_asked_and_names_its_choices():
    assert fp8.conv_mode({}) == "off" and fp8.conv_mode({fp8.CONV_ENV: "Triton"}) == "triton"
    with pytest.raises(InputError, match="ATELIER_FP8_CONV must be one of off, triton"):
        fp8.conv_mode({fp8.CONV_ENV: "cudnn"})


def test_a_unets_convolutions_swap_after_calibration_and_stay_close():
    from optim.prune import unet_probe_inputs

    unet = _tiny_unet()
    inputs = unet_probe_inputs(unet, CPU, batch=2)
    with torch.no_grad():
        ref = unet(**inputs).sample
    found = fp8.conv_candidates(unet, CPU, min_channels=64)
    names = found["layers"]
    assert names and "conv_in" not in names and "conv_out" not in names
    shapes: dict = {}
    amax, how = fp8.calibrate(resolve(unet, "diffusion"), names, CPU, steps=2, shapes=shapes)
    assert how["source"].startswith("probe") and set(shapes) == set(names)
    assert all(len(s) == 4 and s[1] == unet.get_submodule(n).in_channels for n, s in shapes.items())
    report = fp8.quantize_convs_static(unet, amax, shapes, CPU, measure=False)
    assert sorted(report["fp8_layers"]) == sorted(names) and report["kept"] == 0
    swapped = [n for n, m in unet.named_modules() if isinstance(m, fp8_conv.StaticFP8Conv2d)]
    assert sorted(swapped) == sorted(names)
    assert isinstance(unet.conv_in, torch.nn.Conv2d) and isinstance(unet.conv_out, torch.nn.Conv2d)
    with torch.no_grad():
        got = unet(**inputs).sample
    assert torch.isfinite(got).all() and rel_err(ref, got) < 0.15, rel_err(ref, got)


def test_off_the_gpu_the_toggle_says_why_convolutions_stay():
    assert "compute capability 10.0" in fp8._conv_note(CPU) and fp8.CONV_ENV in fp8._conv_note(CPU)
    assert "CUDA" in fp8_conv.unavailable_reason("meta")


@pytest.mark.gpu
@pytest.mark.parametrize("select", ["size", "measure"])
def test_gpu_fp8_convolutions_under_compile_and_cuda_graphs(tmp_path, monkeypatch, select):
    """bf16 UNet (SDXL's 320 and 1280 channels), ATELIER_FP8_CONV=triton: its convolutions through the kernel
    (all of them with the size filter; the measured selection reports each shape's cuDNN and FP8 times),
    compiled by inductor with CUDA graphs, no skipped capture, close to the unquantized UNet, finite on zero text."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    monkeypatch.setenv(fp8.CONV_ENV, "triton")
    monkeypatch.setenv(fp8.SELECT_ENV, select)
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    ref, inputs = _big_unet_reference(cuda, torch.bfloat16)
    skips = int(counters["inductor"]["cudagraph_skips"])
    unet, report = optim.prepare(_big_unet().to(cuda, torch.bfloat16),
                                 Flags(precision="bf16", channels_last=True, fp8=True, compile="reduce-overhead"),
                                 cuda, kind="diffusion", cache_dir=tmp_path)
    convs = report["fp8"]["convolutions"]
    assert isinstance(convs, dict) and "fp8_layers" in convs, convs
    n_fp8 = sum(isinstance(m, fp8_conv.StaticFP8Conv2d) for m in getattr(unet, "_orig_mod", unet).modules())
    assert n_fp8 == len(convs["fp8_layers"])
    if select == "size":
        assert n_fp8 > 0
    else:
        rows = convs["selection"]["shapes"]
        assert rows and all(r["cudnn_us"] > 0 and r["fp8_us"] > 0 for r in rows), rows
    out = _graphed_calls(unet, inputs)
    assert int(counters["inductor"]["cudagraph_skips"]) == skips
    assert rel_err(ref, out) < 0.15


_COMPILE_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from optim import fp8_conv

fn = triton.jit(fp8_conv._body())
sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "y_ptr": "*bf16",
       **{n: "i32" for n in ("M", "H", "W", "HO", "WO", "C", "CO", "KTOT")},
       **{n: "constexpr" for n in ("STRIDE", "PAD", "KH", "KW", "HAS_BIAS", "BLOCK_M", "BLOCK_N", "BLOCK_K")}}
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n] != "constexpr"}
consts = {"STRIDE": 1, "PAD": 1, "KH": 3, "KW": 3, "HAS_BIAS": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
try:
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:400]}))
else:
    print(json.dumps({"wgmma": "wgmma" in k.asm["ptx"], "e4m3": ".e4m3.e4m3" in k.asm["ptx"],
                      "async_copies": k.asm["ttgir"].count("async_copy_global_to_local")}))
"""


def test_the_kernel_compiles_for_hopper_to_pipelined_fp8_tensor_core_code():
    """Without a GPU, compile the kernel for SM 9.0 with Triton's own ptxas (as a JIT launch on an H200 with
    16-aligned pointers and sizes would): it must lower to wgmma on e4m3 operands, with the global loads turned
    into pipelined asynchronous copies (none would mean every K step waits on memory). In its own process,
    without TRITON_INTERPRET: the interpreter patches triton.language while this process's other tests run."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if "ptxas" in got.get("error", "").lower():
        pytest.skip(f"Triton cannot compile for CUDA here: {got['error']}")
    assert got.get("wgmma") and got.get("e4m3"), got
    assert got["async_copies"] >= 2, got
