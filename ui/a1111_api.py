"""An AUTOMATIC1111-compatible HTTP API on the studio's server (`/sdapi/v1/...`).

Many tools already speak A1111's web API: painting-app plugins, batch scripts, bots. The same
routes here let them drive Atelier's diffusion backend without changes:

    POST /sdapi/v1/txt2img     POST /sdapi/v1/img2img     POST /sdapi/v1/png-info
    GET  /sdapi/v1/sd-models   GET  /sdapi/v1/samplers    GET  /sdapi/v1/schedulers
    GET  /sdapi/v1/progress    POST /sdapi/v1/interrupt   GET  /sdapi/v1/options

Requests are read with A1111's field names (prompt, negative_prompt, seed (-1 = random),
steps, cfg_scale, width, height, sampler_name + scheduler, batch_size, n_iter,
denoising_strength, init_images, override_settings.sd_model_checkpoint) and answered in its
shape: base64 PNGs (with both Atelier's and A1111's parameter chunks), the request echoed as
`parameters`, and `info` as a JSON string with all_seeds and infotexts. Fields Atelier does not
implement (hires fix, restore faces, scripts, ...) are refused by name instead of being ignored.

Jobs take the studio's GPU lock and appear on its queue board and in /metrics, so an API job
and a browser job never share the GPU. With --auth the routes want the same user and password
(HTTP Basic), as A1111's --api-auth does.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import random
import secrets
import threading
import time
from typing import Any

from core.errors import AtelierError, Cancelled, InputError, ModelLoadError, ResourceError
from core.pnginfo import png_bytes, read_png_params
from core.types import SEED_MAX, DiffusionParams, GenerationRequest, Job, OptimizationFlags
from telemetry.live import DONE

PREFIX = "/sdapi/v1"
MAX_IMAGES = 16                       # batch_size x n_iter per request
UNSUPPORTED = {                       # A1111 fields with an effect Atelier does not have: refused when set
    "enable_hr": "hires fix", "restore_faces": "face restoration", "tiling": "seamless tiling",
    "script_name": "scripts", "alwayson_scripts": "extensions", "subseed_strength": "variation seeds",
    "refiner_checkpoint": "the SDXL refiner", "mask": "inpainting masks",
}


def _b64_image(data: str, what: str):
    from PIL import Image

    if not isinstance(data, str) or not data:
        raise InputError(f"{what} must be a base64-encoded image")
    if data.startswith("data:"):
        data = data.split(",", 1)[-1]
    try:
        raw = base64.b64decode(data, validate=False)
        im = Image.open(io.BytesIO(raw))
        im.load()
    except (binascii.Error, ValueError, OSError) as exc:
        raise InputError(f"{what} is not a readable base64 image ({exc})") from None
    return im


def _flags(override: dict) -> OptimizationFlags:
    """A1111 has no toggles in the request; Atelier's may be passed in override_settings.atelier_flags."""
    raw = override.get("atelier_flags")
    if raw is None:
        return OptimizationFlags()
    if not isinstance(raw, dict):
        raise InputError("override_settings.atelier_flags must be an object like {\"precision\": \"bf16\"}")
    return OptimizationFlags.from_dict(raw)


