"""torch.compile: buckets compile once each (checked with dynamo's error_on_recompile after warm-up),
first-run status, eager fallback, the on-disk / portable cache, and agreement with the fp32 reference.

The bucket logic is the same whatever the backend, so the StyleGAN and UNet guard tests use dynamo's
"eager" backend (tracing without code generation: seconds, not minutes on 2 CPU cores); a tiny conv
net goes through the real inductor backend and its cache in subprocesses.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo

import optim
from core.errors import AtelierError
from core.types import OptimizationFlags as Flags
from optim import compile as oc
from optim.targets import Context, resolve
from tests.optim_helpers import CPU, generate, latents, load_G, reference_G, rel_err

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def dynamo_clean():
    torch._dynamo.reset()
    old = torch._dynamo.config.error_on_recompile
    yield
    torch._dynamo.config.error_on_recompile = old
    torch._dynamo.reset()


def _compiled_stylegan(testdata, tmp_path, name="sg2_uncond_32", mode="default"):
    G = load_G(testdata, name)
    target = resolve(G, "stylegan")
    ctx = Context(CPU, tmp_path)
    report = oc.apply(target, Flags(compile=mode), ctx, backend="eager")
    return G, report


def test_batch_buckets():
    assert [oc.batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 130)] == \
        [1, 2, 4, 4, 8, 8, 16, 64, 64, 128, 192]
    with pytest.raises(ValueError):
        oc.batch_bucket(0)


def test_stylegan_buckets_compile_once_and_never_recompile(testdata, tmp_path, dynamo_clean):
    G, report = _compiled_stylegan(testdata, tmp_path)
    ref_G = load_G(testdata, "sg2_uncond_32")
    assert report["applied"] and report["component"] == "synthesis" and report["dynamic"] is False
    messages = []
    assert optim.set_status_callback(G, messages.append)
    # warm-up: batches 1 and 3 (-> bucket 4)
    for n in (1, 3):
        assert optim.is_first_run(G, n)
        out = generate(G, Flags(), seeds=tuple(range(n)))
        assert not optim.is_first_run(G, n)
        assert rel_err(generate(ref_G, Flags(), seeds=tuple(range(n))), out) < 1e-6
    assert messages.count(oc.FIRST_RUN_STATUS) == 2 and any(m.startswith("compiled 4xconst") for m in messages)
    assert set(report["buckets"]) == {"1xconst", "4xconst"}
    assert not optim.is_first_run(G, 4) and optim.is_first_run(G, 2) and optim.is_first_run(G, 5)
    # after warm-up: new seeds, ψ values, batch 4 in the warmed bucket, grad mode on and off
    torch._dynamo.config.error_on_recompile = True
    for n, psi in ((1, 0.5), (3, 1.0), (4, 0.3)):
        z, c = latents(G, seeds=tuple(range(10, 10 + n)))
        img = G(z, c, truncation_psi=psi, noise_mode="const")
        assert img.shape == (n, 3, 32, 32)
        with torch.no_grad():
            ws = G.mapping(z, c, truncation_psi=psi)
            assert G.synthesis(ws, noise_mode="const").shape == (n, 3, 32, 32)
    assert messages.count(oc.FIRST_RUN_STATUS) == 2


def test_naive_compile_of_the_generator_would_recompile_per_psi(testdata, dynamo_clean):
    """The control: compiling the whole generator specialises on ψ, which the guard above would catch."""
    G = load_G(testdata, "sg2_uncond_32")
    cg = torch.compile(G, backend="eager", dynamic=False)
    z, c = latents(G, seeds=(0, 1))
    with torch.no_grad():
        cg(z, c, truncation_psi=0.7)
        torch._dynamo.config.error_on_recompile = True
        with pytest.raises(torch._dynamo.exc.RecompileError):
            cg(z, c, truncation_psi=0.5)


@pytest.mark.slow
def test_stylegan3_synthesis_compiles_and_matches(testdata, tmp_path, dynamo_clean):
    G, report = _compiled_stylegan(testdata, tmp_path, "sg3t_uncond_32")
    ref = generate(load_G(testdata, "sg3t_uncond_32"), Flags(), seeds=(0,))
    assert rel_err(ref, generate(G, Flags(), seeds=(0,))) < 1e-6
    assert set(report["buckets"]) == {"1xconst"}


def test_stylegan3_is_compiled_without_inductor_layout_optimization(testdata):
    # Inductor would hand the convolutions' outputs to the NCHW-tiled filtered_lrelu kernel as NHWC.
    assert oc._stylegan_options(load_G(testdata, "sg3t_uncond_32").synthesis) == {"layout_optimization": False}
    assert oc._stylegan_options(load_G(testdata, "sg2_uncond_32").synthesis) is None


def test_freezing_is_an_opt_in_inductor_option(testdata, monkeypatch):
    monkeypatch.setenv("ATELIER_INDUCTOR_FREEZING", "1")
    assert oc._stylegan_options(load_G(testdata, "sg2_uncond_32").synthesis) == {"freezing": True}
    opts = oc._stylegan_options(load_G(testdata, "sg3t_uncond_32").synthesis)
    assert opts == {"layout_optimization": False, "freezing": True}
    torch.compile(torch.nn.Linear(2, 2), options=dict(opts, **{"triton.cudagraphs": True}))   # names torch knows


def test_inductor_options_reach_torch_compile_and_the_module_runs(tmp_path, dynamo_clean):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU()).eval()
    report = {}
    compiled = oc.compile_module(net, "module", "reduce-overhead", CPU, report,
                                 inductor_options={"layout_optimization": False})
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert rel_err(net(x), compiled(x)) < 1e-5
    assert report["inductor_options"] == {"layout_optimization": False}
    # the spelling the GPU path uses (reduce-overhead as its one option) is one torch accepts
    torch.compile(net, options={"layout_optimization": False, "triton.cudagraphs": True})
    with pytest.raises(RuntimeError, match="no_such_option"):
        torch.compile(net, options={"no_such_option": True})


def test_compile_failure_falls_back_to_eager_with_reason(testdata, tmp_path, dynamo_clean):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("simulated compiler crash")

    G = load_G(testdata, "sg2_uncond_32")
    report = oc.apply(resolve(G, "stylegan"), Flags(compile="default"), Context(CPU, tmp_path), backend=broken_backend)
    ref = generate(load_G(testdata, "sg2_uncond_32"), Flags(), seeds=(0,))
    out = generate(G, Flags(), seeds=(0,))
    assert rel_err(ref, out) < 1e-6
    assert "simulated compiler crash" in report["failures"]["1xconst"] and "ran eagerly" in report["failures"]["1xconst"]
    assert not optim.is_first_run(G, 1)                      # no retry storm on the same shape


@pytest.mark.slow
def test_unet_in_pipeline_compiles_once_per_resolution(tmp_path, dynamo_clean):
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    pipe = tiny_pipeline()
    ref_pipe = tiny_pipeline()
    report = oc.apply(resolve(pipe, "diffusion"), Flags(compile="reduce-overhead"), Context(CPU, tmp_path),
                      backend="eager")
    assert report["applied"] and report["mode"] == "default" and "CUDA graphs" in report["note"]
    assert type(pipe.unet).__name__ == "OptimizedModule" and pipe.unet.config.in_channels == 4
    pe = prompt_embeds()

    def run(p, size, seed=0):
        g = torch.Generator().manual_seed(seed)
        return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=2,
                 height=size, width=size, output_type="np", generator=g).images
    assert optim.is_first_run(pipe, (2, 16, 16))
    out = run(pipe, 32)
    assert not optim.is_first_run(pipe, (2, 16, 16))
    assert abs(out - run(ref_pipe, 32)).max() < 1e-5
    run(pipe, 48)                                              # a second resolution: one more bucket
    assert set(report["buckets"]) == {"2x16x16", "2x24x24"}
    # the VAE decoder and the text encoder are compiled too, each with its own buckets
    assert type(pipe.vae.decoder).__name__ == "OptimizedModule" and type(pipe.text_encoder).__name__ == "OptimizedModule"
    assert set(report["parts"]["vae_decoder"]["buckets"]) == {"1x4x16x16", "1x4x24x24"}
    cfg = pipe.text_encoder.config
    ids = [torch.randint(0, cfg.vocab_size, (1, cfg.max_position_embeddings), generator=torch.Generator().manual_seed(i))
           for i in range(2)]
    with torch.no_grad():
        for x in ids:       # as diffusers' encode_prompt calls it (the SDXL pipelines also ask for hidden states)
            got, want = pipe.text_encoder(x, output_hidden_states=True), ref_pipe.text_encoder(x, output_hidden_states=True)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got.hidden_states[-2], want.hidden_states[-2], rtol=1e-4, atol=1e-5)
    assert set(report["parts"]["text_encoder"]["buckets"]) == {f"1x{cfg.max_position_embeddings}"}
    torch._dynamo.config.error_on_recompile = True
    run(pipe, 32, seed=5)                                      # other seed, every timestep: no recompile
    run(pipe, 48, seed=6)
    with torch.no_grad():
        pipe.text_encoder(ids[0].flip(1), output_hidden_states=True)     # other tokens: no recompile


def test_graphs_not_captured_as_cuda_graphs_are_reported(dynamo_clean):
    """reduce-overhead: a graph inductor declines to capture (here: CPU tensors, the same check that catches a
    stray CPU tensor in a CUDA model) is named in the report instead of being claimed as replayed."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU()).eval()
    report: dict = {}
    compiled = torch.compile(net, backend="cudagraphs", dynamic=False)   # dynamo's CUDA-graph trees, no codegen
    compiled.forward = oc._BucketedCall(compiled.forward, net, oc.BucketTracker(report), "module", True, None, "")
    x = torch.randn(2, 3, 8, 8)
    out = compiled(x)
    with torch.no_grad():   # compiled against eager: to float rounding (a traced graph may fuse or reorder)
        torch.testing.assert_close(out, net(x), rtol=1e-5, atol=1e-6)
    # a generic module's bucket is its input's whole shape
    assert set(report["cudagraph_skips"]) == {"2x3x8x8"} and "without CUDA graphs" in report["cudagraph_skips"]["2x3x8x8"]
    compiled(torch.randn(1, 3, 8, 8))                      # every new shape is checked on its first run
    assert set(report["cudagraph_skips"]) == {"2x3x8x8", "1x3x8x8"}


