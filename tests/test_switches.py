"""Process-wide switches (pipelines/switches.py): requests with different flags, one after another through
the real model manager, leave every switch as it found it, a request that raises too; the compile settings
are made once, when the manager is built, and a later compile activation changes none of them."""
from pathlib import Path

import pytest
import torch

from core.types import GenerationRequest, Job, OptimizationFlags, StyleGANParams
from models import ops
from models.catalogue import Catalogue
from optim import compile as oc
from pipelines import switches
from pipelines.manager import ModelManager

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def manager(testdata, tmp_path):
    return ModelManager(Catalogue(ROOT / "assets", (testdata / "stylegan",)), device="cpu", cache_dir=tmp_path)


def _request(testdata, **flags) -> GenerationRequest:
    return GenerationRequest("stylegan", str(testdata / "stylegan" / "sg2_uncond_32.pkl"),
                             StyleGANParams(seeds=(0, 1), truncation_psi=0.7, batch_size=1),
                             OptimizationFlags(**flags), device="cpu")


def _watch(manager, request, seen: list, fail: bool = False):
    """A forward hook on the request's real synthesis network: records the switches as the network runs
    (so the test sees that the request did switch something) and, with fail, raises there."""
    G = manager.get(request).G

    def hook(module, args):
        seen.append((switches.snapshot(), torch.is_autocast_enabled("cpu")))
        if fail:
            raise RuntimeError("boom in the middle of the synthesis")

    return G.synthesis.register_forward_pre_hook(hook)


def test_requests_with_different_flags_do_not_leak_into_each_other(testdata, manager):
    fused = _request(testdata, precision="bf16", kernels="fir:nc1/up:subpixel")
    reference = _request(testdata, precision="fp32", kernels="reference")
    seen_fused, seen_ref = [], []
    hooks = [_watch(manager, fused, seen_fused), _watch(manager, reference, seen_ref)]
    try:
        before = switches.snapshot()
        manager.generate(fused, Job())
        assert switches.snapshot() == before
        manager.generate(reference, Job())
        assert switches.snapshot() == before
        # and in the other order: the reference request after the fused one ran reference ops in fp32
        manager.generate(fused, Job())
        assert switches.snapshot() == before
    finally:
        for h in hooks:
            h.remove()
    # Inside the requests the switches were the request's own.
    assert seen_fused and all(s["ops"]["fir"] == "nc1" and s["ops"]["up"] == "subpixel" and autocast
                              for s, autocast in seen_fused)
    assert seen_ref and all(s["ops"] == ops.DEFAULT_IMPL and not autocast for s, autocast in seen_ref)


def test_a_request_that_raises_midway_restores_every_switch(testdata, manager):
    fused = _request(testdata, kernels="fir:shifts/down:fused-stride")
    seen = []
    hook = _watch(manager, fused, seen, fail=True)
    try:
        before = switches.snapshot()
        with pytest.raises(RuntimeError, match="boom"):
            manager.generate(fused, Job())
    finally:
        hook.remove()
    assert seen and seen[0][0]["ops"]["fir"] == "shifts"      # it did fail inside the request's scope
    assert switches.snapshot() == before


def test_request_scope_leaves_out_knobs_as_reference_not_as_left_set():
    with switches.scoped(ops_impl={"fir": "nc1"}):                 # something set before a request
        with switches.request_scope(OptimizationFlags(), torch.device("cpu"), ops_impl={"up": "subpixel"}):
            assert ops.get_impl() == {**ops.DEFAULT_IMPL, "up": "subpixel"}
        assert ops.get_impl()["fir"] == "nc1"
    assert ops.get_impl() == ops.DEFAULT_IMPL


def test_scoped_restores_torch_switches_after_an_exception():
    before = switches.snapshot()
    with pytest.raises(ValueError):
        with switches.scoped(tf32=True, cudnn_benchmark=True, sdp_flash=False, num_threads=1,
                             float32_matmul_precision="medium", ops_impl={"grad": "gradfix"}):
            inside = switches.snapshot()
            # a library under the request changing a switch by itself is put back too
            torch.backends.cudnn.deterministic = not before["cudnn.deterministic"]
            raise ValueError("mid-request")
    changed = {k for k in before if inside[k] != before[k]}
    assert {"cuda.matmul.allow_tf32", "cudnn.benchmark", "sdp.flash", "num_threads", "float32_matmul_precision",
            "ops"} <= changed
    assert switches.snapshot() == before
    with pytest.raises(TypeError, match="unknown switch"):
        with switches.scoped(no_such_switch=1):
            pass
    assert switches.snapshot() == before


def test_compile_settings_are_set_once_by_the_manager(testdata, manager, tmp_path):
    folder = oc.process_compile_dir()
    assert folder is not None                                    # the manager (built above) configured it
    before = switches.snapshot()
    assert before["env.TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert before["env.TRITON_CACHE_DIR"] == str(folder / "triton")
    assert before["dynamo.recompile_limit"] >= 64 and before["inductor.fx_graph_cache"] is True
    # A compile request with another cache root (what apply() does when a pipeline loads) moves nothing.
    loaded = oc.CompileCache(tmp_path / "other").activate()
    assert loaded == 0 and (tmp_path / "other" / "compile").is_dir()
    assert switches.snapshot() == before
    assert switches.configure_process(tmp_path / "third") == folder
    assert switches.snapshot() == before


def test_a_diffusion_request_between_stylegan_requests_leaks_nothing(testdata, manager, tmp_path):
    from core.types import DiffusionParams
    from tests.diffusion_tiny import build_tiny_sd

    folder = tmp_path / "tiny-sd"
    build_tiny_sd(folder)
    diffusion = GenerationRequest("diffusion", str(folder),
                                  DiffusionParams(prompt="a photo of a cat", seed=7, steps=2, width=64, height=64),
                                  OptimizationFlags(precision="bf16", attention="math"), device="cpu")
    fused = _request(testdata, kernels="fir:nc1")
    reference = _request(testdata, kernels="reference")
    seen_unet, seen_ref = [], []
    unet = manager.get(diffusion).pipe.unet
    hooks = [unet.register_forward_pre_hook(lambda m, a: seen_unet.append(torch.is_autocast_enabled("cpu"))),
             _watch(manager, reference, seen_ref)]
    try:
        before = switches.snapshot()
        for request in (fused, diffusion, reference):
            manager.generate(request, Job())
            assert switches.snapshot() == before
    finally:
        for h in hooks:
            h.remove()
    assert seen_unet and all(seen_unet)                          # the diffusion request ran under its bf16 autocast
    assert seen_ref and all(s["ops"] == ops.DEFAULT_IMPL and not autocast for s, autocast in seen_ref)
