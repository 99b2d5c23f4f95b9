"""The benchmark loop: every (workload, batch, configuration) case measured in isolation,
each result appended to a JSON-lines file the moment it exists.

A run can be cut into pieces (`--workload`, `--configs`, `--batches`, `--max-minutes`)
and the pieces merged later by the report: a killed command still leaves every finished
case on disk, and a case that started but never finished shows up as such. One failing
configuration is recorded with its reason and the loop goes on.

Rows (one JSON object a line, `type` says which):
- `run`: when, where, with what (torch, GPU, command) and the two measured matrix rates;
- `workload`: the workload's settings, FLOPs per image (counted on the fp32 reference run),
  parameter counts and targets;
- `start`: a case began (so a kill mid-case is visible);
- `result`: a case's numbers, or why it was skipped or failed.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import optim
from optim.precision import tf32_switches
from core.device import peak_memory_bytes, pick_device, reset_peak_memory
from core.errors import AtelierError, InputError, OptionalDependencyError
from core.types import DiffusionParams, GenerationRequest, Job, OptimizationFlags, StyleGANParams
from pipelines.base import to_uint8_images
from bench import build
from bench.estimate import command_overhead_s, estimate_case, same_flags_key
from bench.measure import (CallCapture, StageClock, count_flops_detailed, device_times_ms, fp8_rate,
                                     matrix_rates, median, profile_call, spread_pct, sync, wall_ms)
from bench.specs import PROMPT, BenchConfig, Workload, get_workload, resolve_configs

ROOT = Path(__file__).resolve().parents[1]
JSONL_NAME = "bench.jsonl"
REFERENCE_FLAGS = OptimizationFlags(precision="fp32")

DriftFn = Callable[[np.ndarray, np.ndarray], dict]


class SkipCase(Exception):
    """A configuration that cannot run here (a toggle this build or this machine lacks)."""


@dataclass
class BenchOptions:
    workloads: list[str]
    configs: list[str] | None = None              # names or NAME@key=value+...; None = all
    batches: list[int] | None = None              # None = the workload's own (batch 1 and its throughput batch)
    repeats: int | None = None
    warmup: int | None = None
    steps: int | None = None                      # diffusion: override the workload's steps (quick looks only)
    seed: int = 0
    device: str | None = None
    out_dir: Path = Path("outputs/bench")
    max_minutes: float | None = None
    isolate: bool | str = False                   # False/'none', True/'all', or 'compiled' (compile / TensorRT cases)
    config_timeout_s: float | None = None
    profile: list[str] = field(default_factory=list)   # config names to profile, or ['all']
    weights: str | None = None
    strict: bool = False
    quiet: bool = False
    run_id: str | None = None                     # set for a child of an isolated run
    rates: dict | None = None                     # a child gets the parent's measured rates
    child: bool = False
    command: str = ""


@dataclass
class Reference:
    """The fp32 batch-1 image of a workload (drift reference) and the FLOPs of one image."""

    images: np.ndarray                            # uint8 [1, H, W, C]
    flops: dict[str, dict]                        # stage -> {'calls', 'flops', 'linear_flops'}
    params: dict[str, int]
    extra: dict = field(default_factory=dict)

    @property
    def flops_per_image(self) -> int:
        return int(sum(v["flops"] for v in self.flops.values()))

    @property
    def linear_flops_per_image(self) -> int | None:
        """The plain matrix-product part (what FP8 linear layers can take); None for an old reference file."""
        if not all("linear_flops" in v for v in self.flops.values()):
            return None
        return int(sum(v["linear_flops"] for v in self.flops.values()))


# ==========================================================================================================
# JSON lines
# ==========================================================================================================

def jsonable(x: Any) -> Any:
    """Plain JSON: non-finite floats as the strings 'inf' / '-inf' / 'nan', tuples as lists, the rest as text."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, (float, np.floating)):
        v = float(x)
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    return str(x)


class JsonlSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        line = json.dumps(jsonable(row), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:     # one open per row: a kill loses at most the row in flight
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_rows(path: Path) -> list[dict]:
    rows = []
    if not Path(path).is_file():
        return rows
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue     # a line cut short by a kill
    return rows


# ==========================================================================================================
# Environment
# ==========================================================================================================

def _package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(device), "diffusers": _package_version("diffusers"),
           "transformers": _package_version("transformers"), "torchao": _package_version("torchao"),
           "tensorrt": _package_version("tensorrt")}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_bytes=int(p.total_memory))
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return env


def default_numerics():
    """torch's own defaults (cuDNN convolutions may use TF32, matmuls may not): what a user who never
    touches these switches runs, so the baseline runs under them rather than under the reference's."""
    return tf32_switches(matmul=False, cudnn=True)


def reference_numerics():
    """fp32 means fp32 in this benchmark: TF32 off for matmuls and convolutions (torch turns it on for cuDNN
    convolutions by default). The tf32 configuration turns it back on through its own runtime context."""
    return tf32_switches(matmul=False, cudnn=False)


# Errors after which the CUDA context of this process is unusable: every later call fails the same way.
_STICKY_CUDA_ERRORS = ("illegal memory access", "unspecified launch failure", "device-side assert",
                       "misaligned address", "illegal instruction", "uncorrectable ecc", "cuda error: unknown error",
                       "an illegal address")


def sticky_cuda_error(text: str) -> bool:
    """True for an error text that means this process can no longer use its GPU (unlike an out-of-memory)."""
    low = text.lower()
    return any(k in low for k in _STICKY_CUDA_ERRORS)


