"""An AUTOMATIC1111-compatible HTTP API on the studio's server (`/sdapi/v1/...`).

Many tools already speak A1111's web API: painting-app plugins, batch scripts, bots. The same
routes here let them drive Atelier's diffusion backend without changes:

    POST /sdapi/v1/txt2img     POST /sdapi/v1/img2img     POST /sdapi/v1/png-info
    GET  /sdapi/v1/sd-models   GET  /sdapi/v1/samplers    GET  /sdapi/v1/schedulers
    GET  /sdapi/v1/progress    POST /sdapi/v1/interrupt   GET|POST /sdapi/v1/options
    POST /sdapi/v1/refresh-checkpoints   GET /sdapi/v1/sd-vae, loras, upscalers, cmd-flags

Requests are read with A1111's field names (prompt, negative_prompt, seed (-1 = random),
steps, cfg_scale, width, height, sampler_name + scheduler, batch_size, n_iter,
denoising_strength, init_images, override_settings.sd_model_checkpoint) and answered in its
shape: base64 PNGs (with both Atelier's and A1111's parameter chunks), the request echoed as
`parameters`, and `info` as a JSON string with all_seeds and infotexts. Fields Atelier does not
implement (hires fix, restore faces, scripts, ...) are refused by name instead of being ignored.

Requests are checked strictly before anything runs (types: integers are integers, numbers are finite,
strings are strings; ranges; prompt length; unknown atelier_flags) and refused with 422 and the field's name.
Uploaded images stay in memory only and are refused by their header's size (MAX_INPUT_PIXELS) before any
pixel is decoded; img2img decodes its image only when its turn in the queue has come.

Requests queue as in A1111: txt2img / img2img take a place on the studio's GPU queue board (shared with
browser jobs, bounded by the same --queue-size) before their body is read, and run one at a time in arrival
order under the studio's GPU lock, so an API job and a browser job never share the GPU. Only a full queue
is refused: at once, 503 with Retry-After. A client that hangs up (closes its connection) takes its job with it:
a waiting job gives its place up at once and never starts, a running one is cancelled at its next step. /progress carries the running job's live preview (a latent
preview every PREVIEW_EVERY steps, the last finished image between iterations) as current_image, and an
interrupted job returns what it had (its partly denoised latents decoded), as A1111 does. With --auth the
routes want the same user and password (HTTP Basic), as A1111's --api-auth does.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import logging
import math
import random
import secrets
import statistics
import threading
import time
from collections import deque
from typing import Any

from core.errors import AtelierError, Cancelled, InputError, ModelLoadError, OutOfMemory, QueueFull, ResourceError
from core.pnginfo import png_bytes, read_png_params
from core.types import SEED_MAX, DiffusionParams, GenerationRequest, Job, OptimizationFlags
from telemetry.live import DONE

PREFIX = "/sdapi/v1"
log = logging.getLogger(__name__)
MAX_IMAGES = 16                       # batch_size x n_iter per request
MAX_INPUT_PIXELS = 4096 * 4096        # an uploaded image (init_images, png-info) is refused above this, before decoding
MAX_BODY_BYTES = 64 * 2**20           # a request body (base64 images included) is refused above this
MAX_JSON_DEPTH = 32                   # arrays/objects nested deeper than this are refused
MAX_NAME_CHARS = 200                  # sampler, scheduler and model names
PREVIEW_EVERY = 10                    # A1111's default live-preview period (show_progress_every_n_steps), in steps
INPUT_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "BMP", "GIF")   # what an uploaded image may be (no EPS, PDF, ...)
UNSUPPORTED = {                       # A1111 fields with an effect Atelier does not have: refused when set
    "enable_hr": "hires fix", "restore_faces": "face restoration", "tiling": "seamless tiling",
    "script_name": "scripts", "alwayson_scripts": "extensions", "subseed_strength": "variation seeds",
    "refiner_checkpoint": "the SDXL refiner", "mask": "inpainting masks",
}
OPTION_CHOICES = {                    # A1111 options POST /options takes besides sd_model_checkpoint: what Atelier honours
    "samples_format": ("png",), "sd_vae": ("Automatic", "None"), "CLIP_stop_at_last_layers": (1,),
    # A1111's "Live preview display": what draws /progress's current_image. A1111 defaults to "Approx NN" (a small
    # CNN Atelier does not have); "Approx NN" and "Approx cheap" both draw the linear latent map here.
    "show_progress_type": ("Approx NN", "Approx cheap", "TAESD", "Full"),
}
PREVIEW_METHOD_OF = {"Approx NN": "latent", "Approx cheap": "latent", "TAESD": "taesd", "Full": "full"}
_decode_slots = threading.BoundedSemaphore(2)


class ClientGone(Cancelled):
    """The HTTP client of a queued API job closed its connection: the job is dropped, nobody reads its answer."""   # png-info decodes at once (img2img decodes under the job lock)


def _kind(v: Any) -> str:
    """A JSON value's type in JSON's words, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f"the string {v[:40]!r}" + ("..." if len(v) > 40 else "")
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (int, float)):
        return repr(v)
    return "an array" if isinstance(v, list) else "an object" if isinstance(v, dict) else type(v).__name__


