"""Fused QKV projections (optim/fused_qkv.py) on tiny real SD / SDXL pipelines (CPU, fp32).

The fused and the unfused pipeline compute the same products up to summation order, so their images
agree to float rounding: max |difference| < 1e-4 on [0, 1] images (measured 0 on this CPU; a wrong
split of Q/K/V or a lost bias changes pixels by far more). Refusals (non-SDPA processors, added-KV
UNets) leave the model unfused and say why; StyleGAN is not applicable."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import optim
from core.errors import InputError, OptionalDependencyError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags as Flags
from optim.fused_qkv import STYLEGAN_REASON, fused_layers
from pipelines.diffusion import DiffusionPipeline, load_diffusion
from tests.optim_helpers import CPU, prepared

ATOL = 1e-4
FUSED = Flags(fuse_qkv=True)


def _pipeline(folder, flags) -> DiffusionPipeline:
    return DiffusionPipeline(load_diffusion(str(folder), flags=flags), flags, CPU)


def _image(pipe: DiffusionPipeline) -> np.ndarray:
    params = DiffusionParams(prompt="a photo of a cat", negative_prompt="dog", seed=7, steps=3, guidance=6.0,
                             width=64, height=64)
    return pipe.generate(GenerationRequest("diffusion", pipe.model_id, params), Job()).raw


@pytest.mark.parametrize("arch", ["sd", "sdxl"])
def test_fused_image_equals_unfused_and_reports_applied(tiny_sd_sdxl, arch):
    ref = _image(_pipeline(tiny_sd_sdxl[arch], Flags()))
    pipe = _pipeline(tiny_sd_sdxl[arch], FUSED)
    out = _image(pipe)
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert float(np.abs(out - ref).max()) < ATOL

    r = pipe.optimizations["fuse_qkv"]
    assert r["applied"] and r["processor"] == "FusedAttnProcessor2_0" and r["params_freed"] > 0
    unet = pipe.pipe.unet
    assert fused_layers(unet)["to_qkv"] > 0 and fused_layers(unet)["to_kv"] > 0
    assert r["components"]["unet"] == fused_layers(unet)
    assert r["components"]["vae"] == {"to_qkv": 2, "to_kv": 0}      # the encoder and decoder mid-block attention
    assert {type(p).__name__ for p in unet.attn_processors.values()} == {"FusedAttnProcessor2_0"}
    # the separate projections the fused processor no longer calls are gone (cross-attention keeps to_q)
    for name, m in unet.named_modules():
        if name.endswith("attn1"):
            assert not hasattr(m, "to_q") and not hasattr(m, "to_k") and hasattr(m, "to_qkv")
        if name.endswith("attn2"):
            assert hasattr(m, "to_q") and not hasattr(m, "to_k") and hasattr(m, "to_kv")


def test_model_manager_cache_key_separates_fused_and_unfused(tiny_sd_sdxl, tmp_path):
    from models.catalogue import Catalogue
    from pipelines.manager import ModelManager
    from tests.conftest import ROOT

    mgr = ModelManager(Catalogue(ROOT / "assets", ()), device="cpu", cache_dir=tmp_path)
    req = lambda flags: GenerationRequest("diffusion", str(tiny_sd_sdxl["sd"]), DiffusionParams(), flags)  # noqa: E731
    plain, fused = mgr._request_key(req(Flags())), mgr._request_key(req(FUSED))
    assert plain != fused
    assert mgr._request_key(req(Flags(fuse_qkv=True, strict=True))) == fused      # strict is not part of the key


def test_attention_math_is_not_undone_and_runs_unfused():
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    pipe, report = optim.prepare(tiny_pipeline(), Flags(attention="math", fuse_qkv=True), CPU, kind="diffusion")
    r = report["fuse_qkv"]
    assert not r["applied"] and "SDPA only" in r["reason"] and "AttnProcessor" in r["reason"]
    assert set(r["refused"]) == {"unet", "vae"}
    assert {type(p).__name__ for p in pipe.unet.attn_processors.values()} == {"AttnProcessor"}
    assert fused_layers(pipe.unet) == {"to_qkv": 0, "to_kv": 0}
    pe = prompt_embeds()
    img = pipe(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=1, height=32,
               width=32, output_type="np").images
    assert np.isfinite(img).all()
    with pytest.raises(OptionalDependencyError, match="fuse_qkv"):
        optim.prepare(tiny_pipeline(), Flags(attention="math", fuse_qkv=True, strict=True), CPU, kind="diffusion")


def _added_kv_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
                                attention_head_dim=8, mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                                down_block_types=("SimpleCrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "SimpleCrossAttnUpBlock2D")).eval().requires_grad_(False)


def test_added_kv_unet_is_refused_with_the_reason_and_runs_unfused():
    unet = _added_kv_unet()
    x, c = torch.randn(1, 4, 8, 8), torch.randn(1, 8, 32)
    with torch.no_grad():
        ref = unet(x, 10, c).sample
    out_unet, report = optim.prepare(unet, FUSED, CPU, kind="diffusion")
    r = report["fuse_qkv"]
    assert not r["applied"] and "added-KV" in r["reason"] and "AttnAddedKVProcessor" in r["reason"]
    with torch.no_grad():
        assert torch.equal(out_unet(x, 10, c).sample, ref)


def test_stylegan_is_not_applicable(testdata):
    _, report = prepared(testdata, "sg2_uncond_32", FUSED)
    assert report["fuse_qkv"] == {"applied": False, "reason": STYLEGAN_REASON}
    assert "not applicable" in STYLEGAN_REASON


def test_runs_after_pruning_and_before_fp8_selection():
    """Pruned zeros survive the concatenation; FP8's size filter sees to_qkv, and keeps the fused
    cross-attention to_kv in bf16 by role, as it keeps attn2.to_k / to_v."""
    from optim.fp8 import SIZE, select
    from tests.optim_tiny import tiny_pipeline

    pipe, report = optim.prepare(tiny_pipeline(), Flags(prune_amount=0.5, fuse_qkv=True), CPU, kind="diffusion")
    assert report["prune"]["applied"] and report["fuse_qkv"]["applied"]
    assert list(report).index("fuse_qkv") < list(report).index("prune")      # report order (NAMES), not run order
    qkv = [m for n, m in pipe.unet.named_modules() if n.endswith("attn1.to_qkv")]
    zeros = sum(int((m.weight == 0).sum()) for m in qkv) / sum(m.weight.numel() for m in qkv)
    assert 0.45 < zeros < 0.55
    sel = select(pipe.unet, 16)
    assert any(n.endswith("attn1.to_qkv") for n in sel.fp8)
    assert all(n.endswith("attn2.to_kv") for n in sel.kept["cross-attention K/V"])
    assert not any(n.endswith(("attn1.to_q", "attn1.to_k", "attn2.to_k")) for n in sel.fp8 + sel.kept.get(SIZE, []))


def test_fused_unet_traces_without_graph_break():
    from tests.optim_tiny import tiny_unet, unet_inputs

    unet, _ = optim.prepare(tiny_unet(), FUSED, CPU, kind="diffusion")
    x, t, c = unet_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t, c).sample, unet(x, t, c).sample, rtol=1e-5, atol=1e-5)


# -- the flag through every way in -----------------------------------------------------------------------

def test_flag_round_trips_through_cli_bench_api_and_dict():
    from bench.specs import WORKLOADS, describe_flags, parse_custom, resolve_configs
    from cli.generate import build_parser
    from cli.options import flags_from_args
    from ui.a1111_api import _flags

    base = ["--backend", "diffusion", "--model", "m"]
    assert flags_from_args(build_parser().parse_args(base + ["--fuse-qkv"])).fuse_qkv
    assert not flags_from_args(build_parser().parse_args(base)).fuse_qkv
    assert Flags.from_dict(FUSED.to_dict()) == FUSED and FUSED.requested() == {"fuse_qkv"}
    assert optim.requested_toggles(FUSED) == ["precision", "fuse_qkv"]

    assert _flags({"atelier_flags": {"fuse_qkv": True}}).fuse_qkv
    with pytest.raises(InputError, match="atelier_flags.fuse_qkv must be true or false"):
        _flags({"atelier_flags": {"fuse_qkv": "yes"}})

    assert parse_custom("x@fuse-qkv=1+precision=bf16") == ("x", {"fuse_qkv": True, "precision": "bf16"})
    wl = WORKLOADS["sd15-512"]
    cfgs = {c.name: c for c in resolve_configs(wl, ["best", "best-fqkv"])}
    assert not cfgs["best"].flags.fuse_qkv
    assert cfgs["best-fqkv"].flags == Flags(**wl.best, fuse_qkv=True)
    assert "fused QKV" in cfgs["best-fqkv"].description


def test_bench_skips_fused_qkv_on_stylegan_workloads():
    from bench.estimate import h200_skip_reason
    from bench.runner import unavailable_here
    from bench.specs import WORKLOADS, resolve_configs

    sg = WORKLOADS["sg2-1024"]
    flags = resolve_configs(sg, ["best-fqkv"])[0].flags
    assert "fuse_qkv" in unavailable_here(flags, sg, CPU) and h200_skip_reason(sg, flags)
    sd = WORKLOADS["sd15-512"]
    assert h200_skip_reason(sd, resolve_configs(sd, ["best-fqkv"])[0].flags) is None


# -- GPU -------------------------------------------------------------------------------------------------

def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.mark.gpu
def test_gpu_fp16_fused_matches_unfused():
    """fp16 on CUDA: fused and unfused differ only by the fp16 rounding of differently tiled GEMMs, less than
    fp16 differs from fp32 (> 30 dB in test_optim_precision), so > 35 dB; a swapped K/V split gives 23.8 dB
    on this pipeline (measured on the CPU in fp32)."""
    from pipelines.diffusion_noise import fp32_noise
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    cuda = torch.device("cuda")
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(precision="fp16"), cuda, kind="diffusion")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(precision="fp16", fuse_qkv=True), cuda, kind="diffusion")
    assert report["fuse_qkv"]["applied"] and pipe.unet.dtype == torch.float16
    pe = prompt_embeds(1).to(cuda, torch.float16)

    def run(p):
        with fp32_noise():
            return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=2, height=32,
                     width=32, output_type="np", generator=torch.Generator("cpu").manual_seed(0)).images
    assert _psnr(run(ref_pipe), run(pipe)) > 35