def _cleanup(device: torch.device) -> str | None:
    """Free what the case left (compiled graphs, CUDA-graph pools, cached blocks) and reset the peak.
    Never raises; returns why the device is unusable when it is (a sticky CUDA error), else None."""
    with contextlib.suppress(Exception):
        torch._dynamo.reset()        # compiled graphs of the previous case
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()     # the private memory pools of CUDA-graph trees
    gc.collect()
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    except Exception as exc:         # noqa: BLE001 - the probe itself is what failed
        text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return text if sticky_cuda_error(text) or isinstance(exc, RuntimeError) else None
    return None


def _peak_fields(device: torch.device) -> dict:
    """Peak allocated bytes since the last reset and, on a GPU, peak reserved bytes. Under CUDA graphs the
    replays allocate nothing, so the allocated peak leaves out their activations; the graphs' private pool
    stays reserved, which is why the reserved peak is recorded too."""
    out = {"peak_vram_bytes": peak_memory_bytes(device)}
    if device.type == "cuda":
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return out


STYLEGAN_FP8 = ("optim.fp8 quantizes diffusion UNets only (StyleGAN's convolutions are modulated per sample and "
                "its dense layers are too small to gain)")


def unavailable_here(flags: OptimizationFlags, wl: Workload, device: torch.device) -> str | None:
    """Why a toggle the configuration asks for cannot run on this machine, known before any model is built
    (the same checks optim.prepare makes), or None. A case skipped here costs no model build, no child
    process and no device time; anything less certain is left to optim.prepare and check_applied."""
    from optim import compile as opt_compile
    from optim import fp8 as opt_fp8
    from optim import tensorrt as opt_tensorrt
    from optim.hardware import has_package

    reasons = []
    if flags.tensorrt:
        r = opt_tensorrt.unavailable_reason(device)
        if r:
            reasons.append(f"tensorrt: {r}")
    if flags.fp8:
        r = opt_fp8.unavailable_reason(device)
        if r:
            reasons.append(f"fp8: {r}")
        elif wl.kind == "stylegan":
            reasons.append(f"fp8: {STYLEGAN_FP8}")
    if flags.fuse_qkv and wl.kind == "stylegan":
        from optim.fused_qkv import STYLEGAN_REASON
        reasons.append(f"fuse_qkv: {STYLEGAN_REASON}")
    if flags.tiny_vae and wl.kind == "stylegan":
        from optim.tiny_vae import STYLEGAN_REASON as TINY_REASON
        reasons.append(f"tiny_vae: {TINY_REASON}")
    if flags.request_graph:
        from optim import request_graph as opt_rg
        r = opt_rg.STYLEGAN_REASON if wl.kind == "stylegan" else opt_rg.unavailable_reason(device)
        if r:
            reasons.append(f"request_graph: {r}")
    if flags.compile != "off":
        r = opt_compile.unavailable_reason(device)
        if r:
            reasons.append(f"compile: {r}")
    if (flags.prune_amount > 0 and flags.prune_method == "structured" and wl.kind == "diffusion"
            and not has_package("torch_pruning")):
        reasons.append("prune: structured UNet pruning needs torch-pruning (pip install torch-pruning)")
    return "; ".join(reasons) or None


def check_applied(flags: OptimizationFlags, report: dict) -> None:
    """Raise SkipCase when a toggle the configuration asks for did not run: timing a silent fallback would
    put the fallback's number under the toggle's name."""
    missing = {}
    for name in optim.requested_toggles(flags):
        r = report.get(name)
        if name == "precision" and flags.precision == "fp32":
            continue
        if not isinstance(r, dict):
            missing[name] = "not reported by optim.prepare"
        elif not r.get("applied"):
            missing[name] = r.get("reason") or "not applied"
    if missing:
        raise SkipCase("; ".join(f"{k}: {v}" for k, v in missing.items()))


# ==========================================================================================================
# Cases
# ==========================================================================================================

@dataclass
class CaseContext:
    opts: BenchOptions
    device: torch.device
    sink: JsonlSink
    run_id: str
    rates: dict
    drift_fn: DriftFn | None
    references: dict[str, Reference] = field(default_factory=dict)
    workloads_noted: set = field(default_factory=set)
    reference_errors: dict[str, str] = field(default_factory=dict)    # workload -> why it has no reference
    cuda_broken: str | None = None                # set when a case left this process's CUDA context unusable

    @property
    def ref_dir(self) -> Path:
        return self.opts.out_dir / "reference"


def _workload_steps(ctx: CaseContext, wl: Workload) -> int:
    return int(ctx.opts.steps or wl.steps)


def _ref_key(ctx: CaseContext, wl: Workload) -> str:
    w = Path(ctx.opts.weights).name if ctx.opts.weights else "random"
    return f"{wl.name}-s{ctx.opts.seed}-n{_workload_steps(ctx, wl)}-{w}"


def _load_reference(ctx: CaseContext, wl: Workload) -> Reference | None:
    key = _ref_key(ctx, wl)
    if key in ctx.references:
        return ctx.references[key]
    path = ctx.ref_dir / f"{key}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ref = Reference(z["images"], meta["flops"], meta["params"], meta.get("extra", {}))
        ctx.references[key] = ref
        return ref
    return None


def _store_reference(ctx: CaseContext, wl: Workload, ref: Reference) -> None:
    key = _ref_key(ctx, wl)
    ctx.references[key] = ref
    ctx.ref_dir.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(jsonable({"flops": ref.flops, "params": ref.params, "extra": ref.extra}))
    tmp = ctx.ref_dir / f"{key}.tmp.npz"
    np.savez(tmp, images=ref.images, meta=np.array(meta))
    tmp.replace(ctx.ref_dir / f"{key}.npz")


