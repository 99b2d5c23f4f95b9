"""Memory readings: torch's CUDA allocator, NVML for the whole device, process RSS on CPU.

Each reading is a handful of counters (no device sync), so the UI can poll it
at 2 Hz without costing the job anything measurable.
"""
from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass

import torch


@dataclass
class MemoryReading:
    kind: str                         # "cuda" or "cpu-rss"
    device_name: str
    allocated: int = 0                # torch allocator, bytes (cuda)
    reserved: int = 0
    peak: int = 0                     # allocator peak since the last reset (the current job's peak)
    device_used: int | None = None    # NVML: every process on the device
    device_total: int | None = None
    rss: int | None = None            # CPU: resident set size of this process

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=1)
def _nvml():
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver: NVML is optional
        return None


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def read_memory(device: torch.device | str | None = None) -> MemoryReading:
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        r = MemoryReading(
            kind="cuda",
            device_name=torch.cuda.get_device_name(idx),
            allocated=int(torch.cuda.memory_allocated(idx)),
            reserved=int(torch.cuda.memory_reserved(idx)),
            peak=int(torch.cuda.max_memory_allocated(idx)),
        )
        nv = _nvml()
        if nv is not None:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(idx)
                info = nv.nvmlDeviceGetMemoryInfo(h)
                r.device_used, r.device_total = int(info.used), int(info.total)
            except Exception:
                pass
        if r.device_total is None:
            free, total = torch.cuda.mem_get_info(idx)
            r.device_used, r.device_total = int(total - free), int(total)
        return r
    import psutil

    proc = psutil.Process(os.getpid())
    return MemoryReading(kind="cpu-rss", device_name=_cpu_name(), rss=int(proc.memory_info().rss),
                         device_total=int(psutil.virtual_memory().total))


def free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
