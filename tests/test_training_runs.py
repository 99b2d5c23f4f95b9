"""The training run manager: real `python -m training.cli` child processes (tiny preset, CPU) on a tiny
dataset written here. Start -> log.jsonl grows -> stop (SIGTERM -> checkpoint) -> export -> resume; a
failing run reports the trainer's error; a trainer that ignores SIGTERM is killed after the grace period."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from core.errors import InputError, ResourceError
from training.runs import (FAILED, FINISHED, RUNNING, STOPPED, LogTail, TrainingRunManager, TrainRequest,
                           format_duration)

# One OpenMP thread per trainer: on a busy 2-core box OpenMP's spinning threads make a tiny CPU run ~50x slower.
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def write_tiny_dataset(folder: Path, n: int = 24, res: int = 16) -> Path:
    """White squares with a coloured box each: uint8 (N, res, res, 3), as the trainer reads .npy files."""
    rng = np.random.default_rng(1)
    x = np.full((n, res, res, 3), 255, np.uint8)
    for i in range(n):
        s = rng.integers(3, res // 2)
        y0, x0 = rng.integers(0, res - s, size=2)
        x[i, y0:y0 + s, x0:x0 + s] = rng.integers(0, 255, size=3)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny16.npy"
    np.save(path, x)
    return path


def tiny_request(data: Path, **kw) -> TrainRequest:
    """A run that would take minutes (so it is still going when stopped), logging every iteration."""
    base = dict(data=str(data), preset="tiny", kimg=50, log_every=1, monitor_kimg=0.016, device="cpu")
    return TrainRequest(**{**base, **kw})


def wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def kinds(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r.get("kind") == kind]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("train-data"))


@pytest.fixture
def manager(tmp_path):
    m = TrainingRunManager(tmp_path / "runs", env=CHILD_ENV, grace_s=60)
    yield m
    m.stop_all(wait=True, grace_s=5)


def test_start_follow_stop_export_resume(manager, data, tmp_path):
    st = manager.start(tiny_request(data, name="mine"))
    assert st.state == RUNNING and st.pid and st.folder == tmp_path / "runs" / "mine"
    assert json.loads((st.folder / "run.json").read_text())["request"]["preset"] == "tiny"

    # log.jsonl grows while it runs; the status follows it
    wait_for(lambda: len(kinds(manager.records("mine"), "train")) >= 3, what="three log records")
    first = len(manager.records("mine"))
    wait_for(lambda: len(manager.records("mine")) > first, what="the log to grow")
    wait_for(lambda: kinds(manager.records("mine"), "monitor"), what="a monitor record")
    st = manager.status("mine")
    assert st.state == RUNNING and st.kimg > 0 and st.img_s and st.img_s > 0
    assert st.total_kimg == 50 and st.eta_s is not None and st.eta_s > 0
    assert "diversity" in st.last_monitor and st.last_train["loss_G"] == st.last_train["loss_G"]   # not NaN

    # one run at a time, and a name is not reused by accident
    with pytest.raises(ResourceError, match="still training"):
        manager.start(tiny_request(data, name="other"))

    # another manager on the same folder (a restarted studio) finds the run through run.json and /proc
    other = TrainingRunManager(tmp_path / "runs")
    assert other.active() == "mine" and other.status("mine").state == RUNNING

    st = manager.stop("mine", wait=True)                # the manager's grace_s (60 s) is the hang guard
    assert st.state == STOPPED and st.returncode == 0, st.message    # exited on SIGTERM itself: never SIGKILLed
    assert "killed" not in st.message
    assert st.checkpoint and (st.folder / "state.json").is_file() and (st.folder / "G_ema.safetensors").is_file()
    assert st.samples is not None and st.samples.stat().st_size > 0
    assert "stopped at" in st.message and "checkpoint saved" in st.message
    end = kinds(manager.records("mine"), "end")[-1]
    assert end["stop_reason"] == "stop requested"
    with pytest.raises(ProcessLookupError):            # the whole process group is gone
        os.killpg(st.pid, 0)
    assert other.status("mine").state == STOPPED and other.active() is None
    assert manager.runs() == ["mine"]

    # export: the studio's StyleGAN format, loadable and rendering at the trained size
    with pytest.raises(InputError, match="already exists"):
        manager.start(tiny_request(data, name="mine"))
    paths = manager.export("mine", tmp_path / "models")
    assert paths["weights"] == tmp_path / "models" / "mine.safetensors" and paths["card"].is_file()
    from models.stylegan import load_generator

    import torch

    G = load_generator(paths["weights"], device="cpu").G
    with torch.no_grad():
        img = G(torch.randn(2, G.z_dim), None, noise_mode="const")
    assert img.shape == (2, 3, 16, 16) and torch.isfinite(img).all()

    # resume: the same folder continues from its checkpoint's kimg
    kimg_at_stop = st.kimg
    manager.start(tiny_request(data, name="mine", resume=True))
    wait_for(lambda: manager.status("mine").kimg > kimg_at_stop, what="the resumed run to pass its checkpoint")
    st = manager.stop("mine", wait=True)
    assert st.state == STOPPED and st.kimg > kimg_at_stop
    assert "[resume]" in (st.folder / "stdout.log").read_text()


def test_bad_data_fails_with_the_trainers_error(manager, tmp_path):
    bad = tmp_path / "broken.npy"
    bad.write_text("this is not an image array")
    manager.start(TrainRequest(data=str(bad), preset="tiny", device="cpu", name="broken"))
    wait_for(lambda: not manager.status("broken").active, timeout=60, what="the failing run to exit")
    st = manager.status("broken")
    assert st.state == FAILED and st.returncode == 2
    assert "could not read" in st.message and "broken.npy" in st.message
    assert manager.active() is None


def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, data):
    # a stand-in interpreter that ignores SIGTERM (what a hung trainer looks like from outside); it says when
    # the trap is set, so the SIGTERM cannot arrive before it (which would end it by TERM, not by the KILL)
    ready = tmp_path / "trap-is-set"
    fake = tmp_path / "stubborn-python"
    fake.write_text(f"#!/bin/sh\ntrap '' TERM\n: > '{ready}'\nwhile true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    m = TrainingRunManager(tmp_path / "runs", python=str(fake), grace_s=60)
    st = m.start(tiny_request(data, name="hung"))
    assert st.state == RUNNING
    wait_for(ready.exists, what="the stand-in trainer to ignore SIGTERM")
    st = m.stop("hung", grace_s=1.0)
    assert st.state in ("stopping", STOPPED)
    wait_for(lambda: not m.status("hung").active, timeout=60, what="the SIGKILL")
    st = m.status("hung")
    assert st.state == STOPPED and st.returncode == -signal.SIGKILL and "killed" in st.message


@pytest.mark.parametrize("kw, msg", [
    (dict(data=""), "give the training data"),
    (dict(data="/nonexistent/images"), "not found"),
    (dict(resolution=48), "power of two"),
    (dict(resolution=4), "power of two"),
    (dict(name="../escape"), "run name"),
    (dict(preset="stylegan9"), "unknown preset"),
    (dict(loss="hinge"), "loss must be"),
    (dict(batch=3), "even number"),
    (dict(d_steps=11), "D:G ratio"),
    (dict(kimg=-1), "positive"),
    (dict(labels="assets/datasets/emoji64_labels.json"), "only for class-conditional"),
    (dict(cond="a b"), "class key"),
    (dict(cond="group", labels="/nonexistent/labels.json"), "labels file not found"),
    (dict(cond="group"), "dataset.json inside the data folder"),       # a .npy without labels has none
])
def test_bad_requests_are_refused_before_anything_starts(tmp_path, data, kw, msg):
    m = TrainingRunManager(tmp_path / "runs")
    with pytest.raises(InputError, match=msg):
        m.start(TrainRequest(**{"data": str(data), "preset": "tiny", **kw}))
    assert m.runs() == [] and m.active() is None


def test_unsupported_file_and_missing_checkpoint(tmp_path, data):
    m = TrainingRunManager(tmp_path / "runs")
    txt = tmp_path / "notes.txt"
    txt.write_text("x")
    with pytest.raises(InputError, match="not training data"):
        m.start(TrainRequest(data=str(txt), preset="tiny"))
    with pytest.raises(InputError, match="no checkpoint to resume"):
        m.start(TrainRequest(data=str(data), preset="tiny", name="fresh", resume=True))
    with pytest.raises(InputError, match="no training run is going on"):
        m.stop()
    with pytest.raises(InputError, match="no training runs"):
        m.status()


def test_cli_arguments(tmp_path, data):
    req = TrainRequest(data=str(data), preset="stylegan2", resolution=64, minutes=12.5, batch=16, loss="wgan-gp",
                       d_steps=3, aug="fixed", aug_p=0.3, auto_countermeasures=True, name="x").checked()
    args = req.cli_args(tmp_path / "x")
    joined = " ".join(args)
    for part in ("--config stylegan2", "--resolution 64", "--minutes 12.5", "--batch 16", "--loss wgan-gp",
                 "--d-steps 3", "--aug fixed", "--aug-p 0.3", "--auto-countermeasures", f"--out {tmp_path / 'x'}",
                 "--no-progress"):
        assert part in joined, (part, joined)
    assert "--kimg" not in args and "--resume" not in args
    from training.cli import build_parser

    parsed = build_parser().parse_args(args)         # the trainer's own parser accepts exactly these
    assert parsed.d_steps == 3 and parsed.aug_p == 0.3 and parsed.auto_countermeasures
    assert TrainRequest(data=str(data), preset="tiny").checked().name.startswith("tiny-")


def test_log_tail_reads_appended_lines_and_waits_for_a_partial_one(tmp_path):
    log = tmp_path / "log.jsonl"
    tail = LogTail(log)
    assert tail.read() == []                                   # no file yet
    log.write_text('{"kind": "train", "kimg": 0.1}\n{"kind": "train", "ki')
    assert [r["kimg"] for r in tail.read()] == [0.1]           # the torn line waits
    with open(log, "a") as f:
        f.write('mg": 0.2}\nnot json\n{"kind": "monitor", "kimg": 0.2}\n')
    assert [r["kind"] for r in tail.read()] == ["train", "monitor"]   # completed; the garbage line skipped
    assert len(tail.records) == 3 and tail.read() == []
    v = tail.version
    log.write_text('{"kind": "train", "kimg": 0.05}\n')         # rewritten shorter (a resumed run trims its log)
    assert [r["kimg"] for r in tail.read()] == [0.05] and len(tail.records) == 1 and tail.version > v


def test_runs_written_by_the_command_line_are_listed(tmp_path):
    runs = tmp_path / "runs"
    done = runs / "from-cli"
    done.mkdir(parents=True)
    (done / "log.jsonl").write_text(json.dumps({"kind": "train", "kimg": 1.0, "train_seconds": 10, "img_s": 100}) + "\n"
                                    + json.dumps({"kind": "end", "kimg": 1.2, "stop_reason": "kimg"}) + "\n")
    (runs / "empty-folder").mkdir()
    m = TrainingRunManager(runs)
    assert m.runs() == ["from-cli"]
    st = m.status()
    assert st.name == "from-cli" and st.state == FINISHED and st.kimg == 1.2 and "finished at 1.2 kimg" in st.message
    assert format_duration(3725) == "1 h 02 min" and format_duration(65) == "1 min 05 s" and format_duration(None) == "–"
