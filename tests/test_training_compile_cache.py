"""--compile-cache: the trainer's portable compile cache (training/compile_cache.py). Real compiles on the CPU
(inductor's C++ backend) of the tiny network, each run in its own process with its own empty inductor cache
folder, as a fresh GPU machine would be: the first run compiles and writes the file; a second "machine" given
only that file (also xz-packed, the form it travels in) reads its graphs from it instead of compiling them.
A damaged file is reported and the run compiles as if it had none."""
from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training_helpers import square_images, tiny_cfg
from training import compile_cache
from training.dataset import DatasetInfo
from training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent

_RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from training import cli
    sys.exit(cli.main(["--config", "tiny", "--data", sys.argv[1], "--out", sys.argv[2], "--device", "cpu",
                       "--kimg", "0.016", "--batch", "8", "--compile", "--compile-cache", sys.argv[3],
                       "--no-progress", "--log-every", "1", "--snapshot-kimg", "0", "--monitor-kimg", "0"]))
""")


def _fresh_machine_run(tmp: Path, name: str, data: Path, cache: Path) -> tuple[list[dict], str]:
    """One training run in a new process whose inductor and triton caches start empty."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / name / "inductor"),
               TRITON_CACHE_DIR=str(tmp / name / "triton"))
    out = tmp / name / "run"
    res = subprocess.run([sys.executable, "-c", _RUN.format(root=str(ROOT)), str(data), str(out), str(cache)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return recs, res.stdout


def _compile_record(recs: list[dict]) -> dict:
    found = [r for r in recs if r.get("kind") == "compile"]
    assert len(found) == 1, [r.get("kind") for r in recs]
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_fresh_machine_given_the_file_reads_its_graphs_instead_of_compiling_them(tmp_path):
    data = tmp_path / "squares.npy"
    np.save(data, square_images(24, 16))
    cache = tmp_path / "cache"

    recs, said = _fresh_machine_run(tmp_path, "first", data, cache)
    first = _compile_record(recs)
    assert "none for this GPU" in said and first["cache_loaded"] == {"file": None}
    assert first["fx_miss"] >= 1 and first["fx_hit"] == 0            # everything compiled here
    saved = Path(first["cache_saved"]["file"])
    assert saved == compile_cache.cache_file(cache, "cpu") and saved.stat().st_size > 0
    assert first["cache_saved"]["artifacts"] >= first["fx_miss"]
    assert "[compile] first iteration" in said and "saved" in said
    assert all(np.isfinite(r["loss_G"]) for r in recs if r.get("kind") == "train")

    # a second machine with only the file: the FX graphs come from it, none is compiled again
    recs, said = _fresh_machine_run(tmp_path, "second", data, cache)
    second = _compile_record(recs)
    assert second["cache_loaded"]["file"] == str(saved) and second["cache_loaded"]["artifacts"] >= 1
    assert second["fx_hit"] >= 1 and second["fx_miss"] == 0, second
    assert "compile cache: loaded" in said
    # ... and, having compiled nothing, it leaves the file as it was (a re-save would hold fewer entries)
    assert second["cache_saved"] is None and "not saved again" in said

    # the travelling form: xz-packed, alone in its folder
    packed_dir = tmp_path / "carried"
    packed_dir.mkdir()
    packed = packed_dir / (saved.name + ".xz")
    packed.write_bytes(lzma.compress(saved.read_bytes()))
    recs, _ = _fresh_machine_run(tmp_path, "third", data, packed_dir)
    third = _compile_record(recs)
    assert third["cache_loaded"]["file"] == str(packed) and third["fx_hit"] >= 1 and third["fx_miss"] == 0
    assert not compile_cache.cache_file(packed_dir, "cpu").exists()  # nothing new compiled: nothing written


def test_file_names_keep_devices_and_torch_versions_apart(tmp_path):
    f = compile_cache.cache_file(tmp_path, "cpu")
    assert f.parent == tmp_path and f.name.startswith("train-torch") and f.name.endswith("-cpu.bin")
    assert torch.__version__.split("+")[0] in f.name
    assert compile_cache.device_slug("cpu") == "cpu"
    # nothing there: no file, no error
    assert compile_cache.load(tmp_path, "cpu") == {"file": None}


@pytest.mark.parametrize("packed", [False, True])
def test_a_damaged_file_is_reported_and_the_run_compiles_without_it(tmp_path, packed):
    f = compile_cache.cache_file(tmp_path, "cpu")
    junk = b"\x00not an artifacts file" * 10
    if packed:
        f = f.with_name(f.name + ".xz")
        junk = lzma.compress(junk)[:-7]                              # a packed file cut short in transit
    f.write_bytes(junk)
    got = compile_cache.load(tmp_path, "cpu")
    assert got["file"] == str(f) and got["error"]
    data = square_images(24, 16)
    tr = Trainer(tiny_cfg("squares", tmp_path / "run", 0.016, batch=8, compile=True, compile_cache=str(tmp_path)),
                 data=(data, DatasetInfo(source="squares", count=24, resolution=16, channels=3, decoder="array")),
                 write_outputs=False, log=lambda s: None)
    note = tr._compile_cache_note()
    assert "not used" in note and "compiling from scratch" in note and str(f) in note


def test_the_option_is_a_machine_setting_that_a_resume_may_change():
    from training.cli import _PASS_THROUGH, build_parser
    from training.trainer import RESUME_OVERRIDABLE, RESUME_RETUNABLE

    args = build_parser().parse_args(["--compile", "--compile-cache", "some/dir"])
    assert args.compile_cache == "some/dir" and "compile_cache" in _PASS_THROUGH
    assert "compile_cache" in RESUME_OVERRIDABLE and "compile_cache" not in RESUME_RETUNABLE


def test_without_compile_the_cache_folder_is_named_as_unused_and_left_alone(tmp_path):
    said = []
    data = square_images(24, 16)
    tr = Trainer(tiny_cfg("squares", tmp_path / "run", 0.008, batch=8, compile=False, compile_cache=str(tmp_path / "cc"),
                          monitor_kimg=0.0),
                 data=(data, DatasetInfo(source="squares", count=24, resolution=16, channels=3, decoder="array")),
                 write_outputs=False, log=said.append)
    tr.run()
    assert any("--compile-cache" in s and "add --compile" in s for s in said), said
    assert not (tmp_path / "cc").exists()


def test_the_time_budget_judges_the_next_interval_without_the_first_iterations_compile():
    from training.trainer import next_interval_estimate

    # the 2026-12-08 cold H100 run: the first log point (100 iterations of 256) came 189 s after the start, its
    # interval about 160 s, 151.4 s of it the first iteration's compile. A 5-minute sitting judged by that
    # interval (189 + 160 + 45 s reserve > 300) stopped there with ~110 s unused; the 99 other iterations say
    # the next interval takes under 9 s, so it trains on (189 + 9 + 45 < 300)
    est = next_interval_estimate(160.0, 151.4, 100)
    assert est == pytest.approx(8.6 * 100 / 99)
    assert 189.0 + est + 45.0 < 300.0 < 189.0 + 160.0 + 45.0
    # later intervals, and an interval of one iteration (nothing else to go by), are taken as they were
    assert next_interval_estimate(8.0, None, 100) == 8.0
    assert next_interval_estimate(50.0, 49.0, 1) == 50.0
    # a first iteration measured longer than its interval (clock granularity) never gives a negative estimate
    assert next_interval_estimate(10.0, 10.5, 100) == 0.0
