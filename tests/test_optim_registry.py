"""optim.prepare / runtime / availability / strict: the contract every toggle reports through."""
import pytest
import torch

import optim
from core.errors import InputError, OptionalDependencyError
from core.types import OptimizationFlags as Flags
from optim.fp8 import unavailable_reason as fp8_reason
from optim.tensorrt import TENSORRT_MISSING
from tests.optim_helpers import CPU, prepared

NAMES = {"precision", "channels_last", "attention", "fuse_qkv", "compile", "request_graph", "fp8", "prune", "tensorrt", "memory",
         "tiny_vae"}
ALL_FLAGS = Flags(precision="bf16", channels_last=True, attention="xformers", compile="default", fp8=True,
                  prune_amount=0.25, prune_method="structured", tensorrt=True, memory=("vae-tiling",),
                  fuse_qkv=True, request_graph=True, tiny_vae=True)


def test_availability_covers_every_toggle_with_a_reason():
    av = optim.availability("cpu")
    assert set(av) == NAMES
    for name, (ok, reason) in av.items():
        assert isinstance(ok, bool) and isinstance(reason, str) and len(reason) > 10, name
    if not torch.cuda.is_available():
        assert av["fp8"] == (False, "FP8 needs compute capability 8.9 or newer (Ada/Hopper); this machine has no CUDA GPU")
        assert av["precision"][0] and "bf16" in av["precision"][1]


def test_pipelines_tools_facade_uses_optim_availability():
    from pipelines.tools import optimization_availability

    assert set(optimization_availability("cpu")) == NAMES


def test_requested_toggles():
    assert optim.requested_toggles(Flags()) == ["precision"]
    assert set(optim.requested_toggles(ALL_FLAGS)) == NAMES


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU skip reasons")
def test_every_toggle_reports_applied_or_why_not(testdata):
    G, report = prepared(testdata, "sg2_uncond_32", ALL_FLAGS)
    assert list(report) == [n for n in optim.NAMES if n in report]          # stable order for JSON and UI
    assert set(report) == NAMES
    for name, r in report.items():
        assert isinstance(r["applied"], bool) and isinstance(r["reason"], str) and r["reason"], name
    assert report["precision"]["applied"] and report["precision"]["mode"] == "autocast-bf16"
    assert report["channels_last"]["applied"]
    assert report["prune"]["applied"] and report["prune"]["params_after"] < report["prune"]["params_before"]
    assert report["compile"]["applied"]                                     # g++ is present on CI
    assert not report["attention"]["applied"] and "no attention" in report["attention"]["reason"]
    assert report["fp8"] == {"applied": False, "reason": fp8_reason(CPU)}
    assert report["fp8"]["reason"] == "FP8 needs compute capability 8.9 or newer (Ada/Hopper); this machine has no CUDA GPU"
    assert report["tensorrt"]["reason"] == TENSORRT_MISSING
    assert not report["memory"]["applied"] and "diffusion" in report["memory"]["reason"]


def test_strict_turns_a_skip_into_an_error(testdata):
    with pytest.raises(OptionalDependencyError) as e:
        prepared(testdata, "sg2_uncond_32", Flags(attention="math", strict=True))
    assert "--strict" in str(e.value) and "attention" in str(e.value)
    # strict with toggles that all run is fine
    _, report = prepared(testdata, "sg2_uncond_32", Flags(precision="bf16", channels_last=True, strict=True))
    assert all(r["applied"] for r in report.values())


def test_bad_targets_are_input_errors():
    with pytest.raises(InputError):
        optim.prepare(torch.nn.Linear(2, 2), Flags(), "cpu", kind="stylegan")
    with pytest.raises(InputError):
        optim.prepare(object(), Flags(), "cpu", kind="diffusion")
    with pytest.raises(InputError):
        optim.prepare(torch.nn.Linear(2, 2), Flags(), "cpu", kind="gan")
