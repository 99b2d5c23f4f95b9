"""The tiny-autoencoder toggle (optim/tiny_vae.py) on tiny real SD / SDXL pipelines (CPU, fp32).

The tiny decoder is diffusers' AutoencoderTiny (TAESD's structure) at a few channels with random weights, saved
as a diffusers folder: the test checks that the final image *is* its decode of the last latents (forward hooks on
both decoders: the tiny one runs, the VAE's does not), that live previews come from it, and that every way of
not having it (no folder, a hub id not in the cache offline, a decoder for other latents) says why and leaves
the full VAE decoding."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from core.errors import OptionalDependencyError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags as Flags
from pipelines.diffusion import DiffusionPipeline, load_diffusion
from tests.diffusion_tiny import build_tiny_taesd
from tests.optim_helpers import CPU

TINY = Flags(tiny_vae=True)


@pytest.fixture(scope="module")
def taesd(tmp_path_factory):
    return build_tiny_taesd(tmp_path_factory.mktemp("taesd") / "tiny-taesd")


def _pipeline(folder, flags) -> DiffusionPipeline:
    return DiffusionPipeline(load_diffusion(str(folder), flags=flags), flags, CPU)


def _params(**kw) -> DiffusionParams:
    base = dict(prompt="a photo of a cat", negative_prompt="dog", seed=7, steps=3, guidance=6.0, width=64, height=64)
    return DiffusionParams(**{**base, **kw})


def _calls(module: torch.nn.Module, store: list):
    return module.register_forward_hook(lambda m, args, out: store.append((args[0].detach().clone(), out.detach().clone())))


@pytest.mark.parametrize("arch", ["sd", "sdxl"])
def test_the_tiny_decoder_makes_the_image_and_the_previews(tiny_sd_sdxl, taesd, arch, monkeypatch):
    monkeypatch.setenv("ATELIER_TINY_VAE" if arch == "sd" else "ATELIER_TINY_VAE_XL", str(taesd))
    pipe = _pipeline(tiny_sd_sdxl[arch], TINY)
    r = pipe.optimizations["tiny_vae"]
    assert r["applied"], r
    assert r["source"] == str(taesd) and r["family"] == arch and r["params"] < r["vae_decoder_params"]
    tiny = pipe.pipe.atelier_tiny_vae
    tiny_calls, vae_calls = [], []
    hooks = [_calls(tiny.decoder, tiny_calls), _calls(pipe.pipe.vae.decoder, vae_calls)]
    events = []
    try:
        res = pipe.generate(GenerationRequest("diffusion", pipe.model_id, _params(preview_every=1)),
                            Job(on_progress=events.append))
    finally:
        for h in hooks:
            h.remove()
    assert not vae_calls, "the full VAE decoder ran although the tiny one was asked for"
    previews = [e.preview for e in events if e.preview is not None]
    assert len(previews) == 3 and len(tiny_calls) == 4         # one preview per step, then the final decode
    assert all(p.size == (64, 64) for p in previews)
    lat, out = tiny_calls[-1]
    assert lat.shape == (1, 4, 8, 8) and out.shape == (1, 3, 64, 64)
    want = (out.float() / 2 + 0.5).clamp(0, 1).numpy()
    assert res.raw.shape == want.shape and float(np.abs(res.raw - want).max()) < 1e-5
    # the first preview is the tiny decode of the latents after step 1, not the linear latent map
    first = np.asarray(previews[0], dtype=np.float32) / 255.0
    want0 = ((tiny_calls[0][1][0].float().clamp(-1, 1) + 1) / 2).permute(1, 2, 0).numpy()
    assert float(np.abs(first - want0).max()) <= 1.0 / 255 + 1e-6
    # against the full VAE (same seed): a different decoder, a different picture
    full = _pipeline(tiny_sd_sdxl[arch], Flags()).generate(GenerationRequest("diffusion", pipe.model_id, _params()),
                                                           Job())
    assert full.raw.shape == res.raw.shape and float(np.abs(full.raw - res.raw).mean()) > 1e-3
    assert pipe.memory_bytes() > sum(p.numel() * 4 for p in tiny.parameters())


def test_missing_weights_leave_the_vae_decoding_and_say_where_they_were_looked_for(tiny_sd_sdxl, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("ATELIER_TINY_VAE", str(tmp_path / "nowhere"))
    pipe = _pipeline(tiny_sd_sdxl["sd"], TINY)
    r = pipe.optimizations["tiny_vae"]
    assert not r["applied"] and "not a diffusers AutoencoderTiny folder" in r["reason"]
    assert "the full VAE decodes" in r["reason"] and getattr(pipe.pipe, "atelier_tiny_vae", None) is None
    res = pipe.generate(GenerationRequest("diffusion", pipe.model_id, _params(steps=1)), Job())
    assert np.isfinite(res.raw).all()
    # a hub id with the hub unreachable and the cache empty: how to get it
    monkeypatch.setenv("ATELIER_TINY_VAE", "madebyollin/taesd")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = _pipeline(tiny_sd_sdxl["sd"], TINY).optimizations["tiny_vae"]
    assert not r["applied"] and "not in the local Hugging Face cache" in r["reason"]
    assert "hf download madebyollin/taesd" in r["reason"] and "ATELIER_TINY_VAE" in r["reason"]
    # --strict: the same is an error
    with pytest.raises(OptionalDependencyError, match="tiny_vae"):
        _pipeline(tiny_sd_sdxl["sd"], Flags(tiny_vae=True, strict=True))


def test_a_decoder_for_other_latents_is_refused(tiny_sd_sdxl, tmp_path, monkeypatch):
    monkeypatch.setenv("ATELIER_TINY_VAE", str(build_tiny_taesd(tmp_path / "two-level", levels=2)))
    r = _pipeline(tiny_sd_sdxl["sd"], TINY).optimizations["tiny_vae"]
    assert not r["applied"] and "upsamples latents 2x; this model's VAE 8x" in r["reason"]


def test_random_source_and_the_bench_config(tiny_sd_sdxl, monkeypatch):
    """'random' (what the benchmark's random-weight pipelines default to): TAESD's published architecture."""
    from bench.specs import get_workload, resolve_configs

    monkeypatch.setenv("ATELIER_TINY_VAE", "random")
    r = _pipeline(tiny_sd_sdxl["sd"], TINY).optimizations["tiny_vae"]
    assert r["applied"] and "random weights" in r["reason"]
    assert 1_000_000 < r["params"] < 1_500_000                   # TAESD's decoder: about 1.2 M parameters
    cfg = {c.name: c for c in resolve_configs(get_workload("sd15-512"), ["best", "best-taesd"])}
    assert cfg["best-taesd"].flags.tiny_vae and not cfg["best"].flags.tiny_vae
    assert "tiny VAE" in cfg["best-taesd"].description
    # the bench's vae_decode stage is bounded by the decoder that runs: the tiny one when the toggle is on
    from bench.runner import _diffusion_stages

    pipe = _pipeline(tiny_sd_sdxl["sd"], TINY).pipe
    assert pipe.atelier_tiny_vae.decoder in _diffusion_stages(pipe)["vae_decode"]


def test_cli_generate_with_tiny_vae_reports_it(tiny_sd_sdxl, taesd, tmp_path):
    from tests.conftest import ROOT

    out = tmp_path / "fox.png"
    env = dict(os.environ, ATELIER_TINY_VAE=str(taesd))
    proc = subprocess.run([sys.executable, str(ROOT / "app.py"), "generate", "--backend", "diffusion", "--model",
                           str(tiny_sd_sdxl["sd"]), "--prompt", "a fox", "--steps", "2", "--width", "64", "--height",
                           "64", "--tiny-vae", "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["optimizations"]["tiny_vae"]["applied"], doc["optimizations"]
    assert out.is_file()


def test_the_recorded_request_decodes_through_the_tiny_decoder_too(tiny_sd_sdxl, taesd, monkeypatch):
    """The request graph's function (run eagerly on the CPU, through the same static buffers) gives the normal
    path's image with the tiny decoder in both."""
    monkeypatch.setenv("ATELIER_TINY_VAE", str(taesd))
    normal, recorded = _pipeline(tiny_sd_sdxl["sd"], TINY), _pipeline(tiny_sd_sdxl["sd"], TINY)
    recorded._request_graph_mode = "eager"
    calls: list = []
    hook = _calls(recorded.pipe.atelier_tiny_vae.decoder, calls)
    req = GenerationRequest("diffusion", normal.model_id, _params(scheduler="euler", steps=2, guidance=0.0))
    want = normal.generate(req, Job())
    got = recorded.generate(req, Job())
    hook.remove()
    assert got.optimizations["request_graph"].get("last_fallback") is None, got.optimizations["request_graph"]
    assert len(calls) == 1
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=2e-5)


