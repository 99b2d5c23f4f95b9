"""The benchmark report: JSON-lines rows of one or more `bench` runs merged into one JSON
file, a markdown section (tables, targets, what limits each missed target) and one PNG
plot per workload (latency and peak VRAM per configuration).

Runs are cut into pieces to fit a GPU lease; the report puts them back together. For each
(workload, batch, configuration) the latest successful result wins; without one, the latest
result of any kind; a case that started but never wrote a result reads "did not finish".

Only the standard library here (plus matplotlib for the plots, optional), so a report can
be rebuilt anywhere from the committed JSON lines.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from core.errors import InputError, OptionalDependencyError

START_MARK = "<!-- bench:results:start -->"
END_MARK = "<!-- bench:results:end -->"
STYLEGAN_PSNR_BUDGET_DB = 35.0     # fp16/bf16 StyleGAN configurations against fp32 (the drift budget)


# ==========================================================================================================
# Loading and merging
# ==========================================================================================================

def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no benchmark results at {p}: pass the bench.jsonl files that `bench` wrote")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue          # a line cut short when a run was killed
        if isinstance(row, dict) and "type" in row:
            row["_source"] = f"{p.name}:{n}"
            rows.append(row)
    return rows


def num(x: Any) -> float | None:
    """A number from a row value ('inf' / 'nan' are how non-finite floats travel in the JSON lines)."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


@dataclass
class Merged:
    runs: dict[str, dict] = field(default_factory=dict)
    workloads: dict[str, dict] = field(default_factory=dict)
    results: dict[tuple[str, int, str], dict] = field(default_factory=dict)   # (workload, batch, config) -> row
    order: dict[str, list[str]] = field(default_factory=dict)                 # workload -> configs, first-seen order
    starts: dict[str, list[dict]] = field(default_factory=dict)  # workload -> rows of starts from disk
    reference_gpu: str | None = None          # the GPU the tables and targets are about
    elsewhere: dict[str, list[dict]] = field(default_factory=dict)  # workload -> results from other GPUs


def run_device(run: dict) -> str | None:
    return run.get("gpu") or run.get("cpu") or run.get("device")


def pick_reference_gpu(runs: Iterable[dict]) -> str | None:
    """The GPU most runs were made on (the first such when tied); None when no run names a GPU."""
    counts: dict[str, int] = {}
    for r in runs:
        if r.get("gpu"):
            counts[r["gpu"]] = counts.get(r["gpu"], 0) + 1
    return max(counts, key=lambda g: counts[g]) if counts else None


def merge(rows: Iterable[dict], reference_gpu: str | None = None) -> Merged:
    """`reference_gpu`: the GPU whose results fill the tables and the targets (default: the GPU most runs were
    made on). Results from runs on another GPU are kept apart (`elsewhere`, their own table): a latency from an
    H100 must neither replace an H200 row nor be divided by the H200's baseline."""
    rows = list(rows)
    m = Merged()
    for r in rows:
        if r.get("type") == "run":
            m.runs[r["run_id"]] = r
    m.reference_gpu = reference_gpu or pick_reference_gpu(m.runs.values())

    def foreign(r: dict) -> bool:
        gpu = (m.runs.get(r.get("run_id")) or {}).get("gpu")
        return bool(m.reference_gpu and gpu and gpu != m.reference_gpu)

    started: dict[tuple, dict] = {}
    finished: set[tuple] = set()
    for r in rows:
        t = r.get("type")
        if t == "workload":
            if not foreign(r) or r["workload"] not in m.workloads:
                m.workloads[r["workload"]] = r
        elif t in ("start", "result") and foreign(r):
            if t == "result":
                m.elsewhere.setdefault(r["workload"], []).append(r)
                if r.get("status") == "ok" and is_start_from_disk(r, m.runs.get(r.get("run_id"), {})):
                    m.starts.setdefault(r["workload"], []).append(r)
        elif t in ("start", "result"):
            key = (r["workload"], int(r["batch"]), r["config"])
            m.order.setdefault(r["workload"], [])
            if r["config"] not in m.order[r["workload"]]:
                m.order[r["workload"]].append(r["config"])
            if t == "start":
                started[(r.get("run_id"),) + key] = r
                continue
            finished.add((r.get("run_id"),) + key)
            if r.get("status") == "ok" and is_start_from_disk(r, m.runs.get(r.get("run_id"), {})):
                m.starts.setdefault(r["workload"], []).append(r)
            prev = m.results.get(key)
            if prev is None or r.get("status") == "ok" or prev.get("status") != "ok":
                m.results[key] = r
    for full_key, r in started.items():
        key = full_key[1:]
        if full_key not in finished and key not in m.results:
            m.results[key] = {**r, "type": "result", "status": "unfinished",
                              "reason": "started but wrote no result: the run was killed or timed out during this case"}
    return m


