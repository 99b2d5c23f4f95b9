"""The A1111-compatible /sdapi/v1 routes, over real HTTP against the studio started in-process with a
tiny Stable Diffusion pipeline built by the test (nothing downloaded)."""
from __future__ import annotations

import base64
import io
import json
import shutil
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from core.pnginfo import read_png_params
from tests.ui_helpers import running_studio, tiny_sd_folder


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return tiny_sd_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def sd_b(tmp_path_factory, sd):
    """A second model for switching (the same weights under another name: the name shows which one ran)."""
    folder = tmp_path_factory.mktemp("a1111-models") / "tiny-sd-b"
    shutil.copytree(sd, folder)
    return folder


@pytest.fixture(scope="module")
def late(tmp_path_factory):
    """A model path the studio is told about but which only appears after it started (refresh-checkpoints)."""
    return tmp_path_factory.mktemp("a1111-late") / "tiny-sd-late"


@pytest.fixture(scope="module")
def studio(tmp_path_factory, sd, sd_b, late, testdata):
    with running_studio(tmp_path_factory.mktemp("a1111"), models=(sd, sd_b, late)) as demo:
        yield demo


def url(studio, path: str) -> str:
    return studio.local_url.rstrip("/") + "/sdapi/v1" + path


def _decode(b64: str) -> Image.Image:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()
    return im


BODY = {"prompt": "a red fox", "negative_prompt": "blurry", "seed": 42, "steps": 3, "cfg_scale": 5,
        "width": 64, "height": 64, "sampler_name": "DPM++ 2M", "scheduler": "Karras", "batch_size": 2}


def test_txt2img_answers_in_a1111_shape(studio, sd):
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "n_iter": 2,
                                                  "override_settings": {"sd_model_checkpoint": str(sd)}}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    info = json.loads(out["info"])
    assert len(out["images"]) == 4 and info["all_seeds"] == [42, 43, 44, 45]      # A1111: seed + index
    assert out["parameters"]["prompt"] == "a red fox" and info["sampler_name"] == "DPM++ 2M Karras"
    first = _decode(out["images"][0])
    assert first.size == (64, 64) and np.asarray(first).std() > 0
    text = first.info["parameters"]
    assert text.startswith("a red fox\nNegative prompt: blurry\nSteps: 3, Sampler: DPM++ 2M Karras, CFG scale: 5")
    assert "Seed: 42" in text and info["infotexts"][0] == text
    ours = read_png_params(first)                                  # Atelier's own chunk rides along
    assert ours["seed"] == 42 and ours["scheduler"] == "dpm++2m-karras"
    # the same seed alone (batch 1, not the first of a batch of 2): the same picture. To rounding, not bit for
    # bit: a different batch size may run other kernels, which round differently (a level at most in 8 bits)
    again = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1}, timeout=300).json()
    diff = np.abs(np.asarray(_decode(again["images"][0]), dtype=int) - np.asarray(first, dtype=int))
    assert diff.max() <= 1, f"seed 42 alone differs from seed 42 in a batch by up to {diff.max()} levels"


def test_save_images_keeps_files_and_send_images_false_sends_none(studio):
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1, "save_images": True, "send_images": False},
                   timeout=300)
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert r.json()["images"] == [] and len(info["atelier_files"]) == 1
    saved = Image.open(info["atelier_files"][0])
    assert saved.info["parameters"] == info["infotexts"][0] and read_png_params(saved)["seed"] == 42


