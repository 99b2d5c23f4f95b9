"""TensorRT path: the ONNX export is checked here against onnxruntime on the CPU (rel. error < 1e-4 in
fp32; measured ~5e-7 for StyleGAN2), the engine cache key and shape-profile checks are checked as plain
functions, the skip reason is exact where tensorrt is not importable, and the engine build and run are
gpu-marked (they need NVIDIA's tensorrt wheel on the GPU machine)."""
import numpy as np
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from optim import tensorrt as ot
from optim.hardware import has_package
from tests.optim_helpers import CPU, latents, load_G, prepared, reference_G, rel_err


def _ort(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.skipif(has_package("tensorrt"), reason="tensorrt is installed here")
def test_skip_reason_is_exact_when_tensorrt_is_missing(testdata):
    assert ot.unavailable_reason(CPU) == ot.TENSORRT_MISSING
    assert "NVIDIA's own package index" in ot.TENSORRT_MISSING and "ran in PyTorch" in ot.TENSORRT_MISSING
    G, report = prepared(testdata, "sg2_uncond_32", Flags(tensorrt=True))
    assert report["tensorrt"] == {"applied": False, "reason": ot.TENSORRT_MISSING}
    assert type(G.synthesis).__name__ == "SynthesisNetwork"        # untouched: PyTorch runs it


@pytest.fixture(scope="module")
def sg2_onnx(testdata, tmp_path_factory):
    """sg2_uncond_32's synthesis network exported once for the tests below (an export takes ~10 s)."""
    G = load_G(testdata, "sg2_uncond_32")
    return ot.export_stylegan_onnx(G.synthesis, tmp_path_factory.mktemp("sg2") / "sg2.onnx")


@pytest.fixture(scope="module")
def unet_onnx(tmp_path_factory):
    """tiny_unet(seed 0) exported once, with 8 text tokens (the tiny pipeline's prompt length)."""
    from tests.optim_tiny import tiny_unet

    unet = tiny_unet()
    return ot.export_unet_onnx(unet, tmp_path_factory.mktemp("unet") / "unet.onnx", ot.unet_profile(unet, tokens=8))


def test_stylegan2_synthesis_onnx_matches_pytorch(testdata, sg2_onnx):
    G = load_G(testdata, "sg2_uncond_32")
    path, profile = sg2_onnx
    assert profile.inputs["ws"][0][0] == 1 and profile.inputs["ws"][2][0] == 32
    sess = _ort(path)
    for n in (3, 1):                                          # dynamic batch, neither the export example
        z, c = latents(G, seeds=tuple(range(n)))
        with torch.no_grad():
            ws = G.mapping(z, c, truncation_psi=0.7)
            ref = G.synthesis(ws, noise_mode="const")         # the fused path the pipeline runs
        out = sess.run(None, {"ws": ws.numpy()})[0]
        assert out.shape == (n, 3, 32, 32)
        assert rel_err(ref, torch.from_numpy(out)) < 1e-4


@pytest.mark.slow
def test_stylegan3_synthesis_onnx_matches_pytorch(testdata, tmp_path):
    G = load_G(testdata, "sg3t_uncond_32")
    path, profile = ot.export_stylegan_onnx(G.synthesis, tmp_path / "sg3.onnx")
    assert profile.inputs["ws"][0] == profile.inputs["ws"][2]          # static batch 1
    z, c = latents(G, seeds=(4,))
    with torch.no_grad():
        ws = G.mapping(z, c)
        ref = G.synthesis(ws, noise_mode="const")
    out = _ort(path).run(None, {"ws": ws.numpy()})[0]
    assert rel_err(ref, torch.from_numpy(out)) < 1e-4


def _unet_feeds(unet, batch, size, tokens, seed=0):
    cfg = unet.config
    g = torch.Generator().manual_seed(seed)
    cross = cfg.cross_attention_dim
    feeds = {"sample": torch.randn(batch, 4, size, size, generator=g),
             "timestep": torch.tensor([999.0, 250.0, 10.0, 500.0][:batch]),
             "encoder_hidden_states": torch.randn(batch, tokens, cross, generator=g)}
    if cfg.addition_embed_type == "text_time":
        feeds["text_embeds"] = torch.randn(batch, 48, generator=g)
        feeds["time_ids"] = torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch)
    return feeds