def _note_workload(ctx: CaseContext, wl: Workload, ref: Reference) -> None:
    """The workload row, once per process: settings, FLOPs per image, parameters, targets."""
    if wl.name in ctx.workloads_noted:
        return
    ctx.workloads_noted.add(wl.name)
    ctx.sink.write({"type": "workload", "run_id": ctx.run_id, **wl.to_dict(), "steps": _workload_steps(ctx, wl),
                    "seed": ctx.opts.seed, "weights": ctx.opts.weights or f"random (seed {ctx.opts.seed})",
                    "flops_per_image": ref.flops_per_image, "linear_flops_per_image": ref.linear_flops_per_image,
                    "flops_by_stage": ref.flops, "params": ref.params, **ref.extra})


def _is_reference_config(cfg: BenchConfig) -> bool:
    return cfg.flags is not None and replace(cfg.flags, strict=False) == REFERENCE_FLAGS


# -- StyleGAN -------------------------------------------------------------------------------------------------

def _z_bank(G, batch: int, seed: int, device: torch.device, k: int = 4) -> list[torch.Tensor]:
    """Input sets: the first from the seeds as the studio maps them (the drift image), the rest random."""
    from pipelines.stylegan import seed_to_z

    first = torch.from_numpy(np.concatenate([seed_to_z(seed + i, G.z_dim) for i in range(batch)])).to(device)
    g = torch.Generator("cpu").manual_seed(seed + 7919)
    return [first] + [torch.randn(batch, G.z_dim, generator=g).to(device) for _ in range(k - 1)]


def _stylegan_case(ctx: CaseContext, wl: Workload, cfg: BenchConfig, batch: int, row: dict,
                   capture_reference: bool, reference_only: bool = False) -> Reference | None:
    from pipelines.stylegan import StyleGANPipeline

    device, opts = ctx.device, ctx.opts
    t0 = time.perf_counter()
    loaded = build.stylegan_generator(wl, device, opts.seed, fp32_layers=cfg.fp32_layers, weights=opts.weights)
    G = loaded.G
    class_index = 0 if G.c_dim > 0 else None          # a conditional model (real weights) draws class 0
    if cfg.is_baseline:
        c = torch.zeros([batch, G.c_dim], device=device)
        if class_index is not None:
            c[:, class_index] = 1
        call = lambda z: G(z, c, truncation_psi=1.0, noise_mode="const")   # noqa: E731
        row["optimizations"] = {"baseline": {"applied": True, "reason": wl.baseline}}
        pipe = None
    else:
        pipe = StyleGANPipeline(loaded, cfg.flags, device)
        row["optimizations"] = pipe.optimizations
        check_applied(cfg.flags, pipe.optimizations)
        params = StyleGANParams(seeds=tuple(range(opts.seed, opts.seed + batch)), truncation_psi=1.0,
                                noise_mode="const", class_index=class_index, batch_size=batch)
        c = pipe._label(class_index, batch)
        call = lambda z: pipe._synthesize(z, c, params)                      # noqa: E731
    sync(device)
    row["prepare_s"] = time.perf_counter() - t0
    bank = _z_bank(G, batch, opts.seed, device)
    warmup = max(opts.warmup if opts.warmup is not None else wl.warmup, 3 if cfg.uses_compile else 1)
    repeats = opts.repeats or wl.repeats
    ref = None
    with torch.no_grad():
        first_ms, out = wall_ms(lambda: call(bank[0]), device)
        row["first_call_s"] = first_ms / 1e3
        if capture_reference:
            counted = count_flops_detailed(lambda: call(bank[0][:1]))
            ref = Reference(_uint8(out[:1]), {"synthesis": {"calls": 1, **counted}}, build.parameter_counts(G))
            if reference_only:
                return ref
        for i in range(1, warmup):
            call(bank[i % len(bank)])
        sync(device)
        reset_peak_memory(device)
        order = [bank[(repeats - 1 - i) % len(bank)] for i in range(repeats)]   # the last call sees bank[0]
        times, out = device_times_ms(call, order, device)
        row.update(_peak_fields(device))
        images = _uint8(out) if batch == 1 else None
        row.update(_timing_fields(times, batch))
        row["stages_ms"] = {"synthesis": row["call_ms"]}
        row["warmup_calls"], row["repeats"] = warmup, repeats
        row.update(_compile_fields(cfg, row))
        if pipe is not None:
            e2e, stages = [], []
            req = GenerationRequest("stylegan", None, params, cfg.flags, str(device))
            for _ in range(3):
                job = Job()
                ms, _ = wall_ms(lambda: pipe.generate(req, job), device)
                e2e.append(ms)
                stages.append(job.timings_ms)
            row["e2e_ms_per_image"] = median(e2e) / batch
            # where the studio's own call spends its time (seed -> latents -> synthesis -> pixels)
            row["e2e_stages_ms"] = {k: median([s.get(k, 0.0) for s in stages]) for k in stages[0]}
        if _wants_profile(opts, cfg):
            row["profile"] = _with_busy(profile_call(lambda: call(bank[0]), device), row["call_ms"])
    row["_images"] = images
    return ref


def _uint8(img: torch.Tensor) -> np.ndarray:
    """[N, C, H, W] in [-1, 1] -> uint8 [N, H, W, C], rounded as the studio writes PNGs."""
    return np.stack([np.asarray(im) for im in to_uint8_images(img.detach().float().cpu())])


# -- diffusion ------------------------------------------------------------------------------------------------

def _pil_stack(images) -> np.ndarray:
    return np.stack([np.asarray(im.convert("RGB")) for im in images])


def _diffusion_stages(pipe) -> dict[str, list]:
    """The modules whose first entry and last exit bound each stage (the same for both runners)."""
    from optim import tiny_vae

    tiny = tiny_vae.get(pipe)              # the tiny-autoencoder toggle decodes instead of the VAE
    return {"text_encoder": [pipe.text_encoder, getattr(pipe, "text_encoder_2", None)], "denoise": [pipe.unet],
            "vae_decode": [pipe.vae.post_quant_conv, pipe.vae.decoder] + ([tiny.decoder] if tiny is not None else [])}


