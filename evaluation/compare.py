"""Compare: one request run twice, with the fp32 reference and with the chosen toggles.

What the optimization toggles are for: flip one and see side by side what it does to speed,
memory and the picture (the studio's Compare tab, `generate --compare`). Both runs use the same
model, seeds and parameters on the same device, one after the other:

- the reference is plain fp32 with every toggle off, except the memory savers the artist chose
  (they may be what makes the model fit; the table says they were kept);
- a configuration that has not run yet (first use, or compiled / TensorRT code) gets one
  untimed warm-up run first (diffusion: the same batch with at most 2 steps), so compile time
  and cold caches do not pass for latency; compile time is reported as such;
- latency is the generation itself (model load and PNG saving excluded); memory is the
  device's peak during the run; drift is PSNR/SSIM of the 8-bit images the artist sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from core.errors import InputError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags, StyleGANParams
from evaluation.drift import compare as drift_compare
from evaluation.drift import difference_map

MAX_COMPARE_IMAGES = 8          # seeds beyond this are left out of a comparison (said in the notes)
UNTIMED_STAGES = ("load", "save")


@dataclass
class Side:
    label: str
    flags: OptimizationFlags
    images: list                                   # PIL images
    timings_ms: dict[str, float]
    peak_bytes: int
    dtype: str
    optimizations: dict[str, dict]
    warmup_ms: float | None = None                 # None: no warm-up was needed
    notes: list[str] = field(default_factory=list)

    @property
    def latency_ms(self) -> float:
        return sum(v for k, v in self.timings_ms.items() if k not in UNTIMED_STAGES)


@dataclass
class Comparison:
    reference: Side
    candidate: Side
    drift: dict[str, Any]                          # evaluation.drift.compare over all image pairs
    heat: np.ndarray                               # uint8 [H, W, 3] difference map of the first pair
    gain: float                                    # how much the difference map is amplified
    device: str
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        c = self.candidate.latency_ms
        return self.reference.latency_ms / c if c > 0 else float("nan")

    def summary(self) -> str:
        """One line for the progress box."""
        d = self.drift
        psnr = "identical" if d["psnr_db"] == float("inf") else f"PSNR {d['psnr_db']:.1f} dB"
        return (f"Compared on {self.device}: {speed_words(self.speedup)} than the fp32 reference "
                f"({self.candidate.latency_ms:.0f} vs {self.reference.latency_ms:.0f} ms), {psnr}, "
                f"SSIM {d['ssim']:.4f}")


def reference_flags(flags: OptimizationFlags) -> OptimizationFlags:
    """fp32, every toggle off; the memory savers stay (they may be what lets the model fit)."""
    return OptimizationFlags(memory=tuple(flags.memory))


def _worth_trying(request: GenerationRequest) -> str:
    """A toggle that is fast on the device the request runs on, to suggest."""
    import torch

    from core.device import cpu_bf16

    dev = request.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(dev).startswith("cuda"):
        return "precision fp16"
    fast, what = cpu_bf16()
    return "precision bf16" if fast else (f"precision bf16, to see it: this CPU has {what}, so it will be slower "
                                          "than fp32; the toggles pay off on a GPU")


def comparison_request(request: GenerationRequest) -> tuple[GenerationRequest, list[str]]:
    """The request a comparison runs (at most MAX_COMPARE_IMAGES images) and notes about the cut."""
    if replace(request.flags, strict=False) == replace(reference_flags(request.flags), strict=False):
        raise InputError("Nothing to compare: every optimization is off, so your settings are the fp32 reference. "
                         f"Turn on a toggle in the Optimization panel (e.g. {_worth_trying(request)}), "
                         "then press Compare.")
    notes: list[str] = []
    p = request.params
    if isinstance(p, StyleGANParams) and len(p.seeds) > MAX_COMPARE_IMAGES:
        notes.append(f"compared the first {MAX_COMPARE_IMAGES} of {len(p.seeds)} seeds")
        p = replace(p, seeds=p.seeds[:MAX_COMPARE_IMAGES])
    if isinstance(p, DiffusionParams) and p.batch_size > MAX_COMPARE_IMAGES:
        notes.append(f"compared a batch of {MAX_COMPARE_IMAGES} instead of {p.batch_size}")
        p = replace(p, batch_size=MAX_COMPARE_IMAGES)
    return replace(request, params=p, flags=replace(request.flags, strict=False)), notes


def _warmup_request(request: GenerationRequest) -> GenerationRequest:
    p = request.params
    if isinstance(p, DiffusionParams):        # same shapes (batch, size), fewer steps
        p = replace(p, steps=min(p.steps, 2), preview_every=0)
    return replace(request, params=p)


def _needs_warmup(manager, request: GenerationRequest) -> bool:
    f = request.flags
    return (not manager.is_loaded(request)) or f.compile != "off" or f.tensorrt


def run_comparison(manager, request: GenerationRequest, job: Job) -> Comparison:
    """Run `request` with the fp32 reference flags and with its own flags; time, measure, compare.

    `manager` is the model manager (pipelines.manager.ModelManager: `generate`, `is_loaded`),
    passed in so that evaluation/ stays free of the pipelines it measures.

    Each run has its own child job (its own timings), sharing `job`'s cancel token and progress
    callback; `job`'s own timings get one stage per run ("reference", "optimized", "warm-up")."""
    request, notes = comparison_request(request)
    runs = (("fp32 reference", replace(request, flags=reference_flags(request.flags))),
            ("your settings", request))
    sides: list[Side] = []
    device = ""
    for label, req in runs:
        warmup_ms = None
        if _needs_warmup(manager, req):
            job.status(f"{label}: warm-up run (first use of these settings; not timed)")
            warm = job.child()
            before = job.timings_ms.get("warm-up", 0.0)
            with job.stage("warm-up"):
                manager.generate(_warmup_request(req), warm)
            warmup_ms = job.timings_ms["warm-up"] - before
        job.status(f"{label}: timed run")
        sub = job.child()
        with job.stage("reference" if label.startswith("fp32") else "optimized"):
            result = manager.generate(req, sub)
        if result.cancelled or not result.images:
            job.check_cancelled()
            raise InputError(f"the {label} run produced no images; nothing to compare")
        device = result.device
        side_notes = list(result.notes or [])
        sides.append(Side(label, req.flags, list(result.images), dict(sub.timings_ms), int(result.peak_memory_bytes or 0),
                          result.dtype, dict(result.optimizations or {}), warmup_ms, side_notes))
    ref, cand = sides
    a = np.stack([np.asarray(im.convert("RGB")) for im in ref.images])
    b = np.stack([np.asarray(im.convert("RGB")) for im in cand.images])
    if a.shape != b.shape:
        raise InputError(f"the two runs made images of different shapes ({a.shape} vs {b.shape}); "
                         "a toggle changed the output size, so they cannot be compared pixel by pixel")
    drift = drift_compare(a, b, layout="NHWC")
    heat, gain = difference_map(a, b, layout="NHWC")
    return Comparison(ref, cand, drift, heat, gain, device, notes)


