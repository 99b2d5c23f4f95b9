"""Should a freshly trained emoji model replace the shipped one? The runbook's ship rule, computed.

    python scripts/ship_check.py metrics-vs-shipped-psi0.7.json [--shipped assets/models/emoji64.safetensors]
                                 [--rule better|tie] [--fd-slack 0.10] [--z 2] [--json verdict.json]

The input is what `scripts/emoji_metrics.py --generator CANDIDATE SHIPPED --truncation 0.7` wrote (the file
`scripts/h200_train.sh finish` brings back as `metrics-vs-shipped-psi0.7.json`): two models scored on the same
latents in one call. The rule (docs/gpu-runbook.md §1) has two numeric parts, both required:

- the per-class mean class agreement (`balanced_top1`: every class weighs the same) is above the shipped
  model's by more than `--z` (default 2) standard errors of the difference: the small classes, where the shipped
  model lags, get better, and not by the luck of a few samples (a class of 6 images gets ~15 of 10,000 samples,
  so one class's top-1 moves by 0.07 a sample; the standard error, from each class's count and top-1 as
  independent binomials, is about 0.006 at 10,000 samples);
- the Fréchet distance is at most `--fd-slack` (default 10 %) above the shipped model's: the big classes,
  which FD weighs most, do not pay too much for it;
- the within-class diversity (emoji_metrics.py `--per-class`: each class's samples spread against the data's own
  images of that class, averaged over classes) is not below the shipped model's by more than `--z` standard errors
  of the per-class differences: no class-wise mode collapse. Added after the 2026-12-07 from-scratch candidate
  passed the first part and missed the second by 0.6 % while drawing one picture per class in many classes
  (docs/training.md, "The 2026-12-07 from-scratch sitting"); FD and the agreement cannot see that. A file
  scored without `--per-class` leaves it unmeasured, and an unmeasured check does not ship.

`--rule tie` asks less of the agreement and more of FD: the per-class mean may not fall by more than `--z`
standard errors (instead of having to rise by them), FD may be at most 5 % worse (`--fd-slack` overrides), and the
within-class diversity is kept as above. It is for a candidate that comes with its own D
(`emoji64-D.safetensors.xz` from `h200_train.sh finish`): a model as good as the shipped one that can be continued
with the D it trained against is worth shipping, because the shipped one cannot (its D was never kept), and every
continuation without the G's own D made the model worse (docs/training.md, "The 2026-12-07 class-balance sitting").

The last part, that the class sheet (scripts/class_sheet.py) reads better, is a person's call: the script
says so and leaves it to them. Exit status: 0 when the numeric parts hold, 1 when one fails or is unmeasured,
2 when the file cannot be judged (not two models, no agreement, no shipped model in it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_SHIPPED = "assets/models/emoji64.safetensors"


class VerdictError(ValueError):
    """The metrics file cannot be judged; the message says why and what to run instead."""


def _is_shipped(entry: dict, shipped: str) -> bool:
    f = str(entry.get("file", "")).replace("\\", "/")
    s = shipped.replace("\\", "/")
    return f == s or f.endswith("/" + s)


def balanced_gain_se(new_classes: list[dict], old_classes: list[dict]) -> float:
    """Standard error of the difference of two per-class means of top-1: each class's top-1 a binomial share of
    its n samples, the two models independent (they share latents and classes, which if anything makes the
    true error smaller), every class weighing 1/C as in `balanced_top1`."""
    if len(new_classes) != len(old_classes):
        raise VerdictError(f"the two models were scored on different classes ({len(new_classes)} and "
                           f"{len(old_classes)}): score them in one emoji_metrics.py call")
    var = 0.0
    for a, b in zip(new_classes, old_classes):
        if a.get("name") != b.get("name"):
            raise VerdictError(f"the two models' classes differ ({a.get('name')!r} against {b.get('name')!r}): "
                               "score them in one emoji_metrics.py call")
        for r in (a, b):
            n = int(r.get("n") or 0)
            if n <= 0:
                raise VerdictError(f"class {r.get('name')!r} has no samples: score with more samples (--n)")
            var += r["top1"] * (1 - r["top1"]) / n
    return var ** 0.5 / len(new_classes)


def diversity_check(new: dict, old: dict, z: float) -> dict:
    """The within-class diversity part: the candidate's mean ratio may sit below the shipped model's by at most z
    standard errors of the mean of the per-class differences (the same classes, paired by name)."""
    a, b = new.get("within_class"), old.get("within_class")
    if not a or not b:
        missing = ", ".join(str(s.get("file")) for s, w in ((new, a), (old, b)) if not w)
        return {"ok": False, "measured": False,
                "why": f"no within-class diversity for {missing}: score both with scripts/emoji_metrics.py "
                       "--per-class 16 (the default since 2026-12-07)"}
    pa = {r["name"]: r["ratio"] for r in a["per_class"]}
    pb = {r["name"]: r["ratio"] for r in b["per_class"]}
    common = sorted(set(pa) & set(pb))
    if len(common) < 2:
        raise VerdictError("the two models share fewer than 2 classes with a within-class diversity: score them in "
                           "one emoji_metrics.py call")
    d = [pa[c] - pb[c] for c in common]
    mean_d = sum(d) / len(d)
    se = (sum((x - mean_d) ** 2 for x in d) / (len(d) - 1)) ** 0.5 / len(d) ** 0.5
    return {"ok": mean_d >= -z * se, "measured": True, "candidate": a["mean"], "shipped": b["mean"],
            "change": mean_d, "se": se, "z": z, "classes": len(common),
            "below_half": {"candidate": a["below_half"], "shipped": b["below_half"]}}


RULES = ("better", "tie")
FD_SLACK = {"better": 0.10, "tie": 0.05}


def verdict(metrics: dict, shipped: str = DEFAULT_SHIPPED, fd_slack: float | None = None, z: float = 2.0,
            rule: str = "better") -> dict:
    """The ship rule on one emoji_metrics.py result holding the candidate and the shipped model. rule "better": the
    per-class mean must rise beyond the noise; "tie": it may not fall beyond it, and FD gets less slack."""
    if rule not in RULES:
        raise VerdictError(f"--rule must be one of {', '.join(RULES)}; got {rule!r}")
    fd_slack = FD_SLACK[rule] if fd_slack is None else fd_slack
    if not 0 <= fd_slack < 1:
        raise VerdictError(f"--fd-slack is a fraction in [0, 1), e.g. 0.10 for 10 %; got {fd_slack}")
    if not 0 <= z <= 10:
        raise VerdictError(f"--z is a number of standard errors in [0, 10], e.g. 2; got {z}")
    snaps = metrics.get("snapshots")
    if not isinstance(snaps, list) or len(snaps) != 2:
        n = len(snaps) if isinstance(snaps, list) else 0
        raise VerdictError(f"the file scores {n} model(s); the rule compares exactly two: run "
                           f"`scripts/emoji_metrics.py --generator CANDIDATE {shipped} --truncation 0.7`")
    ship = [s for s in snaps if _is_shipped(s, shipped)]
    if len(ship) != 1:
        files = ", ".join(str(s.get("file")) for s in snaps)
        raise VerdictError(f"exactly one of the two models must be the shipped {shipped} (give --shipped if it "
                           f"lives elsewhere); the file has {files}")
    old = ship[0]
    new = snaps[0] if snaps[1] is old else snaps[1]
    for s in (new, old):
        if not isinstance(s.get("agreement"), dict) or "balanced_top1" not in s["agreement"] \
                or not isinstance(s["agreement"].get("per_class"), list):
            raise VerdictError(f"{s.get('file')} has no class agreement: the rule is for class-conditional models, "
                               "scored by an emoji_metrics.py that reports it")
        if not isinstance(s.get("fd"), (int, float)):
            raise VerdictError(f"{s.get('file')} has no FD")
    bal_new, bal_old = new["agreement"]["balanced_top1"], old["agreement"]["balanced_top1"]
    fd_new, fd_old = float(new["fd"]), float(old["fd"])
    fd_limit = fd_old * (1 + fd_slack)
    se = balanced_gain_se(new["agreement"]["per_class"], old["agreement"]["per_class"])
    gain = bal_new - bal_old
    checks = {
        "per_class_mean_up": {"ok": gain > max(z * se, 0.0), "candidate": bal_new, "shipped": bal_old,
                              "gain": gain, "se": se, "z": z},
    } if rule == "better" else {
        "per_class_mean_kept": {"ok": gain >= -z * se, "candidate": bal_new, "shipped": bal_old,
                                "gain": gain, "se": se, "z": z},
    }
    checks |= {
        "fd_within_slack": {"ok": fd_new <= fd_limit, "candidate": fd_new, "shipped": fd_old, "limit": fd_limit},
        "within_class_diversity_kept": diversity_check(new, old, z),
    }
    return {
        "rule": rule,
        "truncation": metrics.get("truncation"),
        "n": metrics.get("n"),
        "candidate": {"file": new.get("file"), "kimg": new.get("kimg")},
        "shipped": {"file": old.get("file"), "kimg": old.get("kimg")},
        "checks": checks,
        "also_shown": {k: {"candidate": _figure(new, k), "shipped": _figure(old, k)}
                       for k in ("precision", "recall", "class_top1")},
        "ship": all(c["ok"] for c in checks.values()),
        "still_to_judge": "the class sheet (scripts/class_sheet.py CANDIDATE sheet.png) must read better too",
    }


def _figure(entry: dict, key: str):
    """A model's figure from its emoji_metrics.py entry (class top-1 sits under its agreement)."""
    return entry["agreement"].get(key) if key == "class_top1" else entry.get(key)


