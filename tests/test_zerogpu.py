"""ZeroGPU: the job body decorated with `spaces.GPU`, a duration sized from the request, and the job
working across the process boundary ZeroGPU puts around it.

The real `spaces` package (in requirements.txt) is used where it can run here: off ZeroGPU its
decorator must leave the studio as it is. Its ZeroGPU path needs Hugging Face's device API, which
no machine outside a Space has, so that path runs with a stand-in that does what ZeroGPU does to a
decorated call: ask `duration(*args)`, pickle the arguments into a worker process forked from the
studio, run the function there, pickle the result back, and keep only an exception's type name.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

from core.settings import Settings
from core.types import DiffusionParams, GenerationRequest, OptimizationFlags
from pipelines.services import build_services
from telemetry.live import DONE, FAILED, STOPPED
from tests.ui_helpers import SG_UNCOND
from ui import zerogpu
from ui.controls import JobSpec, job_spec
from ui.state import SessionState

ROOT = Path(__file__).resolve().parent.parent


def make_standin() -> types.ModuleType:
    """A `spaces` module whose GPU decorator runs the call as ZeroGPU does (see the module docstring)."""
    mod = types.ModuleType("spaces")
    mod.calls = []            # (duration asked, worker pid) per call

    def GPU(task=None, *, duration=None, size=None):
        def decorate(fn):
            def handler(*args, **kwargs):
                seconds = duration(*args, **kwargs) if callable(duration) else duration
                ctx = multiprocessing.get_context("fork")
                recv, send = ctx.Pipe(duplex=False)
                payload = pickle.dumps((args, kwargs))      # ZeroGPU pickles the arguments ...

                def worker():
                    a, kw = pickle.loads(payload)
                    try:
                        out = ("ok", fn(*a, **kw), os.getpid())
                    except Exception as exc:                 # ... and keeps only an exception's type name
                        out = ("error", type(exc).__name__, os.getpid())
                    send.send_bytes(pickle.dumps(out))       # ... and pickles the result back

                proc = ctx.Process(target=worker, daemon=True)
                proc.start()
                if not recv.poll(300):
                    proc.kill()
                    raise RuntimeError("the stand-in GPU worker did not answer in 300 s")
                out = pickle.loads(recv.recv_bytes())
                proc.join(60)
                mod.calls.append((seconds, out[-1]))
                if out[0] == "error":
                    raise RuntimeError(f"ZeroGPU worker error: {out[1]}")
                return out[1]
            return handler
        return decorate(task) if callable(task) else decorate

    mod.GPU = GPU
    return mod


@pytest.fixture
def zero(monkeypatch):
    standin = make_standin()
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    monkeypatch.setitem(sys.modules, "spaces", standin)
    monkeypatch.setattr(zerogpu, "_spaces", None)
    yield standin


@pytest.fixture
def runtime_factory(tmp_path, testdata):
    from ui.runner import StudioRuntime

    def make():
        settings = Settings(extra_models=(str(SG_UNCOND),), models_dirs=(), output_dir=tmp_path / "out",
                            cache_dir=tmp_path / "cache", default_stylegan_model=str(SG_UNCOND), device="cpu")
        return StudioRuntime(build_services(settings), poll_s=0.05)
    return make


def drive(rt, sess, spec, on_step=None):
    """Run a job to its end as the event generator does; `on_step(snapshot)` sees each update."""
    last = None
    for ev in rt.run(sess, spec):
        if on_step is not None and not ev.done:
            on_step(sess.tracker.snapshot())
        last = ev
    return last


def sg_spec(seeds: str, batch: int = 8, **extra) -> JobSpec:
    return job_spec({"backend": "stylegan", "seed": seeds, "truncation_psi": 0.7, "sg_batch_size": batch, **extra},
                    "cpu")


# -- the duration --------------------------------------------------------------------------------
def test_duration_grows_with_the_request_and_stays_in_bounds(monkeypatch):
    monkeypatch.delenv("ATELIER_ZEROGPU_MAX_S", raising=False)
    few, many = zerogpu.gpu_seconds(sg_spec("0-3")), zerogpu.gpu_seconds(sg_spec("0-4000"))
    assert zerogpu.MIN_S <= few < many <= zerogpu.DEFAULT_MAX_S

    def diffusion(steps, size=512, flags=OptimizationFlags()):
        params = DiffusionParams(prompt="a fox", negative_prompt="", seed=1, steps=steps, guidance=7.0, width=size,
                                 height=size, scheduler="default", batch_size=1)
        return zerogpu.gpu_seconds(JobSpec(GenerationRequest("diffusion", None, params, flags, None), "diffusion"))

    assert diffusion(4) < diffusion(50) < diffusion(50, 1024)
    assert diffusion(4, flags=OptimizationFlags(compile="default")) >= diffusion(4) + 100   # compiling takes minutes
    compare = JobSpec(sg_spec("0-999").request, "compare")
    assert zerogpu.gpu_seconds(compare) > zerogpu.gpu_seconds(sg_spec("0-999"))
    monkeypatch.setenv("ATELIER_ZEROGPU_MAX_S", "60")
    assert diffusion(150, 1024) == 60


# -- off ZeroGPU: the real package leaves everything as it is ----------------------------------------
def test_off_zerogpu_nothing_is_decorated(monkeypatch, runtime_factory):
    spaces = pytest.importorskip("spaces")
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    monkeypatch.setattr(zerogpu, "_spaces", None)
    assert zerogpu.decorate(lambda spec: spec, zerogpu.gpu_seconds) is None

    def f(x):
        return x
    assert spaces.GPU(duration=30)(f) is f        # the real decorator is a no-op here, as documented
    rt = runtime_factory()
    assert rt.bridge is None and rt._gpu_call is None
    sess = SessionState()
    end = drive(rt, sess, sg_spec("0-1"))
    assert end.state == DONE and len(end.items) == 2


# -- on ZeroGPU (stand-in): a forked worker, pickled arguments, Stop and progress across -----------------
@pytest.mark.slow
def test_job_runs_in_the_gpu_worker_with_a_duration_from_the_request(zero, runtime_factory):
    rt = runtime_factory()
    assert rt._gpu_call is not None, "on ZeroGPU the job body must be decorated"
    sess = SessionState()
    spec = sg_spec("0-5", batch=2)
    steps: list[int] = []
    end = drive(rt, sess, spec, on_step=lambda snap: steps.append(snap.step))
    assert end.state == DONE, end.message
    assert [Path(i.path).is_file() for i in end.items] == [True] * 6
    (seconds, pid), = zero.calls
    assert pid != os.getpid(), "the job body must run in the worker process"
    assert seconds == zerogpu.gpu_seconds(spec)
    snap = sess.tracker.snapshot()
    assert snap.state == DONE and snap.last_images == 6
    assert sum(snap.last_stage_ms.values()) > 0, "the worker's stage timings must reach the panel"


@pytest.mark.slow
def test_stop_reaches_the_gpu_worker(zero, runtime_factory):
    rt = runtime_factory()
    sess = SessionState()
    seen = []

    def stop_once_running(snap):
        seen.append(snap.step)
        if snap.step >= 1 and not sess.job.cancelled:
            sess.cancel()

    end = drive(rt, sess, sg_spec("0-4000", batch=1), on_step=stop_once_running)
    assert max(seen) >= 1, "the worker's steps must reach the studio's tracker"
    assert end.state == STOPPED, end.message
    assert sess.tracker.snapshot().state == STOPPED
    assert len(zero.calls) == 1


@pytest.mark.slow
def test_errors_keep_their_message_across_the_worker(zero, runtime_factory):
    rt = runtime_factory()
    sess = SessionState()
    end = drive(rt, sess, sg_spec("0", model="not-a-model.pkl"))
    assert end.state == FAILED
    assert "not-a-model.pkl" in end.message and "not found" in end.message    # not just "ModelLoadError"


# -- nothing initialises CUDA at import -------------------------------------------------------------
def test_import_and_build_start_no_cuda(tmp_path):
    """ZeroGPU forks its workers from the studio; CUDA started before that breaks them. Import every studio
    module and build the app with torch.cuda's lazy initialiser replaced by a recorder."""
    code = f"""
import sys, torch
calls = []
torch.cuda._lazy_init = lambda *a, **k: calls.append(1)
import app
from core.settings import Settings
from pipelines.services import build_services
from ui.studio import build_app
s = Settings(models_dirs=(), output_dir={str(tmp_path / 'out')!r}, cache_dir={str(tmp_path / 'cache')!r})
build_app(build_services(s))
print("CUDA_INIT_CALLS", len(calls))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "SPACES_ZERO_GPU": ""})
    assert "CUDA_INIT_CALLS 0" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
