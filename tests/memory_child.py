"""Run in a child process by tests/test_memory_recovery.py: the studio's model manager under memory stress, with
resident memory read after each step. Prints one JSON object on stdout.

    python tests/memory_child.py oom OUT_DIR       20 requests too large for a 512 MiB address-space allowance
    python tests/memory_child.py switch OUT_DIR    50 switches between the bundled model and an NVlabs pickle

A child because the address-space limit (RLIMIT_AS) cannot be lifted again in the process it is set in, and
so that memory readings are of this work alone.
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np      # noqa: E402
import psutil           # noqa: E402
import torch            # noqa: E402

from core.device import release_memory                       # noqa: E402
from core.errors import OutOfMemory                          # noqa: E402
from core.settings import Settings                            # noqa: E402
from core.types import GenerationRequest, StyleGANParams      # noqa: E402
from pipelines.services import build_services                 # noqa: E402

EMOJI = ROOT / "assets" / "models" / "emoji64.safetensors"    # the bundled StyleGAN model
MiB = 1 << 20
NVLABS = ROOT.parent / "shared" / "testdata" / "stylegan" / "sg2_uncond_32.pkl"
HEADROOM = 512 * MiB            # address space allowed above what the warmed-up process already maps


def rss() -> int:
    return psutil.Process().memory_info().rss


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage Python can still reach: what a failed request left alive,
    free of the allocator's noise (which pages glibc keeps moves RSS by 16-40 MiB from run to run)."""
    import gc

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                st = obj.untyped_storage()
            except RuntimeError:            # tensors without storage (meta, some wrappers)
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def services(out: Path, models, max_cached: int = 4):
    settings = Settings(models_dirs=(), extra_models=tuple(str(m) for m in models), output_dir=out / "outputs",
                        cache_dir=out / "cache", default_stylegan_model=str(models[0]), device="cpu")
    s = build_services(settings)
    s.manager.max_cached = max_cached
    return s


def oom(out: Path) -> dict:
    manager = services(out, (EMOJI,)).manager
    normal = GenerationRequest("stylegan", str(EMOJI), StyleGANParams(seeds=(0, 1, 2, 3), batch_size=4))
    # 2048 images in one forward pass: gigabytes of activations by the 16x16 layers
    huge = GenerationRequest("stylegan", str(EMOJI), StyleGANParams(seeds=tuple(range(2048)), batch_size=2048))
    ref = manager.generate(normal).raw
    manager.generate(normal)                         # warm: the allocator's steady state for a normal request
    # the baseline in the state a failure leaves (the studio trims the heap after one, core.device.release_memory):
    # untrimmed, it held 20-60 MiB of freed pages or not, depending on where the last frees fell
    release_memory()
    baseline = rss()
    baseline_tensors = live_tensor_bytes()
    mapped = psutil.Process().memory_info().vms
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + HEADROOM, hard))
    rounds = []
    for _ in range(20):
        entry: dict = {}
        kept = None
        try:
            manager.generate(huge)
            entry["error"] = None
        except OutOfMemory as exc:
            entry["error"] = str(exc)
            kept = exc       # held while memory is read, as the studio holds a job's error to report it
        entry["rss_after_failure"] = rss()
        entry["tensor_bytes_after_failure"] = live_tensor_bytes()
        del kept
        result = manager.generate(normal)            # the next normal request
        entry["normal_images"] = len(result.images)
        entry["normal_max_diff"] = float(np.abs(result.raw - ref).max())
        entry["rss_after_normal"] = rss()
        rounds.append(entry)
    return {"baseline_rss": baseline, "baseline_tensor_bytes": baseline_tensors, "limit_headroom": HEADROOM,
            "rounds": rounds}


def switch(out: Path) -> dict:
    # one cached pipeline at a time, so every switch really unloads one model and loads the other
    manager = services(out, (EMOJI, NVLABS), max_cached=1).manager
    requests = [GenerationRequest("stylegan", str(m), StyleGANParams(seeds=(0,), batch_size=1)) for m in (EMOJI, NVLABS)]
    readings, loaded, tensors = [], [], []
    for i in range(1, 51):
        manager.generate(requests[i % 2])
        loaded.append([e["model"] for e in manager.loaded()])
        readings.append(rss())
        tensors.append(live_tensor_bytes())
    return {"rss": readings, "loaded": loaded, "tensor_bytes": tensors, "cuda": torch.cuda.is_available()}


if __name__ == "__main__":
    torch.set_num_threads(2)
    mode, out = sys.argv[1], Path(sys.argv[2])
    print(json.dumps({"oom": oom, "switch": switch}[mode](out)))
