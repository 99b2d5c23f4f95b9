"""pipelines/overlap.py: the denoising loop without per-step host/device synchronisation.

On the CPU: host-side timesteps give the same images as diffusers' own (the same model, so to float
rounding), keep the scheduler's signature (diffusers inspects it), and the pacer and the hook are
no-ops. On a GPU: a generation synchronises a bounded number of times, not once or twice per step.
"""
from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags
from pipelines import overlap
from pipelines.diffusion import DiffusionPipeline, load_diffusion, make_scheduler
from tests.diffusion_tiny import build_tiny_sd

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overlap") / "tiny-sd"
    build_tiny_sd(folder)
    return folder


def test_host_timesteps_keeps_the_schedule_on_the_cpu_and_the_signature():
    base = dict(make_scheduler("euler", {"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000}).config)
    sched = overlap.host_timesteps(make_scheduler("euler", base))
    assert overlap.host_timesteps(sched) is sched                       # idempotent: wrapped once
    params = inspect.signature(sched.set_timesteps).parameters
    assert {"num_inference_steps", "device", "timesteps", "sigmas"} <= set(params)   # diffusers checks these names
    # asked for a GPU (there is none here): the schedule is still built, on the CPU
    sched.set_timesteps(5, device="cuda")
    assert sched.timesteps.device.type == "cpu" and len(sched.timesteps) == 5
    sched.set_timesteps(4, "cuda")                                      # positional device too
    assert sched.timesteps.device.type == "cpu" and len(sched.timesteps) == 4


@pytest.mark.parametrize("name", ["pndm", "euler", "dpm++2m-karras", "euler-a"])
def test_host_timesteps_denoise_like_diffusers(sd_folder, name):
    """A scheduler wrapped by host_timesteps drives diffusers' loop to the same latents as the plain one."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(sd_folder))
    pipe.set_progress_bar_config(disable=True)
    base = dict(pipe.scheduler.config)

    def run(scheduler):
        pipe.scheduler = scheduler
        g = torch.Generator("cpu").manual_seed(3)
        return pipe("a photo of a cat", num_inference_steps=4, guidance_scale=5.0, height=64, width=64,
                    generator=g, output_type="latent").images

    plain = run(make_scheduler(name, base))
    hosted = run(overlap.host_timesteps(make_scheduler(name, base)))
    torch.testing.assert_close(hosted, plain, rtol=0, atol=1e-6)
    assert not torch.equal(plain, run(make_scheduler(name, base).__class__.from_config(base, num_train_timesteps=500)))


def test_pacer_and_hook_are_noops_on_the_cpu():
    pacer = overlap.StepPacer(CPU)
    for _ in range(5):
        pacer.step()
    assert not pacer.events
    unet = torch.nn.Conv2d(4, 4, 1)
    assert overlap.install_timestep_hook(unet) and not overlap.install_timestep_hook(unet)   # once
    t = torch.tensor(10)
    assert overlap._timestep_pre_hook(unet, (torch.zeros(1, 4, 2, 2), t), {}) is None        # CPU sample: untouched
    assert overlap.to_device(t, CPU) is t


def test_studio_generation_unchanged_with_cached_views(sd_folder):
    """The studio reuses one diffusers view and scheduler per (task, scheduler): a second generation of a seed is
    the same image, and another scheduler in between does not disturb it."""
    sd = DiffusionPipeline(load_diffusion(str(sd_folder)), OptimizationFlags(), CPU)

    def gen(**kw):
        p = DiffusionParams(**{**dict(prompt="a red fox", seed=11, steps=3, guidance=5.0, width=64, height=64), **kw})
        return sd.generate(GenerationRequest("diffusion", sd.model_id, p), Job())

    first = gen(scheduler="dpm++2m")
    other = gen(scheduler="euler-a")
    again = gen(scheduler="dpm++2m")
    assert len(sd._views) == 2
    np.testing.assert_allclose(again.raw, first.raw, rtol=0, atol=1e-6)   # one model, one process
    assert not np.allclose(first.raw, other.raw, atol=1e-3)
    # the 8-bit images are the float images rounded as diffusers rounds them
    u8 = np.stack([np.asarray(im) for im in first.images]).transpose(0, 3, 1, 2)
    assert np.array_equal(u8, (first.raw * 255).round().astype(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["pndm", "euler", "dpm++2m"])
def test_gpu_denoising_loop_does_not_sync_every_step(sd_folder, scheduler):
    """With CUDA's sync debug mode on, a 12-step generation synchronises a bounded number of times (prompt, start
    and end), not once or more per step as a stock diffusers loop with PNDM does."""
    cuda = torch.device("cuda")
    sd = DiffusionPipeline(load_diffusion(str(sd_folder), device=cuda), OptimizationFlags(precision="fp16"), cuda)
    p = DiffusionParams(prompt="a red fox", seed=1, steps=12, guidance=5.0, width=64, height=64, scheduler=scheduler)
    sd.generate(GenerationRequest("diffusion", sd.model_id, p), Job())          # warm-up
    torch.cuda.synchronize()
    counts = {}
    job = Job()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with job.stage("denoise_probe"):
                res = sd.generate(GenerationRequest("diffusion", sd.model_id, p), job)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts["syncs"] = sum("synchroniz" in str(w.message).lower() for w in caught)
    assert res.images and counts["syncs"] < 12, counts
