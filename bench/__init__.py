"""Measuring the product: everything that says how fast (and how far from the fp32 reference)
the studio's own pipelines run. `python app.py bench` (cli/bench.py) drives it.

- `specs`: workloads (SD1.5, SDXL, SD-Turbo, StyleGAN2/3 and tiny harness checks) and
  configurations (baseline, fp32 … best) as OptimizationFlags;
- `build`: random-weight (or real-weight) models from the bundled configs;
- `measure`: timers, matrix rates, FLOP counts, stage clocks, kernel profiles;
- `estimate`: what a plan costs on the H200 before anything runs (`bench --dry-run`);
- `runner`: the loop that measures each case in isolation (in its own process where asked)
  and appends JSON lines;
- `report`: the report from those JSON lines (markdown tables, JSON, plots; docs/benchmarks.md);
- `summary`: one line per result, the table a device call prints last (`python -m bench.summary`);
- `ops`: op-level microbenchmarks of the models.ops variants on the GPU (`python -m bench.ops`).

Drift metrics come from `evaluation.drift`, handed in by the CLI. Nothing is imported here, so
`report` and `summary` stay standard-library only (a report can be rebuilt without torch).
"""
