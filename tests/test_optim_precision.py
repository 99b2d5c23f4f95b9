"""Precision toggle against the fp32 reference on the same seeds.

Measured on the CPU (bf16 autocast vs fp32, seeds 0-1 (sg3: 0), const noise, PSNR over [-1, 1]):
sg2_uncond_32 40.6 dB, sg2_cond4_64_fp16 36.6 dB, sg3t_uncond_32 rel. error 1.3 %.
"""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from evaluation.drift import psnr, ssim
from tests.optim_helpers import CPU, generate, load_G, prepared, reference_G, rel_err


@pytest.mark.parametrize("name,min_psnr", [("sg2_uncond_32", 35.0), ("sg2_cond4_64_fp16", 32.0)])
def test_bf16_autocast_stylegan2_close_to_fp32(testdata, name, min_psnr):
    ref = generate(load_G(testdata, name), Flags(), seeds=(0, 1))
    G, report = prepared(testdata, name, Flags(precision="bf16"))
    out = generate(G, Flags(precision="bf16"), seeds=(0, 1))
    assert report["precision"] == {"applied": True, "mode": "autocast-bf16", "reason": report["precision"]["reason"]}
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert not torch.equal(out, ref)                      # bf16 really ran
    assert psnr(ref, out, 2.0) > min_psnr
    assert ssim(ref, out, 2.0) > 0.98


def test_bf16_autocast_stylegan3_close_to_fp32(testdata):
    ref = generate(load_G(testdata, "sg3t_uncond_32"), Flags(), seeds=(0,))
    G, _ = prepared(testdata, "sg3t_uncond_32", Flags(precision="bf16"))
    out = generate(G, Flags(precision="bf16"), seeds=(0,))
    assert not torch.equal(out, ref)
    assert rel_err(ref, out) < 0.03


@pytest.mark.parametrize("name,cutoff", [("sg2_uncond_32", None), ("sg2_uncond_32", 4), ("sg3t_uncond_32", None)])
def test_bf16_autocast_with_truncation(testdata, name, cutoff):
    """Truncation (psi != 1) under autocast: the mapping's bf16 output meets the fp32 running mean.
    The studio's default psi is 0.7, so this is the everyday path (it once raised a dtype error)."""
    import numpy as np

    G = load_G(testdata, name)
    z = torch.from_numpy(np.random.RandomState(0).randn(2, G.z_dim)).float()
    c = torch.zeros(2, G.c_dim)
    kw = dict(truncation_psi=0.7, noise_mode="const")
    if cutoff is not None:
        kw["truncation_cutoff"] = cutoff
    with torch.no_grad():
        ref = G(z, c, **kw).float()
    Gb, _ = prepared(testdata, name, Flags(precision="bf16"))
    with torch.no_grad(), optim.runtime(Flags(precision="bf16"), CPU):
        out = Gb(z, c, **kw).float()
        ws = Gb.mapping(z, c, **{k: v for k, v in kw.items() if k != "noise_mode"})
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert psnr(ref, out, 2.0) > 30.0
    assert G.mapping.w_avg.dtype == torch.float32 and ws.dtype in (torch.bfloat16, torch.float32)


