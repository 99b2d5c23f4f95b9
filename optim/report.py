"""The shape of a toggle's report: `{"applied": bool, "reason": str, ...details}`.

The same dict goes into the CLI JSON, the PNG metadata and the UI, so reasons are
sentences for the artist ("FP8 needs compute capability 8.9 or newer ..."), not codes.
"""
from __future__ import annotations

from typing import Any

ToggleReport = dict[str, Any]

# The order toggles are reported in (and the names the CLI JSON uses).
NAMES = ("precision", "channels_last", "attention", "fuse_qkv", "tiny_vae", "kernels", "compile", "request_graph", "fp8", "prune", "tensorrt", "memory")


def applied(reason: str, **details: Any) -> ToggleReport:
    return {"applied": True, "reason": reason, **details}


def skipped(reason: str, **details: Any) -> ToggleReport:
    return {"applied": False, "reason": reason, **details}


def ordered(report: dict[str, ToggleReport]) -> dict[str, ToggleReport]:
    """The report with toggles in NAMES order (stable JSON for diffs and the UI table)."""
    out = {k: report[k] for k in NAMES if k in report}
    out.update({k: v for k, v in report.items() if k not in out})
    return out
