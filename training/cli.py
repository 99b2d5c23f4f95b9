"""`python app.py train ...`: the training command line.

    python app.py train --data PATH --resolution R --config stylegan2 --kimg N --out DIR
                        [--resume DIR] [--loss r1|wgan-gp] [--minutes M] [--batch B] ...
    python app.py train --preset emoji64 --out runs/emoji64 --minutes 8.5 [--resume runs/emoji64]
    python app.py train --preset emoji64 --bench 30          # fp32 eager vs the fast path, img/s
    python app.py train --export runs/emoji64 --to assets/models/emoji64   # G_ema -> fp16 safetensors

`main(argv)` returns the exit status; app.py hands its remaining arguments here.
Multi-GPU: launch the same command under torchrun or `accelerate launch`
(see training/distributed.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from core.errors import AtelierError, InputError
from training.config import AUG_MODES, AUG_PIPES, COMPILE_SCOPES, LOSSES, OPTIMIZERS, PRECISIONS, PRESETS, build_config


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="app.py train", description="Train a StyleGAN2/3 on a folder or zip of images.")
    a = ap.add_argument
    a("--data", help="folder of images, .zip, or .npy/.npz/.npy.xz uint8 array (the emoji64 preset has its own)")
    a("--out", default=None, help="run folder for checkpoints, log.jsonl and samples.png (default runs/<preset>)")
    a("--config", "--preset", dest="preset", default="stylegan2", choices=PRESETS,
      help="network/hyperparameter preset (default stylegan2)")
    a("--resolution", type=int, default=0, help="train at this size (power of two); 0 = the data's own")
    a("--kimg", type=float, default=None, help="length in thousands of real images shown to D")
    a("--minutes", type=float, default=None,
      help="wall-clock budget for the whole process; stops cleanly with --reserve-seconds left for saving")
    a("--reserve-seconds", type=float, default=None)
    a("--resume", default=None, help="run folder to continue from (exactly: data order, EMA, optimizers, ADA p)")
    a("--retune", action="store_true",
      help="with --resume: take the recipe settings given on this command line (--batch, --lr-g/--lr-d, "
           "--r1-gamma, --pl-weight, --style-mixing, --ema-kimg, --aug, --aug-pipe, --ada-target, --ada-max-p, "
           "--d-steps, --class-balance) instead of the run's own; networks, EMA, optimizer moments and ADA p carry over (p is "
           "lowered to a new --ada-max-p)")
    a("--loss", choices=LOSSES, default=None, help="r1: non-saturating + lazy R1 (default) | wgan-gp")
    a("--optimizer", choices=OPTIMIZERS, default=None,
      help="stylegan2: Adam(0, 0.99) | wgan-gp: G RAdam, D Adam(0.5, 0.9), lr 1e-4 (default follows --loss)")
    a("--batch", type=int, default=None, help="global batch over all GPUs")
    a("--lr-g", type=float, default=None)
    a("--lr-d", type=float, default=None)
    a("--d-steps", type=int, default=None, help="D updates per G update, e.g. 3 for 3:1")
    a("--r1-gamma", type=float, default=None, help="R1 weight (default: 0.0002 * res^2 / batch)")
    a("--gp-lambda", type=float, default=None)
    a("--pl-weight", type=float, default=None, help="path length regularization weight (0 = off)")
    a("--style-mixing", type=float, default=None)
    a("--ema-kimg", type=float, default=None)
    a("--aug", choices=AUG_MODES, default=None, help="ada (default) | fixed | none")
    a("--aug-pipe", choices=AUG_PIPES, default=None,
      help="augmentations: ADA's blit/geom/color/bg/bgc/bgcc (default bgc), or upright: translation, scale, "
           "brightness, contrast, hue, saturation, without flips or rotations, for data with one orientation "
           "and background (the emoji64 preset's)")
    a("--aug-p", type=float, default=None,
      help="initial (ada) or fixed augmentation probability; above --ada-max-p is an error")
    a("--ada-max-p", type=float, default=None,
      help="cap on augmentation p, in (0, 1] (default 1.0 = none, as NVlabs; emoji64: 0.6): near p = 1 flips "
           "and rotations leak into G (sideways or mirrored samples). A fixed --aug-p above it is an error, "
           "not clamped")
    a("--ada-target", type=float, default=None)
    a("--mirror", action="store_true", default=None, help="add x-flipped copies of the data")
    a("--seed", type=int, default=None)
    a("--monitor-kimg", type=float, default=None, help="mode-collapse monitor every N kimg (0 = off)")
    a("--monitor-per-class", type=int, default=None,
      help="class-conditional runs: fixed samples per class for the monitor's within-class diversity (default 4; "
           "0 = off)")
    a("--auto-countermeasures", action="store_true", default=None,
      help="on monitor warnings apply dropout / mbstd / higher D:G / more augmentation automatically")
    a("--d-dropout", type=float, default=None, help="dropout before D's last layer from the start")
    a("--precision", choices=PRECISIONS, default=None, help="bf16 (default) | fp16 (GradScaler) | fp32")
    a("--no-tf32", dest="tf32", action="store_false", default=None)
    a("--no-channels-last", dest="channels_last", action="store_false", default=None)
    a("--compile", action="store_true", default=None, help="torch.compile the forward passes (slow first start)")
    a("--compile-scope", choices=COMPILE_SCOPES, default=None,
      help="with --compile: full (default) also compiles G's no-grad pass of the D step and runs the augmentation "
           "inside D's compiled graphs (fewer kernel launches and host work per step); nets compiles the network "
           "passes only (the trainer before 2026-12-06)")
    a("--compile-cache", default=None, metavar="DIR",
      help="with --compile: load the portable compile cache for this GPU from DIR before the first compile and save "
           "it there after (torch.compiler.save_cache_artifacts): a fresh machine given the folder skips most of the "
           "minutes a cold compile takes (docs/training.md, \"Speed\")")
    a("--init-g", default=None, metavar="FILE",
      help="start a new run's G and G_ema from this exported generator (.safetensors with its .json: a G_ema "
           "snapshot or a studio model of the same network); D starts fresh, counters continue from its kimg")
    a("--freeze-g-kimg", type=float, default=None, metavar="N",
      help="train D alone for the run's first N kimg (G and G_ema fixed), so a fresh D catches up with a trained G "
           "(--init-g) before G learns from it")
    a("--init-d", default=None, metavar="FILE",
      help="with --init-g: D and ADA's p from a carried D state (a .safetensors.xz from train_default_model.py "
           "--carry-d) instead of a fresh D, so the run continues without training D alone first")
    a("--cbase", type=int, default=None, help="channel base of G and D (channels = min(cbase / res, cmax))")
    a("--cmax", type=int, default=None, help="most channels of any layer of G and D")
    a("--cond", default=None, metavar="KEY",
      help="class-conditional G and D (NVlabs --cond) on the per-image class indices under KEY of --labels; "
           "emoji64: group (10 Unicode groups) or class (98 subgroups)")
    a("--class-balance", type=float, default=None, metavar="ALPHA",
      help="with --cond: draw image i with probability proportional to n_c ** -ALPHA (n_c: the images of its "
           "class), for the real images and the generated images' classes alike, so a class's share of training "
           "is proportional to n_c ** (1 - ALPHA): 0 = the data's proportions (default), 0.5 = square-root "
           "sampling, 1 = every class equally often")
    a("--noisy-twins", type=float, default=None, metavar="WEIGHT",
      help="with --cond: NoisyTwins against class-wise mode collapse (every sample of a class alike): noise on G's "
           "class embedding, and a Barlow Twins loss of this weight on the w's of twin samples (same z and class, "
           "independent noise). 0 = off (default); the paper used 0.001-0.01")
    a("--noisy-twins-sigma", type=float, default=None, metavar="STD",
      help="std of the class-embedding noise of --noisy-twins (default 0.25; the embedding has unit second moment)")
    a("--noisy-twins-start-kimg", type=float, default=None, metavar="N",
      help="switch --noisy-twins on at this kimg (default 0; the paper starts it on a trained model)")
    a("--noisy-twins-beta", type=float, default=None, metavar="BETA",
      help="with --noisy-twins: scale each class's noise by 1 / its effective number of samples (1 - BETA^n) / "
           "(1 - BETA), normalised to a mean of 1, so rare classes get more (the paper's CIFAR10-LT: 0.99); "
           "default 0 = the same noise for every class")
    a("--labels", default=None, metavar="FILE",
      help="JSON with a list of class indices per image under the --cond key (and the class names under its "
           "plural), or NVlabs' dataset.json; without it, the data folder's or .zip's own dataset.json; "
           "emoji64's default: assets/datasets/emoji64_labels.json")
    a("--kernels", default=None,
      help="op formulations: auto (the measured fastest on CUDA: conv gradfix, folded up/down convs, separable "
           "FIR; the reference on the CPU), reference, or knob:choice pairs joined by '/', e.g. "
           "grad:gradfix/up:subpixel-fused/down:fused-s2d/fir:separable")
    a("--snapshot-ema", action="store_true", default=None,
      help="keep G_ema of every snapshot as fp16 safetensors in RUN/snapshots/ (for scripts/emoji_metrics.py)")
    a("--grad-checkpointing", action="store_true", default=None, help="trade compute for activation memory")
    a("--data-device", choices=("auto", "gpu", "host"), default=None)
    a("--no-dali", dest="dali", action="store_true",
      help="no effect (DALI decoding was removed; kept so old command lines still run)")
    a("--device", default=None, help="cuda, cuda:N or cpu (default: best available; per rank under torchrun)")
    a("--log-every", type=int, default=None, help="iterations between log lines")
    a("--snapshot-kimg", type=float, default=None)
    a("--snapshot-minutes", type=float, default=None)
    a("--no-progress", dest="progress", action="store_false", default=None)
    a("--bench", type=float, default=None, metavar="SECONDS",
      help="measure img/s of the plain fp32 eager configuration and of the fast one (SECONDS each) and exit")
    a("--bench-compile", action="store_true", help="also benchmark torch.compile in --bench")
    a("--export", default=None, metavar="RUN", help="export RUN's G_ema as fp16 safetensors (+ model card) and exit")
    a("--to", default=None, help="export destination stem (default assets/models/<preset>)")
    a("--snapshot", default=None, metavar="KIMG|FILE",
      help="with --export: export this G_ema snapshot of RUN (a kimg such as 3400, a name in RUN/snapshots, or a "
           "file) instead of the checkpoint's G_ema, e.g. the one the emoji metric scored best")
    return ap


_PASS_THROUGH = ("data", "kimg", "minutes", "reserve_seconds", "loss", "optimizer", "batch", "lr_g", "lr_d",
                 "d_steps", "r1_gamma", "gp_lambda", "pl_weight", "style_mixing", "ema_kimg", "aug", "aug_pipe",
                 "aug_p", "ada_max_p", "ada_target", "mirror", "seed", "monitor_kimg", "monitor_per_class", "auto_countermeasures", "d_dropout",
                 "precision", "tf32", "channels_last", "compile", "grad_checkpointing", "data_device",
                 "device", "log_every", "snapshot_kimg", "snapshot_minutes", "progress", "kernels", "snapshot_ema", "cbase", "cmax",
                 "cond", "labels", "compile_scope", "compile_cache", "init_g", "freeze_g_kimg", "init_d", "class_balance", "noisy_twins",
                 "noisy_twins_sigma", "noisy_twins_start_kimg", "noisy_twins_beta")


def retune_from_args(args: argparse.Namespace) -> dict | None:
    """The recipe settings given explicitly on the command line, when --retune asks for them."""
    if not getattr(args, "retune", False):
        return None
    from training.trainer import RESUME_RETUNABLE

    given = {k: getattr(args, k) for k in RESUME_RETUNABLE if getattr(args, k, None) is not None}
    if not given:
        raise InputError("--retune needs at least one recipe setting to change, e.g. --batch 256 --pl-weight 0")
    return given


def given_from_args(args: argparse.Namespace) -> set[str]:
    """The settings given explicitly on the command line (a resumed run takes these even when they
    equal the built-in default)."""
    return {k for k in _PASS_THROUGH if getattr(args, k, None) is not None}


def config_from_args(args: argparse.Namespace):
    overrides = {k: getattr(args, k) for k in _PASS_THROUGH}
    overrides["out"] = args.out or f"runs/{args.preset}"
    return build_config(args.preset, args.resolution, **overrides)


def main(argv: list[str] | None = None) -> int:
    t_start = time.time()
    args = build_parser().parse_args(argv)
    if args.dali:
        print("note: --no-dali has no effect any more: image folders are decoded once with Pillow and cached",
              file=sys.stderr)
    try:
        if args.snapshot is not None and not args.export:
            raise InputError("--snapshot picks what --export writes: give it with --export RUN "
                             "(e.g. --export runs/mine --snapshot 3400)")
        if args.export:
            from training.export import export_run

            paths = export_run(args.export, args.to, snapshot=args.snapshot)
            print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
            return 0
        cfg = config_from_args(args)
        if args.bench:
            from training.bench import run_bench

            report = run_bench(cfg, seconds=args.bench, with_compile=args.bench_compile)
            print(json.dumps(report, indent=1))
            return 0
        from training.trainer import train

        summary = train(cfg, resume=args.resume, t_start=t_start, retune=retune_from_args(args),
                        given=given_from_args(args))
        print(json.dumps(summary))
        return 0
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
