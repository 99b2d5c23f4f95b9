"""The model manager owns what is on the device.

It loads what a request names, caches pipelines by (backend, model, flags,
device), and evicts the least recently used ones when the next load would
exceed the memory budget. There is no global "current model".
"""
from __future__ import annotations

import gc
import re
import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from core.device import is_out_of_memory, pick_device, release_memory
from core.errors import AtelierError, ModelLoadError, OutOfMemory
from core.types import GenerationRequest, GenerationResult, Job
from models.catalogue import Catalogue
from pipelines import switches
from telemetry.memory import free_device_bytes


class ModelManager:
    def __init__(self, catalogue: Catalogue, device: str | None = None, budget_fraction: float = 0.85,
                 max_cached: int = 4, cache_dir=None):
        self.catalogue = catalogue
        self.default_device = device
        self.budget_fraction = budget_fraction
        self.max_cached = max_cached
        self.cache_dir = cache_dir
        # Process-wide compile settings once, now, so that no request is the one that sets them.
        switches.configure_process(cache_dir)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._warm: set[tuple] = set()     # cached pipelines that have completed one generation (readiness)
        self._lock = threading.RLock()
        self.last_load_ms: float | None = None

    def _key(self, request: GenerationRequest, device: torch.device, model_id: str) -> tuple:
        flags = replace(request.flags, strict=False)
        return (request.backend, model_id, flags, str(device))

    def get(self, request: GenerationRequest):
        device = pick_device(request.device or self.default_device)
        entry = self.catalogue.resolve(request.model, request.backend)
        key = self._key(request, device, entry.id)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            self._make_room(device, entry.size_bytes or 0)
            pipe = self._load(request, entry, device)
            self._cache[key] = pipe
            while len(self._cache) > self.max_cached:
                self._evict_one()
            return pipe

    def _request_key(self, request: GenerationRequest) -> tuple:
        device = pick_device(request.device or self.default_device)
        return self._key(request, device, self.catalogue.resolve(request.model, request.backend).id)

    def mark_warm(self, request: GenerationRequest) -> None:
        """Record that this request's pipeline (if still cached) has completed a generation."""
        key = self._request_key(request)
        with self._lock:
            if key in self._cache:
                self._warm.add(key)

    def holds_warm(self, backend: str, model_id: str) -> bool:
        """Whether a pipeline of `model_id` (any flags, any device) is cached and has generated once."""
        with self._lock:
            return any(k[0] == backend and k[1] == model_id for k in self._warm if k in self._cache)

    def is_loaded(self, request: GenerationRequest) -> bool:
        """Whether a pipeline for exactly this request's model, flags and device is in the cache."""
        device = pick_device(request.device or self.default_device)
        entry = self.catalogue.resolve(request.model, request.backend)
        with self._lock:
            return self._key(request, device, entry.id) in self._cache

    def _load(self, request: GenerationRequest, entry, device: torch.device):
        import time

        from pipelines import preload

        # no model load imports alongside the studio's background import of diffusers (its modules pull in
        # torch._dynamo, which a compiled StyleGAN load would import too): it waits until that is done
        preload.wait()
        t0 = time.perf_counter()
        oom = None
        try:
            if request.backend == "stylegan":
                from models.stylegan import load_generator
                from pipelines.stylegan import StyleGANPipeline

                loaded = load_generator(entry.path or entry.id, device="cpu")
                pipe = StyleGANPipeline(loaded, request.flags, device, cache_dir=self.cache_dir)
            else:
                from pipelines import diffusion

                # With CPU offload the weights stay in RAM and accelerate moves each model to the GPU only
                # while it runs: loading onto the GPU first would put the whole pipeline there at load time.
                offload = "cpu-offload" in request.flags.memory and device.type == "cuda"
                loaded = diffusion.load_diffusion(entry.path or entry.id, device=None if offload else device,
                                                  flags=request.flags, cache_dir=self.cache_dir)
                pipe = diffusion.DiffusionPipeline(loaded, request.flags, device, cache_dir=self.cache_dir)
        except AtelierError:
            raise
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise ModelLoadError(f"could not load {entry.id}: {type(exc).__name__}: {exc}") from None
            oom = _allocator_said(exc)     # raised below, outside this block: see generate()
        except ImportError as exc:
            raise ModelLoadError(f"the {request.backend} backend needs a package that is not installed "
                                 f"({exc.name or exc}); run `make setup` or pip install -r requirements.txt") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError) as exc:
            raise ModelLoadError(f"could not load {entry.id}: {type(exc).__name__}: {exc}") from None
        if oom is not None:
            release_memory(device)
            where = "GPU memory" if device.type == "cuda" else "memory"
            raise OutOfMemory(f"out of {where} while loading {entry.id} ({oom}); close other models or use a "
                              "smaller precision")
        self.last_load_ms = (time.perf_counter() - t0) * 1e3
        return pipe

    def _make_room(self, device: torch.device, incoming_bytes: int) -> None:
        if device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(device).total_memory
        while self._cache and (total - free_device_bytes(device)) + incoming_bytes > self.budget_fraction * total:
            self._evict_one()

    def _evict_one(self) -> None:
        key, pipe = self._cache.popitem(last=False)
        self._warm.discard(key)
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def style_layers(self, ref: str | None) -> int | None:
        """The style-layer count of a StyleGAN model, never loading it: from an Atelier model's JSON or a run's
        config, else from the model as loaded now (any flags, any device; an NVlabs pickle after its first run)."""
        from models.stylegan import style_layers_of_file

        try:
            entry = self.catalogue.resolve(ref, "stylegan")
        except Exception:       # an unknown name: the generate call will say so
            return None
        n = style_layers_of_file(entry.path) if entry.path else None
        return n or self._loaded_style_layers(entry.id)

    def classes(self, ref: str | None) -> tuple[int, list[str]] | None:
        """(class count, names) of a StyleGAN model, never loading it: from an Atelier model's JSON, else from
        the model as loaded now (names from its config); None when unknown (an NVlabs pickle before its first run)."""
        from models.stylegan import classes_of_file

        try:
            entry = self.catalogue.resolve(ref, "stylegan")
        except Exception:       # an unknown name: the generate call will say so
            return None
        known = classes_of_file(entry.path) if entry.path else None
        if known is not None:
            return known
        with self._lock:
            for k, p in self._cache.items():
                if k[0] == "stylegan" and k[1] == entry.id and hasattr(p, "class_names"):
                    return int(p.loaded.G.c_dim), p.class_names()
        return None

    def _loaded_style_layers(self, model_id: str) -> int | None:
        with self._lock:
            for k, p in self._cache.items():
                if k[0] == "stylegan" and k[1] == model_id:
                    n = getattr(getattr(getattr(p, "loaded", None), "G", None), "num_ws", None)
                    if isinstance(n, int) and n > 0:
                        return n
        return None

    def loaded(self) -> list[dict]:
        with self._lock:
            return [{"backend": k[0], "model": k[1], "flags": k[2].to_dict(), "device": k[3],
                     "bytes": getattr(p, "memory_bytes", lambda: 0)()} for k, p in self._cache.items()]

    def clear(self) -> None:
        with self._lock:
            while self._cache:
                self._evict_one()

    def generate(self, request: GenerationRequest, job: Job | None = None) -> GenerationResult:
        """Run `request` on its pipeline. A request too large for the device fails with OutOfMemory, with what
        it held given back, so the next request runs as if it had not happened. If other pipelines were
        cached on that device they are evicted and the request is tried once more first."""
        job = job or Job()
        with switches.scoped():   # whatever the request (or a library under it) switches is put back after it
            return self._generate(request, job)

    def _generate(self, request: GenerationRequest, job: Job) -> GenerationResult:
        with job.stage("load"):
            pipe = self.get(request)
        for attempt in (1, 2):
            oom = None
            try:
                result = pipe.generate(request, job)
            except (MemoryError, torch.OutOfMemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
                # Raised outside this block: an exception raised inside it would keep this one as its
                # __context__, and its traceback's frames hold every tensor the failed request had made.
                oom = _allocator_said(exc)
            if oom is None:
                break
            release_memory(pipe.device)
            if attempt == 2 or not self._evict_others(pipe):
                where = "GPU memory" if pipe.device.type == "cuda" else "memory"
                raise OutOfMemory(f"out of {where} for this request ({oom}): lower the batch size or image size, "
                                  "or turn on a memory saver")
        if not result.cancelled:
            self.mark_warm(request)
        return result

    def _evict_others(self, pipe) -> bool:
        """Evict every cached pipeline on `pipe`'s device but `pipe`; True if any was."""
        with self._lock:
            others = [k for k, p in self._cache.items() if p is not pipe and k[3] == str(pipe.device)]
            for k in others:
                self._warm.discard(k)
                del self._cache[k]
        if others:
            release_memory(pipe.device)
        return bool(others)


def _allocator_said(exc: BaseException) -> str:
    """The allocation failure's first line, short (it names sizes, never a path)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", text)   # the CPU allocator's source line
    return text if len(text) <= 160 else text[:157] + "..."
