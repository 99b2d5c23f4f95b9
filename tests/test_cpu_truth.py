"""The CPU's bf16: detected from its instruction set, and only what is fast on the machine at hand is
recommended (the precision toggle's note, the fp16 skip reason, the Compare tab's empty state)."""
from __future__ import annotations

import pytest
import torch

import optim
from core.device import cpu_bf16
from core.errors import InputError
from core.types import GenerationRequest, OptimizationFlags, StyleGANParams
from evaluation.compare import comparison_request
from optim.precision import mode_for

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
NEOVERSE = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpuinfo_flags_decide():
    assert cpu_bf16(AVX2_ONLY) == (False, "no bf16 instructions (no AVX512-BF16 or AMX)")
    fast, what = cpu_bf16(SAPPHIRE)
    assert fast and "AVX512-BF16" in what and "AMX" in what
    assert cpu_bf16(NEOVERSE) == (True, "Arm BF16")


def test_this_machine_is_read(monkeypatch):
    monkeypatch.delenv("ATELIER_CPU_BF16", raising=False)
    text = open("/proc/cpuinfo").read()
    fast, _ = cpu_bf16()
    assert fast == (" avx512_bf16" in text or " amx_bf16" in text or "\tbf16" in text or " bf16 " in text)


@pytest.mark.parametrize("fast", [False, True])
def test_the_cpu_precision_note_recommends_only_what_is_fast(monkeypatch, fast):
    monkeypatch.setenv("ATELIER_CPU_BF16", "1" if fast else "0")
    note = optim.availability(torch.device("cpu"))["precision"][1]
    _mode, fp16_reason = mode_for(OptimizationFlags(precision="fp16"), torch.device("cpu"), "stylegan", False)
    request = GenerationRequest("stylegan", None, StyleGANParams(seeds=(0,)), OptimizationFlags(), "cpu")
    with pytest.raises(InputError) as empty:
        comparison_request(request)
    if fast:
        assert "bf16 autocast" in note and "slower" not in note
        assert "use bf16 on the CPU" in fp16_reason
        assert "e.g. precision bf16)" in str(empty.value)
    else:
        assert "fp32 is the fast one here" in note and "slower" in note
        assert "use bf16" not in fp16_reason and "fp32 is the fastest here" in fp16_reason
        assert "slower than fp32" in str(empty.value)
