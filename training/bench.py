"""Trainer throughput: the plain fp32 eager loop against the fast path, same network, same process.

Each configuration builds fresh networks from the same seed, runs a warm-up, then
trains for `seconds` of wall clock and reports real images per second (images shown
to D, the figure NVlabs reports as sec/kimg) and peak GPU memory. The ladder adds one
change at a time so each one's share is visible:

  plain-fp32    fp32 with TF32 off, NCHW, batches gathered on the host and copied with a
                blocking transfer, losses read back every step (what a first training loop does)
  gpu-data      + uint8 dataset resident on the GPU, GPU-side augmentation, no per-step host sync
  tf32          + TF32 matmuls/convolutions (still fp32 storage)
  bf16          bf16 autocast instead of TF32
  channels-last + channels_last memory format
  fast-ops      + the training op formulations (`kernels=auto`: convs differentiated by gradfix,
                up/down convs folded with their FIR into dense convs, separable FIR blurs); the
                default configuration
  fast-ops-nc1  the same with the FIR blurs as 1-channel convs on an [N*C, 1, H, W] view
  batch-x2/x4   fast-ops at 2x / 4x the batch (same learning rate)
  compile       + torch.compile of the main forward passes, with G's no-grad pass and the augmentation
                inside the compiled graphs (compile scope "full"; only with with_compile)
  compile-nets  compile of the network passes only (scope "nets": the trainer before 2026-12-06)
  compile-x2    compile at 2x the batch (only with with_compile)

The training algorithm (losses, lazy R1/PL intervals, ADA, EMA) is identical in all
of them. Under torchrun the figures are global (all ranks), so running the same bench
on 1 and 2 GPUs gives the scaling efficiency.
"""
from __future__ import annotations

import copy
import gc
import time
from pathlib import Path
from typing import Any, Callable

import torch

from training.config import TrainConfig
from training.dataset import load_images

REF = "reference"
LADDER = {
    "plain-fp32": dict(precision="fp32", tf32=False, channels_last=False, data_device="host-plain", kernels=REF,
                       _sync=True),
    "gpu-data": dict(precision="fp32", tf32=False, channels_last=False, data_device="auto", kernels=REF),
    "tf32": dict(precision="fp32", tf32=True, channels_last=False, data_device="auto", kernels=REF),
    "bf16": dict(precision="bf16", channels_last=False, data_device="auto", kernels=REF),
    "channels-last": dict(precision="bf16", channels_last=True, data_device="auto", kernels=REF),
    "fast-ops": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto"),
    "fast-ops-nc1": dict(precision="bf16", channels_last=True, data_device="auto",
                         kernels="grad:gradfix/up:subpixel-fused/down:fused-s2d/fir:nc1"),
    "batch-x2": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto", _batch_mult=2),
    "batch-x4": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto", _batch_mult=4),
    "compile": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto", compile=True),
    "compile-nets": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto", compile=True,
                         compile_scope="nets"),
    "compile-x2": dict(precision="bf16", channels_last=True, data_device="auto", kernels="auto", compile=True,
                       _batch_mult=2),
}
OPTIONAL = ("compile", "compile-nets", "compile-x2")    # only with with_compile (its first compilation takes minutes)


