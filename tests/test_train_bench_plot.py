"""scripts/plot_train_bench.py on the committed H200 ladder and run log (real files, CPU only)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import plot_train_bench  # noqa: E402

BENCH = ROOT / "docs" / "results" / "2026-12-02-8429f28-train-bench-1gpu.json"
LOG = ROOT / "docs" / "results" / "2026-12-02-8429f28-emoji64-log.jsonl"


def test_run_rate_is_the_median_after_warm_up(tmp_path):
    log = tmp_path / "log.jsonl"
    rows = [{"kind": "train", "img_s": v} for v in (10.0, 20.0, 300.0, 100.0, 200.0)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"kind": "monitor"}]))
    assert plot_train_bench.run_rate(log, skip=2) == (200.0, 3)
    assert plot_train_bench.run_rate(log, skip=99) == (100.0, 5)      # too few lines: all of them
    (tmp_path / "empty.jsonl").write_text(json.dumps({"kind": "end"}) + "\n")
    with pytest.raises(ValueError, match="no train records"):
        plot_train_bench.run_rate(tmp_path / "empty.jsonl")


def test_plot_of_the_committed_ladder(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "ladder.png"
    assert plot_train_bench.main([str(BENCH), str(out), "--run-log", str(LOG)]) == 0
    from PIL import Image

    assert Image.open(out).size[0] > 600
    rate, n = plot_train_bench.run_rate(LOG)
    assert 1000 < rate < 5000 and n > 50        # the committed run: ~2,300 img/s over ~80 log lines
