"""The studio's view of a comparison (evaluation/compare.py): the table under the Compare tab's slider."""
from __future__ import annotations

import html

from evaluation.compare import (MAX_COMPARE_IMAGES, Comparison, Side, comparison_request, reference_flags,  # noqa: F401
                                run_comparison)
from evaluation.compare import UNTIMED_STAGES, speed_words


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "—"


def _applied(side: Side) -> tuple[list[str], list[str]]:
    on, off = [], []
    for name, rep in side.optimizations.items():
        if not isinstance(rep, dict):
            continue
        if rep.get("applied"):
            detail = rep.get("mode") or rep.get("dtype") or rep.get("method") or rep.get("backend") or ""
            on.append(f"{name} {detail}".strip())
        elif rep.get("reason") and name in side.flags.requested():
            off.append(f"{name}: {rep['reason']}")
    return on, off


def render_comparison(c: Comparison) -> str:
    """The comparison table (HTML) shown under the slider."""
    e = html.escape
    ref, cand = c.reference, c.candidate
    n = len(ref.images)
    d = c.drift
    rows: list[tuple[str, str, str, str]] = []
    rows.append(("generation", f"{ref.latency_ms:,.1f} ms", f"{cand.latency_ms:,.1f} ms", speed_words(c.speedup)))
    if n > 1:
        rows.append(("per image", f"{ref.latency_ms / n:,.2f} ms", f"{cand.latency_ms / n:,.2f} ms", ""))
    stages = [k for k in dict.fromkeys(list(ref.timings_ms) + list(cand.timings_ms)) if k not in UNTIMED_STAGES]
    if len(stages) > 1:
        for s in stages:
            rows.append((f"· {s}", f"{ref.timings_ms.get(s, 0):,.1f} ms", f"{cand.timings_ms.get(s, 0):,.1f} ms", ""))
    change = ""
    if ref.peak_bytes and cand.peak_bytes:
        change = f"{(cand.peak_bytes - ref.peak_bytes) / ref.peak_bytes:+.0%}"
    on_gpu = c.device.startswith("cuda")
    rows.append(("peak GPU memory" if on_gpu else "process memory (RSS)", _mib(ref.peak_bytes), _mib(cand.peak_bytes),
                 change))
    rows.append(("compute dtype", ref.dtype, cand.dtype, ""))
    if ref.warmup_ms is not None or cand.warmup_ms is not None:
        fmt = lambda w: "—" if w is None else f"{w / 1000:,.2f} s"  # noqa: E731
        rows.append(("warm-up (untimed)", fmt(ref.warmup_ms), fmt(cand.warmup_ms),
                     "includes compiling" if cand.flags.compile != "off" or cand.flags.tensorrt else ""))
    on, off = _applied(cand)
    psnr = "∞ (identical)" if d["psnr_db"] == float("inf") else f"{d['psnr_db']:.2f} dB"
    rows.append(("drift: PSNR", "—", psnr, ""))
    rows.append(("drift: SSIM", "—", f"{d['ssim']:.4f}", ""))
    rows.append(("largest pixel change", "—", f"{d['max_abs']:.0f} / 255", f"mean {d['mean_abs']:.2f}"))
    body = "".join(f"<tr><th>{e(a)}</th><td>{e(b)}</td><td>{e(x)}</td><td class='at-cmp-change'>{e(y)}</td></tr>"
                   for a, b, x, y in rows)
    notes = [f"applied: {', '.join(on) or 'none'}",
             f"{n} image{'s' if n != 1 else ''} on {c.device}, one timed run each, one after the other; "
             "press Compare again to re-measure",
             "drift is measured on the 8-bit images: PSNR over 35 dB is hard to see, SSIM 1 = identical"]
    if ref.flags.memory:
        notes.append("memory savers kept in the reference: " + ", ".join(ref.flags.memory))
    notes += c.notes + [f"not applied — {x}" for x in off] + cand.notes
    note_html = "".join(f"<li>{e(x)}</li>" for x in notes)
    return (f"<div class='at-compare'><table class='at-cmp-table'><thead><tr><th></th><th>fp32 reference</th>"
            f"<th>your settings</th><th></th></tr></thead><tbody>{body}</tbody></table>"
            f"<ul class='at-cmp-notes'>{note_html}</ul></div>")


__all__ = ["Comparison", "Side", "MAX_COMPARE_IMAGES", "comparison_request", "reference_flags", "render_comparison",
           "run_comparison"]