class _ProductDiffusion:
    """The studio's DiffusionPipeline.generate, timed end to end with one synchronize before and after.

    The job gets no synchronizer: Job.stage would otherwise drain the device at every stage boundary (eight
    times a call), which the studio's own progress display does but which would hide host/device overlap
    from the end-to-end figure. Stage times come from CUDA events in forward hooks instead, exactly as for
    the stock pipeline, so the two rows are measured the same way."""

    def __init__(self, product, wl: Workload, flags: OptimizationFlags, batch: int, steps: int, device):
        self.product, self.wl, self.flags, self.batch, self.steps, self.device = product, wl, flags, batch, steps, device
        self.pipe = product.pipe
        self.clock = StageClock(self.modules(), device)

    def modules(self) -> dict[str, list]:
        return _diffusion_stages(self.pipe)

    def call(self, seed: int) -> tuple[float, dict, np.ndarray]:
        params = DiffusionParams(prompt=PROMPT, seed=seed, steps=self.steps, guidance=self.wl.guidance,
                                 width=self.wl.resolution, height=self.wl.resolution, batch_size=self.batch)
        req = GenerationRequest("diffusion", None, params, self.flags, str(self.device))
        self.clock.begin()
        ms, res = wall_ms(lambda: self.product.generate(req, Job()), self.device)
        return ms, {**self.clock.end(), "_calls": dict(self.clock.calls)}, _pil_stack(res.images)


class _StockDiffusion:
    """diffusers' own pipeline called the normal way; stages from forward hooks (no syncs added).

    Left as stock on purpose (it is what a user would run instead): its fp16 pipeline draws the seed's noise in
    fp16 on the CPU generator, where the studio draws float32 and casts (pipelines/diffusion_noise.py). On torch
    versions whose CPU half sampler gives another stream (2.11), its image is another picture than the fp32
    reference of the same seed, and its drift figures measure that rather than rounding."""

    def __init__(self, pipe, wl: Workload, batch: int, steps: int, device):
        self.pipe, self.wl, self.batch, self.steps, self.device = pipe, wl, batch, steps, device
        self.clock = StageClock(self.modules(), device)

    def modules(self) -> dict[str, list]:
        return _diffusion_stages(self.pipe)

    def call(self, seed: int) -> tuple[float, dict, np.ndarray]:
        gens = [torch.Generator("cpu").manual_seed(seed + i) for i in range(self.batch)]
        self.clock.begin()
        ms, out = wall_ms(lambda: self.pipe(prompt=PROMPT, num_inference_steps=self.steps,
                                            guidance_scale=self.wl.guidance, height=self.wl.resolution,
                                            width=self.wl.resolution, num_images_per_prompt=self.batch,
                                            generator=gens[0] if self.batch == 1 else gens, output_type="pil"),
                          self.device)
        return ms, {**self.clock.end(), "_calls": dict(self.clock.calls)}, _pil_stack(out.images)


def _diffusion_case(ctx: CaseContext, wl: Workload, cfg: BenchConfig, batch: int, row: dict,
                    capture_reference: bool, reference_only: bool = False) -> Reference | None:
    from pipelines.diffusion import DiffusionPipeline

    device, opts = ctx.device, ctx.opts
    steps = _workload_steps(ctx, wl)
    t0 = time.perf_counter()
    calib = None
    if cfg.is_baseline:
        pipe = build.stock_diffusion_pipeline(wl, device, opts.seed, opts.weights)
        runner: Any = _StockDiffusion(pipe, wl, batch, steps, device)
        row["optimizations"] = {"baseline": {"applied": True, "reason": wl.baseline}}
    else:
        # where a start's preparation goes: importing diffusers' pipeline code, loading the weights (from disk
        # with --weights), then the toggles (placing, casting, wrapping, FP8 calibration)
        from pipelines.diffusion import _pipeline_class

        _pipeline_class("sdxl" if wl.arch.startswith("sdxl") else "sd")
        t_import = time.perf_counter()
        loaded = build.loaded_diffusion(wl, device, opts.seed, opts.weights, cfg.flags)
        sync(device)
        t_load = time.perf_counter()
        calib = getattr(loaded.pipe, "_atelier_calibration", None)
        with build.quiet_diffusers():
            product = DiffusionPipeline(loaded, cfg.flags, device)
        sync(device)
        row["prepare_parts_s"] = {"import": round(t_import - t0, 3), "load": round(t_load - t_import, 3),
                                  "optimize": round(time.perf_counter() - t_load, 3)}
        row["prepare_toggles_s"] = dict(product.prepare_timings)     # "optimize", per toggle step
        row["optimizations"] = product.optimizations
        check_applied(cfg.flags, product.optimizations)
        runner = _ProductDiffusion(product, wl, cfg.flags, batch, steps, device)
    sync(device)
    row["prepare_s"] = time.perf_counter() - t0
    try:
        return _diffusion_measure(ctx, wl, cfg, batch, row, runner, steps, calib, capture_reference, reference_only)
    finally:
        runner.clock.remove()


