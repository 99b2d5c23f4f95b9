"""The trainer's portable compile cache (`--compile-cache DIR`): torch.compile's work carried to a fresh machine.

With `--compile` the first iteration of a run compiles G's and D's steps: about two minutes on a cold H100
for the emoji64 network (the 2026-12-07 sitting's first log point came at 152 s, 8 s of it training), out of
a GPU sitting of twenty. Inductor keeps what it compiled in a cache on the machine's local disk, so a second
run on the *same* machine starts in seconds; a rented GPU machine starts empty every time. PyTorch's
portable cache artifacts (`torch.compiler.save_cache_artifacts`, torch >= 2.7: the FX-graph cache with its
Triton kernels, the AOT-autograd cache and the autotuning results) are one byte string that
`load_cache_artifacts` puts back into a fresh machine's caches before the first compile.

One file per (torch version, device) in DIR: inductor keys its entries by the GPU's name, so an H100's
artifacts never hit on an H200 (they load harmlessly and are simply never read). A file may be
xz-compressed (`.bin.xz`, the form it travels in); a stale, truncated or foreign file costs only the compile
it was meant to save: it is reported and skipped, never fatal. The trainer saves after the first log point
(every graph of a training step has compiled by then) and again at the end if anything new compiled.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from core import compile_artifacts


def device_slug(device: torch.device | str) -> str:
    """The device part of the file name: the GPU's name (what inductor keys its entries by) or the device type."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = device.type
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or device.type


def cache_file(folder: str | Path, device: torch.device | str) -> Path:
    """Where this torch version's artifacts for `device` live in `folder` (uncompressed form)."""
    version = re.sub(r"[^A-Za-z0-9.]+", "_", torch.__version__)
    return Path(folder) / f"train-torch{version}-{device_slug(device)}.bin"


supported = compile_artifacts.supported


def counters() -> dict[str, int]:
    """Cache hits and misses of this process so far: inductor's FX-graph cache and the AOT-autograd cache."""
    from torch._dynamo.utils import counters as c

    return {"fx_hit": int(c["inductor"]["fxgraph_cache_hit"]), "fx_miss": int(c["inductor"]["fxgraph_cache_miss"]),
            "aot_hit": int(c["aot_autograd"]["autograd_cache_hit"]),
            "aot_miss": int(c["aot_autograd"]["autograd_cache_miss"])}


def load(folder: str | Path, device: torch.device | str) -> dict:
    """Load this device's artifacts from `folder` into the process's compile caches, before anything compiles.

    Returns {"file", "mib", "artifacts"} for a loaded file, {"file": None} when there is none, or {"file",
    "error"} for one that could not be loaded (the run goes on and compiles as if there were none)."""
    if not supported():
        return {"file": None, "error": f"torch {torch.__version__} has no portable compile cache (needs >= 2.7)"}
    plain = cache_file(folder, device)
    packed = plain.with_name(plain.name + ".xz")
    # the newer of the two: a run writes the plain file; a carried one arrives packed
    found = sorted((p for p in (plain, packed) if p.is_file()), key=lambda p: p.stat().st_mtime)
    if not found:
        return {"file": None}
    path = found[-1]
    try:
        nbytes, info = compile_artifacts.load_file(path)
    except Exception as e:  # noqa: BLE001 - a bad file costs a compile, never the run
        return {"file": str(path), "error": f"{type(e).__name__}: {e}"}
    return {"file": str(path), "mib": round(nbytes / 2**20, 2), "artifacts": compile_artifacts.artifact_count(info)}


def pending() -> bool:
    """Whether something compiled (or was read from a cache) since the last save."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:           # an older layout: save and let the file's content decide
        return True
    return bool(CacheArtifactManager.need_serialize())


def covered(loaded: dict | None) -> bool:
    """Whether the file `load` read served every graph this process has compiled so far (FX-graph and
    AOT-autograd caches: hits, no misses). Saving again would only rewrite that file, and with fewer entries
    (an H100 run given 280 artifacts re-recorded 266 of them, 2026-12-08)."""
    if not loaded or not loaded.get("file") or loaded.get("error"):
        return False
    c = counters()
    return c["fx_hit"] + c["aot_hit"] > 0 and c["fx_miss"] == 0 and c["aot_miss"] == 0


def save(folder: str | Path, device: torch.device | str, loaded: dict | None = None) -> dict | None:
    """Write everything this process compiled or loaded to `folder` (atomically); None when there is nothing
    new to write: nothing compiled, or (`loaded`, what `load` returned) every graph came from that file. The
    bytes are cumulative: each save holds every artifact of the process so far."""
    path = cache_file(folder, device)
    try:
        if not supported() or not pending() or covered(loaded):
            return None
        saved = compile_artifacts.save_file(path)
        if saved is None:
            return None
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written must not end a training run
        return {"file": str(path), "error": f"{type(e).__name__}: {e}"}
    return {"file": str(path), "mib": round(saved[0] / 2**20, 2), "artifacts": compile_artifacts.artifact_count(saved[1])}
