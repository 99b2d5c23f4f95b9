"""The /sdapi/v1 routes under hostile or sloppy input (issue 13), over real HTTP against the studio started
in-process with the tiny Stable Diffusion pipeline: every bad body is a 422 naming the field, images are
refused by their header's size before any pixel is decoded, img2img decodes only when its queue turn comes,
and no visitor input is left on disk."""
from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

import ui.a1111_api as a1111
from tests.ui_helpers import running_studio, tiny_sd_folder

# the server warns (PIL) on opening the probe's 144-megapixel header, just before the API refuses it
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return tiny_sd_folder(tmp_path_factory)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, sd, testdata):
    with running_studio(tmp_path_factory.mktemp("a1111-robust"), models=(sd,)) as demo:
        yield demo


def url(studio, path: str) -> str:
    return studio.local_url.rstrip("/") + "/sdapi/v1" + path


BODY = {"prompt": "a red fox", "seed": 42, "steps": 2, "cfg_scale": 5, "width": 64, "height": 64,
        "sampler_name": "Euler", "batch_size": 1}


def post_raw(studio, path: str, content: bytes, timeout: float = 120) -> httpx.Response:
    return httpx.post(url(studio, path), content=content, headers={"content-type": "application/json"},
                      timeout=timeout)


def b64_png(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def small_init() -> str:
    return b64_png(Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)))


def header_only_png(width: int, height: int) -> str:
    """A PNG whose header claims width x height but whose pixel data is 8 bytes of a truncated stream: any
    attempt to decode it fails with 'truncated'/'broken', so a refusal that names its megapixels can only
    come from the size check on the header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)           # 8-bit RGB
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)[:8]) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def bomb_png() -> str:
    """The probe's bomb: a 12000x12000 one-bit PNG, a few tens of KB that decode to 144 megapixels."""
    return b64_png(Image.new("1", (12000, 12000)))


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.exists() else set()


# -- every bad body: 422 with the field's name ----------------------------------------------------------------
BAD_JSON = [                                                 # raw bodies: JSON's non-numbers and deep nesting
    (b'{"prompt": "x", "steps": Infinity}', "steps must be a finite number"),
    (b'{"prompt": "x", "steps": NaN}', "steps must be a finite number"),
    (b'{"prompt": "x", "cfg_scale": -Infinity}', "cfg_scale must be a finite number"),
    (b'{"prompt": "x", "steps": 1e400}', "steps must be a finite number"),
    (b'{"prompt": "x", "styles": [1, {"a": NaN}]}', "styles[1].a must be a finite number"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": "x", "styles": ' + b"[" * 100 + b"]" * 100 + b"}", "nested more than 32 levels"),
    (b"[]", "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"{not json", "not JSON"),
]


@pytest.mark.parametrize("content,needle", BAD_JSON, ids=[n for _, n in BAD_JSON])
@pytest.mark.parametrize("path", ["/txt2img", "/img2img"])
def test_bad_json_is_a_422(studio, path, content, needle):
    r = post_raw(studio, path, content)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"] and r.json()["error"] == "InputError"


BAD_FIELDS = [
    ({"steps": 1.5}, "steps must be an integer from 1 to 150; got 1.5"),
    ({"steps": True}, "steps must be an integer from 1 to 150; got true"),
    ({"steps": None}, "steps must be an integer from 1 to 150; got null"),
    ({"steps": "20"}, "steps must be an integer"),
    ({"steps": 0}, "steps must be an integer from 1 to 150; got 0"),
    ({"steps": 151}, "steps must be an integer from 1 to 150; got 151"),
    ({"steps": 10 ** 30}, "steps must be an integer from 1 to 150"),
    ({"sampler_name": 123}, "sampler_name must be a string or null; got 123"),
    ({"sampler_name": ["Euler"]}, "sampler_name must be a string or null; got an array"),
    ({"sampler_index": {"a": 1}}, "sampler_index must be a string or null; got an object"),
    ({"scheduler": 5}, "scheduler must be a string or null; got 5"),
    ({"prompt": None}, "prompt must be a string; got null"),
    ({"prompt": 7}, "prompt must be a string; got 7"),
    ({"negative_prompt": ["a"]}, "negative_prompt must be a string; got an array"),
    ({"prompt": "x" * 4001}, "prompt is 4001 characters long; at most 4000"),
    ({"seed": -2}, "seed must be an integer from -1 to 4294967295"),
    ({"seed": 2 ** 32}, "seed must be an integer from -1 to 4294967295"),
    ({"seed": 0.5}, "seed must be an integer"),
    ({"seed": False}, "seed must be an integer"),
    ({"width": 8}, "width must be an integer from 64 to 4096; got 8"),
    ({"height": 100_000}, "height must be an integer from 64 to 4096"),
    ({"width": "64"}, "width must be an integer"),
    ({"batch_size": 0}, "batch_size must be an integer from 1 to 16; got 0"),
    ({"batch_size": 17}, "batch_size must be an integer from 1 to 16"),
    ({"n_iter": 0}, "n_iter must be an integer from 1 to 16"),
    ({"cfg_scale": "7"}, "cfg_scale must be a finite number from 0 to 30"),
    ({"cfg_scale": 31}, "cfg_scale must be a finite number from 0 to 30"),
    ({"cfg_scale": True}, "cfg_scale must be a finite number"),
    ({"send_images": "no"}, "send_images must be true or false"),
    ({"save_images": 1}, "save_images must be true or false"),
    ({"override_settings": "x"}, "override_settings must be an object"),
    ({"override_settings": {"sd_model_checkpoint": 5}}, "sd_model_checkpoint must be a string or null"),
    ({"override_settings": {"atelier_flags": {"precison": "bf16"}}}, "atelier_flags.precison is not an Atelier flag"),
    ({"override_settings": {"atelier_flags": {"fp8": "yes"}}}, "atelier_flags.fp8 must be true or false"),
    ({"override_settings": {"atelier_flags": {"precision": 16}}}, "atelier_flags.precision must be a string"),
    ({"override_settings": {"atelier_flags": {"prune_amount": "0.5"}}}, "atelier_flags.prune_amount must be a finite number"),
    ({"override_settings": {"atelier_flags": {"memory": ["swap"]}}}, "atelier_flags.memory must be a list of memory savers"),
    ({"override_settings": {"atelier_flags": {"precision": "fp64"}}}, "precision must be one of"),
    ({"override_settings": {"atelier_flags": []}}, "atelier_flags must be an object"),
]


@pytest.mark.parametrize("extra,needle", BAD_FIELDS, ids=[n[:50] for _, n in BAD_FIELDS])
def test_bad_fields_are_a_422_naming_the_field(studio, extra, needle):
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, **extra}, timeout=120)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"], r.json()["detail"]


