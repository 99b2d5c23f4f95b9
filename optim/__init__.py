"""Optimization toggles. Each toggle is a small unit; `prepare` applies the
module-level ones once (when the model manager loads a model for a set of
flags) and `runtime` gives the per-call context (autocast, TF32).

Every toggle reports `{"applied": bool, "reason": str, ...details}` so the
CLI JSON, the PNG metadata and the UI can say what really ran.
"""
from optim.registry import prepare, runtime, requested_toggles  # noqa: F401
