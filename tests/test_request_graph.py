"""pipelines/request_graph.py: one CUDA graph per diffusion request.

On the CPU the recorded path's function runs without recording ("eager" mode), through the same static buffers,
so these tests check what the graph will replay: op for op the image diffusers' own call gives for the seed
(several schedulers, with and without CFG, batch 2, a new prompt and seed in the same buffers), the requests it
declines and why, and the toggle's report. On a GPU (gpu marker) the recorded graph is checked against the
normal path, and replays with new prompts, seeds and guidance against fresh normal-path images.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags
from pipelines import request_graph as rgraph
from pipelines.diffusion import DiffusionPipeline, load_diffusion, make_scheduler

CPU = torch.device("cpu")


def _gen(sd, **kw):
    p = DiffusionParams(**{**dict(prompt="a red fox", seed=11, steps=3, guidance=5.0, width=64, height=64), **kw})
    return sd.generate(GenerationRequest("diffusion", sd.model_id, p), Job())


@pytest.fixture(scope="module")
def pair(tiny_sd_sdxl):
    """The tiny SD pipeline twice on the CPU: the normal path, and the recorded path's function (eager)."""
    loaded = load_diffusion(str(tiny_sd_sdxl["sd"]))
    normal = DiffusionPipeline(loaded, OptimizationFlags(), CPU)
    recorded = DiffusionPipeline(load_diffusion(str(tiny_sd_sdxl["sd"])), OptimizationFlags(), CPU)
    recorded._request_graph_mode = "eager"
    return normal, recorded


@pytest.mark.parametrize("kw", [
    dict(scheduler="euler", steps=1, guidance=0.0),                 # SD-Turbo's request: 1 step, no CFG
    dict(scheduler="euler", steps=4, guidance=5.0),
    dict(scheduler="dpm++2m-karras", steps=5, guidance=7.5, negative_prompt="blurry"),
    dict(scheduler="pndm", steps=4, guidance=7.5),                  # PLMS: one more UNet call than steps
    dict(scheduler="heun", steps=3, guidance=4.0),                  # two UNet calls a step
    dict(scheduler="ddim", steps=3, guidance=0.0, batch_size=2, seed=5),
])
def test_recorded_function_gives_the_normal_image(pair, kw):
    normal, recorded = pair
    want = _gen(normal, **kw)
    got = _gen(recorded, **kw)
    assert got.optimizations["request_graph"].get("last_fallback") is None, got.optimizations["request_graph"]
    assert got.raw.shape == want.raw.shape == (kw.get("batch_size", 1), 3, 64, 64)
    # one model, one process, the same ops: equal to float rounding (the CFG combine order is diffusers')
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=2e-5)
    u8 = np.stack([np.asarray(im) for im in got.images]).transpose(0, 3, 1, 2)
    assert np.array_equal(u8, (got.raw * 255).round().astype(np.uint8))
    assert [m["seed"] for m in got.metadata] == [m["seed"] for m in want.metadata]


def test_same_shape_reuses_the_buffers_with_new_inputs(pair):
    """A second request of the same shape (another prompt, seed and guidance) runs through the same recorded
    request and gives its own image, not the first one's."""
    normal, recorded = pair
    kw = dict(scheduler="euler", steps=2, width=64, height=64)
    _gen(recorded, prompt="a red fox", seed=1, guidance=3.0, **kw)
    key = rgraph.GraphKey(1, 64, 64, 2, "euler", True)
    rec = recorded._graphs.graphs[key]
    n0 = rec.replays
    got = _gen(recorded, prompt="a blue house", seed=2, guidance=6.0, **kw)
    want = _gen(normal, prompt="a blue house", seed=2, guidance=6.0, **kw)
    assert recorded._graphs.graphs[key] is rec and rec.replays == n0 + 1
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=2e-5)
    first = _gen(normal, prompt="a red fox", seed=1, guidance=3.0, **kw)
    assert not np.allclose(got.raw, first.raw, atol=1e-3)


