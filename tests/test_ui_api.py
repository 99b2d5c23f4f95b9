"""The studio's API, driven by gradio_client against a server started in-process on 127.0.0.1.
Real StyleGAN pickles from shared/testdata; each test reads what really came back (files, PNG metadata)."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client
from gradio_client.utils import QueueError, Status, handle_file  # noqa: E402

from core.pnginfo import read_png_params  # noqa: E402
from tests.ui_helpers import SG_COND, SG_UNCOND, running_studio, tiny_sd_folder  # noqa: E402

MEM_FIGURE = re.compile(r"\d+(\.\d+)? (KiB|MiB|GiB)")


@pytest.fixture(scope="module")
def studio(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("studio-api"), queue_max_size=8) as demo:
        yield demo


@pytest.fixture
def client(studio):
    return Client(studio.local_url, verbose=False)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return tiny_sd_folder(tmp_path_factory)


def gallery_paths(gallery) -> list[str]:
    return [item["image"] for item in gallery]


def wait_for_step(c: Client, min_step: int = 2, timeout: float = 120.0) -> int:
    """Poll the panel (as the browser's timer does) until this session's job reports `min_step` steps."""
    t0, progress = time.time(), ""
    while time.time() - t0 < timeout:
        try:
            progress = c.predict(api_name="/telemetry")[5]
        except QueueError:        # gradio_client sends even queue=False events through the queue: poll again
            time.sleep(0.2)
            continue
        m = re.search(r"step (\d+)/(\d+)", progress)
        if m and int(m.group(1)) >= min_step:
            return int(m.group(1))
        time.sleep(0.1)
    raise AssertionError(f"the job never reached step {min_step} in {timeout:.0f} s; progress: {progress}")


def queue_size(demo) -> int:
    """Events waiting in the server's Gradio queue (its own /queue/status), not counting running ones."""
    with urllib.request.urlopen(demo.local_url + "gradio_api/queue/status", timeout=30) as r:
        return int(json.loads(r.read())["queue_size"])


def wait_for_queue_size(demo, n: int, timeout: float = 60.0) -> None:
    """Poll until the server's queue holds exactly `n` waiting events (a hang guard, not a time budget)."""
    deadline, size = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        size = queue_size(demo)
        if size == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server's queue never held {n} waiting events in {timeout:.0f} s (it holds {size})")


def test_listens_on_localhost_by_default(studio):
    assert studio.server_name == "127.0.0.1"


def test_every_event_is_named(studio, client):
    names = set(client.view_api(return_format="dict", print_info=False)["named_endpoints"])
    for expected in ("/generate", "/stop", "/telemetry", "/read_png_info", "/send_back", "/switch_backend",
                     "/list_models", "/add_model", "/random_seed", "/select_image", "/queue_job"):
        assert expected in names, f"{expected} missing from {sorted(names)}"
    for dep in studio.config["dependencies"]:
        assert dep.get("api_name"), f"an event without api_name: {dep}"


def test_generate_stylegan_images_carry_their_parameters(client):
    gallery, _preview, progress, params, download = client.predict(
        backend="stylegan", seed="0-2", truncation_psi=0.5, api_name="/generate")
    paths = gallery_paths(gallery)
    assert len(paths) == 3 and "Done: 3 images" in progress
    seeds = [read_png_params(p)["seed"] for p in paths]
    assert seeds == [0, 1, 2]
    meta = read_png_params(paths[1])
    assert meta["backend"] == "stylegan" and meta["truncation_psi"] == 0.5 and meta["model"] == str(SG_UNCOND)
    download = download["value"] if isinstance(download, dict) else download   # a component update carries the file
    assert params["seed"] == 0 and read_png_params(download)["seed"] == 0      # the download keeps the metadata

    panel = client.predict(api_name="/telemetry")
    device, vram, job, latency, charts, _progress, _timer = panel
    assert MEM_FIGURE.search(vram)
    assert re.search(r"synthesis</span>.*?<b>\d+(\.\d+)? (ms|s)</b>", latency)
    assert "done" in job
    assert "<svg" in charts


def test_png_info_reads_back_what_generate_wrote(client, testdata):
    gallery = client.predict(backend="stylegan", seed="7", api_name="/generate")[0]
    _img, params, _cleared = client.predict(handle_file(gallery_paths(gallery)[0]), api_name="/read_png_info")
    assert params["seed"] == 7 and params["source"] == "atelier"
    _img, a1111, _cleared = client.predict(handle_file(str(testdata / "pnginfo" / "a1111_v1_6.png")),
                                           api_name="/read_png_info")
    assert a1111["source"] == "a1111" and a1111["prompt"] and "steps" in a1111


def test_select_and_send_back(client):
    client.predict(backend="stylegan", seed="3-4", truncation_psi=0.8, noise_mode="random", api_name="/generate")
    # the gallery's select event needs a browser click; the selection is index 0 after a job
    sent = client.predict(api_name="/send_back")
    values = {k: v for k, v in zip(["backend", "model", "seed"], sent[:3])}
    assert values["backend"] == "stylegan" and values["model"]["value"] == str(SG_UNCOND)
    assert values["seed"]["value"] == "3" and values["seed"]["label"].startswith("Seeds")   # the field and its label


def test_style_mix_and_interpolation(client):
    gallery = client.predict(backend="stylegan", sg_mode="style-mix", mix_rows="1,2", mix_cols="5-7",
                             mix_from=0, mix_to=4, api_name="/generate")[0]
    [grid] = gallery_paths(gallery)
    meta = read_png_params(grid)
    assert meta["mode"] == "style-mix" and meta["row_seeds"] == [1, 2] and meta["col_seeds"] == [5, 6, 7]
    from PIL import Image

    assert Image.open(grid).size == (4 * 32, 3 * 32)           # one header row/column plus the mixes
    gallery = client.predict(backend="stylegan", sg_mode="interpolate", seed="0,1", frames_per_seed=3,
                             api_name="/generate")[0]
    [anim] = gallery_paths(gallery)
    im = Image.open(anim)
    assert im.format == "GIF" and getattr(im, "n_frames", 1) == 6
    pytest.importorskip("imageio_ffmpeg")
    gallery = client.predict(backend="stylegan", sg_mode="interpolate", seed="0,1", frames_per_seed=4,
                             animation_format="mp4", api_name="/generate")[0]
    [item] = gallery
    video = item.get("video") or item.get("image")
    video = video["video"] if isinstance(video, dict) else video
    assert str(video).endswith(".mp4") and Path(video).stat().st_size > 0


def test_conditional_model_and_clear_errors(client):
    gallery = client.predict(backend="stylegan", model=str(SG_COND), seed="0", class_index="2",
                             truncation_centre="global", api_name="/generate")[0]
    saved = read_png_params(gallery_paths(gallery)[0])
    assert saved["class_index"] == 2 and saved["truncation_centre"] == "global"
    from ui.studio import CONTROL_NAMES

    sent = client.predict(api_name="/send_back")             # the class goes back as text, the model with it
    assert sent[CONTROL_NAMES.index("class_index")] == "2"
    assert sent[CONTROL_NAMES.index("truncation_centre")] == "global"
    assert sent[CONTROL_NAMES.index("model")]["value"] == str(SG_COND)
    with pytest.raises(Exception, match="unconditional"):
        client.predict(backend="stylegan", model=str(SG_UNCOND), seed="0", class_index="1", api_name="/generate")
    with pytest.raises(Exception, match="seed"):
        client.predict(backend="stylegan", seed="zero", api_name="/generate")
    with pytest.raises(Exception, match=r"'middle'.* not in the list of choices: \['class', 'global'\]"):
        client.predict(backend="stylegan", model=str(SG_COND), seed="0", truncation_centre="middle",
                       api_name="/generate")    # refused by the radio itself (job_spec would say the same in words)
    with pytest.raises(Exception, match="not found"):
        client.predict(backend="stylegan", model="/nope/missing.pkl", seed="0", api_name="/generate")


def test_stop_really_stops_and_the_next_job_runs(studio, client):
    job = client.submit(backend="stylegan", seed="0-2000", sg_batch_size=1, api_name="/generate")
    step = wait_for_step(client, 3)
    client.predict(api_name="/stop")
    out = job.result(timeout=120)                     # hang guard; promptness is the step count below
    m = re.search(r"Stopped at step (\d+)/2001", out[2])
    assert m, out[2]
    assert step <= int(m.group(1)) < 2001
    gallery = client.predict(backend="stylegan", seed="5-6", api_name="/generate")[0]
    assert [read_png_params(p)["seed"] for p in gallery_paths(gallery)] == [5, 6]



def test_stop_keeps_the_finished_images_and_their_latency(studio, client):
    """Issue 16: Stop after some batches of a long StyleGAN job shows (and has saved) the finished images,
    labelled as stopped, and the side panel times the stopped job instead of reading 'none yet'."""
    from PIL import Image

    job = client.submit(backend="stylegan", model="emoji64", seed="0-999", sg_batch_size=2, api_name="/generate")
    step = wait_for_step(client, 2, timeout=300)      # at least 2 batches (4 images) finished
    client.predict(api_name="/stop")
    gallery, _preview, progress, params, _download = job.result(timeout=300)   # hang guard only
    m = re.search(r"Stopped at step (\d+)/500: kept (\d+) of 1000 images", progress)
    assert m, progress
    stopped_at, kept = int(m.group(1)), int(m.group(2))
    assert step <= stopped_at < 500 and kept == 2 * stopped_at
    paths = gallery_paths(gallery)
    assert len(paths) == min(kept, 200) and len(paths) >= 4
    for i, path in enumerate(paths):
        assert Path(path).is_file()
        with Image.open(path) as im:
            im.verify()
        meta = read_png_params(path)
        assert meta["seed"] == i and meta["backend"] == "stylegan" and meta["arch"]
    assert all("stopped" in item["caption"] for item in gallery)
    assert params["seed"] == 0                          # the first kept image is selected, as after a finished job
    outputs = sorted(Path(studio.atelier_runtime.settings.output_dir).rglob("*.png"))
    saved_seeds = {read_png_params(str(f)).get("seed") for f in outputs}
    assert set(range(kept)) <= saved_seeds              # every finished image is on disk, shown or not
    latency = client.predict(api_name="/telemetry")[3]
    assert "none yet" not in latency and "stopped" in latency
    assert re.search(r"synthesis</span>.*?<b>\d+(\.\d+)? (ms|s)</b>", latency) and "per image" in latency

def test_sessions_do_not_see_or_stop_each_other(studio):
    a, b = Client(studio.local_url, verbose=False), Client(studio.local_url, verbose=False)
    job = a.submit(backend="stylegan", seed="0-2000", sg_batch_size=1, api_name="/generate")
    try:
        step = wait_for_step(a, 2)
        b.predict(api_name="/stop")                       # b has no job: nothing of a's may stop
        b_panel = b.predict(api_name="/telemetry")
        assert "No job yet" in b_panel[2] and "step" not in b_panel[5]
        assert "1 running" in b_panel[2]                  # b sees that the GPU is busy, not whose job it is
        later = wait_for_step(a, step + 3)
        assert later > step and not job.done()
    finally:
        a.predict(api_name="/stop")
        out = job.result(timeout=30)
    assert "Stopped" in out[2]


def test_diffusion_generate_with_previews_then_stop(client, tiny_sd):
    _dropdown, status = client.predict(str(tiny_sd), "diffusion", api_name="/add_model")
    assert "Added" in status
    job = client.submit(backend="diffusion", model=str(tiny_sd), prompt="a red fox", negative_prompt="blurry",
                        seed="3", steps=6, size="64x64", preview_every=2, api_name="/generate")
    gallery, *_ = job.result(timeout=120)
    previews = [o[1]["value"] for o in job.outputs() if isinstance(o[1], dict) and o[1].get("value")]
    assert previews, "no preview image was streamed while denoising"
    [path] = gallery_paths(gallery)
    meta = read_png_params(path)
    assert (meta["backend"], meta["prompt"], meta["negative_prompt"], meta["seed"], meta["steps"]) == \
        ("diffusion", "a red fox", "blurry", 3, 6)
    assert (meta["width"], meta["height"]) == (64, 64)

    job = client.submit(backend="diffusion", model=str(tiny_sd), prompt="a red fox", seed="3", steps=150,
                        size="64x64", api_name="/generate")
    wait_for_step(client, 2)
    client.predict(api_name="/stop")
    out = job.result(timeout=60)
    assert re.search(r"Stopped at step \d+/\d+", out[2]), out[2]


def test_diffusion_without_a_model_name_uses_a_diffusion_model(client, tiny_sd):
    """An API call naming only the backend carries the StyleGAN picker's value: it must not be used."""
    client.predict(str(tiny_sd), "diffusion", api_name="/add_model")
    gallery = client.predict(backend="diffusion", prompt="a cat", seed="1", steps=2, size="64x64",
                             api_name="/generate")[0]
    assert read_png_params(gallery_paths(gallery)[0])["backend"] == "diffusion"


PANEL_SESSION = "panel-probe"
POLYLINE = re.compile(r'<polyline points="([^"]*)"')


def _tick(http, studio, api: str = "telemetry") -> tuple[list, int]:
    """One panel refresh over HTTP, as the browser's timer sends it: (outputs, response bytes)."""
    r = http.post(studio.local_url + f"gradio_api/run/{api}", json={"data": [None], "session_hash": PANEL_SESSION})
    assert r.status_code == 200, r.text[:500]
    return r.json()["data"], len(r.content)


class _Tripwire:
    """Stands in for the model manager: any use of it by a panel tick is recorded (and fails that tick)."""

    def __init__(self):
        self.touched: list[str] = []

    def __getattr__(self, name):
        self.touched.append(name)
        raise AssertionError(f"a panel tick used the model manager ({name})")


def test_panel_refresh_is_cheap_by_construction(studio, monkeypatch):
    """A timer tick (every open tab, 2 Hz while a job runs) must stay cheap and must never wait for the
    GPU. Counted, not timed (a loaded CI box makes any CPU-time budget flaky):
    - it never touches the model manager, and it answers while the GPU lock is held (as during a job);
    - it reads the device at most once per MemoryHistory interval, however many ticks arrive
      (a frozen clock: 40 ticks in one interval = exactly 1 read, the next interval = 1 more);
    - the timer component is re-sent only when its interval changes (once here), not on every tick;
    - the answer stays small with a long job's history: charts are downsampled to <= 240 points."""
    import types

    import httpx

    import telemetry.live as live
    from core.types import ProgressEvent
    from telemetry.live import STOPPED, MemoryHistory

    rt = studio.atelier_runtime
    now = {"t": time.time()}
    monkeypatch.setattr(live, "time", types.SimpleNamespace(time=lambda: now["t"], perf_counter=time.perf_counter))
    reads: list = []
    real_reader = rt.memory._read

    def counting_reader(device):
        reads.append(device)
        return real_reader(device)

    history = MemoryHistory(rt.device, reader=counting_reader)      # this test's own, on the frozen clock
    monkeypatch.setattr(rt, "memory", history)
    for _ in range(700):                                              # more than the 5-minute window holds
        now["t"] += history.min_interval_s
        history.sample()
    assert len(reads) == 700

    with httpx.Client(timeout=60) as http:                           # hang guard only
        _tick(http, studio, "page_load")                              # registers the session, as a page load does
        sess = rt._sessions[PANEL_SESSION]
        sess.tracker.start("images")                                  # a long job's worth of steps
        for i in range(1, 20001):
            sess.tracker.on_progress(ProgressEvent("synthesis", i, 20000, 3.0 + i % 7))
        manager = _Tripwire()
        monkeypatch.setattr(rt.services, "manager", manager)
        assert rt.gpu_lock.acquire(timeout=60), "a job still holds the GPU lock"
        try:
            now["t"] += history.min_interval_s                        # a new interval: one read is due
            reads.clear()
            t0 = time.perf_counter()
            ticks = [_tick(http, studio) for _ in range(40)]
            wall_ms = (time.perf_counter() - t0) / len(ticks) * 1e3
            first_interval_reads = len(reads)
            now["t"] += history.min_interval_s
            ticks += [_tick(http, studio) for _ in range(10)]
        finally:
            rt.gpu_lock.release()
            sess.tracker.finish(STOPPED, {}, message="probe over")

    assert manager.touched == []
    assert first_interval_reads == 1 and len(reads) == 2, reads
    timer_updates = [out[6] for out, _ in ticks if "value" in out[6]]
    assert len(timer_updates) == 1 and ticks[0][0][6]["value"] == 0.5     # idle 2 s -> running 0.5 s, once
    assert all(out[6] == {"__type__": "update"} for out, _ in ticks[1:])   # then gr.skip(): nothing re-sent
    _device, vram, job, _latency, charts, progress, _timer = ticks[-1][0]
    assert "step 20000/20000" in progress and "running" in job and MEM_FIGURE.search(vram)
    lines = POLYLINE.findall(charts)
    assert len(lines) == 2 and all(0 < len(pts.split()) <= 240 for pts in lines), [len(p.split()) for p in lines]
    biggest = max(size for _, size in ticks)
    assert biggest < 32 * 1024, f"a panel refresh sends {biggest} bytes"    # about 12 KiB with full charts
    print(f"\npanel tick (report only, not asserted): {wall_ms:.2f} ms wall per HTTP round trip, {biggest} bytes")


def test_metrics_endpoint(studio, client):
    client.predict(backend="stylegan", seed="1", api_name="/generate")
    text = urllib.request.urlopen(studio.local_url + "metrics", timeout=10).read().decode()
    m = re.search(r'atelier_images_generated_total\{backend="stylegan"\} (\d+)', text)
    assert m and int(m.group(1)) >= 1
    assert 'atelier_stage_latency_seconds_bucket{backend="stylegan",le="+Inf",stage="synthesis"}' in text
    assert "atelier_queue_waiting" in text and ("atelier_process_rss_bytes" in text or "vram" in text)


def wait_until_processing(job, timeout: float = 120.0) -> None:
    """Until the server runs `job` (read from the client's own status: no request). With a one-place queue a
    panel poll sent before the job has joined would take that place and get the job refused."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        code = job.status().code
        if code in (Status.PROCESSING, Status.ITERATING, Status.PROGRESS):
            return
        if job.done():
            job.result()                                   # raises the server's error, if any
            raise AssertionError(f"the job ended before it was seen running (status {code})")
        time.sleep(0.05)
    raise AssertionError(f"the job was not running after {timeout:.0f} s (status {job.status().code})")


def test_full_queue_is_refused_with_a_clear_message(tmp_path, testdata):
    with running_studio(tmp_path, queue_max_size=1) as demo:
        a, b, c = (Client(demo.local_url, verbose=False) for _ in range(3))
        running = a.submit(backend="stylegan", seed="0-2000", sg_batch_size=1, api_name="/generate")
        wait_until_processing(running)
        wait_for_step(a, 1)
        waiting = b.submit(backend="stylegan", seed="0", api_name="/generate")
        wait_for_queue_size(demo, 1)                       # the server says b holds the one waiting place
        with pytest.raises(Exception, match="(?i)queue is full"):
            c.predict(backend="stylegan", seed="0", api_name="/generate")
        waiting.cancel()                                   # free the place (the client's own cancel)
        wait_for_queue_size(demo, 0)                       # ... and the server has let it go
        a.predict(api_name="/stop")
        assert "Stopped" in running.result(timeout=60)[2]
        gallery = c.predict(backend="stylegan", seed="4", api_name="/generate")[0]   # room again
        assert len(gallery) == 1


def test_auth_is_required_when_set(tmp_path, testdata):
    with running_studio(tmp_path, auth=("artist", "s3cret")) as demo:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(demo.local_url + "config", timeout=10)
        assert refused.value.code == 401
        with pytest.raises(Exception):
            Client(demo.local_url, verbose=False).predict(api_name="/telemetry")
        ok = Client(demo.local_url, auth=("artist", "s3cret"), verbose=False)
        assert MEM_FIGURE.search(ok.predict(api_name="/telemetry")[1])


def test_train_start_status_stop_export(studio, client, tmp_path, monkeypatch):
    """The Train tab's endpoints: clear errors, a tiny run that logs, stops with a checkpoint, exports, generates."""
    from tests.test_training_runs import write_tiny_dataset

    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # the trainer child inherits it (2-core box; see the runs tests)
    data = write_tiny_dataset(tmp_path)
    with pytest.raises(Exception, match="power of two"):
        client.predict(data=str(data), preset="tiny", resolution=48, api_name="/train_start")
    with pytest.raises(Exception, match="not found"):
        client.predict(data=str(tmp_path / "nothing-here"), preset="tiny", api_name="/train_start")
    run, status_html, _timer = client.predict(data=str(data), preset="tiny", kimg=50, monitor_kimg=0.016,
                                              log_every=1, name="api-run", api_name="/train_start")
    assert "api-run" in status_html and "running" in status_html
    with pytest.raises(Exception, match="still training"):
        client.predict(data=str(data), preset="tiny", name="api-other", api_name="/train_start")

    def status(c=client) -> tuple:
        return c.predict("api-run", api_name="/train_status")

    t0, raw = time.time(), {}
    while time.time() - t0 < 60 and not (raw.get("kimg", 0) > 0 and raw.get("last_monitor")):
        raw = status()[6]
        time.sleep(0.2)
    assert raw["state"] == "running" and raw["kimg"] > 0 and raw["img_s"] > 0, raw
    fresh = Client(studio.local_url, verbose=False)      # a new session draws everything once
    html, _warn, losses, _reg, monitor, _samples, _raw, _timer = status(fresh)
    assert re.search(r"kimg</span><b>[\d.]+ / 50", html), html
    losses = losses.get("value", losses)             # an update (the plot's axis limits travel with it)
    monitor = monitor.get("value", monitor)
    cols = losses["columns"]
    series = {row[cols.index("series")] for row in losses["data"]}
    assert series == {"G", "D"} and len(losses["data"]) >= 4
    assert "diversity" in {row[2] for row in monitor["data"]}

    stopping, _timer = client.predict(api_name="/train_stop")
    assert "stopping" in stopping or "stopped" in stopping
    t0 = time.time()
    while time.time() - t0 < 60 and raw["state"] != "stopped":
        html, _w, _l, _r, _m, samples, raw, _t = status()
        time.sleep(0.2)
    assert raw["state"] == "stopped" and raw["checkpoint"], raw
    assert "checkpoint saved" in html

    message, picker = client.predict("api-run", "", "stylegan", api_name="/train_export")
    assert "Exported" in message
    weights = picker["value"] if isinstance(picker, dict) else picker
    assert str(weights).endswith(".safetensors") and Path(weights).is_file()
    gallery = client.predict(backend="stylegan", model=weights, seed="0", api_name="/generate")[0]
    from PIL import Image

    assert Image.open(gallery_paths(gallery)[0]).size == (16, 16)    # the studio generates with what it trained
