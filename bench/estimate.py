"""How long a bench plan takes on the reference H200, before anything runs (`bench --dry-run`).

The GPU machine allows 10 minutes a command and about 30 minutes a session, machine start included,
so a full run is cut into chunks and each chunk has to be known to fit before it is sent. The figures
below are per-call times on the H200: measured ones come from shared/GPU.md and docs/results/
(2026-11-29 smoke run); the rest are derived from those or guessed, and each says which. A case costs

    [child process start] + model build + [compilation] + calls × time per call [+ StyleGAN's 3
    end-to-end generate calls] [+ one profiled call] + cleanup

where calls = warm-up + repeats, and a workload whose fp32 batch-1 case is not in the plan first pays
one fp32 reference call (drift reference and FLOP count). The estimate is meant to err long; it is a
plan, not a measurement, and the JSON lines of a real run say what each case took (`case_s`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from core.types import OptimizationFlags
from bench.specs import BenchConfig, Workload

# What the reference machine lacks even with the carried wheels (diffusers, torchao): a case that needs it is
# skipped there before any model is built, at no cost.
H200_MISSING = {"tensorrt": "TensorRT is not installed on the H200 image",
                "torch_pruning": "torch-pruning is not installed on the H200 image (structured UNet pruning)"}

# Seconds of one Python process that imports the bench and initialises CUDA (an isolated case's child, or
# the command itself); diffusion adds diffusers and transformers. Guessed from this machine's import times
# (torch 2 s, the bench 1.5 s, diffusers + transformers 4 s on 2 slow cores) plus CUDA start-up.
PROCESS_START_S = {"stylegan": 7.0, "diffusion": 12.0}
RATES_S = 4.0                  # the two matrix rates at 8192³ (25 products each, plus allocation)
CLEANUP_S = 1.0                # dynamo reset, gc, empty_cache between cases
PROFILE_EXTRA_S = 3.0          # profiler start and kernel-table work around the profiled call
FP8_COMPILE_FACTOR = 1.5       # guess: torchao's FP8 layers add quantise/scale ops to the compiled graph


@dataclass(frozen=True)
class Anchor:
    """Per-call seconds on the H200 by configuration class, at batch 1 and at the workload's throughput
    batch (linear in between and beyond), plus build and compile seconds."""

    call_s: dict[str, tuple[float, float]]
    build_s: float
    compile_s: dict[str, float]                   # 'default' / 'reduce-overhead' -> first-call compile seconds
    postprocess_s_per_image: float = 0.0          # StyleGAN's generate(): to the CPU, uint8, PIL
    source: str = ""


# Diffusion per-call times = steps × UNet step + VAE decode + text encoder + ~30 ms host work (scheduler,
# tokenizer, PIL). GPU.md's measured UNet steps (CFG, batch 2) and VAE decodes are the base.
ANCHORS: dict[str, Anchor] = {
    # SD1.5, 50 steps: fp32 72.2 ms/step, tf32 33.7, fp16 31.0, bf16+channels_last 27.9, bf16 compile 15.5,
    # fp16 compile + CUDA graphs 9.1 (all measured); VAE 27.8 / 26.3 ms (measured). Batch 8 (UNet batch 16,
    # 12.8 TFLOP a step): eager half precision at ~330 TFLOP/s, compiled ~450, fp32 ~25 (guesses).
    "sd15-512": Anchor(
        call_s={"baseline": (1.61, 2.3), "fp32": (3.68, 26.0), "tf32": (1.75, 4.6), "fp16": (1.61, 2.3),
                "bf16": (1.63, 2.3), "bf16-cl": (1.46, 2.15), "compile": (0.84, 1.75), "compile-cg": (0.52, 1.7),
                "fp8": (0.84, 1.6)},
        build_s=6.0, compile_s={"default": 53.0, "reduce-overhead": 85.0},
        source="GPU.md SD1.5 UNet steps and VAE (measured); batch 8 and fp8 derived"),
    # SDXL, 30 steps: fp16 63.4 ms/step, bf16+channels_last 79.1, bf16 compile 36.2 (compile 108 s), VAE bf16
    # 85.2 ms (measured). fp32 ~0.5 s/step at ~27 TFLOP/s (guess, 13.5 TFLOP a step); fp16 decodes with the
    # VAE upcast to fp32 (SDXL's force_upcast), ~0.35 s (guess). Batch 4: UNet batch 8, 54 TFLOP a step.
    "sdxl-1024": Anchor(
        call_s={"baseline": (2.3, 6.2), "fp32": (16.0, 64.0), "tf32": (7.5, 28.0), "fp16": (2.3, 6.2),
                "bf16": (2.1, 5.3), "bf16-cl": (2.5, 5.6), "compile": (1.23, 4.0), "compile-cg": (1.15, 3.9),
                "fp8": (1.1, 3.2)},
        build_s=15.0, compile_s={"default": 108.0, "reduce-overhead": 160.0},
        source="GPU.md SDXL UNet steps, compile and VAE (measured); fp32, VAE upcast and batch 4 derived"),
    # SD-Turbo, 1 step, no CFG: UNet batch 1 (~20 ms fp16, ~40 ms fp32, guessed from SD1.5's batch-2 steps),
    # OpenCLIP-H text encoder ~4-8 ms, VAE 27 ms, PIL and scheduler ~15 ms. Batch 16: the VAE dominates
    # (16 decodes at 512², ~0.4 s).
    "sd-turbo-512": Anchor(
        call_s={"baseline": (0.066, 0.52), "fp32": (0.091, 2.2), "tf32": (0.07, 0.9), "fp16": (0.066, 0.52),
                "bf16": (0.066, 0.52), "bf16-cl": (0.063, 0.5), "compile": (0.055, 0.5), "compile-cg": (0.05, 0.5),
                "fp8": (0.055, 0.5)},
        build_s=6.0, compile_s={"default": 53.0, "reduce-overhead": 85.0},
        source="derived from GPU.md's SD1.5 figures (SD 2.1-sized UNet at batch 1)"),
    # StyleGAN2 1024 (docs/results/2026-11-29-gpu-smoke.json, measured): fp32 17.0 ms / 1332 ms (batch 1 / 32),
    # NVlabs mixed 11.5 / 192, bf16 autocast 13.4 / 141. Compiled times and compile seconds are guesses
    # (the synthesis graph is a few times smaller than a UNet's).
    "sg2-1024": Anchor(
        call_s={"baseline": (0.0115, 0.192), "fp32": (0.017, 1.33), "tf32": (0.016, 0.6), "fp16": (0.0134, 0.15),
                "bf16": (0.0134, 0.141), "bf16-cl": (0.013, 0.13), "compile": (0.006, 0.1),
                "compile-cg": (0.003, 0.1), "fp8": (0.006, 0.1)},
        build_s=2.0, compile_s={"default": 60.0, "reduce-overhead": 90.0}, postprocess_s_per_image=0.02,
        source="smoke run 2026-11-29 (measured eager); compiled guessed"),
    # StyleGAN3-T 1024 (smoke run, measured): 145 ms at batch 1 in fp32, 586 ms under bf16 autocast (the
    # 1-channel FIR convolutions). Batch 16 and compiled figures are guesses.
    "sg3t-1024": Anchor(
        call_s={"baseline": (0.145, 1.7), "fp32": (0.145, 1.7), "tf32": (0.13, 1.5), "fp16": (0.59, 6.6),
                "bf16": (0.59, 6.6), "bf16-cl": (0.59, 6.6), "compile": (0.35, 4.0), "compile-cg": (0.35, 4.0),
                "fp8": (0.35, 4.0)},
        build_s=2.0, compile_s={"default": 60.0, "reduce-overhead": 90.0}, postprocess_s_per_image=0.02,
        source="smoke run 2026-11-29 (measured batch 1 eager); batch 16 and compiled guessed"),
}
# The tiny harness workloads: milliseconds a call; their cost is process start, build and compilation.
_TINY = Anchor(call_s={k: (0.01, 0.02) for k in ("baseline", "fp32", "tf32", "fp16", "bf16", "bf16-cl", "compile",
                                                 "compile-cg", "fp8")},
               build_s=1.0, compile_s={"default": 20.0, "reduce-overhead": 30.0}, source="guess")


def anchor(wl: Workload) -> Anchor:
    return ANCHORS.get(wl.name, _TINY)


def config_class(flags: OptimizationFlags | None) -> str:
    """The anchor row a configuration's speed is read from."""
    if flags is None:
        return "baseline"
    if flags.compile == "reduce-overhead":
        return "compile-cg"
    if flags.compile == "default":
        return "fp8" if flags.fp8 else "compile"
    if flags.precision in ("fp16", "bf16") and flags.channels_last:
        return "bf16-cl"
    return flags.precision if flags.precision in ("fp32", "tf32", "fp16", "bf16") else "bf16"


