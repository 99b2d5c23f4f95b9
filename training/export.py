"""Export a training run's G_ema for the studio: fp16 safetensors + JSON, model card, sample grid.

    python app.py train --export runs/emoji64 --to assets/models/emoji64

writes assets/models/emoji64.safetensors + .json (via models.stylegan.save_generator,
so the StyleGAN backend loads it directly), assets/models/emoji64.md (the model card)
and, with `grid_path`, an 8x8 grid of seeds 0-63 at psi = 0.7 rendered from the
exported fp16 weights with the same seed -> z rule as `app.py generate`
(np.random.RandomState(seed).randn(z_dim)).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import InputError
from models.common import seed_class_labels
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.dataset import image_grid, read_dataset_meta, to_uint8_hwc

MAX_SHIPPED_BYTES = 16 * 2**20


def _load_g_ema(run: Path) -> tuple[torch.nn.Module, dict]:
    from models.stylegan2 import load_state_strict
    from training.trainer import build_networks

    doc, tensors = ckpt.load_checkpoint(run)
    cfg = TrainConfig.from_dict(doc["config"])
    G, _ = build_networks(cfg)
    load_state_strict(G, tensors["G_ema"], "G_ema of the checkpoint")
    return G.eval().requires_grad_(False), doc


@torch.no_grad()
def render_seeds(G: torch.nn.Module, seeds: list[int], psi: float = 0.7, batch: int = 16) -> np.ndarray:
    """uint8 [N, R, R, 3] for `seeds`, z = RandomState(seed).randn(z_dim) as the studio does; a conditional G
    truncated towards each class's own mean w, the studio's default (models/class_centres.py)."""
    from models.class_centres import ClassCentres

    c_dim = int(getattr(G, "c_dim", 0))
    centres = ClassCentres(G.mapping) if c_dim and psi != 1 else None
    out = []
    for i in range(0, len(seeds), batch):
        part = seeds[i:i + batch]
        z = np.concatenate([np.random.RandomState(s).randn(1, G.z_dim) for s in part])
        c = seed_class_labels(c_dim, part)    # conditional: seed s draws class s % c_dim
        extra = {"truncation_centre": centres([s % c_dim for s in part])} if centres is not None else {}
        img = G(torch.from_numpy(z).float(), c, truncation_psi=psi, noise_mode="const", **extra)
        out.append(to_uint8_hwc(img))
    return np.concatenate(out)


def _monitor_summary(doc: dict) -> dict[str, Any]:
    hist = (doc.get("monitor") or {}).get("history") or []
    if not hist:
        return {}
    last = hist[-1]
    return {"kimg": last["kimg"], "diversity_vs_data": last["diversity"], "duplicate_rate": last["duplicate_rate"],
            **({"class_diversity_vs_data": last["class_diversity"]} if last.get("class_diversity") is not None else {}),
            "d_acc": last["d_acc"], "warnings_total": sum(len(h["warnings"]) for h in hist),
            "countermeasures": (doc.get("monitor") or {}).get("applied", [])}


def find_snapshot(run: Path, snapshot: str | Path) -> Path:
    """A G_ema snapshot of `run`: a file path, a file name in run/snapshots, or its kimg ("3400")."""
    from training.trainer import SNAPSHOT_DIR

    cand = Path(snapshot).expanduser()
    if cand.is_file():
        return cand
    folder = run / SNAPSHOT_DIR
    names = [folder / str(snapshot), folder / f"{snapshot}.safetensors"]
    try:
        names.append(folder / f"G_ema-{int(round(float(snapshot))):06d}kimg.safetensors")
    except ValueError:
        pass
    for f in names:
        if f.is_file():
            return f
    have = sorted(p.name for p in folder.glob("G_ema-*kimg.safetensors")) if folder.is_dir() else []
    raise InputError(f"no snapshot {snapshot!r} in {folder}: "
                     + (f"it holds {', '.join(have)} (pass a kimg such as {have[-1][6:12].lstrip('0') or '0'}, a "
                        "name, or a file path)" if have else "the run wrote no G_ema snapshots (--snapshot-ema, "
                        "--snapshot-kimg)"))


def snapshot_doc(run: Path, snap_meta: dict) -> dict:
    """The run's state.json as it stood at a snapshot's kimg, rebuilt from the run's log.jsonl.

    The recipe: retune records before the snapshot are applied ("to"), later ones undone ("from"),
    so the card is right whether state.json was saved before the snapshot (a run whose last
    checkpoint was lost) or after it. kimg, step and train time come from the snapshot itself; ADA's
    p from the last train record before it; the monitor history is cut at it."""
    from training.runs import LOG_FILE, LogTail

    doc = ckpt.read_state(run)
    kimg = float(snap_meta.get("kimg", doc.get("kimg", 0.0)))
    recs = LogTail(run / LOG_FILE).read()          # torn lines of a killed writer are skipped
    cfg = dict(doc["config"])
    retunes = [r for r in recs if r.get("kind") == "retune" and isinstance(r.get("changed"), dict)]
    # a retune at kimg K changes the training after K: a snapshot written at K was trained before it
    for r in reversed([r for r in retunes if r.get("kimg", 0.0) >= kimg - 1e-6]):
        cfg.update({k: v["from"] for k, v in r["changed"].items()})
    for r in [r for r in retunes if r.get("kimg", 0.0) < kimg - 1e-6]:
        cfg.update({k: v["to"] for k, v in r["changed"].items()})
    out = dict(doc, config=cfg, kimg=kimg)
    if snap_meta.get("step") is not None:
        out["step"] = snap_meta["step"]
    if snap_meta.get("train_seconds") is not None:
        out["train_seconds"] = snap_meta["train_seconds"]
    train = [r for r in recs if r.get("kind") == "train" and r.get("kimg", 0.0) <= kimg + 1e-6]
    if train and train[-1].get("aug_p") is not None:
        out["aug_p"] = train[-1]["aug_p"]
    out["pieces"] = 1 + sum(1 for r in recs if r.get("kind") == "end" and r.get("kimg", 0.0) < kimg - 1e-6)
    hist = [{k: r.get(k) for k in ("kimg", "diversity", "pairwise_distance", "duplicate_rate", "class_diversity",
                                   "classes_below_half", "d_acc", "d_acc_real", "d_acc_fake")}
            | {"warnings": r.get("warnings") or []}
            for r in recs if r.get("kind") == "monitor" and r.get("kimg", 0.0) <= kimg + 1e-6]
    if hist:
        out["monitor"] = dict(doc.get("monitor") or {}, history=hist)
    out["exported_snapshot"] = True
    return out


def exported_generator(path: str | Path):
    """(loaded generator, its weights in fp32, its progress {kimg, step, train_seconds}: None where unknown) of
    an exported generator or G_ema snapshot: what a run that starts from one (--init-g, a warm start) needs. A
    snapshot's metadata has the progress at the top; an exported model's has it under "training"."""
    from models.stylegan import load_generator

    loaded = load_generator(path, device="cpu")
    meta = loaded.config.get("metadata") or {}
    nested = meta.get("training") or {}
    progress = {k: meta.get(k, nested.get(k)) for k in ("kimg", "step", "train_seconds")}
    weights = {k: v.to(torch.float32) for k, v in loaded.G.state_dict().items()}
    return loaded, weights, progress


def _load_snapshot(run: Path, snapshot: str | Path) -> tuple[torch.nn.Module, dict]:
    from models.stylegan import load_generator

    path = find_snapshot(run, snapshot)
    loaded = load_generator(path, device="cpu")
    doc = snapshot_doc(run, loaded.config.get("metadata") or {})
    cfg = TrainConfig.from_dict(doc["config"])
    have = loaded.config.get("init_kwargs") or {}
    diff = sorted(k for k, v in cfg.g_kwargs.items() if k in have and have[k] != v)
    if loaded.arch != cfg.arch or have.get("img_resolution", cfg.resolution) != cfg.resolution or diff:
        raise InputError(f"{path.name} is not a snapshot of the run in {run}: its network differs from the run's "
                         f"config ({', '.join(diff) or 'architecture or resolution'}); pass the run folder it "
                         "came from")
    return loaded.G.eval().requires_grad_(False), doc


def export_run(run: str | Path, to: str | Path | None = None, grid_path: str | Path | None = None,
               psi: float = 0.7, description: str | None = None,
               max_bytes: int | None = None, snapshot: str | Path | None = None) -> dict[str, Path]:
    """Write the fp16 generator, its JSON, the model card and (optionally) the seeds 0-63 grid.

    `snapshot`: export that G_ema snapshot of the run (a kimg, a name in run/snapshots or a file)
    instead of the checkpoint's G_ema: the snapshot a metric picked, or the newest one of a run whose
    last checkpoint was lost. The card's recipe and monitor figures are the run's at that kimg.
    `max_bytes`: refuse a larger file (the bundled model's MAX_SHIPPED_BYTES); None = any size."""
    from models.stylegan import load_generator, save_generator

    run = Path(run)
    if snapshot is not None:
        G, doc = _load_snapshot(run, snapshot)
    else:
        G, doc = _load_g_ema(run)
    cfg = TrainConfig.from_dict(doc["config"])
    to = Path(to) if to is not None else Path("assets") / "models" / cfg.preset
    data_meta = read_dataset_meta(cfg.data) if cfg.data else {}
    license_info = data_meta.get("license", {})
    meta = {
        "description": description or f"StyleGAN2 trained by Atelier on {cfg.data} ({doc['dataset']['count']} images, "
                                      f"{cfg.resolution}px), {doc['kimg']:.0f} kimg",
        "license": license_info.get("images", "same as the training images"),
        "training": {"kimg": doc["kimg"], "train_seconds": round(doc.get("train_seconds", 0.0), 1),
                     "pieces": doc.get("pieces"), "batch": cfg.batch, "loss": cfg.loss,
                     "r1_gamma": cfg.r1_gamma_value(), "aug_p": doc.get("aug_p"), "preset": cfg.preset,
                     "device": doc.get("env", {}).get("device"), "params_G": doc.get("params", {}).get("G")},
        "monitor": _monitor_summary(doc),
        "recommended_truncation": psi,
    }
    if cfg.init_g:
        # a run started from another generator (--init-g): where G's first kimg came from
        meta["training"]["init_g"] = {"from": cfg.init_g, "freeze_g_kimg": cfg.freeze_g_kimg,
                                      "kimg": _init_kimg(run), "init_d": cfg.init_d or None}
    if doc.get("classes"):
        meta["classes"] = doc["classes"]        # {"key": "group", "names": [...]}: class index -> name
    if cfg.class_balance:
        meta["training"]["class_balance"] = cfg.class_balance
    if cfg.noisy_twins:
        meta["training"]["noisy_twins"] = {"weight": cfg.noisy_twins, "sigma": cfg.noisy_twins_sigma,
                                           "start_kimg": cfg.noisy_twins_start_kimg, "beta": cfg.noisy_twins_beta}
    weights = save_generator(G, to, cfg.arch, metadata=meta, dtype="fp16")
    size = weights.stat().st_size
    if max_bytes is not None and size > max_bytes:
        weights.unlink(missing_ok=True)
        weights.with_suffix(".json").unlink(missing_ok=True)
        raise InputError(f"the exported generator is {size / 2**20:.1f} MiB, over the {max_bytes / 2**20:.0f} MiB "
                         "budget for bundled models; train a smaller network (channel_base / channel_max)")
    paths = {"weights": weights, "config": weights.with_suffix(".json")}

    # Render from the file just written, as the studio will.
    loaded = load_generator(weights, device="cpu")
    Gl = loaded.G
    if grid_path is not None:
        from PIL import Image

        imgs = render_seeds(Gl, list(range(64)), psi=psi)
        grid_path = Path(grid_path)
        grid_path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image_grid(imgs, 8)).save(grid_path)
        paths["grid"] = grid_path
    card = to.with_suffix(".md")
    card.write_text(model_card(cfg, doc, meta, data_meta, size, grid_path, name=to.stem))
    paths["card"] = card
    return paths