def _diffusion_measure(ctx: CaseContext, wl: Workload, cfg: BenchConfig, batch: int, row: dict, runner, steps: int,
                       calib: dict | None, capture_reference: bool, reference_only: bool) -> Reference | None:
    device, opts = ctx.device, ctx.opts
    # A diffusion call runs the UNet once per step, so by the end of the first call a compiled UNet has compiled,
    # and (reduce-overhead) recorded and replayed its CUDA graph: one more call is a steady one.
    warmup = max(opts.warmup if opts.warmup is not None else wl.warmup, 2 if cfg.uses_compile else 1)
    repeats = opts.repeats or wl.repeats
    ref = None
    capture = CallCapture(runner.modules()) if capture_reference else None
    with torch.no_grad():
        first_ms, _, first_images = runner.call(opts.seed)
        row["first_call_s"] = first_ms / 1e3
        if capture is not None:
            flops = capture.flops()
            ref = Reference(first_images[:1], flops, build.parameter_counts(runner.pipe),
                            {"calibration": calib} if calib else {})
            if reference_only:
                return ref
        for i in range(1, warmup):
            ms, _, _ = runner.call(opts.seed + 1000 + i)
            if i == 1:      # what a second request pays (a request graph's capture, when the first call deferred it)
                row["second_call_s"] = ms / 1e3
        sync(device)
        reset_peak_memory(device)
        walls, stage_runs, images = [], [], None
        for i in range(repeats):
            seed = opts.seed if i == repeats - 1 else opts.seed + 1 + i     # the last call makes the drift image
            ms, stages, images = runner.call(seed)
            walls.append(ms)
            stage_runs.append(stages)
        row.update(_peak_fields(device))
    row.update(_timing_fields(walls, batch))
    names = sorted({k for s in stage_runs for k in s if not k.startswith("_")})
    row["stages_ms"] = {k: median([s[k] for s in stage_runs if k in s]) for k in names}
    denoise = row["stages_ms"].get("denoise")
    # it/s as diffusers' progress bar counts it: loop iterations, one UNet call each (classifier-free guidance
    # batches both halves into one call). PNDM runs steps + 1 of them (its first step is repeated).
    unet_calls = median([s["_calls"].get("denoise", 0) for s in stage_runs if "_calls" in s]) or steps
    row["denoise_calls"] = int(unet_calls)
    row["it_per_s"] = unet_calls / (denoise / 1e3) if denoise else None
    row["warmup_calls"], row["repeats"], row["steps"] = warmup, repeats, steps
    row.update(_compile_fields(cfg, row))
    if _wants_profile(opts, cfg):
        with torch.no_grad():
            row["profile"] = _with_busy(profile_call(lambda: runner.call(opts.seed), device), row["call_ms"])
    row["_images"] = images if batch == 1 else None
    return ref


# -- one case, any backend ------------------------------------------------------------------------------------

def _timing_fields(times_ms: list[float], batch: int) -> dict:
    call = median(times_ms)
    return {"call_ms": call, "call_ms_samples": [round(t, 4) for t in times_ms], "spread_pct": spread_pct(times_ms),
            "ms_per_image": call / batch if call else None,
            "images_per_s": 1e3 * batch / call if call else None}


def _with_busy(profile: dict, call_ms: float | None) -> dict:
    """Device time over the unprofiled median call: the profiler's own overhead stays out of the ratio."""
    if call_ms:
        profile["busy_fraction"] = profile["device_busy_ms"] / call_ms
    return profile


def _wants_profile(opts: BenchOptions, cfg: BenchConfig) -> bool:
    return "all" in opts.profile or cfg.name in opts.profile


def _compile_fields(cfg: BenchConfig, row: dict) -> dict:
    """Compilation time, apart from the timed calls: the first call minus a steady call (the first call of a
    compiled configuration traces, compiles and, with CUDA graphs, records)."""
    if not cfg.uses_compile or row.get("first_call_s") is None or not row.get("call_ms"):
        return {}
    return {"compile_s": max(0.0, row["first_call_s"] - row["call_ms"] / 1e3)}


def _floor_fields(ms_per_image: float | None, ref: Reference | None, rates: dict, uses_fp8: bool = False) -> dict:
    """The floor of a row: its workload's FLOPs per image at the measured bf16 matrix rate, and the row's
    fraction of it. An FP8 row also gets a mixed floor: the plain matrix products (what FP8 linear layers
    take over) at the faster measured FP8 rate, everything else (convolutions, attention) at the bf16 rate;
    counting every FLOP at the FP8 rate would set a floor no configuration can reach."""
    flops = ref.flops_per_image if ref else None
    out: dict[str, Any] = {"flops_per_image": flops}
    bf16 = rates.get("bf16_tflops")
    if not (flops and bf16):
        return out
    floor = flops / (bf16 * 1e12) * 1e3
    out["floor_ms_per_image"] = floor
    out["floor_fraction"] = floor / ms_per_image if ms_per_image else None
    fp8 = fp8_rate(rates)
    linear = ref.linear_flops_per_image if ref else None
    if uses_fp8 and fp8 and linear is not None:
        floor8 = (linear / (fp8 * 1e12) + (flops - linear) / (bf16 * 1e12)) * 1e3
        out["linear_flops_per_image"] = linear
        out["floor_fp8_ms_per_image"] = floor8
        out["floor_fraction_fp8"] = floor8 / ms_per_image if ms_per_image else None
    return out