def _measure(cfg: TrainConfig, data, seconds: float, warmup_seconds: float, sync: bool, log) -> dict[str, Any]:
    from training.trainer import Trainer

    tr = Trainer(cfg, data=data, write_outputs=False, log=log)
    tr.sync_every_step = sync
    dev = tr.device
    is_cuda = dev.type == "cuda"

    def wait():
        if is_cuda:
            torch.cuda.synchronize(dev)

    from training import distributed as dist_utils

    def run_for(target_seconds: float, min_iterations: int) -> int:
        """Iterate in chunks of 10 until `target_seconds`; rank 0 decides so all ranks stop together."""
        t = time.time()
        its = 0
        while True:
            for _ in range(10):
                tr.iteration()
            its += 10
            wait()
            done = its >= min_iterations and time.time() - t >= target_seconds
            if dist_utils.broadcast_object(done, tr.dist):
                return its

    t0 = time.time()
    warm_its = run_for(warmup_seconds, 10)
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    n0, it0 = tr.cur_nimg, tr.step
    t1 = time.time()
    run_for(seconds, 10)
    dt = time.time() - t1
    out = {"img_s": round((tr.cur_nimg - n0) / dt, 1), "iterations": tr.step - it0, "seconds": round(dt, 2),
           "warmup_seconds": round(t1 - t0, 2), "warmup_iterations": warm_its,
           "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if is_cuda else 0.0,
           "loss_G_finite": bool(torch.isfinite(tr.stats[0]).item())}
    del tr
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()
    return out


def run_bench(cfg: TrainConfig, seconds: float = 30.0, with_compile: bool = False,
              configs: list[str] | None = None, warmup_seconds: float = 8.0, log=print,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """{config name: figures} plus speedups over plain-fp32; networks and data as in `cfg`.

    `on_result(report so far)` is called after each configuration (e.g. to write the file, so a
    run stopped by a time limit keeps what it measured)."""
    from training import distributed as dist_utils
    from training.trainer import resolve_data_path

    names = configs or [n for n in LADDER if n not in OPTIONAL or with_compile]
    unknown = [n for n in names if n not in LADDER]
    if unknown:
        from core.errors import InputError

        raise InputError(f"unknown bench configuration(s) {', '.join(unknown)}; known: {', '.join(LADDER)}")
    info = dist_utils.setup(cfg.device)
    images, dinfo = load_images(resolve_data_path(cfg.data), cfg.resolution,
                                cache_dir=Path(".cache") / "atelier" / "datasets")
    results: dict[str, Any] = {}
    quiet = (lambda s: None) if not info.is_main else (lambda s: log(s) if s.startswith("[bench]") else None)
    for name in names:
        over = dict(LADDER[name])
        sync = over.pop("_sync", False)
        mult = over.pop("_batch_mult", 1)
        c = copy.deepcopy(cfg)
        if mult != 1:
            c.batch = (cfg.batch or 0) * mult
        for k, v in over.items():
            setattr(c, k, v)
        c.progress = False
        c.monitor_kimg = 0.0
        c.minutes = None
        c.kimg = 1e9
        try:
            r = _measure(c, (images, dinfo), seconds, warmup_seconds, sync, quiet)
        except Exception as exc:    # one failing configuration (e.g. a compile error) must not lose the rest
            if info.enabled:
                raise
            r = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "img_s": 0.0, "peak_mem_gib": 0.0,
                 "warmup_seconds": 0.0}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        r["batch"] = c.batch
        r["kernels"] = c.kernels
        results[name] = r
        if on_result is not None and info.is_main:
            on_result(_report(results, info, cfg, seconds))
        if info.is_main and "error" in r:
            log(f"[bench] {name:14s} failed: {r['error']}")
        elif info.is_main:
            log(f"[bench] {name:14s} {r['img_s']:10,.0f} img/s  batch {c.batch}  peak {r['peak_mem_gib']:.2f} GiB  "
                f"(warm-up {r['warmup_seconds']:.0f} s)")
    report = _report(results, info, cfg, seconds)
    if info.enabled:
        dist_utils.cleanup()
    return report


def _report(results: dict[str, Any], info, cfg: TrainConfig, seconds: float) -> dict[str, Any]:
    base = results.get("plain-fp32", {}).get("img_s")
    if base:
        for r in results.values():
            if "error" in r:
                continue
            r["speedup_vs_plain_fp32"] = round(r["img_s"] / base, 2)
    dev = info.device
    return {"configs": results, "world_size": info.world_size, "batch": cfg.batch or "preset",
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "seconds_each": seconds}