def is_start_from_disk(row: dict, run: dict) -> bool:
    """A result whose run loaded its weights from disk (`--weights`): its prepare + first call is a start's time
    to its first image, as a user's start would be (random weights drawn in-process are not a load)."""
    return "--weights" in str(run.get("command", "")) and num(row.get("prepare_s")) is not None \
        and num(row.get("first_call_s")) is not None


def start_kind(row: dict) -> str:
    """'second start (warm cache)', 'first start (cold cache)', or 'start' when the row does not say. The
    request graph's AOT parts say it outright; otherwise a first call within 30 s of the steady one is warm."""
    aot = ((row.get("optimizations") or {}).get("request_graph") or {}).get("aot") or {}
    if aot:
        if all(e.get("loaded_from_cache") for e in aot.values()):
            return "second start (warm cache)"
        if any("compiled_s" in e for e in aot.values()):
            return "first start (cold cache)"
    compile_s = num(row.get("compile_s"))
    if compile_s is not None:
        return "second start (warm cache)" if compile_s < 30 else "first start (cold cache)"
    return "start"


def _starts_table(rows: list[dict], runs: dict[str, dict] | None = None) -> list[str]:
    out = []
    for r in rows:
        parts = r.get("prepare_parts_s") or {}
        split = ", ".join(f"{k} {_f(v)}" for k, v in parts.items()) if parts else "–"
        total = num(r.get("prepare_s")) + num(r.get("first_call_s"))
        device = run_device((runs or {}).get(r.get("run_id")) or {}) or "?"
        out.append([f"`{r['config']}`", start_kind(r), device, _f(total), _f(r.get("prepare_s")), split,
                    _f(r.get("first_call_s")), f"`{str(r.get('_source', '')).split(':')[0]}`"])
    return _table(["config", "start", "device", "first image (s)", "prepare (s)", "of which import / load / optimize (s)",
                   "first call (s)", "run file"], out)


def _elsewhere_table(rows: list[dict], runs: dict[str, dict]) -> list[str]:
    out = []
    for r in sorted(rows, key=lambda r: (str(r.get("run_id", "")), int(r.get("batch", 0)), str(r.get("config")))):
        d = r.get("drift") or {}
        shown = _ms(r.get("ms_per_image")) if r.get("status") == "ok" else _status_text(r)
        out.append([f"`{r['config']}`", r.get("batch"), run_device(runs.get(r.get("run_id")) or {}) or "?", shown,
                    _f(r.get("it_per_s")), _f(d.get("psnr_db")), f"`{str(r.get('_source', '')).split(':')[0]}`"])
    return _table(["config", "batch", "device", "ms/image", "it/s", "PSNR dB", "run file"], out)


# ==========================================================================================================
# Formatting
# ==========================================================================================================

def _ms(x: Any) -> str:
    v = num(x)
    if v is None:
        return "–"
    if v >= 1000:
        return f"{v / 1000:.2f} s"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _f(x: Any, digits: int = 1) -> str:
    v = num(x)
    if v is None:
        return "–"
    if math.isinf(v):
        return "∞"
    if math.isnan(v):
        return "NaN"
    return f"{v:.{digits}f}"


def _gib(x: Any) -> str:
    v = num(x)
    return "–" if v is None else f"{v / 2**30:.2f}"


def _pct(x: Any) -> str:
    v = num(x)
    return "–" if v is None else f"{100 * v:.1f}%"


def _flop(x: Any) -> str:
    v = num(x)
    if v is None:
        return "–"
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.3g} FLOP"


def _rate(x: Any) -> str:
    v = num(x)
    return "n/a" if v is None else f"{v:.4g}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


# ==========================================================================================================
# Targets and limits
# ==========================================================================================================