def _build_reference(ctx: CaseContext, wl: Workload) -> Reference:
    """A dedicated fp32 batch-1 run when the fp32 configuration is not part of this run."""
    cfg = resolve_configs(wl, ["fp32"])[0]
    fn = _stylegan_case if wl.kind == "stylegan" else _diffusion_case
    try:
        ref = fn(ctx, wl, cfg, 1, {}, capture_reference=True, reference_only=True)
    except Exception as exc:
        raise RuntimeError(f"the fp32 reference run (needed for drift and FLOPs) failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        _cleanup(ctx.device)
    assert ref is not None
    return ref


def run_case(ctx: CaseContext, wl: Workload, cfg: BenchConfig, batch: int) -> dict:
    """Measure one configuration at one batch size; always returns (and writes) a result row."""
    base = {"run_id": ctx.run_id, "workload": wl.name, "config": cfg.name, "batch": batch,
            "description": cfg.description, "flags": cfg.flags.to_dict() if cfg.flags else None,
            "fp32_layers": cfg.fp32_layers}
    ctx.sink.write({"type": "start", **base, "time": time.time(), "pid": os.getpid()})
    row: dict[str, Any] = {"type": "result", **base, "status": "ok"}
    t0 = time.perf_counter()
    try:
        why = unavailable_here(cfg.flags, wl, ctx.device) if cfg.flags is not None else None
        if why and cfg.flags.strict:
            raise OptionalDependencyError(f"--strict: requested optimizations could not run here ({why})")
        if why:
            raise SkipCase(f"{why} (known before the model was built)")
        ref = _load_reference(ctx, wl)
        capture = ref is None and batch == 1 and _is_reference_config(cfg)
        if ref is None and not capture and wl.name not in ctx.reference_errors:
            try:
                ref = _build_reference(ctx, wl)
                _store_reference(ctx, wl, ref)
            except Exception as exc:      # the case still runs: it only loses its drift and floor numbers
                ctx.reference_errors[wl.name] = str(exc)[:500]
        if wl.name in ctx.reference_errors and ref is None:
            row["reference_error"] = ctx.reference_errors[wl.name]
        if ref is not None:
            _note_workload(ctx, wl, ref)
        fn = _stylegan_case if wl.kind == "stylegan" else _diffusion_case
        with default_numerics() if cfg.is_baseline else contextlib.nullcontext():
            new_ref = fn(ctx, wl, cfg, batch, row, capture_reference=capture)
        if new_ref is not None:
            _store_reference(ctx, wl, new_ref)
            _note_workload(ctx, wl, new_ref)
            ref = new_ref
        images = row.pop("_images", None)
        if images is not None and ref is not None and ctx.drift_fn is not None:
            row["drift"] = {"reference": "fp32", **ctx.drift_fn(ref.images, images)}
        row.update(_floor_fields(row.get("ms_per_image"), ref, ctx.rates, cfg.uses_fp8))
    except SkipCase as exc:
        row.update(status="skipped", reason=str(exc))
    except torch.cuda.OutOfMemoryError as exc:
        row.update(status="failed", reason=f"out of GPU memory: {str(exc).splitlines()[0][:300]}")
    except AtelierError as exc:
        row.update(status="failed", reason=str(exc))
    except Exception as exc:       # one configuration's crash must not stop the others
        row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}",
                   traceback=traceback.format_exc()[-4000:])
    finally:
        row.pop("_images", None)
        row["case_s"] = time.perf_counter() - t0
        broken = _cleanup(ctx.device)
        if broken:
            ctx.cuda_broken = f"{wl.name} b{batch} {cfg.name} left the GPU unusable in this process ({broken})"
            row["cuda_broken"] = ctx.cuda_broken
    ctx.sink.write(row)
    return row


# ==========================================================================================================
# The run
# ==========================================================================================================

def plan(opts: BenchOptions) -> list[tuple[Workload, BenchConfig, int]]:
    """(workload, configuration, batch) in the order they run: workload by workload, batch 1 first (the
    numbers that matter most survive a cut-short run), and at batch 1 the fp32 reference first."""
    if not opts.workloads:
        raise InputError("name at least one workload (--workload); `bench list` shows them")
    cases = []
    for spec in opts.workloads:
        name, own_batches = parse_workload_spec(spec)
        wl = get_workload(name)
        configs = resolve_configs(wl, opts.configs, strict=opts.strict)
        batches = sorted(set(own_batches or opts.batches or wl.batches))
        if any(b < 1 for b in batches):
            raise InputError(f"batch sizes must be ≥ 1; got {batches}")
        for b in batches:
            ordered = sorted(configs, key=lambda c: 0 if (b == 1 and _is_reference_config(c)) else 1)
            cases += [(wl, c, b) for c in ordered]
    keys = [(w.name, c.name, b) for w, c, b in cases]
    if len(set(keys)) != len(keys):
        raise InputError("a workload is named twice in --workload; give it once (NAME@B1+B2 for several batches)")
    if opts.weights and len({w.name for w, _, _ in cases}) > 1:
        raise InputError("--weights belongs to one workload: run one --workload at a time with real weights")
    return cases


def parse_workload_spec(spec: str) -> tuple[str, list[int] | None]:
    """'sg2-1024' -> ('sg2-1024', None); 'sg2-1024@1+32' -> ('sg2-1024', [1, 32]): a workload with its own
    batch sizes, so one command can hold batch 32 of one workload and batch 1 of another."""
    name, at, body = spec.strip().partition("@")
    if not at:
        return name, None
    try:
        batches = [int(b) for b in body.split("+") if b.strip()]
    except ValueError:
        raise InputError(f"a workload with its own batches is NAME@B1+B2 (e.g. sg2-1024@1+32); got {spec!r}") from None
    if not batches:
        raise InputError(f"no batch sizes after '@' in {spec!r}; e.g. sg2-1024@32")
    return name, batches


def _bar(done: int, total: int, width: int = 20) -> str:
    k = int(width * done / max(total, 1))
    return "[" + "#" * k + "." * (width - k) + f"] {done}/{total}"


def _summary_line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('reason', '')}"[:300]
    parts = [f"{row['ms_per_image']:.3f} ms/img" if row.get("ms_per_image") is not None else "?"]
    if row.get("it_per_s"):
        parts.append(f"{row['it_per_s']:.1f} it/s")
    if row.get("batch", 1) > 1 and row.get("images_per_s"):
        parts.append(f"{row['images_per_s']:.1f} img/s")
    if row.get("peak_vram_bytes"):
        parts.append(f"peak {row['peak_vram_bytes'] / 2**30:.2f} GiB")
    d = row.get("drift") or {}
    if d.get("psnr_db") is not None:
        p = d["psnr_db"]
        parts.append(f"PSNR {p if isinstance(p, str) else f'{p:.1f}'} dB")
    if row.get("first_call_s") is not None:
        parts.append(f"first call {row['first_call_s']:.1f} s")
    return "ok " + ", ".join(parts)