def call_seconds(wl: Workload, flags: OptimizationFlags | None, batch: int) -> float:
    lo, hi = anchor(wl).call_s[config_class(flags)]
    big = max(wl.batches)
    if big <= 1 or batch <= 1:
        return lo * max(batch, 1)
    per = (hi - lo) / (big - 1)                       # linear between batch 1 and the throughput batch, and beyond
    t = lo + per * (batch - 1)
    if flags is not None and flags.prune_amount:
        t *= 1.0 - 0.5 * flags.prune_amount           # guess: structured pruning removes about half its share
    return t


def h200_skip_reason(wl: Workload, flags: OptimizationFlags | None) -> str | None:
    """Why the H200 skips this configuration before building anything (see H200_MISSING), or None."""
    if flags is None:
        return None
    if flags.tensorrt:
        return H200_MISSING["tensorrt"]
    if flags.fp8 and wl.kind == "stylegan":
        return "FP8 applies to diffusion UNets only"
    if flags.fuse_qkv and wl.kind == "stylegan":
        return "fused QKV applies to diffusion attention only (StyleGAN has none)"
    if flags.request_graph and wl.kind == "stylegan":
        return "the request graph applies to diffusion requests only"
    if flags.tiny_vae and wl.kind == "stylegan":
        return "the tiny autoencoder replaces a diffusion VAE decoder (StyleGAN has none)"
    if flags.prune_amount and flags.prune_method == "structured" and wl.kind == "diffusion":
        return H200_MISSING["torch_pruning"]
    return None