@pytest.mark.parametrize("scheduler", ["euler", "dpm++2m-karras", "heun", "pndm"])
def test_a_short_warmup_pass_leaves_the_full_request_intact(pair, scheduler):
    """record()'s warm-up passes stop the denoising loop after warmup_unet_calls() UNet calls (the same shapes
    every call; a full 50-step pass was most of a second start's first call). The pass still decodes, and the
    request after it, which the graph records, runs every step from a reset scheduler: the normal image."""
    normal, recorded = pair
    kw = dict(scheduler=scheduler, steps=6, guidance=5.0)
    _gen(recorded, **kw)
    key = next(k for k in recorded._graphs.graphs if k.scheduler == scheduler and k.steps == 6)
    rec = recorded._graphs.graphs[key]
    calls = rgraph.warmup_unet_calls(len(rec._t_host))
    assert calls == rgraph.WARMUP_UNET_CALLS < len(rec._t_host)
    assert rgraph.warmup_unet_calls(1) == 1
    seen, decoded = [], []
    hooks = [recorded.pipe.unet.register_forward_hook(lambda *a: seen.append(1)),
             recorded.pipe.vae.decoder.register_forward_hook(lambda *a: decoded.append(1))]
    try:
        stages: dict = {}
        with torch.no_grad():
            rec._forward(calls, stages=stages)      # the (first) warm-up pass, as record() runs it
        assert len(seen) == calls and len(decoded) == 1, (len(seen), len(decoded))
        # where the pass's time goes, stage by stage (record_s["first_pass_stages"] on a GPU)
        assert set(stages) == {"text", "unet_first", "unet_rest", "decode"}, stages
        assert all(isinstance(v, float) and v >= 0 for v in stages.values()) and stages["unet_first"] > 0
        # asked to run whole, a pass without AOT packages still stops at the warm-up's calls (it compiles)
        seen.clear()
        with torch.no_grad():
            rec._forward(calls, whole_if_aot=True)
        assert len(seen) == calls and rec._whole_pass is False
        seen.clear()
        with torch.no_grad():
            rec._forward()
        assert len(seen) == len(rec._t_host) and rec._whole_pass is True
        seen.clear()
        got = _gen(recorded, prompt="a blue house", seed=4, **kw)
        assert len(seen) == len(rec._t_host)        # the recorded request: every step
    finally:
        for h in hooks:
            h.remove()
    want = _gen(normal, prompt="a blue house", seed=4, **kw)
    assert got.optimizations["request_graph"].get("last_fallback") is None
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kw, why", [
    (dict(scheduler="euler-a"), "fresh noise"),
    (dict(scheduler="dpm++2m-sde-karras"), "fresh noise"),
    (dict(preview_every=1), "previews"),
])
def test_declined_requests_run_the_normal_path_and_say_why(pair, kw, why):
    normal, recorded = pair
    got = _gen(recorded, **kw)
    want = _gen(normal, **kw)
    assert why in got.optimizations["request_graph"]["last_fallback"]
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def pair_xl(tiny_sd_sdxl):
    """The tiny SDXL pipeline twice on the CPU: the normal path, and the recorded path's function (eager)."""
    normal = DiffusionPipeline(load_diffusion(str(tiny_sd_sdxl["sdxl"])), OptimizationFlags(), CPU)
    recorded = DiffusionPipeline(load_diffusion(str(tiny_sd_sdxl["sdxl"])), OptimizationFlags(), CPU)
    recorded._request_graph_mode = "eager"
    return normal, recorded


@pytest.mark.parametrize("kw", [
    dict(scheduler="euler", steps=2, guidance=5.0),                              # empty negative: zero embeddings
    dict(scheduler="euler", steps=2, guidance=5.0, negative_prompt="blurry"),    # both encoders on the negative
    dict(scheduler="dpm++2m-karras", steps=3, guidance=0.0, batch_size=2),       # no CFG, batch 2
])
def test_sdxl_recorded_function_gives_the_normal_image(pair_xl, kw):
    """SDXL: both text encoders (penultimate states side by side, the second's pooled projection), the size
    conditioning and the empty-negative zeros, as diffusers' SDXL call makes them."""
    normal, recorded = pair_xl
    want = _gen(normal, **kw)
    got = _gen(recorded, **kw)
    assert got.optimizations["request_graph"].get("last_fallback") is None, got.optimizations["request_graph"]
    np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=2e-5)
    key = next(reversed(recorded._graphs.graphs))
    assert key.zero_negative == (kw["guidance"] > 1 and "negative_prompt" not in kw)


def test_img2img_is_declined(tiny_sd_sdxl, tmp_path):
    from PIL import Image

    sd = DiffusionPipeline(load_diffusion(str(tiny_sd_sdxl["sd"])), OptimizationFlags(), CPU)
    sd._request_graph_mode = "eager"
    init = tmp_path / "init.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(init)
    res = _gen(sd, steps=2, init_image=str(init), strength=0.5)
    assert "image-to-image" in res.optimizations["request_graph"]["last_fallback"] and res.images


