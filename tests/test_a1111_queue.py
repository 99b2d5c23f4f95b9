"""The A1111 API queues like A1111 (issue 13), shows its live preview and keeps an interrupted image (issue 16).

Over real HTTP against the studio started in-process with a tiny Stable Diffusion pipeline and a queue of
Q places. A job is kept running for as long as a test needs by a real long request (16 iterations of 150
steps: 2,400 denoising steps) that the test ends with POST /interrupt; every wait is on an event (a queue
change, a response arriving, a progress poll that sees the state) with a generous upper bound.
"""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

import ui.a1111_api as a1111
from tests.ui_helpers import running_studio, tiny_sd_folder

Q = 2                                   # the studio's --queue-size in these tests
WAIT_S = 300                            # upper bound of every wait: generous for a loaded 2-core machine
LONG = {"prompt": "a slow fox", "seed": 7, "steps": 150, "n_iter": 16, "batch_size": 1, "width": 64, "height": 64}
SHORT = {"prompt": "a quick fox", "steps": 2, "batch_size": 1, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return tiny_sd_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, sd):
    with running_studio(tmp_path_factory.mktemp("a1111-queue"), models=(sd,), queue_max_size=Q) as demo:
        yield demo


def url(studio, path: str) -> str:
    return studio.local_url.rstrip("/") + "/sdapi/v1" + path


def _decode(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


class Responses:
    """Responses of requests sent on threads, in arrival order; the test waits for a count of them."""

    def __init__(self):
        self.items: list[tuple[str, httpx.Response | BaseException]] = []
        self._cv = threading.Condition()

    def send(self, name: str, studio, path: str, body: dict, barrier: threading.Barrier | None = None):
        def call():
            if barrier is not None:
                barrier.wait(WAIT_S)
            try:
                r: httpx.Response | BaseException = httpx.post(url(studio, path), json=body, timeout=WAIT_S)
            except BaseException as exc:     # a lost request shows up as this, not as a missing entry
                r = exc
            with self._cv:
                self.items.append((name, r))
                self._cv.notify_all()
        t = threading.Thread(target=call, name=f"client-{name}", daemon=True)
        t.start()
        return t

    def wait_count(self, n: int) -> list[tuple[str, httpx.Response]]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.items) >= n, WAIT_S), f"only {len(self.items)} of {n} answered"
            return list(self.items)

    def of(self, name: str) -> httpx.Response:
        return dict(self.items)[name]


def start_long_job(studio, responses: Responses, body: dict = LONG) -> threading.Thread:
    """A real API job that runs until interrupted; returns once it holds the GPU (running, none waiting)."""
    queue = studio.atelier_runtime.queue
    assert queue.wait_for(lambda w, r: (w, r) == (0, 0), WAIT_S), "the studio's queue is not empty to start with"
    t = responses.send("long", studio, "/txt2img", body)
    assert queue.wait_for(lambda w, r: (w, r) == (0, 1), WAIT_S), f"the long job did not start: {queue.counts()}"
    return t