@dataclass
class CaseEstimate:
    workload: str
    config: str
    batch: int
    seconds: float
    isolated: bool
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "config": self.config, "batch": self.batch,
                "seconds": round(self.seconds, 1), "isolated": self.isolated, "note": self.note,
                "parts": {k: round(v, 1) for k, v in self.parts.items()}}


def estimate_case(wl: Workload, cfg: BenchConfig, batch: int, *, warmup: int | None, repeats: int | None,
                  steps: int | None, isolated: bool, needs_reference: bool, profiled: bool) -> CaseEstimate:
    """Seconds one case takes on the H200, with its parts."""
    a = anchor(wl)
    flags = cfg.flags
    skip = h200_skip_reason(wl, flags)
    if skip:
        return CaseEstimate(wl.name, cfg.name, batch, 0.2, False, f"skipped on the H200: {skip}", {"skip": 0.2})
    scale = (steps / wl.steps) if (steps and wl.steps) else 1.0       # --steps shortens a diffusion call
    call = call_seconds(wl, flags, batch) * scale
    n_warm = max(warmup if warmup is not None else wl.warmup,
                 (3 if wl.kind == "stylegan" else 2) if cfg.uses_compile else 1)
    n_rep = repeats or wl.repeats
    parts: dict[str, float] = {}
    if isolated:
        parts["process"] = PROCESS_START_S[wl.kind]
    parts["build"] = a.build_s
    if cfg.uses_compile:
        c = a.compile_s["reduce-overhead" if flags.compile == "reduce-overhead" else "default"]
        parts["compile"] = c * (FP8_COMPILE_FACTOR if flags.fp8 else 1.0)
    parts["calls"] = call * (n_warm + n_rep)
    if wl.kind == "stylegan" and not cfg.is_baseline:
        parts["end_to_end"] = 3 * (call + a.postprocess_s_per_image * batch)
    if profiled:
        parts["profile"] = 1.5 * call + PROFILE_EXTRA_S
    if needs_reference:
        ref_call = call_seconds(wl, OptimizationFlags(precision="fp32"), 1) * scale
        parts["fp32_reference"] = a.build_s + 2 * ref_call           # first call + the FLOP-count replay
    parts["cleanup"] = CLEANUP_S
    return CaseEstimate(wl.name, cfg.name, batch, sum(parts.values()), isolated, "", parts)


def command_overhead_s(kinds: set[str]) -> float:
    """The command's own process start and the matrix rates (the report at the end takes under a second)."""
    return PROCESS_START_S["diffusion" if "diffusion" in kinds else "stylegan"] + RATES_S


def same_flags_key(wl: Workload, cfg: BenchConfig, batch: int) -> tuple:
    if cfg.flags is None:
        return (wl.name, batch, "baseline", cfg.name)
    return (wl.name, batch, replace(cfg.flags, strict=False), cfg.fp32_layers)
