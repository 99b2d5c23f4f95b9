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


# -- out of memory ------------------------------------------------------------------------------
# What an allocation failure says when it is not torch.OutOfMemoryError: the CPU allocator under an
# address-space limit or a full machine ("DefaultCPUAllocator: can't allocate memory"), oneDNN's scratchpad,
# and CUDA errors raised as RuntimeError by extensions
_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate memory",
             "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (GPU or CPU), not a bug."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def release_memory(device: torch.device | None = None) -> None:
    """Give back what a failed request held: collect its cycles, empty the CUDA cache, and ask glibc to
    return freed heap pages to the system (malloc_trim), so resident memory falls back to its baseline."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.empty_cache()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc: the allocator keeps its pages, nothing to do
        pass


# -- what the CPU runs fast ----------------------------------------------------------------------
_X86_BF16 = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}


def cpu_bf16(cpuinfo: str | None = None) -> tuple[bool, str]:
    """(bf16 is fast on this CPU, what it has). Without bf16 instructions (x86: AVX512-BF16 or AMX;
    Arm: the BF16 extension) oneDNN emulates bf16 and it runs many times slower than fp32 (20-55x
    measured on an AVX2 machine). `cpuinfo`: /proc/cpuinfo's text (read when None);
    ATELIER_CPU_BF16=0/1 overrides the detection."""
    forced = os.environ.get("ATELIER_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1", ("bf16 instructions (ATELIER_CPU_BF16=1)" if forced == "1"
                               else "no bf16 instructions (ATELIER_CPU_BF16=0)")
    if cpuinfo is None:
        return _cpu_bf16_here()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    found = [name for flag, name in _X86_BF16.items() if flag in flags]
    if not found and "bf16" in flags:           # aarch64 'Features: ... bf16'
        found = ["Arm BF16"]
    if found:
        return True, " and ".join(found)
    return False, "no bf16 instructions (no AVX512-BF16 or AMX)"


@functools.lru_cache(maxsize=1)
def _cpu_bf16_here() -> tuple[bool, str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_bf16(f.read())
    except OSError:          # not Linux: ask torch what vector unit it dispatches to
        cap = str(getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")() or "")
        return ("AMX" in cap.upper()), (f"{cap} (bf16 instructions unknown)" if cap else "bf16 instructions unknown")