def _is_fp8(row: dict) -> bool:
    return bool((row.get("flags") or {}).get("fp8"))


def _within_drift_budget(row: dict, kind: str) -> bool:
    if kind != "stylegan":
        return True
    precision = (row.get("flags") or {}).get("precision")
    if precision not in ("fp16", "bf16"):
        return True
    psnr = num((row.get("drift") or {}).get("psnr_db"))
    return psnr is None or psnr >= STYLEGAN_PSNR_BUDGET_DB


def evaluate_targets(m: Merged, workload: str) -> list[dict]:
    """Each target of `workload` against its best eligible row (baseline excluded; StyleGAN fp16/bf16 rows
    over the drift budget excluded; tiny-autoencoder rows excluded, since TAESD is not the model's decoder)."""
    wl = m.workloads.get(workload) or {}
    kind = wl.get("kind", "")
    batches = sorted({b for (w, b, _) in m.results if w == workload})
    throughput = max(batches) if batches and max(batches) > 1 else None
    out = []
    for t in wl.get("targets") or []:
        batch = 1 if t.get("batch", "1") == "1" else throughput
        cands = []
        for (w, b, c), r in m.results.items():
            if w != workload or b != batch or r.get("status") != "ok" or c == "baseline":
                continue
            if t.get("configs") == "fp8" and not _is_fp8(r):
                continue
            if t.get("configs") == "no-fp8" and _is_fp8(r):
                continue
            if not _within_drift_budget(r, kind):
                continue
            if (r.get("flags") or {}).get("tiny_vae"):
                continue        # another decoder draws another picture: the targets are for the model's own
            v = num(r.get(t["metric"]))
            if v is not None:
                cands.append((v, c, r))
        entry = {"target": t.get("label") or f"{t['metric']} {t['op']} {t['value']}", "metric": t["metric"],
                 "op": t["op"], "value": t["value"], "batch": batch}
        if not cands:
            entry.update(status="not measured", config=None, measured=None)
            out.append(entry)
            continue
        lower_better = t["op"] == "<"
        v, c, r = min(cands, key=lambda x: x[0]) if lower_better else max(cands, key=lambda x: x[0])
        goal = float(t["value"])
        met = v < goal if lower_better else v >= goal
        margin = (goal - v) / goal if lower_better else (v - goal) / goal
        entry.update(status="met" if met else "missed", config=c, measured=v, margin=margin,
                     limit=None if met else limit_text(r, m))
        out.append(entry)
    return out


def limit_text(row: dict, m: Merged | None = None) -> str:
    """What limits a row, from its profile: kernel classes by device time and how busy the device was."""
    prof = row.get("profile")
    parts = []
    floor = num(row.get("floor_fraction"))
    if floor is not None:
        parts.append(f"at {100 * floor:.1f}% of the bf16 floor")
    if not prof:
        parts.append(f"no kernel profile recorded (re-run with --profile {row.get('config')})")
        return "; ".join(parts)
    busy = num(prof.get("busy_fraction"))
    if busy is not None:
        parts.append(f"device busy {100 * busy:.0f}% of the wall time"
                     + (" (launch/host-bound: CUDA graphs or larger batches help)" if busy < 0.6 else ""))
    classes = prof.get("by_class_ms") or {}
    total = sum(num(v) or 0 for v in classes.values())
    if total > 0:
        top = sorted(classes.items(), key=lambda kv: -(num(kv[1]) or 0))[:3]
        parts.append("device time: " + ", ".join(f"{k} {100 * (num(v) or 0) / total:.0f}%" for k, v in top))
    kernels = prof.get("top") or []
    if kernels:
        k = kernels[0]
        parts.append(f"top kernel {k['name'][:80]} ({_f(k.get('pct'), 0)}%)")
    floor = _compute_floor(row, m)
    if floor:
        parts.append(floor)
    return "; ".join(parts)