def test_scheduler_reason_names_the_noisy_ones():
    base = {"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000}
    for name in ("euler", "ddim", "dpm++2m", "dpm++2m-karras", "unipc", "heun", "lms", "pndm"):
        assert rgraph.scheduler_reason(make_scheduler(name, base)) is None, name
    for name in ("euler-a", "dpm++2m-sde-karras", "lcm"):
        assert "noise" in rgraph.scheduler_reason(make_scheduler(name, base)), name


def test_toggle_on_the_cpu_is_skipped_with_a_reason_and_changes_nothing(tiny_sd_sdxl):
    sd = DiffusionPipeline(load_diffusion(str(tiny_sd_sdxl["sd"])), OptimizationFlags(request_graph=True), CPU)
    rep = sd.optimizations["request_graph"]
    assert rep["applied"] is False and "CUDA" in rep["reason"]
    assert sd._request_graph_mode is None
    assert _gen(sd, steps=1).images


def test_flag_round_trips_through_cli_api_and_bench():
    import argparse

    from bench.specs import get_workload, resolve_configs
    from cli.options import add_optimization_args, flags_from_args
    from ui.a1111_api import FLAG_TYPES

    ap = argparse.ArgumentParser()
    add_optimization_args(ap)
    assert flags_from_args(ap.parse_args(["--request-graph"])).request_graph is True
    assert flags_from_args(ap.parse_args([])).request_graph is False
    assert FLAG_TYPES["request_graph"] is bool
    assert OptimizationFlags.from_dict({"request_graph": True}).requested() == {"request_graph"}
    (cfg,) = resolve_configs(get_workload("sd-turbo-512"), ["best-graph"])
    assert cfg.flags.request_graph and cfg.flags.compile == "reduce-overhead" and "request graph" in cfg.description
    (own,) = resolve_configs(get_workload("sd-tiny"), ["g@precision=bf16+request_graph=1"])
    assert own.flags.request_graph and own.flags.precision == "bf16"


# -- on a GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family, precision, compile_mode", [("sd", "fp16", "reduce-overhead"),
                                                           ("sdxl", "bf16", "reduce-overhead")])
def test_gpu_recorded_request_matches_the_normal_path(tiny_sd_sdxl, family, precision, compile_mode):
    """The recorded graph replays what the normal path computes: same seed, same picture (half precision,
    compiled or not), and a replay with another prompt, seed and guidance gives that request's picture."""
    cuda = torch.device("cuda")
    folder = str(tiny_sd_sdxl[family])
    flags = OptimizationFlags(precision=precision, compile=compile_mode)
    normal = DiffusionPipeline(load_diffusion(folder, device=cuda), flags, cuda)
    graphed = DiffusionPipeline(load_diffusion(folder, device=cuda), OptimizationFlags(
        precision=precision, compile=compile_mode, request_graph=True), cuda)
    assert graphed._request_graph_mode == "capture", graphed.optimizations["request_graph"]
    for kw in (dict(steps=1, guidance=0.0), dict(steps=4, guidance=5.0, scheduler="dpm++2m")):
        for prompt, seed in (("a red fox", 3), ("a blue house", 4)):
            got = _gen(graphed, prompt=prompt, seed=seed, **kw)
            rep = got.optimizations["request_graph"]
            assert rep.get("last_fallback") is None and not rep.get("failures"), rep
            want = _gen(normal, prompt=prompt, seed=seed, **kw)
            err = float(np.abs(got.raw - want.raw).max())
            assert err < 2e-2, (kw, prompt, err)
    assert len(graphed._graphs.graphs) == 2 and all(r.graph is not None for r in graphed._graphs.graphs.values())


