"""`python app.py eval`: FID, KID, IS and LPIPS of generated images, offline.

    python app.py eval --real data/faces --fake out/samples --metrics fid,kid,is \\
        --inception-weights weights/pt_inception-2015-12-05-6726825d.pth
    python app.py eval --real data/faces --model ffhq-256 --num 10000 --metrics fid,kid,is,lpips ...
    python app.py eval --real out/reference --fake out/fp16 --metrics lpips_paired ...   # toggle drift

The last line on stdout is one JSON object; --out also writes it to a file.
Errors are one line on stderr. Nothing is downloaded: the weights come from
the paths given, or from the folder named by ATELIER_METRIC_WEIGHTS.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cli.errors import cli_errors
from cli.options import add_optimization_args, flags_from_args
from core.errors import InputError
from core.types import GenerationRequest, Job, OptimizationFlags, StyleGANParams, SEED_MAX
from evaluation.metrics import (DEFAULT_INPUT_MODE, INPUT_MODES, KID_SEED, METRICS, FeatureStats, compute_metrics, parse_metrics,
                                real_statistics)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="app.py eval", description="Measure FID, KID, IS and LPIPS of generated images.")
    p.add_argument("--real", default=None,
                   help="real images: folder, .npy/.npz/.npy.xz array, or a stats .npz (mu, sigma)")
    p.add_argument("--fake", default=None, help="generated images: folder or .npy/.npz/.npy.xz array")
    p.add_argument("--model", default=None, help="StyleGAN model (catalogue id or file) to sample instead of --fake")
    p.add_argument("--num", type=int, default=None, help="images to generate with --model (or the first N of --fake)")
    p.add_argument("--num-real", type=int, default=None, help="use only the first N real images")
    p.add_argument("--metrics", default="fid,kid,is", help=f"comma list of {', '.join(METRICS)} (default fid,kid,is)")
    p.add_argument("--inception-weights", default=None, metavar="PATH",
                   help="pt_inception-2015-12-05-6726825d.pth (or a folder holding it)")
    p.add_argument("--inception-input", choices=INPUT_MODES, default=DEFAULT_INPUT_MODE,
                   help="which tool's way into the Inception to reproduce: tf = torch-fidelity / NVlabs StyleGAN / "
                        "TensorFlow FID (default), torchmetrics (its antialiased default), pytorch-fid, "
                        "clean = clean-fid (docs/metrics.md)")
    p.add_argument("--lpips-weights", default=None, metavar="PATH",
                   help="LPIPS heads (lpips v0.1 alex.pth / vgg.pth), or a folder with heads and backbone")
    p.add_argument("--lpips-backbone", default=None, metavar="PATH",
                   help="torchvision backbone weights (alexnet-owt-7be5be79.pth / vgg16-397923af.pth)")
    p.add_argument("--lpips-net", choices=["alex", "vgg"], default="alex")
    p.add_argument("--lpips-pairs", type=int, default=None, help="random pairs for LPIPS diversity (default N/2)")
    p.add_argument("--kid-subsets", type=int, default=100)
    p.add_argument("--kid-subset-size", type=int, default=1000)
    p.add_argument("--is-splits", type=int, default=10)
    p.add_argument("--value-range", choices=["-1,1", "0,1"], default="-1,1",
                   help="range of float arrays in .npy/.npz (generate --out x.npy writes -1,1)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.add_argument("--seed", type=int, default=KID_SEED,
                   help=f"seed of KID subsets (default {KID_SEED}: torch-fidelity's) and LPIPS pairs")
    p.add_argument("--cache-dir", default=None, help="where real-set statistics are cached (default: the studio cache)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write cached real-set statistics")
    p.add_argument("--save-real-stats", default=None, metavar="NPZ",
                   help="also write the real set's statistics (mu, sigma, features) to this .npz")
    p.add_argument("--out", default=None, help="write the JSON result to this file too")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    sg = p.add_argument_group("sampling with --model")
    sg.add_argument("--seed-start", type=int, default=0, help="first seed; images use seeds seed-start .. +num-1")
    sg.add_argument("--truncation", type=float, default=1.0, help="truncation ψ (1 = none, as for FID)")
    sg.add_argument("--truncation-centre", "--truncation-center", dest="truncation_centre", default="class",
                    metavar="class|global",
                    help="what ψ < 1 pulls towards: class = each class's own mean w (a class-conditional model's "
                         "default), global = the model's mean w over all classes (unconditional models: always)")
    sg.add_argument("--class", "--class-index", dest="class_index", default=None, metavar="CLASS",
                    help="class of a class-conditional model: an index or a name from the model's file "
                         "(e.g. face-smiling, animal-mammal); default: seed s draws class s %% classes")
    sg.add_argument("--gen-batch-size", type=int, default=16, help="images per generator call")
    add_optimization_args(p)
    return p


def model_sampler(services, a: argparse.Namespace, flags: OptimizationFlags):
    """A `sample(n) -> uint8 [n, 3, H, W]` that walks the seeds seed-start, seed-start+1, ..."""
    if services is None or getattr(services, "manager", None) is None:
        raise InputError("--model needs the studio's model manager; run through `python app.py eval`")
    StyleGANParams(seeds=(0,), truncation_centre=a.truncation_centre)     # a bad centre is refused before any work
    state = {"next": int(a.seed_start)}
    if not (0 <= state["next"] and state["next"] + int(a.num) - 1 <= SEED_MAX):
        raise InputError(f"--seed-start {a.seed_start} with --num {a.num} leaves the seed range 0..{SEED_MAX}")

    def sample(n: int) -> np.ndarray:
        seeds = tuple(range(state["next"], state["next"] + n))
        state["next"] += n
        params = StyleGANParams(seeds=seeds, truncation_psi=a.truncation, class_index=a.class_index,
                                truncation_centre=a.truncation_centre,
                                batch_size=min(n, int(a.gen_batch_size)))
        result = services.manager.generate(GenerationRequest("stylegan", a.model, params, flags, a.device), Job())
        if result.metadata:                 # the centre the model used (an unconditional one: always global)
            sample.truncation_centre = result.metadata[0].get("truncation_centre")
        return np.stack([np.asarray(im.convert("RGB")).transpose(2, 0, 1) for im in result.images])

    sample.truncation_centre = None
    return sample


@cli_errors
def main(argv: list[str], services=None) -> int:
    a = build_parser().parse_args(argv)
    names = parse_metrics(a.metrics)
    if (a.fake is None) == (a.model is None):
        raise InputError("give the generated images with exactly one of --fake PATH or --model MODEL --num N")
    if a.model is not None and not a.num:
        raise InputError("--model needs --num N, the number of images to generate")
    for flag in ("num", "num_real", "lpips_pairs", "kid_subsets", "kid_subset_size", "is_splits", "batch_size",
                 "gen_batch_size"):
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1; got {v}")
    value_range = (-1.0, 1.0) if a.value_range == "-1,1" else (0.0, 1.0)
    if a.no_cache:
        cache_dir = False
    elif a.cache_dir:
        cache_dir = Path(a.cache_dir)
    elif services is not None and getattr(services, "settings", None) is not None:
        cache_dir = services.settings.cache_dir / "metrics"
    else:
        cache_dir = None
    fake = model_sampler(services, a, flags_from_args(a)) if a.model is not None else a.fake
    progress = not a.quiet

    inception = None
    real = a.real
    if a.save_real_stats:
        if real is None:
            raise InputError("--save-real-stats needs --real")
        from evaluation.inception import InceptionFeatures

        inception = InceptionFeatures(a.inception_weights, device=a.device, batch_size=a.batch_size, progress=progress,
                                      input_mode=a.inception_input)
        stats, _ = real_statistics(real, inception, cache_dir, batch_size=a.batch_size, progress=progress,
                                   num=a.num_real)
        stats.save(a.save_real_stats)
        if "lpips_paired" not in names:
            real = stats                    # the metrics below reuse them instead of reading the images again

    result = compute_metrics(
        real, fake, names, num=a.num, num_real=a.num_real if not isinstance(real, FeatureStats) else None,
        inception_weights=a.inception_weights, lpips_weights=a.lpips_weights, lpips_backbone=a.lpips_backbone,
        lpips_net=a.lpips_net, device=a.device, batch_size=a.batch_size, kid_subsets=a.kid_subsets,
        kid_subset_size=a.kid_subset_size, is_splits=a.is_splits, lpips_pairs=a.lpips_pairs, seed=a.seed,
        input_mode=a.inception_input, cache_dir=cache_dir, value_range=value_range, progress=progress, inception=inception)
    result["real"] = a.real
    result["fake"] = a.fake if a.fake is not None else {"model": a.model, "seeds": [a.seed_start, a.seed_start + a.num - 1],
                                                         "truncation_psi": a.truncation, "class_index": a.class_index,
                                                         "truncation_centre": getattr(fake, "truncation_centre", None)}
    if a.save_real_stats:
        result["real_stats_saved"] = a.save_real_stats
    text = json.dumps(result, default=str)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)
    return 0
