"""Measuring tools for the benchmark: device timers, the two matrix rates, FLOP counts,
per-stage clocks for a plain diffusers pipeline, and a kernel profile of one call.

Timing follows the workplace method: device events around the region (or a host clock
after a synchronize when the region includes host work), warm-up first, the median of
many calls, inputs rotated among several random sets.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Host-clock milliseconds of `fn` with the device drained before and after (for regions with host work)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def device_times_ms(fn: Callable[[Any], Any], inputs: list, device: torch.device) -> tuple[list[float], Any]:
    """Milliseconds of each `fn(x)` for x in `inputs`, timed with CUDA events without a sync between calls
    (host clock per call on the CPU). Returns (times, last output)."""
    out = None
    if device.type != "cuda":
        times = []
        for x in inputs:
            t0 = time.perf_counter()
            out = fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
        return times, out
    events = []
    for x in inputs:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn(x)
        b.record()
        events.append((a, b))
    torch.cuda.synchronize(device)
    return [a.elapsed_time(b) for a, b in events], out


def median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def spread_pct(values: list[float]) -> float | None:
    """(max - min) / median in percent: a difference between configurations smaller than this is noise."""
    if len(values) < 2:
        return None
    m = statistics.median(values)
    return float((max(values) - min(values)) / m * 100) if m > 0 else None


# -- the two ceilings -----------------------------------------------------------------------------------

def matrix_rates(device: torch.device, size: int | None = None, repeats: int = 20, warmup: int = 5) -> dict:
    """Measured bf16 matrix-product rate and FP8 (`torch._scaled_mm`, e4m3, per-tensor scales, bf16 out) rate
    in TFLOP/s, on `size`³ products (8192 on a GPU, 512 on a CPU, where the numbers only feed the same
    arithmetic). Three input pairs are rotated so no product runs out of a warm cache.

    FP8 is measured twice: with the default fp32 accumulation (`fp8_tflops`, the figure shared/GPU.md
    quotes) and with `use_fast_accum=True` (`fp8_fast_accum_tflops`, what torchao's inference FP8 layers
    ask for); the FP8 floor uses the faster of the two. `_scaled_mm`'s conventions (torch 2.5 to 2.13):
    scale_a / scale_b are float32 tensors with one element (per-tensor scaling), the second operand is
    column-major (the transpose of a row-major matrix), both dimensions multiples of 16, out_dtype names
    the result's dtype."""
    n = int(size or (8192 if device.type == "cuda" else 512))
    flops = 2.0 * n ** 3
    g = torch.Generator(device).manual_seed(1234)     # drawn where they are used: 8192² on a CPU takes seconds
    out: dict[str, Any] = {"size": n, "device": str(device)}

    def rate(fn, pairs, flops=flops) -> float:
        seq = [pairs[i % len(pairs)] for i in range(warmup)]
        device_times_ms(fn, seq, device)
        times, _ = device_times_ms(fn, [pairs[i % len(pairs)] for i in range(repeats)], device)
        return flops / (statistics.median(times) * 1e-3) / 1e12

    pairs = [(torch.randn(n, n, generator=g, device=device).to(torch.bfloat16),
              torch.randn(n, n, generator=g, device=device).to(torch.bfloat16)) for _ in range(3)]
    out["bf16_tflops"] = rate(lambda ab: torch.mm(ab[0], ab[1]), pairs)
    del pairs
    try:
        f8 = torch.float8_e4m3fn
        scale = torch.ones((), dtype=torch.float32, device=device)
        # The second operand column-major: the transpose of a row-major matrix (a strided view, no copy).
        # A CPU emulates FP8 products element by element: a 512³ one took ~2.5 s on the 2-core CI machine,
        # so 50 of them added 2 minutes to every CPU bench run. 128³ feeds the same arithmetic.
        n8 = n if device.type == "cuda" else min(n, 128)
        out["fp8_size"] = n8
        pairs8 = [((torch.randn(n8, n8, generator=g, device=device) * 0.5).to(f8),
                   (torch.randn(n8, n8, generator=g, device=device) * 0.5).to(f8).t()) for _ in range(3)]
        assert pairs8[0][1].stride() == (1, n8), "the FP8 product's second operand must be column-major"
        for key, fast in (("fp8_tflops", False), ("fp8_fast_accum_tflops", True)):
            out[key] = rate(lambda ab: torch._scaled_mm(ab[0], ab[1], scale_a=scale, scale_b=scale,
                                                        out_dtype=torch.bfloat16, use_fast_accum=fast), pairs8,
                            flops=2.0 * n8 ** 3)
        del pairs8
    except (RuntimeError, AttributeError, TypeError, NotImplementedError) as exc:
        out.setdefault("fp8_tflops", None)
        out.setdefault("fp8_fast_accum_tflops", None)
        out["fp8_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def fp8_rate(rates: dict) -> float | None:
    """The FP8 ceiling of a run: the faster of the two accumulation modes that were measured."""
    vals = [v for v in (rates.get("fp8_tflops"), rates.get("fp8_fast_accum_tflops")) if isinstance(v, (int, float))]
    return max(vals) if vals else None


# -- FLOPs ----------------------------------------------------------------------------------------------

# Products that FP8 linear layers (torchao) take over: nn.Linear lowers to these. Attention (SDPA, bmm) and
# convolutions stay in bf16, so an FP8 configuration's floor mixes the two rates.
LINEAR_OPS = ("aten.mm", "aten.addmm")


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call as torch's flop counter sees them (matmuls, convolutions, attention)."""
    return count_flops_detailed(fn)["flops"]


def count_flops_detailed(fn: Callable[[], Any]) -> dict[str, int]:
    """{'flops': all, 'linear_flops': the part in plain matrix products (what FP8 linear layers can take),
    'conv_flops': convolutions, 'attention_flops': the fused attention kernels}. `bench.gap` sets each kernel
    class's time against its own FLOPs with these.

    torch's counter knows the CUDA attention kernels (flash, memory-efficient, cuDNN) but not the CPU
    flash kernel, so on a CPU attention is left out; the GPU runs count it."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    by_op = {str(op): int(v) for op, v in counter.get_flop_counts().get("Global", {}).items()}
    return {"flops": int(counter.get_total_flops()),
            "linear_flops": sum(v for op, v in by_op.items() if op in LINEAR_OPS),
            "conv_flops": sum(v for op, v in by_op.items() if "convolution" in op),
            "attention_flops": sum(v for op, v in by_op.items() if "attention" in op)}


FLOP_PARTS = ("linear_flops", "conv_flops", "attention_flops")


def _detached_clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class CallCapture:
    """Counts the calls of some modules during one real run and keeps each one's first inputs, so the
    FLOPs of the run can be counted afterwards by replaying one call per module under the flop counter
    (exact for the pipeline as it ran: CFG batch, the scheduler's real number of UNet calls)."""

    def __init__(self, modules: dict[str, list[torch.nn.Module]]):
        self.modules = {k: [m for m in v if m is not None] for k, v in modules.items()}
        self.calls: dict[str, int] = {}
        self.first: dict[str, tuple] = {}
        self._handles = []
        for stage, mods in self.modules.items():
            for i, m in enumerate(mods):
                key = f"{stage}.{i}"
                self.calls[key] = 0
                self._handles.append(m.register_forward_pre_hook(self._hook(key), with_kwargs=True))

    def _hook(self, key: str):
        def pre(module, args, kwargs):
            self.calls[key] += 1
            if key not in self.first:
                self.first[key] = (module, tree_map(_detached_clone, args), tree_map(_detached_clone, kwargs))
        return pre

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def flops(self) -> dict[str, dict]:
        """stage -> {'calls': n, 'flops': total for the run, and its parts (FLOP_PARTS: plain matrix products,
        convolutions, attention)}; modules replayed once each."""
        self.remove()
        out: dict[str, dict] = {}
        for key, n in self.calls.items():
            stage = key.rsplit(".", 1)[0]
            entry = out.setdefault(stage, {"calls": 0, "flops": 0, **dict.fromkeys(FLOP_PARTS, 0)})
            if n == 0:
                continue
            module, args, kwargs = self.first[key]
            per_call = count_flops_detailed(lambda: module(*args, **kwargs))
            entry["calls"] = max(entry["calls"], n)
            entry["flops"] += per_call["flops"] * n
            for part in FLOP_PARTS:
                entry[part] += per_call[part] * n
        self.first.clear()
        return out


# -- stage clock for a stock diffusers pipeline -------------------------------------------------------------

class StageClock:
    """Per-stage time of one pipeline call, from forward hooks: a stage runs from the first entry into
    any of its modules to the last exit. On a GPU each mark is a CUDA event recorded on the current
    stream, with no synchronize: the end-to-end time of the same call is not changed by the clock (the
    events are read after the call's own final synchronize). The hooks sit on the objects the pipeline
    calls (a torch.compile wrapper included), so they run outside compiled code and CUDA graphs.
    While a stream is recording a CUDA graph (the studio's request graph, pipelines/request_graph.py) the
    hooks mark nothing: a timing event cannot be recorded into a graph, and a replay runs no hooks, so such a
    request has no per-stage times, only its end-to-end time."""

    def __init__(self, stages: dict[str, list[torch.nn.Module]], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._start: dict[str, Any] = {}
        self._end: dict[str, Any] = {}
        self.calls: dict[str, int] = {}        # exits per stage in the last call (UNet calls = loop iterations)
        self._handles = []
        for name, mods in stages.items():
            for m in mods:
                if m is None:
                    continue
                self._handles.append(m.register_forward_pre_hook(self._pre(name)))
                self._handles.append(m.register_forward_hook(self._post(name)))

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _recording(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def _pre(self, name):
        def hook(module, args):
            if name not in self._start and not self._recording():
                self._start[name] = self._mark()
        return hook

    def _post(self, name):
        def hook(module, args, output):
            if self._recording():
                return
            self._end[name] = self._mark()
            self.calls[name] = self.calls.get(name, 0) + 1
        return hook

    def begin(self) -> None:
        self._start.clear()
        self._end.clear()
        self.calls = {}

    def end(self) -> dict[str, float]:
        sync(self.device)
        out = {}
        for name, a in self._start.items():
            b = self._end.get(name)
            if b is None:
                continue
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# -- profile ------------------------------------------------------------------------------------------------

# Heuristic, first match wins; the report shows the kernel names themselves next to the classes.
_KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("matmul", ("triton_tem", "triton_mm")),                     # inductor's matmul templates
    ("elementwise (fused)", ("triton_poi",)),
    ("normalization/reduction", ("triton_red", "triton_per")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "_mm_", "addmm", "sm90", "scaled_mm", "cublas")),
    ("convolution", ("conv", "implicit", "winograd", "cudnn", "dgrad", "wgrad", "fprop")),
    ("normalization/reduction", ("norm", "reduce", "welford", "mean", "sum")),
    ("copy/layout", ("copy", "memcpy", "memset", "transpose", "permute", "cat", "nchw", "nhwc")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "silu", "gelu", "relu", "lrelu", "clamp",
                     "tanh", "sigmoid", "mul", "add", "div", "sub")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in _KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


CLASS_TOP = 12     # kernels kept per class in a profile's top_by_class


def profile_call(fn: Callable[[], Any], device: torch.device, top: int = 10) -> dict:
    """Which kernels one call spends its device time in, and how busy the device was (device time / wall
    time: far below 1 means launch-bound, the case CUDA graphs fix)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # On a GPU only the kernels are recorded: a 50-step image launches tens of thousands of them, and host-side
    # operator events would multiply the profiler's own cost for nothing this table uses.
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    # name -> [microseconds, calls]. On a GPU: every kernel / memcpy / memset the device ran, from its own
    # start and end times (robust to how the profiler attributes device time to host operators). On a CPU
    # there are no kernels: the leaf operators' own time is the closest thing.
    per_name: dict[str, list[float]] = {}
    if device.type == "cuda":
        for e in prof.events():
            if getattr(e, "device_type", None) == DeviceType.CUDA:
                acc = per_name.setdefault(e.name, [0.0, 0])
                acc[0] += float(e.time_range.elapsed_us())
                acc[1] += 1
    else:
        for e in prof.key_averages():
            if e.key.startswith("aten::"):
                per_name[e.key] = [float(e.self_cpu_time_total), int(e.count)]
    total_us = sum(v[0] for v in per_name.values())
    classes: dict[str, float] = {}
    for name, (us, _) in per_name.items():
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + us / 1e3
    ordered = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    ranked = ordered[:top]
    # per class, its own heaviest kernels: what a class total is made of (SDXL's 107 ms of normalization is
    # spread over dozens of generated kernels that never reach the overall top ten)
    by_class_top: dict[str, list[dict]] = {}
    for name, (us, n) in ordered:
        bucket = by_class_top.setdefault(kernel_class(name), [])
        if len(bucket) < CLASS_TOP:
            bucket.append({"name": name[:160], "ms": us / 1e3, "calls": int(n)})
    return {
        "wall_ms": wall,
        "device_busy_ms": total_us / 1e3,
        "busy_fraction": (total_us / 1e3) / wall if wall > 0 else None,
        "kernel_launches": int(sum(v[1] for v in per_name.values())),
        "by_class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top": [{"name": name[:160], "class": kernel_class(name), "ms": us / 1e3, "calls": int(n),
                 "pct": (100.0 * us / total_us) if total_us else None} for name, (us, n) in ranked],
        "top_by_class": by_class_top,
    }
