"""What the Train tab shows, from a run's status and log records. No Gradio here.

Pure functions: `render_status` and `render_warnings` make small HTML strings (the side
panel's classes), `loss_frame` / `regularizer_frame` / `monitor_frame` make the long-format
DataFrames (kimg, value, series) that `gr.LinePlot` draws with one colour per series (always every
series of the plot, see `_frame`).
Long runs log thousands of points; each series is thinned to `MAX_POINTS` so a redraw stays
cheap for the browser.
"""
from __future__ import annotations

import html

import pandas as pd

from training.runs import FAILED, FINISHED, INTERRUPTED, NEW, RUNNING, STOPPED, STOPPING, RunStatus, format_duration

MAX_POINTS = 400
# every plot's series and their colours (fixed: see _frame)
LOSS_COLORS = {"G": "#7c3aed", "D": "#0ea5e9"}
REG_COLORS = {"R1": "#f59e0b", "GP": "#ef4444", "path length": "#10b981"}
MONITOR_COLORS = {"diversity": "#7c3aed", "class diversity": "#db2777", "duplicate rate": "#ef4444",
                  "D accuracy": "#0ea5e9", "aug p": "#94a3b8"}
BADGE = {RUNNING: "running", STOPPING: "queued", FINISHED: "done", STOPPED: "stopped", FAILED: "failed",
         INTERRUPTED: "stopped", NEW: "stopped"}       # reuse the side panel's badge colours


def _kv(label: str, value: str) -> str:
    return f'<div class="at-kv"><span>{html.escape(label)}</span><b>{value}</b></div>'


