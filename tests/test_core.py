import numpy as np
import pytest

from core.errors import InputError
from core.types import (DiffusionParams, GenerationRequest, Job, OptimizationFlags, StyleGANParams, check_seed,
                        parse_seeds)
from core.errors import Cancelled


def test_parse_seeds_ranges_and_lists():
    assert parse_seeds("0-3") == (0, 1, 2, 3)
    assert parse_seeds("1,5, 9") == (1, 5, 9)
    assert parse_seeds("7") == (7,)
    assert parse_seeds("0-1,10") == (0, 1, 10)


@pytest.mark.parametrize("bad", ["-1", "4294967296", "abc", "3-1", "", "1.5"])
def test_parse_seeds_rejects(bad):
    with pytest.raises(InputError):
        parse_seeds(bad)


def test_check_seed_bounds():
    assert check_seed(2**32 - 1) == 2**32 - 1
    with pytest.raises(InputError, match="0..4294967295"):
        check_seed(2**32)
    with pytest.raises(InputError):
        check_seed(1.5)


def test_stylegan_params_validation():
    with pytest.raises(InputError, match="finite"):
        StyleGANParams(seeds=(0,), truncation_psi=float("nan"))
    with pytest.raises(InputError, match="noise mode"):
        StyleGANParams(seeds=(0,), noise_mode="loud")
    with pytest.raises(InputError):
        DiffusionParams(seed=-3)


def test_flags_roundtrip_and_validation():
    f = OptimizationFlags(precision="bf16", channels_last=True, memory=("vae-tiling",))
    assert OptimizationFlags.from_dict(f.to_dict()) == f
    with pytest.raises(InputError):
        OptimizationFlags(precision="fp64")
    with pytest.raises(InputError):
        OptimizationFlags(prune_amount=1.5)
    with pytest.raises(InputError):
        GenerationRequest("gan", None, StyleGANParams())


def test_job_stage_timing_and_cancel():
    events = []
    job = Job(on_progress=events.append)
    with job.stage("work"):
        job.step(1, 3)
    assert job.timings_ms["work"] >= 0 and events[0].step == 1 and events[0].total == 3
    job.cancel()
    with pytest.raises(Cancelled):
        job.step(2, 3)
    assert len(job.trace) == 2


def test_flags_name_the_toggles_they_turn_on():
    from core.types import OptimizationFlags

    assert OptimizationFlags().requested() == set()
    assert OptimizationFlags(strict=True).requested() == set()
    f = OptimizationFlags(precision="bf16", channels_last=True, compile="reduce-overhead", fp8=True, prune_amount=0.2,
                          tensorrt=True, attention="math", memory=("vae-tiling",))
    assert f.requested() == {"precision", "channels_last", "compile", "fp8", "prune", "tensorrt", "attention", "memory"}
