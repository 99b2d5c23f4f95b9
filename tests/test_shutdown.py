"""Issue 13: a kill mid-save leaves no partial output, and SIGTERM drains the studio and exits 0.

- save_png (and the other output writers) write at a hidden temporary name and os.replace it into
  place: the final name holds a complete file or nothing, and no temporary file is left behind.
- StudioRuntime.drain: no new jobs, the running job finishes within the grace period or is
  cancelled (its cancel token), and run() refuses new work while draining.
- `python app.py` on SIGTERM: drains, logs a line, exits 0 (a real subprocess; waits on its output
  lines and its exit, never on sleeps).
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from core.errors import Cancelled
from core.pnginfo import read_png_params, save_png
from tests.ui_helpers import PORT_ATTEMPTS, SG_UNCOND, free_port

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 180.0   # generous: only a bound on a hang, never a timing assertion


def image() -> Image.Image:
    return Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3))


class Boom(RuntimeError):
    pass


def half_writing_save(monkeypatch, exc: BaseException):
    """Image.save writes the first bytes of a PNG to its target, then fails (as a kill mid-save would)."""
    targets: list[Path] = []

    def save(self, fp, *a, **k):
        targets.append(Path(fp))
        with open(fp, "wb") as fh:
            fh.write(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
        raise exc

    monkeypatch.setattr(Image.Image, "save", save)
    return targets


@pytest.mark.parametrize("exc", [Boom("disk on fire"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_save_png_never_leaves_a_partial_file(tmp_path, monkeypatch, exc):
    final = tmp_path / "out" / "seed0001.png"
    targets = half_writing_save(monkeypatch, exc)
    with pytest.raises(type(exc)):
        save_png(image(), final, {"seed": 1})
    assert targets and targets[0] != final and targets[0].parent == final.parent   # it wrote elsewhere
    assert not final.exists()
    assert list(final.parent.iterdir()) == []                                    # temp file removed


def test_a_failed_overwrite_keeps_the_previous_file(tmp_path, monkeypatch):
    final = save_png(image(), tmp_path / "seed0001.png", {"seed": 1})
    before = final.read_bytes()
    half_writing_save(monkeypatch, Boom("no space left"))
    with pytest.raises(Boom):
        save_png(image(), final, {"seed": 2})
    assert final.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["seed0001.png"]


def test_save_png_writes_a_complete_png_and_no_temp_file(tmp_path):
    final = save_png(image(), tmp_path / "a.png", {"seed": 7})
    assert read_png_params(final)["seed"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]
    with Image.open(final) as im:
        assert im.size == (64, 64)


def test_gif_animation_is_written_atomically(tmp_path, monkeypatch):
    from pipelines.stylegan import write_animation

    frames = [image(), image().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    path = write_animation(frames, tmp_path / "walk.gif", fps=10)
    assert [p.name for p in tmp_path.iterdir()] == ["walk.gif"]
    with Image.open(path) as im:
        assert im.n_frames == 2
    half_writing_save(monkeypatch, Boom("killed"))
    with pytest.raises(Boom):
        write_animation(frames, tmp_path / "other.gif")
    assert [p.name for p in tmp_path.iterdir()] == ["walk.gif"]


# ---------------------------------------------------------------------------------------------
# Draining the runtime (the function SIGTERM calls)


@pytest.fixture
def runtime(tmp_path):
    from core.settings import Settings
    from pipelines.services import build_services
    from ui.runner import StudioRuntime

    settings = Settings(host="127.0.0.1", extra_models=(str(SG_UNCOND),), models_dirs=(),
                        output_dir=tmp_path / "outputs", cache_dir=tmp_path / "cache", device="cpu")
    return StudioRuntime(build_services(settings), poll_s=0.05)


def fake_spec():
    return SimpleNamespace(kind="images", request=SimpleNamespace(device="cpu", backend="stylegan", flags=None))


def start_job(rt, monkeypatch, finish: threading.Event):
    """A job that runs until `finish` is set or it is cancelled; returns (started, progress list, thread)."""
    from ui.state import new_session

    started = threading.Event()

    def execute(spec, job, tracker):
        started.set()
        while not finish.is_set():
            if job.cancelled:
                raise Cancelled("cancelled by the user")
            finish.wait(0.01)
        return [], SimpleNamespace(images=[], notes=[], cancelled=False)

    monkeypatch.setattr(rt, "_execute", execute)
    session = new_session()
    out: list = []
    t = threading.Thread(target=lambda: out.extend(rt.run(session, fake_spec())), daemon=True)
    t.start()
    assert started.wait(TIMEOUT)
    return session, out, t


def test_drain_cancels_a_job_that_outlives_the_grace_period(runtime, monkeypatch):
    from telemetry.live import STOPPED

    session, out, t = start_job(runtime, monkeypatch, threading.Event())
    assert len(runtime.active_jobs()) == 1
    report = runtime.drain(grace_s=0, cancel_wait_s=TIMEOUT)
    assert report == {"finished": 0, "cancelled": 1, "left": 0}
    t.join(TIMEOUT)
    assert out[-1].done and out[-1].state == STOPPED
    assert runtime.active_jobs() == []


def test_drain_lets_a_running_job_finish(runtime, monkeypatch):
    from telemetry.live import DONE

    finish = threading.Event()
    session, out, t = start_job(runtime, monkeypatch, finish)
    result = {}
    drainer = threading.Thread(target=lambda: result.update(runtime.drain(grace_s=TIMEOUT)), daemon=True)
    drainer.start()
    assert runtime.draining.wait(TIMEOUT)
    finish.set()                       # the job ends on its own while drain waits
    drainer.join(TIMEOUT)
    assert result == {"finished": 1, "cancelled": 0, "left": 0}
    t.join(TIMEOUT)
    assert out[-1].state == DONE


def test_no_new_jobs_while_draining(runtime, monkeypatch):
    from telemetry.live import FAILED
    from ui.state import new_session

    assert runtime.drain(grace_s=0) == {"finished": 0, "cancelled": 0, "left": 0}
    monkeypatch.setattr(runtime, "_execute", lambda *a: pytest.fail("a job ran while draining"))
    progress = list(runtime.run(new_session(), fake_spec()))
    assert progress[-1].state == FAILED and "shutting down" in progress[-1].message


# ---------------------------------------------------------------------------------------------
# The real server: python app.py, SIGTERM, exit 0


def _lines(stream, q: queue.Queue, name: str) -> None:
    for line in iter(stream.readline, ""):
        q.put((name, line.rstrip("\n")))
    q.put((name, None))


def wait_for_line(q: queue.Queue, needle: str, seen: list[str], closed: set) -> str:
    while True:
        try:
            name, line = q.get(timeout=TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"no line containing {needle!r} within {TIMEOUT} s; output so far:\n"
                                 + "\n".join(seen)) from None
        if line is None:
            closed.add(name)
            if len(closed) == 2:
                raise AssertionError(f"the server exited before printing {needle!r}; output:\n" + "\n".join(seen))
            continue
        seen.append(f"{name}: {line}")
        if needle in line:
            return line


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM is POSIX")
def test_sigterm_drains_the_studio_and_exits_zero(tmp_path, testdata):
    env = dict(os.environ, ATELIER_OUTPUT_DIR=str(tmp_path / "outputs"), ATELIER_CACHE_DIR=str(tmp_path / "cache"),
               ATELIER_RUNS_DIR=str(tmp_path / "runs"), ATELIER_DEVICE="cpu", ATELIER_DRAIN_S="5",
               GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    env.pop("ATELIER_MODE", None)
    # The port is free when picked but released before the server binds it: another process may take
    # it in between, so a start that fails on the port is retried with a fresh one.
    for attempt in range(PORT_ATTEMPTS):
        cmd = [sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(free_port()),
               "--model", str(SG_UNCOND)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        q: queue.Queue = queue.Queue()
        for stream, name in ((proc.stdout, "out"), (proc.stderr, "err")):
            threading.Thread(target=_lines, args=(stream, q, name), daemon=True).start()
        seen: list[str] = []
        closed: set = set()
        try:
            wait_for_line(q, "Atelier studio (", seen, closed)      # the startup banner: it is serving
            break
        except AssertionError:
            proc.wait(timeout=TIMEOUT)
            if attempt + 1 < PORT_ATTEMPTS and any("port" in line.lower() for line in seen):
                continue
            raise
    try:
        proc.send_signal(signal.SIGTERM)
        wait_for_line(q, "SIGTERM received", seen, closed)
        wait_for_line(q, "Atelier studio: stopped", seen, closed)
        rc = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, "\n".join(seen)