def test_studio_controls_carry_the_toggle_and_a_png_restores_it():
    """The Generate form's two diffusion toggles reach the request's flags, and a PNG's flags bring them back."""
    from ui.controls import controls_from_params, job_spec

    spec = job_spec({"backend": "diffusion", "prompt": "a fox", "fuse_qkv": True, "request_graph": True})
    assert spec.request.flags.request_graph and spec.request.flags.fuse_qkv
    assert not job_spec({"backend": "diffusion", "prompt": "a fox"}).request.flags.request_graph
    restored = controls_from_params({"backend": "diffusion", "prompt": "a fox", "flags": spec.request.flags.to_dict()})
    assert restored["request_graph"] is True and restored["fuse_qkv"] is True


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="AOTInductor needs a C++ compiler")
def test_aot_parts_compile_once_and_a_second_start_loads_them(tiny_sd_sdxl, tmp_path, monkeypatch):
    """ATELIER_REQUEST_GRAPH_AOT: by default (auto) a start uses the packages the cache has and builds none;
    with 1 the recorded request's text encoder, UNet and VAE decoder are compiled into AOTInductor packages on
    the first start; later starts load them with the model's own weights (auto does too, 0 does not), and the
    image is the normal path's throughout."""
    from pipelines import aot_parts

    folder = str(tiny_sd_sdxl["sd"])
    normal = DiffusionPipeline(load_diffusion(folder), OptimizationFlags(), CPU)
    want = _gen(normal, steps=1, guidance=0.0)
    reports = []
    for env in ("", "1", "", "0"):          # auto on an empty cache, build, auto again, off
        monkeypatch.setenv(aot_parts.ENV, env)
        sd = DiffusionPipeline(load_diffusion(folder), OptimizationFlags(), CPU, cache_dir=tmp_path)
        sd._request_graph_mode = "eager"
        got = _gen(sd, steps=1, guidance=0.0)
        rep = got.optimizations["request_graph"]
        assert rep.get("last_fallback") is None, rep
        np.testing.assert_allclose(got.raw, want.raw, rtol=0, atol=1e-4)
        reports.append(rep)
        aot = getattr(sd, "_aot", None)
        if env in ("", "0") and len(reports) >= 3:
            # a first pass asked to run whole once a package serves the UNet (record() on a GPU, whose picture
            # then serves the request): all three steps with the packages, the warm-up's one call without
            _gen(sd, steps=3, guidance=0.0)
            rec = next(r for k, r in sd._graphs.graphs.items() if k.steps == 3)
            with torch.no_grad():
                rec._forward(1, whole_if_aot=True)
            assert rec._whole_pass is (env == ""), (env, aot and aot._parts)
            if env == "":       # the text encoder eager (its package failed): that pass cannot serve, so it stays short
                kept = {k: p for k, p in aot._parts.items() if k.startswith("text_encoder-")}
                aot._parts.update(dict.fromkeys(kept))
                try:
                    with torch.no_grad():
                        rec._forward(1, whole_if_aot=True)
                    assert rec._whole_pass is False and not aot.serves_all(), aot._parts
                finally:
                    aot._parts.update(kept)
        if env in ("", "1"):   # the recording's warm-up: one pass once packages serve every part, else two
            served = env == "1" or len(reports) == 3
            assert aot is not None and aot.serves_all() is served, (env, aot and aot._parts)
            assert rgraph.warmup_passes(aot, xl=False) == (1 if served else 2)
            assert rgraph.warmup_passes(aot, xl=True) == 2       # SDXL's UNet has no package
    auto_empty, built, auto_loaded, off = reports
    assert "aot" not in auto_empty and auto_empty["aot_note"] == aot_parts.AUTO_NOTE, auto_empty
    built, auto_loaded = built["aot"], auto_loaded["aot"]
    assert sorted(k.split()[0] for k in built) == ["text_encoder", "unet", "vae_decoder"], built
    assert all("compiled_s" in e and "failed" not in e for e in built.values()), built
    assert sorted(auto_loaded) == sorted(built)
    assert all(e.get("loaded_from_cache") and "compiled_s" not in e for e in auto_loaded.values()), auto_loaded
    # a CPU package's code is built for the host's ISA: the public loader, with its device check, opens it
    assert all(e.get("loader") == "aoti_load_package" for e in auto_loaded.values()), auto_loaded
    assert "aot" not in off and "aot_note" not in off, off
    assert len(list((tmp_path / "aoti").glob("*.pt2"))) == 3


def test_aot_mode_values(monkeypatch):
    from pipelines import aot_parts

    for raw, want in (("", "auto"), ("auto", "auto"), ("1", "1"), ("on", "1"), ("0", "0"), ("false", "0")):
        monkeypatch.setenv(aot_parts.ENV, raw)
        assert aot_parts.mode() == want and aot_parts.enabled() is (want != "0")
    monkeypatch.setenv(aot_parts.ENV, "2")
    assert aot_parts.mode() == "2" and not aot_parts.enabled()


