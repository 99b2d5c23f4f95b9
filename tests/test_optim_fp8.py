"""FP8 (torchao float8, Ada/Hopper). On the CPU: the exact skip reason, the size and role filters, the
ATELIER_FP8_MIN_FEATURES setting, the FLOP coverage, and torchao's real float8 quantization, FP8 matmuls and
tracing (only its GPU gate lifted): all-zero activation rows stay finite, a whole FP8 UNet traces as one graph
with no host sync. On the GPU (marked gpu): a 4096-wide MLP in FP8 within 8 % relative error of bf16, a UNet
with 1280-wide attention under compile within 15 % (and finite on zero text), all-zero rows on the CUDA
kernels, and FP8 under CUDA graphs (reduce-overhead) without a skipped capture.

Tolerances come from the same torchao quantization run on the CPU (torch._scaled_mm has a CPU kernel):
the 2-layer 4096 MLP is 5.3 % from bf16 (e4m3 keeps 3 mantissa bits: ~3.7 % per quantized GEMM, and the
second layer compounds the first), the 1280-wide UNet 1.9 %."""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from optim import fp8
from core.errors import InputError
from tests.optim_helpers import CPU, prepared, rel_err

CPU_REASON = "FP8 needs compute capability 8.9 or newer (Ada/Hopper); this machine has no CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU skip reason")
def test_cpu_skip_reason_is_exact(testdata):
    assert fp8.unavailable_reason(CPU) == CPU_REASON
    _, report = prepared(testdata, "sg2_uncond_32", Flags(fp8=True))
    assert report["fp8"] == {"applied": False, "reason": CPU_REASON}


def test_size_filter():
    L = torch.nn.Linear
    assert fp8.selects(L(1024, 1024)) and fp8.selects(L(1280, 5120))
    assert not fp8.selects(L(320, 1280))                  # too small to gain
    assert not fp8.selects(L(1024, 1000))                 # FP8 GEMM wants multiples of 16
    assert not fp8.selects(torch.nn.Conv2d(1024, 1024, 3))
    assert fp8.selects(L(64, 64), min_features=64)


def test_fp8_linear_boundary_keeps_the_callers_dtype():
    """The wrapper around a quantized layer of a non-bf16 model: bf16 inside, autocast off, the caller's dtype outside."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False)
    wrapped = fp8.FP8Linear(lin)
    x = torch.randn(4, 64)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, torch.is_autocast_enabled("cpu"))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = wrapped(x)
    assert y.dtype == torch.float32 and seen == [(torch.bfloat16, False)]
    assert rel_err(torch.nn.functional.linear(x, lin.weight.float(), lin.bias.float()), y) < 1e-2
    assert wrapped.weight is lin.weight and wrapped.in_features == 64
    seen.clear()                                         # bf16 in, autocast off: nothing to cast or switch
    assert wrapped(x.to(torch.bfloat16)).dtype == torch.bfloat16 and seen == [(torch.bfloat16, False)]


def _cpu_rowwise_scaled_mm() -> bool:
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@pytest.fixture
def torchao_fp8_anywhere(monkeypatch):
    """torchao's float8 workflow asserts an sm89+ GPU before doing anything, although its tensor subclass
    and torch._scaled_mm both run on the CPU. Lifting only that assert lets a CPU run the real quantize_,
    the real FP8 matmuls and the real tracing; everything else is torchao's own code."""
    quant_api = pytest.importorskip("torchao.quantization.quant_api")
    if not _cpu_rowwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only (per-row came later)")
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularities: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_quantize_linears_with_real_torchao_float8(torchao_fp8_anywhere):
    from torchao.quantization import Float8Tensor

    L = torch.nn.Linear
    torch.manual_seed(0)
    net = torch.nn.Sequential(L(64, 64), torch.nn.GELU(), L(64, 48), L(48, 40)).eval().requires_grad_(False)
    x = torch.randn(2, 5, 64)                            # (batch, tokens, features), as attention projections see it
    with torch.no_grad():
        ref = net(x)
    sel = fp8.quantize_linears(net, min_features=48)
    assert sel.fp8 == ["0", "2"] and sel.kept == {fp8.SIZE: ["3"]}   # 48 -> 40: below the filter (and not 16-aligned)
    # an fp32 model: its quantized layers sit behind the bf16 boundary
    assert isinstance(net[0], fp8.FP8Linear) and isinstance(net[3], L) and net[3].weight.dtype == torch.float32
    w = net[2].inner.weight
    assert isinstance(w, Float8Tensor) and w.qdata.dtype == torch.float8_e4m3fn and w.dtype == torch.bfloat16
    assert w.scale.shape == (48, 1)                      # one scale per output row
    assert w.act_quant_kwargs.hp_value_lb == fp8.ACTIVATION_SCALE_LB
    with torch.no_grad():
        out = net(x)
        # fullgraph: the dtype boundary (autocast off, casts) and the tensor subclass trace without a graph
        # break, so under torch.compile the quantize + scaled matmul land in one graph
        compiled = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 40)
    assert 0.005 < rel_err(ref, out) < 0.08              # FP8 really ran (bf16 alone is ~0.3 %), and stays close
    # compiled against eager: the same FP8 computation, to rounding (not bit for bit: a traced graph may
    # order or fuse the scaling differently); a compiled graph that lost the FP8 path would be >= 0.5 % off
    assert rel_err(out, compiled) < 1e-3


