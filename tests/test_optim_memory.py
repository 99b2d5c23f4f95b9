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


def test_vae_without_tiling_is_skipped_with_reason():
    """diffusers gives every VAE enable_tiling/enable_slicing; some raise NotImplementedError from them."""
    from diffusers import AsymmetricAutoencoderKL

    pipe = tiny_pipeline()
    pipe.vae = AsymmetricAutoencoderKL(in_channels=3, out_channels=3, down_block_out_channels=(32,),
                                       up_block_out_channels=(32,), layers_per_down_block=1, layers_per_up_block=1,
                                       latent_channels=4, norm_num_groups=8, sample_size=16)
    _, report = optim.prepare(pipe, Flags(memory=("vae-tiling", "vae-slicing", "attention-slicing")), CPU,
                              kind="diffusion")
    s = report["memory"]["savers"]
    assert report["memory"]["applied"] is False and s["attention-slicing"]["applied"]
    for saver in ("vae-tiling", "vae-slicing"):
        assert s[saver] == {"applied": False, "reason": f"this VAE (AsymmetricAutoencoderKL) does not support {saver}"}


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


@pytest.mark.gpu
def test_gpu_offload_in_the_studios_load_order(tmp_path):
    """The studio's order: the manager loads the pipeline onto the GPU, then optim enables offload (diffusers
    parks every model on the CPU first). Nothing may move the pipeline to the GPU afterwards (diffusers would
    only warn, and the offload would be silently lost); the image equals the one without offload."""
    import logging

    import numpy as np

    from core.types import DiffusionParams, GenerationRequest, Job
    from pipelines.diffusion import DiffusionPipeline, load_diffusion
    from tests.diffusion_tiny import build_tiny_sd

    cuda = torch.device("cuda")
    folder = tmp_path / "tiny-sd"
    build_tiny_sd(folder)
    params = DiffusionParams(prompt="a cat", seed=1, steps=2, guidance=5.0, width=64, height=64)

    def make(flags):                      # what ModelManager._load does
        return DiffusionPipeline(load_diffusion(str(folder), device=cuda, flags=flags), flags, cuda)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append         # diffusers' loggers do not propagate to the root (caplog misses them)
    logging.getLogger("diffusers").addHandler(handler)
    try:
        ref = make(Flags()).generate(GenerationRequest("diffusion", "tiny", params), Job())
        off_flags = Flags(memory=("cpu-offload",))
        off = make(off_flags)
        assert off.optimizations["memory"]["applied"], off.optimizations["memory"]
        assert off.pipe.unet.device.type == "cpu" and off.pipe.text_encoder.device.type == "cpu"
        res = off.generate(GenerationRequest("diffusion", "tiny", params, flags=off_flags), Job())
        again = off.generate(GenerationRequest("diffusion", "tiny", params, flags=off_flags), Job())
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert not [r.getMessage() for r in records if "offload" in r.getMessage()]
    assert off.pipe.unet.device.type == "cpu"     # parked again: the VAE's hook moved it off when the decode began
    assert np.abs(res.raw - ref.raw).max() < 1e-4 and np.array_equal(res.raw, again.raw)
