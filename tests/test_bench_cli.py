"""The bench command as the GPU machine runs it: no gradio and no matplotlib there, the documented chunk
commands exactly as written (dry run: flags exist, each chunk fits its time budget), cases isolated only
where they compile, toggles that cannot run skipped before a model is built, and the floor arithmetic."""
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from cli.bench import main as bench_main
from bench.estimate import ANCHORS, call_seconds
from bench.measure import matrix_rates
from bench.runner import (BenchOptions, Reference, _cleanup, _floor_fields, estimate_plan, isolation_mode,
                                    sticky_cuda_error)
from bench.specs import get_workload, resolve_configs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
CHUNK_LIMIT_S = 8 * 60          # each command must end well inside the machine's 10-minute limit

# Imported at interpreter start (sitecustomize on PYTHONPATH), in the bench process and in any child it
# starts: gradio and matplotlib look exactly as if they were not installed (a None entry in sys.modules makes
# `import` raise ModuleNotFoundError and importlib.util.find_spec return None, which is what optional-import
# probes such as diffusers' check), and every import statement that asks for one is written to a file.
_BLOCKER = textwrap.dedent('''
    import builtins, os, sys

    BLOCKED = ("gradio", "gradio_client", "matplotlib")
    for _name in BLOCKED:
        sys.modules[_name] = None
    _import = builtins.__import__

    def _logged_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in BLOCKED:
            where = sys._getframe(1).f_code.co_filename
            with open(os.environ["BLOCK_LOG"], "a") as f:
                f.write(f"{name} {where}\\n")
        return _import(name, globals, locals, fromlist, level)

    builtins.__import__ = _logged_import
''')


def _blocked_env(tmp_path: Path) -> tuple[dict, Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    log = tmp_path / "blocked.log"
    log.write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "BLOCK_LOG": str(log)}
    return env, log