IMG2IMG_BAD = [
    ({"denoising_strength": 0}, "denoising_strength must be a finite number in (0, 1]; got 0"),
    ({"denoising_strength": 1.5}, "denoising_strength must be a finite number in (0, 1]"),
    ({"denoising_strength": None}, "denoising_strength must be a finite number"),
    ({"init_images": "abc"}, "img2img needs init_images: a list"),
    ({"init_images": []}, "img2img needs init_images: a list"),
    ({"init_images": [5]}, "init_images[0] must be a base64-encoded image; got 5"),
    ({"init_images": ["bm90IGFuIGltYWdl"]}, "init_images[0] is not a readable image"),
    ({"init_images": ["%%%"]}, "init_images[0] is not"),
]


@pytest.mark.parametrize("extra,needle", IMG2IMG_BAD, ids=[n[:50] for _, n in IMG2IMG_BAD])
def test_bad_img2img_fields_are_a_422(studio, extra, needle):
    r = httpx.post(url(studio, "/img2img"), json={**BODY, "init_images": [small_init()], **extra}, timeout=120)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"], r.json()["detail"]


def test_a_whole_float_is_taken_as_an_integer_and_unknown_fields_are_still_ignored(studio):
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "steps": 2.0, "seed": 7.0, "styles": [], "subseed": -1,
                                                  "sampler_name": None, "scheduler": None}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["images"]) == 1


def test_a_body_over_the_cap_is_refused(studio, monkeypatch):
    monkeypatch.setattr(a1111, "MAX_BODY_BYTES", 1000)       # the route reads the cap when called
    r = httpx.post(url(studio, "/txt2img"), json={**BODY, "prompt": "x" * 2000}, timeout=60)
    assert r.status_code == 422 and "request body is" in r.json()["detail"], r.text


# -- images: size-checked before decoding, in memory only, decoded under the lock -------------------------------
@pytest.mark.parametrize("path,key", [("/img2img", "init_images[0]"), ("/png-info", "image")])
def test_the_probes_bomb_is_refused(studio, path, key):
    b64 = bomb_png()
    assert len(b64) < 200_000                                 # small on the wire ...
    body = {**BODY, "init_images": [b64]} if path == "/img2img" else {"image": b64}
    r = httpx.post(url(studio, path), json=body, timeout=120)
    assert r.status_code == 422, r.text                        # ... 144 megapixels decoded
    assert f"{key} is 12000x12000 = 144.0 megapixels" in r.json()["detail"]
    assert "up to 16.8 megapixels" in r.json()["detail"]


