"""Applies the toggles named in OptimizationFlags to a model, in a fixed order."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from core.errors import OptionalDependencyError
from core.types import OptimizationFlags
from optim import precision as _precision

Report = dict[str, dict[str, Any]]


def requested_toggles(flags: OptimizationFlags) -> list[str]:
    """Names of the toggles a request asks for (precision is always reported)."""
    names = ["precision"]
    if flags.channels_last:
        names.append("channels_last")
    if flags.attention != "sdpa":
        names.append("attention")
    if flags.compile != "off":
        names.append("compile")
    if flags.fp8:
        names.append("fp8")
    if flags.prune_amount > 0:
        names.append("prune")
    if flags.tensorrt:
        names.append("tensorrt")
    if flags.memory:
        names.append("memory")
    return names


def prepare(module: torch.nn.Module, flags: OptimizationFlags, device: torch.device, kind: str) -> tuple[torch.nn.Module, Report]:
    """Apply module-level toggles. `kind` is 'stylegan' or 'diffusion'. Returns (module, report)."""
    report: Report = {}
    module, report["precision"] = _precision.prepare(module, flags, device, kind)
    for name in requested_toggles(flags)[1:]:
        report[name] = {"applied": False, "reason": "this toggle is not available in this build yet"}
    _enforce_strict(flags, report)
    return module, report


def runtime(flags: OptimizationFlags, device: torch.device):
    """Context manager for one forward call under the requested precision."""
    return _precision.runtime(flags, device)


def _enforce_strict(flags: OptimizationFlags, report: Report) -> None:
    if not flags.strict:
        return
    skipped = {k: v.get("reason", "") for k, v in report.items() if not v.get("applied")
               and not (k == "precision" and flags.precision == "fp32")}
    if skipped:
        detail = "; ".join(f"{k}: {r}" for k, r in skipped.items())
        raise OptionalDependencyError(f"--strict: requested optimizations could not run here ({detail})")


__all__ = ["prepare", "runtime", "requested_toggles", "contextlib"]
