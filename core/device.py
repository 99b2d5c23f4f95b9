"""Device and dtype helpers. Detected once, cheap to call."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from core.errors import InputError, ResourceError

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(precision: str) -> torch.dtype:
    try:
        return _DTYPES[precision]
    except KeyError:
        raise InputError(f"unknown precision {precision!r}; use fp32, tf32, fp16 or bf16") from None


def pick_device(requested: str | None = None) -> torch.device:
    """'cuda', 'cuda:1', 'cpu', 'mps' or None for the best available."""
    req = requested or os.environ.get("ATELIER_DEVICE") or None
    if req is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        dev = torch.device(req)
    except (RuntimeError, TypeError):
        raise InputError(f"unknown device {req!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ResourceError("device 'cuda' was asked for but no CUDA GPU is visible; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ResourceError(f"{req} was asked for but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


@dataclass(frozen=True)
class GPUInfo:
    name: str
    capability: tuple[int, int]
    total_bytes: int


@functools.lru_cache(maxsize=8)
def gpu_info(index: int = 0) -> GPUInfo | None:
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(index)
    return GPUInfo(p.name, (p.major, p.minor), int(p.total_memory))


def synchronizer(device: torch.device):
    """A callable that waits for queued work on `device` (no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocator memory on CUDA; resident set size of this process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # psutil is in requirements; this only guards odd installs
        return 0