def _child_argv(opts: BenchOptions, run_id: str, rates: dict, wl: Workload, cfg_spec: str, batch: int) -> list[str]:
    argv = [sys.executable, str(ROOT / "app.py"), "bench", "run", "--child", "--run-id", run_id,
            "--rates", json.dumps(jsonable(rates)), "--workload", wl.name, "--configs", cfg_spec,
            "--batches", str(batch), "--out", str(opts.out_dir), "--seed", str(opts.seed), "--quiet"]
    for flag, val in (("--repeats", opts.repeats), ("--warmup", opts.warmup), ("--steps", opts.steps),
                      ("--device", opts.device), ("--weights", opts.weights)):
        if val is not None:
            argv += [flag, str(val)]
    argv += ["--profile", ",".join(opts.profile) or "none"]
    if opts.strict:
        argv.append("--strict")
    return argv


def _run_child(opts: BenchOptions, ctx: CaseContext, wl: Workload, cfg: BenchConfig, cfg_spec: str, batch: int,
               timeout: float | None) -> dict:
    argv = _child_argv(opts, ctx.run_id, ctx.rates, wl, cfg_spec, batch)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)        # the child and anything it started (compile workers)
        _, err = proc.communicate()
        timed_out = True
    key = (ctx.run_id, wl.name, cfg.name, batch)
    results = [r for r in read_rows(ctx.sink.path) if r.get("type") == "result"
               and (r.get("run_id"), r.get("workload"), r.get("config"), r.get("batch")) == key]
    if results and not timed_out:
        return results[-1]
    reason = (f"timed out after {time.perf_counter() - t0:.0f} s and was killed" if timed_out
              else f"the child process exited with code {proc.returncode} without a result")
    tail = (err or "").strip().splitlines()[-5:]
    row = {"type": "result", "run_id": ctx.run_id, "workload": wl.name, "config": cfg.name, "batch": batch,
           "description": cfg.description, "flags": cfg.flags.to_dict() if cfg.flags else None, "status": "failed",
           "reason": reason + (f" ({' | '.join(tail)[:600]})" if tail else ""), "case_s": time.perf_counter() - t0}
    ctx.sink.write(row)
    return row


def isolation_mode(value: bool | str | None) -> str:
    """'none', 'all' or 'compiled' from BenchOptions.isolate (True means 'all')."""
    if value is True:
        return "all"
    if value in (False, None, "", "none"):
        return "none"
    if value in ("all", "compiled"):
        return str(value)
    raise InputError(f"--isolate takes 'all' (the default when given alone), 'compiled' or 'none'; got {value!r}")


def _in_child(mode: str, cfg: BenchConfig, ctx: CaseContext | None = None) -> bool:
    """Whether a case runs in its own process: all of them, only those that compile or build an engine (the
    ones that can take minutes and leave compiled state behind), or every case once this process's CUDA
    context broke."""
    if ctx is not None and ctx.cuda_broken:
        return True
    if mode == "all":
        return True
    return mode == "compiled" and cfg.flags is not None and (cfg.uses_compile or cfg.flags.tensorrt)


def _needs_reference(cases: list, i: int) -> bool:
    """Whether case i pays for a dedicated fp32 reference run: it is the first case of its workload and the
    plan's fp32 batch-1 case (which captures the reference itself) does not come first."""
    wl, cfg, batch = cases[i]
    if any(w.name == wl.name for w, _, _ in cases[:i]):
        return False
    return not (batch == 1 and _is_reference_config(cfg))


def estimate_plan(opts: BenchOptions) -> dict:
    """The plan with each case's estimated seconds on the H200 (see bench.estimate); touches no
    device. Cases with the same flags as an earlier one cost nothing (their result is copied)."""
    cases = plan(opts)
    mode = isolation_mode(opts.isolate)
    seen: set = set()
    rows, total = [], 0.0
    kinds = {wl.kind for wl, _, _ in cases}
    overhead = command_overhead_s(kinds)
    for i, (wl, cfg, batch) in enumerate(cases):
        key = _same_key(wl, cfg, batch)
        if key in seen:
            rows.append({"workload": wl.name, "config": cfg.name, "batch": batch, "seconds": 0.0, "isolated": False,
                         "note": "same flags as an earlier case: result copied", "parts": {}})
            continue
        seen.add(key)
        est = estimate_case(wl, cfg, batch, warmup=opts.warmup, repeats=opts.repeats, steps=opts.steps,
                            isolated=_in_child(mode, cfg), needs_reference=_needs_reference(cases, i),
                            profiled=_wants_profile(opts, cfg))
        rows.append(est.to_dict())
        total += est.seconds
    total += overhead
    out = {"cases": rows, "overhead_s": round(overhead, 1), "total_s": round(total, 1),
           "total_min": round(total / 60, 2), "isolate": mode, "max_minutes": opts.max_minutes,
           "config_timeout_s": opts.config_timeout_s}
    notes = []
    if opts.max_minutes is not None and total > opts.max_minutes * 60:
        notes.append(f"the estimate ({total / 60:.1f} min) is over --max-minutes {opts.max_minutes:g}: the last "
                     f"cases would be skipped (or killed, if isolated)")
    if opts.config_timeout_s is not None:
        slow = [r for r in rows if r["seconds"] > opts.config_timeout_s]
        if slow:
            notes.append("estimated over --config-timeout: " + ", ".join(f"{r['workload']} b{r['batch']} {r['config']} "
                                                                           f"({r['seconds']:.0f} s)" for r in slow))
    out["notes"] = notes
    return out


