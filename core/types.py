"""Request, result and job types shared by every backend, the UI and the CLI.

Every request carries everything it needs: backend, model, parameters and
optimization flags. Nothing here knows about Gradio.
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from core.errors import Cancelled, InputError

BACKENDS = ("stylegan", "diffusion")
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
NOISE_MODES = ("const", "random", "none")
# what truncation pulls w towards: the class's own mean w (class-conditional models) or the running mean w_avg
# tracked over all classes in training (models/class_centres.py says why)
TRUNCATION_CENTRES = ("class", "global")
SEED_MAX = 2**32 - 1


@dataclass(frozen=True)
class OptimizationFlags:
    """Which optimizations a request asks for. The model manager caches by these."""

    precision: str = "fp32"            # fp32 | tf32 | fp16 | bf16
    channels_last: bool = False
    attention: str = "sdpa"            # sdpa | xformers | math
    compile: str = "off"               # off | default | reduce-overhead
    fp8: bool = False
    prune_amount: float = 0.0          # 0 = off
    prune_method: str = "l1-unstructured"  # l1-unstructured | structured
    tensorrt: bool = False
    memory: tuple[str, ...] = ()       # attention-slicing, vae-tiling, vae-slicing, cpu-offload
    kernels: str = "auto"              # StyleGAN op implementations: auto | reference | knob:choice/... (models.kernels)
    strict: bool = False               # a requested toggle that cannot run is an error, not a skip
    fuse_qkv: bool = False             # diffusion: one Q/K/V (cross-attention: K/V) projection per attention layer
    request_graph: bool = False        # diffusion on CUDA: one CUDA graph per request (pipelines/request_graph.py)
    tiny_vae: bool = False             # diffusion: decode (and preview) with TAESD / TAESDXL (optim/tiny_vae.py)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.attention not in ("sdpa", "xformers", "math"):
            raise InputError(f"attention must be sdpa, xformers or math; got {self.attention!r}")
        if self.compile not in ("off", "default", "reduce-overhead"):
            raise InputError(f"compile must be off, default or reduce-overhead; got {self.compile!r}")
        if not (0.0 <= float(self.prune_amount) < 1.0):
            raise InputError(f"prune amount must be in [0, 1); got {self.prune_amount}")
        if self.prune_method not in ("l1-unstructured", "structured"):
            raise InputError(f"prune method must be l1-unstructured or structured; got {self.prune_method!r}")
        if not isinstance(self.kernels, str) or not (self.kernels in ("auto", "reference") or ":" in self.kernels):
            raise InputError(f"kernels must be auto, reference, or knob:choice pairs joined by '/' "
                             f"(e.g. fir:triton/up:subpixel-fused); got {self.kernels!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"] = list(self.memory)
        return d

    def requested(self) -> set[str]:
        """The toggles these flags turn on (report names: precision, channels_last, attention, ...)."""
        on = {"precision": self.precision != "fp32", "channels_last": self.channels_last,
              "attention": self.attention != "sdpa", "compile": self.compile != "off", "fp8": self.fp8,
              "prune": self.prune_amount > 0, "tensorrt": self.tensorrt, "memory": bool(self.memory),
              "kernels": self.kernels != "auto", "fuse_qkv": self.fuse_qkv,
              "request_graph": self.request_graph, "tiny_vae": self.tiny_vae}
        return {name for name, v in on.items() if v}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "OptimizationFlags":
        if not d:
            return cls()
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "memory" in known:
            known["memory"] = tuple(known["memory"] or ())
        return cls(**known)


def check_seed(seed: int) -> int:
    try:
        s = int(str(seed).strip()) if isinstance(seed, str) else int(seed)
        if isinstance(seed, float) and not seed.is_integer():
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"seed must be an integer in 0..{SEED_MAX}; got {seed!r}") from None
    if not (0 <= s <= SEED_MAX):
        raise InputError(f"seed must be an integer in 0..{SEED_MAX}; got {seed!r}")
    return s


def parse_seeds(text: str) -> tuple[int, ...]:
    """'0-7', '1,5,9', '3' -> a tuple of seeds; ranges are inclusive."""
    seeds: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if "-" in part[1:]:
            lo, hi = part.split("-", 1) if not part.startswith("-") else (part, "")
            a, b = check_seed(lo), check_seed(hi)
            if b < a:
                raise InputError(f"seed range {part!r} runs backwards")
            if b - a >= 4096:
                raise InputError(f"seed range {part!r} has more than 4096 seeds")
            seeds.extend(range(a, b + 1))
        else:
            seeds.append(check_seed(part))
    if not seeds:
        raise InputError(f"no seeds in {text!r}; write e.g. 0-7 or 1,5,9")
    return tuple(seeds)


@dataclass(frozen=True)
class StyleGANParams:
    seeds: tuple[int, ...] = (0,)
    truncation_psi: float = 1.0
    truncation_cutoff: int | None = None
    noise_mode: str = "const"
    class_index: int | str | None = None  # an index, or a class name the model's file lists (resolved by the pipeline)
    batch_size: int = 8                 # images per forward pass
    truncation_centre: str = "class"    # class | global; unconditional models always truncate towards w_avg (global)

    def __post_init__(self):
        object.__setattr__(self, "seeds", tuple(check_seed(s) for s in self.seeds))
        if not self.seeds:
            raise InputError("at least one seed is needed")
        if not math.isfinite(float(self.truncation_psi)):
            raise InputError(f"truncation ψ must be a finite number; got {self.truncation_psi}")
        if self.noise_mode not in NOISE_MODES:
            raise InputError(f"noise mode must be one of {', '.join(NOISE_MODES)}; got {self.noise_mode!r}")
        if self.truncation_cutoff is not None and int(self.truncation_cutoff) < 0:
            raise InputError("truncation cutoff must be a non-negative layer count")
        centre = str(self.truncation_centre).strip().lower() if isinstance(self.truncation_centre, str) else None
        if centre not in TRUNCATION_CENTRES:
            raise InputError(f"truncation centre must be 'class' (towards each class's own mean w) or 'global' "
                             f"(towards the model's mean w over all classes); got {self.truncation_centre!r}")
        object.__setattr__(self, "truncation_centre", centre)
        if isinstance(self.class_index, str):
            text = self.class_index.strip()
            object.__setattr__(self, "class_index", None if not text else int(text)
                               if text.lstrip("+-").isdigit() else text)
        elif self.class_index is not None:
            if isinstance(self.class_index, float) and not float(self.class_index).is_integer():
                raise InputError(f"class index must be a whole number; got {self.class_index}")
            object.__setattr__(self, "class_index", int(self.class_index))
        if int(self.batch_size) < 1:
            raise InputError("batch size must be at least 1")


@dataclass(frozen=True)
class DiffusionParams:
    prompt: str = ""
    negative_prompt: str = ""
    seed: int = 0
    steps: int = 25
    guidance: float = 7.0
    width: int = 512
    height: int = 512
    scheduler: str = "default"
    batch_size: int = 1
    init_image: str | None = None       # path to an image file for image-to-image
    strength: float = 0.75
    preview_every: int = 0              # 0 = no previews
    # how a live preview is drawn (PREVIEW_METHODS): 'auto' = the tiny autoencoder when it is loaded or its weights
    # are on disk, else the latent map; 'latent' = the linear latent-to-RGB map; 'taesd' = the tiny autoencoder;
    # 'full' = the model's own VAE (exact, slowest). Only previews: the final image is decoded as the toggles say.
    preview_method: str = "auto"
    # a stopped job decodes the latents it had and returns them as a (noisy) partial result, as A1111 does;
    # off by default: the studio keeps nothing of a stopped diffusion job
    partial_on_cancel: bool = False

    def __post_init__(self):
        object.__setattr__(self, "seed", check_seed(self.seed))
        if self.preview_method not in PREVIEW_METHODS:
            raise InputError(f"preview method must be one of {', '.join(PREVIEW_METHODS)}; got {self.preview_method!r}")


# live-preview decoders of a diffusion job (DiffusionParams.preview_method); ComfyUI's --preview-method and A1111's
# "Live preview display" offer the same choice
PREVIEW_METHODS = ("auto", "latent", "taesd", "full")


@dataclass(frozen=True)
class GenerationRequest:
    backend: str
    model: str | None                   # catalogue id or path; None = the default for the backend
    params: StyleGANParams | DiffusionParams
    flags: OptimizationFlags = field(default_factory=OptimizationFlags)
    device: str | None = None           # None = best available

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise InputError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")


@dataclass
class GenerationResult:
    images: list                        # PIL.Image.Image, one per sample
    raw: np.ndarray                     # float32 [N, C, H, W] as the network returned it
    timings_ms: dict[str, float]
    peak_memory_bytes: int
    device: str
    dtype: str
    optimizations: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)   # per image: what goes into the PNG
    cancelled: bool = False


@dataclass
class ProgressEvent:
    stage: str
    step: int
    total: int
    step_ms: float | None = None
    preview: Any = None                 # PIL image or None
    message: str = ""


class Job:
    """Cancel token, progress callback and per-step trace of one generation or training job."""

    def __init__(self, on_progress: Callable[[ProgressEvent], None] | None = None, sync: Callable[[], None] | None = None):
        self._cancel = threading.Event()
        self._on_progress = on_progress
        self._sync = sync               # e.g. torch.cuda.synchronize, so stage times are real
        self.timings_ms: dict[str, float] = {}
        self.trace: list[ProgressEvent] = []
        self.stage_name = "queued"
        self.started = time.time()
        self._last_step_t: float | None = None

    def child(self) -> "Job":
        """A job with its own timings and trace that shares this one's cancel token and progress
        callback: one press that runs several generations (a comparison) times each separately,
        and Stop still reaches whichever is running."""
        sub = Job(self._on_progress, self._sync)
        sub._cancel = self._cancel
        sub.stage_name = self.stage_name
        return sub

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("cancelled by the user")

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.stage_name = name
        if self._sync:
            self._sync()
        t0 = time.perf_counter()
        self._last_step_t = t0
        try:
            yield
        finally:
            if self._sync:
                self._sync()
            self.timings_ms[name] = self.timings_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

    def status(self, message: str) -> None:
        """Report a status line (e.g. "compiling (first run for this size)") without counting a step."""
        last = self.trace[-1] if self.trace else None
        ev = ProgressEvent(self.stage_name, last.step if last else 0, last.total if last else 0, None, None, message)
        if self._on_progress:
            self._on_progress(ev)

    def step(self, step: int, total: int, preview: Any = None, message: str = "") -> None:
        """Record one finished step; raises Cancelled if a cancel was requested."""
        now = time.perf_counter()
        step_ms = None if self._last_step_t is None else (now - self._last_step_t) * 1e3
        self._last_step_t = now
        ev = ProgressEvent(self.stage_name, step, total, step_ms, preview, message)
        self.trace.append(ProgressEvent(ev.stage, step, total, step_ms, None, message))
        if self._on_progress:
            self._on_progress(ev)
        self.check_cancelled()
