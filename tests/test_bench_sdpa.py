"""bench.sdpa: the attention shapes a diffusion workload calls, each SDPA backend timed on them (CPU: the tiny
SD workload; the H200 run says which backend wins per shape)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import sdpa
from tests.optim_helpers import CPU


def test_shapes_come_from_the_real_pipeline_and_every_backend_is_timed_or_says_why(tmp_path):
    original = F.scaled_dot_product_attention
    out = tmp_path / "sdpa.json"
    report = sdpa.run(["sd-tiny"], CPU, iters=2, out=out)
    assert F.scaled_dot_product_attention is original                 # the recorder put SDPA back
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    wl = report["workloads"][0]
    assert wl["workload"] == "sd-tiny" and wl["unet_calls_per_image"] >= wl["steps"]
    assert set(wl["route"]) == {"value", "parts", "saving_ms_per_image"}     # the suggested ATELIER_SDPA_ROUTE
    parts = {r["part"] for r in wl["shapes"]}
    assert {"unet", "vae_decoder", "text_encoder"} <= parts
    unet = [r for r in wl["shapes"] if r["part"] == "unet"]
    assert any(r["k_len"] == 77 for r in unet) and any(r["k_len"] == r["q_len"] for r in unet)   # cross and self
    for r in unet:
        assert r["batch"] == 2                                        # CFG: the negative and the prompt together
        assert r["calls_per_image"] == round(r["calls_per_unet_call"] * wl["unet_calls_per_image"])
    for r in wl["shapes"]:
        if r["masked"]:
            assert r["times"] is None and "not timed" in r["note"]
            continue
        for name in ("default", "math"):
            t = r["times"][name]
            assert t["ms"] > 0 and t["rel_err"] < 1e-4, (name, t)    # fp32 on the CPU: all agree with the reference
        for name in sdpa.BACKENDS:
            t = r["times"][name]
            assert ("ms" in t) != ("unavailable" in t)
            assert "unavailable" not in t or len(t["unavailable"]) > 10
        assert r["best"] in ("default",) + sdpa.BACKENDS


def test_pick_takes_the_fastest_backend_within_the_default_error():
    row = {"calls_per_image": 100}
    times = {"default": {"ms": 1.0, "rel_err": 1e-3}, "flash": {"ms": 0.8, "rel_err": 1e-3},
             "efficient": {"ms": 0.5, "rel_err": 0.5},                  # fast but wrong: not picked
             "cudnn": {"unavailable": "No available kernel. Aborting execution."}, "math": {"ms": 3.0, "rel_err": 0.0}}
    got = sdpa.pick(row, times)
    assert got["best"] == "flash" and abs(got["saving_ms_per_image"] - 20.0) < 1e-9
    assert sdpa.pick(row, {"default": {"unavailable": "x"}}) == {"best": None}


def test_recording_names_the_part_and_leaves_hooks_and_sdpa_as_they_were():
    lin = torch.nn.Linear(4, 4)
    q = torch.randn(1, 2, 5, 4)

    class Attn(torch.nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x)
    m = Attn()
    with sdpa.recording({"unet": m, "other_part": lin}) as calls:
        m(q)
        m(q)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)       # outside any part
    assert calls[("unet", 1, 2, 5, 5, 4, 4, "float32", False)] == 2
    assert calls[("other", 1, 2, 5, 5, 4, 4, "float32", True)] == 1
    assert calls.entered["unet"] == 2 and not m._forward_pre_hooks and not m._forward_hooks


def test_each_shape_is_timed_in_its_own_dtype():
    """bf16 rows run in bf16 (their error against fp32 math is bf16's rounding, not fp32's); an unknown dtype is
    an error, not a silent fp32 run (SDXL's whole table was once timed in fp32 that way)."""
    row = {"batch": 1, "heads": 2, "q_len": 64, "k_len": 16, "head_dim": 32, "v_dim": 32}
    assert sdpa.row_dtype({**row, "dtype": "bfloat16"}) is torch.bfloat16
    assert sdpa.row_dtype({**row, "dtype": "float16"}) is torch.float16
    bf16 = sdpa.time_shape({**row, "dtype": "bfloat16"}, CPU, iters=1)
    fp32 = sdpa.time_shape({**row, "dtype": "float32"}, CPU, iters=1)
    assert 1e-4 < bf16["default"]["rel_err"] < 3e-2, bf16["default"]     # bf16's 8-bit mantissa
    assert fp32["default"]["rel_err"] < 1e-5, fp32["default"]
    try:
        sdpa.row_dtype({**row, "dtype": "float64"})
    except ValueError as exc:
        assert "float64" in str(exc) and "bfloat16" in str(exc)
    else:
        raise AssertionError("an unknown dtype was accepted")


def test_the_suggested_route_takes_one_backend_per_part_and_only_a_real_gain():
    def shape(part, q, k, calls, **ms):
        times = {n: {"ms": v, "rel_err": 1e-3} for n, v in ms.items()}
        times["math"] = {"ms": 9.0, "rel_err": 0.0}
        times["cudnn"] = {"unavailable": "No available kernel. Aborting execution."}
        return {"part": part, "q_len": q, "k_len": k, "calls_per_image": calls, "times": times}

    facts = {"shapes": [
        # cross-attention: efficient wins the frequent shape, loses a little on the rare one: one backend overall
        shape("unet", 1024, 77, 1800, default=0.0446, flash=0.0421, efficient=0.0352),
        shape("unet", 4096, 77, 300, default=0.0472, flash=0.0458, efficient=0.0500),
        # self-attention: flash 1 % faster: noise, not a route
        shape("unet", 4096, 4096, 300, default=0.2171, flash=0.2150, efficient=0.7205),
        # the VAE: efficient is inaccurate here (error beyond the default's budget), so it is never picked
        {**shape("vae_decoder", 4096, 4096, 1, default=4.6, flash=4.0), "times": {
            "default": {"ms": 4.6, "rel_err": 1e-3}, "efficient": {"ms": 1.0, "rel_err": 0.5}}},
        {"part": "text_encoder", "q_len": 77, "k_len": 77, "calls_per_image": 12, "times": None},
    ]}
    route = sdpa.suggest_route(facts)
    assert route["value"] == "cross=efficient", route
    want = (0.0446 * 1800 + 0.0472 * 300) - (0.0352 * 1800 + 0.0500 * 300)
    assert abs(route["saving_ms_per_image"] - want) < 1e-3
    assert sdpa.suggest_route({"shapes": facts["shapes"][2:]})["value"] == ""


def test_cpu_rows_say_how_they_were_timed():
    row = {"batch": 1, "heads": 2, "q_len": 32, "k_len": 8, "head_dim": 16, "v_dim": 16, "dtype": "float32"}
    times = sdpa.time_shape(row, CPU, iters=1)
    timed = [t for t in times.values() if "ms" in t]
    assert timed and all(t["timing"] == "wall" for t in timed), times


@pytest.mark.gpu
def test_gpu_rows_are_device_time_of_graph_replayed_calls():
    """On a GPU a backend's time is the device time of calls replayed from one CUDA graph (what a graph-captured
    UNet pays), not events around one eager call (which count the host's launch: on 2026-12-06 that made the
    efficient kernel look faster for SDXL's cross-attention, where in the pipeline it cost 7x cuDNN's time).
    A function that cannot be captured (it syncs with the host) falls back to calls queued back to back."""
    cuda = torch.device("cuda")
    row = {"batch": 2, "heads": 20, "q_len": 1024, "k_len": 77, "head_dim": 64, "v_dim": 64, "dtype": "bfloat16"}
    times = sdpa.time_shape(row, cuda, iters=5)
    assert times["default"]["timing"] == "cuda-graph" and times["default"]["ms"] > 0, times
    assert times["default"]["rel_err"] < 3e-2
    x = torch.ones(256, device=cuda)
    assert sdpa._graph_of(lambda: x.mul_(1.0), 4, cuda) is not None
    # .item() cannot be captured; a failed capture may leave the CUDA context unusable, so in its own process
    code = ("import torch; from bench import sdpa; c = torch.device('cuda'); x = torch.ones(256, device=c); "
            "ms, how = sdpa._time(lambda: x.sum().item(), c, iters=3); print(how, ms > 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["stream", "True"], done.stdout + done.stderr
