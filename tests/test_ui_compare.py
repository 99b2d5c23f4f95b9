"""Compare: the same request with the fp32 reference and with the chosen toggles (ui/compare.py),
on real generators (the NVlabs test pickle and the bundled emoji64 model) on the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from core.errors import Cancelled, InputError
from core.settings import Settings
from core.types import GenerationRequest, Job, OptimizationFlags, StyleGANParams
from pipelines.services import build_services
from ui.compare import MAX_COMPARE_IMAGES, comparison_request, reference_flags, render_comparison, run_comparison
from ui.controls import compare_spec
from tests.ui_helpers import SG_UNCOND


@pytest.fixture(scope="module")
def manager(tmp_path_factory, testdata):
    tmp = tmp_path_factory.mktemp("compare")
    settings = Settings(extra_models=(str(SG_UNCOND),), models_dirs=(), output_dir=tmp / "out", cache_dir=tmp / "cache",
                        default_stylegan_model=str(SG_UNCOND))
    return build_services(settings).manager


def _request(flags: OptimizationFlags, seeds=(0, 1, 2), model=None, psi=0.7) -> GenerationRequest:
    return GenerationRequest("stylegan", model or str(SG_UNCOND), StyleGANParams(seeds=seeds, truncation_psi=psi),
                             flags, "cpu")


def test_bf16_against_the_reference(manager):
    events = []
    job = Job(on_progress=lambda ev: events.append(ev.message))
    c = run_comparison(manager, _request(OptimizationFlags(precision="bf16", fp8=True)), job)
    assert c.reference.flags == OptimizationFlags() and c.candidate.flags.precision == "bf16"
    assert len(c.reference.images) == len(c.candidate.images) == 3
    a = np.stack([np.asarray(i) for i in c.reference.images])
    b = np.stack([np.asarray(i) for i in c.candidate.images])
    assert not np.array_equal(a, b)                                  # bf16 really ran
    assert 30 < c.drift["psnr_db"] < 80 and 0.95 < c.drift["ssim"] < 1.0
    assert c.heat.shape == (32, 32, 3) and c.heat.dtype == np.uint8 and c.gain >= 1
    assert c.reference.latency_ms > 0 and c.candidate.latency_ms > 0 and np.isfinite(c.speedup)
    assert c.candidate.optimizations["precision"]["mode"] == "autocast-bf16"
    # both configurations were new: each got an untimed warm-up, said so while it ran
    assert c.reference.warmup_ms is not None and c.candidate.warmup_ms is not None
    assert any("warm-up" in m for m in events) and any("timed run" in m for m in events)
    assert {"warm-up", "reference", "optimized"} <= set(job.timings_ms)
    html = render_comparison(c)
    for text in ("fp32 reference", "your settings", "drift: PSNR", "process memory (RSS)", "applied: precision autocast-bf16",
                 "not applied — fp8: FP8 needs compute capability"):
        assert text in html, text
    assert "Compared on cpu" in c.summary() and "PSNR" in c.summary()
    # a second comparison finds both pipelines loaded: no warm-up, and the reference is fp32 bit for bit
    again = run_comparison(manager, _request(OptimizationFlags(precision="bf16", fp8=True)), Job())
    assert again.reference.warmup_ms is None and again.candidate.warmup_ms is None
    assert np.array_equal(np.stack([np.asarray(i) for i in again.reference.images]), a)


def test_the_bundled_model_at_psi_07_in_bf16():
    """The out-of-the-box path: the default model, ψ 0.7, bf16 (this once failed with a dtype error)."""
    services = build_services(Settings(models_dirs=()))
    req = GenerationRequest("stylegan", None, StyleGANParams(seeds=(0, 1), truncation_psi=0.7),
                            OptimizationFlags(precision="bf16", channels_last=True), "cpu")
    c = run_comparison(services.manager, req, Job())
    assert c.drift["psnr_db"] > 30 and c.heat.shape[:2] == (64, 64)
    assert "channels_last" in render_comparison(c)


def test_nothing_to_compare_and_limits(manager):
    with pytest.raises(InputError, match="Nothing to compare"):
        comparison_request(_request(OptimizationFlags()))
    with pytest.raises(InputError, match="Nothing to compare"):        # --strict alone changes nothing
        comparison_request(_request(OptimizationFlags(strict=True)))
    req, notes = comparison_request(_request(OptimizationFlags(channels_last=True), seeds=tuple(range(20))))
    assert len(req.params.seeds) == MAX_COMPARE_IMAGES and notes == [f"compared the first {MAX_COMPARE_IMAGES} of 20 seeds"]
    # memory savers stay in the reference (they may be what lets the model fit)
    assert reference_flags(OptimizationFlags(precision="bf16", memory=("vae-tiling",))) == \
        OptimizationFlags(memory=("vae-tiling",))


def test_compare_spec_uses_plain_images_whatever_tab_is_open():
    spec = compare_spec({"backend": "stylegan", "seed": "3-5", "sg_mode": "interpolate", "precision": "bf16"})
    assert spec.kind == "compare" and spec.request.params.seeds == (3, 4, 5)
    with pytest.raises(InputError, match="seed"):
        compare_spec({"backend": "stylegan", "seed": "x", "precision": "bf16"})


def test_stop_reaches_the_comparison(manager):
    job = Job()
    job.cancel()
    with pytest.raises(Cancelled):
        run_comparison(manager, _request(OptimizationFlags(channels_last=True), seeds=tuple(range(8))), job)
    # a Stop pressed during the second (optimized) run: its child job shares the token, and stops
    # at its next step rather than finishing the batch
    steps = {"optimized": 0}

    def on_progress(ev):
        if ev.stage == "synthesis" and outer.stage_name == "optimized":
            steps["optimized"] += 1
            outer.cancel()

    outer = Job(on_progress=on_progress)
    req = GenerationRequest("stylegan", str(SG_UNCOND), StyleGANParams(seeds=tuple(range(8)), batch_size=1),
                            OptimizationFlags(channels_last=True), "cpu")
    with pytest.raises(Cancelled):
        run_comparison(manager, req, outer)
    assert steps["optimized"] == 1
    assert outer.child().cancelled


def test_diffusion_comparison_warms_up_with_two_steps(tmp_path_factory):
    """A tiny SD pipeline (built by the test): bf16 vs fp32 on the same CPU seed; the warm-up run of a
    new configuration uses at most 2 denoising steps and the same batch."""
    from core.types import DiffusionParams
    from tests.ui_helpers import tiny_sd_folder

    folder = tiny_sd_folder(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("compare-sd")
    services = build_services(Settings(extra_models=(str(folder),), models_dirs=(), output_dir=tmp / "out",
                                       cache_dir=tmp / "cache"))
    steps_seen = []
    job = Job(on_progress=lambda ev: steps_seen.append((job.stage_name, ev.total)) if ev.total else None)
    req = GenerationRequest("diffusion", str(folder), DiffusionParams(prompt="a red fox", seed=3, steps=4, width=64,
                                                                      height=64, batch_size=2),
                            OptimizationFlags(precision="bf16"), "cpu")
    c = run_comparison(services.manager, req, job)
    assert len(c.reference.images) == len(c.candidate.images) == 2
    # progress totals are the denoising steps asked for (PNDM's extra warm-up callback is not a step)
    assert {t for s, t in steps_seen if s == "warm-up"} == {2}
    assert {t for s, t in steps_seen if s != "warm-up"} == {4}
    assert 25 < c.drift["psnr_db"] < 90 and c.heat.shape == (64, 64, 3)
    assert {"denoise", "vae_decode"} <= set(c.candidate.timings_ms)
    assert "· denoise" in render_comparison(c)