def speed_words(ratio: float) -> str:
    if not np.isfinite(ratio):
        return "no timing"
    if ratio >= 1.005:
        return f"{ratio:.2f}× faster"
    if ratio <= 0.995:
        return f"{1 / ratio:.2f}× slower"
    return "as fast"


def comparison_json(c: Comparison) -> dict[str, Any]:
    """The comparison as plain JSON (the CLI's last line)."""
    def side(s: Side) -> dict[str, Any]:
        return {"flags": s.flags.to_dict(), "latency_ms": round(s.latency_ms, 3),
                "stages_ms": {k: round(v, 3) for k, v in s.timings_ms.items()},
                "warmup_ms": None if s.warmup_ms is None else round(s.warmup_ms, 1),
                "peak_memory_bytes": s.peak_bytes, "dtype": s.dtype, "optimizations": s.optimizations,
                "notes": s.notes}

    d = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in c.drift.items()}
    return {"device": c.device, "n_images": len(c.reference.images), "speedup": round(c.speedup, 4),
            "reference": side(c.reference), "candidate": side(c.candidate), "drift": d,
            "difference_gain": round(c.gain, 2), "notes": c.notes, "summary": c.summary()}


__all__ = ["Comparison", "Side", "MAX_COMPARE_IMAGES", "speed_words", "comparison_json", "comparison_request", "reference_flags",
           "run_comparison"]