def check_json_shape(value: Any) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH and NaN/Infinity anywhere (JSON has neither; Python's
    parser lets them through, and they could not be echoed back in `parameters`). Iterative: no recursion."""
    stack = [(value, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise InputError(f"{path or 'the body'} must be a finite number; got {_kind(v)} (JSON has no NaN or Infinity)")
        if isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise InputError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, child in items:
                where = (f"{path}.{k}" if path else str(k)) if isinstance(v, dict) else f"{path}[{k}]"
                stack.append((child, where, depth + 1))


def parse_body(raw: bytes) -> Any:
    """The request's JSON, or InputError (not JSON, too deep, NaN/Infinity)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InputError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError):
        raise InputError("the request body is not JSON") from None
    check_json_shape(body)
    return body


def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    """A whole number in lo..hi. Booleans, strings, null, fractions and non-finite numbers are refused;
    20.0 is taken as 20 (JSON does not tell the two apart)."""
    v = body.get(key, default)
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v) and v.is_integer())
    if not ok or not (lo <= v <= hi):
        raise InputError(f"{key} must be an integer from {lo} to {hi}; got {_kind(v)}")
    return int(v)


def _num(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
        rng = f"in ({lo:g}, {hi:g}]" if lo_open else f"from {lo:g} to {hi:g}"
        raise InputError(f"{key} must be a finite number {rng}; got {_kind(v)}")
    return float(v)


def _str(body: dict, key: str, default: str | None, limit: int, nullable: bool = False) -> str | None:
    v = body.get(key, default)
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        raise InputError(f"{key} must be a string{' or null' if nullable else ''}; got {_kind(v)}")
    if len(v) > limit:
        raise InputError(f"{key} is {len(v)} characters long; at most {limit}")
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise InputError(f"{key} must be true or false; got {_kind(v)}")
    return v


def _b64_image(data: Any, what: str):
    """A base64 image, refused by its header's size before any pixel is decoded. Held in memory only."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str) or not data:
        raise InputError(f"{what} must be a base64-encoded image; got {_kind(data)}")
    if data.startswith("data:"):
        data = data.split(",", 1)[-1]
    try:
        raw = base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{what} is not valid base64 ({exc})") from None
    Image.init()                                                        # registers every plugin PIL has
    try:
        im = Image.open(io.BytesIO(raw), formats=[f for f in INPUT_FORMATS if f in Image.OPEN])   # the header only
    except Image.DecompressionBombError as exc:
        raise InputError(f"{what} is refused as a decompression bomb ({exc})") from None
    except (UnidentifiedImageError, ValueError, OSError) as exc:
        raise InputError(f"{what} is not a readable image; send a PNG, JPEG, WebP, BMP or GIF ({exc})") from None
    w, h = im.size
    if w * h > MAX_INPUT_PIXELS or w < 1 or h < 1:
        im.close()
        raise InputError(f"{what} is {w}x{h} = {w * h / 1e6:.1f} megapixels; images are accepted up to "
                         f"{MAX_INPUT_PIXELS / 1e6:.1f} megapixels (e.g. 4096x4096)")
    try:
        im.load()
    except Image.DecompressionBombError as exc:
        raise InputError(f"{what} is refused as a decompression bomb ({exc})") from None
    except (ValueError, OSError, SyntaxError, EOFError) as exc:
        raise InputError(f"{what} is not a readable image ({exc})") from None
    return im


FLAG_TYPES = {"precision": str, "channels_last": bool, "attention": str, "compile": str, "fp8": bool,
              "prune_amount": float, "prune_method": str, "tensorrt": bool, "memory": list, "kernels": str,
              "strict": bool, "fuse_qkv": bool, "request_graph": bool, "tiny_vae": bool}


def _flags(override: dict) -> OptimizationFlags:
    """A1111 has no toggles in the request; Atelier's may be passed in override_settings.atelier_flags."""
    from ui.controls import MEMORY_SAVERS

    raw = override.get("atelier_flags")
    if raw is None:
        return OptimizationFlags()
    if not isinstance(raw, dict):
        raise InputError("override_settings.atelier_flags must be an object like {\"precision\": \"bf16\"}")
    unknown = sorted(set(raw) - set(FLAG_TYPES))
    if unknown:
        raise InputError(f"override_settings.atelier_flags.{unknown[0]} is not an Atelier flag; "
                         f"known: {', '.join(FLAG_TYPES)}")
    for key, kind in FLAG_TYPES.items():
        if key not in raw:
            continue
        v, name = raw[key], f"override_settings.atelier_flags.{key}"
        if kind is bool and not isinstance(v, bool):
            raise InputError(f"{name} must be true or false; got {_kind(v)}")
        if kind is str and not (isinstance(v, str) and len(v) <= MAX_NAME_CHARS):
            raise InputError(f"{name} must be a string; got {_kind(v)}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise InputError(f"{name} must be a finite number; got {_kind(v)}")
        if kind is list and not (isinstance(v, list) and all(isinstance(m, str) and m in MEMORY_SAVERS for m in v)):
            raise InputError(f"{name} must be a list of memory savers ({', '.join(MEMORY_SAVERS)}); got {_kind(v)}")
    return OptimizationFlags.from_dict(raw)


def build_request(body: dict[str, Any], img2img: bool, device: str | None,
                  decode_init=None) -> tuple[GenerationRequest, int, list[str]]:
    """A1111 txt2img/img2img JSON -> (request for the first iteration, n_iter, notes). Raises InputError.

    Every field is checked strictly (types, ranges, lengths) without decoding anything. For img2img the init
    image is decoded only when `decode_init` is true-ish (the caller holds the job lock); otherwise
    params.init_image is left None and the base64 text is checked for its type only."""
    from pipelines.diffusion import MAX_BATCH, MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_SIDE, MAX_STEPS, resolve_scheduler_name

    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object")
    for key, what in UNSUPPORTED.items():
        if body.get(key):
            raise InputError(f"{key} ({what}) is not supported by Atelier; leave it out")
    override = body.get("override_settings")
    if override is None:
        override = {}
    if not isinstance(override, dict):
        raise InputError(f"override_settings must be an object; got {_kind(override)}")

    prompt = _str(body, "prompt", "", MAX_PROMPT_CHARS)
    negative = _str(body, "negative_prompt", "", MAX_PROMPT_CHARS)
    seed = _int(body, "seed", -1, -1, SEED_MAX)
    if seed == -1:
        seed = random.randint(0, SEED_MAX)
    batch, n_iter = _int(body, "batch_size", 1, 1, MAX_BATCH), _int(body, "n_iter", 1, 1, MAX_IMAGES)
    if batch * n_iter > MAX_IMAGES:
        raise InputError(f"batch_size x n_iter is {batch * n_iter}; at most {MAX_IMAGES} images a request")
    steps = _int(body, "steps", 20, 1, MAX_STEPS)
    guidance = _num(body, "cfg_scale", 7.0, 0.0, MAX_GUIDANCE)
    width, height = _int(body, "width", 512, 64, MAX_SIDE), _int(body, "height", 512, 64, MAX_SIDE)
    notes: list[str] = []
    for key, v in (("width", width), ("height", height)):
        if v % 8:      # A1111 makes its latent (side // 8) and so floors the image to a multiple of 8
            notes.append(f"{key} {v} was rounded down to {v // 8 * 8} (a multiple of 8, as A1111 does)")
    width, height = width // 8 * 8, height // 8 * 8
    sampler = _str(body, "sampler_name", None, MAX_NAME_CHARS, nullable=True)
    sampler_index = _str(body, "sampler_index", None, MAX_NAME_CHARS, nullable=True)
    schedule = _str(body, "scheduler", None, MAX_NAME_CHARS, nullable=True)
    scheduler = resolve_scheduler_name(sampler or sampler_index or "default", schedule)
    for key in ("save_images", "send_images"):
        _bool(body, key, key == "send_images")
    model = _str(override, "sd_model_checkpoint", None, 4096, nullable=True) if "sd_model_checkpoint" in override \
        else _str(body, "sd_model_checkpoint", None, 4096, nullable=True)
    flags = _flags(override)
    init, strength = None, 0.75
    if img2img:
        strength = _num(body, "denoising_strength", 0.75, 0.0, 1.0, lo_open=True)
        inits = body.get("init_images")
        if not isinstance(inits, list) or not inits:
            raise InputError("img2img needs init_images: a list with one base64 image")
        if not isinstance(inits[0], str) or not inits[0]:
            raise InputError(f"init_images[0] must be a base64-encoded image; got {_kind(inits[0])}")
        if len(inits) > 1:
            notes.append(f"only init_images[0] is used; the other {len(inits) - 1} were ignored")
        if decode_init:
            init = _b64_image(inits[0], "init_images[0]")
    elif body.get("denoising_strength") is not None:      # A1111's txt2img carries it for hires fix: type only
        _num(body, "denoising_strength", 0.0, 0.0, 1.0)
    params = DiffusionParams(prompt=prompt, negative_prompt=negative, seed=seed, steps=steps, guidance=guidance,
                             width=width, height=height, scheduler=scheduler, batch_size=batch, init_image=init,
                             strength=strength)
    return GenerationRequest("diffusion", model or None, params, flags, device), n_iter, notes


MODEL_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")


def model_name_of(e) -> str:
    """A1111's `model_name` for a catalogue entry: the file or folder name without its extension."""
    name = (e.path or e.id).rstrip("/").split("/")[-1]
    for suffix in MODEL_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def find_model(catalogue, ref: str | None):
    """The listed diffusion entry that `ref` names: its title (our id), path, model_name or file name, as
    A1111 accepts any of a checkpoint's aliases. None when no listed entry has that name."""
    if not ref:
        return None
    entries = catalogue.entries("diffusion")
    for match in (lambda e: ref in (e.id, e.path),
                  lambda e: ref == model_name_of(e) or ref == (e.path or e.id).rstrip("/").split("/")[-1]):
        for e in entries:
            if match(e):
                return e
    return None


def infotext(meta: dict[str, Any], sampler_label: str, model_name: str) -> str:
    """A1111's 'parameters' text for one image (what its PNG-info tab and other tools read)."""
    lines = [str(meta.get("prompt", ""))]
    if meta.get("negative_prompt"):
        lines.append(f"Negative prompt: {meta['negative_prompt']}")
    kv = [f"Steps: {meta.get('steps')}", f"Sampler: {sampler_label}", f"CFG scale: {meta.get('guidance')}",
          f"Seed: {meta.get('seed')}", f"Size: {meta.get('width')}x{meta.get('height')}"]
    if meta.get("model_hash"):
        kv.append(f"Model hash: {meta['model_hash']}")
    kv.append(f"Model: {model_name}")
    if meta.get("strength") is not None and meta.get("task") == "img2img":
        kv.append(f"Denoising strength: {meta['strength']}")
    kv.append("Version: atelier")
    return "\n".join(lines + [", ".join(kv)])


class A1111Api:
    """The routes' state: the API's place in the studio's bounded GPU queue, its running job, that job's
    progress, live preview and cancel token.

    Requests queue as in A1111: each takes a ticket on the studio's queue board (shared with browser jobs,
    bounded by the same `--queue-size`) before its body is read, waits its turn in arrival order, then runs
    under the studio's GPU lock. Only a full queue is refused, at once, with 503 and Retry-After. A request whose
    client hangs up is dropped (waiting: its place is given up at once) or cancelled (running): `abandon`."""

    def __init__(self, runtime):
        self.rt = runtime
        self.services = runtime.services
        self._lock = threading.Lock()          # held by the one API job that runs (its init image decodes under it)
        self._turn = threading.Condition()
        self._line: list[int] = []             # the API's tickets in arrival order; the first one runs (next)
        self._runs = 0                         # API jobs started so far (info.atelier_queue.run_no)
        self._job_s: deque[float] = deque(maxlen=8)   # recent API job durations, for Retry-After
        self._admitted: dict[int, tuple[int, float]] = {}   # ticket id -> (queue position, time) when admitted
        self._gone: set[int] = set()           # tickets whose client hung up: dropped when their turn comes
        self._running: int | None = None       # the ticket of the API job that runs now
        self.dropped = 0                       # API jobs dropped unstarted because their client hung up
        self.job: Job | None = None
        self.progress = {"step": 0, "total": 0, "job_no": 0, "job_count": 0}
        self._preview_lock = threading.Lock()
        self._preview = None                   # the running job's latest preview (PIL), None when there is none
        self._preview_seq = 0
        self._preview_png: tuple[int, str] | None = None   # (seq, base64 PNG): encoded once per new preview
        # A1111's POST /options state, held by this API (not the studio): the model a request that names none
        # gets (None = the catalogue's default) and the other options a client set
        self.checkpoint: str | None = None
        self.options = {k: v[0] for k, v in OPTION_CHOICES.items()}

    # -- the queue ----------------------------------------------------------------------------
    def retry_after_s(self) -> int:
        """When a place is likely to free up: the median of the recent API jobs' durations (5 s before any)."""
        recent = list(self._job_s)
        return max(1, min(300, math.ceil(statistics.median(recent)))) if recent else 5

    def admit(self):
        """A place in the studio's GPU queue, or QueueFull / ResourceError at once (never waits)."""
        if self.rt.draining.is_set():
            raise ResourceError("the studio is shutting down and takes no new jobs")
        limit = self.services.settings.queue_max_size
        self.rt.release_cancelled()            # places of closed tabs' jobs that Gradio dropped are free again
        ticket = self.rt.queue.try_join(limit)
        if ticket is None:
            raise QueueFull(f"the GPU queue is full ({limit} jobs waiting, the limit set by --queue-size); "
                            f"try again in a little while", retry_after_s=self.retry_after_s())
        with self._turn:
            self._line.append(ticket.id)
            self._admitted[ticket.id] = (self.rt.queue.position(ticket) or 1, time.perf_counter())
        return ticket

    def leave(self, ticket) -> None:
        """Give up `ticket`'s place (done, refused or failed), so the next in line runs."""
        self.rt.queue.leave(ticket)
        with self._turn:
            if ticket.id in self._line:
                self._line.remove(ticket.id)
            self._admitted.pop(ticket.id, None)
            self._turn.notify_all()

    def _wait_turn(self, ticket) -> None:
        """Block until `ticket` is first in the API's line (first come, first served)."""
        with self._turn:
            while True:
                if ticket.id in self._gone:    # its client hung up while it waited: abandon() took it off the line
                    raise ClientGone("the client closed its connection before its job started")
                if not self._line or self._line[0] == ticket.id:
                    return
                if self.rt.draining.is_set():
                    raise ResourceError("the studio is shutting down; this queued job was not started")
                self._turn.wait(timeout=1.0)   # woken by leave(); the timeout only rechecks draining

    def abandon(self, ticket) -> None:
        """`ticket`'s client hung up (its connection closed, as a closed tab or a killed script does). A job that
        waits gives its place up now, so the next in line moves up, and is dropped when its thread next looks;
        a running job is cancelled (it stops at its next step). Nothing happens for a job already finished."""
        with self._turn:
            if ticket.id not in self._admitted:
                return
            self._gone.add(ticket.id)
            job = self.job if self._running == ticket.id else None
            running = self._running == ticket.id
        if running:
            if job is not None:
                job.cancel()
            log.info("API job (ticket %d) cancelled: its client hung up", ticket.id)
        else:
            self.leave(ticket)

    @property
    def started(self) -> int:
        """API jobs started so far (each ran, whatever its outcome); a dropped job is not one of them."""
        return self._runs

    # -- models and options -------------------------------------------------------------------
    def model_for(self, ref: str | None) -> str | None:
        """The catalogue id a request's model name means: any name /sd-models lists (title, model_name, file
        name), else the name itself (a path or hub id the catalogue resolves or refuses); none = the options'."""
        if not ref:
            return self.checkpoint
        e = find_model(self.services.catalogue, ref)
        return e.id if e is not None else ref

    def checkpoint_title(self) -> str | None:
        if self.checkpoint is not None:
            return self.checkpoint
        try:
            return self.services.catalogue.default("diffusion").id
        except AtelierError:
            return None

    def options_json(self) -> dict:
        return {"sd_model_checkpoint": self.checkpoint_title(), "sd_checkpoint_hash": None, **self.options}

    def set_options(self, body: Any) -> None:
        """A1111's POST /options, all or nothing: every key is checked before any is set. A1111 refuses a
        checkpoint it does not list and an option key it does not have (unless the value is null); so does
        this, with 4xx errors that say what is accepted."""
        if not isinstance(body, dict):
            raise InputError("the request body must be a JSON object like {\"sd_model_checkpoint\": \"<title>\"}")
        changes: dict[str, Any] = {}
        for key, v in body.items():
            if v is None:                      # A1111 leaves an option alone when it is sent as null
                continue
            if key == "sd_model_checkpoint":
                name = _str(body, key, None, 4096)
                e = find_model(self.services.catalogue, name)
                if e is None:
                    cat = self.services.catalogue          # a public studio names no server folder in its errors
                    titles = ", ".join(repr(model_name_of(x) if cat.public else x.id)
                                       for x in cat.entries("diffusion")[:8]) or "none"
                    shown = name if len(name) <= 80 else name[:77] + "..."
                    raise ModelLoadError(f"model {shown!r} is not in /sdapi/v1/sd-models; name one by its title or "
                                         f"model_name (available: {titles})")
                changes[key] = e.id
            elif key in OPTION_CHOICES:
                if v not in OPTION_CHOICES[key] or isinstance(v, bool):
                    allowed = " or ".join(repr(c) for c in OPTION_CHOICES[key])
                    raise InputError(f"{key} can only be {allowed} on Atelier; got {_kind(v)}")
                changes[key] = v
            else:
                raise InputError(f"{key!r} is not an option Atelier has; known: sd_model_checkpoint, "
                                 f"{', '.join(OPTION_CHOICES)}")
        for key, v in changes.items():
            if key == "sd_model_checkpoint":
                self.checkpoint = v
            else:
                self.options[key] = v

    # -- auth ---------------------------------------------------------------------------------
    def check_auth(self, request) -> None:
        from fastapi import HTTPException

        auth = self.services.settings.auth
        if not auth:
            return
        header = request.headers.get("authorization", "")
        ok = False
        if header.lower().startswith("basic "):
            try:
                user, _, pw = base64.b64decode(header[6:]).decode().partition(":")
                ok = secrets.compare_digest(user, auth[0]) and secrets.compare_digest(pw, auth[1])
            except (binascii.Error, UnicodeDecodeError):
                ok = False
        if not ok:
            raise HTTPException(401, "this studio runs with --auth: send the same user and password (HTTP Basic)",
                                headers={"WWW-Authenticate": 'Basic realm="atelier"'})

    # -- generation ---------------------------------------------------------------------------
    def generate(self, body: dict, img2img: bool, ticket) -> dict:
        """Run one txt2img / img2img request that holds `ticket` (from admit); always gives the ticket up."""
        from pathlib import Path

        from pipelines.diffusion import SCHEDULERS, resolve_scheduler_name

        settings = self.services.settings
        with self._turn:
            position, queued_at = self._admitted.get(ticket.id, (1, time.perf_counter()))
        try:
            build_request(body, img2img, settings.device)     # every field checked before waiting; nothing decoded
            self._wait_turn(ticket)
            with self._lock:
                # the init image is decoded (in memory, size-checked first) only by the job whose turn it is
                request, n_iter, notes = build_request(body, img2img, settings.device, decode_init=img2img)
                request = dataclasses.replace(request, model=self.model_for(request.model))
                images, metas, timings, run_no, waited_ms, started, stopped = self._run(request, n_iter, notes, ticket, queued_at)
        except ClientGone:
            with self._turn:
                self.dropped += 1
            self.rt.metrics.observe_job("diffusion", "dropped", {})
            log.info("API job (ticket %d) dropped before it started: its client hung up", ticket.id)
            raise
        finally:
            self.leave(ticket)
            with self._turn:
                self._gone.discard(ticket.id)
        self._job_s.append(time.perf_counter() - started)
        p = request.params
        canon = resolve_scheduler_name(p.scheduler)
        label = SCHEDULERS[canon].label if canon in SCHEDULERS else "Automatic"
        model_name = Path(str((metas[0].get("model") if metas else request.model) or "")).stem
        texts = [infotext(m, label, model_name) for m in metas]
        pngs = [png_bytes(im, m, t) for im, m, t in zip(images, metas, texts)]
        saved = []
        if body.get("save_images"):                  # A1111: also keep them in the server's output folder
            folder = Path(settings.output_dir) / "api" / time.strftime("%Y-%m-%d")
            folder.mkdir(parents=True, exist_ok=True)
            for data, m in zip(pngs, metas):
                path = folder / f"{time.strftime('%H%M%S')}-{secrets.token_hex(3)}-seed{m.get('seed', 0)}.png"
                path.write_bytes(data)
                saved.append(str(path))
        send = body.get("send_images", True)
        encoded = [base64.b64encode(d).decode() for d in pngs] if send else []
        seeds = [int(m.get("seed", 0)) for m in metas]
        info = {"prompt": p.prompt, "all_prompts": [p.prompt] * len(images), "negative_prompt": p.negative_prompt,
                "all_negative_prompts": [p.negative_prompt] * len(images), "seed": seeds[0] if seeds else p.seed,
                "all_seeds": seeds, "subseed": -1, "all_subseeds": [-1] * len(images), "steps": p.steps,
                "cfg_scale": p.guidance, "sampler_name": label, "width": p.width, "height": p.height,
                "batch_size": p.batch_size, "sd_model_name": model_name, "infotexts": texts,
                "interrupted": stopped or len(images) < p.batch_size * n_iter, "atelier_notes": notes,
                "atelier_timings_ms": {k: round(v, 2) for k, v in timings.items()}, "atelier_files": saved,
                "atelier_queue": {"position": position, "waited_ms": round(waited_ms, 1), "run_no": run_no}}
        if img2img:
            info["denoising_strength"] = p.strength
        echo = {k: v for k, v in body.items() if k != "init_images"}
        return {"images": encoded, "parameters": echo, "info": json.dumps(info)}

    def _run(self, request, n_iter: int, notes: list[str], ticket, queued_at: float):
        """The job's iterations under the studio's GPU lock; a stop keeps what was made (A1111's partial result)."""
        p = request.params
        # A1111 previews every few steps while a job runs and, when interrupted, decodes the latents it had
        request = dataclasses.replace(request, params=dataclasses.replace(
            p, preview_every=min(PREVIEW_EVERY, p.steps), partial_on_cancel=True,
            preview_method=PREVIEW_METHOD_OF[self.options["show_progress_type"]]))
        p = request.params
        job = Job(on_progress=self._on_progress)
        images, metas, timings = [], [], {}
        with self.rt.gpu_lock:
            with self._turn:                   # one check with abandon(): either it sees this job running, or this
                if ticket.id in self._gone:    # sees its client gone (it hung up while a browser job held the GPU)
                    raise ClientGone("the client closed its connection before its job started")
                self._running = ticket.id
                self.job = job
            started = time.perf_counter()
            self.rt.queue.start(ticket)
            self._runs += 1
            run_no = self._runs
            self._set_preview(None)
            self.progress = {"step": 0, "total": p.steps, "job_no": 0, "job_count": n_iter}
            try:
                for i in range(n_iter):
                    self.progress["job_no"] = i
                    req = request if i == 0 else dataclasses.replace(
                        request, params=dataclasses.replace(p, seed=(p.seed + i * p.batch_size) % (SEED_MAX + 1)))
                    try:
                        result = self.services.manager.generate(req, job)
                    except Cancelled:
                        break
                    images += result.images
                    metas += result.metadata
                    for k, v in result.timings_ms.items():
                        timings[k] = timings.get(k, 0.0) + v
                    notes += [n for n in result.notes if n not in notes]
                    if result.images:            # the last finished image is the preview until the next step's
                        self._set_preview(result.images[-1])
                    if result.cancelled or job.cancelled:
                        break
            finally:
                with self._turn:
                    self.job = None
                    self._running = None
                self._set_preview(None)
        outcome = DONE if images and not job.cancelled else "stopped"
        self.rt.metrics.observe_job("diffusion", outcome, timings, images=len(images))
        waited_ms = (started - queued_at) * 1e3
        return images, metas, timings, run_no, waited_ms, started, job.cancelled

    def _set_preview(self, image) -> None:
        with self._preview_lock:
            self._preview = image
            self._preview_seq += 1

    def current_image(self) -> str | None:
        """The running job's latest preview as base64 PNG (A1111's /progress current_image), encoded once."""
        with self._preview_lock:
            seq, im = self._preview_seq, self._preview
            cached = self._preview_png
        if im is None:
            return None
        if cached is not None and cached[0] == seq:
            return cached[1]
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        encoded = base64.b64encode(buf.getvalue()).decode()
        with self._preview_lock:
            self._preview_png = (seq, encoded)
        return encoded

    def _on_progress(self, ev) -> None:
        if ev.total:
            self.progress["step"], self.progress["total"] = ev.step, ev.total
        if ev.preview is not None:
            self._set_preview(ev.preview)

    def progress_json(self, skip_current_image: bool = False) -> dict:
        pr = self.progress
        job = self.job
        frac = 0.0
        if job is not None and pr["total"]:
            frac = (pr["job_no"] + min(pr["step"], pr["total"]) / pr["total"]) / max(1, pr["job_count"])
        eta = 0.0
        if job is not None and pr["total"]:
            times = [e.step_ms for e in job.trace[-8:] if e.step_ms]
            if times:
                left = (pr["total"] - min(pr["step"], pr["total"])) + pr["total"] * max(0, pr["job_count"] - pr["job_no"] - 1)
                eta = left * sorted(times)[len(times) // 2] / 1e3
        return {"progress": round(frac, 4), "eta_relative": round(eta, 2),
                "state": {"job_count": pr["job_count"] if job else 0, "job_no": pr["job_no"] if job else 0,
                          "sampling_step": pr["step"] if job else 0, "sampling_steps": pr["total"] if job else 0,
                          "interrupted": bool(job and job.cancelled), "skipped": False},
                "current_image": None if (skip_current_image or job is None) else self.current_image(),
                "textinfo": None}

    def interrupt(self) -> None:
        job = self.job
        if job is not None:
            job.cancel()


def mount_a1111_api(demo) -> A1111Api:
    """Add the /sdapi/v1 routes to the running studio's FastAPI app."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    from pipelines.diffusion import SCHEDULERS

    api = A1111Api(demo.atelier_runtime)
    services = api.services

    def error(exc: Exception) -> JSONResponse:
        # OutOfMemory before ResourceError: the same request would fail again, so it is not a 503 to retry
        status = next((code for cls, code in ((InputError, 422), (ModelLoadError, 404), (OutOfMemory, 422),
                                               (ResourceError, 503), (Cancelled, 409)) if isinstance(exc, cls)),
                      400 if isinstance(exc, AtelierError) else 500)
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QueueFull) else None
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status, headers=headers)

    async def body_of(request) -> dict:
        """The JSON body, read up to MAX_BODY_BYTES (a longer one is refused while it streams in)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise InputError(f"the request body is {int(declared) / 2**20:.1f} MiB; at most {MAX_BODY_BYTES // 2**20} MiB")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise InputError(f"the request body is over {MAX_BODY_BYTES // 2**20} MiB")
            chunks.append(chunk)
        return parse_body(b"".join(chunks))

    def route(path: str, method: str):
        def deco(fn):
            async def endpoint(request):
                api.check_auth(request)
                try:
                    return await fn(request)
                except AtelierError as exc:
                    return error(exc)
                except ImportError as exc:
                    return error(AtelierError(f"the diffusion backend cannot run here: {exc}"))
                except Exception as exc:                # a bug: logged, and answered in the same JSON shape
                    log.exception("%s %s failed", method, PREFIX + path)
                    return JSONResponse({"error": type(exc).__name__, "detail": "internal error; see the server log"},
                                        status_code=500)
            endpoint.__name__ = f"a1111_{fn.__name__}"
            endpoint.__annotations__ = {"request": Request}    # a real class: this module's annotations are strings
            demo.app.add_api_route(PREFIX + path, endpoint, methods=[method], include_in_schema=False)
            return fn
        return deco

    import asyncio

    import anyio

    limiter: list = []

    async def on_disconnect(request, callback) -> None:
        """Call `callback` once the client has hung up. The server resumes reading the connection for this,
        so a closed socket is seen as soon as it closes (a half-closed one too: HTTP/1.1 has no half-close)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                callback()
                return

    async def queued(request, img2img: bool):
        """Take a queue place before reading the body (a full queue is refused at once, nothing read), then
        wait for the turn on a thread of the API's own pool: waiting jobs never use up the server's threads."""
        ticket = api.admit()
        try:
            body = await body_of(request)
        except ClientDisconnect:               # hung up while sending its body: nobody to answer
            api.leave(ticket)
            return Response(status_code=499)
        except BaseException:
            api.leave(ticket)
            raise
        if not limiter:
            limiter.append(anyio.CapacityLimiter((services.settings.queue_max_size or 64) + 2))
        # The body is read, so the next ASGI message is http.disconnect: the client hanging up (or the response
        # sent). Watched while the job waits and runs, so a job nobody waits for any more is dropped or stopped.
        watcher = asyncio.ensure_future(on_disconnect(request, lambda: api.abandon(ticket)))
        try:
            return await anyio.to_thread.run_sync(api.generate, body, img2img, ticket, limiter=limiter[0])
        finally:
            watcher.cancel()

    @route("/txt2img", "POST")
    async def txt2img(request):
        return await queued(request, False)

    @route("/img2img", "POST")
    async def img2img(request):
        return await queued(request, True)

    def read_info(body) -> dict:
        if not isinstance(body, dict):
            raise InputError("the request body must be a JSON object like {\"image\": \"<base64>\"}")
        with _decode_slots:                          # a few decodes at once, each size-checked before it starts
            im = _b64_image(body.get("image"), "image")
            try:
                text = im.info.get("parameters", "")
                try:
                    params = read_png_params(im)
                except Exception:                    # a visitor's text chunk that does not parse: no parameters
                    params = {}
                items = {k: v for k, v in im.info.items() if isinstance(v, str) and k != "parameters"}
            finally:
                im.close()
        return {"info": text if isinstance(text, str) else "", "items": items, "parameters": params}

    @route("/png-info", "POST")
    async def png_info(request):
        body = await body_of(request)
        return await anyio.to_thread.run_sync(read_info, body)

    @route("/sd-models", "GET")
    async def sd_models(request):
        out = []
        for e in services.catalogue.entries("diffusion"):
            out.append({"title": e.id, "model_name": model_name_of(e), "hash": None,
                        "sha256": None, "filename": e.path or e.id, "config": None, "atelier_kind": e.kind,
                        "atelier_source": e.source})
        return out

    @route("/samplers", "GET")
    async def samplers(request):
        return [{"name": spec.label, "aliases": [name], "options": {}} for name, spec in SCHEDULERS.items()]

    @route("/schedulers", "GET")
    async def schedulers(request):
        return [{"name": "automatic", "label": "Automatic", "aliases": None, "default_rho": -1, "need_inner_model": False},
                {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0, "need_inner_model": False}]

    @route("/progress", "GET")
    async def progress(request):
        skip = request.query_params.get("skip_current_image", "false").lower() in ("true", "1")
        return await anyio.to_thread.run_sync(api.progress_json, skip)     # a PNG encode: off the event loop

    @route("/interrupt", "POST")
    async def interrupt(request):
        api.interrupt()
        return {}

    @route("/options", "GET")
    async def options(request):
        return api.options_json()

    @route("/options", "POST")
    async def set_options(request):
        api.set_options(await body_of(request))
        return None                                  # A1111 answers null

    @route("/refresh-checkpoints", "POST")
    async def refresh_checkpoints(request):
        # the catalogue scans its folders on every listing; this one rescans now, as A1111's does
        await anyio.to_thread.run_sync(services.catalogue.entries, "diffusion")
        return None

    @route("/sd-vae", "GET")
    async def sd_vae(request):
        return []                                    # A1111 lists only VAE files it found; a model's own VAE is used

    @route("/loras", "GET")
    async def loras(request):
        return []

    @route("/upscalers", "GET")
    async def upscalers(request):
        # A1111 always lists its "None" upscaler; Atelier has no other (hires fix is refused)
        return [{"name": "None", "model_name": None, "model_path": None, "model_url": None, "scale": 4}]

    @route("/cmd-flags", "GET")
    async def cmd_flags(request):
        s = services.settings
        return {"api": True, "nowebui": False, "listen": s.host not in ("127.0.0.1", "localhost", "::1"),
                "server_name": s.host, "port": s.port, "share": s.share,
                "api_auth": "***" if s.auth else None, "gradio_auth": "***" if s.auth else None,   # never the password
                "ckpt_dir": None, "data_dir": None, "device_id": s.device, "atelier_mode": s.mode}

    demo.atelier_a1111 = api
    return api


__all__ = ["A1111Api", "build_request", "infotext", "mount_a1111_api", "PREFIX"]
