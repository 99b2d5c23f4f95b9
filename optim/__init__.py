"""Optimization toggles. Each toggle is a small unit with `apply(...) -> report`; `prepare`
applies the module-level ones once (when the model manager loads a model for a set of
flags), `runtime` gives the per-call context (autocast, TF32) and `availability` tells the
UI which toggles can run on a device and why not.

Every toggle reports `{"applied": bool, "reason": str, ...details}` so the CLI JSON, the PNG
metadata and the UI can say what really ran. See docs/optimizations.md.
"""
from optim.compile import FIRST_RUN_STATUS, is_first_run, set_status_callback  # noqa: F401
from optim.registry import availability, prepare, requested_toggles, runtime  # noqa: F401
from optim.report import NAMES  # noqa: F401

__all__ = ["prepare", "runtime", "availability", "requested_toggles", "is_first_run", "set_status_callback",
           "FIRST_RUN_STATUS", "NAMES"]
