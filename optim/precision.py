"""Precision: fp32 reference, TF32 matmuls, AMP autocast in fp16/bf16."""
from __future__ import annotations

import contextlib

import torch

from core.types import OptimizationFlags

_AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}


def prepare(module, flags: OptimizationFlags, device: torch.device, kind: str):
    p = flags.precision
    if p == "fp32":
        return module, {"applied": True, "mode": "fp32", "reason": "full precision reference"}
    if p == "tf32":
        if device.type != "cuda":
            return module, {"applied": False, "mode": "fp32", "reason": "TF32 needs an NVIDIA GPU (Ampere or newer); ran in fp32"}
        return module, {"applied": True, "mode": "tf32", "reason": "TF32 matmuls and convolutions"}
    if device.type == "cpu" and p == "fp16":
        return module, {"applied": False, "mode": "fp32",
                        "reason": "fp16 autocast is not useful on the CPU (no fast fp16 kernels); ran in fp32 — use bf16 on CPU"}
    if device.type == "cuda" and p == "bf16" and not torch.cuda.is_bf16_supported():
        return module, {"applied": False, "mode": "fp32", "reason": "this GPU has no bf16 support; ran in fp32"}
    return module, {"applied": True, "mode": f"autocast-{p}", "reason": f"AMP autocast in {p} (weights stay fp32)"}


def runtime(flags: OptimizationFlags, device: torch.device):
    p = flags.precision
    stack = contextlib.ExitStack()
    if device.type == "cuda" and p == "tf32":
        stack.enter_context(_tf32())
    elif p in _AMP and not (device.type == "cpu" and p == "fp16"):
        if not (device.type == "cuda" and p == "bf16" and not torch.cuda.is_bf16_supported()):
            stack.enter_context(torch.autocast(device_type=device.type, dtype=_AMP[p]))
    return stack


@contextlib.contextmanager
def _tf32():
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