def _compute_floor(row: dict, m: Merged | None) -> str | None:
    """`bench.gap`'s verdict for a profiled row whose workload line has the FLOP split: what every GEMM, convolution
    and attention kernel at the run's measured rate would reach, and the memory-bound kernels' share."""
    if m is None or not row.get("profile"):
        return None
    from bench.gap import gap_of_row

    run = m.runs.get(row.get("run_id")) or {}
    g = gap_of_row(row, m.workloads.get(row.get("workload")), run.get("rates") or {}, run_device(run) or "?")
    floor = g.compute_floor_ms
    if floor is None:
        return None
    mm = next((c for c in g.lines if c.name == "matmul+conv"), None)
    return (f"GEMMs + convolutions at {100 * (mm.of_peak or 0):.0f}% of the run's measured rate; with every GEMM, "
            f"convolution and attention kernel at that rate: {floor:.0f} ms, of which {g.memory_ms:.0f} ms "
            f"memory-bound kernels (python -m bench.gap)")


# ==========================================================================================================
# Markdown
# ==========================================================================================================

def _baseline_ms(m: Merged, workload: str, batch: int) -> float | None:
    r = m.results.get((workload, batch, "baseline"))
    return num(r.get("ms_per_image")) if r and r.get("status") == "ok" else None


def _flops_line(wl: dict, rates: dict | None) -> str:
    flops = num(wl.get("flops_per_image"))
    if not flops:
        return ""
    stages = wl.get("flops_by_stage") or {}
    detail = ", ".join(f"{k} {_flop(v.get('flops'))} ({v.get('calls')} call{'s' if v.get('calls') != 1 else ''})"
                       for k, v in stages.items())
    line = f"FLOPs per image: {_flop(flops)} ({detail})"
    bf16 = num((rates or {}).get("bf16_tflops"))
    if bf16:
        line += f"; floor at the measured bf16 rate ({bf16:.4g} TFLOP/s): {_ms(flops / (bf16 * 1e12) * 1e3)} ms"
    return line + "."


def _run_date(m: Merged, r: dict) -> str:
    """', run of YYYY-MM-DD': a failure stays listed until the configuration succeeds, so say how old it is."""
    date = str((m.runs.get(r.get("run_id")) or {}).get("date") or "")[:10]
    return f", run of {date}" if date else ""


def _status_text(r: dict) -> str:
    s = r.get("status")
    if s == "ok":
        return "ok"
    return f"{s}: {r.get('reason', '')}"