def format_estimate(est: dict) -> str:
    lines = [f"{'workload':<13} {'batch':>5}  {'config':<12} {'est. s':>7}  {'child':<5}  note / parts"]
    for r in est["cases"]:
        parts = ", ".join(f"{k} {v:g}" for k, v in r["parts"].items())
        lines.append(f"{r['workload']:<13} {r['batch']:>5}  {r['config']:<12} {r['seconds']:>7.1f}  "
                     f"{'yes' if r['isolated'] else '':<5}  {r['note'] or parts}")
    lines.append(f"command start + matrix rates: {est['overhead_s']:.0f} s")
    lines.append(f"estimated total on the H200: {est['total_s']:.0f} s = {est['total_min']:.1f} min "
                 f"(isolate: {est['isolate']})")
    lines += [f"note: {n}" for n in est["notes"]]
    return "\n".join(lines)


def run(opts: BenchOptions, drift_fn: DriftFn | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Run the benchmark; returns the JSON-lines file the rows were appended to."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    say = (lambda s: None) if opts.quiet else log
    # diffusers and transformers warn on every cast of a freshly built model; on the GPU machine only the last
    # 12,000 characters of a command's output come back, and those lines would push the progress out of them.
    # Read at their import, so set before it (children inherit them); a user's own setting wins.
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = pick_device(opts.device)
    cases = plan(opts)
    mode = isolation_mode(opts.isolate)
    specs = _config_specs(opts)
    sink = JsonlSink(Path(opts.out_dir) / JSONL_NAME)
    run_id = opts.run_id or f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + opts.max_minutes * 60 if opts.max_minutes is not None else None
    with reference_numerics():
        rates = opts.rates
        if rates is None:
            say("measuring the bf16 and FP8 matrix rates …")
            rates = matrix_rates(device)
        if not opts.child:
            sink.write({"type": "run", "run_id": run_id, **environment(device), "command": opts.command,
                        "rates": rates, "isolate": mode, "tf32": "off unless the configuration asks for it "
                        "(the baseline runs under torch's defaults: TF32 for cuDNN convolutions only)",
                        "cases_planned": len(cases)})
            fp8 = rates.get("fp8_tflops")
            say(f"run {run_id} on {device}: bf16 {rates['bf16_tflops']:.4g} TFLOP/s, "
                f"FP8 {f'{fp8:.4g} TFLOP/s' if fp8 else 'n/a (' + rates.get('fp8_error', '?') + ')'}; "
                f"{len(cases)} cases → {sink.path}")
        ctx = CaseContext(opts, device, sink, run_id, rates, drift_fn)
        done: dict[tuple, dict] = {}
        for i, (wl, cfg, batch) in enumerate(cases):
            label = f"{wl.name} b{batch} {cfg.name}"
            same = done.get(_same_key(wl, cfg, batch))
            if same is not None:
                # 'best' is often one of the named rows; measuring it twice would cost a second compile for nothing.
                row = {**same, "config": cfg.name, "description": cfg.description, "same_as": same["config"]}
                sink.write(row)
                say(f"{_bar(i + 1, len(cases))} {label}: same flags as {same['config']}, result copied")
                continue
            child = _in_child(mode, cfg, ctx) and not opts.child
            remaining = deadline - time.monotonic() if deadline is not None else None
            why_not = None
            if remaining is not None and remaining <= 0:
                why_not = f"time budget (--max-minutes {opts.max_minutes:g}) spent before this case started"
            elif remaining is not None and device.type == "cuda" and not opts.child:
                est = estimate_case(wl, cfg, batch, warmup=opts.warmup, repeats=opts.repeats, steps=opts.steps,
                                    isolated=child, needs_reference=_needs_reference(cases, i),
                                    profiled=_wants_profile(opts, cfg))
                if 0.75 * est.seconds > remaining:      # even a quarter faster than estimated it would not finish
                    why_not = (f"would not finish in the {remaining:.0f} s left of --max-minutes {opts.max_minutes:g} "
                               f"(estimated {est.seconds:.0f} s on an H200)")
            if why_not:
                row = {"type": "result", "run_id": run_id, "workload": wl.name, "config": cfg.name, "batch": batch,
                       "description": cfg.description, "flags": cfg.flags.to_dict() if cfg.flags else None,
                       "status": "skipped", "reason": f"{why_not}; run it in another command"}
                sink.write(row)
                say(f"{_bar(i + 1, len(cases))} {label}: skipped ({why_not})")
                continue
            say(f"{_bar(i, len(cases))} {label}{' (own process)' if child else ''} …")
            if child:
                timeout = min(t for t in (opts.config_timeout_s, remaining) if t is not None) \
                    if (opts.config_timeout_s is not None or remaining is not None) else None
                row = _run_child(opts, ctx, wl, cfg, specs.get(cfg.name, cfg.name), batch, timeout)
            else:
                row = run_case(ctx, wl, cfg, batch)
            say(f"{_bar(i + 1, len(cases))} {label}: {_summary_line(row)}")
            if row.get("cuda_broken") and not opts.child:
                say(f"the GPU is unusable in this process ({row['cuda_broken']}); the remaining cases run in their "
                    f"own processes")
            if row.get("status") in ("ok", "skipped"):
                done[_same_key(wl, cfg, batch)] = row
    return sink.path


def _same_key(wl: Workload, cfg: BenchConfig, batch: int) -> tuple:
    return same_flags_key(wl, cfg, batch)


def _config_specs(opts: BenchOptions) -> dict[str, str]:
    """configuration name -> the text that names it again in a child process (custom ones carry their flags)."""
    return {spec.split("@", 1)[0].strip(): spec.strip() for spec in opts.configs or []}


def shell_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
