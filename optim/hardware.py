"""What this machine can do, detected once: CUDA compute capability, optional packages, a C++ compiler.

Toggles ask here instead of importing optional packages at module import time, so that a
missing package costs nothing until someone asks for the toggle that needs it.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import torch

NO_GPU = "this machine has no CUDA GPU"


@functools.lru_cache(maxsize=None)
def has_package(name: str) -> bool:
    """Importable without importing it (find_spec does not run the package's code)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device a request runs on; None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def gpu_name(device: torch.device) -> str:
    if device.type != "cuda" or not torch.cuda.is_available():
        return "none"
    return torch.cuda.get_device_name(device)


def where(device: torch.device) -> str:
    """The end of a skip reason: what this request runs on."""
    if not torch.cuda.is_available():
        return NO_GPU
    if device.type != "cuda":
        return f"this request runs on the {device.type.upper()}"
    major, minor = capability(device)  # type: ignore[misc]
    return f"this GPU ({gpu_name(device)}) is {major}.{minor}"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU (it honours $CXX)."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def package_version(name: str) -> str | None:
    if not has_package(name):
        return None
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # a package without metadata still imports
        return "unknown"
