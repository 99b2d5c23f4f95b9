"""ATELIER_SDPA_ROUTE (optim/attention.py): each kind of attention call of a real tiny SD pipeline runs under the
SDPA backends named for it, the image stays the same, and a malformed value is an error naming the form."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from core.errors import AtelierError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags as Flags
from optim import attention as oa
from pipelines.diffusion import DiffusionPipeline, load_diffusion
from tests.optim_helpers import CPU


def _generate(folder, monkeypatch, route: str | None):
    if route is None:
        monkeypatch.delenv(oa.ROUTE_ENV, raising=False)
    else:
        monkeypatch.setenv(oa.ROUTE_ENV, route)
    pipe = DiffusionPipeline(load_diffusion(str(folder), flags=Flags()), Flags(), CPU)
    seen, original = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):      # which backends were allowed when each call ran
        seen.append((q.shape[-2], k.shape[-2], torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()))
        return original(q, k, v, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    try:
        res = pipe.generate(GenerationRequest("diffusion", pipe.model_id, DiffusionParams(
            prompt="a fox", seed=3, steps=2, guidance=5.0, width=64, height=64)), Job())
    finally:
        monkeypatch.setattr(F, "scaled_dot_product_attention", original)
    return pipe, res, seen


def test_cross_attention_runs_under_its_backend_and_the_image_is_unchanged(tiny_sd_sdxl, monkeypatch):
    _, base, seen0 = _generate(tiny_sd_sdxl["sd"], monkeypatch, None)
    assert all(flash for _, _, flash, _ in seen0)                   # unrouted: every backend allowed
    pipe, res, seen = _generate(tiny_sd_sdxl["sd"], monkeypatch, "cross=math,vae=math")
    rep = pipe.optimizations["attention"]
    assert rep["applied"] and rep["routes"] == {"cross": ["math"], "vae": ["math"]}
    assert rep["layers"]["unet"] > 0 and rep["layers"]["vae"] > 0
    # UNet cross-attention (77 text keys; the text encoder's own 77x77 calls are not the UNet's): math only
    cross = [(f, m) for q_len, k_len, f, m in seen if k_len == 77 and q_len != 77]
    assert cross and all(not f and m for f, m in cross)
    assert all(f for q_len, k_len, f, _ in seen if q_len == k_len == 77)   # the text encoder: not routed
    assert any(f for q_len, k_len, f, _ in seen if k_len not in (77,) and q_len != 1)  # UNet self: PyTorch picks
    assert float(np.abs(res.raw - base.raw).max()) < 1e-4
    assert torch.backends.cuda.flash_sdp_enabled()                   # the context ended with each call


@pytest.mark.parametrize("raw", ["cross", "cross=fast", "text=math", "cross=", "cross=math;self=flash"])
def test_a_malformed_route_is_an_error_naming_the_form(raw, monkeypatch):
    monkeypatch.setenv(oa.ROUTE_ENV, raw)
    with pytest.raises(AtelierError, match="part=backend"):
        oa.sdpa_routes()


def test_routes_parse_several_parts_and_backends(monkeypatch):
    monkeypatch.setenv(oa.ROUTE_ENV, "self=cudnn/flash, cross=efficient")
    assert oa.sdpa_routes() == {"self": ("cudnn", "flash"), "cross": ("efficient",)}
    monkeypatch.delenv(oa.ROUTE_ENV)
    assert oa.sdpa_routes() == {}


def test_routed_processors_trace_under_dynamo_without_breaks(monkeypatch):
    """torch.compile (fullgraph: a graph break would raise) through a routed processor, as the compile toggle does."""
    import torch._dynamo
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    torch.manual_seed(0)
    attn = Attention(query_dim=16, cross_attention_dim=8, heads=2, dim_head=8, processor=AttnProcessor2_0()).eval()
    x, ctx = torch.randn(2, 5, 16), torch.randn(2, 7, 8)
    with torch.no_grad():
        want = attn(x, encoder_hidden_states=ctx)
    attn.processor = oa.RoutedAttention(attn.processor, None, ("math",))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(attn, backend="eager", fullgraph=True)
        with torch.no_grad():
            got = compiled(x, encoder_hidden_states=ctx)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_route_gets_its_own_compile_cache_entry(tmp_path, monkeypatch):
    from optim import compile as oc
    from optim.targets import Context, resolve
    from tests.optim_tiny import tiny_pipeline

    pipe = tiny_pipeline()
    target, ctx = resolve(pipe, "diffusion"), Context(CPU, tmp_path)
    monkeypatch.delenv(oa.ROUTE_ENV, raising=False)
    plain = oc._cache_key(target, Flags(compile="default"), ctx, pipe.unet)
    monkeypatch.setenv(oa.ROUTE_ENV, "cross=math")
    routed = oc._cache_key(target, Flags(compile="default"), ctx, pipe.unet)
    monkeypatch.setenv(oa.ROUTE_ENV, " CROSS=math ")                 # the same route, spelled otherwise
    assert routed != plain and oc._cache_key(target, Flags(compile="default"), ctx, pipe.unet) == routed