def test_fp32_is_the_reference_bit_for_bit(testdata):
    ref = generate(load_G(testdata, "sg2_uncond_32"), Flags())
    G, report = prepared(testdata, "sg2_uncond_32", Flags())
    assert report["precision"]["applied"] and report["precision"]["mode"] == "fp32"
    assert torch.equal(generate(G, Flags()), ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU skip reasons")
def test_cpu_skips_fp16_and_tf32_with_reasons(testdata):
    _, r16 = prepared(testdata, "sg2_uncond_32", Flags(precision="fp16"))
    reason = r16["precision"]["reason"]
    # the advice depends on this CPU: bf16 where it has AVX512-BF16/AMX, fp32 where it has not
    assert r16["precision"]["applied"] is False and "fp16 is not useful on the CPU" in reason
    assert "bf16 on the CPU" in reason or "no bf16 instructions" in reason
    _, r32 = prepared(testdata, "sg2_uncond_32", Flags(precision="tf32"))
    assert r32["precision"]["applied"] is False and "TF32 needs" in r32["precision"]["reason"]
    # the skipped modes still produce the fp32 image
    ref = generate(load_G(testdata, "sg2_uncond_32"), Flags())
    G, _ = prepared(testdata, "sg2_uncond_32", Flags(precision="fp16"))
    assert torch.equal(generate(G, Flags(precision="fp16")), ref)


def test_diffusion_pipeline_bf16_on_cpu_is_autocast_and_close():
    from tests.optim_tiny import tiny_unet, unet_inputs

    x, t, c = unet_inputs()
    ref = tiny_unet()(x, t, c).sample
    unet, report = optim.prepare(tiny_unet(), Flags(precision="bf16"), CPU, kind="diffusion")
    with torch.no_grad(), optim.runtime(Flags(precision="bf16"), CPU):
        out = unet(x, t, c).sample.float()
    assert report["precision"]["mode"] == "autocast-bf16"
    assert next(unet.parameters()).dtype == torch.float32          # autocast: weights stay fp32
    assert rel_err(ref, out) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("precision,min_psnr", [("fp16", 35.0), ("bf16", 32.0), ("tf32", 45.0)])
def test_gpu_precisions_stylegan(testdata, precision, min_psnr):
    cuda = torch.device("cuda")
    ref = generate(reference_G(testdata, "sg2_cond4_64_fp16", cuda), Flags(), device=cuda)
    G, report = prepared(testdata, "sg2_cond4_64_fp16", Flags(precision=precision), device=cuda)
    assert report["precision"]["applied"], report
    assert "native_fp16_blocks" in report["precision"]            # NVlabs fp16 blocks handed to the toggle
    out = generate(G, Flags(precision=precision), device=cuda)
    assert psnr(ref, out, 2.0) > min_psnr


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_diffusion_pipeline_casts_weights(precision):
    """The cast pipeline's image is the fp32 picture to rounding. Noise is drawn as the studio draws it (fp32_noise):
    stock diffusers draws fp16/bf16 noise in that dtype, which on torch 2.11 is another stream (about 13 dB)."""
    from pipelines.diffusion_noise import fp32_noise
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    cuda = torch.device("cuda")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(precision=precision), cuda, kind="diffusion")
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert report["precision"]["mode"] == f"weights-{precision}"
    assert pipe.unet.dtype == want and pipe.vae.dtype == want and pipe.text_encoder.dtype == want
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(), cuda, kind="diffusion")
    pe = prompt_embeds(1).to(cuda)

    def run(p, dtype):
        g = torch.Generator("cpu").manual_seed(0)
        with fp32_noise():
            return p(prompt_embeds=pe.to(dtype), negative_prompt_embeds=torch.zeros_like(pe).to(dtype),
                     num_inference_steps=2, height=32, width=32, output_type="np", generator=g).images
    ref, out = run(ref_pipe, torch.float32), run(pipe, want)
    assert psnr(ref, out, 1.0) > 30


def _tiny_sdxl_pipeline(tmp_path, flags, device, dtype=None):
    from pipelines.diffusion import DiffusionPipeline, load_diffusion
    from tests.diffusion_tiny import build_tiny_sdxl

    folder = tmp_path / "tiny-sdxl"
    build_tiny_sdxl(folder)
    return DiffusionPipeline(load_diffusion(str(folder), device=device, dtype=dtype, flags=flags), flags, device)


def _decode_dtypes_of(pipe) -> tuple[list, object]:
    """Generate one small image; (weight dtype, output dtype) of each VAE decoder conv_in call, and the result."""
    from core.types import DiffusionParams, GenerationRequest, Job

    seen = []
    hook = pipe.pipe.vae.decoder.conv_in.register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, out.dtype)))
    try:
        params = DiffusionParams(prompt="a cat", seed=1, steps=2, guidance=5.0, width=64, height=64)
        res = pipe.generate(GenerationRequest("diffusion", pipe.model_id, params), Job())
    finally:
        hook.remove()
    return seen, res


