"""torch.compile's portable cache artifacts as files, for the studio (optim/compile.py) and the trainer
(training/compile_cache.py).

`torch.compiler.save_cache_artifacts()` (torch >= 2.7) returns everything the process compiled or loaded
(inductor's FX-graph cache with its Triton kernels, the AOT-autograd cache, autotuning results) as one byte
string, and `load_cache_artifacts(bytes)` puts such a string back into a fresh process's caches before it
compiles. This module only moves those bytes to and from disk: written atomically (core.atomic, so a kill
never leaves half a file to load), read plain or xz-packed (`.xz`, the form a file travels in). What to do
with a file that will not load (report it, delete it) is the caller's decision.
"""
from __future__ import annotations

import lzma
from pathlib import Path

import torch

from core.atomic import write_atomic


def supported() -> bool:
    """Whether this torch has the portable cache artifacts API."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def artifact_count(info) -> int:
    """How many cache entries a CacheInfo (what load and save return) holds."""
    return int(sum(len(keys) for keys in getattr(info, "artifacts", {}).values()))


def load_file(path: str | Path) -> tuple[int, object]:
    """Load the artifacts in `path` (plain, or xz when it ends in .xz) into this process's compile caches.

    Returns (bytes loaded, CacheInfo). Raises ValueError for a file torch does not take as artifacts of
    this version, and whatever reading or unpacking raises (OSError, LZMAError) for a damaged one."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".xz":
        raw = lzma.decompress(raw)
    info = torch.compiler.load_cache_artifacts(raw)
    if info is None:
        raise ValueError(f"{path.name} is not a cache artifacts file of torch {torch.__version__}")
    return len(raw), info


def save_file(path: str | Path) -> tuple[int, object] | None:
    """Write every artifact this process has compiled or loaded so far to `path`, atomically.

    Returns (bytes written, CacheInfo), or None when torch has nothing to write."""
    saved = torch.compiler.save_cache_artifacts()
    if not saved or not saved[0]:
        return None
    data, info = saved
    write_atomic(path, lambda tmp: tmp.write_bytes(data))
    return len(data), info