def test_a_bf16_model_keeps_plain_linears(torchao_fp8_anywhere):
    """In a bf16 model nothing needs a dtype boundary: the Linear stays, only its weight becomes FP8."""
    from torchao.quantization import Float8Tensor

    net = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16).eval().requires_grad_(False)
    fp8.quantize_linears(net, min_features=64)
    assert type(net[0]) is torch.nn.Linear and isinstance(net[0].weight, Float8Tensor)


def test_min_features_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(fp8.MIN_FEATURES_ENV, raising=False)
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    assert fp8.min_features() == fp8.FP8_MIN_FEATURES_STATIC == 640        # static scaling, the default
    assert fp8.min_features({fp8.SCALING_ENV: "dynamic"}) == fp8.FP8_MIN_FEATURES == 1024
    monkeypatch.setenv(fp8.MIN_FEATURES_ENV, " 640 ")
    assert fp8.min_features() == 640
    assert fp8.min_features({fp8.MIN_FEATURES_ENV: "320"}) == 320
    for bad, words in (("lots", "whole number"), ("8", "at least 16")):
        monkeypatch.setenv(fp8.MIN_FEATURES_ENV, bad)
        with pytest.raises(InputError, match=words) as info:
            fp8.min_features()
        assert fp8.MIN_FEATURES_ENV in str(info.value)