def test_sdxl_vae_upcast_is_not_undone_by_the_requests_autocast(tmp_path):
    """SDXL's VAE overflows in fp16, so an fp16 VAE decodes with an fp32 copy (its config's force_upcast). The
    request's autocast (here the CPU's bf16; on a GPU fp16) must not put those convolutions back in half precision:
    under fp16 that brings back the overflow, and the NaN guard then blames the weights."""
    import numpy as np

    pipe = _tiny_sdxl_pipeline(tmp_path, Flags(precision="bf16"), CPU, dtype=torch.float32)
    assert pipe.optimizations["precision"]["mode"] == "autocast-bf16"
    pipe.pipe.vae.to(torch.float16)      # as fp16 precision leaves it on a GPU; the CPU's autocast is bf16
    assert pipe.pipe.vae.config.force_upcast
    seen, res = _decode_dtypes_of(pipe)
    assert seen == [(torch.float32, torch.float32)]
    assert pipe.pipe.vae.dtype == torch.float16                 # the fp32 copy lasts for the decode only
    assert len(res.images) == 1 and np.isfinite(res.raw).all()


def test_weight_cast_pipelines_run_without_autocast(tmp_path):
    """The GPU's mode casts every part to fp16/bf16; generation then runs as diffusers runs it, with no autocast
    on top (which would undo diffusers' own fp32 islands). The autocast modes keep theirs."""
    pipe = _tiny_sdxl_pipeline(tmp_path, Flags(precision="bf16"), CPU)
    seen = []
    pipe.pipe.unet.conv_in.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    assert pipe.optimizations["precision"]["mode"] == "autocast-bf16"
    _decode_dtypes_of(pipe)
    assert seen and all(seen)
    seen.clear()
    pipe.optimizations["precision"] = dict(pipe.optimizations["precision"], mode="weights-bf16")  # as on a GPU
    _, res = _decode_dtypes_of(pipe)
    assert seen and not any(seen) and len(res.images) == 1


@pytest.mark.gpu
def test_gpu_sdxl_fp16_img2img_encodes_in_fp32(tmp_path):
    """diffusers' SDXL img2img encodes the init image with an fp32 VAE (force_upcast); no autocast undoes it."""
    import numpy as np
    from PIL import Image

    from core.types import DiffusionParams, GenerationRequest, Job

    cuda = torch.device("cuda")
    pipe = _tiny_sdxl_pipeline(tmp_path, Flags(precision="fp16"), cuda)
    seen = []
    pipe.pipe.vae.encoder.conv_in.register_forward_hook(lambda m, a, out: seen.append((m.weight.dtype, out.dtype)))
    init = Image.fromarray(np.random.RandomState(0).randint(0, 255, (64, 64, 3), dtype=np.uint8))
    params = DiffusionParams(prompt="a cat", seed=1, steps=4, guidance=5.0, width=64, height=64, init_image=init,
                             strength=0.5)
    res = pipe.generate(GenerationRequest("diffusion", pipe.model_id, params), Job())
    assert seen == [(torch.float32, torch.float32)]
    assert pipe.pipe.vae.dtype == torch.float16 and len(res.images) == 1 and np.isfinite(res.raw).all()


@pytest.mark.gpu
def test_gpu_sdxl_fp16_vae_decodes_in_fp32(tmp_path):
    import numpy as np

    cuda = torch.device("cuda")
    pipe = _tiny_sdxl_pipeline(tmp_path, Flags(precision="fp16"), cuda)
    assert pipe.optimizations["precision"]["mode"] == "weights-fp16" and pipe.pipe.vae.dtype == torch.float16
    seen, res = _decode_dtypes_of(pipe)
    assert seen == [(torch.float32, torch.float32)]
    assert pipe.pipe.vae.dtype == torch.float16
    assert len(res.images) == 1 and np.isfinite(res.raw).all() and not res.notes
