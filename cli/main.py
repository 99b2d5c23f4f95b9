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