def wait_progress(studio, predicate, what: str) -> dict:
    """Poll /progress (as A1111 clients do) until `predicate(answer)` holds."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        p = httpx.get(url(studio, "/progress"), timeout=60).json()
        if predicate(p):
            return p
        time.sleep(0.1)                       # poll period, not synchronisation: the predicate decides
    raise AssertionError(f"/progress never showed {what}; last answer: {p}")


def test_requests_queue_and_only_a_full_queue_is_refused_at_once(studio):
    queue = studio.atelier_runtime.queue
    responses = Responses()
    long_job = start_long_job(studio, responses)
    n_more = 6                                # Q of them wait their turn, the rest find the queue full
    barrier = threading.Barrier(n_more)
    threads = [responses.send(f"short-{i}", studio, "/txt2img", {**SHORT, "seed": 100 + i}, barrier)
               for i in range(n_more)]
    refused = responses.wait_count(n_more - Q)
    # the refusals came while the long job still runs and Q requests wait: nobody waited to be refused
    assert queue.counts() == (Q, 1) and long_job.is_alive() and "long" not in dict(refused)
    for name, r in refused:
        assert isinstance(r, httpx.Response) and r.status_code == 503, (name, r)
        assert "queue is full" in r.json()["detail"] and r.json()["error"] == "QueueFull"
        assert int(r.headers["retry-after"]) >= 1
    # /progress answers while the queue is full and shows the running job
    assert httpx.get(url(studio, "/progress"), timeout=60).json()["state"]["job_count"] == 16
    assert httpx.post(url(studio, "/interrupt"), timeout=60).status_code == 200
    for t in [long_job] + threads:
        t.join(WAIT_S)
    everything = responses.wait_count(1 + n_more)
    assert len(everything) == 1 + n_more                                  # none lost
    statuses = sorted(r.status_code for _, r in everything)
    assert statuses == [200] * (1 + Q) + [503] * (n_more - Q)
    long_info = json.loads(responses.of("long").json()["info"])
    assert long_info["interrupted"] is True and long_info["atelier_queue"]["position"] == 1
    done = [json.loads(r.json()["info"]) for name, r in everything if name != "long" and r.status_code == 200]
    assert all(len(d["all_seeds"]) == 1 and not d["interrupted"] for d in done)
    # first come, first served: the queued jobs ran in the order they took their places, after the long one
    by_place = sorted(done, key=lambda d: d["atelier_queue"]["position"])
    assert [d["atelier_queue"]["position"] for d in by_place] == list(range(1, Q + 1))
    runs = [d["atelier_queue"]["run_no"] for d in by_place]
    assert runs == sorted(runs) and runs[0] == long_info["atelier_queue"]["run_no"] + 1
    assert queue.counts() == (0, 0)
    # and the next request simply runs
    r = httpx.post(url(studio, "/txt2img"), json={**SHORT, "seed": 1}, timeout=WAIT_S)
    assert r.status_code == 200 and len(r.json()["images"]) == 1


def test_a_full_queue_refuses_img2img_before_reading_its_image(studio, monkeypatch):
    decoded = []
    real = a1111._b64_image
    monkeypatch.setattr(a1111, "_b64_image", lambda data, what: decoded.append(what) or real(data, what))
    queue = studio.atelier_runtime.queue
    responses = Responses()
    long_job = start_long_job(studio, responses)
    waiting = [responses.send(f"short-{i}", studio, "/txt2img", {**SHORT, "seed": i}) for i in range(Q)]
    assert queue.wait_for(lambda w, r: (w, r) == (Q, 1), WAIT_S), queue.counts()
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buf, format="PNG")
    r = httpx.post(url(studio, "/img2img"), json={**SHORT, "init_images": [base64.b64encode(buf.getvalue()).decode()]},
                   timeout=WAIT_S)
    assert r.status_code == 503 and "retry-after" in r.headers and "queue is full" in r.json()["detail"], r.text
    assert decoded == [] and long_job.is_alive()
    assert httpx.post(url(studio, "/interrupt"), timeout=60).status_code == 200
    for t in [long_job] + waiting:
        t.join(WAIT_S)
    assert [r.status_code for _, r in responses.wait_count(1 + Q)] == [200] * (1 + Q)


def test_progress_shows_the_live_preview_and_interrupt_returns_the_image(studio):
    responses = Responses()
    job = start_long_job(studio, responses, {**LONG, "n_iter": 1})          # a one-image job
    p = wait_progress(studio, lambda p: p["current_image"], "a current_image")
    preview = _decode(p["current_image"])
    assert preview.format == "PNG" and preview.size == (64, 64) and np.asarray(preview).std() > 0
    assert p["state"]["sampling_step"] >= a1111.PREVIEW_EVERY
    skipped = httpx.get(url(studio, "/progress"), params={"skip_current_image": "true"}, timeout=60).json()
    assert skipped["current_image"] is None and skipped["state"]["job_count"] == 1
    assert httpx.post(url(studio, "/interrupt"), timeout=60).status_code == 200
    job.join(WAIT_S)
    r = responses.wait_count(1)[0][1]
    assert r.status_code == 200, r.text
    out = r.json()
    info = json.loads(out["info"])
    assert info["interrupted"] is True and len(out["images"]) == 1 and info["all_seeds"] == [LONG["seed"]]
    image = _decode(out["images"][0])
    assert image.size == (64, 64) and np.asarray(image).std() > 0            # a decoded (noisy) picture
    assert "Seed: 7" in image.info["parameters"]
    assert any("partly denoised" in n for n in info["atelier_notes"])
    # no job, no preview
    assert httpx.get(url(studio, "/progress"), timeout=60).json()["current_image"] is None


# -- a client that hangs up (issue 13) ---------------------------------------------------------------------------

def hang_up_client(studio, body: dict) -> "socket.socket":
    """A raw HTTP/1.1 txt2img request whose client the test closes when it likes, as a closed tab or a killed
    script does: the socket is returned with the whole request sent and nothing read."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(studio.local_url)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=60)
    s.sendall(b"POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (u.hostname.encode(), u.port, len(data)) + data)
    return s


def wait_until(predicate, what: str):
    """Poll `predicate` (a counter the server keeps, read in this process) until it holds, up to WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)                      # poll period, not synchronisation: the predicate decides
    raise AssertionError(f"never saw {what}")


def test_a_waiting_client_that_hangs_up_gives_its_place_up_and_its_job_never_runs(studio):
    api = studio.atelier_a1111
    queue = studio.atelier_runtime.queue
    responses = Responses()
    long_job = start_long_job(studio, responses)
    wait_until(lambda: api.job is not None, "the long job running")
    started, dropped = api.started, api.dropped
    # two clients fill the queue (Q = 2) behind the running job, then the first hangs up
    first = hang_up_client(studio, {**SHORT, "seed": 4242})
    assert queue.wait_for(lambda w, r: (w, r) == (1, 1), WAIT_S), queue.counts()
    second = hang_up_client(studio, {**SHORT, "seed": 4343})
    assert queue.wait_for(lambda w, r: (w, r) == (2, 1), WAIT_S), queue.counts()
    first.close()
    # its place is given up at once, while the long job still runs (it did not wait for its turn to be dropped)
    assert queue.wait_for(lambda w, r: (w, r) == (1, 1), WAIT_S), queue.counts()
    wait_until(lambda: api.dropped == dropped + 1, "the first hung-up job dropped")
    assert long_job.is_alive() and api.started == started
    # the freed place is a real one: the next client is queued, not refused with 503
    kept = responses.send("kept", studio, "/txt2img", {**SHORT, "seed": 4444})
    assert queue.wait_for(lambda w, r: (w, r) == (2, 1), WAIT_S), queue.counts()
    second.close()                            # now the one ahead of "kept" hangs up too
    assert queue.wait_for(lambda w, r: (w, r) == (1, 1), WAIT_S), queue.counts()
    wait_until(lambda: api.dropped == dropped + 2, "the second hung-up job dropped")
    assert long_job.is_alive() and api.started == started
    assert httpx.post(url(studio, "/interrupt"), timeout=60).status_code == 200
    for t in (long_job, kept):
        t.join(WAIT_S)
    answers = responses.wait_count(2)
    assert [r.status_code for _, r in answers] == [200, 200], [(n, getattr(r, "text", r)) for n, r in answers]
    long_info, kept_info = (json.loads(responses.of(n).json()["info"]) for n in ("long", "kept"))
    # the dropped jobs never started: "kept" ran right after the long job, and only those two started
    assert kept_info["atelier_queue"]["run_no"] == long_info["atelier_queue"]["run_no"] + 1
    assert kept_info["all_seeds"] == [4444] and not kept_info["interrupted"]
    assert api.started == started + 1 and api.dropped == dropped + 2
    assert queue.counts() == (0, 0)
    r = httpx.post(url(studio, "/txt2img"), json={**SHORT, "seed": 5}, timeout=WAIT_S)
    assert r.status_code == 200 and len(r.json()["images"]) == 1
    assert api.started == started + 2


def test_a_running_jobs_client_that_hangs_up_cancels_it(studio):
    api = studio.atelier_a1111
    queue = studio.atelier_runtime.queue
    assert queue.wait_for(lambda w, r: (w, r) == (0, 0), WAIT_S), queue.counts()
    started = api.started
    client = hang_up_client(studio, LONG)     # 2,400 denoising steps if nothing stops it
    assert queue.wait_for(lambda w, r: (w, r) == (0, 1), WAIT_S), queue.counts()
    wait_until(lambda: api.job is not None and api.progress["step"] >= 1, "the hung-up client's job stepping")
    job = api.job
    client.close()
    assert queue.wait_for(lambda w, r: (w, r) == (0, 0), WAIT_S), queue.counts()
    wait_until(lambda: api.job is None, "the cancelled job's end")
    assert job.cancelled and api.started == started + 1
    steps = [e for e in job.trace if e.total]          # the steps it reported
    assert len(steps) < LONG["steps"] * LONG["n_iter"]               # it stopped well before its 2,400 steps
    r = httpx.post(url(studio, "/txt2img"), json={**SHORT, "seed": 6}, timeout=WAIT_S)
    assert r.status_code == 200 and len(r.json()["images"]) == 1
    info = json.loads(r.json()["info"])
    assert not info["interrupted"] and info["all_seeds"] == [6] and api.started == started + 2