def test_compile_compiles_the_tiny_decoder_with_the_vae(tiny_sd_sdxl, taesd, monkeypatch, tmp_path):
    """With compile on, the tiny decoder is a compiled part beside the VAE decoder (eager backend: the wrapping and
    the report are what is checked here; the H200 bench measures the speed), and it decodes what it did eagerly."""
    import torch._dynamo

    from optim import compile as oc
    from optim.targets import Context, resolve

    monkeypatch.setenv("ATELIER_TINY_VAE", str(taesd))
    pipe = _pipeline(tiny_sd_sdxl["sd"], TINY)
    tiny = pipe.pipe.atelier_tiny_vae
    lat = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = tiny.decode(lat, return_dict=False)[0]
    torch._dynamo.reset()
    try:
        report = oc.apply(resolve(pipe.pipe, "diffusion"), Flags(compile="default", tiny_vae=True),
                          Context(CPU, tmp_path), backend="eager")
        assert report["applied"] and report["parts"]["tiny_vae_decoder"]["applied"], report
        assert type(tiny.decoder).__name__ == "OptimizedModule"
        with torch.no_grad():
            got = tiny.decode(lat, return_dict=False)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        monkeypatch.setenv("ATELIER_COMPILE_PARTS", "unet")           # "vae" not asked for: the tiny decoder stays
        pipe2 = _pipeline(tiny_sd_sdxl["sd"], TINY)
        r2 = oc.apply(resolve(pipe2.pipe, "diffusion"), Flags(compile="default", tiny_vae=True),
                      Context(CPU, tmp_path), backend="eager")
        assert "tiny_vae_decoder" not in r2.get("parts", {})
        assert type(pipe2.pipe.atelier_tiny_vae.decoder).__name__ != "OptimizedModule"
    finally:
        torch._dynamo.reset()