def _mark(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(v: dict) -> str:
    tie = v.get("rule") == "tie"
    up = v["checks"]["per_class_mean_kept" if tie else "per_class_mean_up"]
    fd = v["checks"]["fd_within_slack"]
    wc = v["checks"]["within_class_diversity_kept"]
    if wc["measured"]:
        wc_line = (f"  within-class diversity {wc['candidate']:.3f} vs {wc['shipped']:.3f} (change {wc['change']:+.3f} "
                   f"over {wc['classes']} classes, standard error {wc['se']:.3f}; classes below half the data's: "
                   f"{wc['below_half']['candidate']} vs {wc['below_half']['shipped']})  kept within {wc['z']:g} SE: "
                   f"{_mark(wc['ok'])}")
    else:
        wc_line = f"  within-class diversity: not measured ({wc['why']}): NO"

    lines = [
        f"rule {v.get('rule', 'better')}: candidate {v['candidate']['file']} ({v['candidate']['kimg']} kimg) against shipped "
        f"{v['shipped']['file']} ({v['shipped']['kimg']} kimg), truncation {v['truncation']}, n {v['n']}",
        f"  per-class mean agreement {up['candidate']:.3f} vs {up['shipped']:.3f} (gain {up['gain']:+.3f}, "
        f"standard error {up['se']:.3f})  " + (f"not below by > {up['z']:g} SE" if tie else f"above by > {up['z']:g} SE")
        + f": {_mark(up['ok'])}",
        f"  FD {fd['candidate']:.3f} vs {fd['shipped']:.3f} (limit {fd['limit']:.3f})  within: {_mark(fd['ok'])}",
        wc_line,
        "  " + ", ".join(f"{k} {d['candidate']:.3f} vs {d['shipped']:.3f}" for k, d in v["also_shown"].items()
                         if isinstance(d["candidate"], (int, float)) and isinstance(d["shipped"], (int, float))),
        ("SHIP (numbers): " + v["still_to_judge"]) if v["ship"] else "DO NOT SHIP: the shipped model stays",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", type=Path, help="emoji_metrics.py JSON with the candidate and the shipped model")
    ap.add_argument("--shipped", default=DEFAULT_SHIPPED, help="the shipped model's path as the JSON names it")
    ap.add_argument("--rule", choices=RULES, default="better",
                    help="better: the per-class mean must rise beyond the noise (default); tie: it may not fall beyond "
                         "it and FD may be 5 %% worse, for a candidate that brings its own D")
    ap.add_argument("--fd-slack", type=float, default=None,
                    help="how much worse FD may be, as a fraction (default 0.10 for better, 0.05 for tie)")
    ap.add_argument("--z", type=float, default=2.0,
                    help="how many standard errors the per-class mean must gain by (0: any gain), and the "
                         "within-class diversity may fall by")
    ap.add_argument("--json", type=Path, default=None, help="also write the verdict here")
    a = ap.parse_args(argv)
    try:
        metrics = json.loads(a.metrics.read_text())
    except OSError as e:
        print(f"error: cannot read {a.metrics}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {a.metrics} is not JSON ({e}); give the file emoji_metrics.py --out wrote", file=sys.stderr)
        return 2
    try:
        v = verdict(metrics, a.shipped, a.fd_slack, a.z, a.rule)
    except VerdictError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(v))
    if a.json:
        a.json.write_text(json.dumps(v, indent=1) + "\n")
    return 0 if v["ship"] else 1


if __name__ == "__main__":
    sys.exit(main())