def test_img2img_and_png_info(studio):
    init = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    init.save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    r = httpx.post(url(studio, "/img2img"), json={**BODY, "batch_size": 1, "init_images": [b64],
                                                  "denoising_strength": 0.5}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert json.loads(out["info"])["denoising_strength"] == 0.5 and "init_images" not in out["parameters"]
    assert "Denoising strength: 0.5" in _decode(out["images"][0]).info["parameters"]
    pi = httpx.post(url(studio, "/png-info"), json={"image": out["images"][0]}, timeout=60).json()
    assert pi["info"].startswith("a red fox") and pi["parameters"]["strength"] == 0.5


def test_lists_and_options(studio, sd):
    models = httpx.get(url(studio, "/sd-models")).json()
    assert any(m["filename"] == str(sd) for m in models)
    names = [s["name"] for s in httpx.get(url(studio, "/samplers")).json()]
    assert {"Euler a", "DPM++ 2M Karras", "DDIM"} <= set(names)
    assert {s["name"] for s in httpx.get(url(studio, "/schedulers")).json()} == {"automatic", "karras"}
    assert httpx.get(url(studio, "/progress")).json()["state"]["job_count"] == 0


@pytest.mark.parametrize("body,status,needle", [
    ({**BODY, "enable_hr": True}, 422, "hires fix"),
    ({**BODY, "sampler_name": "Foo 9000"}, 422, "Foo 9000"),
    ({**BODY, "batch_size": 9, "n_iter": 2}, 422, "at most 16"),
    ({**BODY, "steps": "many"}, 422, "steps must be an integer from 1 to 150"),
    ({**BODY, "override_settings": {"sd_model_checkpoint": "/nowhere/model.safetensors"}}, 404, "/nowhere"),
])
def test_bad_requests_get_clear_errors(studio, body, status, needle):
    r = httpx.post(url(studio, "/txt2img"), json=body, timeout=120)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"] and r.json()["error"]


def test_img2img_without_an_image_and_a_broken_body(studio):
    r = httpx.post(url(studio, "/img2img"), json=BODY, timeout=60)
    assert r.status_code == 422 and "init_images" in r.json()["detail"]
    r = httpx.post(url(studio, "/txt2img"), content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not JSON" in r.json()["detail"]


def test_interrupt_stops_a_long_job_and_progress_shows_it(studio):
    box = {}

    def call():
        box["r"] = httpx.post(url(studio, "/txt2img"), json={**BODY, "steps": 150, "batch_size": 1}, timeout=300)

    t = threading.Thread(target=call)
    t.start()
    t0 = time.time()
    while time.time() - t0 < 60:
        p = httpx.get(url(studio, "/progress")).json()
        if p["state"]["sampling_step"] >= 2:
            break
        time.sleep(0.05)
    assert p["state"]["sampling_steps"] >= 150 and 0 < p["progress"] < 1
    assert p["eta_relative"] > 0                                # seconds left, from the recent step times
    assert httpx.post(url(studio, "/interrupt")).status_code == 200
    t.join(60)
    info = json.loads(box["r"].json()["info"])
    assert box["r"].status_code == 200 and info["interrupted"] is True
    # the next job runs normally
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1}, timeout=300)
    assert r.status_code == 200 and len(r.json()["images"]) == 1


def test_auth_is_the_studios(tmp_path, sd):
    with running_studio(tmp_path, models=(sd,), auth=("ana", "s3cret")) as demo:
        u = demo.local_url.rstrip("/") + "/sdapi/v1/samplers"
        assert httpx.get(u).status_code == 401
        assert httpx.get(u, auth=("ana", "wrong")).status_code == 401
        assert httpx.get(u, auth=("ana", "s3cret")).status_code == 200


# -- issue 16: a drop-in for A1111 scripts -------------------------------------------------------------------

def _options(studio) -> dict:
    r = httpx.get(url(studio, "/options"))
    assert r.status_code == 200, r.text
    return r.json()


def _set_options(studio, body: dict) -> httpx.Response:
    return httpx.post(url(studio, "/options"), json=body, timeout=60)


def test_options_switch_the_model_txt2img_uses(studio, sd, sd_b):
    assert _options(studio)["sd_model_checkpoint"] == str(sd)                  # the catalogue's default
    try:
        r = _set_options(studio, {"sd_model_checkpoint": "tiny-sd-b"})         # by model_name, as scripts do
        assert r.status_code == 200 and r.json() is None, r.text               # A1111 answers null
        assert _options(studio)["sd_model_checkpoint"] == str(sd_b)            # reported by its title
        out = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1}, timeout=300)
        assert out.status_code == 200, out.text
        assert json.loads(out.json()["info"])["sd_model_name"] == "tiny-sd-b"
        titles = {m["title"] for m in httpx.get(url(studio, "/sd-models")).json()}
        assert str(sd) in titles
        assert _set_options(studio, {"sd_model_checkpoint": str(sd)}).status_code == 200   # by title
        assert _options(studio)["sd_model_checkpoint"] == str(sd)
    finally:
        _set_options(studio, {"sd_model_checkpoint": str(sd)})


