import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"
TESTDATA = SHARED / "testdata"

# Without a GPU, Triton kernels run in Triton's interpreter (tests/test_kernels.py). Triton reads
# this when it is imported, so it is set before any test module imports it.
if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The studio imports diffusers in a background thread once it serves (pipelines/preload.py). In this process
# tests import diffusers themselves at any moment, so the UI tests' in-process servers leave it off; the
# subprocess tests in tests/test_preload.py turn it on explicitly.
os.environ.setdefault("ATELIER_PRELOAD", "0")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `make test-gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def testdata() -> Path:
    if not TESTDATA.is_dir():
        pytest.skip(f"shared test data not found at {TESTDATA}")
    return TESTDATA


@pytest.fixture(scope="session")
def tiny_sd_sdxl(tmp_path_factory) -> dict:
    """Tiny SD and SDXL diffusers folders (random weights, real configs' structure), built once per
    session and only read: {"sd": folder, "sdxl": folder}."""
    from tests.diffusion_tiny import build_tiny_sd, build_tiny_sdxl

    root = tmp_path_factory.mktemp("tiny-diffusion")
    build_tiny_sd(root / "tiny-sd")
    build_tiny_sdxl(root / "tiny-sdxl")
    return {"sd": root / "tiny-sd", "sdxl": root / "tiny-sdxl"}