def test_artifact_file_key_separates_configurations(testdata, tmp_path):
    """One model compiled with and without FP8 / pruning / channels_last must not share an artifacts file."""
    G = load_G(testdata, "sg2_uncond_32")
    target, ctx = resolve(G, "stylegan"), Context(CPU, tmp_path, weights_hash="ab" * 32)

    def key(**kw):
        return oc._cache_key(target, Flags(compile="default", **kw), ctx, G.synthesis)
    keys = {key(), key(fp8=True), key(prune_amount=0.3), key(channels_last=True), key(precision="bf16"),
            key(memory=("attention-slicing",))}
    assert len(keys) == 6
    assert key() == key(strict=True)                      # --strict changes nothing that is compiled


def test_prepare_compile_reports_cache_dir(testdata, tmp_path, dynamo_clean):
    G = load_G(testdata, "sg2_uncond_32")
    _, report = optim.prepare(G, Flags(compile="default"), CPU, kind="stylegan", cache_dir=tmp_path)
    r = report["compile"]
    assert r["applied"] and r["backend"] == "inductor" and r["cache_dir"] == str(tmp_path / "compile")
    # inductor's folder is process-wide, set by the first configure_process of this process (maybe this one)
    folder = oc.process_compile_dir()
    assert r["kernel_cache_dir"] == str(folder) and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")