def test_options_refuse_unknown_models_and_keys_and_set_nothing(studio, sd):
    r = _set_options(studio, {"sd_model_checkpoint": "no-such-model"})
    assert r.status_code == 404 and "no-such-model" in r.json()["detail"] and str(sd) in r.json()["detail"]
    # all or nothing: the bad key refuses the whole body, the good checkpoint before it is not set either
    r = _set_options(studio, {"sd_model_checkpoint": "tiny-sd-b", "no_such_option": 3})
    assert r.status_code == 422 and "no_such_option" in r.json()["detail"]
    r = _set_options(studio, {"samples_format": "jpg"})
    assert r.status_code == 422 and "samples_format" in r.json()["detail"] and "png" in r.json()["detail"]
    assert _options(studio)["sd_model_checkpoint"] == str(sd)
    # what Atelier honours is accepted and echoed; null leaves an option alone (A1111 does the same)
    assert _set_options(studio, {"samples_format": "png", "sd_vae": "None", "no_such_option": None}).status_code == 200
    opts = _options(studio)
    assert opts["samples_format"] == "png" and opts["sd_vae"] == "None" and "no_such_option" not in opts
    assert _set_options(studio, {"sd_vae": "Automatic"}).status_code == 200
    # A1111's live-preview display: honoured (it picks the /progress preview decoder), other values refused
    assert opts["show_progress_type"] == "Approx NN"
    r = _set_options(studio, {"show_progress_type": "Fancy"})
    assert r.status_code == 422 and "TAESD" in r.json()["detail"] and "Approx cheap" in r.json()["detail"]
    assert _set_options(studio, {"show_progress_type": "TAESD"}).status_code == 200
    assert _options(studio)["show_progress_type"] == "TAESD"
    assert _set_options(studio, {"show_progress_type": "Approx NN"}).status_code == 200


def test_every_live_preview_display_maps_to_a_preview_method():
    from core.types import PREVIEW_METHODS
    from ui.a1111_api import OPTION_CHOICES, PREVIEW_METHOD_OF

    assert set(PREVIEW_METHOD_OF) == set(OPTION_CHOICES["show_progress_type"])
    assert set(PREVIEW_METHOD_OF.values()) <= set(PREVIEW_METHODS)


def test_override_settings_name_a_model_by_model_name_or_title(studio, sd_b):
    models = {m["model_name"]: m for m in httpx.get(url(studio, "/sd-models")).json()}
    assert models["tiny-sd-b"]["title"] == str(sd_b)
    for name in ("tiny-sd-b", str(sd_b)):
        r = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1,
                                                      "override_settings": {"sd_model_checkpoint": name}}, timeout=300)
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["info"])["sd_model_name"] == "tiny-sd-b"


def test_sizes_off_the_multiple_of_8_are_floored_as_a1111_does(studio):
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "batch_size": 1, "width": 100, "height": 64}, timeout=300)
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert _decode(r.json()["images"][0]).size == (96, 64)
    assert (info["width"], info["height"]) == (96, 64) and "Size: 96x64" in info["infotexts"][0]
    assert any("width 100 was rounded down to 96" in n for n in info["atelier_notes"])
    assert r.json()["parameters"]["width"] == 100                            # the request, echoed as sent
    for bad in ({"width": 63}, {"height": 4097}):                            # the bounds still hold
        r = httpx.post(url(studio, "/txt2img"), json={**BODY, **bad}, timeout=60)
        assert r.status_code == 422 and next(iter(bad)) in r.json()["detail"]


def test_refresh_checkpoints_lists_a_model_that_appeared(studio, sd, late):
    assert str(late) not in {m["filename"] for m in httpx.get(url(studio, "/sd-models")).json()}
    shutil.copytree(sd, late)
    r = httpx.post(url(studio, "/refresh-checkpoints"), timeout=60)
    assert r.status_code == 200 and r.json() is None, r.text                  # A1111 answers null
    assert "tiny-sd-late" in {m["model_name"] for m in httpx.get(url(studio, "/sd-models")).json()}


def test_sd_vae_lists_no_extra_vae(studio):
    r = httpx.get(url(studio, "/sd-vae"))
    assert r.status_code == 200 and r.json() == []


def test_loras_lists_none(studio):
    r = httpx.get(url(studio, "/loras"))
    assert r.status_code == 200 and r.json() == []


def test_upscalers_list_a1111s_none(studio):
    r = httpx.get(url(studio, "/upscalers"))
    assert r.status_code == 200
    assert r.json() == [{"name": "None", "model_name": None, "model_path": None, "model_url": None, "scale": 4}]


def test_cmd_flags_in_a1111s_names(studio):
    r = httpx.get(url(studio, "/cmd-flags"))
    assert r.status_code == 200
    flags, settings = r.json(), studio.atelier_runtime.services.settings
    assert flags["api"] is True and flags["listen"] is False and flags["share"] is False
    assert flags["port"] == settings.port and flags["server_name"] == "127.0.0.1" and flags["api_auth"] is None


def test_options_on_a_public_studio_name_no_server_folder(tmp_path, sd):
    with running_studio(tmp_path, models=(sd,), mode="public") as demo:
        r = httpx.post(url(demo, "/options"), json={"sd_model_checkpoint": "no-such-model"}, timeout=60)
        assert r.status_code == 404 and "'tiny-sd'" in r.json()["detail"]
        assert str(sd.parent) not in r.json()["detail"]
        assert httpx.post(url(demo, "/options"), json={"sd_model_checkpoint": "tiny-sd"}, timeout=60).status_code == 200