def _rows(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


def test_app_bench_runs_and_reports_without_gradio_or_matplotlib(tmp_path):
    env, log = _blocked_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; assert u.find_spec('matplotlib') is None; "
                            "import gradio"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr     # the blocker is really in place
    log.write_text("")

    # Both backends (diffusers probes for matplotlib at import), through app.py as the GPU machine runs it.
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "app.py", "bench", "--workload", "sg2-tiny,sd-tiny", "--configs", "fp32,bf16",
                        "--batches", "1", "--steps", "1", "--repeats", "1", "--profile", "none", "--device", "cpu",
                        "--quiet", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    attempts = log.read_text().splitlines()
    # nothing on the bench path asked for gradio; matplotlib was asked for only by the report's plot step
    assert not [a for a in attempts if a.startswith("gradio")], attempts
    assert attempts and all(a.startswith("matplotlib") and a.endswith("bench/report.py")
                            for a in attempts), attempts
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    res = {(r["workload"], r["config"]): r for r in _rows(Path(summary["jsonl"]), "result")}
    assert len(res) == 4 and {r["status"] for r in res.values()} == {"ok"}, \
        {k: r.get("reason") for k, r in res.items()}
    assert summary["plots"] == [] and "plots skipped" in (out / "bench.md").read_text()

    # `bench report` (here, later) merges the pieces; without matplotlib it writes the tables and says why no plot
    doc = tmp_path / "benchmarks.md"
    p = subprocess.run([sys.executable, "app.py", "bench", "report", "--inputs", str(out / "bench.jsonl"),
                        "--out", str(doc)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = doc.read_text()
    assert "| `fp32` |" in text and "plots skipped" in text and "matplotlib" in text


# -- the documented chunks ----------------------------------------------------------------------------------

def documented_chunks() -> list[tuple[str, list[str], float | None]]:
    """(label, bench arguments, the minutes the doc claims) for every `app.py bench` run command in the
    H200 section of docs/benchmarks.md."""
    text = DOC.read_text()
    section = text[text.index("### On the H200"):text.index("### Reading the tables")]
    code = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S))
    chunks, claimed = [], None
    for line in code.splitlines():
        m = re.search(r"est\. ([\d.]+) min", line)
        if line.lstrip().startswith("#") and m:
            claimed = float(m.group(1))
        if "app.py bench" in line and " report" not in line and not line.lstrip().startswith("#"):
            cmd = line[line.index("app.py bench") + len("app.py bench"):]
            args = shlex.split(cmd.replace("$OUT", "/tmp/OUT"))
            name = args[args.index("--out") + 1].rsplit("/", 1)[-1] if "--out" in args else line.strip()[:60]
            chunks.append((name, args, claimed))
            claimed = None
    return chunks


def test_the_documented_chunks_exist_and_are_ordered():
    chunks = documented_chunks()
    assert len(chunks) >= 6
    first = " ".join(chunks[0][1])
    assert "sg2-1024" in first and "sg3t-1024" in first            # StyleGAN first, then SD1.5 baseline vs best
    assert "sd15-512" in " ".join(chunks[1][1]) and "best" in " ".join(chunks[1][1])
    for label, args, claimed in chunks:
        assert claimed is not None, f"no '(est. N min)' comment above {label}"
        assert "--max-minutes" in args and "--out" in args, label


@pytest.mark.parametrize("label,args,claimed", documented_chunks(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_documented_chunk_parses_and_fits_its_budget(label, args, claimed, capsys):
    assert bench_main(args + ["--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    total = float(re.search(r"estimated total on the H200: ([\d.]+) s", out).group(1))
    assert total < CHUNK_LIMIT_S, f"{label}: estimated {total / 60:.1f} min\n{out}"
    assert "note:" not in out, out                      # not over its own --max-minutes or --config-timeout
    assert abs(total / 60 - claimed) <= 0.3, f"{label}: the doc says {claimed} min, the estimate is {total / 60:.2f}"


def test_dry_run_touches_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert bench_main(["--workload", "sd15-512,sg2-1024", "--configs", "baseline,fp32,best,tensorrt,prune-50",
                       "--batches", "1", "--isolate", "compiled", "--max-minutes", "1", "--config-timeout", "60",
                       "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert "skipped on the H200: TensorRT" in text and "torch-pruning" in text     # diffusion's structured pruning
    assert "over --max-minutes 1" in text and "over --config-timeout" in text


# -- the plan's arithmetic -----------------------------------------------------------------------------------

def test_estimates_follow_the_measured_anchors_and_the_plan():
    sd15 = get_workload("sd15-512")
    cfg = {c.name: c for c in resolve_configs(sd15, ["baseline", "fp32", "best", "compile"])}
    # GPU.md: a 50-step fp32 image is 50 × 72.2 ms of UNet plus the VAE; the CUDA-graph one 50 × 9.1 ms
    assert 50 * 0.0722 < call_seconds(sd15, cfg["fp32"].flags, 1) < 50 * 0.0722 + 0.2
    assert 50 * 0.0091 < call_seconds(sd15, cfg["best"].flags, 1) < 50 * 0.0091 + 0.2
    assert call_seconds(sd15, cfg["baseline"].flags, 8) > call_seconds(sd15, cfg["baseline"].flags, 1)
    opts = BenchOptions(workloads=["sd15-512"], configs=["baseline", "best"], batches=[1], isolate="compiled",
                        profile=["best"])
    est = estimate_plan(opts)
    base, best = est["cases"]
    assert not base["isolated"] and best["isolated"] and best["parts"]["compile"] == 85.0
    assert "fp32_reference" in base["parts"]          # no fp32 case in the plan: the first case pays for the reference
    assert "profile" in best["parts"] and "profile" not in base["parts"]
    with_fp32 = estimate_plan(BenchOptions(workloads=["sd15-512"], configs=["fp32", "baseline"], batches=[1]))
    assert all("fp32_reference" not in c["parts"] for c in with_fp32["cases"])
    # identical flags are measured once: sg2-1024's best is compile-cg
    dup = estimate_plan(BenchOptions(workloads=["sg2-1024"], configs=["compile-cg", "best"], batches=[1]))
    assert dup["cases"][1]["seconds"] == 0.0 and "copied" in dup["cases"][1]["note"]
    assert set(ANCHORS) == {"sd15-512", "sdxl-1024", "sd-turbo-512", "sg2-1024", "sg3t-1024"}


def test_isolation_modes_parse():
    assert isolation_mode(True) == "all" and isolation_mode(False) == "none" and isolation_mode(None) == "none"
    assert isolation_mode("compiled") == "compiled"
    from core.errors import InputError

    with pytest.raises(InputError, match="compiled"):
        isolation_mode("some")


# -- running: isolation, early skips, cleanup ----------------------------------------------------------------

def test_isolate_compiled_runs_only_compiled_cases_in_a_child(tmp_path, monkeypatch):
    from tests.test_bench import hang_new_pythons

    out = tmp_path / "iso"
    hang_new_pythons(monkeypatch, tmp_path)        # the child hangs for sure: its kill does not hang on speed
    rc = bench_main(["--out", str(out), "--device", "cpu", "--quiet", "--no-report", "--workload", "sg2-tiny",
                     "--configs", "fp32,cc@precision=fp32+compile=default", "--batches", "1", "--repeats", "1",
                     "--profile", "none", "--isolate", "compiled", "--config-timeout", "1"])
    assert rc == 0
    res = {r["config"]: r for r in _rows(out / "bench.jsonl", "result")}
    starts = {r["config"]: r for r in _rows(out / "bench.jsonl", "start")}
    assert res["fp32"]["status"] == "ok" and starts["fp32"]["pid"] == os.getpid()     # eager: in this process
    # the compiled case went to a child process (hung here), which the 1-second timeout killed (an in-process
    # case cannot be)
    assert res["cc"]["status"] == "failed" and "timed out" in res["cc"]["reason"]
    assert "cc" not in starts or starts["cc"]["pid"] != os.getpid()


def test_toggles_that_cannot_run_here_skip_before_any_model_is_built(tmp_path):
    # On a CPU: TensorRT is not installed and FP8 needs a GPU; neither case builds the generator.
    out = tmp_path / "skip"
    rc = bench_main(["--out", str(out), "--device", "cpu", "--quiet", "--no-report", "--workload", "sg2-tiny",
                     "--configs", "tensorrt,fp8", "--batches", "1", "--profile", "none"])
    assert rc == 0
    res = {r["config"]: r for r in _rows(out / "bench.jsonl", "result")}
    for name, word in (("tensorrt", "TensorRT"), ("fp8", "FP8")):
        r = res[name]
        assert r["status"] == "skipped" and word in r["reason"] and "before the model was built" in r["reason"]
        assert "prepare_s" not in r and r["case_s"] < 2.0
    assert not (out / "reference").exists()        # not even the fp32 reference was built for them
    out2 = tmp_path / "strict"
    assert bench_main(["--out", str(out2), "--device", "cpu", "--quiet", "--no-report", "--workload", "sg2-tiny",
                       "--configs", "tensorrt", "--batches", "1", "--strict"]) == 0
    r = _rows(out2 / "bench.jsonl", "result")[0]
    assert r["status"] == "failed" and "--strict" in r["reason"]


def test_sticky_cuda_errors_are_told_from_recoverable_ones():
    assert sticky_cuda_error("CUDA error: an illegal memory access was encountered")
    assert sticky_cuda_error("RuntimeError: CUDA error: device-side assert triggered")
    assert not sticky_cuda_error("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert _cleanup(torch.device("cpu")) is None          # and the cleanup itself never raises


# -- rates and the floor ---------------------------------------------------------------------------------------

def test_matrix_rates_measure_bf16_and_both_fp8_accumulations():
    r = matrix_rates(torch.device("cpu"), size=64, repeats=2, warmup=1)
    assert r["size"] == 64 and r["bf16_tflops"] > 0
    if "fp8_error" not in r:                       # _scaled_mm runs on CPUs too in current torch
        assert r["fp8_tflops"] > 0 and r["fp8_fast_accum_tflops"] > 0
        assert r["fp8_size"] == 64


def test_cpu_fp8_rate_is_timed_on_small_products():
    """A CPU emulates FP8 products (seconds for one 512³): the CPU rate is taken at 128³ at most, so a CPU
    bench run does not spend minutes on a figure that only feeds the floor arithmetic."""
    r = matrix_rates(torch.device("cpu"), size=512, repeats=1, warmup=1)
    assert r["size"] == 512 and r["bf16_tflops"] > 0
    if "fp8_error" not in r:
        assert r["fp8_size"] == 128 and r["fp8_tflops"] > 0


def test_floor_of_an_fp8_row_mixes_the_two_rates():
    ref = Reference(np.zeros((1, 4, 4, 3), np.uint8),
                    {"denoise": {"calls": 50, "flops": 800, "linear_flops": 600}, "vae": {"calls": 1, "flops": 200,
                                                                                         "linear_flops": 0}},
                    {"unet": 1})
    rates = {"bf16_tflops": 1e-9, "fp8_tflops": 1.5e-9, "fp8_fast_accum_tflops": 2e-9}    # 1000 / 2000 FLOP/s
    bf16 = _floor_fields(2000.0, ref, rates)
    assert bf16["floor_ms_per_image"] == pytest.approx(1000.0) and bf16["floor_fraction"] == pytest.approx(0.5)
    assert "floor_fp8_ms_per_image" not in bf16                       # a bf16 row is held to the bf16 floor
    fp8 = _floor_fields(2000.0, ref, rates, uses_fp8=True)
    # 600 linear FLOPs at the faster FP8 rate (2000/s) + 400 others at bf16 (1000/s) = 0.3 + 0.4 s
    assert fp8["floor_fp8_ms_per_image"] == pytest.approx(700.0) and fp8["floor_fraction_fp8"] == pytest.approx(0.35)
    assert fp8["floor_ms_per_image"] == pytest.approx(1000.0)


def test_save_random_writes_a_folder_the_bench_loads_as_real_weights(tmp_path, capsys):
    """`bench save-random` writes the workload's random pipeline as safetensors; `bench --weights FOLDER` then
    loads it from disk (the second-start measurement) and gets the same picture as the random build."""
    folder = tmp_path / "sd-tiny-random"
    assert bench_main(["save-random", "--workload", "sd-tiny", "--out", str(folder), "--dtype", "fp32",
                       "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["folder"] == str(folder) and info["bytes"] > 0 and info["dtype"] == "float32"
    assert sorted(p.name for p in folder.glob("*/*.safetensors")) and (folder / "model_index.json").is_file()
    # refused: a non-empty folder (nothing overwritten), a StyleGAN workload
    assert bench_main(["save-random", "--workload", "sd-tiny", "--out", str(folder)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert bench_main(["save-random", "--workload", "sg2-tiny", "--out", str(tmp_path / "sg")]) == 2
    assert "diffusion" in capsys.readouterr().err and not (tmp_path / "sg").exists()

    rows = {}
    for name, extra in (("random", []), ("file", ["--weights", str(folder)])):
        out = tmp_path / name
        assert bench_main(["--workload", "sd-tiny", "--batches", "1", "--configs", "fp32", "--steps", "2",
                           "--device", "cpu", "--out", str(out), "--no-report", "--quiet", *extra]) == 0
        rows[name] = [json.loads(l) for l in (out / "bench.jsonl").read_text().splitlines()]
    res = {k: next(r for r in v if r.get("type") == "result") for k, v in rows.items()}
    assert res["random"]["status"] == res["file"]["status"] == "ok"
    wl = {k: next(r for r in v if r.get("type") == "workload") for k, v in rows.items()}
    assert json.dumps(wl["file"]).count(str(folder)) >= 1 and str(folder) not in json.dumps(wl["random"])
    # the same weights, read back from disk: the same picture (to rounding; not asserted bit for bit)
    ref = {k: np.load(next((tmp_path / k / "reference").glob("*.npz")))["images"].astype(np.float64)
           for k in ("random", "file")}
    assert ref["random"].std() > 10 and np.abs(ref["random"] - ref["file"]).mean() < 0.5
    # where the start's preparation went, and the report's table of starts: the run from disk only
    parts = res["file"]["prepare_parts_s"]
    assert sorted(parts) == ["import", "load", "optimize"] and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= res["file"]["prepare_s"] + 0.05
    toggles = res["file"]["prepare_toggles_s"]       # the "optimize" part, by toggle step
    assert {"place", "precision"} <= set(toggles) and all(v >= 0 for v in toggles.values()), toggles
    assert sum(toggles.values()) <= parts["optimize"] + 0.05, (toggles, parts)
    from bench.report import merge, read_jsonl, render_markdown

    text = render_markdown(merge([r for k in ("random", "file") for r in read_jsonl(tmp_path / k / "bench.jsonl")]))
    starts = text[text.index("Time to a first image"):].split("\n\n")[1].splitlines()[2:]
    assert len(starts) == 1 and starts[0].startswith("| `fp32` |") and "load " in starts[0], starts


def test_the_h200_diffusion_script_refuses_a_bad_plan_before_any_gpu_work(tmp_path):
    """scripts/h200_diffusion.sh checks every part, workload and configuration first (PREFLIGHT_ONLY=1 stops
    there): a plan with a typo fails here, not after a device call has started."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OUT": str(tmp_path / "out"), "PREFLIGHT_ONLY": "1"}
    env.pop("WEIGHTS", None)

    def plan(*parts, **extra):
        return subprocess.run(["bash", "scripts/h200_diffusion.sh", *parts], cwd=root, env={**env, **extra},
                              capture_output=True, text=True, timeout=300)

    good = plan("save-sd15-512", "sd15", "warm-sd15-512", "warm0-sd15-512", "tests", WEIGHTS=str(tmp_path / "w"),
                SD15_CONFIGS="best-graph", SDXL_CONFIGS="best,mine@precision=bf16+fp8=1")
    assert good.returncode == 0 and "preflight ok" in good.stdout, good.stdout + good.stderr
    bad = plan("warm-sd15", "sdxl", "save-sd15-512", "sd16", SDXL_CONFIGS="best,bestfp8")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    for why in ("warm-sd15: unknown workload 'sd15'", "unknown configuration 'bestfp8'",
                "save-sd15-512: needs WEIGHTS", "sd16: unknown part"):
        assert why in bad.stdout, (why, bad.stdout)
    assert not (tmp_path / "w").exists() and not list((tmp_path / "out").glob("*/bench.jsonl"))
    # the suggested SDPA route comes from an sdpa part earlier in the same call, or the plan is refused
    routed = plan("sdpa", "envab", AB_ENV="ATELIER_SDPA_ROUTE=suggested", SDPA_WORKLOADS="sdxl-1024")
    assert routed.returncode == 0, routed.stdout + routed.stderr
    unrouted = plan("envab", "sdpa", AB_ENV="ATELIER_SDPA_ROUTE=suggested")
    assert unrouted.returncode == 2 and "takes the route of an `sdpa` part" in unrouted.stdout, unrouted.stdout
    # several settings stacked on one row, with flags added to best's; each setting and flag is checked
    stacked = plan("envab", AB_ENV="ATELIER_FP8_CONV=triton ATELIER_INDUCTOR_TUNING=coordinate",
                   AB_EXTRA="fp8=1+fuse_qkv=1", AB_NAME="stacked")
    assert stacked.returncode == 0, stacked.stdout + stacked.stderr
    wrong = plan("envab", AB_ENV="ATELIER_FP8_CONV=cudnn ATELIER_INDUCTOR_TUNING=fast", AB_EXTRA="fp9=1")
    assert wrong.returncode == 2, wrong.stdout
    for why in ("ATELIER_FP8_CONV must be one of off, triton", ):
        assert why in wrong.stdout, (why, wrong.stdout)
    assert plan("envab", AB_ENV="ATELIER_FP8_CONV=triton", AB_EXTRA="fp9=1").stdout.count("unknown setting 'fp9=1'") == 1
    # the pruning A/B part checks its model and dtype
    assert plan("prune-ab", PRUNEAB_MODEL="sdxl", PRUNEAB_DTYPE="bf16").returncode == 0
    badab = plan("prune-ab", PRUNEAB_MODEL="sd16", PRUNEAB_DTYPE="fp8")
    assert badab.returncode == 2 and "no assets/diffusion_configs/sd16/unet/config.json" in badab.stdout, badab.stdout
