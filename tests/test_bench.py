"""`python app.py bench` on the CPU with tiny real models: rows on disk, skips and failures that do not stop
the run, drift and FLOPs, time budgets, isolated cases, and the merged report."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli.bench import main as bench_main
from core.errors import InputError
from bench.specs import get_workload, parse_custom, resolve_configs
from bench.report import END_MARK, START_MARK, evaluate_targets, merge, read_jsonl, write_report

ROOT = Path(__file__).resolve().parent.parent


def rows_of(out: Path, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["type"] == kind]


def results(out: Path) -> dict[tuple[str, int], dict]:
    return {(r["config"], r["batch"]): r for r in rows_of(out, "result")}


def bench(out: Path, *args: str) -> int:
    return bench_main(["--out", str(out), "--device", "cpu", "--quiet", *map(str, args)])


def hang_new_pythons(monkeypatch, tmp_path: Path) -> None:
    """From here on every Python process started from this one hangs at startup (a sitecustomize on
    PYTHONPATH that never returns): an isolated case's child is then really hung, rather than merely
    slower than a short --config-timeout, which a fast machine could beat."""
    site = tmp_path / "hang-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import time\nwhile True:\n    time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH"))
                                                     if p))


@pytest.fixture(scope="module")
def sg2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sg2")
    rc = bench(out, "--workload", "sg2-tiny", "--configs", "fp32,bf16,fp16,tensorrt", "--batches", "1",
               "--repeats", "2", "--warmup", "1", "--profile", "bf16")
    assert rc == 0
    return out


def test_stylegan_run_writes_every_case_with_numbers_or_reasons(sg2_run):
    run = rows_of(sg2_run, "run")
    assert len(run) == 1 and run[0]["torch"] == torch.__version__ and run[0]["device"] == "cpu"
    assert run[0]["rates"]["bf16_tflops"] > 0 and run[0]["command"].startswith("python app.py bench")
    starts = {(r["config"], r["batch"]) for r in rows_of(sg2_run, "start")}
    res = results(sg2_run)
    assert set(res) == starts == {("fp32", 1), ("bf16", 1), ("fp16", 1), ("tensorrt", 1)}

    wl = rows_of(sg2_run, "workload")[0]
    G_flops = wl["flops_per_image"]
    assert G_flops > 1e6 and wl["params"]["generator"] > 1000 and wl["targets"] == []

    fp32, bf16 = res[("fp32", 1)], res[("bf16", 1)]
    for r in (fp32, bf16):
        assert r["status"] == "ok", r.get("reason")
        assert r["ms_per_image"] > 0 and len(r["call_ms_samples"]) == 2 and r["stages_ms"]["synthesis"] > 0
        assert r["peak_vram_bytes"] > 0 and r["first_call_s"] > 0 and r["e2e_ms_per_image"] > 0
        assert r["flops_per_image"] == G_flops and 0 < r["floor_fraction"]
    # fp32 against itself is exact on the CPU; bf16 drifts but stays a recognisable image
    assert fp32["drift"]["psnr_db"] == "inf" and fp32["drift"]["ssim"] == 1.0
    assert 20 < bf16["drift"]["psnr_db"] < 200 and 0.5 < bf16["drift"]["ssim"] < 1.0
    assert bf16["optimizations"]["precision"]["applied"] is True
    prof = bf16["profile"]
    assert prof["top"] and prof["device_busy_ms"] > 0 and sum(prof["by_class_ms"].values()) > 0
    # each class lists its own heaviest kernels, heaviest first, within the class total
    assert set(prof["top_by_class"]) == set(prof["by_class_ms"])
    for cls, kernels in prof["top_by_class"].items():
        ms = [k["ms"] for k in kernels]
        assert kernels and ms == sorted(ms, reverse=True) and sum(ms) <= prof["by_class_ms"][cls] + 1e-6, cls

    fp16, trt = res[("fp16", 1)], res[("tensorrt", 1)]
    assert fp16["status"] == "skipped" and "CPU" in fp16["reason"] and "ms_per_image" not in fp16
    assert trt["status"] == "skipped" and "tensorrt" in trt["reason"].lower()


def test_stylegan_run_leaves_a_report_with_table_plot_and_reasons(sg2_run):
    md = (sg2_run / "bench.md").read_text()
    assert START_MARK in md and END_MARK in md
    assert "| `fp32` |" in md and "| `bf16` |" in md
    assert "Not measured:" in md
    assert re.search(r"`tensorrt` \(batch 1, run of \d{4}-\d\d-\d\d\): skipped", md)   # a failure says how old it is
    png = sg2_run / "plots" / "sg2-tiny.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    merged = json.loads((sg2_run / "bench.json").read_text())
    assert {r["config"] for r in merged["results"]} == {"fp32", "bf16", "fp16", "tensorrt"}


def test_gap_sets_each_kernel_class_against_its_flops_and_the_runs_rates(sg2_run, capsys):
    from bench.gap import GapError, analyse, main as gap_main

    wl = rows_of(sg2_run, "workload")[0]
    stage = wl["flops_by_stage"]["synthesis"]
    # the reference run's counter splits its FLOPs: StyleGAN's modulated convolutions are convolutions
    assert stage["conv_flops"] > 0 and stage["attention_flops"] == 0
    assert stage["linear_flops"] + stage["conv_flops"] + stage["attention_flops"] <= stage["flops"]
    gaps = analyse(str(sg2_run / "bench.jsonl"))
    assert [g.config for g in gaps] == ["bf16"]            # the one profiled row
    g = gaps[0]
    bf16 = results(sg2_run)[("bf16", 1)]
    prof = bf16["profile"]
    assert g.busy_ms == pytest.approx(prof["device_busy_ms"])
    # every class's time is accounted for once: compute classes, memory-bound classes, the rest
    assert sum(c.ms for c in g.lines) + g.other_ms == pytest.approx(sum(prof["by_class_ms"].values()))
    mm = next(c for c in g.lines if c.name == "matmul+conv")
    assert mm.tflop == pytest.approx((stage["linear_flops"] + stage["conv_flops"]) / 1e12)
    rate = rows_of(sg2_run, "run")[0]["rates"]["bf16_tflops"]
    assert mm.peak_tflops == rate and mm.at_peak_ms == pytest.approx(mm.tflop / rate * 1e3)
    if mm.ms > 0:
        assert mm.tflops == pytest.approx(mm.tflop / (mm.ms / 1e3))
    assert g.compute_floor_ms == pytest.approx(sum(c.at_peak_ms for c in g.lines if c.tflop is not None)
                                               + g.memory_ms + g.other_ms)
    # the CLI: a table with a target line, and JSON
    assert gap_main([str(sg2_run / "bench.jsonl"), "--target", "0.001"]) == 0
    text = capsys.readouterr().out
    assert "matmul+conv" in text and "target < 0.001 ms:" in text and "to go" in text
    assert gap_main([str(sg2_run / "bench.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["classes"][0]["class"] == "matmul+conv"
    # a configuration without a profile: a clear error, exit 2
    with pytest.raises(GapError, match="no profiled result of config 'fp32'"):
        analyse(str(sg2_run / "bench.jsonl"), config="fp32")
    assert gap_main([str(sg2_run / "bench.jsonl"), "--config", "fp32"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_gap_takes_attention_flops_from_an_sdpa_table_for_runs_before_the_split(tmp_path):
    from bench.gap import analyse, attention_flops_from_sdpa

    table = {"workloads": [{"workload": "w", "shapes": [
        {"batch": 2, "heads": 10, "q_len": 4096, "k_len": 4096, "head_dim": 64, "v_dim": 64, "calls_per_image": 300},
        {"batch": 2, "heads": 20, "q_len": 1024, "k_len": 77, "head_dim": 64, "v_dim": 64, "calls_per_image": 1800}]}]}
    attn = 4 * 2 * 10 * 4096 * 4096 * 64 * 300 + 4 * 2 * 20 * 1024 * 77 * 64 * 1800
    assert attention_flops_from_sdpa(table, "w") == attn
    # a run file as the GPU wrote them before 2026-12-06: linear FLOPs only, a profiled row
    run = tmp_path / "old.jsonl"
    lines = [{"type": "run", "rates": {"bf16_tflops": 800.0}, "gpu": "GPU"},
             {"type": "workload", "workload": "w", "flops_per_image": 400e12,
              "flops_by_stage": {"denoise": {"calls": 30, "flops": 400e12, "linear_flops": 250e12}}},
             {"type": "result", "workload": "w", "config": "best", "batch": 1, "status": "ok", "ms_per_image": 1000.0,
              "flags": {"precision": "bf16"},
              "profile": {"wall_ms": 1040.0, "device_busy_ms": 970.0,
                          "by_class_ms": {"matmul": 580.0, "attention": 140.0, "normalization/reduction": 110.0,
                                          "elementwise (fused)": 125.0, "copy/layout": 15.0}}}]
    run.write_text("\n".join(json.dumps(x) for x in lines))
    g = analyse(str(run))[0]
    assert any("pass --sdpa" in n for n in g.notes) and g.compute_floor_ms is None
    g = analyse(str(run), sdpa=table)[0]
    mm, at = g.lines[0], g.lines[1]
    assert at.tflop == pytest.approx(attn / 1e12) and mm.tflop == pytest.approx((400e12 - attn) / 1e12)
    assert g.memory_ms == pytest.approx(250.0) and g.compute_floor_ms == pytest.approx(
        (400e12 / 800e12) * 1e3 + 250.0)


def test_strict_fails_the_case_and_the_rest_continue(tmp_path):
    # fp32 is not asked for: the drift reference comes from a dedicated fp32 run before the first case.
    rc = bench(tmp_path, "--workload", "sg2-tiny", "--configs", "fp16,bf16", "--batches", "1", "--repeats", "1",
               "--strict", "--no-report", "--profile", "none")
    assert rc == 0
    res = results(tmp_path)
    assert res[("fp16", 1)]["status"] == "failed" and "--strict" in res[("fp16", 1)]["reason"]
    bf16 = res[("bf16", 1)]
    assert bf16["status"] == "ok" and 20 < bf16["drift"]["psnr_db"] < 200
    assert list((tmp_path / "reference").glob("sg2-tiny-*.npz"))


def test_time_budget_skips_cases_that_would_start_late(tmp_path):
    rc = bench(tmp_path, "--workload", "sg2-tiny", "--configs", "fp32,bf16", "--batches", "1,2",
               "--max-minutes", "0", "--no-report")
    assert rc == 0
    res = results(tmp_path)
    assert len(res) == 4 and not rows_of(tmp_path, "start")
    assert all(r["status"] == "skipped" and "--max-minutes" in r["reason"] for r in res.values())


def test_diffusion_stock_baseline_and_product_path_with_stage_times_and_exact_flops(tmp_path):
    rc = bench(tmp_path, "--workload", "sd-tiny", "--configs", "baseline,fp32", "--batches", "1", "--steps", "2",
               "--repeats", "1", "--warmup", "1", "--profile", "none", "--no-report")
    assert rc == 0
    res = results(tmp_path)
    for name in ("baseline", "fp32"):
        r = res[(name, 1)]
        assert r["status"] == "ok", r.get("reason")
        assert {"text_encoder", "denoise", "vae_decode"} <= set(r["stages_ms"])
        # it/s counts loop iterations (UNet calls) as diffusers does; PNDM repeats its first step
        assert r["denoise_calls"] in (2, 3)
        assert r["it_per_s"] == pytest.approx(r["denoise_calls"] / (r["stages_ms"]["denoise"] / 1e3))
        assert r["ms_per_image"] >= r["stages_ms"]["denoise"]
    assert res[("fp32", 1)]["drift"]["psnr_db"] == "inf"
    base = res[("baseline", 1)]
    assert base["optimizations"]["baseline"]["applied"] and base["drift"]["ssim"] > 0.5   # fp16 weights drift a little

    wl = rows_of(tmp_path, "workload")[0]
    stages = wl["flops_by_stage"]
    assert stages["text_encoder"]["calls"] == 2          # prompt and (empty) negative prompt, for CFG
    assert stages["vae_decode"]["calls"] == 1 and stages["denoise"]["calls"] >= 2
    # the UNet's FLOPs per call equal a direct count on the same network and CFG-batched input
    from torch.utils.flop_counter import FlopCounterMode

    from bench import build

    pipe = build.random_diffusion_pipeline(get_workload("sd-tiny"), torch.device("cpu"), 0)
    unet = pipe.unet
    x = torch.randn(2, 4, 8, 8)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        unet(x, torch.tensor([500, 500]), encoder_hidden_states=ctx)
    assert stages["denoise"]["flops"] == fc.get_total_flops() * stages["denoise"]["calls"]
    assert wl["flops_per_image"] == sum(s["flops"] for s in stages.values())
    assert wl["calibration"]["unet_conv_out"] > 0


@pytest.mark.slow
def test_sdxl_tiny_runs_both_text_towers(tmp_path):
    rc = bench(tmp_path, "--workload", "sdxl-tiny", "--configs", "fp32,baseline", "--batches", "1", "--steps", "1",
               "--repeats", "1", "--profile", "none", "--no-report")
    assert rc == 0
    res = results(tmp_path)
    assert all(r["status"] == "ok" for r in res.values()), [r.get("reason") for r in res.values()]
    wl = rows_of(tmp_path, "workload")[0]
    te = wl["flops_by_stage"]["text_encoder"]
    assert te["calls"] == 1 and te["flops"] > 0                     # each tower once (the negative is zeros)
    assert res[("baseline", 1)]["stages_ms"]["text_encoder"] > 0


@pytest.mark.slow
def test_isolated_cases_run_in_children_and_a_hung_case_is_killed(tmp_path, monkeypatch):
    rc = bench(tmp_path, "--workload", "sg2-tiny", "--configs", "fp32,bf16", "--batches", "1", "--repeats", "1",
               "--isolate", "--profile", "none", "--no-report")
    assert rc == 0
    run_id = rows_of(tmp_path, "run")[0]["run_id"]
    res = results(tmp_path)
    assert {r["status"] for r in res.values()} == {"ok"} and {r["run_id"] for r in res.values()} == {run_id}
    assert res[("bf16", 1)]["drift"]["psnr_db"] > 20           # the reference crossed processes through the npz

    out2 = tmp_path / "hung"
    hang_new_pythons(monkeypatch, tmp_path)
    rc = bench(out2, "--workload", "sg2-tiny", "--configs", "fp32", "--batches", "1", "--isolate",
               "--config-timeout", "0.5", "--no-report")
    assert rc == 0
    r = results(out2)[("fp32", 1)]
    assert r["status"] == "failed" and "timed out" in r["reason"]


def test_report_merges_pieces_prefers_successes_and_flags_unfinished_cases(sg2_run, tmp_path):
    # A second piece: bf16 measured again but failed this time, and a case that was killed mid-way.
    piece = tmp_path / "piece.jsonl"
    run_id = "later"
    piece.write_text("\n".join(json.dumps(r) for r in [
        {"type": "run", "run_id": run_id, "date": "2026-11-30T00:00:00+00:00", "torch": "x", "device": "cpu",
         "rates": {"bf16_tflops": 1.0}, "command": "python app.py bench ..."},
        {"type": "start", "run_id": run_id, "workload": "sg2-tiny", "config": "bf16", "batch": 1},
        {"type": "result", "run_id": run_id, "workload": "sg2-tiny", "config": "bf16", "batch": 1,
         "status": "failed", "reason": "boom"},
        {"type": "start", "run_id": run_id, "workload": "sg2-tiny", "config": "compile-cg", "batch": 1},
    ]) + "\n{\"type\": \"result\", \"cut sho")         # a line cut short by a kill is ignored
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nHow to run.\n\n{START_MARK}\nold numbers\n{END_MARK}\n\nFooter stays.\n")
    out = write_report([sg2_run / "bench.jsonl", piece], doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nHow to run.") and text.rstrip().endswith("Footer stays.")
    assert "old numbers" not in text and text.count(START_MARK) == 1
    assert "| `bf16` |" in text                                   # the earlier success wins over the later failure
    assert re.search(r"`compile-cg` \(batch 1(, run of [\d-]+)?\): unfinished", text)
    assert Path(out["json"]).is_file() and out["plots"] and Path(out["plots"][0]).is_file()
    m = merge(read_jsonl(sg2_run / "bench.jsonl") + read_jsonl(piece))
    assert m.results[("sg2-tiny", 1, "bf16")]["status"] == "ok" and len(m.runs) == 2


def test_targets_name_the_best_row_and_the_margin():
    rows = [
        {"type": "workload", "workload": "w", "kind": "stylegan",
         "targets": [{"metric": "ms_per_image", "op": "<", "value": 2.0, "batch": "1", "configs": "any", "label": "< 2 ms"},
                     {"metric": "images_per_s", "op": ">=", "value": 2000, "batch": "throughput", "configs": "any",
                      "label": "> 2000/s"}]},
        {"type": "result", "workload": "w", "config": "baseline", "batch": 1, "status": "ok", "ms_per_image": 1.0},
        {"type": "result", "workload": "w", "config": "bf16", "batch": 1, "status": "ok", "ms_per_image": 3.0,
         "flags": {"precision": "bf16"}, "drift": {"psnr_db": 40.0},
         "profile": {"busy_fraction": 0.3, "by_class_ms": {"convolution": 3.0, "elementwise": 1.0}, "top": []}},
        {"type": "result", "workload": "w", "config": "fp16", "batch": 1, "status": "ok", "ms_per_image": 2.5,
         "flags": {"precision": "fp16"}, "drift": {"psnr_db": 30.0}},      # faster but over the drift budget
        {"type": "result", "workload": "w", "config": "bf16", "batch": 32, "status": "ok", "images_per_s": 2500.0,
         "flags": {"precision": "bf16"}},
        {"type": "result", "workload": "w", "config": "taesd", "batch": 1, "status": "ok", "ms_per_image": 1.5,
         "flags": {"precision": "bf16", "tiny_vae": True}},               # faster, but another decoder: not counted
    ]
    t1, t2 = evaluate_targets(merge(rows), "w")
    assert t1["status"] == "missed" and t1["config"] == "bf16" and t1["margin"] == pytest.approx(-0.5)
    assert "busy 30%" in t1["limit"] and "convolution 75%" in t1["limit"]
    assert t2["status"] == "met" and t2["batch"] == 32 and t2["margin"] == pytest.approx(0.25)
    assert "bench.gap" not in t1["limit"]          # no FLOP split in the workload line: no compute floor claimed


def test_a_missed_target_names_the_floor_with_compute_kernels_at_the_measured_rate():
    rows = [
        {"type": "run", "run_id": "r1", "gpu": "GPU", "rates": {"bf16_tflops": 800.0}},
        {"type": "workload", "workload": "w", "kind": "diffusion", "flops_per_image": 400e12,
         "flops_by_stage": {"denoise": {"calls": 30, "flops": 400e12, "linear_flops": 250e12, "conv_flops": 100e12,
                                        "attention_flops": 48e12}},
         "targets": [{"metric": "ms_per_image", "op": "<", "value": 850, "batch": "1", "configs": "any",
                      "label": "< 850 ms"}]},
        {"type": "result", "run_id": "r1", "workload": "w", "config": "best", "batch": 1, "status": "ok",
         "ms_per_image": 1000.0, "flags": {"precision": "bf16"},
         "profile": {"wall_ms": 1040.0, "device_busy_ms": 970.0, "busy_fraction": 0.97,
                     "by_class_ms": {"matmul": 580.0, "attention": 140.0, "normalization/reduction": 110.0,
                                     "elementwise (fused)": 125.0, "copy/layout": 15.0}, "top": []}},
    ]
    (t,) = evaluate_targets(merge(rows), "w")
    assert t["status"] == "missed"
    # 350 TFLOP of GEMMs + convolutions in 580 ms = 603 TFLOP/s = 75 % of 800; at 800: 437.5 + 60 + 250 ms
    assert "75% of the run's measured rate" in t["limit"] and "748 ms" in t["limit"] and "250 ms" in t["limit"]


def test_configuration_names_and_custom_flags():
    wl = get_workload("sdxl-1024")
    cfgs = {c.name: c for c in resolve_configs(wl, ["baseline", "fp32", "best", "best-fp8", "x@precision=fp16+prune=0.3"])}
    assert cfgs["baseline"].is_baseline and not cfgs["fp32"].is_baseline
    assert cfgs["best"].flags.precision == "bf16" and cfgs["best"].flags.compile == "reduce-overhead"
    assert cfgs["best-fp8"].flags.fp8 and cfgs["best-fp8"].uses_compile
    assert cfgs["x"].flags.prune_amount == pytest.approx(0.3) and cfgs["x"].flags.precision == "fp16"
    # pruning rows are the workload's best plus pruning, so they compare with `best` one change apart
    pr = resolve_configs(wl, ["prune-25", "prune-50"])
    best = cfgs["best"].flags
    for c, amount in zip(pr, (0.25, 0.5)):
        assert c.flags.prune_amount == pytest.approx(amount) and c.flags.prune_method == "structured"
        assert (c.flags.precision, c.flags.compile, c.flags.channels_last) == (best.precision, best.compile,
                                                                              best.channels_last)
    assert resolve_configs(get_workload("sg2-1024"), ["fp32"])[0].fp32_layers
    assert parse_custom("a@channels-last=yes+memory=vae-tiling/vae-slicing")[1] == {
        "channels_last": True, "memory": ("vae-tiling", "vae-slicing")}
    with pytest.raises(InputError, match="unknown configuration 'fp64'"):
        resolve_configs(wl, ["fp64"])
    with pytest.raises(InputError, match="unknown setting"):
        parse_custom("a@speed=max")
    with pytest.raises(InputError, match="unique"):
        resolve_configs(wl, ["fp32", "fp32"])


def test_cli_errors_are_one_line_and_nonzero(tmp_path, capsys):
    assert bench(tmp_path, "--workload", "sd99") == 2
    assert "unknown workload 'sd99'" in capsys.readouterr().err
    assert bench(tmp_path, "--workload", "sg2-tiny", "--config-timeout", "5") == 2
    assert "--isolate" in capsys.readouterr().err
    assert bench_main(["report", "--inputs", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r.md")]) == 2
    assert "no benchmark results" in capsys.readouterr().err


def test_app_bench_needs_no_gradio():
    # The GPU machine has no gradio: `python app.py bench` must get to the benchmark without it.
    code = ("import sys; import app; rc = app.main(['bench', 'list']); "
            "assert rc == 0, rc; bad = [m for m in ('gradio', 'ui', 'diffusers') if m in sys.modules]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "sd15-512" in p.stdout and "compile-cg" in p.stdout and "best-fp8" in p.stdout


def test_a_configuration_with_the_same_flags_is_measured_once(tmp_path):
    # sg2-tiny's 'best' is plain bf16: its row is the bf16 row, not a second measurement.
    rc = bench(tmp_path, "--workload", "sg2-tiny", "--configs", "bf16,best", "--batches", "1", "--repeats", "1",
               "--profile", "none", "--no-report")
    assert rc == 0
    res = results(tmp_path)
    assert res[("best", 1)]["same_as"] == "bf16" and res[("best", 1)]["ms_per_image"] == res[("bf16", 1)]["ms_per_image"]
    assert [r["config"] for r in rows_of(tmp_path, "start")] == ["bf16"]


def test_real_weights_of_a_conditional_network(testdata, tmp_path):
    pkl = testdata / "stylegan" / "sg2_cond4_64_fp16.pkl"
    rc = bench(tmp_path, "--workload", "sg2-tiny", "--configs", "baseline,fp32", "--batches", "1", "--repeats", "1",
               "--weights", pkl, "--profile", "none", "--no-report")
    assert rc == 0
    res = results(tmp_path)
    assert all(r["status"] == "ok" for r in res.values()), [r.get("reason") for r in res.values()]
    assert res[("fp32", 1)]["e2e_ms_per_image"] > 0          # through generate(): class 0 of the 4 classes
    wl = rows_of(tmp_path, "workload")[0]
    assert wl["weights"] == str(pkl) and wl["params"]["generator"] > 10_000


def test_report_shows_the_reserved_peak_of_cuda_graph_rows_and_the_fp8_floor():
    from bench.report import render_markdown

    rows = [
        {"type": "workload", "workload": "w", "kind": "stylegan", "targets": []},
        {"type": "result", "workload": "w", "config": "compile-cg", "batch": 1, "status": "ok", "ms_per_image": 2.0,
         "peak_vram_bytes": 1 << 30, "peak_reserved_bytes": 3 << 30, "floor_fraction": 0.25},
        {"type": "result", "workload": "w", "config": "bf16", "batch": 1, "status": "ok", "ms_per_image": 3.0,
         "peak_vram_bytes": 1 << 30, "peak_reserved_bytes": (1 << 30) + (1 << 20), "floor_fraction": 0.2},
        {"type": "result", "workload": "w", "config": "fp8", "batch": 1, "status": "ok", "ms_per_image": 2.5,
         "peak_vram_bytes": 1 << 30, "floor_fraction": 0.3, "floor_fraction_fp8": 0.12},
    ]
    text = render_markdown(merge(rows))
    line = {c: next(x for x in text.splitlines() if x.startswith(f"| `{c}`")) for c in ("compile-cg", "bf16", "fp8")}
    assert "(res. 3" in line["compile-cg"] and "res." not in line["bf16"]      # only where the pools are sizeable
    assert "12" in line["fp8"] and "30.0%" not in line["fp8"]                  # the FP8 row's mixed floor


def test_report_keeps_runs_on_another_gpu_out_of_the_reference_tables():
    """A later run on an H100 must neither replace the H200's row nor be divided by the H200's baseline; it gets
    its own table, and the starts table names each start's device."""
    from bench.report import render_markdown, to_json

    def run(rid, gpu):
        return {"type": "run", "run_id": rid, "gpu": gpu, "command": "python app.py bench --weights /tmp/w"}

    def res(rid, config, ms, **kw):
        return {"type": "result", "run_id": rid, "workload": "w", "config": config, "batch": 1, "status": "ok",
                "ms_per_image": ms, **kw}

    rows = [run("a", "NVIDIA H200"), {"type": "workload", "run_id": "a", "workload": "w", "kind": "diffusion",
                                       "targets": []},
            res("a", "baseline", 1000.0), res("a", "best", 334.0),
            run("b", "NVIDIA H200"), res("b", "best", 335.0),
            run("c", "NVIDIA H100 80GB HBM3"), res("c", "best", 354.0, prepare_s=7.3, first_call_s=2.5)]
    m = merge(rows)
    assert m.reference_gpu == "NVIDIA H200"
    assert m.results[("w", 1, "best")]["run_id"] == "b"                 # the latest H200 row, not the H100's
    assert [r["run_id"] for r in m.elsewhere["w"]] == ["c"]
    assert [r["run_id"] for r in m.starts["w"]] == ["c"]                # a start from disk, on its own device
    text = render_markdown(m)
    best = next(x for x in text.splitlines() if x.startswith("| `best` | 2 |"))
    assert "335" in best and "2.99×" in best                            # 1000 / 335, both H200
    other = text.split("On other GPUs than the NVIDIA H200")[1]
    assert "| `best` | 1 | NVIDIA H100 80GB HBM3 | 354 |" in other
    assert "| `best` | start | NVIDIA H100 80GB HBM3 | 9.8 |" in text
    assert to_json(m)["other_gpus"][0]["ms_per_image"] == 354.0
    # asked for the H100 instead, the tables are the H100's and the H200 rows are the ones kept apart
    m100 = merge(rows, reference_gpu="NVIDIA H100 80GB HBM3")
    assert m100.results[("w", 1, "best")]["run_id"] == "c" and len(m100.elsewhere["w"]) == 3
