"""`python app.py generate`: one request through the same services as the UI.

The last line on stdout is one JSON object (outputs, per-stage latency, peak
memory, device, dtype, optimization report); errors are one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from cli.errors import cli_errors
from cli.options import add_optimization_args, flags_from_args, positive_int
from core.errors import InputError
from core.pnginfo import read_png_params, save_png
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags, StyleGANParams, parse_seeds
from pipelines.base import image_grid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="app.py generate", description="Generate images with a StyleGAN or diffusion model.")
    p.add_argument("--backend", choices=["stylegan", "diffusion"], default=None,
                   help="default: stylegan, or what --from-png says")
    p.add_argument("--model", default=None, help="catalogue id, file/folder path, or (diffusion) a Hugging Face id")
    p.add_argument("--out", default=None, help=".png (images with parameters embedded) or .npy (raw float32 [N, C, H, W])")
    p.add_argument("--from-png", default=None, metavar="FILE", help="reproduce the image whose parameters FILE carries")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: best available)")
    p.add_argument("--no-grid", action="store_true", help="with several images and a .png --out, write one file per image")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--compare", action="store_true",
                   help="also run the fp32 reference (every toggle off) on the same seeds and report speed, memory "
                        "and drift (PSNR/SSIM) side by side; --out gets the optimized images, plus *-reference.png and "
                        "*-difference.png")
    sg = p.add_argument_group("stylegan")
    sg.add_argument("--seed", type=str, default=None, help="one seed (0..2^32-1)")
    sg.add_argument("--seeds", type=str, default=None, help="seed list/ranges, e.g. 0-7 or 1,5,9")
    sg.add_argument("--truncation", type=float, default=1.0, help="truncation ψ (1 = none)")
    sg.add_argument("--truncation-cutoff", type=int, default=None)
    sg.add_argument("--truncation-centre", "--truncation-center", dest="truncation_centre", default=None,
                    metavar="class|global",
                    help="what ψ pulls w towards: class = the class's own mean w (the default for a class-conditional "
                         "model), global = the model's running mean w_avg over all classes (NVlabs' truncation; "
                         "what an unconditional model always uses)")
    sg.add_argument("--noise-mode", choices=["const", "random", "none"], default="const")
    sg.add_argument("--class", "--class-index", dest="class_index", default=None, metavar="CLASS",
                    help="class of a class-conditional model: an index or a name from the model's file "
                         "(e.g. face-smiling, animal-mammal); default: seed s draws class s %% classes")
    sg.add_argument("--batch-size", type=positive_int, default=None,
                    help="images per forward pass (at least 1; default: 8 for StyleGAN, 1 for diffusion)")
    df = p.add_argument_group("diffusion")
    df.add_argument("--prompt", default=None)
    df.add_argument("--negative-prompt", default="")
    df.add_argument("--init-image", default=None)
    df.add_argument("--strength", type=float, default=0.75)
    df.add_argument("--steps", type=int, default=None)
    df.add_argument("--guidance", type=float, default=None)
    df.add_argument("--width", type=int, default=None)
    df.add_argument("--height", type=int, default=None)
    df.add_argument("--scheduler", default=None)
    add_optimization_args(p)
    return p


def _request_from_png(path: str, a: argparse.Namespace, flags: OptimizationFlags) -> GenerationRequest:
    meta = read_png_params(path)
    backend = "diffusion" if meta.get("source") == "a1111" else meta.get("backend")
    saved_flags = OptimizationFlags.from_dict(meta.get("flags")) if meta.get("flags") else flags
    if backend == "stylegan":
        seeds = meta.get("seeds") or [meta.get("seed", 0)]
        params = StyleGANParams(seeds=tuple(int(s) for s in seeds), truncation_psi=float(meta.get("truncation_psi", 1.0)),
                                truncation_cutoff=meta.get("truncation_cutoff"), noise_mode=meta.get("noise_mode", "const"),
                                class_index=meta.get("class_index"),
                                # an image saved before the centre was recorded was truncated towards w_avg
                                truncation_centre=a.truncation_centre or meta.get("truncation_centre") or "global")
    elif backend == "diffusion":
        from pipelines.diffusion import params_from_png

        kw = params_from_png(meta)
        kw.pop("model_hash", None)
        model = kw.pop("model", None)
        if meta.get("seeds"):
            kw["seed"] = int(meta["seeds"][0])
            kw["batch_size"] = len(meta["seeds"])
        params = DiffusionParams(**{k: v for k, v in kw.items() if k in DiffusionParams.__dataclass_fields__})
        return GenerationRequest("diffusion", a.model or model, params, saved_flags, a.device)
    else:
        raise InputError(f"{path}: unknown backend {backend!r} in its parameters")
    return GenerationRequest(backend, a.model or meta.get("model"), params, saved_flags, a.device)


def _request_from_args(a: argparse.Namespace, flags: OptimizationFlags) -> GenerationRequest:
    backend = a.backend or "stylegan"
    if backend == "stylegan":
        if a.seed is not None and a.seeds is not None:
            raise InputError("give either --seed or --seeds, not both")
        seeds = parse_seeds(a.seeds if a.seeds is not None else (a.seed if a.seed is not None else "0"))
        params = StyleGANParams(seeds=seeds, truncation_psi=a.truncation, truncation_cutoff=a.truncation_cutoff,
                                noise_mode=a.noise_mode, class_index=a.class_index,
                                batch_size=8 if a.batch_size is None else a.batch_size,
                                truncation_centre="class" if a.truncation_centre is None else a.truncation_centre)
    else:
        if a.prompt is None:
            raise InputError("the diffusion backend needs --prompt TEXT")
        kw = dict(prompt=a.prompt, negative_prompt=a.negative_prompt, seed=a.seed if a.seed is not None else 0,
                  init_image=a.init_image, strength=a.strength, batch_size=1 if a.batch_size is None else a.batch_size)
        for name in ("steps", "guidance", "width", "height", "scheduler"):
            if getattr(a, name) is not None:
                kw[name] = getattr(a, name)
        params = DiffusionParams(**kw)
    return GenerationRequest(backend, a.model, params, flags, a.device)


def _progress(quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    bar = {"t": None}

    def on_progress(ev):
        if bar["t"] is None or bar["t"].total != ev.total:
            if bar["t"] is not None:
                bar["t"].close()
            bar["t"] = tqdm(total=ev.total, desc=ev.stage, file=sys.stderr, leave=False)
        bar["t"].n = ev.step
        bar["t"].refresh()
        if ev.step >= ev.total:
            bar["t"].close()
            bar["t"] = None
    return on_progress


def write_outputs(result, out: str, request: GenerationRequest, no_grid: bool = False) -> list[str]:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".npy":
        np.save(path, result.raw.astype(np.float32))
        return [str(path)]
    if path.suffix.lower() != ".png":
        raise InputError(f"--out must end in .png or .npy, not {path.suffix or '(none)'}")
    metas = result.metadata or [{}] * len(result.images)
    if len(result.images) == 1:
        return [str(save_png(result.images[0], path, {**metas[0], "optimizations": result.optimizations}))]
    if no_grid:
        outs = []
        for im, m in zip(result.images, metas):
            tag = f"s{m.get('seed', len(outs))}" + (f"-{len(outs)}" if request.backend == "diffusion" else "")
            outs.append(str(save_png(im, path.with_name(f"{path.stem}-{tag}.png"), {**m, "optimizations": result.optimizations})))
        return outs
    grid = image_grid(result.images)
    meta = dict(metas[0])
    meta.pop("seed", None)
    meta["seeds"] = [m.get("seed") for m in metas]
    meta["grid"] = True
    return [str(save_png(grid, path, {**meta, "optimizations": result.optimizations}))]


@cli_errors
def main(argv: list[str], services) -> int:
    a = build_parser().parse_args(argv)
    if a.backend == "diffusion" or a.from_png:
        from pipelines.tools import quiet_third_party_output

        quiet_third_party_output()
    flags = flags_from_args(a)
    request = _request_from_png(a.from_png, a, flags) if a.from_png else _request_from_args(a, flags)
    out = a.out
    if out is None:
        out = str(services.settings.output_dir / f"{request.backend}-{time.strftime('%Y%m%d-%H%M%S')}.png")
    if Path(out).suffix.lower() not in (".png", ".npy"):
        raise InputError(f"--out must end in .png or .npy, not {Path(out).suffix or '(none)'}")
    job = Job(on_progress=_progress(a.quiet))
    if a.compare:
        return _compare(services, request, job, out, a.no_grid)
    result = services.manager.generate(request, job)
    outputs = write_outputs(result, out, request, a.no_grid)
    summary = {
        "outputs": outputs,
        "backend": request.backend,
        "model": (result.metadata[0].get("model") if result.metadata else request.model),
        "n_images": len(result.images),
        "latency_ms": {k: round(v, 3) for k, v in result.timings_ms.items()},
        "total_ms": round(sum(result.timings_ms.values()), 3),
        "peak_memory_bytes": result.peak_memory_bytes,
        "peak_memory_kind": "cuda-allocator" if result.device.startswith("cuda") else "cpu-rss",
        "device": result.device,
        "dtype": result.dtype,
        "optimizations": result.optimizations,
        "notes": result.notes,
        "cancelled": result.cancelled,
    }
    print(json.dumps(summary, default=str))
    return 0


def _compare(services, request: GenerationRequest, job: Job, out: str, no_grid: bool) -> int:
    """`generate --compare`: the fp32 reference and the request's toggles, side by side (JSON)."""
    from PIL import Image

    from evaluation.compare import comparison_json, run_comparison

    if Path(out).suffix.lower() != ".png":
        raise InputError("--compare writes images: give --out a .png path")
    c = run_comparison(services.manager, request, job)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    outputs = []
    for side, target in ((c.candidate, path), (c.reference, path.with_name(f"{path.stem}-reference.png"))):
        grid = side.images[0] if len(side.images) == 1 or no_grid else image_grid(side.images)
        outputs.append(str(save_png(grid, target, {"backend": request.backend, "flags": side.flags.to_dict(),
                                                   "optimizations": side.optimizations})))
    diff = path.with_name(f"{path.stem}-difference.png")
    Image.fromarray(c.heat).save(diff)
    outputs.append(str(diff))
    print(json.dumps({"outputs": outputs, "backend": request.backend, "compare": comparison_json(c)}, default=str))
    return 0
