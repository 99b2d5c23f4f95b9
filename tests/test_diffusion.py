"""Diffusion generation on tiny real pipelines (CPU): equality with diffusers (to rounding), cancel, progress,
NaN guard, safety checker, input checks, schedulers, PNG round trip."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import AtelierError, InputError
from core.pnginfo import read_png_params, save_png
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags
from pipelines.diffusion import (SCHEDULER_NAMES, DiffusionPipeline, LoadedDiffusion, load_diffusion,
                                 params_from_png, resolve_scheduler_name)
from tests.diffusion_tiny import build_tiny_sd, build_tiny_sdxl

CPU = torch.device("cpu")
PROMPT = "a photo of a cat"


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diffusion") / "tiny-sd"
    build_tiny_sd(folder)
    return folder


@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diffusion") / "tiny-sdxl"
    build_tiny_sdxl(folder)
    return folder


@pytest.fixture(scope="module")
def sd(sd_folder):
    return DiffusionPipeline(load_diffusion(str(sd_folder)), OptimizationFlags(), CPU)


@pytest.fixture(scope="module")
def reference(sd_folder):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(sd_folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def params(**kw) -> DiffusionParams:
    base = dict(prompt=PROMPT, negative_prompt="dog", seed=7, steps=3, guidance=6.0, width=64, height=64)
    base.update(kw)
    return DiffusionParams(**base)


def generate(pipe: DiffusionPipeline, job: Job | None = None, task=None, **kw):
    return pipe.generate(GenerationRequest("diffusion", pipe.model_id, params(**kw)), job or Job(), task=task)


def nchw(images_nhwc: np.ndarray) -> np.ndarray:
    return images_nhwc.transpose(0, 3, 1, 2)


# Ours and diffusers' pipeline are two separately built models that compute the same thing: they match to
# float rounding (pixel values in [0, 1]), not bit for bit, which a different CPU or torch build may break.
# A wrong seed, scheduler, guidance or prompt changes pixels by far more than this.
ATOL = 1e-5


def assert_same_image(ours: np.ndarray, ref_nhwc: np.ndarray) -> None:
    assert ours.shape == nchw(ref_nhwc).shape
    np.testing.assert_allclose(ours, nchw(ref_nhwc), rtol=0, atol=ATOL)


# -- reproducibility: the same images as diffusers' own pipeline ------------------------------------------

def test_txt2img_equals_diffusers(sd, reference):
    res = generate(sd, seed=1234)
    ref = reference(PROMPT, negative_prompt="dog", num_inference_steps=3, guidance_scale=6.0, width=64, height=64,
                    generator=torch.Generator("cpu").manual_seed(1234), output_type="np").images
    assert res.raw.dtype == np.float32 and res.raw.shape == (1, 3, 64, 64)
    assert_same_image(res.raw, ref)
    pixels = np.asarray(res.images[0], dtype=int) - np.asarray(reference.numpy_to_pil(ref)[0], dtype=int)
    assert np.abs(pixels).max() <= 1                                    # 8-bit: one level of rounding at most
    assert res.notes == [] and not res.cancelled
    m = res.metadata[0]
    for key in ("backend", "model", "model_hash", "prompt", "negative_prompt", "seed", "steps", "guidance", "scheduler",
                "width", "height", "flags", "latency_ms", "peak_vram_bytes"):
        assert key in m, key
    assert (m["backend"], m["seed"], m["steps"], m["scheduler"], m["arch"]) == ("diffusion", 1234, 3, "default", "sd15")
    assert set(res.timings_ms) >= {"text_encoder", "denoise", "vae_decode"}


def test_batch_uses_one_cpu_seed_per_image(sd, reference):
    res = generate(sd, seed=40, batch_size=2)
    gens = [torch.Generator("cpu").manual_seed(s) for s in (40, 41)]
    ref = reference(PROMPT, negative_prompt="dog", num_inference_steps=3, guidance_scale=6.0, width=64, height=64,
                    num_images_per_prompt=2, generator=gens, output_type="np").images
    assert_same_image(res.raw, ref)
    assert [m["seed"] for m in res.metadata] == [40, 41]
    # the second image is the seed-41 image: reproducible alone from its own PNG metadata
    alone = generate(sd, seed=41)
    np.testing.assert_allclose(res.raw[1], alone.raw[0], atol=1e-5)


def test_img2img_equals_diffusers(sd, sd_folder, tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline

    rng = np.random.RandomState(0)
    init = Image.fromarray((rng.rand(64, 64, 3) * 255).astype(np.uint8))
    path = tmp_path / "init.png"
    init.save(path)
    res = generate(sd, init_image=str(path), strength=0.6, steps=5)
    ref_pipe = StableDiffusionImg2ImgPipeline.from_pretrained(str(sd_folder))
    ref = ref_pipe(PROMPT, negative_prompt="dog", image=init, strength=0.6, num_inference_steps=5, guidance_scale=6.0,
                   generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    assert_same_image(res.raw, ref)
    assert res.metadata[0]["task"] == "img2img" and res.metadata[0]["strength"] == 0.6


def test_img2img_converts_init_image_to_rgb_and_size(sd, tmp_path):
    rgba = Image.new("RGBA", (80, 48), (255, 0, 0, 0))
    path = tmp_path / "init.png"
    rgba.save(path)
    res = generate(sd, init_image=str(path), strength=0.5, steps=2)
    assert res.raw.shape == (1, 3, 64, 64)
    assert any("flattened onto white" in n for n in res.notes)
    assert any("resized from 80x48 to 64x64" in n for n in res.notes)


def test_sdxl_equals_diffusers(sdxl_folder):
    from diffusers import StableDiffusionXLPipeline

    loaded = load_diffusion(str(sdxl_folder))
    assert loaded.arch == "sdxl" and loaded.family == "sdxl"
    res = DiffusionPipeline(loaded, OptimizationFlags(), CPU).generate(
        GenerationRequest("diffusion", "tiny-sdxl", params(negative_prompt="", steps=2)), Job())
    ref = StableDiffusionXLPipeline.from_pretrained(str(sdxl_folder))(
        PROMPT, num_inference_steps=2, guidance_scale=6.0, width=64, height=64,
        generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    assert_same_image(res.raw, ref)


def test_sdxl_img2img_equals_diffusers(sdxl_folder):
    from diffusers import StableDiffusionXLImg2ImgPipeline

    init = Image.fromarray((np.random.RandomState(1).rand(64, 64, 3) * 255).astype(np.uint8))
    res = DiffusionPipeline(load_diffusion(str(sdxl_folder)), OptimizationFlags(), CPU).generate(
        GenerationRequest("diffusion", "tiny-sdxl", params(negative_prompt="", steps=4, init_image=init, strength=0.5)),
        Job())
    ref = StableDiffusionXLImg2ImgPipeline.from_pretrained(str(sdxl_folder))(
        PROMPT, image=init, strength=0.5, num_inference_steps=4, guidance_scale=6.0,
        generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    assert_same_image(res.raw, ref)


# -- progress, previews and cancel ----------------------------------------------------------------------------

def test_progress_reports_every_step_with_previews(sd):
    events = []
    job = Job(on_progress=events.append)
    res = generate(sd, job=job, steps=5, preview_every=2)
    steps = [e.step for e in events if e.stage == "denoise"]
    assert steps == [1, 2, 3, 4, 5] and events[-1].total == 5     # N/N for N steps (PNDM calls back N+1 times)
    previews = [e for e in events if e.preview is not None]
    assert [e.step for e in previews] == [s for s in steps if s % 2 == 0 or s == steps[-1]]
    assert all(isinstance(e.preview, Image.Image) and e.preview.size == (64, 64) for e in previews)
    assert res.images and len(job.trace) == len(events)


def test_cancel_stops_within_one_step_and_next_job_runs(sd, reference):
    unet_calls = []
    hook = sd.pipe.unet.register_forward_hook(lambda *a: unet_calls.append(1))
    try:
        job = Job()

        at_cancel = []

        def cancel_at_two(ev):
            if ev.stage == "denoise" and ev.step == 2:
                at_cancel.append(len(unet_calls))       # PNDM's first step is two UNet calls: 3 by step 2
                job.cancel()

        job._on_progress = cancel_at_two
        res = generate(sd, job=job, steps=6)
        assert res.cancelled and res.images == [] and res.raw.shape == (0, 3, 64, 64)
        assert at_cancel and len(unet_calls) == at_cancel[0] <= 3, "the UNet ran after the cancel"
        assert any("cancelled after step 2 of" in n for n in res.notes)
        unet_calls.clear()
        after = generate(sd, steps=3, seed=5)     # a fresh job on the same pipeline runs normally
    finally:
        hook.remove()
    assert not after.cancelled and len(unet_calls) == 4      # PNDM (PLMS): 3 steps = 4 UNet calls
    ref = reference(PROMPT, negative_prompt="dog", num_inference_steps=3, guidance_scale=6.0, width=64, height=64,
                    generator=torch.Generator("cpu").manual_seed(5), output_type="np").images
    assert_same_image(after.raw, ref)


# -- NaN guard and safety checker -----------------------------------------------------------------------------

def test_nan_guard_redecodes_fp16_vae_in_fp32(sd_folder, sd):
    loaded = load_diffusion(str(sd_folder))
    vae = loaded.pipe.vae
    with torch.no_grad():
        w = vae.decoder.conv_in.weight
        w.copy_(torch.sign(w) * 2000.0)     # representable in fp16, but the activations overflow fp16's 65504
    vae.to(torch.float16)
    pipe = DiffusionPipeline(loaded, OptimizationFlags(), CPU)
    lat = torch.randn(1, 4, 8, 8, dtype=torch.float16) * 4
    with torch.no_grad():
        assert not torch.isfinite(vae.decode(lat).sample).all()     # the failure is real
    res = generate(pipe)
    assert "VAE produced NaN/Inf in fp16; decoded again in fp32" in res.notes
    assert np.isfinite(res.raw).all() and res.raw.std() > 0.01      # a real picture, not a black one
    assert vae.dtype == torch.float16                                # the model is left as it was


def test_nan_even_in_fp32_is_an_error_not_a_black_image(sd_folder):
    loaded = load_diffusion(str(sd_folder))
    with torch.no_grad():
        loaded.pipe.vae.decoder.conv_out.weight.fill_(3e38)
    pipe = DiffusionPipeline(loaded, OptimizationFlags(), CPU)
    with pytest.raises(AtelierError, match="NaN/Inf even in fp32"):
        generate(pipe)


def test_safety_checker_black_image_is_reported(sd_folder):
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    loaded = load_diffusion(str(sd_folder))
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1),
                     vision_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                                        image_size=32, patch_size=8), projection_dim=8)
    checker = StableDiffusionSafetyChecker(cfg).eval()
    with torch.no_grad():
        checker.concept_embeds_weights.fill_(-2.0)    # every image scores above every threshold: always flagged
    from diffusers import StableDiffusionPipeline

    p = loaded.pipe
    flagged = StableDiffusionPipeline(vae=p.vae, text_encoder=p.text_encoder, tokenizer=p.tokenizer, unet=p.unet,
                                      scheduler=p.scheduler, safety_checker=checker,
                                      feature_extractor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                           crop_size={"height": 32, "width": 32}),
                                      requires_safety_checker=False)
    pipe = DiffusionPipeline(LoadedDiffusion(flagged, "sd15", "folder", "tiny", None, "0" * 10, 0), OptimizationFlags(), CPU)
    res = generate(pipe)
    assert np.array_equal(res.raw, np.zeros_like(res.raw))
    assert any("safety checker" in n and "not a NaN" in n for n in res.notes)
    assert not any("NaN/Inf in" in n for n in res.notes)
    assert res.metadata[0]["safety_checker_blacked_out"] is True


# -- input checks, before any device work ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, task, match", [
    (dict(width=100), None, "multiple of 8"),
    (dict(height=4000 + 8 * 20), None, "between 64 and"),
    (dict(steps=0), None, "steps must be"),
    (dict(steps=151), None, "steps must be"),
    (dict(guidance=-1.0), None, "guidance"),
    (dict(guidance=float("nan")), None, "guidance"),
    (dict(batch_size=0), None, "batch size"),
    (dict(strength=1.5, init_image="x.png"), None, r"strength must be in \(0, 1\]"),
    (dict(strength=0.0, init_image="x.png"), None, r"strength must be in \(0, 1\]"),
    (dict(), "img2img", "needs an init image"),
    (dict(init_image=""), None, "needs an init image"),
    (dict(init_image="/no/such/file.png", strength=0.5), None, "init image not found"),
    (dict(scheduler="warp-drive"), None, "unknown scheduler"),
    (dict(prompt="x" * 5000), None, "limited to"),
])
def test_bad_input_is_refused_before_work(sd, kw, task, match):
    calls = []
    hook = sd.pipe.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(InputError, match=match):
            generate(sd, task=task, **kw)
    finally:
        hook.remove()
    assert calls == []


def test_init_image_that_is_not_an_image(sd, tmp_path):
    bad = tmp_path / "notes.png"
    bad.write_text("not a picture")
    with pytest.raises(InputError, match="not a readable image"):
        generate(sd, init_image=str(bad), strength=0.5)


def test_long_prompt_is_truncated_with_token_count(sd):
    long_prompt = " ".join(["cat"] * 90)
    res = generate(sd, prompt=long_prompt, steps=1)
    assert "prompt truncated: 92 tokens > 77 (start and end tokens included); the words past token 75 were ignored" in res.notes
    assert res.images


def test_pixel_cap_from_free_memory(sd, monkeypatch):
    import pipelines.diffusion as dmod

    monkeypatch.setattr(dmod, "pixel_cap", lambda *a, **k: (64 * 64, 1 << 30))
    from core.errors import ResourceError

    with pytest.raises(ResourceError, match="too large to decode"):
        generate(sd, width=128, height=128)


# -- schedulers -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_scheduler_runs(sd, name):
    res = generate(sd, scheduler=name, steps=2, guidance=2.0)
    assert res.images and np.isfinite(res.raw).all() and res.metadata[0]["scheduler"] == name
    if name == "lcm":
        assert any("LCM scheduler suits" in n for n in res.notes)


def test_scheduler_names_from_a1111():
    assert resolve_scheduler_name("Euler a") == "euler-a"
    assert resolve_scheduler_name("DPM++ 2M Karras") == "dpm++2m-karras"
    assert resolve_scheduler_name("DPM++ 2M", "Karras") == "dpm++2m-karras"
    assert resolve_scheduler_name("DPM++ 2M", "Automatic") == "dpm++2m"
    assert resolve_scheduler_name("DDIM") == "ddim" and resolve_scheduler_name("LCM") == "lcm"
    assert resolve_scheduler_name(None) == "default"
    assert resolve_scheduler_name("DPM++ 2M Automatic") == "dpm++2m"          # 'sampler schedule' in one string
    assert resolve_scheduler_name("Euler a Automatic") == "euler-a"
    assert resolve_scheduler_name("DPM++ 2M SDE Karras") == "dpm++2m-sde-karras"


def test_scheduler_keeps_model_config(sd):
    from pipelines.diffusion import make_scheduler

    s = make_scheduler("dpm++2m-karras", dict(sd.pipe.scheduler.config, prediction_type="v_prediction"))
    assert type(s).__name__ == "DPMSolverMultistepScheduler"
    assert s.config.use_karras_sigmas and s.config.prediction_type == "v_prediction"


# -- PNG metadata round trip ----------------------------------------------------------------------------------

def test_png_round_trip_reproduces_the_image(sd, tmp_path):
    res = generate(sd, seed=99, scheduler="euler-a", steps=2)
    path = save_png(res.images[0], tmp_path / "out.png", res.metadata[0])
    back = params_from_png(read_png_params(path))
    assert back["scheduler"] == "euler-a" and back["seed"] == 99 and back["model_hash"] == sd.loaded.hash
    model = back.pop("model")
    back.pop("model_hash")
    again = sd.generate(GenerationRequest("diffusion", model, DiffusionParams(**back)), Job())
    assert np.array_equal(again.raw, res.raw)


def test_a1111_png_parameters_map_to_our_names(testdata):
    meta = read_png_params(testdata / "pnginfo" / "a1111_v1_10_schedule.png")
    p = params_from_png(meta)
    assert p["scheduler"] == "dpm++2m-karras" and p["guidance"] == 7.0 and (p["width"], p["height"]) == (1024, 1024)
    p = params_from_png(read_png_params(testdata / "pnginfo" / "a1111_v1_6.png"))
    assert p["scheduler"] == "dpm++2m-karras" and p["seed"] == 1234567890 and p["guidance"] == 6.5
    DiffusionParams(**{k: v for k, v in p.items() if k not in ("model", "model_hash")})


def test_the_step_counter_reads_the_steps_asked_for_whatever_the_sampler_calls_back():
    from pipelines.diffusion import sampler_steps, step_counter

    for asked, callbacks in ((25, 26), (25, 49), (4, 4), (1, 2), (3, 1)):     # PNDM, Heun, Euler, ...
        seen = [step_counter(i, callbacks, asked) for i in range(callbacks)]
        total = min(asked, callbacks)
        assert {t for _, t in seen} == {total}
        done = [d for d, _ in seen]
        assert done[0] == 1 and done[-1] == total
        assert total == 1 or done.count(total) == 1                                  # N only at the last callback
        assert all(0 <= b - a <= 1 for a, b in zip(done, done[1:]))                # never a jump, never back
    assert sampler_steps(25) == 25 and sampler_steps(25, 0.5) == 12 and sampler_steps(3, 0.1) == 1


@pytest.mark.parametrize("scheduler", ["default", "heun"])    # PNDM: N+1 callbacks; Heun: 2N-1
def test_a_real_run_counts_n_of_n_steps(sd, scheduler):
    events = []
    generate(sd, job=Job(on_progress=events.append), steps=4, scheduler=scheduler)
    denoise = [(e.step, e.total) for e in events if e.stage == "denoise"]
    assert denoise == [(1, 4), (2, 4), (3, 4), (4, 4)], denoise