def build_request(body: dict[str, Any], img2img: bool, device: str | None,
                  save_init) -> tuple[GenerationRequest, int, list[str]]:
    """A1111 txt2img/img2img JSON -> (request for the first iteration, n_iter, notes). Raises InputError."""
    from pipelines.diffusion import resolve_scheduler_name

    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object")
    for key, what in UNSUPPORTED.items():
        if body.get(key):
            raise InputError(f"{key} ({what}) is not supported by Atelier; leave it out")
    override = body.get("override_settings") or {}
    if not isinstance(override, dict):
        raise InputError("override_settings must be an object")

    def num(key, default, cast=float):
        v = body.get(key, default)
        try:
            return cast(v)
        except (TypeError, ValueError):
            raise InputError(f"{key} must be a number; got {v!r}") from None

    seed = num("seed", -1, int)
    if seed == -1:
        seed = random.randint(0, SEED_MAX)
    batch, n_iter = num("batch_size", 1, int), num("n_iter", 1, int)
    if batch < 1 or n_iter < 1:
        raise InputError("batch_size and n_iter must be at least 1")
    if batch * n_iter > MAX_IMAGES:
        raise InputError(f"batch_size x n_iter is {batch * n_iter}; at most {MAX_IMAGES} images a request")
    scheduler = resolve_scheduler_name(body.get("sampler_name") or body.get("sampler_index") or "default",
                                       body.get("scheduler"))
    init_path = None
    if img2img:
        inits = body.get("init_images") or []
        if not inits:
            raise InputError("img2img needs init_images: a list with one base64 image")
        init_path = save_init(_b64_image(inits[0], "init_images[0]"))
    params = DiffusionParams(prompt=str(body.get("prompt", "")), negative_prompt=str(body.get("negative_prompt", "")),
                             seed=seed, steps=num("steps", 20, int), guidance=num("cfg_scale", 7.0),
                             width=num("width", 512, int), height=num("height", 512, int), scheduler=scheduler,
                             batch_size=batch, init_image=init_path,
                             strength=num("denoising_strength", 0.75) if img2img else 0.75)
    model = override.get("sd_model_checkpoint") or body.get("sd_model_checkpoint") or None
    return GenerationRequest("diffusion", model, params, _flags(override), device), n_iter, []


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
    """The routes' state: one API job at a time, its progress and its cancel token."""

    def __init__(self, runtime):
        self.rt = runtime
        self.services = runtime.services
        self._lock = threading.Lock()
        self.job: Job | None = None
        self.progress = {"step": 0, "total": 0, "job_no": 0, "job_count": 0}

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
    def generate(self, body: dict, img2img: bool) -> dict:
        from pathlib import Path

        from pipelines.diffusion import SCHEDULERS, resolve_scheduler_name

        settings = self.services.settings
        tmp = Path(settings.output_dir) / "api-inputs"

        def save_init(im):
            tmp.mkdir(parents=True, exist_ok=True)
            path = tmp / f"init-{secrets.token_hex(6)}.png"
            im.convert("RGB").save(path)
            return str(path)

        request, n_iter, notes = build_request(body, img2img, settings.device, save_init)
        p = request.params
        if self.rt.draining.is_set():
            raise ResourceError("the studio is shutting down and takes no new jobs")
        if not self._lock.acquire(blocking=False):
            raise ResourceError("another API job is running; wait for it or POST /sdapi/v1/interrupt")
        ticket = self.rt.queue.join()
        try:
            job = Job(on_progress=self._on_progress)
            self.job = job
            self.progress = {"step": 0, "total": p.steps, "job_no": 0, "job_count": n_iter}
            images, metas, timings = [], [], {}
            with self.rt.gpu_lock:
                self.rt.queue.start(ticket)
                for i in range(n_iter):
                    self.progress["job_no"] = i
                    req = request if i == 0 else dataclasses.replace(
                        request, params=dataclasses.replace(p, seed=(p.seed + i * p.batch_size) % (SEED_MAX + 1)))
                    try:
                        result = self.services.manager.generate(req, job)
                    except Cancelled:
                        break
                    if result.cancelled:
                        break
                    images += result.images
                    metas += result.metadata
                    for k, v in result.timings_ms.items():
                        timings[k] = timings.get(k, 0.0) + v
                    notes += [n for n in result.notes if n not in notes]
            self.rt.metrics.observe_job("diffusion", DONE if images else "stopped", timings, images=len(images))
        finally:
            self.rt.queue.leave(ticket)
            self.job = None
            self._lock.release()
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
                "interrupted": len(images) < p.batch_size * n_iter, "atelier_notes": notes,
                "atelier_timings_ms": {k: round(v, 2) for k, v in timings.items()}, "atelier_files": saved}
        if img2img:
            info["denoising_strength"] = p.strength
        echo = {k: v for k, v in body.items() if k != "init_images"}
        return {"images": encoded, "parameters": echo, "info": json.dumps(info)}

    def _on_progress(self, ev) -> None:
        if ev.total:
            self.progress["step"], self.progress["total"] = ev.step, ev.total

    def progress_json(self) -> dict:
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
                "current_image": None, "textinfo": None}

    def interrupt(self) -> None:
        job = self.job
        if job is not None:
            job.cancel()


def mount_a1111_api(demo) -> A1111Api:
    """Add the /sdapi/v1 routes to the running studio's FastAPI app."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from pipelines.diffusion import SCHEDULERS

    api = A1111Api(demo.atelier_runtime)
    services = api.services

    def error(exc: Exception) -> JSONResponse:
        status = {InputError: 422, ModelLoadError: 404, ResourceError: 503, Cancelled: 409}.get(type(exc), 500)
        if status == 500 and isinstance(exc, AtelierError):
            status = 400
        return JSONResponse({"error": type(exc).__name__, "detail": str(exc)}, status_code=status)

    async def body_of(request) -> dict:
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError):
            raise InputError("the request body is not JSON") from None

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
            endpoint.__name__ = f"a1111_{fn.__name__}"
            endpoint.__annotations__ = {"request": Request}    # a real class: this module's annotations are strings
            demo.app.add_api_route(PREFIX + path, endpoint, methods=[method], include_in_schema=False)
            return fn
        return deco

    import anyio

    @route("/txt2img", "POST")
    async def txt2img(request):
        body = await body_of(request)
        return await anyio.to_thread.run_sync(api.generate, body, False)

    @route("/img2img", "POST")
    async def img2img(request):
        body = await body_of(request)
        return await anyio.to_thread.run_sync(api.generate, body, True)

    @route("/png-info", "POST")
    async def png_info(request):
        body = await body_of(request)
        im = _b64_image(body.get("image", ""), "image")
        text = im.info.get("parameters", "")
        try:
            params = read_png_params(im)
        except InputError:
            params = {}
        return {"info": text, "items": {k: v for k, v in im.info.items() if isinstance(v, str) and k != "parameters"},
                "parameters": params}

    @route("/sd-models", "GET")
    async def sd_models(request):
        out = []
        for e in services.catalogue.entries("diffusion"):
            out.append({"title": e.id, "model_name": (e.path or e.id).rstrip("/").split("/")[-1], "hash": None,
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
        return api.progress_json()

    @route("/interrupt", "POST")
    async def interrupt(request):
        api.interrupt()
        return {}

    @route("/options", "GET")
    async def options(request):
        try:
            default = services.catalogue.default("diffusion").id
        except AtelierError:
            default = None
        return {"sd_model_checkpoint": default, "samples_format": "png"}

    demo.atelier_a1111 = api
    return api


__all__ = ["A1111Api", "build_request", "infotext", "mount_a1111_api", "PREFIX"]
