"""FP8 (torchao float8, Ada/Hopper). On the CPU: the exact skip reason, the size filter, and torchao's real
float8 quantization, FP8 matmuls and tracing (only its GPU gate lifted). On the GPU (marked gpu): a 4096-wide
MLP in FP8 within 8 % relative error of bf16, and a UNet with 1280-wide attention under compile within 15 %.

Tolerances come from the same torchao quantization run on the CPU (torch._scaled_mm has a CPU kernel):
the 2-layer 4096 MLP is 5.3 % from bf16 (e4m3 keeps 3 mantissa bits: ~3.7 % per quantized GEMM, and the
second layer compounds the first), the 1280-wide UNet 1.9 %."""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from optim import fp8
from tests.optim_helpers import CPU, prepared, rel_err

CPU_REASON = "FP8 needs compute capability 8.9 or newer (Ada/Hopper); this machine has no CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU skip reason")
def test_cpu_skip_reason_is_exact(testdata):
    assert fp8.unavailable_reason(CPU) == CPU_REASON
    _, report = prepared(testdata, "sg2_uncond_32", Flags(fp8=True))
    assert report["fp8"] == {"applied": False, "reason": CPU_REASON}


def test_size_filter():
    L = torch.nn.Linear
    assert fp8.selects(L(1024, 1024)) and fp8.selects(L(1280, 5120))
    assert not fp8.selects(L(320, 1280))                  # too small to gain
    assert not fp8.selects(L(1024, 1000))                 # FP8 GEMM wants multiples of 16
    assert not fp8.selects(torch.nn.Conv2d(1024, 1024, 3))
    assert fp8.selects(L(64, 64), min_features=64)


def test_fp8_linear_boundary_keeps_the_callers_dtype():
    """The wrapper around a quantized layer: bf16 inside, autocast off, the caller's dtype outside."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    wrapped = fp8.FP8Linear(lin)
    x = torch.randn(4, 64)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, torch.is_autocast_enabled("cpu"))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = wrapped(x)
    assert y.dtype == torch.float32 and seen == [(torch.bfloat16, False)]
    assert rel_err(torch.nn.functional.linear(x, lin.weight.float(), lin.bias.float()), y) < 1e-2
    assert wrapped.weight is lin.weight and wrapped.in_features == 64


@pytest.fixture
def torchao_fp8_anywhere(monkeypatch):
    """torchao's float8 workflow asserts an sm89+ GPU before doing anything, although its tensor subclass
    and torch._scaled_mm both run on the CPU. Lifting only that assert lets a CPU run the real quantize_,
    the real FP8 matmuls and the real tracing; everything else is torchao's own code."""
    quant_api = pytest.importorskip("torchao.quantization.quant_api")
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularities: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_quantize_linears_with_real_torchao_float8(torchao_fp8_anywhere):
    from torchao.quantization import Float8Tensor

    L = torch.nn.Linear
    torch.manual_seed(0)
    net = torch.nn.Sequential(L(64, 64), torch.nn.GELU(), L(64, 48), L(48, 40)).eval().requires_grad_(False)
    x = torch.randn(2, 5, 64)                            # (batch, tokens, features), as attention projections see it
    with torch.no_grad():
        ref = net(x)
    layers, kept = fp8.quantize_linears(net, min_features=48)
    assert layers == ["0", "2"] and kept == 1            # 48 -> 40: below the filter (and not a multiple of 16)
    assert isinstance(net[0], fp8.FP8Linear) and isinstance(net[3], L) and net[3].weight.dtype == torch.float32
    w = net[2].inner.weight
    assert isinstance(w, Float8Tensor) and w.qdata.dtype == torch.float8_e4m3fn and w.dtype == torch.bfloat16
    assert w.scale.shape == (48, 1)                      # one scale per output row
    with torch.no_grad():
        out = net(x)
        # fullgraph: the dtype boundary (autocast off, casts) and the tensor subclass trace without a graph
        # break, so under torch.compile the quantize + scaled matmul land in one graph
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 40)
    assert 0.005 < rel_err(ref, out) < 0.08              # FP8 really ran (bf16 alone is ~0.3 %), and stays close
    # compiled against eager: the same FP8 computation, to rounding (not bit for bit: a traced graph may
    # order or fuse the scaling differently); a compiled graph that lost the FP8 path would be >= 0.5 % off
    assert rel_err(out, compiled) < 1e-3


def _big_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(320, 1280), norm_num_groups=32,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                                cross_attention_dim=1024, attention_head_dim=8).eval().requires_grad_(False)


@pytest.mark.gpu
def test_gpu_fp8_mlp_close_to_bf16():
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
    mlp = mlp.to(cuda, torch.bfloat16).eval()
    x = torch.randn(256, 4096, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x).float()
        layers, kept = fp8.quantize_linears(mlp)
        out = torch.compile(mlp)(x).float()
    assert layers == ["0", "2"] and kept == 0
    assert rel_err(ref, out) < 0.08                      # 5.3 % measured with the same quantization on the CPU


@pytest.mark.gpu
def test_gpu_fp8_unet_under_compile(tmp_path):
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    from optim.prune import unet_probe_inputs

    ref_unet = _big_unet().to(cuda, torch.bfloat16)
    inputs = unet_probe_inputs(ref_unet, cuda)
    with torch.no_grad():
        ref = ref_unet(**inputs).sample.float()
    unet = _big_unet().to(cuda, torch.bfloat16)
    unet, report = optim.prepare(unet, Flags(precision="bf16", fp8=True, compile="default"), cuda, kind="diffusion",
                                 cache_dir=tmp_path)
    r = report["fp8"]
    assert r["applied"], r
    assert r["fp8_layers"] == len(r["layers"]) > 0 and r["kept_bf16_layers"] > 0
    base = _big_unet()
    for name in r["layers"]:                                # every FP8 layer passed the size filter
        assert fp8.selects(base.get_submodule(name))
    assert "convolutions" in r and "warning" not in r      # compiled, so no eager-speed warning
    with torch.no_grad():
        out = unet(**inputs).sample.float()
    assert rel_err(ref, out) < 0.15


@pytest.mark.gpu
def test_gpu_fp8_stylegan_is_unsupported_with_reason(testdata):
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    _, report = prepared(testdata, "sg2_uncond_32", Flags(fp8=True), device=cuda)
    assert report["fp8"]["applied"] is False and "modulated" in report["fp8"]["reason"]
