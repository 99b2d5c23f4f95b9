"""Memory comes back (issue 13): a request too large for the device fails clearly and leaves nothing behind, and
switching models back and forth does not grow the process. Each runs in a child (tests/memory_child.py) that
reads its own resident memory; the out-of-memory one under a real address-space limit (RLIMIT_AS), so the CPU
allocator really fails, as the GPU's would with a request too large for its memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


CHILD = Path(__file__).resolve().parent / "memory_child.py"
MiB = 1 << 20


def run_child(mode: str, tmp_path: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, str(CHILD), mode, str(tmp_path)], capture_output=True, text=True,
                          timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_request_too_large_fails_clearly_and_memory_comes_back_20_times(tmp_path, testdata):
    out = run_child("oom", tmp_path)
    baseline = out["baseline_rss"]
    assert len(out["rounds"]) == 20
    for i, r in enumerate(out["rounds"]):
        # a clear error that says what to do, with the allocator's own words (a real failed allocation)
        assert r["error"] is not None, f"round {i}: the huge request did not fail under the limit"
        assert r["error"].startswith("out of memory for this request") and "lower the batch size" in r["error"]
        assert "can't allocate memory" in r["error"] and "alloc_cpu.cpp" not in r["error"]
        # no tensor of the failed request is alive while its error is held (no traceback keeps them): its smallest
        # activation is 16 MiB (2048 x 128 x 4 x 4 fp32); what may differ from the baseline is the previous
        # round's normal result (4 x 3 x 64 x 64 fp32 = 192 KiB), still referenced by the child's loop
        extra = r["tensor_bytes_after_failure"] - out["baseline_tensor_bytes"]
        assert extra <= 1 * MiB, f"round {i}: {extra / MiB:.1f} MiB of tensors still alive after the failure"
        # ... and the memory comes back to the system. The baseline is read after the same heap trim the studio
        # does after a failure; glibc then still keeps 5-45 MiB of freed pages or not (measured over 7 runs of 20
        # rounds), where a kept activation of the failing 16x16 stage would be 256 MiB.
        assert r["rss_after_failure"] <= baseline + 80 * MiB, \
            f"round {i}: {(r['rss_after_failure'] - baseline) / MiB:.0f} MiB above the baseline after the failure"
        # ... and the next normal request runs as before, making the same images (same pipeline object); it is not
        # trimmed after (measured 64-91 MiB above the trimmed baseline)
        assert r["normal_images"] == 4 and r["normal_max_diff"] <= 1e-6, r
        assert r["rss_after_normal"] <= baseline + 160 * MiB, \
            f"round {i}: {(r['rss_after_normal'] - baseline) / MiB:.0f} MiB above the baseline after a normal request"


def test_fifty_model_switches_plateau(tmp_path, testdata):
    out = run_child("switch", tmp_path)
    rss, loaded = out["rss"], out["loaded"]
    assert len(rss) == 50
    # every switch really swapped the model: one pipeline cached, the other model's
    assert all(len(m) == 1 for m in loaded) and len({m[0] for m in loaded}) == 2
    assert all(a != b for a, b in zip(loaded, loaded[1:]))
    # the tensors alive after a switch are those of the one cached model: the same at switch 30-50 as at
    # switch 10 or 11 with the same model (a pipeline kept alive would add its 7.6 MiB of fp32 weights)
    tb = out["tensor_bytes"]
    for i in range(29, 50):
        assert abs(tb[i] - tb[9 + (i - 9) % 2]) <= MiB // 4, f"switch {i + 1}: {(tb[i] - tb[9]) / MiB:.1f} MiB more tensors"
    # resident memory after switches 30-50 stays within 40 MiB of switch 10's (each model is ~3.5 MiB on disk,
    # so a pipeline kept alive every other switch would add ~35 MiB by switch 30 and ~70 MiB by switch 50;
    # measured without a leak: 4-12 MiB, glibc's freed pages moving from run to run)
    after_10 = rss[9]
    worst = max(rss[29:50])
    assert worst <= after_10 + 40 * MiB, \
        f"RSS grew {(worst - after_10) / MiB:.1f} MiB between switch 10 and switches 30-50: {[x // MiB for x in rss]}"