@pytest.mark.parametrize("path", ["/img2img", "/png-info"])
def test_an_oversized_header_is_refused_without_decoding(studio, path):
    # the pixel data is a truncated stream: decoding would fail as 'not a readable image', so the megapixel
    # message shows the refusal came from the header alone, before any decode (and any memory for 64 MP)
    b64 = header_only_png(8000, 8000)
    body = {**BODY, "init_images": [b64]} if path == "/img2img" else {"image": b64}
    r = httpx.post(url(studio, path), json=body, timeout=120)
    assert r.status_code == 422, r.text
    assert "8000x8000 = 64.0 megapixels" in r.json()["detail"] and "not a readable" not in r.json()["detail"]
    # PIL's own bomb guard (over twice Image.MAX_IMAGE_PIXELS) is a 422 too, not a 500
    b64 = header_only_png(20000, 20000)
    body = {**BODY, "init_images": [b64]} if path == "/img2img" else {"image": b64}
    r = httpx.post(url(studio, path), json=body, timeout=120)
    assert r.status_code == 422, r.text
    assert "megapixels" in r.json()["detail"] or "decompression bomb" in r.json()["detail"]


def test_a_header_within_the_cap_is_decoded_and_a_broken_one_is_a_422(studio):
    r = httpx.post(url(studio, "/png-info"), json={"image": header_only_png(64, 64)}, timeout=60)
    assert r.status_code == 422 and "not a readable image" in r.json()["detail"], r.text


@pytest.mark.parametrize("fmt", ["TGA", "PPM"])
def test_formats_outside_the_list_are_refused(studio, fmt):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buf, format=fmt)
    r = httpx.post(url(studio, "/png-info"), json={"image": base64.b64encode(buf.getvalue()).decode()}, timeout=60)
    assert r.status_code == 422 and "send a PNG, JPEG" in r.json()["detail"], r.text


def test_png_info_bad_bodies(studio):
    for body, needle in (([], "must be a JSON object"), ({"image": None}, "image must be a base64-encoded image"),
                         ({}, "image must be a base64-encoded image")):
        r = httpx.post(url(studio, "/png-info"), json=body, timeout=60)
        assert r.status_code == 422 and needle in r.json()["detail"], r.text


def test_four_concurrent_bombs_are_each_refused_and_leave_nothing(studio):
    out_dir = Path(studio.atelier_runtime.services.settings.output_dir)
    before = files_under(out_dir)
    b64 = bomb_png()
    results: list[httpx.Response] = []
    barrier = threading.Barrier(4)

    def call():
        barrier.wait()
        results.append(httpx.post(url(studio, "/img2img"), json={**BODY, "init_images": [b64]}, timeout=120))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:                                          # each queued, then refused by its size
        assert r.status_code == 422 and "144.0 megapixels" in r.json()["detail"], r.text
    assert files_under(out_dir) == before and not (out_dir / "api-inputs").exists()


def test_img2img_decodes_under_the_lock_and_keeps_nothing_on_disk(studio, monkeypatch):
    api = studio.atelier_a1111
    out_dir = Path(studio.atelier_runtime.services.settings.output_dir)
    before = files_under(out_dir)
    decoded_locked = []
    real = a1111._b64_image

    def spy(data, what):
        decoded_locked.append(api._lock.locked())
        return real(data, what)

    monkeypatch.setattr(a1111, "_b64_image", spy)
    r = httpx.post(url(studio, "/img2img"), json={**BODY, "init_images": [small_init()], "denoising_strength": 0.5},
                   timeout=300)
    assert r.status_code == 200, r.text
    assert decoded_locked == [True]                            # decoded once, by the job holding the lock
    assert files_under(out_dir) == before and not (out_dir / "api-inputs").exists()


def test_a_queued_img2img_decodes_its_image_only_when_its_turn_comes(studio, monkeypatch):
    api = studio.atelier_a1111
    queue = studio.atelier_runtime.queue
    calls = []
    real = a1111._b64_image
    monkeypatch.setattr(a1111, "_b64_image", lambda data, what: calls.append(what) or real(data, what))
    box = {}
    assert api._lock.acquire(blocking=False)                   # stands in for the running API job
    try:
        t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
            url(studio, "/img2img"), json={**BODY, "init_images": [small_init()], "denoising_strength": 0.5},
            timeout=300)))
        t.start()
        assert queue.wait_for(lambda waiting, running: waiting == 1, 120), queue.counts()   # queued, not refused
        assert calls == []
    finally:
        api._lock.release()
    t.join(300)
    assert box["r"].status_code == 200, box["r"].text
    assert calls == ["init_images[0]"]


def test_auth_still_comes_first(tmp_path, sd):
    with running_studio(tmp_path, models=(sd,), auth=("ana", "s3cret")) as demo:
        u = demo.local_url.rstrip("/") + "/sdapi/v1/txt2img"
        r = httpx.post(u, content=b'{"steps": Infinity}', headers={"content-type": "application/json"})
        assert r.status_code == 401
        r = httpx.post(u, content=b'{"steps": Infinity}', headers={"content-type": "application/json"},
                       auth=("ana", "s3cret"))
        assert r.status_code == 422 and "steps must be a finite number" in r.json()["detail"]
