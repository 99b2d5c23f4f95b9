"""Issue 13: /healthz and /readyz over real HTTP on 127.0.0.1.

- /healthz: the process answers, always 200 {"status": "ok"} (draining too: the orchestrator must not
  kill a studio that is finishing its jobs).
- /readyz: 503 {"status": "unavailable", "reason": ...} until the model manager holds the default model
  and one generation with it has completed (a visitor's job, or the `--warmup` one at start); then 200
  {"status": "ready"}; 503 "shutting down" once the runtime drains.
- With --auth both answer without credentials and say nothing beyond the status and a short reason
  (no path, no model name).

Synchronisation is on conditions (a finished request, a polled state with a generous bound), never sleeps.
"""
from __future__ import annotations

import time

import httpx
import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from core.settings import Settings  # noqa: E402
from pipelines.services import build_services  # noqa: E402
from tests.ui_helpers import SG_COND, SG_UNCOND, running_studio  # noqa: E402
from ui.runner import StudioRuntime  # noqa: E402

TIMEOUT = 180.0   # a bound on a hang only, never a timing assertion
USER, PASSWORD = "ana", "s3cret-pass"


def probe(base: str, path: str) -> httpx.Response:
    return httpx.get(base.rstrip("/") + path, timeout=30)


def wait_until_ready(base: str) -> httpx.Response:
    deadline = time.monotonic() + TIMEOUT
    while True:
        r = probe(base, "/readyz")
        if r.status_code == 200 or time.monotonic() > deadline:
            return r
        time.sleep(0.1)   # poll interval; the condition is the status code


def assert_unready(r: httpx.Response, reason: str | None = None) -> None:
    assert r.status_code == 503, r.text
    body = r.json()
    assert set(body) == {"status", "reason"} and body["status"] == "unavailable", body
    if reason is not None:
        assert reason in body["reason"], body


def assert_says_nothing(r: httpx.Response, demo) -> None:
    """The body is a status word and a short reason: no server path, no model name."""
    text = r.text
    assert len(text) < 200, text
    for secret in (SG_UNCOND.name, SG_UNCOND.stem, SG_COND.stem, str(demo.atelier_runtime.settings.output_dir),
                   "/tmp", "/home", ".pkl", "stylegan"):
        assert secret not in text, (secret, text)


def test_readyz_waits_for_the_default_model_then_drains(tmp_path, testdata):
    with running_studio(tmp_path) as demo:
        base = demo.local_url
        h = probe(base, "/healthz")
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        assert_unready(probe(base, "/readyz"), "not loaded")
        assert probe(base, "/readyz").headers.get("cache-control") == "no-store"

        client = Client(base, verbose=False)
        # another model is not the default one: still not ready
        gallery = client.predict(backend="stylegan", model=str(SG_COND), seed="0", class_index="1",
                                 api_name="/generate")[0]
        assert len(gallery) == 1
        assert_unready(probe(base, "/readyz"), "not loaded")

        # the default model (the picker's initial value): the job has finished when predict returns
        progress = client.predict(backend="stylegan", seed="0", api_name="/generate")[2]
        assert "Done" in progress
        r = probe(base, "/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        assert httpx.head(base.rstrip("/") + "/readyz", timeout=30).status_code == 200
        assert probe(base, "/healthz").status_code == 200

        # evicting the default model makes the studio unready again
        demo.atelier_runtime.services.manager.clear()
        assert_unready(probe(base, "/readyz"), "not loaded")
        client.predict(backend="stylegan", seed="1", api_name="/generate")
        assert probe(base, "/readyz").status_code == 200

        report = demo.atelier_runtime.drain(grace_s=0, cancel_wait_s=0)   # what SIGTERM does first
        assert report == {"finished": 0, "cancelled": 0, "left": 0}
        assert_unready(probe(base, "/readyz"), "shutting down")
        h = probe(base, "/healthz")
        assert h.status_code == 200 and h.json() == {"status": "ok"}   # still alive while it drains


def test_warmup_makes_the_studio_ready_without_a_request(tmp_path, testdata):
    with running_studio(tmp_path, warmup=True) as demo:
        r = wait_until_ready(demo.local_url)
        assert r.status_code == 200, r.text
        loaded = demo.atelier_runtime.services.manager.loaded()
        assert [m["model"] for m in loaded] == [str(SG_UNCOND)]
        assert not list((tmp_path / "outputs").rglob("*.png"))   # the warm-up saves nothing
        # the studio then serves as usual
        gallery = Client(demo.local_url, verbose=False).predict(backend="stylegan", seed="3", api_name="/generate")[0]
        assert len(gallery) == 1


def test_probes_answer_without_sign_in_and_say_nothing(tmp_path, testdata):
    with running_studio(tmp_path, auth=(USER, PASSWORD)) as demo:
        base = demo.local_url
        assert probe(base, "/metrics").status_code == 401           # the guard is on
        h = probe(base, "/healthz")
        assert h.status_code == 200 and h.json() == {"status": "ok"}
        r = probe(base, "/readyz")
        assert_unready(r)
        assert "www-authenticate" not in r.headers
        assert_says_nothing(r, demo)

        Client(base, auth=(USER, PASSWORD), verbose=False).predict(backend="stylegan", seed="0", api_name="/generate")
        r = probe(base, "/readyz")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
        assert_says_nothing(r, demo)

        demo.atelier_runtime.drain(grace_s=0, cancel_wait_s=0)
        r = probe(base, "/readyz")
        assert_unready(r, "shutting down")
        assert_says_nothing(r, demo)
        assert probe(base, "/healthz").status_code == 200


def test_readiness_without_any_model_installed(tmp_path):
    settings = Settings(assets_dir=tmp_path / "assets", models_dirs=(), extra_models=(),
                        output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    rt = StudioRuntime(build_services(settings))
    ready, reason = rt.readiness()
    assert not ready and reason == "no default model is installed"
    rt.draining.set()
    assert rt.readiness() == (False, "shutting down")


def test_a_failed_warmup_is_reported_without_details(tmp_path):
    missing = tmp_path / "secret-place" / "gone.pkl"
    settings = Settings(assets_dir=tmp_path / "assets", models_dirs=(), extra_models=(),
                        default_stylegan_model=str(missing), output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    missing.parent.mkdir()
    missing.write_bytes(b"not a pickle")
    rt = StudioRuntime(build_services(settings))
    rt.start_warmup().join(TIMEOUT)
    ready, reason = rt.readiness()
    assert not ready and reason == "the default model failed to warm up"


def test_warmup_is_asked_for_by_flag_or_environment(monkeypatch):
    monkeypatch.delenv("ATELIER_WARMUP", raising=False)
    assert Settings.from_env().warmup is False
    assert Settings.from_env(warmup=True).warmup is True
    monkeypatch.setenv("ATELIER_WARMUP", "1")
    assert Settings.from_env().warmup is True
