"""docs/grafana/atelier-dashboard.json queries only what /metrics really serves.

The exposition comes from the studio's own StudioMetrics after a finished job, a queue change and a
CUDA-style memory reading; every metric name a panel's PromQL uses must appear in it, and every
label it groups by must be a label of that metric. Renaming a metric without the dashboard fails here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from telemetry.memory import MemoryReading
from telemetry.metrics import StudioMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "atelier-dashboard.json"
PROMQL_KEYWORDS = {"sum", "rate", "by", "le", "histogram_quantile"}


def _exposition() -> dict[str, set[str]]:
    """metric sample name -> its label names, from the text format."""
    m = StudioMetrics()
    m.observe_job("stylegan", "done", {"synthesis": 12.0, "save": 1.0}, images=8, step_ms=[3.0, 4.0])
    m.observe_job("diffusion", "stopped", {"denoise": 50.0})
    m.set_queue(2, 1)
    m.set_memory(MemoryReading("cuda", "H200", allocated=1 << 30, reserved=2 << 30, peak=3 << 30,
                               device_used=4 << 30, device_total=140 << 30, rss=1 << 29))
    series: dict[str, set[str]] = {}
    for line in m.render().decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        name = name.split()[0]
        labels = set(re.findall(r'(\w+)="', rest)) if rest else set()
        series.setdefault(name, set()).update(labels)
    return series


def test_every_panel_query_uses_served_metrics_and_labels():
    dash = json.loads(DASHBOARD.read_text())
    served = _exposition()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and dash["uid"] == "atelier-studio"
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\b(atelier_\w+)", expr))
        assert names, expr
        for name in names:
            assert name in served, f"{name} (in {expr!r}) is not served by /metrics; served: {sorted(served)}"
            used.add(name)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert any(label in served[n] for n in names), f"label {label!r} of {expr!r} is on none of {names}"
    # the dashboard covers every family the studio exports (latency, steps, stages, images, jobs, queue, memory)
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in served}
    covered = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert families - covered == set(), f"not on the dashboard: {sorted(families - covered)}"


def test_panels_are_laid_out_without_overlap():
    dash = json.loads(DASHBOARD.read_text())
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