def _fmt(v, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def render_status(st: RunStatus | None) -> str:
    """The status block: state, message, kimg of total, img/s, ETA, elapsed, augmentation p."""
    if st is None:
        return ('<div class="at-train-status at-sec"><div class="at-muted">No training run yet. Fill in the data and '
                'press <b>Start training</b>.</div></div>')
    badge = f'<span class="at-badge at-b-{BADGE.get(st.state, "stopped")}">{html.escape(st.state)}</span>'
    total = f" / {st.total_kimg:g}" if st.total_kimg else ""
    frac = min(st.kimg / st.total_kimg, 1.0) if st.total_kimg else None
    if st.minutes and st.started and st.elapsed_s is not None and st.active:
        frac = max(frac or 0.0, min(st.elapsed_s / (st.minutes * 60), 1.0))
    bar = (f'<div class="at-bar"><div style="width:{frac * 100:.1f}%"></div></div>'
           if frac is not None and st.state != FAILED else "")
    msg_cls = "at-train-error" if st.state == FAILED else "at-train-msg"
    message = html.escape(st.message or "")
    if st.state == FAILED:
        message = f"<pre>{message}</pre>"
    t = st.last_train or {}
    rows = [
        _kv("kimg", f"{st.kimg:g}{total}"),
        _kv("img/s", _fmt(st.img_s, ",.1f")),
        _kv("ETA" if st.active else "elapsed", format_duration(st.eta_s if st.active else st.elapsed_s)),
        _kv("losses G / D", f"{_fmt(t.get('loss_G'))} / {_fmt(t.get('loss_D'))}"),
        _kv("aug p", _fmt(t.get("aug_p"), ".3f")),
    ]
    if st.active and st.elapsed_s is not None:
        rows.insert(3, _kv("elapsed", format_duration(st.elapsed_s)))
    return (f'<div class="at-train-status at-sec"><div class="at-h">Run <b>{html.escape(st.name)}</b> {badge}</div>'
            f'{bar}<div class="{msg_cls}">{message}</div><div class="at-train-grid">{"".join(rows)}</div></div>')


def render_warnings(st: RunStatus | None, limit: int = 3) -> str:
    """The monitor's warnings (newest first) and the counter-measures it applied; empty when none."""
    if st is None or not (st.warnings or st.countermeasures):
        return ""
    items = [f'<li><b>kimg {w["kimg"]:g}</b> {html.escape(w["text"])}</li>' for w in reversed(st.warnings[-limit:])]
    more = len(st.warnings) - limit
    if more > 0:
        items.append(f'<li class="at-muted">… and {more} earlier</li>')
    cms = [f'<li><b>kimg {c["kimg"]:g}</b> {html.escape(str(c.get("detail") or c.get("measure")))}</li>'
           for c in st.countermeasures]
    out = []
    if items:
        out.append(f'<div class="at-train-warn"><div class="at-h">⚠ Monitor warnings</div><ul>{"".join(items)}</ul></div>')
    if cms:
        out.append(f'<div class="at-train-cm"><div class="at-h">Counter-measures applied</div><ul>{"".join(cms)}</ul></div>')
    return "".join(out)


def _thin(rows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(rows) <= MAX_POINTS:
        return rows
    step = len(rows) / MAX_POINTS
    picked = [rows[int(i * step)] for i in range(MAX_POINTS - 1)]
    return picked + [rows[-1]]      # always the newest point


def _frame(records: list[dict], kind: str, series: dict[str, object]) -> pd.DataFrame:
    """series: label -> record key, or a function of the record (None = no point)."""
    recs = [r for r in records if r.get("kind") == kind and r.get("kimg") is not None]
    parts = []
    for label, key in series.items():
        rows = []
        for r in recs:
            v = key(r) if callable(key) else r.get(key)
            if v is not None and v == v and abs(v) != float("inf"):    # skip missing and NaN/inf points
                rows.append((float(r["kimg"]), float(v)))
        # a series with no point yet still gets a row (value NaN, drawn as nothing): the plot fixes its
        # colour domain from the first value it shows, and a series missing then is never drawn later
        parts += [(k, v, label) for k, v in _thin(rows)] or [(0.0, float("nan"), label)]
    return _typed(parts)


def _typed(parts: list[tuple[float, float, str]]) -> pd.DataFrame:
    # explicit dtypes: gr.LinePlot reads an object column (what an empty frame has) as categories
    return pd.DataFrame({"kimg": pd.Series([p[0] for p in parts], dtype="float64"),
                         "value": pd.Series([p[1] for p in parts], dtype="float64"),
                         "series": pd.Series([p[2] for p in parts], dtype="string")})


def loss_frame(records: list[dict]) -> pd.DataFrame:
    return _frame(records, "train", {"G": "loss_G", "D": "loss_D"})


def regularizer_frame(records: list[dict]) -> pd.DataFrame:
    return _frame(records, "train", {"R1": "r1", "GP": "gp", "path length": "pl"})


def _d_acc(r: dict):
    a, b = r.get("d_acc_real"), r.get("d_acc_fake")
    return None if a is None or b is None else 0.5 * (a + b)


def monitor_frame(records: list[dict]) -> pd.DataFrame:
    """Diversity, within-class diversity (conditional runs) and duplicate rate (monitor records), D accuracy and
    augmentation p (every log point)."""
    mon = _frame(records, "monitor", {"diversity": "diversity", "class diversity": "class_diversity",
                                      "duplicate rate": "duplicate_rate"})
    train = _frame(records, "train", {"D accuracy": _d_acc, "aug p": "aug_p"})
    return pd.concat([mon, train], ignore_index=True)


def empty_frames() -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The three plots' frames before any record: every series present, no points."""
    return loss_frame([]), regularizer_frame([]), monitor_frame([])


EMPTY_PLOT_LIMITS = {"x_lim": [0, 1], "y_lim": [0, 1]}


def plot_limits(frame: pd.DataFrame) -> dict:
    """LinePlot axis limits for `frame`: fixed 0..1 axes while it has no point (a plot of only NaN rows gets a
    zero-width domain, whose ticks read "0.000000"), the data's own range once it has one."""
    has_point = bool(frame["value"].notna().any()) if len(frame) else False
    return {"x_lim": None, "y_lim": None} if has_point else dict(EMPTY_PLOT_LIMITS)


SAMPLES_CAPTION = "**Latest samples** (samples.png)"