_CACHE_SCRIPT = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    import torch
    from torch._dynamo.utils import counters
    from optim import compile as oc
    cache = oc.CompileCache(sys.argv[1])
    loaded = cache.activate()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 3, 1)).eval()
    report = {{}}
    compiled = oc.compile_module(net, "module", "default", torch.device("cpu"), report, cache, "tiny")
    x = torch.randn(2, 3, 16, 16)
    t0 = time.perf_counter()
    out = compiled(x)
    with torch.no_grad():
        ref = net(x)
    print(json.dumps({{"loaded": loaded, "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"], "s": time.perf_counter() - t0,
                      "err": float((out - ref).abs().max()), "report": report}}))
""")


def _run_cache_script(cache_dir: Path) -> dict:
    code = _CACHE_SCRIPT.format(root=str(ROOT))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    res = subprocess.run([sys.executable, "-c", code, str(cache_dir)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


_DEFERRED_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import torch
    from optim import compile as oc
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU()).eval()
    report = {{}}
    cache = oc.CompileCache(sys.argv[1])
    compiled = oc.compile_module(net, "module", "default", torch.device("cpu"), report, cache, "deferred")
    before = "torch._inductor.compile_fx" in sys.modules
    kind = type(compiled).__name__
    same = compiled._orig_mod is net
    x = torch.randn(1, 3, 8, 8)
    out = compiled(x)
    with torch.no_grad():
        err = float((out - net(x)).abs().max())
    print(json.dumps({{"before": before, "after": "torch._inductor.compile_fx" in sys.modules, "kind": kind,
                      "same": same, "err": err, "buckets": list(report.get("buckets", {{}})),
                      "loaded": report.get("cache_artifacts_loaded")}}))
""")