def _check_unet_onnx(unet, path, profile, tokens):
    sess = _ort(path)
    assert profile.inputs["sample"][0][2:] == (4, 4) and profile.inputs["sample"][2][2:] == (16, 16)
    for batch, size in ((1, 12), (3, 16)):                   # away from the export example (2, 8)
        feeds = _unet_feeds(unet, batch, size, tokens)
        assert profile.accepts({k: tuple(v.shape) for k, v in feeds.items()}) is None
        added = ({"text_embeds": feeds["text_embeds"], "time_ids": feeds["time_ids"]}
                 if "text_embeds" in feeds else None)
        with torch.no_grad():
            ref = unet(feeds["sample"], feeds["timestep"], feeds["encoder_hidden_states"],
                       added_cond_kwargs=added).sample
        out = sess.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        assert rel_err(ref, torch.from_numpy(out)) < 1e-4


def test_unet_onnx_matches_pytorch_across_the_profile(unet_onnx):
    from tests.optim_tiny import tiny_unet

    path, profile = unet_onnx
    _check_unet_onnx(tiny_unet(), path, profile, tokens=8)


@pytest.mark.slow
def test_sdxl_unet_onnx_matches_pytorch(tmp_path):
    from tests.optim_tiny import tiny_sdxl_unet

    unet = tiny_sdxl_unet()
    path, profile = ot.export_unet_onnx(unet, tmp_path / "unet.onnx")
    assert set(profile.inputs) == {"sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"}
    _check_unet_onnx(unet, path, profile, tokens=77)


def test_profile_accepts_and_explains():
    p = ot.ShapeProfile({"sample": ((1, 4, 32, 32), (2, 4, 64, 64), (8, 4, 128, 128))}, {"sample.multiple": "8"})
    assert p.accepts({"sample": (2, 4, 64, 96)}) is None
    assert "outside the engine's profile" in p.accepts({"sample": (2, 4, 64, 136)})
    assert "outside the engine's profile" in p.accepts({"sample": (16, 4, 64, 64)})
    assert "multiples of 8" in p.accepts({"sample": (2, 4, 60, 64)})
    assert "no input" in p.accepts({"latents": (2, 4, 64, 64)})
    assert p.max_batch == 8


def test_engine_key_changes_with_every_ingredient():
    p = ot.ShapeProfile({"ws": ((1, 8, 64), (8, 8, 64), (32, 8, 64))})
    base = dict(weights_hash="abc", transforms={"precision": "fp16"}, trt_version="10.9", cap=(9, 0), profile=p,
                component="stylegan-synthesis")
    k = ot.engine_key(**base)
    assert k == ot.engine_key(**base)
    for change in ({"weights_hash": "abd"}, {"transforms": {"precision": "bf16"}}, {"trt_version": "10.10"},
                   {"cap": (8, 9)}, {"profile": ot.ShapeProfile({"ws": ((1, 8, 64), (8, 8, 64), (16, 8, 64))})}):
        assert ot.engine_key(**{**base, **change}) != k, change


def test_weights_fingerprint_sees_every_weight(testdata):
    G = load_G(testdata, "sg2_uncond_32")
    a = ot.weights_fingerprint(G.synthesis)
    with torch.no_grad():
        G.synthesis.b32.torgb.bias[0] += 1e-6
    assert ot.weights_fingerprint(G.synthesis) != a


class OnnxRuntimeRunner:
    """Runs an exported ONNX graph with onnxruntime behind the engine-call interface (named tensors in and
    out), so the PyTorch-side routing of the TensorRT wrappers is exercised on the CPU with real numbers."""

    def __init__(self, path):
        self.sess = _ort(path)
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.calls = 0

    def __call__(self, feeds):
        self.calls += 1
        res = self.sess.run(None, {k: v.detach().float().cpu().numpy() for k, v in feeds.items()})
        return {n: torch.from_numpy(np.asarray(r)) for n, r in zip(self.outputs, res)}


