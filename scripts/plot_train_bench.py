"""Bar chart of a trainer throughput ladder (`--bench` JSON), optionally with a training run's own rate.

    python3 scripts/plot_train_bench.py docs/results/2026-12-02-8429f28-train-bench-1gpu.json \
        docs/images/train_ladder.png --run-log docs/results/2026-12-02-8429f28-emoji64-log.jsonl

`--run-log` adds one bar: the median img/s of the run's log lines (the first `--skip` lines, which
include compilation, left out), labelled with the run's batch and options from `--run-label`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def run_rate(log: Path, skip: int = 3) -> tuple[float, int]:
    """(median img/s of the 'train' records after the first `skip`, how many records were used)."""
    rates = [r["img_s"] for r in map(json.loads, log.read_text().splitlines()) if r.get("kind") == "train"]
    used = rates[skip:] or rates
    if not used:
        raise ValueError(f"{log} has no train records")
    return statistics.median(used), len(used)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--run-log", type=Path, default=None)
    ap.add_argument("--run-label", default="training run")
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: the plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    doc = json.loads(args.bench.read_text())
    names, rates, labels = [], [], []
    for name, r in doc["configs"].items():
        if "error" in r:
            continue
        names.append(name)
        rates.append(r["img_s"])
        labels.append(f"{name}\nbatch {r.get('batch', doc.get('batch'))}")
    colors = ["#9aa5b1"] * len(names)
    if args.run_log is not None:
        rate, n = run_rate(args.run_log, args.skip)
        names.append("run")
        rates.append(rate)
        labels.append(args.run_label)
        colors.append("#2f7ed8")
    base = doc["configs"].get("plain-fp32", {}).get("img_s")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.95 * len(names)), 3.6), dpi=110)
    bars = ax.bar(range(len(names)), rates, color=colors)
    for b, v in zip(bars, rates):
        text = f"{v:,.0f}" + (f"\n{v / base:.1f}x" if base else "")
        ax.text(b.get_x() + b.get_width() / 2, v, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.set_ylabel("real images / s (shown to D)")
    ax.set_ylim(0, max(rates) * 1.22)
    ax.set_title(f"Trainer throughput, {doc.get('device', '?')}, torch {doc.get('torch', '?')} "
                 f"({doc.get('seconds_each', '?')} s each after warm-up)", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