def render_markdown(m: Merged, plots: dict[str, str] | None = None, plot_note: str | None = None) -> str:
    plots = plots or {}
    lines = [f"_Generated by `python app.py bench report` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from "
             f"{len(m.runs)} run(s). Do not edit by hand: re-run the report._", ""]
    if not m.results:
        lines.append("No results yet: run `python app.py bench` on the GPU and `bench report` on its output.")
        return "\n".join(lines) + "\n"
    lines += ["### Runs", ""]
    run_rows = []
    run_no = {rid: i + 1 for i, rid in enumerate(m.runs)}
    for rid, r in m.runs.items():
        rates = r.get("rates") or {}
        run_rows.append([f"{run_no[rid]}", f"{rid}" + (f" (`{r['file']}`)" if r.get("file") else ""), r.get("date", "?"), r.get("gpu") or r.get("cpu") or r.get("device"), r.get("torch"),
                         r.get("cuda") or "–", r.get("diffusers") or "–", _rate(rates.get("bf16_tflops")),
                         _rate(rates.get("fp8_tflops")),
                         f"`{r.get('command', '')}`"])
    lines += _table(["#", "run (file)", "date (UTC)", "device", "torch", "CUDA", "diffusers", "bf16 TFLOP/s", "FP8 TFLOP/s",
                     "command"], run_rows) + [""]
    any_rates = next((r.get("rates") for r in m.runs.values() if r.get("rates")), None)
    if plot_note:
        lines += [f"_{plot_note}_", ""]

    workloads = list(dict.fromkeys([w for (w, _, _) in m.results] + list(m.elsewhere)))
    for w in workloads:
        wl = m.workloads.get(w, {})
        lines += [f"### {w} — {wl.get('description', '')}".rstrip(" —"), ""]
        if wl.get("tiny"):
            lines += ["_A tiny harness-check model: these numbers say the tool works, not how fast anything is._", ""]
        if wl.get("baseline"):
            lines += [f"Baseline: {wl['baseline']}. Weights: {wl.get('weights', '?')}."]
        fl = _flops_line(wl, (m.runs.get(wl.get("run_id")) or {}).get("rates") or any_rates)
        if fl:
            lines += [fl]
        lines += [""]
        if w in plots:
            lines += [f"![{w}: latency and peak VRAM per configuration]({plots[w]})", ""]
        batches = sorted({b for (ww, b, _) in m.results if ww == w})
        configs = m.order.get(w, [])
        for b in batches:
            base = _baseline_ms(m, w, b)
            title = "Batch 1" if b == 1 else f"Batch {b} (throughput)"
            lines += [f"**{title}**", ""]
            rows = []
            for c in configs:
                r = m.results.get((w, b, c))
                if r is None or r.get("status") != "ok":
                    continue
                st = r.get("stages_ms") or {}
                d = r.get("drift") or {}
                ms = num(r.get("ms_per_image"))
                speed = f"{base / ms:.2f}×" if base and ms else "–"
                psnr = _f(d.get("psnr_db"))
                if not _within_drift_budget(r, wl.get("kind", "")):
                    psnr += f" (under {STYLEGAN_PSNR_BUDGET_DB:.0f} dB budget)"
                name = f"`{c}`" + (f" (= `{r['same_as']}`)" if r.get("same_as") else "")
                row = [name, run_no.get(r.get("run_id"), "–"), _ms(r.get("ms_per_image")), speed]
                if wl.get("kind") == "diffusion":
                    row += [_f(r.get("it_per_s")), _ms(st.get("text_encoder")), _ms(st.get("denoise")),
                            _ms(st.get("vae_decode"))]
                else:
                    row += [_ms(r.get("e2e_ms_per_image"))]
                warm = (num(r.get("prepare_s")) or 0) + (num(r.get("first_call_s")) or 0) \
                    if r.get("first_call_s") is not None else None
                vram = _gib(r.get("peak_vram_bytes"))
                alloc, reserved = num(r.get("peak_vram_bytes")), num(r.get("peak_reserved_bytes"))
                if alloc and reserved and reserved > 1.1 * alloc:     # CUDA graphs keep their pools outside "allocated"
                    vram += f" (res. {_gib(reserved)})"
                floor = r.get("floor_fraction_fp8") if r.get("floor_fraction_fp8") is not None else r.get("floor_fraction")
                row += [_f(r.get("images_per_s")), vram, _f(warm),
                        psnr if b == 1 else "–", _f(d.get("ssim"), 4) if b == 1 else "–", _pct(floor),
                        _f(r.get("spread_pct"), 0)]
                rows.append(row)
            head = ["config", "run", "ms/image", "vs baseline"]
            head += (["it/s", "text enc ms", "denoise ms", "VAE ms"] if wl.get("kind") == "diffusion"
                     else ["end-to-end ms/image"])
            head += ["images/s", "peak VRAM GiB", "warm-up s", "PSNR dB", "SSIM", "of floor", "spread %"]
            lines += (_table(head, rows) if rows else ["(no successful configuration at this batch)"]) + [""]
        ref_errors = {r.get("reference_error") for (ww, _, _), r in m.results.items() if ww == w} - {None}
        for err in sorted(ref_errors):
            lines += [f"No drift or floor numbers where the fp32 reference could not run: {err}", ""]
        other = [(c, b, m.results[(w, b, c)]) for b in batches for c in configs
                 if (w, b, c) in m.results and m.results[(w, b, c)].get("status") != "ok"]
        if other:
            lines += ["Not measured:", ""]
            lines += [f"- `{c}` (batch {b}{_run_date(m, r)}): {_status_text(r)}" for c, b, r in other] + [""]
        targets = evaluate_targets(m, w)
        if targets:
            lines += [f"Targets ({m.reference_gpu or 'H200'}; the baseline and tiny-autoencoder rows excluded):", ""]
            trows = []
            for t in targets:
                if t["status"] == "not measured":
                    trows.append([t["target"], "–", "–", "not measured in these runs"])
                    continue
                val = t["measured"]
                shown = _ms(val) + " ms" if t["metric"] == "ms_per_image" else _f(val)
                pct = abs(100 * t["margin"])
                verdict = (f"met, {pct:.0f}% to spare" if t["status"] == "met"
                           else f"missed by {pct:.0f}% — {t['limit']}")
                trows.append([t["target"], f"`{t['config']}` (batch {t['batch']})", shown, verdict])
            lines += _table(["target", "best row", "measured", "verdict"], trows) + [""]
        if m.starts.get(w):
            lines += ["Time to a first image, weights read from disk (prepare = import the pipeline code, load, apply "
                      "the toggles; first call = compile or load compiled parts, record, run):", ""]
            lines += _starts_table(sorted(m.starts[w], key=lambda r: str(r.get("run_id", ""))), m.runs) + [""]
        if m.elsewhere.get(w):
            lines += [f"On other GPUs than the {m.reference_gpu} (kept out of the tables and targets above; compare "
                      "each only with rows of its own run):", ""]
            lines += _elsewhere_table(m.elsewhere[w], m.runs) + [""]
        profiled = [(c, b, m.results[(w, b, c)]) for b in batches for c in configs
                    if (w, b, c) in m.results and m.results[(w, b, c)].get("profile")]
        if profiled:
            lines += ["Kernel profiles (one call each):", ""]
            for c, b, r in profiled:
                p = r["profile"]
                top = "; ".join(f"{k['name'][:70]} {_f(k.get('pct'), 0)}%" for k in (p.get("top") or [])[:4])
                lines += [f"- `{c}` batch {b}: {limit_text(r)}. Top kernels: {top}"]
            lines += [""]
    lines += _column_notes()
    return "\n".join(lines).rstrip() + "\n"