def _init_kimg(run: Path) -> float | None:
    """The kimg of the generator an --init-g run started from (its log's init_g record), or None."""
    from training.runs import LogTail

    return next((r.get("kimg") for r in LogTail(run / "log.jsonl").read() if r.get("kind") == "init_g"), None)


def model_card(cfg: TrainConfig, doc: dict, meta: dict, data_meta: dict, size: int, grid_path,
               name: str = "model") -> str:
    t = meta["training"]
    mon = meta["monitor"]
    lic = data_meta.get("license", {})
    hours = (t["train_seconds"] or 0) / 3600
    lines = [
        f"# {name}: StyleGAN2 generator ({cfg.resolution}x{cfg.resolution})",
        "",
        meta["description"] + ".",
        "",
        "## Data",
        "",
        f"- Source: `{cfg.data}` ({doc['dataset']['count']} images, {cfg.resolution}x{cfg.resolution}"
        + (", x-flips added" if cfg.mirror else "") + ").",
    ]
    if data_meta:
        lines += [f"- Built by `scripts/build_emoji_dataset.py` from {data_meta.get('source', '')}; background "
                  f"{data_meta.get('background', '?')}; dropped glyphs: {data_meta.get('stats', {})}."]
    lines += [
        "",
        "## License",
        "",
        f"- Weights: {meta['license']} (a derivative of the training images)." if lic else
        "- Weights: follow the license of the training images.",
    ]
    if lic:
        lines += ["", "```", lic.get("text", ""), "```"]
    lines += [
        "",
        "## Training",
        "",
        f"- {t['kimg']:.0f} kimg (thousand real images shown to D), {hours:.2f} h of training "
        f"in {t['pieces']} piece(s) on {t['device']}.",
        f"- Batch {cfg.batch}, loss {cfg.loss} (R1 gamma {t['r1_gamma']:g}), Adam lr {cfg.lr_g:g}, "
        f"EMA {cfg.ema_kimg_value():g} kimg, ADA ({cfg.aug_pipe}) final p = {t['aug_p'] if t['aug_p'] is not None else 0:.3f}, "
        f"precision {cfg.precision}.",
        f"- Generator: {t['params_G'] / 1e6:.2f} M parameters; shipped as fp16 safetensors, {size / 2**20:.1f} MiB.",
    ]
    if t.get("init_g"):
        ig = t["init_g"]
        lines += [f"- G and G_ema started from `{ig['from']}`"
                  + (f" ({ig['kimg']:.0f} kimg, counted above)" if ig.get("kimg") is not None else "")
                  + (f"; D from the carried state `{ig['init_d']}` (`--init-d`)" if ig.get("init_d")
                     else "; D trained from scratch")
                  + (f", alone for its first {ig['freeze_g_kimg']:g} kimg" if ig.get("freeze_g_kimg") else "")
                  + " (`--init-g`)."]
    if doc.get("exported_snapshot"):
        lines += [f"- Exported from the run's G_ema snapshot at {t['kimg']:.0f} kimg (`--snapshot`); the recipe "
                  "above is the run's at that point (its retunes from log.jsonl applied)."]
    if cfg.class_balance:
        a = cfg.class_balance
        what = {0.5: " (square-root sampling)", 1.0: " (every class equally often)"}.get(a, "")
        lines += [f"- Class balance {a:g} (`--class-balance`): a training image of a class with n images was drawn "
                  f"with probability proportional to n^-{a:g}, so each class was trained in proportion to "
                  f"n^{1 - a:g}{what}, for real and generated images alike; the data's own proportions are "
                  "balance 0."]
    if cfg.noisy_twins:
        lines += [f"- NoisyTwins (`--noisy-twins {cfg.noisy_twins:g}`) from {cfg.noisy_twins_start_kimg:g} kimg: "
                  f"Gaussian noise of std {cfg.noisy_twins_sigma:g} on G's class embedding while training, and a "
                  "Barlow Twins loss on the w's of twin samples (same z and class, independent noise), against "
                  "class-wise mode collapse. Inference uses the embedding without noise."
                  + (f" Each class's noise was scaled by 1 / its effective number of samples (beta "
                     f"{cfg.noisy_twins_beta:g}, `--noisy-twins-beta`): rare classes got more." if cfg.noisy_twins_beta
                     else "")]
    lines += [f"- Network arguments: `{json.dumps(cfg.g_kwargs)}`."]
    names = (meta.get("classes") or {}).get("names") or []
    if names:
        lines += [
            "",
            "## Classes",
            "",
            f"- Class-conditional: {len(names)} classes, from the data set's per-image labels "
            f"(`{meta['classes'].get('key', 'class')}`). Choose one by index or by name (`--class-index 3`, "
            "`--class face-hand`; the studio's Class dropdown lists them by name and takes either); with none chosen, seed s is drawn "
            f"with class s % {len(names)}, so a seed range walks through the classes.",
            "- " + ", ".join(f"{i} {n}" for i, n in enumerate(names)) + ".",
        ]
    lines += [
        "",
        "## Mode-collapse monitor (last evaluation)",
        "",
    ]
    if mon:
        lines += [
            f"- kimg {mon['kimg']}: diversity {mon['diversity_vs_data']:.2f} of the data's (mean pairwise "
            f"distance in a fixed random-projection space), near-duplicate rate {mon['duplicate_rate']:.1%}, "
            f"D accuracy {mon['d_acc']:.1%}." if mon.get("d_acc") is not None else
            f"- kimg {mon['kimg']}: diversity {mon['diversity_vs_data']:.2f}, near-duplicate rate "
            f"{mon['duplicate_rate']:.1%}.",
            *([f"- Within-class diversity {mon['class_diversity_vs_data']:.2f} of the data's (fixed latents drawn in "
               f"every class, against each class's own images)."] if mon.get("class_diversity_vs_data") is not None
              else []),
            f"- Warnings over the whole run: {mon['warnings_total']}; counter-measures applied: "
            f"{', '.join(a['detail'] for a in mon['countermeasures']) or 'none'}.",
        ]
    else:
        lines += ["- (monitor was off)"]
    if grid_path is not None:
        shown = Path(grid_path)
        try:  # a repository-relative path reads the same on every machine
            shown = shown.resolve().relative_to(Path(__file__).resolve().parent.parent)
        except ValueError:
            pass
        centre = " (conditional: towards each class's own mean w, the studio's default)" if cfg.c_dim else ""
        lines += ["", "## Samples", "", f"Seeds 0-63, truncation psi = {meta['recommended_truncation']}{centre}: "
                  f"`{shown}`", "",
                  f"    python app.py generate --backend stylegan --seeds 0-63 --truncation "
                  f"{meta['recommended_truncation']} --out grid.png"]
    return "\n".join(lines) + "\n"
