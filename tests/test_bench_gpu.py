"""The benchmark on a CUDA GPU (skipped elsewhere): `python3 -m pytest -q -m gpu tests/test_bench_gpu.py`.

About three minutes on an H200: the two matrix rates, StyleGAN2 1024 in half precision against the
drift budget, a compiled CUDA-graph case, and the diffusion harness (stock diffusers next to ours).
"""
import json
from pathlib import Path

import pytest
import torch

from cli.bench import main as bench_main

pytestmark = pytest.mark.gpu


def _results(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines() if x.strip()]
    return {(r["config"], r["batch"]): r for r in rows if r["type"] == "result"}


def _bench(out: Path, *args) -> int:
    return bench_main(["--out", str(out), "--device", "cuda", "--quiet", "--no-report", *map(str, args)])


def test_matrix_rates_are_measured_and_plausible():
    from bench.measure import matrix_rates

    r = matrix_rates(torch.device("cuda"), repeats=10)
    assert 50 < r["bf16_tflops"] < 5000, r
    if torch.cuda.get_device_capability() >= (8, 9):
        assert r["fp8_tflops"] and r["fp8_tflops"] > r["bf16_tflops"], r


def test_stylegan2_1024_half_precision_within_the_drift_budget(tmp_path):
    assert _bench(tmp_path, "--workload", "sg2-1024", "--configs", "baseline,fp32,bf16,fp16", "--batches", "1",
                  "--repeats", "5", "--profile", "bf16") == 0
    res = _results(tmp_path)
    assert {r["status"] for r in res.values()} == {"ok"}, {k: r.get("reason") for k, r in res.items()}
    for name in ("bf16", "fp16"):
        assert res[(name, 1)]["drift"]["psnr_db"] > 35, res[(name, 1)]["drift"]
    for r in res.values():
        assert 0.1 < r["ms_per_image"] < 1000 and r["peak_vram_bytes"] > 100 * 2**20
        assert 0 < r["floor_fraction"] < 1
    prof = res[("bf16", 1)]["profile"]
    assert prof["kernel_launches"] > 50 and prof["top"] and 0 < prof["busy_fraction"] <= 1.5


def test_compiled_cuda_graph_case_runs_and_matches(tmp_path):
    assert _bench(tmp_path, "--workload", "sg2-tiny", "--configs", "fp32,compile-cg", "--batches", "1",
                  "--repeats", "10", "--profile", "none") == 0
    r = _results(tmp_path)[("compile-cg", 1)]
    if r["status"] == "skipped":
        pytest.skip(f"compile-cg not available here: {r['reason']}")
    assert r["status"] == "ok", r.get("reason")
    assert r["drift"]["psnr_db"] == "inf" or r["drift"]["psnr_db"] > 30
    assert r["first_call_s"] > 0 and r["warmup_calls"] >= 3
    assert r["compile_s"] > 0 and r["peak_reserved_bytes"] >= r["peak_vram_bytes"] > 0


def test_diffusion_harness_stock_and_product(tmp_path):
    pytest.importorskip("diffusers")
    assert _bench(tmp_path, "--workload", "sd-tiny", "--configs", "baseline,fp32,fp16,bf16", "--batches", "1,2",
                  "--repeats", "2", "--profile", "fp16") == 0
    res = _results(tmp_path)
    assert {r["status"] for r in res.values()} == {"ok"}, {k: r.get("reason") for k, r in res.items()}
    for r in res.values():
        assert {"text_encoder", "denoise", "vae_decode"} <= set(r["stages_ms"]) and r["it_per_s"] > 0
    assert res[("fp32", 1)]["drift"]["psnr_db"] == "inf" or res[("fp32", 1)]["drift"]["psnr_db"] > 60
    assert res[("fp16", 1)]["optimizations"]["precision"]["applied"]
    assert res[("fp16", 1)]["profile"]["top"]


def test_diffusion_compiled_with_cuda_graphs_keeps_its_stage_clock(tmp_path):
    # The stage hooks sit on the torch.compile wrapper: they must fire around CUDA-graph replays, and the
    # compiled case must run in its own process under --isolate compiled.
    pytest.importorskip("diffusers")
    assert _bench(tmp_path, "--workload", "sd-tiny", "--configs", "fp32,cg@precision=fp16+compile=reduce-overhead",
                  "--batches", "1", "--repeats", "3", "--profile", "none", "--isolate", "compiled",
                  "--config-timeout", "300") == 0
    r = _results(tmp_path)[("cg", 1)]
    assert r["status"] == "ok", r.get("reason")
    assert {"text_encoder", "denoise", "vae_decode"} <= set(r["stages_ms"]) and r["it_per_s"] > 0
    assert r["compile_s"] > 0 and r["optimizations"]["compile"]["applied"]
    assert r["stages_ms"]["denoise"] < r["call_ms"]
