"""Subcommand dispatch for `python app.py SUBCOMMAND`."""
from __future__ import annotations

import argparse
import json
import sys

from cli.errors import cli_errors

SUBCOMMANDS = {
    "generate": "generate images (StyleGAN or diffusion)",
    "models": "list the model catalogue",
    "convert": "convert an NVlabs StyleGAN pickle to safetensors + JSON",
    "compress": "prune a StyleGAN2 generator's channels and distil it back (a smaller, faster model file)",
    "train": "train a StyleGAN on a folder or zip of images",
    "bench": "benchmark the optimization toggles",
    "eval": "quality metrics: FID, KID, IS, LPIPS (diversity and paired drift)",
    "serve": "start the studio UI (same as no subcommand)",
}


def usage() -> str:
    lines = ["usage: python app.py [SUBCOMMAND] [options]", "", "With no subcommand the studio UI starts.", "", "subcommands:"]
    lines += [f"  {k:<10} {v}" for k, v in SUBCOMMANDS.items()]
    return "\n".join(lines)


@cli_errors
def models_cmd(argv, services) -> int:
    p = argparse.ArgumentParser(prog="app.py models")
    p.add_argument("--backend", choices=["stylegan", "diffusion"], default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    entries = services.catalogue.entries(a.backend)
    if a.json:
        print(json.dumps([e.to_dict() for e in entries]))
    else:
        for e in entries:
            size = f"{e.size_bytes / 2**20:.1f} MiB" if e.size_bytes else "?"
            print(f"{e.backend:<9} {e.kind:<22} {e.source:<8} {size:>10}  {e.id}")
        if not entries:
            print("no models found; see README 'Models'")
    return 0


@cli_errors
def convert_cmd(argv, services) -> int:
    from pipelines.tools import convert_stylegan_pickle as convert_pickle

    p = argparse.ArgumentParser(prog="app.py convert", description="NVlabs .pkl -> Atelier .safetensors + .json")
    p.add_argument("src")
    p.add_argument("dst", help="output .safetensors path (a .json sidecar is written beside it)")
    p.add_argument("--fp16", action="store_true", help="store weights in fp16 (half the size)")
    a = p.parse_args(argv)
    out = convert_pickle(a.src, a.dst, dtype="fp16" if a.fp16 else None)
    print(json.dumps({"outputs": [str(x) for x in (out if isinstance(out, (list, tuple)) else [out])]}))
    return 0


@cli_errors
def compress_cmd(argv, services) -> int:
    from pipelines.tools import compress_stylegan

    p = argparse.ArgumentParser(prog="app.py compress",
                                description="structured channel pruning + distillation from the original model")
    p.add_argument("--model", required=True, help="StyleGAN2 model: Atelier .safetensors or an NVlabs .pkl")
    p.add_argument("--amount", type=float, required=True, help="fraction of synthesis channels to remove, e.g. 0.3")
    p.add_argument("--steps", type=int, default=1000, help="distillation steps (0 = prune only)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.add_argument("--fp16", action="store_true", help="store the weights in fp16 (half the file)")
    p.add_argument("--out", required=True, help="output .safetensors (a .json sidecar is written beside it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    bar = None
    if not a.quiet and a.steps > 0:
        from tqdm import tqdm

        bar = tqdm(total=a.steps, desc="distil", file=sys.stderr)

    def on_step(i, n, loss):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    try:
        report = compress_stylegan(a.model, a.out, a.amount, steps=a.steps, batch=a.batch, lr=a.lr, device=a.device,
                                   fp16=a.fp16, on_step=on_step)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(report))
    return 0


def dispatch(argv: list[str], services) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        from cli.generate import main
        return main(rest, services)
    if cmd == "models":
        return models_cmd(rest, services)
    if cmd == "convert":
        return convert_cmd(rest, services)
    if cmd == "compress":
        return compress_cmd(rest, services)
    if cmd == "train":
        from cli.train import main as train_main
        return train_main(rest, services)
    if cmd == "bench":
        from cli.bench import main as bench_main
        return bench_main(rest, services)
    if cmd == "eval":
        from cli.eval import main as eval_main
        return eval_main(rest, services)
    print(f"error: unknown subcommand {cmd!r}\n{usage()}", file=sys.stderr)
    return 2