@pytest.mark.gpu
def test_gpu_aot_parts_recorded_and_loaded_on_a_second_start(tiny_sd_sdxl, tmp_path, monkeypatch):
    """On the GPU the AOT parts are recorded into the request graph; a second pipeline loads them from the
    cache folder (no export, no compile) and gives the normal path's picture."""
    from pipelines import aot_parts

    monkeypatch.setenv(aot_parts.ENV, "1")
    cuda = torch.device("cuda")
    folder = str(tiny_sd_sdxl["sd"])
    want = _gen(DiffusionPipeline(load_diffusion(folder, device=cuda), OptimizationFlags(precision="fp16"), cuda),
                steps=2, guidance=5.0, scheduler="euler")
    want2 = _gen(DiffusionPipeline(load_diffusion(folder, device=cuda), OptimizationFlags(precision="fp16"), cuda),
                 prompt="a blue house", seed=7, steps=5, guidance=5.0, scheduler="euler")
    entries = []
    for start in range(2):
        sd = DiffusionPipeline(load_diffusion(folder, device=cuda), OptimizationFlags(precision="fp16", request_graph=True),
                               cuda, cache_dir=tmp_path)
        got = _gen(sd, steps=2, guidance=5.0, scheduler="euler")
        rep = got.optimizations["request_graph"]
        assert rep.get("last_fallback") is None and not rep.get("failures"), rep
        assert float(np.abs(got.raw - want.raw).max()) < 2e-2
        entries.append(rep["aot"])
        passes = [k for (label, times) in rep["record_s"].items() for k in times if k.startswith("warmup_")]
        # one warm-up pass once the packages serve every part (the first start built them during its first pass,
        # so the check comes after it and finds them too)
        assert passes == ["warmup_1"], rep["record_s"]
        # that pass ran the whole request on the packages and its picture served it; no graph yet (deferred)
        (times,) = rep["record_s"].values()
        assert str(times["capture"]).startswith("deferred") and times["unet_calls_per_warmup"] == 2, times
        (rec,) = sd._graphs.graphs.values()
        assert rec.graph is None and rec.replays == 0
        # the shape's next request records the graph, then replays it: that request's own picture
        got = _gen(sd, steps=2, guidance=5.0, scheduler="euler", prompt="a blue house", seed=7)
        assert rec.graph is not None and rec.replays == 1 and isinstance(times["capture"], float), times
        ref = _gen(DiffusionPipeline(load_diffusion(folder, device=cuda), OptimizationFlags(precision="fp16"), cuda),
                   prompt="a blue house", seed=7, steps=2, guidance=5.0, scheduler="euler")
        assert float(np.abs(got.raw - ref.raw).max()) < 2e-2
        # a longer request: its first pass runs all five steps (the warm-up's three-call cut does not apply)
        got5 = _gen(sd, prompt="a blue house", seed=7, steps=5, guidance=5.0, scheduler="euler")
        times5 = got5.optimizations["request_graph"]["record_s"][next(k for k in got5.optimizations["request_graph"]
                                                                    ["record_s"] if "5 steps" in k)]
        assert times5["unet_calls_per_warmup"] == 5 and str(times5["capture"]).startswith("deferred"), times5
        assert float(np.abs(got5.raw - want2.raw).max()) < 2e-2
    assert all("compiled_s" in e and "failed" not in e for e in entries[0].values()), entries[0]
    assert all(e.get("loaded_from_cache") for e in entries[1].values()), entries[1]
    # CUDA packages through AOTInductor's loader class, without the public loader's ISA probe (41-49 s on the H200)
    assert all(e.get("loader") == "direct" for e in entries[1].values()), entries[1]


def test_cudnn_benchmark_while_recording_is_off_unless_asked(monkeypatch):
    """cuDNN's algorithm benchmark during recording bought nothing on the H200 and cost a second start time
    (2026-12-04 runs): off by default, ATELIER_RECORD_CUDNN_BENCHMARK=1 turns it on."""
    monkeypatch.delenv(rgraph.RECORD_CUDNN_BENCHMARK_ENV, raising=False)
    assert rgraph.cudnn_benchmark_when_recording() is False
    monkeypatch.setenv(rgraph.RECORD_CUDNN_BENCHMARK_ENV, "1")
    assert rgraph.cudnn_benchmark_when_recording() is True
    monkeypatch.setenv(rgraph.RECORD_CUDNN_BENCHMARK_ENV, "0")
    assert rgraph.cudnn_benchmark_when_recording() is False