def _column_notes() -> list[str]:
    return ["Columns: **ms/image** median wall time of one call divided by the batch (diffusion: the whole "
            "`generate`, text encoder to PIL images; StyleGAN: the generator forward on the device, CUDA events); "
            "**vs baseline** baseline ms/image over this row's; **it/s** denoising steps per second of the loop; "
            "**end-to-end** StyleGAN through `generate` (seeds to PIL images); **warm-up** build, optimization "
            "toggles and first call, compilation included (split as `prepare_s` / `first_call_s` in the JSON); "
            "**peak VRAM** the allocator's peak during the timed calls (process memory on a CPU), with the reserved "
            "peak in brackets where it is over 10 % larger (CUDA graphs' memory pools); **PSNR/SSIM** the batch-1 image "
            "against the fp32 row's, same seed, 8-bit; "
            "**of floor** (FLOPs / measured bf16 rate) / ms per image, for FP8 rows against a mixed floor (matrix "
            "products at the measured FP8 rate, the rest at bf16); **spread** (max − min) / median of the "
            "timed calls: differences smaller than this are noise.", ""]


# ==========================================================================================================
# Plots
# ==========================================================================================================

def plot_workload(m: Merged, workload: str, path: Path) -> Path:
    """Latency per configuration (log scale; batch 1 and the throughput batch per image) and peak VRAM,
    with the workload's ms targets drawn as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OptionalDependencyError("plots need matplotlib (pip install matplotlib); the tables do not") from None
    configs = m.order.get(workload, [])
    batches = sorted({b for (w, b, _) in m.results if w == workload})
    ok = lambda c, b: (m.results.get((workload, b, c)) or {}).get("status") == "ok"   # noqa: E731
    configs = [c for c in configs if any(ok(c, b) for b in batches)]
    if not configs:
        raise InputError(f"nothing to plot for {workload}: no successful configuration")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.0 * len(configs) + 4), 4.5),
                                   gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(batches), 1)
    all_ms = []
    for i, b in enumerate(batches):
        xs = [j + (i - (len(batches) - 1) / 2) * width for j in range(len(configs))]
        vals = [num(m.results[(workload, b, c)].get("ms_per_image")) if ok(c, b) else None for c in configs]
        all_ms += [v for v in vals if v]
        bars = ax1.bar([x for x, v in zip(xs, vals) if v], [v for v in vals if v], width,
                       label=f"batch {b}" + (" (per image)" if b > 1 else ""))
        ax1.bar_label(bars, labels=[_ms(v) for v in vals if v], fontsize=6, rotation=90, padding=2)
        mem = [num(m.results[(workload, b, c)].get("peak_vram_bytes")) if ok(c, b) else None for c in configs]
        ax2.bar([x for x, v in zip(xs, mem) if v], [v / 2**30 for v in mem if v], width, label=f"batch {b}")
    targets = [t for t in (m.workloads.get(workload) or {}).get("targets") or [] if t.get("metric") == "ms_per_image"]
    for t in targets:
        ax1.axhline(float(t["value"]), color="crimson", linestyle="--", linewidth=1)
        ax1.text(len(configs) - 0.5, float(t["value"]), " " + (t.get("label") or ""), color="crimson",
                 va="bottom", ha="right", fontsize=7)
    span = all_ms + [float(t["value"]) for t in targets]
    if span and max(span) / min(span) > 20:      # a log axis only where the bars span orders of magnitude
        ax1.set_yscale("log")
        ax1.set_ylim(min(span) / 2, max(span) * 3)
        ax1.set_ylabel("ms per image (log scale)")
    else:
        ax1.set_ylim(0, max(span) * 1.25 if span else 1)
        ax1.set_ylabel("ms per image")
    ax2.set_ylabel("peak memory (GiB; VRAM on a GPU)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, rotation=45, ha="right", fontsize=8)
        ax.legend(fontsize=7)
    ax1.set_title(f"{workload}: latency", fontsize=10)
    ax2.set_title("memory", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ==========================================================================================================
# Writing
# ==========================================================================================================

def to_json(m: Merged) -> dict:
    results = []
    for (w, b, c), r in m.results.items():
        results.append({k: v for k, v in r.items() if not k.startswith("_")})
    return {"generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "runs": list(m.runs.values()), "workloads": m.workloads, "results": results,
            "reference_gpu": m.reference_gpu,
            "other_gpus": [{k: v for k, v in r.items() if not k.startswith("_")}
                           for rows in m.elsewhere.values() for r in rows],
            "targets": {w: evaluate_targets(m, w) for w in dict.fromkeys(w for (w, _, _) in m.results)}}


def splice(doc: str, section: str) -> str:
    """Put `section` between the result markers of `doc` (appending the markers when absent)."""
    block = f"{START_MARK}\n{section.rstrip()}\n{END_MARK}"
    if START_MARK in doc and END_MARK in doc and doc.index(START_MARK) < doc.index(END_MARK):
        head, rest = doc.split(START_MARK, 1)
        _, tail = rest.split(END_MARK, 1)
        return head + block + tail
    return doc.rstrip() + "\n\n## Results\n\n" + block + "\n"


def write_report(inputs: list[str | Path], out_md: str | Path, plots_dir: str | Path | None = None,
                 json_out: str | Path | None = None, plots: bool = True) -> dict:
    """Merge `inputs` (JSON lines) and write the markdown (spliced into an existing document between its
    result markers), the merged JSON and the plots. Returns what was written."""
    if not inputs:
        raise InputError("give at least one bench.jsonl file (--inputs)")
    rows: list[dict] = []
    for p in inputs:
        for r in read_jsonl(p):
            if r.get("type") == "run":
                r = {**r, "file": Path(p).name}      # the runs table names the file each row comes from
            rows.append(r)
    m = merge(rows)
    out_md = Path(out_md)
    plots_dir = Path(plots_dir) if plots_dir else out_md.parent / out_md.stem
    json_out = Path(json_out) if json_out else out_md.with_suffix(".json")
    written: dict[str, Any] = {"markdown": str(out_md), "json": str(json_out), "plots": []}
    plot_links: dict[str, str] = {}
    note = None
    if plots:
        for w in dict.fromkeys(w for (w, _, _) in m.results):
            try:
                p = plot_workload(m, w, plots_dir / f"{w}.png")
            except OptionalDependencyError as exc:
                note = f"plots skipped: {exc}"
                break
            except InputError:
                continue
            written["plots"].append(str(p))
            try:
                plot_links[w] = p.relative_to(out_md.parent).as_posix()
            except ValueError:
                plot_links[w] = p.resolve().as_posix()
    section = render_markdown(m, plot_links, note)
    doc = out_md.read_text(encoding="utf-8") if out_md.is_file() else "# Benchmarks\n"
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(splice(doc, section), encoding="utf-8")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(to_json(m), indent=1, ensure_ascii=False), encoding="utf-8")
    written["cases"] = len(m.results)
    return written


__all__ = ["read_jsonl", "merge", "render_markdown", "evaluate_targets", "plot_workload", "write_report", "splice",
           "num", "START_MARK", "END_MARK"]
