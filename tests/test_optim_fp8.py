"""FP8 (torchao float8, Ada/Hopper). On the CPU: the exact skip reason and the size filter. On the GPU
(marked gpu, tolerances set before measurement, to be confirmed on the H200): a 4096-wide MLP in FP8
within 5 % relative error of bf16, and a UNet with 1280-wide attention under compile within 15 %."""
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
    assert rel_err(ref, out) < 0.05


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