def _tiny_unet(dtype=torch.float32, text_time: bool = False):
    """Attention 64 / 128 wide, so with a 64 filter every kind of UNet linear reaches FP8 size."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    extra = dict(addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=6 * 8 + 64) if text_time else {}
    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(64, 128), norm_num_groups=32,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
                                attention_head_dim=8, **extra).eval().requires_grad_(False).to(dtype)


def _unet_inputs(unet, text: torch.Tensor):
    from optim.prune import unet_probe_inputs

    kw = unet_probe_inputs(unet, CPU, batch=text.shape[0], tokens=text.shape[1])
    kw["encoder_hidden_states"] = text.to(kw["encoder_hidden_states"].dtype)
    return kw


def test_roles_keep_cross_attention_kv_and_time_embeddings_out_of_fp8():
    unet = _tiny_unet(text_time=True)
    sel = fp8.select(unet, min_features=64)
    kv = fp8.KEPT_BY_ROLE[0][0]
    assert sel.kept[kv] and all(n.endswith(("attn2.to_k", "attn2.to_v")) for n in sel.kept[kv])
    emb = sel.kept[fp8.KEPT_BY_ROLE[1][0]]
    assert "time_embedding.linear_1" in emb and "add_embedding.linear_2" in emb
    assert any(n.endswith("time_emb_proj") for n in emb)
    assert any(n.endswith("attn2.to_q") for n in sel.fp8) and any(n.endswith("attn1.to_k") for n in sel.fp8)
    assert not any(fp8.kept_role(n) for n in sel.fp8)
    # a role is reported only for the layers it kept out: at the default filter these are all just small
    assert set(fp8.select(unet).kept) == {fp8.SIZE}
    assert fp8.kept_role("up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k_ip.0") is None


def test_all_zero_activation_rows_stay_finite(torchao_fp8_anywhere):
    """Per-row scale = max|x| / 448: without a floor an all-zero row (SDXL's empty negative prompt) is 0/0."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    x = torch.randn(2, 6, 64, dtype=torch.bfloat16)
    x[1] = 0                                             # one whole CFG half of zeros
    x[0, 2] = 0                                          # and a single zero token
    zero = torch.zeros(2, 6, dtype=torch.bool)
    zero[1], zero[0, 2] = True, True

    def layer():
        torch.manual_seed(0)
        return torch.nn.Linear(64, 32).to(torch.bfloat16).eval().requires_grad_(False)

    unfloored = layer()                                  # the root cause, as torchao does it without the floor
    quantize_(unfloored, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False))
    with torch.no_grad():
        assert torch.isnan(unfloored(x)[zero]).all() and torch.isfinite(unfloored(x)[~zero]).all()

    lin = torch.nn.Sequential(layer())
    bias = lin[0].bias.detach().float().clone()
    fp8.quantize_linears(lin, min_features=32)
    with torch.no_grad():
        for out in (lin(x), torch.compile(lin, backend="aot_eager", fullgraph=True)(x)):
            assert torch.isfinite(out).all()
            # a zero row quantizes to zeros: the layer gives its bias, as bf16 would (bias is stored in bf16)
            assert torch.allclose(out[zero].float(), bias.expand(int(zero.sum()), -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-plain", "fp32-boundary"])
def test_fp8_unet_compiles_to_one_graph_and_an_empty_prompt_stays_finite(torchao_fp8_anywhere, dtype):
    """The whole FP8 UNet traces as one graph with no graph break (explain and fullgraph=True), nothing in it
    syncs with the host (CUDA graphs need that), and zero text embeddings (SDXL's empty negative prompt)
    give a finite result."""
    unet = _tiny_unet(dtype, text_time=True)
    fp8.quantize_linears(unet, min_features=64)
    assert any(isinstance(m, fp8.FP8Linear) for m in unet.modules()) == (dtype != torch.bfloat16)
    eager, ops = _traced_once(unet)
    assert "aten._scaled_mm.default" in ops                           # the FP8 product is in the graph
    assert not set(ops) & {"aten._local_scalar_dense.default", "aten.lift_fresh_copy.default"}   # no .item(), no host tensor


def _traced_once(unet):
    """Run `unet` on zero text for half the CFG batch (SDXL's empty negative prompt) eagerly and compiled as one
    graph (explain: one graph, no break; fullgraph=True); both finite and alike. Returns (eager output, the
    traced graph's call_function targets)."""
    from torch._dynamo.backends.common import aot_autograd

    text = torch.randn(2, 77, 64)
    text[1] = 0                                          # the unconditional half of the CFG batch
    inputs = _unet_inputs(unet, text)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        eager = unet(**inputs).sample
        explained = torch._dynamo.explain(unet)(**inputs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(unet, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(**inputs).sample
    torch._dynamo.reset()
    assert torch.isfinite(eager).all() and torch.isfinite(compiled).all()
    assert rel_err(eager, compiled) < 2e-2
    return eager, [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def test_coverage_is_the_share_of_linear_flops_in_fp8():
    L = torch.nn.Linear
    net = torch.nn.Sequential(L(64, 128), torch.nn.GELU(), L(128, 64), L(64, 16))
    x = torch.randn(3, 10, 64)                           # 30 rows
    per_layer, total = fp8.linear_flops(net, lambda: net(x))
    assert per_layer == {"0": 2 * 30 * 64 * 128, "2": 2 * 30 * 128 * 64, "3": 2 * 30 * 64 * 16}
    assert total == sum(per_layer.values())              # only matrix products here
    sel = fp8.select(net, min_features=64)
    c = fp8.coverage(sel, per_layer, total)
    assert sel.fp8 == ["0", "2"]
    assert c["linear_flops_in_fp8"] == c["unet_flops_in_fp8"] == round(2 * 8192 / (2 * 8192 + 1024), 4)
    assert c["kept_linear_flops"] == {fp8.SIZE: round(1024 / (2 * 8192 + 1024), 4)}


def test_apply_reports_what_is_fp8_what_is_kept_and_why(torchao_fp8_anywhere, monkeypatch, tmp_path):
    from optim.targets import Context, resolve

    monkeypatch.setattr(fp8, "unavailable_reason", lambda device: None)    # the GPU gate alone
    monkeypatch.setenv(fp8.MIN_FEATURES_ENV, "64")
    unet = _tiny_unet(torch.bfloat16, text_time=True)
    r = fp8.apply(resolve(unet, "diffusion"), Flags(precision="bf16", fp8=True, compile="default"),
                  Context(device=CPU, cache_dir=tmp_path))
    assert r["applied"] and r["size_filter"] == 64 and r["size_filter_from"] == fp8.MIN_FEATURES_ENV
    assert r["fp8_layers"] == len(r["layers"]) > 0 and "warning" not in r
    assert r["activation_scale_lb"] == fp8.ACTIVATION_SCALE_LB and "NaN" in r["activation_scale"]
    assert set(r["kept_bf16"]) == {role for role, _, _ in fp8.KEPT_BY_ROLE}
    assert r["kept_bf16_layers"] == sum(k["layers"] for k in r["kept_bf16"].values())
    assert "77 tokens" in r["kept_bf16"]["cross-attention K/V"]["why"]
    cov = r["coverage"]
    assert 0.5 < cov["linear_flops_in_fp8"] < 1 and 0 < cov["unet_flops_in_fp8"] < cov["linear_flops_in_fp8"]
    assert abs(cov["linear_flops_in_fp8"] + sum(cov["kept_linear_flops"].values()) - 1) < 1e-3
    assert f"{cov['linear_flops_in_fp8']:.1%}" in r["reason"] and "8×8 sample size" in cov["measured_on"]
    assert "10.0" in r["convolutions"]
    monkeypatch.delenv(fp8.MIN_FEATURES_ENV)
    r = fp8.apply(resolve(_tiny_unet(torch.bfloat16), "diffusion"), Flags(precision="bf16", fp8=True),
                  Context(device=CPU, cache_dir=tmp_path))
    assert not r["applied"] and f">= {fp8.min_features()}" in r["reason"] and r["size_filter_from"] == "default"


def _big_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(320, 1280), norm_num_groups=32,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                                cross_attention_dim=1024, attention_head_dim=8).eval().requires_grad_(False)


@pytest.mark.gpu
def test_gpu_fp8_mlp_close_to_bf16():
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
    mlp = mlp.to(cuda, torch.bfloat16).eval()
    x = torch.randn(256, 4096, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x).float()
        sel = fp8.quantize_linears(mlp)
        out = torch.compile(mlp)(x).float()
    assert sel.fp8 == ["0", "2"] and sel.kept_count == 0
    assert rel_err(ref, out) < 0.08                      # 5.3 % measured with the same quantization on the CPU


@pytest.mark.gpu
def test_gpu_fp8_unet_under_compile(tmp_path, monkeypatch):
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    monkeypatch.setenv(fp8.SELECT_ENV, "size")     # the FP8 path itself: every layer the filters pass (its 512-row
    #                                                products may well be faster unquantized, which the measured test covers)
    from optim.prune import unet_probe_inputs

    ref_unet = _big_unet().to(cuda, torch.bfloat16)
    inputs = unet_probe_inputs(ref_unet, cuda)
    with torch.no_grad():
        ref = ref_unet(**inputs).sample.float()
    unet = _big_unet().to(cuda, torch.bfloat16)
    unet, report = optim.prepare(unet, Flags(precision="bf16", fp8=True, compile="default"), cuda, kind="diffusion",
                                 cache_dir=tmp_path)
    r = report["fp8"]
    assert r["applied"], r
    assert r["fp8_layers"] == len(r["layers"]) > 0 and r["kept_bf16_layers"] > 0
    base = _big_unet()
    for name in r["layers"]:                                # every FP8 layer passed the size filter and no role
        assert fp8.selects(base.get_submodule(name), r["size_filter"]) and fp8.kept_role(name) is None
    # 1024 -> 1280 K/V of the 4 cross-attentions: FP8-sized, kept for their 77 rows
    assert r["kept_bf16"]["cross-attention K/V"]["layers"] == 8
    assert 0 < r["coverage"]["unet_flops_in_fp8"] < r["coverage"]["linear_flops_in_fp8"] < 1
    assert "convolutions" in r and "warning" not in r      # compiled, so no eager-speed warning
    with torch.no_grad():
        out = unet(**inputs).sample.float()
        # SDXL's empty negative prompt: zero text embeddings for a whole CFG half stay finite
        zero_text = dict(inputs, encoder_hidden_states=torch.zeros_like(inputs["encoder_hidden_states"]))
        assert torch.isfinite(unet(**zero_text).sample).all()
    assert rel_err(ref, out) < 0.15


@pytest.mark.gpu
def test_gpu_fp8_all_zero_rows_are_finite():
    """The root cause of SDXL's NaN latents, on the real CUDA kernels: an all-zero input row, eager and compiled."""
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1280, 1280)).to(cuda, torch.bfloat16).eval().requires_grad_(False)
    bias = net[0].bias.float().clone()
    x = torch.randn(2, 77, 1280, device=cuda, dtype=torch.bfloat16)
    x[1] = 0
    with torch.no_grad():
        assert fp8.quantize_linears(net).fp8 == ["0"]
        for out in (net(x), torch.compile(net, fullgraph=True)(x)):
            assert torch.isfinite(out).all()
            assert torch.allclose(out[1].float(), bias.expand(77, -1), rtol=0, atol=1e-6)


@pytest.mark.gpu
def test_gpu_fp8_composes_with_cuda_graphs():
    """reduce-overhead: inductor captures the FP8 graph as a CUDA graph (nothing on the host, no sync in it)."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1280, 5120), torch.nn.GELU(), torch.nn.Linear(5120, 1280))
    mlp = mlp.to(cuda, torch.bfloat16).eval().requires_grad_(False)
    x = torch.randn(512, 1280, device=cuda, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = mlp(x).float()
    fp8.quantize_linears(mlp)
    torch._dynamo.reset()
    skips = int(counters["inductor"]["cudagraph_skips"])
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):                                 # warm-up, record, replay
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).float()
    assert int(counters["inductor"]["cudagraph_skips"]) == skips
    # against bf16, as the MLP test: compiled FP8 need not match eager FP8 to rounding (fused pointwise ops keep
    # fp32 intermediates, and a different last bit flips e4m3 roundings: 2.7 % apart on the CPU for this MLP)
    assert rel_err(ref, out) < 0.08


@pytest.mark.gpu
def test_gpu_fp8_stylegan_is_unsupported_with_reason(testdata):
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    _, report = prepared(testdata, "sg2_uncond_32", Flags(fp8=True), device=cuda)
    assert report["fp8"]["applied"] is False and "modulated" in report["fp8"]["reason"]


# ---------------------------------------------------------------------------------------------
# Static per-tensor scaling (the default): calibrated once, quantization fused into the producer


def _static_layer(dtype, amax=None, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 48).to(dtype).eval().requires_grad_(False)
    return lin


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_static_fp8_linear_matches_the_layer_in_the_models_dtype(dtype):
    lin = _static_layer(dtype)
    x = torch.randn(3, 7, 64).to(dtype)
    amax = float(x.float().abs().max())
    q = fp8.StaticFP8Linear(lin, amax)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_scale.shape == () and q.input_scale.shape == ()
    assert q.input_scale.item() == pytest.approx(fp8.STATIC_MARGIN * amax / fp8.E4M3_MAX, rel=1e-6)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
        out = q(x)
    assert out.dtype == dtype and out.shape == (3, 7, 48)
    assert 0.005 < rel_err(ref, out) < 0.08               # FP8 really ran (3 mantissa bits), and stays close


def test_static_fp8_zero_rows_give_the_bias_and_large_inputs_saturate():
    lin = _static_layer(torch.bfloat16)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    q = fp8.StaticFP8Linear(lin, float(x.float().abs().max()))
    x[1] = 0
    with torch.no_grad():
        out = q(x)
        assert torch.allclose(out[1].float(), lin.bias.float().expand(5, -1), rtol=0, atol=1e-6)
        # 1000× the calibrated range: clamped at ±448·scale before the cast, so finite (e4m3 has no inf;
        # an unclamped overflow would be NaN)
        big = q(x * 1000)
    assert torch.isfinite(out).all() and torch.isfinite(big).all()
    # never calibrated (max 0): the scale is floored, not 0, and the layer still gives finite numbers
    z = fp8.StaticFP8Linear(lin, 0.0)
    assert z.input_scale.item() > 0 and torch.isfinite(z(x)).all()


def test_scaling_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    assert fp8.scaling() == "static"
    assert fp8.scaling({fp8.SCALING_ENV: " Dynamic "}) == "dynamic"
    with pytest.raises(InputError, match="static, dynamic") as info:
        fp8.scaling({fp8.SCALING_ENV: "per-row"})
    assert fp8.SCALING_ENV in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_static_fp8_unet_traces_to_one_graph_with_the_scaled_mm(dtype):
    """No graph break, the FP8 products in the graph, nothing that syncs with the host (CUDA graphs need
    that), and zero text (SDXL's empty negative prompt) stays finite."""
    from optim.targets import resolve

    unet = _tiny_unet(dtype, text_time=True)
    sel = fp8.select(unet, min_features=64)
    amax, how = fp8.calibrate(resolve(unet, "diffusion"), sel.fp8, CPU, steps=2)
    assert how["source"].startswith("probe") and how["timesteps"] == [999, 750]
    assert set(amax) == set(sel.fp8) and all(v > 0 for v in amax.values())
    done = fp8.quantize_linears_static(unet, amax)
    assert done == sel.fp8 and all(isinstance(unet.get_submodule(n), fp8.StaticFP8Linear) for n in done)
    eager, ops = _traced_once(unet)
    assert eager.dtype == dtype
    assert ops.count("aten._scaled_mm.default") == len(done)
    assert not set(ops) & {"aten._local_scalar_dense.default", "aten.lift_fresh_copy.default"}


def test_static_fp8_calibrates_on_a_real_pipeline_request(tiny_sd_sdxl, monkeypatch, tmp_path):
    """apply() on a real (tiny) SDXL pipeline: the calibration runs the pipeline itself with prompts and its
    empty negative prompt; the FP8 pipeline's latents stay close to the unquantized ones for the same seed."""
    from diffusers import StableDiffusionXLPipeline
    from optim.targets import Context, resolve

    monkeypatch.setattr(fp8, "unavailable_reason", lambda device: None)    # the GPU gate alone
    monkeypatch.setenv(fp8.MIN_FEATURES_ENV, "32")
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_sd_sdxl["sdxl"]))
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe(prompt="a red fox", num_inference_steps=4, output_type="latent",
                    generator=torch.Generator().manual_seed(3)).images

    ref = run()
    r = fp8.apply(resolve(pipe, "diffusion"), Flags(fp8=True, compile="default"), Context(device=CPU, cache_dir=tmp_path))
    assert r["applied"] and r["scaling"] == "static" and "calibrated" in r["granularity"]
    cal = r["calibration"]
    assert cal["source"] == "pipeline" and cal["prompts"] == list(fp8.CALIBRATION_PROMPTS) and cal["steps"] == 8
    assert 0 < r["input_max_range"][0] <= r["input_max_range"][1]
    swapped = [n for n, m in pipe.unet.named_modules() if isinstance(m, fp8.StaticFP8Linear)]
    assert sorted(swapped) == sorted(r["layers"]) and len(swapped) == r["fp8_layers"] > 0
    assert not any(fp8.kept_role(n) for n in swapped)      # cross-attention K/V and time embeddings stay
    out = run()
    assert torch.isfinite(out).all() and 0 < rel_err(ref, out) < 0.1


def test_dynamic_scaling_is_still_torchao_per_row(torchao_fp8_anywhere, monkeypatch, tmp_path):
    from torchao.quantization import Float8Tensor
    from optim.targets import Context, resolve

    monkeypatch.setattr(fp8, "unavailable_reason", lambda device: None)
    monkeypatch.setenv(fp8.MIN_FEATURES_ENV, "64")
    monkeypatch.setenv(fp8.SCALING_ENV, "dynamic")
    unet = _tiny_unet(torch.bfloat16)
    r = fp8.apply(resolve(unet, "diffusion"), Flags(precision="bf16", fp8=True, compile="default"),
                  Context(device=CPU, cache_dir=tmp_path))
    assert r["applied"] and r["scaling"] == "dynamic" and "calibration" not in r and "per-row" in r["reason"]
    assert all(isinstance(unet.get_submodule(n).weight, Float8Tensor) for n in r["layers"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_static_fp8_unet_under_cuda_graphs(tmp_path, monkeypatch, dtype):
    """The default FP8 path on the real kernels: an fp16 (SD1.5's best) or bf16 UNet, calibrated, compiled by
    inductor with CUDA graphs (no skipped capture), close to the unquantized UNet, finite on zero text."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    monkeypatch.setenv(fp8.SELECT_ENV, "size")     # the FP8 path itself (the measured selection has its own test)
    ref, inputs = _big_unet_reference(cuda, dtype)
    skips = int(counters["inductor"]["cudagraph_skips"])
    unet, report = optim.prepare(_big_unet().to(cuda, dtype), Flags(precision="fp16" if dtype == torch.float16 else "bf16",
                                                                    fp8=True, compile="reduce-overhead"),
                                 cuda, kind="diffusion", cache_dir=tmp_path)
    r = report["fp8"]
    assert r["applied"] and r["scaling"] == "static", r
    assert sum(isinstance(m, fp8.StaticFP8Linear) for m in _modules(unet)) == r["fp8_layers"] > 0
    out = _graphed_calls(unet, inputs)
    assert int(counters["inductor"]["cudagraph_skips"]) == skips
    assert out.dtype == torch.float32 and rel_err(ref, out) < 0.15


def _big_unet_reference(cuda: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The unquantized _big_unet's output (fp32) on probe inputs, and those inputs; dynamo reset after."""
    from optim.prune import unet_probe_inputs

    ref_unet = _big_unet().to(cuda, dtype)
    inputs = unet_probe_inputs(ref_unet, cuda, batch=2)
    with torch.no_grad():
        ref = ref_unet(**inputs).sample.float()
    del ref_unet
    torch._dynamo.reset()
    return ref, inputs


def _graphed_calls(unet, inputs) -> torch.Tensor:
    """A compiled UNet called as CUDA graphs run it (warm-up, record, replay), then on all-zero text (SDXL's
    empty negative prompt), which must stay finite. The replayed output, in fp32."""
    with torch.no_grad():
        for _ in range(3):                                 # warm-up, record, replay
            torch.compiler.cudagraph_mark_step_begin()
            out = unet(**inputs).sample.float()
        zero_text = dict(inputs, encoder_hidden_states=torch.zeros_like(inputs["encoder_hidden_states"]))
        torch.compiler.cudagraph_mark_step_begin()
        assert torch.isfinite(unet(**zero_text).sample).all()
    return out


def _modules(m):
    inner = getattr(m, "_orig_mod", m)
    return inner.modules()


# ---------------------------------------------------------------------------------------------
# Measured selection: FP8 only for the shapes where it is faster on the GPU


def test_calibration_records_tokens_and_layers_group_by_product_shape():
    from optim.targets import resolve

    unet = _tiny_unet(torch.bfloat16, text_time=True)
    sel = fp8.select(unet, min_features=64)
    tokens: dict[str, int] = {}
    fp8.calibrate(resolve(unet, "diffusion"), sel.fp8, CPU, steps=1, tokens=tokens)
    assert set(tokens) == set(sel.fp8)
    # 8×8 latents: the first block attends over 64 tokens (its Linears see (batch, 64, features))
    assert tokens["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"] == 64
    groups = fp8.shapes_of(unet, sel.fp8, tokens)
    assert sum(len(v) for v in groups.values()) == len(sel.fp8)
    for (m, k, n), layers in groups.items():
        for name in layers:
            lin = unet.get_submodule(name)
            assert (m, k, n) == (2 * tokens[name], lin.in_features, lin.out_features)


def test_decide_keeps_fp8_only_where_gemm_plus_quantization_wins():
    big, small = (8192, 1280, 5120), (128, 640, 640)
    q_big = fp8.quant_us(8192, 1280)
    assert q_big == pytest.approx(8192 * 1280 * 3 / 3.0e12 * 1e6)
    v = fp8.decide({big: (100.0, 60.0), small: (4.0, 3.99)})
    assert v[big]["fp8"] and v[big]["quant_us"] == round(q_big, 2)
    assert not v[small]["fp8"]                                 # 0.3 % faster is within the 3 % required
    # the quantization pass counts: a GEMM that gains less than it costs stays unquantized
    assert not fp8.decide({big: (100.0, 100.0 - q_big * 0.5)})[big]["fp8"]


def test_select_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(fp8.SELECT_ENV, raising=False)
    assert fp8.select_mode() == "measure" and fp8.select_mode({fp8.SELECT_ENV: "Size"}) == "size"
    with pytest.raises(InputError, match="measure, size"):
        fp8.select_mode({fp8.SELECT_ENV: "auto"})


def test_measured_selection_off_cuda_keeps_the_size_filter_and_says_why():
    unet = _tiny_unet(torch.bfloat16)
    names = fp8.select(unet, min_features=64).fp8
    keep, kept, report = fp8.measured_selection(unet, names, {n: 64 for n in names}, CPU)
    assert keep == names and kept == [] and report["mode"] == "size" and "needs CUDA" in report["why"]


@pytest.mark.gpu
def test_gpu_measured_selection_times_each_shape_and_splits_the_layers(tmp_path, monkeypatch):
    cuda = torch.device("cuda")
    if fp8.unavailable_reason(cuda):
        pytest.skip(fp8.unavailable_reason(cuda))
    monkeypatch.delenv(fp8.SELECT_ENV, raising=False)
    monkeypatch.delenv(fp8.SCALING_ENV, raising=False)
    unet, report = optim.prepare(_big_unet().to(cuda, torch.bfloat16), Flags(precision="bf16", fp8=True,
                                                                             compile="default"),
                                 cuda, kind="diffusion", cache_dir=tmp_path)
    r = report["fp8"]
    sel = r["selection"]
    assert sel["mode"] == "measure" and sel["shapes"], r
    for row in sel["shapes"]:
        assert row["bf16_us"] > 0 and row["fp8_us"] > 0 and row["fp8"] == (
            row["fp8_us"] + row["quant_us"] <= row["bf16_us"] * (1 - fp8.SELECT_GAIN))
    n_fp8 = sum(row["layers"] for row in sel["shapes"] if row["fp8"])
    if r["applied"]:
        assert r["fp8_layers"] == n_fp8 > 0
        measured = r["kept_bf16"].get(fp8.MEASURED, {"layers": 0})["layers"]
        assert measured == sum(row["layers"] for row in sel["shapes"] if not row["fp8"])
    else:
        assert n_fp8 == 0 and "none of the" in r["reason"]
