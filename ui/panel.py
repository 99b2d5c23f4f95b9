"""HTML for the live side panel and the progress bar.

Pure functions from snapshots to small HTML strings: no Gradio, no device
access, so they are cheap (tens of microseconds) and testable on their own.
Charts are inline SVG polylines: nothing to load in the browser, no plotting
library in the timer's path.
"""
from __future__ import annotations

import html
import math

from telemetry.live import DONE, FAILED, IDLE, QUEUED, RUNNING, STOPPED, JobSnapshot, MemorySample
from telemetry.memory import MemoryReading, format_bytes

STATE_LABEL = {IDLE: "idle", QUEUED: "queued", RUNNING: "running", DONE: "done", STOPPED: "stopped", FAILED: "failed"}


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "–"
    if ms < 10:
        return f"{ms:.2f} ms"
    if ms < 1000:
        return f"{ms:.1f} ms"
    return f"{ms / 1000:.2f} s"


def fmt_duration(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "–"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m"


def _kv(label: str, value: str, cls: str = "") -> str:
    return f'<div class="at-kv {cls}"><span>{html.escape(label)}</span><b>{value}</b></div>'


def _bar(fraction: float, cls: str = "") -> str:
    pct = max(0.0, min(1.0, fraction)) * 100
    return f'<div class="at-bar {cls}"><div style="width:{pct:.1f}%"></div></div>'


def render_device(r: MemoryReading, busy: bool) -> str:
    where = "GPU" if r.kind == "cuda" else "CPU"
    total = f" · {format_bytes(r.device_total)}" if r.device_total else ""
    dot = "at-dot busy" if busy else "at-dot"
    return (f'<div class="at-dev"><span class="{dot}"></span><div><div class="at-dev-name">{html.escape(r.device_name)}</div>'
            f'<div class="at-muted">{where}{total}</div></div></div>')


def render_memory(r: MemoryReading, snap: JobSnapshot) -> str:
    """The VRAM readout; on CPU the process's resident memory, labelled as such."""
    if r.kind == "cuda":
        rows = [
            _kv("allocated", format_bytes(r.allocated)),
            _kv("reserved", format_bytes(r.reserved)),
            _kv("peak (this job)" if snap.state == RUNNING else "peak (last job)",
                format_bytes(r.peak if snap.state == RUNNING else (snap.last_peak_bytes or r.peak))),
        ]
        if r.device_total:
            used = r.device_used or 0
            rows.append(_kv("device used / total", f"{format_bytes(used)} / {format_bytes(r.device_total)}"))
            rows.append(_bar(used / r.device_total, "at-mem"))
        title = "VRAM"
    else:
        rows = [_kv("process RSS", format_bytes(r.rss)),
                '<div class="at-muted at-note">no VRAM on CPU: memory of this process</div>']
        if r.device_total:
            rows.append(_kv("system memory", format_bytes(r.device_total)))
        if snap.last_peak_bytes and snap.state != RUNNING:
            rows.append(_kv("RSS at end of last job", format_bytes(snap.last_peak_bytes)))
        title = "Memory <span class='at-muted'>(CPU)</span>"
    return f'<div class="at-sec"><div class="at-h">{title}</div>{"".join(rows)}</div>'


def render_job(snap: JobSnapshot, queue_position: int | None, waiting: int, running: int) -> str:
    state = STATE_LABEL.get(snap.state, snap.state)
    rows = [f'<div class="at-h">Current job <span class="at-badge at-b-{snap.state}">{state}</span></div>']
    if snap.state == QUEUED:
        if queue_position:
            rows.append(_kv("queue position", f"{queue_position} of {waiting}"))
        else:
            rows.append(_kv("queue", "waiting for the GPU"))
    if snap.state in (RUNNING, DONE, STOPPED, FAILED) and (snap.stage or snap.total):
        rows.append(_kv("stage", html.escape(snap.stage or "–")))
        rows.append(_kv("step", f"{snap.step} / {snap.total}" if snap.total else "–"))
        rows.append(_kv("last step", fmt_ms(snap.last_step_ms)))
        rows.append(_kv("speed", f"{snap.it_per_s:.2f} it/s" if snap.it_per_s else "–"))
        if snap.state == RUNNING:
            rows.append(_kv("ETA", fmt_duration(snap.eta_s)))
        rows.append(_kv("elapsed", fmt_duration(snap.elapsed_s)))
    if snap.state == IDLE:
        rows.append('<div class="at-muted">No job yet. Press Generate.</div>')
    q = f"GPU queue: {running} running, {waiting} waiting" if (waiting or running) else "GPU queue: empty"
    rows.append(f'<div class="at-muted at-q">{q}</div>')
    return f'<div class="at-sec">{"".join(rows)}</div>'


def render_latency(snap: JobSnapshot) -> str:
    """The last finished job's latency per stage (or a stopped job's, when it kept the images it finished)."""
    if not snap.last_stage_ms:
        return ('<div class="at-sec"><div class="at-h">Last job latency</div>'
                '<div class="at-muted">none yet</div></div>')
    total = snap.last_total_ms or sum(snap.last_stage_ms.values())
    rows = []
    for stage, ms in snap.last_stage_ms.items():
        share = ms / total if total else 0.0
        rows.append(f'<div class="at-stage"><span>{html.escape(stage)}</span>'
                    f'<div class="at-bar at-thin"><div style="width:{share * 100:.1f}%"></div></div>'
                    f'<b>{fmt_ms(ms)}</b></div>')
    rows.append(_kv("total", f'<span class="at-total">{fmt_ms(total)}</span>', "at-sum"))
    if snap.last_images:
        rows.append(_kv("per image", fmt_ms(total / snap.last_images)))
    title = "Last job latency"
    if snap.last_state == STOPPED:
        kept = f"{snap.last_images} image{'s' if snap.last_images != 1 else ''}"
        title += f' <span class="at-muted">(stopped, {kept} kept)</span>'
    return f'<div class="at-sec"><div class="at-h">{title}</div>{"".join(rows)}</div>'


def sparkline(values: list[float] | tuple[float, ...], width: int = 240, height: int = 44, cls: str = "") -> str:
    """An inline SVG line chart of `values` (left = oldest); empty frame when there are fewer than 2."""
    if len(values) < 2:
        return (f'<svg class="at-spark {cls}" viewBox="0 0 {width} {height}" preserveAspectRatio="none">'
                f'<line x1="0" y1="{height - 1}" x2="{width}" y2="{height - 1}" class="at-axis"/></svg>')
    lo, hi = min(values), max(values)
    lo = min(lo, 0.0) if hi > 0 and lo >= 0 and lo < 0.5 * hi else lo   # anchor at zero unless the range is narrow
    span = (hi - lo) or 1.0
    n = len(values)
    pts = " ".join(f"{i * width / (n - 1):.1f},{height - 2 - (v - lo) / span * (height - 4):.1f}" for i, v in enumerate(values))
    area = f"0,{height} {pts} {width},{height}"
    return (f'<svg class="at-spark {cls}" viewBox="0 0 {width} {height}" preserveAspectRatio="none">'
            f'<polygon points="{area}" class="at-area"/><polyline points="{pts}" class="at-line"/></svg>')


def render_charts(snap: JobSnapshot, memory: list[MemorySample], reading_kind: str) -> str:
    steps = list(snap.step_ms)
    step_label = (f"max {fmt_ms(max(steps))} · last {fmt_ms(steps[-1])}" if steps else "no steps yet")
    used = [s.used for s in memory]
    mem_name = "VRAM allocated" if reading_kind == "cuda" else "process RSS"
    if used:
        span_s = memory[-1].t - memory[0].t if len(memory) > 1 else 0.0
        mem_label = f"now {format_bytes(used[-1])} · max {format_bytes(max(used))} · last {fmt_duration(span_s)}"
    else:
        mem_label = "no samples yet"
    return ('<div class="at-sec"><div class="at-h">Step latency <span class="at-muted">(this job)</span></div>'
            f'{sparkline(steps, cls="at-steps")}<div class="at-muted at-cap">{step_label}</div>'
            f'<div class="at-h">{mem_name} <span class="at-muted">(last minutes)</span></div>'
            f'{sparkline([float(u) for u in used], cls="at-memline")}<div class="at-muted at-cap">{mem_label}</div></div>')


def render_progress(snap: JobSnapshot, queue_position: int | None, waiting: int) -> str:
    """The bar under the Generate button."""
    if snap.state == QUEUED:
        pos = f"position {queue_position} of {waiting}" if queue_position else "starting"
        text = f"Waiting for the GPU — {pos}"
        return f'<div class="at-progress at-queued">{_bar(0.0)}<div class="at-ptext">{text}</div></div>'
    if snap.state == RUNNING:
        step = f"step {snap.step}/{snap.total}" if snap.total else "starting"
        parts = [html.escape(snap.stage or "load"), step]
        if snap.last_step_ms is not None:
            parts.append(fmt_ms(snap.last_step_ms))
        if snap.it_per_s:
            parts.append(f"{snap.it_per_s:.1f} it/s")
        if snap.eta_s is not None:
            parts.append(f"ETA {fmt_duration(snap.eta_s)}")
        if snap.message:                      # e.g. "compiling (first run for this size)"
            parts.append(html.escape(snap.message))
        return (f'<div class="at-progress at-running">{_bar(snap.fraction)}'
                f'<div class="at-ptext">{" · ".join(parts)}</div></div>')
    if snap.state in (DONE, STOPPED, FAILED):
        cls = {DONE: "at-done", STOPPED: "at-stopped", FAILED: "at-failed"}[snap.state]
        frac = 1.0 if snap.state == DONE else snap.fraction
        return (f'<div class="at-progress {cls}">{_bar(frac)}'
                f'<div class="at-ptext">{html.escape(snap.message)}</div></div>')
    return '<div class="at-progress at-idle">' + _bar(0.0) + '<div class="at-ptext">Ready.</div></div>'


def render_stopping(snap: JobSnapshot) -> str:
    """Shown the moment Stop is pressed, until the job reaches its next step and ends."""
    return (f'<div class="at-progress at-stopping">{_bar(snap.fraction)}'
            '<div class="at-ptext">Stopping…</div></div>')
