"""Train the bundled emoji model inside a wall-clock budget (resumable), benchmark the trainer, export.

    python3 scripts/train_default_model.py --out runs/emoji64 --batch 256 --compile --minutes 16   # a run
    python3 scripts/train_default_model.py --out runs/emoji64 --minutes 3 --resume     # continue it
    python3 scripts/train_default_model.py --out runs/e2 --resume runs/emoji64 --retune --batch 256 --pl-weight 0
    python3 scripts/train_default_model.py --bench 10 --bench-compile                  # the speed ladder, img/s
    torchrun --standalone --nproc_per_node 2 scripts/train_default_model.py --bench 30 --bench-configs fast-ops
    python3 scripts/train_default_model.py --export runs/emoji64                       # -> assets/models/emoji64.*

It is `python app.py train --preset emoji64 ...` without the app: it needs only torch,
numpy, safetensors and Pillow (no gradio, no fonttools), and reads the dataset bundled
at assets/datasets/emoji64.npy.xz (rebuild it with scripts/build_emoji_dataset.py).
--minutes is the budget of the whole process: training stops at a log point with
--reserve-seconds (45 s) left for the checkpoint and the sample grid. The run folder holds
the checkpoint (G, G_ema, D, opt_G, opt_D safetensors split below 15 MiB a file, state.json),
log.jsonl, samples.png and snapshots/ (fp16 G_ema every 200 kimg, for scripts/emoji_metrics.py).
scripts/h200_train.sh runs ladder, training, export and metrics on the GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_START = time.time()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/emoji64")
    ap.add_argument("--minutes", type=float, default=None, help="wall-clock budget of this process")
    ap.add_argument("--kimg", type=float, default=None, help="stop at this total kimg (default: preset, 25000)")
    ap.add_argument("--resume", nargs="?", const="", default=None,
                    help="continue from this run folder (no value: from --out)")
    ap.add_argument("--bench", type=float, default=None, metavar="SECONDS")
    ap.add_argument("--bench-configs", default=None, help="comma-separated subset of the bench ladder")
    ap.add_argument("--bench-compile", action="store_true")
    ap.add_argument("--export", nargs="?", const="", default=None, metavar="RUN",
                    help="export RUN (default --out) to assets/models/emoji64.* and docs/images/emoji64_grid.png")
    ap.add_argument("--snapshot", default=None, metavar="KIMG|FILE",
                    help="with --export: export this G_ema snapshot of the run (a kimg such as 3400, a name in "
                         "RUN/snapshots, or a file) instead of the last checkpoint's G_ema")
    ap.add_argument("--compact", default=None, metavar="RUN",
                    help="write RUN's checkpoint in travel form to --compact-to: 16-bit G, G_ema and D, no optimizer "
                         "moments (about a fifth of the size); --resume continues from it with Adam started afresh")
    ap.add_argument("--compact-to", default=None, metavar="DIR")
    ap.add_argument("--carry-d", default=None, metavar="RUN",
                    help="write D of RUN's checkpoint alone, bf16 and xz-compressed (< 12 MB), to --carry-d-to: with "
                         "the exported generator of the same checkpoint, a later run continues from it "
                         "(--init-g MODEL --init-d FILE) without training a fresh D")
    ap.add_argument("--carry-d-to", default=str(ROOT / "training_state" / "emoji64-D.safetensors.xz"),
                    metavar="FILE")
    ap.add_argument("--to", default=str(ROOT / "assets" / "models" / "emoji64"))
    ap.add_argument("--grid", default=str(ROOT / "docs" / "images" / "emoji64_grid.png"))
    args, rest = ap.parse_known_args(argv)

    from core.errors import AtelierError, InputError

    try:
        if args.snapshot is not None and args.export is None:
            raise InputError("--snapshot picks what --export writes: give it with --export [RUN]")
        if args.compact is not None:
            from training.checkpoint import compact_checkpoint

            if not args.compact_to:
                raise InputError("--compact RUN needs --compact-to DIR (a new folder; RUN stays as it is)")
            sizes = compact_checkpoint(args.compact, args.compact_to)
            print(json.dumps({"to": args.compact_to, "mib": {k: round(v / 2**20, 2) for k, v in sizes.items()}}))
            return 0
        if args.carry_d is not None:
            from training.checkpoint import write_d_state

            print(json.dumps(write_d_state(args.carry_d, args.carry_d_to)))
            return 0
        if args.export is not None:
            from training.export import export_run

            from training.export import MAX_SHIPPED_BYTES

            paths = export_run(args.export or args.out, args.to, grid_path=args.grid, max_bytes=MAX_SHIPPED_BYTES,
                               snapshot=args.snapshot)
            print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
            return 0
        if args.bench:
            from training.bench import run_bench
            from training.cli import build_parser, config_from_args

            ns = build_parser().parse_args(["--preset", "emoji64", "--out", args.out, *rest])
            cfg = config_from_args(ns)
            configs = args.bench_configs.split(",") if args.bench_configs else None
            Path(args.out).mkdir(parents=True, exist_ok=True)

            def write(report):
                path = Path(args.out) / f"bench-{report['world_size']}gpu.json"
                path.write_text(json.dumps(report, indent=1) + "\n")

            report = run_bench(cfg, seconds=args.bench, with_compile=args.bench_compile, configs=configs,
                               on_result=write)
            if os.environ.get("RANK", "0") != "0":
                return 0
            print(json.dumps(report, indent=1))
            write(report)
            return 0
        from training.cli import build_parser, config_from_args, given_from_args, retune_from_args
        from training.trainer import train

        ns = build_parser().parse_args(["--preset", "emoji64", "--out", args.out, *rest])
        if args.minutes is not None:
            ns.minutes = args.minutes
        if args.kimg is not None:
            ns.kimg = args.kimg
        cfg = config_from_args(ns)
        resume = None
        if args.resume is not None:
            resume = args.resume or args.out
        summary = train(cfg, resume=resume, t_start=T_START, retune=retune_from_args(ns), given=given_from_args(ns))
        print(json.dumps(summary))
        return 0
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