@pytest.mark.slow
def test_compile_toggle_defers_the_compiler_to_the_first_call(tmp_path):
    """Wrapping costs nothing (a start whose parts come from AOT packages never calls them): inductor's compiler
    is imported, and the cache's artifacts loaded, at the first call; the wrapper is an OptimizedModule around
    the module itself (what diffusers unwraps)."""
    code = _DEFERRED_SCRIPT.format(root=str(ROOT))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] is False, "torch.compile's compiler was imported before the first call"
    assert out["after"] is True and out["buckets"] == ["1x3x8x8"]     # the first call compiled
    assert out["kind"] == "OptimizedModule" and out["same"] is True
    assert out["err"] < 1e-5 and out["loaded"] == 0


@pytest.mark.slow
def test_inductor_matches_eager_and_second_start_hits_the_cache(tmp_path):
    first = _run_cache_script(tmp_path / "a")
    assert first["err"] < 1e-5 and first["miss"] >= 1 and first["hit"] == 0
    assert list(first["report"]["buckets"]) == ["2x3x16x16"]          # a module's bucket: its input's shape
    artifacts = sorted((tmp_path / "a" / "compile" / "artifacts").glob("*.bin"))
    assert len(artifacts) == 1 and artifacts[0].stat().st_size > 0
    # a second start on the same cache: the FX graph comes from disk
    second = _run_cache_script(tmp_path / "a")
    assert second["hit"] >= 1 and second["miss"] == 0 and second["err"] < 1e-5
    # a fresh machine given only the portable artifacts file: loaded, and a hit as well
    fresh = tmp_path / "b" / "compile" / "artifacts"
    fresh.mkdir(parents=True)
    (fresh / artifacts[0].name).write_bytes(artifacts[0].read_bytes())
    third = _run_cache_script(tmp_path / "b")
    assert third["loaded"] == 1 and third["hit"] >= 1 and third["miss"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_stylegan_compile_inductor(testdata, tmp_path, mode, dynamo_clean):
    cuda = torch.device("cuda")
    ref = generate(reference_G(testdata, "sg2_cond4_64_fp16", cuda), Flags(), seeds=(0, 1, 2), device=cuda)
    G = load_G(testdata, "sg2_cond4_64_fp16").to(cuda)
    G, report = optim.prepare(G, Flags(compile=mode), cuda, kind="stylegan", cache_dir=tmp_path)
    assert report["compile"]["applied"] and report["compile"]["mode"] == mode
    for n in (1, 2, 3):
        out = generate(G, Flags(), seeds=tuple(range(n)), device=cuda)
    assert rel_err(ref, out) < 1e-3
    assert "cudagraph_skips" not in report["compile"], report["compile"]["cudagraph_skips"]
    torch._dynamo.config.error_on_recompile = True
    for n in (1, 2, 3, 4):
        generate(G, Flags(), seeds=tuple(range(20, 20 + n)), device=cuda)
    # an image kept across calls survives the next replay of the same bucket (CUDA graphs reuse output memory)
    with torch.no_grad():
        z, c = latents(G, seeds=(5, 6))
        kept = G(z.to(cuda), c.to(cuda), noise_mode="const")
        snapshot = kept.clone()
        z, c = latents(G, seeds=(7, 8))
        other = G(z.to(cuda), c.to(cuda), noise_mode="const")
    assert torch.equal(kept, snapshot) and not torch.equal(kept, other)


@pytest.mark.gpu
def test_gpu_cuda_graphs_replay_in_other_threads(testdata, tmp_path, dynamo_clean):
    """The studio runs generation in Gradio's worker threads: graphs compiled and recorded in one thread
    (CUDA-graph trees keep per-thread state) replay in others, without recompiling, with the same image."""
    from concurrent.futures import ThreadPoolExecutor

    cuda = torch.device("cuda")
    G = load_G(testdata, "sg2_cond4_64_fp16").to(cuda)
    G, report = optim.prepare(G, Flags(compile="reduce-overhead"), cuda, kind="stylegan", cache_dir=tmp_path)
    for _ in range(3):                         # compile, record, replay
        here = generate(G, Flags(), seeds=(0, 1), device=cuda)
    torch._dynamo.config.error_on_recompile = True
    with ThreadPoolExecutor(2) as pool:
        there = [pool.submit(generate, G, Flags(), (0, 1), cuda).result() for _ in range(4)]
    assert all(rel_err(here, t) < 1e-6 for t in there)
    assert set(report["compile"]["buckets"]) == {"2xconst"}


@pytest.mark.gpu
def test_gpu_unet_compile_reduce_overhead(tmp_path, dynamo_clean):
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    cuda = torch.device("cuda")
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(precision="bf16"), cuda, kind="diffusion")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(precision="bf16", compile="reduce-overhead"), cuda,
                                 kind="diffusion", cache_dir=tmp_path)
    assert report["compile"]["applied"] and report["compile"]["mode"] == "reduce-overhead"
    pe = prompt_embeds().to(cuda, torch.bfloat16)

    def run(p, seed=0):
        g = torch.Generator("cpu").manual_seed(seed)
        return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=3, height=32,
                 width=32, output_type="np", generator=g).images
    assert abs(run(pipe) - run(ref_pipe)).max() < 0.05
    assert "cudagraph_skips" not in report["compile"], report["compile"]["cudagraph_skips"]   # really replayed
    # an output kept across calls survives the next replay (CUDA graphs reuse their output memory);
    # the call has the pipeline's own argument set, so it reuses the 2x16x16 graph (32 px, VAE factor 2)
    g = torch.Generator("cpu").manual_seed(7)
    lat = [torch.randn(2, 4, 16, 16, generator=g).to(cuda, torch.bfloat16) for _ in range(2)]
    ctx, t = torch.cat([torch.zeros_like(pe), pe]), torch.tensor(500, device=cuda)

    def unet(x):
        return pipe.unet(x, t, encoder_hidden_states=ctx, timestep_cond=None, cross_attention_kwargs=None,
                         added_cond_kwargs=None, return_dict=False)[0]
    kept = unet(lat[0])
    snapshot = kept.clone()
    other = unet(lat[1])
    assert torch.equal(kept, snapshot) and not torch.equal(kept, other)
    torch._dynamo.config.error_on_recompile = True
    run(pipe, seed=3)


