"""scripts/ship_check.py: the runbook's ship rule, on the committed side-by-side scores of real GPU runs."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ship_check  # noqa: E402

# the 2026-12-07 sitting: a candidate at 4,429 kimg beside the shipped 3,507-kimg model, psi 0.7, 10,000 samples
RUN = ROOT / "docs/results/2026-12-07-e572d15-h100-emoji64-balance05-vs-shipped-psi07.json"
# the 2026-12-04 comparison predates class agreement (and its shipped model was unconditional)
OLD = ROOT / "docs/results/2026-12-04-f07b155-emoji64-cond2-vs-shipped-psi07.json"
SHIPPED = "assets/models/emoji64.safetensors"


def _load():
    return json.loads(RUN.read_text())


def _by_file(m):
    return {s["file"]: s for s in m["snapshots"]}


def _with_diversity(m, candidate: float, shipped: float, spread: float = 0.05):
    """Give both models a within-class diversity (scripts/emoji_metrics.py --per-class): per class, the given level
    plus the same small class-to-class wobble for both, so that only the level differs between them."""
    names = [r["name"] for r in m["snapshots"][0]["agreement"]["per_class"]]
    wobble = [spread * ((7 * i) % 5 - 2) / 2 for i in range(len(names))]
    for s in m["snapshots"]:
        level = shipped if s["file"] == SHIPPED else candidate
        per = [{"class": i, "name": n, "n": 16, "n_real": 10, "ratio": level + w}
               for i, (n, w) in enumerate(zip(names, wobble))]
        ratios = [r["ratio"] for r in per]
        s["within_class"] = {"per_class_samples": 16, "mean": sum(ratios) / len(ratios), "median": level,
                             "below_half": sum(r < 0.5 for r in ratios), "classes": len(per), "per_class": per}
    return m


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/ship_check.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_2026_12_07_candidate_is_not_shipped():
    m = _load()
    snaps = _by_file(m)
    old, new = snaps[SHIPPED], next(s for f, s in snaps.items() if f != SHIPPED)
    v = ship_check.verdict(m)
    assert v["shipped"]["file"] == SHIPPED and v["candidate"]["file"] == new["file"]
    assert v["candidate"]["kimg"] > v["shipped"]["kimg"]
    c = v["checks"]
    assert c["per_class_mean_up"]["candidate"] == new["agreement"]["balanced_top1"]
    assert c["per_class_mean_up"]["shipped"] == old["agreement"]["balanced_top1"]
    assert c["fd_within_slack"]["limit"] == pytest.approx(old["fd"] * 1.10)
    # the run got worse on both counts (docs/training.md, "The 2026-12-07 class-balance sitting")
    assert not c["per_class_mean_up"]["ok"] and not c["fd_within_slack"]["ok"]
    assert v["ship"] is False


def test_the_cli_says_do_not_ship_and_writes_the_verdict(tmp_path):
    out = tmp_path / "verdict.json"
    r = _cli(RUN, "--json", out)
    assert r.returncode == 1, r.stderr
    assert "DO NOT SHIP" in r.stdout and "per-class mean agreement" in r.stdout
    v = json.loads(out.read_text())
    assert v["ship"] is False
    assert set(v["checks"]) == {"per_class_mean_up", "fd_within_slack", "within_class_diversity_kept"}
    # scored before --per-class existed: the diversity check is unmeasured, which never ships
    assert v["checks"]["within_class_diversity_kept"] == {"ok": False, "measured": False,
                                                          "why": v["checks"]["within_class_diversity_kept"]["why"]}
    assert "not measured" in r.stdout and "--per-class 16" in r.stdout


def test_roles_swapped_the_better_model_ships(tmp_path):
    # the same two real scores with the roles exchanged: the 3,507-kimg model as the candidate against the
    # 4,429-kimg one as the shipped model beats it on both counts
    m = _load()
    for s in m["snapshots"]:
        s["file"] = "runs/x/emoji64.safetensors" if s["file"] == SHIPPED else SHIPPED
    p = tmp_path / "swapped.json"
    p.write_text(json.dumps(m))
    assert _cli(p).returncode == 1          # its within-class diversity was never measured
    p.write_text(json.dumps(_with_diversity(m, 0.9, 0.9)))
    r = _cli(p)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SHIP (numbers)" in r.stdout and "class sheet" in r.stdout
    assert "within-class diversity 0.900 vs 0.900" in r.stdout


def test_the_standard_error_follows_the_per_class_counts():
    m = _load()
    snaps = _by_file(m)
    old = snaps[SHIPPED]
    new = next(s for f, s in snaps.items() if f != SHIPPED)
    se = ship_check.balanced_gain_se(new["agreement"]["per_class"], old["agreement"]["per_class"])
    # by hand: binomial variances over each class's samples, both models, every class weighing 1/C
    var = sum(r["top1"] * (1 - r["top1"]) / r["n"]
              for r in new["agreement"]["per_class"] + old["agreement"]["per_class"])
    assert se == pytest.approx(var ** 0.5 / len(old["agreement"]["per_class"]))
    assert 0.001 < se < 0.05
    # four times the samples in every class: half the standard error
    quad = [dict(r, n=4 * r["n"]) for r in new["agreement"]["per_class"]], \
        [dict(r, n=4 * r["n"]) for r in old["agreement"]["per_class"]]
    assert ship_check.balanced_gain_se(*quad) == pytest.approx(se / 2)
    with pytest.raises(ship_check.VerdictError, match="different classes"):
        ship_check.balanced_gain_se(new["agreement"]["per_class"][:-1], old["agreement"]["per_class"])


def test_the_gain_must_clear_the_noise_and_fd_the_slack():
    m = _load()
    snaps = _by_file(m)
    old = snaps[SHIPPED]
    new = next(s for f, s in snaps.items() if f != SHIPPED)
    _with_diversity(m, 0.9, 0.9)
    se = ship_check.verdict(m)["checks"]["per_class_mean_up"]["se"]
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"] + 3 * se
    new["fd"] = old["fd"] * 1.05
    assert ship_check.verdict(copy.deepcopy(m))["ship"] is True
    assert ship_check.verdict(copy.deepcopy(m), fd_slack=0.02)["ship"] is False
    assert ship_check.verdict(copy.deepcopy(m), z=4)["ship"] is False
    new["fd"] = old["fd"] * 1.2
    assert ship_check.verdict(copy.deepcopy(m))["ship"] is False
    # a gain inside the noise is not enough by default, though it is "above" with --z 0
    new["fd"] = old["fd"]
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"] + se
    assert ship_check.verdict(copy.deepcopy(m))["checks"]["per_class_mean_up"]["ok"] is False
    assert ship_check.verdict(copy.deepcopy(m), z=0)["checks"]["per_class_mean_up"]["ok"] is True
    # equal is never above
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"]
    assert ship_check.verdict(m, z=0)["checks"]["per_class_mean_up"]["ok"] is False


def test_files_it_cannot_judge_get_a_clear_error(tmp_path):
    m = _load()
    one = copy.deepcopy(m)
    one["snapshots"] = one["snapshots"][:1]
    with pytest.raises(ship_check.VerdictError, match="exactly two"):
        ship_check.verdict(one)
    neither = copy.deepcopy(m)
    for s in neither["snapshots"]:
        s["file"] = "elsewhere/" + Path(s["file"]).name + ".x"
    with pytest.raises(ship_check.VerdictError, match="--shipped"):
        ship_check.verdict(neither)
    with pytest.raises(ship_check.VerdictError, match="fraction"):
        ship_check.verdict(m, fd_slack=10)
    with pytest.raises(ship_check.VerdictError, match="standard errors"):
        ship_check.verdict(m, z=-1)
    # a comparison without class agreement (the 2026-12-04 one): exit 2 with the reason
    r = _cli(OLD)
    assert r.returncode == 2 and "no class agreement" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = _cli(bad)
    assert r.returncode == 2 and "not JSON" in r.stderr
    r = _cli(tmp_path / "missing.json")
    assert r.returncode == 2 and "cannot read" in r.stderr
    # --shipped finds the shipped model wherever the call named it
    moved = copy.deepcopy(m)
    for s in moved["snapshots"]:
        if s["file"] == SHIPPED:
            s["file"] = "/root/repo/" + SHIPPED
    assert ship_check.verdict(moved)["shipped"]["kimg"] == _by_file(m)[SHIPPED]["kimg"]


def test_within_class_diversity_must_not_fall_beyond_the_noise():
    m = _with_diversity(_load(), 0.9, 0.9)
    snaps = _by_file(m)
    old = snaps[SHIPPED]
    new = next(s for f, s in snaps.items() if f != SHIPPED)
    se = ship_check.verdict(m)["checks"]["per_class_mean_up"]["se"]
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"] + 3 * se
    new["fd"] = old["fd"]
    assert ship_check.verdict(copy.deepcopy(m))["ship"] is True
    # the same class-to-class wobble in both: the paired differences have no spread, so any fall is beyond it
    worse = _with_diversity(copy.deepcopy(m), 0.88, 0.9)
    wc = ship_check.verdict(worse)["checks"]["within_class_diversity_kept"]
    assert wc["measured"] and wc["change"] == pytest.approx(-0.02) and wc["se"] == pytest.approx(0, abs=1e-12)
    assert wc["ok"] is False and ship_check.verdict(worse)["ship"] is False
    # a rise is always kept; with noise in the differences a small fall is within it
    assert ship_check.verdict(_with_diversity(copy.deepcopy(m), 0.95, 0.9))["ship"] is True
    noisy = _with_diversity(copy.deepcopy(m), 0.9, 0.9)
    cand = next(s for s in noisy["snapshots"] if s["file"] != SHIPPED)["within_class"]["per_class"]
    for i, r in enumerate(cand):
        r["ratio"] += 0.2 * (1 if i % 2 else -1) - 0.005
    wc = ship_check.verdict(noisy)["checks"]["within_class_diversity_kept"]
    assert wc["change"] == pytest.approx(-0.005 + (0.2 if len(cand) % 2 else 0) / len(cand))
    assert wc["se"] > 0.015 and wc["ok"] is True
    # classes scored apart cannot be paired
    apart = copy.deepcopy(m)
    for r in next(s for s in apart["snapshots"] if s["file"] != SHIPPED)["within_class"]["per_class"]:
        r["name"] = "other/" + r["name"]
    with pytest.raises(ship_check.VerdictError, match="fewer than 2 classes"):
        ship_check.verdict(apart)


def test_the_tie_rule_keeps_the_agreement_and_asks_more_of_fd(tmp_path):
    """--rule tie: for a candidate with its own D, as good as the shipped model is enough."""
    m = _with_diversity(_load(), 0.9, 0.9)
    snaps = _by_file(m)
    old = snaps[SHIPPED]
    new = next(s for f, s in snaps.items() if f != SHIPPED)
    se = ship_check.verdict(m)["checks"]["per_class_mean_up"]["se"]
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"] - se      # a fall inside the noise
    new["fd"] = old["fd"] * 1.04
    assert ship_check.verdict(copy.deepcopy(m))["ship"] is False                   # not better
    tie = ship_check.verdict(copy.deepcopy(m), rule="tie")
    assert tie["ship"] is True and tie["rule"] == "tie"
    assert set(tie["checks"]) == {"per_class_mean_kept", "fd_within_slack", "within_class_diversity_kept"}
    assert tie["checks"]["fd_within_slack"]["limit"] == pytest.approx(old["fd"] * 1.05)
    new["fd"] = old["fd"] * 1.07                  # within the better rule's 10 %, not the tie rule's 5 %
    assert ship_check.verdict(copy.deepcopy(m), rule="tie")["ship"] is False
    assert ship_check.verdict(copy.deepcopy(m), rule="tie", fd_slack=0.10)["ship"] is True
    new["fd"] = old["fd"]
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"] - 3 * se  # a fall beyond it
    assert ship_check.verdict(copy.deepcopy(m), rule="tie")["checks"]["per_class_mean_kept"]["ok"] is False
    # the diversity part holds in both rules
    new["agreement"]["balanced_top1"] = old["agreement"]["balanced_top1"]
    assert ship_check.verdict(_with_diversity(copy.deepcopy(m), 0.8, 0.9), rule="tie")["ship"] is False
    p = tmp_path / "tie.json"
    p.write_text(json.dumps(m))
    r = _cli(p, "--rule", "tie")
    assert r.returncode == 0 and "rule tie" in r.stdout and "not below by > 2 SE: yes" in r.stdout
    with pytest.raises(ship_check.VerdictError, match="--rule"):
        ship_check.verdict(m, rule="maybe")


# the 2026-12-07 from-scratch candidate (class balance 0.5, 3,277 kimg) beside the shipped model, scored on the CPU
# with the within-class diversity (n 2,000, 16 samples of every class, psi 0.7)
SCRATCH = ROOT / "docs/results/2026-12-07-b91d355-cpu-emoji64-scratch05-vs-shipped-psi07-within-class.json"


def test_the_scratch_candidate_passes_the_old_two_parts_and_fails_on_class_wise_collapse():
    m = json.loads(SCRATCH.read_text())
    v = ship_check.verdict(m)
    c = v["checks"]
    # what the rule asked before 2026-12-07 holds at these latents ...
    assert c["per_class_mean_up"]["ok"] and c["fd_within_slack"]["ok"]
    # ... but inside its classes the candidate draws fewer different pictures: beyond 2 standard errors
    wc = c["within_class_diversity_kept"]
    assert wc["measured"] and wc["classes"] == 97 and not wc["ok"]
    assert wc["change"] < -2 * wc["se"] < 0
    assert wc["below_half"]["candidate"] > wc["below_half"]["shipped"]
    assert v["ship"] is False and ship_check.verdict(m, rule="tie")["ship"] is False