def _decoder_runs(pipe, method, preview_every=1):
    """(result, previews, tiny decoder calls, VAE decoder calls) of one 3-step request with `method` previews."""
    tiny_calls, vae_calls, events = [], [], []
    hooks = [_calls(pipe.pipe.vae.decoder, vae_calls)]
    tiny = pipe.pipe.atelier_tiny_vae if hasattr(pipe.pipe, "atelier_tiny_vae") else None
    res = None
    try:
        if tiny is not None:
            hooks.append(_calls(tiny.decoder, tiny_calls))
        res = pipe.generate(GenerationRequest("diffusion", pipe.model_id,
                                              _params(preview_every=preview_every, preview_method=method)),
                            Job(on_progress=events.append))
    finally:
        for h in hooks:
            h.remove()
    return res, [e.preview for e in events if e.preview is not None], tiny_calls, vae_calls


def test_preview_methods_decode_previews_only(tiny_sd_sdxl, taesd, monkeypatch):
    """Without the toggle, 'taesd' previews come from the tiny decoder and the final image from the full VAE, the
    same image as with the latent-map previews; 'full' previews run the VAE decoder once per preview."""
    monkeypatch.setenv("ATELIER_TINY_VAE", str(taesd))
    pipe = _pipeline(tiny_sd_sdxl["sd"], Flags())
    assert pipe.optimizations.get("tiny_vae") is None and tiny_vae_of(pipe) is None
    base, prev_l, _, vae_l = _decoder_runs(pipe, "latent")
    assert len(prev_l) == 3 and len(vae_l) == 1 and tiny_vae_of(pipe) is None      # the map: no decoder loaded
    res, prev_t, _, vae_t = _decoder_runs(pipe, "taesd")
    tiny = pipe._preview_tiny
    assert tiny is not None and len(prev_t) == 3 and len(vae_t) == 1                 # the VAE decodes the image only
    assert float(np.abs(res.raw - base.raw).max()) < 1e-5                           # previews do not touch the image
    assert not any("previews" in n for n in res.notes)
    # the first preview is the tiny decode of the latents after step 1
    calls = []
    h = _calls(tiny.decoder, calls)
    try:
        _decoder_runs(pipe, "taesd")
    finally:
        h.remove()
    assert len(calls) == 3
    _, prev_f, _, vae_f = _decoder_runs(pipe, "full")
    assert len(prev_f) == 3 and len(vae_f) == 4                                     # 3 previews + the image
    assert all(p.size == (64, 64) for p in prev_t + prev_f)
    assert np.abs(np.asarray(prev_f[-1], np.float32) - np.asarray(base.images[0], np.float32)).max() <= 1.0
    assert np.abs(np.asarray(prev_t[-1], np.float32) - np.asarray(prev_l[-1], np.float32)).mean() > 1.0


def tiny_vae_of(pipe):
    return getattr(pipe, "_preview_tiny", None)


def test_auto_previews_use_taesd_only_when_it_is_on_disk(tiny_sd_sdxl, taesd, tmp_path, monkeypatch):
    monkeypatch.setenv("ATELIER_TINY_VAE", str(tmp_path / "no-such-taesd"))
    pipe = _pipeline(tiny_sd_sdxl["sd"], Flags())
    res, prev, _, _ = _decoder_runs(pipe, "auto")
    assert len(prev) == 3 and tiny_vae_of(pipe) is None and not any("previews" in n for n in res.notes)
    # asked for by name and missing: the previews fall back to the map and the result says why
    res, prev, _, _ = _decoder_runs(pipe, "taesd")
    assert len(prev) == 3 and any("previews: tiny autoencoder not loaded" in n and "no-such-taesd" in n
                                  for n in res.notes), res.notes
    monkeypatch.setenv("ATELIER_TINY_VAE", str(taesd))
    pipe = _pipeline(tiny_sd_sdxl["sd"], Flags())
    _decoder_runs(pipe, "auto")
    assert tiny_vae_of(pipe) is not None                                           # on disk: auto takes it


def test_a_bad_preview_method_is_refused():
    from core.errors import InputError
    from ui.controls import PREVIEW_CHOICES, diffusion_params

    with pytest.raises(InputError, match="preview method must be one of auto, latent, taesd, full"):
        _params(preview_method="nn")
    assert {v for _, v in PREVIEW_CHOICES} == {"auto", "latent", "taesd", "full"}
    p = diffusion_params("a fox", "", "3", 4, 7.0, "512x512", "default", 1, None, 0.75, 2, "TAESD")
    assert p.preview_method == "taesd" and p.preview_every == 2
