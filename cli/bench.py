"""`python app.py bench`: measure the optimization toggles; `bench report`: merge runs into docs.

    python app.py bench --workload sg2-1024 --configs baseline,fp32,bf16,compile-cg --out $OUT/bench
    python app.py bench report --inputs a/bench.jsonl b/bench.jsonl --out docs/benchmarks.md
    python app.py bench list
    python app.py bench save-random --workload sd15-512 --out /tmp/sd15-random   (then --weights /tmp/sd15-random)
    python app.py bench --workload sd15-512 --configs baseline,fp32,best --isolate compiled --dry-run

Nothing on this path imports gradio or matplotlib (matplotlib only for `bench report`'s plots, and
optional there), so the GPU machine runs it as is.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.errors import cli_errors
from core.errors import InputError

USAGE_EXTRA = """
Cut a long run into commands that each fit a time limit: one workload (or a few configurations)
per command, --max-minutes as a guard, and merge the pieces with `bench report`. --dry-run prints
the plan with each case's estimated seconds on the H200 and runs nothing.
Configurations: baseline fp32 tf32 fp16 bf16 bf16-cl compile compile-cg fp8 prune-25 prune-50
tensorrt best best-fp8 best-fqkv best-graph, or your own as NAME@precision=bf16+compile=default+fp8=1.
"""


def _ints(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--batches takes whole numbers separated by commas, e.g. 1,32; got {text!r}") from None


def build_run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="app.py bench", description="Benchmark the optimization toggles.",
                                epilog=USAGE_EXTRA, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", "--workloads", dest="workloads", default=None,
                   help="comma-separated workloads (default: all full-size ones); `bench list` shows them. "
                        "NAME@B1+B2 gives one its own batch sizes, e.g. sg2-1024@32,sd-turbo-512@1")
    p.add_argument("--configs", default=None, help="comma-separated configurations (default: all)")
    p.add_argument("--batches", default=None, help="batch sizes, e.g. 1,32 (default: the workload's own)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (median reported)")
    p.add_argument("--warmup", type=int, default=None, help="calls before timing (compile cases get at least 2-3)")
    p.add_argument("--steps", type=int, default=None, help="override the diffusion steps (quick looks only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the drift image")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: best available)")
    p.add_argument("--out", default="outputs/bench", help="folder for bench.jsonl (appended), bench.json, bench.md")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new case after this many minutes (the rest are recorded as skipped)")
    p.add_argument("--isolate", nargs="?", const="all", default=None, choices=["all", "compiled", "none"],
                   help="run cases in their own processes: 'all' (the default when given alone), or 'compiled' "
                        "(only cases that compile or build an engine, which can hang or take minutes); a crash or "
                        "a hung compile then cannot take the rest down")
    p.add_argument("--config-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --isolate: kill an isolated case after this long")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and each case's estimated time on the H200; run nothing")
    p.add_argument("--profile", default="best",
                   help="configurations to profile one call of (kernel table), 'all' or 'none' (default: best)")
    p.add_argument("--weights", default=None, help="real weights for the (single) workload instead of random ones")
    p.add_argument("--strict", action="store_true", help="a toggle that cannot run fails its case instead of skipping it")
    p.add_argument("--no-report", action="store_true", help="write only the JSON lines")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    # set by the parent of an isolated run
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rates", default=None, help=argparse.SUPPRESS)
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="app.py bench report",
                                description="Merge bench.jsonl files into a markdown report, a JSON file and plots.")
    p.add_argument("--inputs", nargs="+", required=True, help="bench.jsonl files (later ones win ties)")
    p.add_argument("--out", default="docs/benchmarks.md",
                   help="markdown file; an existing one keeps everything outside its result markers")
    p.add_argument("--plots-dir", default=None, help="default: a folder named after the markdown file")
    p.add_argument("--json", default=None, help="merged JSON (default: the markdown path with .json)")
    p.add_argument("--no-plots", action="store_true")
    return p


@cli_errors
def report_cmd(argv: list[str]) -> int:
    from bench.report import write_report

    a = build_report_parser().parse_args(argv)
    out = write_report(a.inputs, a.out, plots_dir=a.plots_dir, json_out=a.json, plots=not a.no_plots)
    print(json.dumps(out))
    return 0


@cli_errors
def list_cmd(argv: list[str]) -> int:
    from bench.specs import DEFAULT_CONFIGS, WORKLOADS, resolve_configs

    print("workloads:")
    for name, w in WORKLOADS.items():
        print(f"  {name:<14} {w.description} (batches {','.join(map(str, w.batches))})")
    print("configurations:")
    for c in resolve_configs(WORKLOADS["sd15-512"], list(DEFAULT_CONFIGS)):
        print(f"  {c.name:<11} {c.description.split(':')[0] if c.name.startswith('best') else c.description}")
    return 0


@cli_errors
def run_cmd(argv: list[str]) -> int:
    from bench.runner import BenchOptions, estimate_plan, format_estimate, isolation_mode, run, shell_command
    from bench.specs import FULL_WORKLOADS, parse_list

    a = build_run_parser().parse_args(argv)
    if a.config_timeout is not None and isolation_mode(a.isolate) == "none":
        raise InputError("--config-timeout needs --isolate (a case in this process cannot be stopped from outside)")
    profile = [] if a.profile in ("none", "") else parse_list(a.profile)
    try:
        rates = json.loads(a.rates) if a.rates else None
    except json.JSONDecodeError:
        raise InputError("--rates must be JSON") from None
    opts = BenchOptions(
        workloads=parse_list(a.workloads) or list(FULL_WORKLOADS), configs=parse_list(a.configs) or None,
        batches=_ints(a.batches), repeats=a.repeats, warmup=a.warmup, steps=a.steps, seed=a.seed, device=a.device,
        out_dir=Path(a.out), max_minutes=a.max_minutes, isolate=isolation_mode(a.isolate),
        config_timeout_s=a.config_timeout,
        profile=profile, weights=a.weights, strict=a.strict, quiet=a.quiet, run_id=a.run_id, rates=rates,
        child=a.child, command=shell_command(["python", "app.py", "bench"] + list(argv)))
    for n, v in (("--repeats", a.repeats), ("--warmup", a.warmup), ("--steps", a.steps)):
        if v is not None and v < (0 if n == "--warmup" else 1):
            raise InputError(f"{n} must be at least {0 if n == '--warmup' else 1}; got {v}")
    if a.dry_run:
        print(format_estimate(estimate_plan(opts)))
        return 0
    from evaluation.drift import compare

    jsonl = run(opts, drift_fn=lambda ref, img: compare(ref, img, data_range=255.0, layout="NHWC"))
    if a.child:
        return 0
    summary: dict = {"jsonl": str(jsonl)}
    if not a.no_report:
        from bench.report import write_report

        summary.update(write_report([jsonl], Path(a.out) / "bench.md", plots_dir=Path(a.out) / "plots",
                                    json_out=Path(a.out) / "bench.json"))
    print(json.dumps(summary))
    return 0


@cli_errors
def save_random_cmd(argv: list[str]) -> int:
    import torch

    from bench.build import save_random_diffusion
    from bench.specs import get_workload

    p = argparse.ArgumentParser(
        prog="app.py bench save-random",
        description="Write a diffusion workload's random-weight pipeline as a diffusers folder (safetensors): "
                    "`bench --weights FOLDER` then loads it from disk as a real model loads (the second-start figure).")
    p.add_argument("--workload", required=True, help="a diffusion workload, e.g. sd15-512")
    p.add_argument("--out", required=True, help="a new (or empty) folder")
    p.add_argument("--seed", type=int, default=0, help="the seed of the weights (the bench's --seed)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="dtype of the saved weights")
    p.add_argument("--device", default=None, help="where to draw the weights (default: cuda when present)")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    print(json.dumps(save_random_diffusion(get_workload(a.workload), Path(a.out), device, a.seed, dtype)))
    return 0


def main(argv: list[str], services=None) -> int:
    """`services` is accepted for the dispatcher's sake; the benchmark builds its own models."""
    del services
    if argv and argv[0] == "report":
        return report_cmd(argv[1:])
    if argv and argv[0] == "list":
        return list_cmd(argv[1:])
    if argv and argv[0] == "save-random":
        return save_random_cmd(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return run_cmd(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