def test_inductor_tuning_switch_reaches_every_diffusion_part(tmp_path, dynamo_clean, monkeypatch):
    """ATELIER_INDUCTOR_TUNING (the H200 A/B switch): its inductor options are ones torch knows, every compiled
    diffusion part gets them, the cache key changes with it (so tuned and untuned artifacts never mix), and a
    typo is an error naming the choices."""
    from tests.optim_tiny import tiny_pipeline

    monkeypatch.delenv(oc.TUNING_ENV, raising=False)
    assert oc._diffusion_options() is None
    pipe = tiny_pipeline()
    target = resolve(pipe, "diffusion")
    ctx = Context(CPU, tmp_path)
    plain_key = oc._cache_key(target, Flags(compile="default"), ctx, pipe.unet)
    monkeypatch.setenv(oc.TUNING_ENV, "coordinate")
    opts = oc._diffusion_options()
    assert opts["coordinate_descent_tuning"] and "max_autotune" not in opts
    assert oc._cache_key(target, Flags(compile="default"), ctx, pipe.unet) != plain_key
    torch.compile(torch.nn.Linear(2, 2), options=dict(opts, **{"triton.cudagraphs": True}))   # names torch knows
    monkeypatch.setenv(oc.TUNING_ENV, "max-autotune")
    assert oc._diffusion_options()["max_autotune"]
    seen, real = [], oc.compile_module

    def recording(module, *args, **kw):           # the real compile, with what each part was given noted
        seen.append((type(module).__name__, kw.get("inductor_options")))
        return real(module, *args, **kw)
    monkeypatch.setattr(oc, "compile_module", recording)
    report = oc.apply(target, Flags(compile="default"), ctx, backend="eager")
    assert report["applied"] and report["tuning"] == "max-autotune"
    assert {name for name, _ in seen} >= {"UNet2DConditionModel", "CLIPTextModel", "Decoder"}, seen
    assert all(o and o["max_autotune"] and o["coordinate_descent_tuning"] for _, o in seen), seen
    monkeypatch.setenv(oc.TUNING_ENV, "fastest")
    with pytest.raises(AtelierError, match="ATELIER_INDUCTOR_TUNING must be one of off, coordinate, max-autotune"):
        oc._diffusion_options()
