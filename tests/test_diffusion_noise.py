"""Seeded noise is drawn in float32 at every precision (issue 10), on tiny real pipelines (CPU).

On torch 2.11 the CPU's half-precision normal sampler gives another stream than the float32 one for the same
generator, so a diffusers fp16/bf16 draw changed the picture of a seed. On the torch these tests run on the two
streams may agree, so `half_sampler_of_torch_2_11` recreates that behaviour: the tests then fail without the
float32 draw on any torch.

Measured here (64x64, 3 steps, Euler a, seed 3; PSNR of the bf16 image against the fp32 one over [0, 1]):
txt2img SD 48.0 dB, SDXL 47.9 dB; img2img SD 47.6 dB, SDXL 47.3 dB; the same with the simulated 2.11 sampler.
Stock diffusers draws under that sampler give 11.5-12.8 dB (the H200 figures of issue 10), another seed about
13 dB. The bounds below (> 30 dB, < 20 dB) leave wide margins on both sides.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

import pipelines.diffusion as diffusion
import pipelines.diffusion_noise as noise
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags
from evaluation.drift import psnr
from pipelines.diffusion import SCHEDULER_NAMES, DiffusionPipeline, load_diffusion

CPU = torch.device("cpu")
PROMPT = "a photo of a cat"
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
INIT = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype(np.uint8))


def _cpu_runs_fp16() -> bool:
    try:
        x = torch.ones(1, 1, 4, 4, dtype=torch.float16)
        torch.nn.functional.conv2d(x, x[:, :, :3, :3])
        return True
    except RuntimeError:
        return False


PRECISIONS = ["bf16", pytest.param("fp16", marks=pytest.mark.skipif(not _cpu_runs_fp16(),
                                                                    reason="this CPU build has no fp16 convolutions"))]


@pytest.fixture(scope="module")
def pipes(tiny_sd_sdxl):
    """pipes(family, precision): one DiffusionPipeline per pair, built on first use."""
    made: dict[tuple[str, str], DiffusionPipeline] = {}

    def get(family: str, precision: str) -> DiffusionPipeline:
        if (family, precision) not in made:
            flags = OptimizationFlags(precision=precision)
            # fp16 weights stay fp32 on a CPU unless asked for by dtype; on a GPU the toggle casts them so.
            dtype = torch.float16 if precision == "fp16" else None
            loaded = load_diffusion(str(tiny_sd_sdxl[family]), dtype=dtype, flags=flags)
            made[(family, precision)] = DiffusionPipeline(loaded, flags, CPU)
        return made[(family, precision)]

    return get


def generate(pipe: DiffusionPipeline, task: str = "txt2img", job: Job | None = None, **kw):
    base = dict(prompt=PROMPT, negative_prompt="", seed=3, steps=3, guidance=6.0, width=64, height=64,
                scheduler="euler-a")
    if task == "img2img":
        base.update(init_image=INIT, strength=0.75, steps=4)        # 3 denoising steps, as txt2img
    base.update(kw)
    return pipe.generate(GenerationRequest("diffusion", pipe.model_id, DiffusionParams(**base)), job or Job())


@dataclass
class NoiseCall:
    module: str                     # the diffusers module that asked for noise
    shape: tuple
    dtype: torch.dtype | None       # the dtype it asked for
    state: torch.Tensor             # its generator's state before the draw
    out: torch.Tensor               # what it got


@pytest.fixture
def noise_calls(monkeypatch):
    """Every noise draw of a generation, seen from the diffusers module that made it (batch 1: one generator)."""
    calls: list[NoiseCall] = []
    real = noise.randn_fp32

    def recording(shape, generator=None, device=None, dtype=None, layout=None):
        assert isinstance(generator, torch.Generator), "the studio passes a CPU generator to every draw"
        state = generator.get_state()
        out = real(shape, generator=generator, device=device, dtype=dtype, layout=layout)
        calls.append(NoiseCall(sys._getframe(1).f_globals["__name__"], tuple(shape), dtype, state, out))
        return out

    monkeypatch.setattr(noise, "randn_fp32", recording)     # fp32_noise() installs whatever randn_fp32 is
    return calls


def fp32_draw(shape, state: torch.Tensor) -> torch.Tensor:
    g = torch.Generator("cpu")
    g.set_state(state)
    return torch.randn(shape, generator=g, dtype=torch.float32)


@pytest.fixture
def half_sampler_of_torch_2_11(monkeypatch):
    """torch.randn as on torch 2.11's CPU: a half-precision draw is another stream than the float32 draw from the
    same generator state (here the float32 stream negated). Returns the dtypes asked for."""
    real = torch.randn
    asked: list[torch.dtype | None] = []

    def randn(*size, generator=None, dtype=None, **kw):
        asked.append(dtype)
        if dtype in HALF.values():
            return (-real(*size, generator=generator, dtype=torch.float32, **kw)).to(dtype)
        return real(*size, generator=generator, dtype=dtype, **kw)

    monkeypatch.setattr(torch, "randn", randn)
    return asked


def randn_bindings() -> dict[str, object]:
    """What `randn_tensor` names in each loaded diffusers module."""
    return {name: vars(m)["randn_tensor"] for name, m in list(sys.modules.items())
            if name.startswith("diffusers") and m is not None and "randn_tensor" in vars(m)}


def diffusers_randn():
    from diffusers.utils import torch_utils

    return torch_utils.randn_tensor


# -- the draw itself ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_randn_fp32_draws_in_float32_and_casts(precision):
    dtype, shape = HALF[precision], (2, 4, 8, 8)
    with noise.fp32_noise():
        one = noise.randn_fp32(shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
        gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
        two = noise.randn_fp32(shape, generator=gens, device=CPU, dtype=dtype)
        same = noise.randn_fp32(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32)
    seed5 = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    assert one.dtype == dtype and torch.equal(one, seed5.to(dtype))
    per_seed = torch.cat([torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in (5, 6)])
    assert torch.equal(two, per_seed.to(dtype))                           # one generator per image, as diffusers
    assert torch.equal(same, diffusers_randn()(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32))


def test_the_simulated_torch_2_11_sampler_changes_stock_draws(half_sampler_of_torch_2_11):
    """Guards the simulation the other tests rely on: diffusers' own bf16 draw is then another stream."""
    stock = diffusers_randn()((1, 4, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    ref = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    assert float((stock.float() - ref).norm() / ref.norm()) > 1.0


# -- what a generation draws ----------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("task", ["txt2img", "img2img"])
@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_half_precision_noise_is_the_fp32_draw_cast(pipes, noise_calls, family, task, precision):
    """Initial latents, img2img noise, the VAE encoder's sample and Euler a's per-step noise: each is the float32
    draw from the generator's state at that moment, cast to the dtype the module asked for."""
    dtype = HALF[precision]
    res = generate(pipes(family, precision), task)
    assert res.images and np.isfinite(res.raw).all()
    for c in noise_calls:
        assert c.out.dtype == (c.dtype or torch.float32) and c.out.device == CPU, c.module
        assert torch.equal(c.out, fp32_draw(c.shape, c.state).to(c.out.dtype)), c.module
    by = {kind: [c for c in noise_calls if c.module.startswith(f"diffusers.{kind}.")]
          for kind in ("pipelines", "schedulers", "models")}
    assert len(by["pipelines"]) == 1 and by["pipelines"][0].dtype == dtype         # latents / img2img noise
    assert len(by["schedulers"]) == 3 and {c.dtype for c in by["schedulers"]} == {dtype}   # one per step
    assert len(by["models"]) == (1 if task == "img2img" else 0)                   # the VAE encoder's sample
    if task == "txt2img":                                                         # the first draw of the seed
        first = noise_calls[0]
        assert torch.equal(first.out, torch.randn(first.shape, generator=torch.Generator().manual_seed(3)).to(dtype))


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_bf16_image_of_a_seed_is_the_fp32_picture(pipes, monkeypatch, half_sampler_of_torch_2_11, family):
    """With torch 2.11's half sampler simulated, the bf16 image stays the fp32 picture; stock diffusers draws
    (the patch taken out) give another picture, so this test fails if the float32 draw is removed."""
    ref = generate(pipes(family, "fp32"), "txt2img")
    half_sampler_of_torch_2_11.clear()
    out = generate(pipes(family, "bf16"), "txt2img")
    assert half_sampler_of_torch_2_11 and all(d == torch.float32 for d in half_sampler_of_torch_2_11)
    assert psnr(ref.raw, out.raw, 1.0) > 30.0
    img2img = psnr(generate(pipes(family, "fp32"), "img2img").raw, generate(pipes(family, "bf16"), "img2img").raw, 1.0)
    assert img2img > 30.0
    monkeypatch.setattr(diffusion, "fp32_noise", contextlib.nullcontext)
    stock = generate(pipes(family, "bf16"), "txt2img")
    assert psnr(ref.raw, stock.raw, 1.0) < 20.0


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_no_draw_is_made_in_half_precision_with_any_scheduler(pipes, half_sampler_of_torch_2_11, name):
    """Euler a, DPM++ 2M SDE and LCM draw noise every step; the others only the initial latents."""
    generate(pipes("sd", "bf16"), "txt2img", scheduler=name, steps=2, guidance=2.0)
    assert half_sampler_of_torch_2_11 and set(half_sampler_of_torch_2_11) == {torch.float32}


def test_fp32_ancestral_image_equals_plain_diffusers(tiny_sd_sdxl, pipes):
    """In fp32 the per-step noise goes through diffusers' own function unchanged (the default-scheduler cases are
    in test_diffusion.py). Two separately built models: equal to float rounding."""
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionPipeline

    ref_pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd_sdxl["sd"]))
    ref_pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(ref_pipe.scheduler.config)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = ref_pipe(PROMPT, num_inference_steps=3, guidance_scale=6.0, width=64, height=64,
                   generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    res = generate(pipes("sd", "fp32"), "txt2img")
    np.testing.assert_allclose(res.raw, ref.transpose(0, 3, 1, 2), rtol=0, atol=1e-5)


# -- installed for a generation only --------------------------------------------------------------------------

def test_originals_are_restored_after_a_generation_an_error_and_a_cancel(pipes):
    pipe = pipes("sd", "bf16")
    before = randn_bindings()
    assert before and all(fn is diffusers_randn() for fn in before.values())
    during = []
    hook = pipe.pipe.unet.register_forward_pre_hook(lambda *a: during.append(set(randn_bindings().values())))
    try:
        generate(pipe, steps=2)
        assert during and all(seen == {noise.randn_fp32} for seen in during)
        assert randn_bindings() == before

        def boom(*a):
            raise RuntimeError("boom")

        failing = pipe.pipe.unet.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            generate(pipe, steps=2)
        failing.remove()
        assert randn_bindings() == before

        job = Job()
        job._on_progress = lambda ev: job.cancel() if ev.stage == "denoise" and ev.step == 1 else None
        assert generate(pipe, job=job, steps=4).cancelled
        assert randn_bindings() == before
    finally:
        hook.remove()


def test_nested_blocks_and_modules_imported_inside(monkeypatch):
    from diffusers.utils import torch_utils

    original = diffusers_randn()
    late = types.ModuleType("diffusers.atelier_probe")           # as if first imported during a generation
    with noise.fp32_noise():
        with noise.fp32_noise():
            pass
        assert torch_utils.randn_tensor is noise.randn_fp32       # still installed: the outer block is open
        late.randn_tensor = torch_utils.randn_tensor              # `from ...utils.torch_utils import randn_tensor`
        monkeypatch.setitem(sys.modules, late.__name__, late)
    assert torch_utils.randn_tensor is original and late.randn_tensor is original


def test_a_stock_call_in_another_thread_keeps_diffusers_behaviour(half_sampler_of_torch_2_11):
    """The benchmark's stock baseline is plain diffusers: a draw outside our block (here another thread while a
    generation holds the patch) is made in the dtype asked for, as diffusers makes it."""
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion as sd_module

    def draw():
        sd_module.randn_tensor((1, 4, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)

    with noise.fp32_noise():
        assert sd_module.randn_tensor is noise.randn_fp32
        other = threading.Thread(target=draw)
        other.start()
        other.join()
        assert half_sampler_of_torch_2_11 == [torch.bfloat16]
        draw()
        assert half_sampler_of_torch_2_11 == [torch.bfloat16, torch.float32]
    draw()
    assert half_sampler_of_torch_2_11[-1] == torch.bfloat16 and sd_module.randn_tensor is diffusers_randn()
