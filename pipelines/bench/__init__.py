"""`python app.py bench`: the optimization toggles measured on the studio's own pipelines.

- `specs`: workloads (SD1.5, SDXL, SD-Turbo, StyleGAN2/3 and tiny harness checks) and
  configurations (baseline, fp32 … best) as OptimizationFlags;
- `build`: random-weight (or real-weight) models from the bundled configs;
- `measure`: timers, matrix rates, FLOP counts, stage clocks, kernel profiles;
- `runner`: the loop that measures each case in isolation and appends JSON lines.

The report (markdown table, JSON, plots) is `telemetry.bench_report`; drift metrics come
from `evaluation.drift`, handed in by the CLI (pipelines/ does not import evaluation/).
"""
from pipelines.bench.runner import BenchOptions, JSONL_NAME, read_rows, run  # noqa: F401
from pipelines.bench.specs import DEFAULT_CONFIGS, FULL_WORKLOADS, WORKLOADS, resolve_configs  # noqa: F401

__all__ = ["BenchOptions", "JSONL_NAME", "read_rows", "run", "DEFAULT_CONFIGS", "FULL_WORKLOADS", "WORKLOADS",
           "resolve_configs"]
