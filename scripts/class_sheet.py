"""What each class of a class-conditional StyleGAN draws: one labelled panel per class, N seeds each.

    python3 scripts/class_sheet.py assets/models/emoji64.safetensors docs/images/emoji64_classes.png [--seeds 4 --cols 7]

Seeds 0..N-1 at psi = 0.7 (the studio's seed -> z rule), every class drawn with the same seeds, so a row of a
panel differs only by class. Truncation pulls towards each class's own mean w, as the studio does by default
(`--truncation-centre global`: towards the model's mean w over all classes; docs/images/emoji64_classes.png
was drawn with global before 2026-12-07, with class since). Panels are labelled with the last part of the class name the model's file records
("face-smiling"), or the index when it names none: the names are what `--class` and the studio's Class box take.

--agreement METRICS.json (from scripts/emoji_metrics.py on this model file): each label also gets the share of
samples the emoji classifier names as that class, and a bar under it (green: that share).

--beside OTHER (--classes LIST to pick classes): the same seeds of a second model of the same classes to the right
of each panel's first, so a candidate can be read against the shipped model class by class, inside each class too
(do its seeds draw different pictures?):

    python3 scripts/class_sheet.py CANDIDATE.safetensors sheet.png --beside assets/models/emoji64.safetensors \
        --classes 2,10,21,28,30,54,68,83,96 --seeds 6 --cols 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def agreement_by_class(path: Path, sha256: str, names: list[str]) -> dict[int, float]:
    """Class index -> class agreement (top-1 share) from an emoji_metrics JSON row scored on this very file."""
    import json

    from core.errors import InputError

    try:
        doc = json.loads(Path(path).read_text())
        rows = doc["snapshots"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path} is not a scripts/emoji_metrics.py result ({exc})") from None
    row = next((r for r in rows if r.get("sha256") == sha256), None)
    if row is None:
        raise InputError(f"{path} scores other model files (sha256 {', '.join(r.get('sha256', '?')[:12] for r in rows)}); "
                         f"this one is {sha256[:12]}: run scripts/emoji_metrics.py --generator on it")
    per = (row.get("agreement") or {}).get("per_class")
    if not per:
        raise InputError(f"{path} has no class agreement for this model (made before the metric had it, or its "
                         "classes are not the classifier's): run scripts/emoji_metrics.py again")
    where = {n: i for i, n in enumerate(names)}
    return {where[r["name"]]: float(r["top1"]) for r in per if r.get("name") in where}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a class-conditional generator (.safetensors / .pkl)")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--seeds", type=int, default=4, help="samples per class (seeds 0..N-1)")
    ap.add_argument("--cols", type=int, default=7, help="panels per row")
    ap.add_argument("--truncation", type=float, default=0.7)
    ap.add_argument("--truncation-centre", "--truncation-center", dest="truncation_centre", default="class",
                    choices=("class", "global"),
                    help="what psi pulls towards: each class's own mean w (default) or the global w_avg")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--agreement", type=Path, default=None,
                    help="scripts/emoji_metrics.py JSON of this model: label each class with its class agreement")
    ap.add_argument("--classes", default=None,
                    help="only these classes, by index or name, comma-separated (\"2,face-tongue,28\"); default all")
    ap.add_argument("--beside", default=None,
                    help="a second model of the same classes: each panel shows this model's seeds, then the other's "
                         "(a candidate beside the shipped model, for the ship rule's class-sheet part)")
    ap.add_argument("--colors", type=int, default=256,
                    help="palette size of the PNG (256: a quarter of the bytes, no visible change here; 0: full colour)")
    a = ap.parse_args(argv)

    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    from core.errors import InputError
    from models.common import resolve_class
    from models.stylegan import load_generator
    from pipelines.base import to_uint8_images
    from pipelines.stylegan import seed_to_z

    if a.seeds < 1 or a.cols < 1:
        raise InputError("--seeds and --cols must be at least 1")
    models = [load_generator(a.model, device=a.device)]
    if a.beside:
        models.append(load_generator(a.beside, device=a.device))
    nets = [m.G.float().eval() for m in models]
    G = nets[0]
    if not G.c_dim:
        raise InputError(f"{a.model} is unconditional: it has no classes to show")
    names = (((models[0].config or {}).get("metadata") or {}).get("classes") or {}).get("names") or []
    if a.beside:
        other = (((models[1].config or {}).get("metadata") or {}).get("classes") or {}).get("names") or []
        if nets[1].c_dim != G.c_dim or list(other) != list(names):
            raise InputError(f"--beside {a.beside} has other classes ({nets[1].c_dim}) than {a.model} ({G.c_dim}): "
                             "a side-by-side sheet compares two models of the same classes")
        if (nets[1].z_dim, nets[1].img_resolution) != (G.z_dim, G.img_resolution):
            raise InputError(f"--beside {a.beside} has another z size or resolution than {a.model}")
    labels = [str(names[k]).rsplit("/", 1)[-1] if k < len(names) else str(k) for k in range(G.c_dim)]
    classes = ([resolve_class(c.strip(), G.c_dim, names) for c in a.classes.split(",") if c.strip()]
               if a.classes else list(range(G.c_dim)))
    agree = agreement_by_class(a.agreement, models[0].sha256, names) if a.agreement else {}
    z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in range(a.seeds)])).to(a.device)
    res = G.img_resolution
    label_h, pad = 14, 6
    gap = 2 * pad if a.beside else 0          # between a model's seeds and the other's
    head = label_h + pad if a.beside else 0   # a title line naming the two models
    rows = -(-len(classes) // a.cols)
    pw, ph = len(models) * a.seeds * res + gap, res + label_h
    sheet = Image.new("RGB", (a.cols * (pw + pad) + pad, head + rows * (ph + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    if a.beside:
        left, right = Path(a.model), Path(a.beside)
        # two files of one name (a candidate and the shipped emoji64.safetensors): their folders tell them apart
        depth = 2 if left.name == right.name else 1
        left, right = ("/".join(p.parts[-depth:]) for p in (left, right))
        draw.text((pad, pad), f"left: {left}   right: {right}   (same seeds, psi {a.truncation:g})", fill=(40, 40, 40))
    with torch.no_grad():
        for i, k in enumerate(classes):
            c = torch.nn.functional.one_hot(torch.full((a.seeds,), k), G.c_dim).float().to(a.device)
            x0, y0 = pad + (i % a.cols) * (pw + pad), head + pad + (i // a.cols) * (ph + pad)
            share = agree.get(k)
            tail = f" {share:.0%}" if share is not None else ""
            draw.text((x0, y0), f"{k} {labels[k]}"[: pw // 6 - len(tail)] + tail, fill=(40, 40, 40))
            if share is not None:
                split = x0 + round(share * (a.seeds * res - 1))
                draw.rectangle((x0, y0 + label_h - 2, x0 + a.seeds * res - 1, y0 + label_h - 1), fill=(225, 80, 70))
                if split > x0:
                    draw.rectangle((x0, y0 + label_h - 2, split, y0 + label_h - 1), fill=(60, 170, 80))
            for m, (loaded, net) in enumerate(zip(models, nets)):
                centre = ({"truncation_centre": loaded.class_centres()([k] * a.seeds)}
                          if a.truncation_centre == "class" and a.truncation != 1 else {})
                imgs = to_uint8_images(net(z, c, truncation_psi=a.truncation, noise_mode="const", **centre).float().cpu())
                for j, im in enumerate(imgs):
                    sheet.paste(im.convert("RGB"), (x0 + m * (a.seeds * res + gap) + j * res, y0 + label_h))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if a.colors:
        sheet = sheet.quantize(colors=min(256, a.colors), method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    sheet.save(a.out, optimize=True)
    print(f"wrote {a.out}: {len(classes)} classes x {a.seeds} seeds{' x 2 models' if a.beside else ''}, "
          f"psi = {a.truncation} (centre: {a.truncation_centre})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