def test_synthesis_wrapper_routes_and_falls_back(testdata, sg2_onnx):
    G = load_G(testdata, "sg2_uncond_32")
    ref_syn = load_G(testdata, "sg2_uncond_32").synthesis
    # an engine profile of batch 1..4 (the graph itself takes 1..32)
    profile = ot.ShapeProfile({"ws": ((1, G.num_ws, G.w_dim), (2, G.num_ws, G.w_dim), (4, G.num_ws, G.w_dim))})
    runner = OnnxRuntimeRunner(sg2_onnx[0])
    report = {}
    G.synthesis = ot.TRTSynthesis(G.synthesis, runner, profile, report)
    assert G.synthesis.num_ws == ref_syn.num_ws                   # attribute pass-through
    z, c = latents(G, seeds=(0, 1, 2))
    with torch.no_grad():
        ws = G.mapping(z, c)
        out = G.synthesis(ws, noise_mode="const")
        assert runner.calls == 1 and report["fallbacks"] == 0
        assert rel_err(ref_syn(ws, noise_mode="const"), out) < 1e-4
        G.synthesis(ws, noise_mode="random")                      # noise is baked in: PyTorch
        assert report["fallbacks"] == 1 and "constant noise" in report["last_fallback"]
        ws6 = torch.cat([ws, ws])
        assert rel_err(ref_syn(ws6, noise_mode="const"), G.synthesis(ws6, noise_mode="const")) < 1e-4
        assert runner.calls == 3                                   # 6 = two chunks of at most 4


def test_unet_forward_wrapper_in_a_real_pipeline(unet_onnx):
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    pipe, ref_pipe = tiny_pipeline(), tiny_pipeline()          # the same seed-0 UNet as the export
    unet = pipe.unet
    path, profile = unet_onnx
    runner = OnnxRuntimeRunner(path)
    report = {}
    unet.forward = ot._TRTUNetForward(unet.forward, runner, profile, report, torch.float32)
    pe = prompt_embeds()

    def run(p, size):
        g = torch.Generator().manual_seed(0)
        return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=2, height=size,
                 width=size, output_type="np", generator=g).images
    out = run(pipe, 32)                                            # latent 16: inside the profile
    assert runner.calls == 2 and report["fallbacks"] == 0
    assert abs(out - run(ref_pipe, 32)).max() < 1e-4
    run(pipe, 64)                                                  # latent 32: outside, PyTorch runs it
    assert report["fallbacks"] == 2 and "outside the engine's profile" in report["last_fallback"]


@pytest.mark.gpu
def test_gpu_tensorrt_stylegan_engine_and_cache(testdata, tmp_path):
    pytest.importorskip("tensorrt")
    cuda = torch.device("cuda")
    ref_G = reference_G(testdata, "sg2_uncond_32", cuda)
    G, report = prepared(testdata, "sg2_uncond_32", Flags(tensorrt=True), device=cuda, cache_dir=tmp_path,
                         weights_hash="test")
    r = report["tensorrt"]
    assert r["applied"], r
    assert r["engine_cache"].startswith("miss")
    z, c = latents(G, seeds=(0, 1, 2))
    with torch.no_grad():
        out = G(z.to(cuda), c.to(cuda), noise_mode="const")
        ref = ref_G(z.to(cuda), c.to(cuda), noise_mode="const")
    assert rel_err(ref, out) < 1e-3
    _, again = prepared(testdata, "sg2_uncond_32", Flags(tensorrt=True), device=cuda, cache_dir=tmp_path,
                        weights_hash="test")
    assert again["tensorrt"]["engine_cache"] == "hit"


@pytest.mark.gpu
def test_gpu_tensorrt_unet_in_pipeline(tmp_path):
    pytest.importorskip("tensorrt")
    from tests.optim_tiny import prompt_embeds, tiny_pipeline

    cuda = torch.device("cuda")
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(precision="fp16"), cuda, kind="diffusion")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(precision="fp16", tensorrt=True), cuda, kind="diffusion",
                                 cache_dir=tmp_path)
    assert report["tensorrt"]["applied"], report["tensorrt"]
    pe = prompt_embeds().to(cuda, torch.float16)

    def run(p, size):
        g = torch.Generator("cpu").manual_seed(0)
        return p(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=2, height=size,
                 width=size, output_type="np", generator=g).images
    assert abs(run(pipe, 32) - run(ref_pipe, 32)).max() < 0.02
    assert report["tensorrt"]["fallbacks"] == 0
    run(pipe, 128)                                                 # latent 64: outside the profile
    assert report["tensorrt"]["fallbacks"] > 0
