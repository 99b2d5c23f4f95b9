"""Pick the fastest models.ops implementations on the GPU: every variant timed and checked in one run.

    python3 -m bench.ops --out $OUT/ops.json          (H200: under 6 minutes)
    python3 -m bench.ops --smoke --out /tmp/ops.json  (CPU, tiny shapes: checks the script itself)

Sections, each with a share of the time budget (--budget seconds; whatever a section leaves is
passed on, and what does not fit is listed under "skipped" in the JSON):

1. ops      every variant of each knob (models.ops.IMPL_CHOICES) on realistic shapes:
            - training (emoji64 trainer: 64x64, 128 channels, batch 128): the G up-conv, the D
              down-conv, the FIR blur and the 2x downsample; modes fwd, bwd (forward + backward
              for input and weights) and dbl (forward, input gradient with create_graph, backward
              of its squared norm: what R1 / path length do), each with grad=aten and gradfix;
            - inference (StyleGAN2-1024, fused modconv): the up-convs of blocks 64, 256 and 1024
              at batch 1 and 32, and the FIR blur of block 1024;
            in bf16 and fp32 (TF32 off), channels_last and NCHW; CUDA events, synchronised per call
            (so launch-bound cases count their launch time), after warm-up and cuDNN autotuning.
            Each variant's output (and for training its input gradient and second-order
            parameter gradient) is compared with the fp32 NCHW reference implementation:
            err_* is its relative L2 error, ref_err_* the default implementation's in the same
            dtype/layout; ok = err <= 2 x ref_err + 1e-6. Times: median of >= 20 calls (fewer only
            for calls over 125 ms; "iters" says how many).
2. compile  torch.compile (default mode) of the default and the best two eager variants
            per knob (plus fir=shifts, which only pays off compiled), bf16.
3. generator  the whole SG2-1024 generator, batch 1 and 32, NVlabs mixed precision and bf16
            autocast: default implementation vs the best inference variants set globally; at
            batch 32 also with fused_modconv=False (a dense conv over the batch instead of a
            grouped conv with per-sample weights) with the default, best-train and best-infer ops.
4. trainer  training.trainer.Trainer, emoji64 preset (as scripts/profile_trainer.py): ms per
            iteration over 32 iterations (2 R1 + 8 path-length steps) for the default, the best
            training variants with grad=aten and with grad=gradfix, gradfix alone, then each
            winning knob alone; plus an fp32 check on the trainer's networks (trainer_check): D
            logits, R1 gradients, G images and path-length gradients vs the default, next to the
            default's own change when the images move by 1e-7 (floor_*: the kinks of lrelu and
            clamp make these gradients that sensitive).

Needs python3 + torch (>= 2.4) + numpy only.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from models import ops

CL = torch.channels_last
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Timing and budget


class Clock:
    """Deadline bookkeeping: section i may run until start + sum of the shares up to i."""

    def __init__(self, budget: float, shares: dict[str, float]):
        self.t0 = time.perf_counter()
        self.budget = budget
        total = sum(shares.values())
        acc = 0.0
        self.deadline = {}
        for name, share in shares.items():
            acc += share / total
            self.deadline[name] = self.t0 + budget * acc

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self, section: str) -> float:
        return self.deadline[section] - time.perf_counter()


class Timer:
    def __init__(self, device: torch.device, smoke: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.smoke = smoke

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn) -> float:
        """ms of one call, synchronised before and after (CUDA events on the GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def median(self, fn, min_iters: int = 20, seconds: float = 0.12, warmup: int = 2) -> dict:
        """Median ms over >= min_iters calls, more for fast calls (about `seconds` worth, at most 200);
        only calls over 125 ms get fewer (2.5 s worth, at least 5)."""
        if self.smoke:
            min_iters, warmup = 2, 1
        for _ in range(warmup):
            fn()
        probe = self.once(fn)
        iters = max(min_iters, min(200, int(seconds * 1e3 / max(probe, 1e-3))))
        if probe * min_iters > 2500:
            iters = max(5 if not self.smoke else 2, int(2500 / probe))
        times = [probe] + [self.once(fn) for _ in range(iters - 1)]
        return {"ms": statistics.median(times), "iters": len(times), "min_ms": min(times)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@contextlib.contextmanager
def tf32(enabled: bool):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Op cases


@dataclass
class Case:
    name: str
    knob: str                      # which setting it compares: up | down | fir
    purpose: str                   # train | infer
    build: Callable                # (dtype, channels_last, masters) -> (op, inputs); inputs[0] is x
    masters: Callable              # () -> fp32 master tensors (random, on the device)
    weight: dict = field(default_factory=dict)   # train score: sum of mode time x weight


def _rand(device, *shape, scale=1.0, offset=0.0):
    return torch.randn(*shape, device=device) * scale + offset


def _layout(t: torch.Tensor, dtype, channels_last: bool) -> torch.Tensor:
    t = t.to(dtype)
    return t.contiguous(memory_format=CL) if channels_last and t.ndim == 4 else t.contiguous()


def make_cases(device, smoke: bool) -> list[Case]:
    f = ops.setup_filter([1, 3, 3, 1], device=device)
    B, C, R = (2, 8, 8) if smoke else (128, 128, 64)
    cases = []

    def conv_case(name, knob, x_shape, up, down, weight):
        def masters():
            return {"x": _rand(device, *x_shape), "w": _rand(device, C, C, 3, 3),
                    "r": _rand(device, B, C, x_shape[2] * up // down, x_shape[3] * up // down)}

        def build(dtype, channels_last, m):
            x = _layout(m["x"], dtype, channels_last)
            w = _layout(m["w"], dtype, channels_last)   # the trainer stores weights channels_last too

            def op(x, w):
                return ops.conv2d_resample(x, w, f=f, up=up, down=down, padding=1, flip_weight=up == 1)
            return op, (x, w), _layout(m["r"], dtype, channels_last)
        cases.append(Case(name, knob, "train", build, masters, weight))

    # Per-iteration use in the emoji64 trainer (r1_interval 16, pl_interval 4 at half batch):
    # G-side ops run 1 fwd (D step) + 1 fwd/bwd (G step) + 1/8 dbl; D-side ops 3 fwd/bwd + 1/16 dbl.
    conv_case(f"G.up {R // 2}->{R} c{C} b{B}", "up", (B, C, R // 2, R // 2), 2, 1, {"fwd": 1, "bwd": 1, "dbl": 1 / 8})
    conv_case(f"D.down {R}->{R // 2} c{C} b{B}", "down", (B, C, R, R), 1, 2, {"bwd": 3, "dbl": 1 / 16})

    def fir_case(name, out_fn, weight):
        def masters():
            x = _rand(device, B, C, R, R)
            return {"x": x, "a": _rand(device, 1, C, 1, 1, scale=0.1, offset=1.0), "r": torch.randn_like(out_fn(x))}

        def build(dtype, channels_last, m):
            def op(x, a):
                return out_fn(x) * a     # a: a parameter after the FIR, so dbl runs the FIR's double backward
            return op, (_layout(m["x"], dtype, channels_last), m["a"].to(dtype)), _layout(m["r"], dtype, channels_last)
        cases.append(Case(name, "fir", "train", build, masters, weight))

    fir_case(f"blur {R} c{C} b{B}", lambda x: ops.upfirdn2d(x, f, padding=2), {"fwd": 1, "bwd": 2, "dbl": 1 / 10})
    fir_case(f"down2 {R} c{C} b{B}", lambda x: ops.downsample2d(x, f), {"bwd": 3, "dbl": 1 / 16})

    # StyleGAN2-1024 inference (fused modconv: one grouped conv over the batch).
    layers = [("b64", 32, 512, 512), ("b256", 128, 256, 128), ("b1024", 512, 64, 32)]
    if smoke:
        layers = [("b16", 8, 16, 8)]
    for batch in (1, 32) if not smoke else (2,):
        for block, res, cin, cout in layers:
            def masters(batch=batch, res=res, cin=cin, cout=cout):
                return {"x": _rand(device, batch, cin, res, res), "w": _rand(device, cout, cin, 3, 3),
                        "s": _rand(device, batch, cin, scale=0.5, offset=1.0)}

            def build(dtype, channels_last, m):
                def op(x):
                    return ops.modulated_conv2d(x, m["w"], m["s"], up=2, padding=1, resample_filter=f,
                                                flip_weight=False, fused_modconv=True)
                return op, (_layout(m["x"], dtype, channels_last),), None
            cases.append(Case(f"G1024.{block} up {cin}->{cout} {res}->{2 * res} b{batch}", "up", "infer", build,
                              masters))
        # The blur after block 1024's transposed conv: [1, N*32, 1025, 1025].
        side = 17 if smoke else 1025
        chans = batch * (4 if smoke else 32)

        def fir_masters(chans=chans, side=side):
            return {"x": _rand(device, 1, chans, side, side)}

        def fir_build(dtype, channels_last, m):
            def op(x):
                return ops.upfirdn2d(x, f, padding=1, gain=4)
            return op, (_layout(m["x"], dtype, channels_last),), None
        cases.append(Case(f"G1024.b1024 blur {side} c{chans} (b{batch})", "fir", "infer", fir_build, fir_masters))
    return cases


def train_once(op, inputs, r):
    """(y, input gradient, parameter gradient of the squared input-gradient norm): the dbl mode's results."""
    x, p = (t.detach().requires_grad_(True) for t in inputs)
    y = op(x, p)
    (gx,) = torch.autograd.grad(y, x, r, create_graph=True)
    gx.float().square().sum().backward()
    return y.detach(), gx.detach(), p.grad


def mode_fns(op, inputs, r, purpose):
    if purpose == "infer":
        def fwd():
            with torch.no_grad():
                op(*inputs)
        return {"fwd": fwd}
    x, p = (t.detach().requires_grad_(True) for t in inputs)

    def fwd():
        with torch.no_grad():
            op(x, p)

    def bwd():
        x.grad = p.grad = None
        op(x, p).backward(r)

    def dbl():
        x.grad = p.grad = None
        (gx,) = torch.autograd.grad(op(x, p), x, r, create_graph=True)
        gx.float().square().sum().backward()
    return {"fwd": fwd, "bwd": bwd, "dbl": dbl}


def outputs(case: Case, op, inputs, r):
    if case.purpose == "infer":
        with torch.no_grad():
            return {"y": op(*inputs)}
    y, gx, gp = train_once(op, inputs, r)
    return {"y": y, "gx": gx, "gp": gp}


def run_ops(cases, timer, clock, device, smoke, results, skipped):
    """Every (case, config, variant, grad) with accuracy; most important configurations first."""
    train_configs = [("bf16", True), ("bf16", False), ("fp32", False), ("fp32", True)]
    infer_configs = [("bf16", False), ("fp32", False), ("bf16", True)]
    plan = []   # (priority, case, dtype, cl)
    for case in cases:
        configs = train_configs if case.purpose == "train" else infer_configs
        for prio, (dt, cl) in enumerate(configs):
            plan.append((prio, case, dt, cl))
    plan.sort(key=lambda item: item[0])
    refs = {}
    for prio, case, dt, cl in plan:
        label = f"{case.name} | {dt} {'CL' if cl else 'NCHW'}"
        if clock.left("ops") < 2:
            skipped.append(f"ops: {label}")
            continue
        try:
            torch.manual_seed(0)
            if case.name not in refs:
                free_memory(device)
                masters = case.masters()
                with tf32(False), ops.use_impl(**ops.DEFAULT_IMPL):
                    op, inputs, r = case.build(torch.float32, False, masters)
                    ref = outputs(case, op, inputs, r)
                refs = {case.name: (masters, ref)}    # keep one case's tensors alive at a time
            masters, ref = refs[case.name]
            with tf32(False):
                run_config(case, dt, cl, masters, ref, timer, clock, smoke, results, skipped, label)
        except torch.cuda.OutOfMemoryError as exc:
            skipped.append(f"ops: {label}: out of memory ({exc})")
        except Exception as exc:  # keep going: one broken combination must not cost the session
            skipped.append(f"ops: {label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    refs.clear()
    free_memory(device)


def run_config(case, dt, cl, masters, ref, timer, clock, smoke, results, skipped, label):
    op, inputs, r = case.build(DTYPES[dt], cl, masters)
    variants = ops.IMPL_CHOICES[case.knob]
    grads = ("aten", "gradfix") if case.purpose == "train" else ("aten",)
    ref_err = None
    for variant in variants:
        for grad in grads:
            if clock.left("ops") < 1:
                skipped.append(f"ops: {label} {variant} grad={grad}")
                continue
            impl = {case.knob: variant, "grad": grad}
            with ops.use_impl(**impl):
                got = outputs(case, op, inputs, r)
                errs = {f"err_{k}": rel_err(v, ref[k]) for k, v in got.items()}
                del got
                if variant == variants[0] and grad == "aten":
                    ref_err = {f"ref_{k}": v for k, v in errs.items()}
                ok = all(errs[k] <= 2 * ref_err["ref_" + k] + 1e-6 for k in errs)
                fns = mode_fns(op, inputs, r, case.purpose)
                for mode, fn in fns.items():
                    if mode == "fwd" and grad != "aten":
                        continue   # the forward pass does not depend on the grad knob
                    t = timer.median(fn)
                    results.append({"case": case.name, "purpose": case.purpose, "knob": case.knob,
                                    "variant": variant, "grad": grad, "dtype": dt,
                                    "layout": "CL" if cl else "NCHW", "mode": mode, **t, **errs, **ref_err,
                                    "ok": ok})
            print(f"  {label:58s} {variant:18s} {grad:7s} " + " ".join(
                f"{r_['mode']} {r_['ms']:8.3f}" for r_ in results
                if r_["case"] == case.name and r_["variant"] == variant and r_["grad"] == grad
                and r_["dtype"] == dt and r_["layout"] == ("CL" if cl else "NCHW")) + ("" if ok else "  NOT OK"),
                flush=True)


def run_sg3_filtered_lrelu(timer, clock, device, smoke, results, skipped):
    """SG3's own filtered_lrelu ([N*C, 1, H, W] 1-D convs) vs the same op from ops.upfirdn2d per FIR variant.

    Diagnostic for the StyleGAN3 owner (models/stylegan3.py is not switched by ops.set_impl):
    fp32 and bf16 autocast, where SG3-T 1024 measured 4x slower than without autocast.
    """
    from models.stylegan3 import filtered_lrelu as sg3_filtered_lrelu

    taps = 12                                   # SG3: filter_size 6 x up 2
    t = torch.arange(taps, dtype=torch.float64) - (taps - 1) / 2
    lowpass = torch.sinc(t / 2) * torch.hann_window(taps + 2, periodic=False, dtype=torch.float64)[1:-1]
    lowpass = (lowpass / lowpass.sum()).float().to(device)
    n, c, side = (1, 4, 20) if smoke else (1, 64, 532)
    torch.manual_seed(0)
    x = torch.randn(n, c, side, side, device=device)
    bias = torch.randn(c, device=device) * 0.1
    kw = dict(up=2, down=2, padding=[10, 10, 10, 10], gain=math.sqrt(2), slope=0.2, clamp=256.0)

    def own(x):
        return sg3_filtered_lrelu(x, lowpass, lowpass, bias, **kw)

    def composed(x):
        y = ops.upfirdn2d(x + bias.to(x.dtype).view(1, -1, 1, 1), lowpass, up=2, padding=kw["padding"], gain=4)
        y = ops.bias_act(y, act="lrelu", alpha=kw["slope"], gain=kw["gain"], clamp=kw["clamp"])
        return ops.upfirdn2d(y, lowpass, down=2)

    with torch.no_grad(), tf32(False):
        ref = own(x)
        for precision in ("fp32", "bf16-autocast"):
            for name, fn, fir in [("sg3 own", own, "grouped")] + [(f"ops fir={v}", composed, v)
                                                                  for v in ops.IMPL_CHOICES["fir"]]:
                label = f"SG3 filtered_lrelu {precision} {name}"
                if clock.left("ops") < 1:
                    skipped.append(f"ops: {label}")
                    continue
                try:
                    with ops.use_impl(fir=fir), torch.autocast(device.type, dtype=torch.bfloat16,
                                                               enabled=precision != "fp32"):
                        err = rel_err(fn(x).float(), ref)
                        r = timer.median(lambda: fn(x))
                    results.append({"shape": [n, c, side, side], "precision": precision, "impl": name, **r,
                                    "err_vs_sg3_fp32": err})
                    print(f"  {label:52s} {r['ms']:8.3f} ms  err {err:.1e}", flush=True)
                except Exception as exc:
                    skipped.append(f"ops: {label}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()


# ---------------------------------------------------------------------------------------------
# Choosing winners


def pick_best(results, cases) -> dict:
    """Per knob: variants ranked by a score in the trainer's configuration (bf16 CL) and for inference.

    train score of (variant, grad) = sum over train cases of that knob of sum_mode weight x ms, relative
    to the default's; infer score = geometric mean of ms / default ms over inference cases (bf16 NCHW).
    Variants that failed the accuracy check anywhere in that configuration are left out.
    """
    weights = {c.name: c.weight for c in cases}
    best = {"train": {}, "infer": {}, "ranking": {}}
    for knob in ("up", "down", "fir"):
        # train
        rows = [r for r in results if r["knob"] == knob and r["purpose"] == "train" and r["dtype"] == "bf16"
                and r["layout"] == "CL"]
        scores = {}
        for variant in ops.IMPL_CHOICES[knob]:
            for grad in ("aten", "gradfix"):
                total, complete, ok = 0.0, True, True
                for case_name in {r["case"] for r in rows}:
                    for mode, wgt in weights[case_name].items():
                        hit = [r for r in rows if r["case"] == case_name and r["variant"] == variant and r["mode"] == mode
                               and (r["grad"] == grad or mode == "fwd")]
                        if not hit:
                            complete = False
                            continue
                        total += wgt * hit[0]["ms"]
                        ok = ok and hit[0]["ok"]
                if complete and ok and rows:
                    scores[(variant, grad)] = total
        if scores:
            base = scores.get((ops.DEFAULT_IMPL[knob], "aten"))
            ranked = sorted(scores.items(), key=lambda kv: kv[1])
            best["ranking"][f"train.{knob}"] = [
                {"variant": v, "grad": g, "score_ms": s, "speedup": (base / s) if base else None} for (v, g), s in ranked]
            best["train"][knob] = {"variant": ranked[0][0][0], "grad": ranked[0][0][1]}
        # infer
        rows = [r for r in results if r["knob"] == knob and r["purpose"] == "infer" and r["dtype"] == "bf16"
                and r["layout"] == "NCHW"]
        if rows:
            base = {r["case"]: r["ms"] for r in rows if r["variant"] == ops.DEFAULT_IMPL[knob]}
            geo = {}
            for variant in ops.IMPL_CHOICES[knob]:
                mine = [r for r in rows if r["variant"] == variant and r["case"] in base]
                if len(mine) == len(base) and all(r["ok"] for r in mine):
                    geo[variant] = math.exp(sum(math.log(r["ms"] / base[r["case"]]) for r in mine) / len(mine))
            if geo:
                ranked = sorted(geo.items(), key=lambda kv: kv[1])
                best["ranking"][f"infer.{knob}"] = [{"variant": v, "rel_time": s} for v, s in ranked]
                best["infer"][knob] = {"variant": ranked[0][0]}
    return best


def combo(best: dict, purpose: str, grad: str | None = None) -> dict:
    impl = {knob: choice["variant"] for knob, choice in best[purpose].items()}
    if grad is not None:
        impl["grad"] = grad
    return impl


# ---------------------------------------------------------------------------------------------
# torch.compile


def run_compile(cases, best, timer, clock, device, smoke, results, skipped):
    backend = "aot_eager" if smoke else "inductor"   # smoke: checks this logic without a C++/Triton build
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    jobs = []   # (case, variant)
    for purpose, knob in (("train", "up"), ("train", "down"), ("train", "fir"), ("infer", "up")):
        ranking = best["ranking"].get(f"{purpose}.{knob}", [])
        names = [ops.DEFAULT_IMPL[knob]]
        for row in ranking:
            if row["variant"] not in names and len(names) < 3:
                names.append(row["variant"])
        if knob == "fir" and "shifts" not in names:
            names.append("shifts")   # elementwise: the one FIR that Inductor can fuse
        # One representative case: the first training case of the knob, or block 64 at batch 32.
        candidates = [c for c in cases if c.knob == knob and c.purpose == purpose]
        if not candidates:
            continue
        preferred = [c for c in candidates if "b64 " in c.name and c.name.endswith("b32")]
        jobs += [((preferred or candidates)[0], v) for v in names]
    for case, variant in jobs:
        label = f"{case.name} {variant}"
        if clock.left("compile") < 30:
            skipped.append(f"compile: {label}")
            continue
        try:
            free_memory(device)
            torch.manual_seed(0)
            masters = case.masters()
            op, inputs, r = case.build(torch.bfloat16, case.purpose == "train", masters)
            torch._dynamo.reset()
            with ops.use_impl(**{case.knob: variant}):
                compiled = torch.compile(op, backend=backend)
                fns = mode_fns(compiled, inputs, r, case.purpose)
                mode = "bwd" if case.purpose == "train" else "fwd"
                t0 = time.perf_counter()
                fns[mode]()
                timer.sync()
                compile_s = time.perf_counter() - t0
                t = timer.median(fns[mode])
                eager = timer.median(mode_fns(op, inputs, r, case.purpose)[mode])
            results.append({"case": case.name, "knob": case.knob, "variant": variant, "dtype": "bf16",
                            "layout": "CL" if case.purpose == "train" else "NCHW", "mode": mode,
                            "compiled_ms": t["ms"], "eager_ms": eager["ms"], "compile_s": compile_s})
            print(f"  compile {label:70s} {mode} compiled {t['ms']:8.3f} ms  eager {eager['ms']:8.3f} ms  "
                  f"(compile {compile_s:.0f} s)", flush=True)
        except Exception as exc:
            skipped.append(f"compile: {label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    torch._dynamo.reset()
    free_memory(device)


# ---------------------------------------------------------------------------------------------
# Whole generator


def run_generator(best, timer, clock, device, smoke, results, skipped):
    from models.stylegan import build_generator

    if smoke:
        kw = dict(z_dim=16, c_dim=0, w_dim=16, img_resolution=32, img_channels=3, mapping_kwargs={"num_layers": 2},
                  channel_base=256, channel_max=16, num_fp16_res=2, conv_clamp=256)
    else:
        kw = dict(z_dim=512, c_dim=0, w_dim=512, img_resolution=1024, img_channels=3,
                  mapping_kwargs={"num_layers": 8}, channel_base=32768, channel_max=512, num_fp16_res=4,
                  conv_clamp=256)
    torch.manual_seed(0)
    G = build_generator("stylegan2", kw).to(device).eval().requires_grad_(False)
    impls = {"default": dict(ops.DEFAULT_IMPL), "best-infer": {**ops.DEFAULT_IMPL, **combo(best, "infer")},
             # Dense (unfused) modconv shares one weight over the batch, like training: its winners apply.
             "best-train": {**ops.DEFAULT_IMPL, **combo(best, "train"), "grad": "aten"}}
    big = 2 if smoke else 32
    # (batch, precision, fused_modconv, impl): fused modconv = one grouped conv with per-sample
    # weights (the default at inference); unfused = a dense conv over the batch.
    plan = [(b, prec, True, name) for b in ((1, big) if not smoke else (big,)) for name in ("default", "best-infer")
            for prec in ("mixed", "bf16")]
    plan += [(big, "bf16", False, name) for name in ("default", "best-train", "best-infer")]
    done = []
    refs = {}
    for batch, precision, fused, name in plan:
        impl = impls[name]
        if (batch, precision, fused, impl) in done:
            continue   # the best variants are the defaults: nothing new to time
        done.append((batch, precision, fused, impl))
        label = f"G1024 b{batch} {precision} fused_modconv={fused} {name}"
        if clock.left("generator") < 3:
            skipped.append(f"generator: {label}")
            continue
        try:
            if batch not in refs:
                refs.clear()
                free_memory(device)
                z = torch.randn(batch, G.z_dim, device=device, generator=torch.Generator(device).manual_seed(batch))
                with torch.no_grad(), tf32(False):
                    refs[batch] = (z, G(z, None, force_fp32=True))
            z, ref = refs[batch]
            with ops.use_impl(**impl), torch.no_grad():
                def fn():
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                        return G(z, None, fused_modconv=fused)
                err = rel_err(fn().float(), ref)
                t = timer.median(fn, min_iters=20, seconds=1.0)
            results.append({"batch": batch, "precision": precision, "fused_modconv": fused, "impl": name,
                            "settings": impl, **t, "ms_per_image": t["ms"] / batch, "err_vs_fp32": err})
            print(f"  {label:58s} {t['ms']:9.3f} ms  ({t['ms'] / batch:7.3f} ms/img)  err {err:.2e}", flush=True)
        except Exception as exc:
            skipped.append(f"generator: {label}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    refs.clear()
    free_memory(device)


# ---------------------------------------------------------------------------------------------
# Trainer


def run_trainer(best, timer, clock, device, smoke, results, skipped, report):
    from training.cli import build_parser, config_from_args
    from training.trainer import Trainer

    argv = ["--preset", "emoji64", "--out", "/tmp/bench_ops_trainer", "--no-progress"]
    if smoke:
        argv += ["--batch", "8", "--device", "cpu", "--precision", "fp32"]
    if clock.left("trainer") < 30:
        skipped.append("trainer: not enough time left to build it")
        return
    cfg = config_from_args(build_parser().parse_args(argv))
    tr = Trainer(cfg, write_outputs=False)
    iters, warm = (32, 16) if not smoke else (4, 1)

    def timed(impl: dict) -> dict:
        with ops.use_impl(**impl):
            for _ in range(warm):
                tr.iteration()
            timer.sync()
            t = time.perf_counter()
            for _ in range(iters):
                tr.iteration()
            timer.sync()
        ms = (time.perf_counter() - t) / iters * 1e3
        return {"ms_per_iter": ms, "img_per_s": cfg.batch / ms * 1e3, "iters": iters}

    # First iterations: cuDNN autotuning, allocator growth, the first lazy R1 / path-length steps.
    for _ in range(20 if not smoke else 1):
        tr.iteration()
    timer.sync()
    train_best = combo(best, "train")
    settings = [("default", dict(ops.DEFAULT_IMPL)),
                ("best-train grad=aten", {**ops.DEFAULT_IMPL, **train_best, "grad": "aten"}),
                ("best-train grad=gradfix", {**ops.DEFAULT_IMPL, **train_best, "grad": "gradfix"}),
                ("gradfix only", {**ops.DEFAULT_IMPL, "grad": "gradfix"})]
    for knob in ("fir", "up", "down"):
        if knob in train_best and train_best[knob] != ops.DEFAULT_IMPL[knob]:
            settings.append((f"{knob}={train_best[knob]} only", {**ops.DEFAULT_IMPL, knob: train_best[knob]}))
    settings.append(("default (again: drift)", dict(ops.DEFAULT_IMPL)))
    seen = []
    base = None
    per_setting = (warm + iters) * 0.25 if not smoke else 0   # seconds; replaced by the measured one
    for name, impl in settings:
        if impl in seen and not name.startswith("default"):
            continue
        seen.append(impl)
        if clock.left("trainer") < per_setting + 2:
            skipped.append(f"trainer: {name}")
            continue
        try:
            r = timed(impl)
            per_setting = 1.3 * (warm + iters) * r["ms_per_iter"] / 1e3
            base = base or r["ms_per_iter"]
            results.append({"setting": name, "impl": impl, **r, "speedup": base / r["ms_per_iter"]})
            print(f"  trainer {name:34s} {r['ms_per_iter']:8.1f} ms/iter  {r['img_per_s']:7.0f} img/s  "
                  f"x{base / r['ms_per_iter']:.2f}", flush=True)
        except Exception as exc:
            skipped.append(f"trainer: {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    # fp32 consistency of the winning combination on the trainer's own networks.
    try:
        report["trainer_check"] = trainer_check(tr, {**ops.DEFAULT_IMPL, **train_best, "grad": "gradfix"}, device)
        print(f"  trainer check (fp32): {report['trainer_check']}", flush=True)
    except Exception as exc:
        skipped.append(f"trainer check: {type(exc).__name__}: {exc}")
        traceback.print_exc()


def trainer_check(tr, impl: dict, device) -> dict:
    """fp32 (TF32 off), default vs impl on the trainer's own networks: D logits, R1 input gradients and
    D's parameter gradients of R1; G images (noise 'const') and G's parameter gradients of a path-length
    style penalty."""
    D, G = tr.D, tr.G
    torch.manual_seed(0)
    res = D.img_resolution
    real = torch.randn(16, 3, res, res, device=device)
    if tr.channels_last:
        real = real.contiguous(memory_format=CL)
    z = torch.randn(8, G.z_dim, device=device)
    probe = torch.randn(8, 3, res, res, device=device)

    def run(setting, images, z):
        D.zero_grad(set_to_none=True)
        G.zero_grad(set_to_none=True)
        x = images.detach().requires_grad_(True)
        with ops.use_impl(**setting), tf32(False):
            logits = D(x)
            (g,) = torch.autograd.grad(logits.sum(), x, create_graph=True)
            g.square().sum().backward()
            ws = G.mapping(z, None)
            img = G.synthesis(ws, noise_mode="const")
            (gw,) = torch.autograd.grad((img * probe).sum(), ws, create_graph=True)
            gw.square().sum().backward()
        d_grads = torch.cat([p.grad.flatten() for p in D.parameters() if p.grad is not None])
        g_grads = torch.cat([p.grad.flatten() for p in G.parameters() if p.grad is not None])
        return logits.detach(), g.detach(), d_grads, img.detach(), g_grads

    want = run(dict(ops.DEFAULT_IMPL), real, z)
    got = run(impl, real, z)
    # Noise floor: the default itself on images and z moved by 1e-7 (relative). lrelu kinks and the
    # conv clamp make the gradients flip at a few pixels, so gradient errors of this order
    # (~1e-4 .. 1e-3 seen on CPU) are conditioning, not a wrong variant.
    floor = run(dict(ops.DEFAULT_IMPL), real * (1 + 1e-7 * torch.randn_like(real)), z * (1 + 1e-7 * torch.randn_like(z)))
    D.zero_grad(set_to_none=True)
    G.zero_grad(set_to_none=True)
    out = {"impl": impl}
    for i, name in enumerate(("d_logits", "r1_input_grad", "r1_d_param_grads", "g_images", "pl_g_param_grads")):
        out[f"err_{name}"] = rel_err(got[i], want[i])
        out[f"floor_{name}"] = rel_err(floor[i], want[i])
    return out


# ---------------------------------------------------------------------------------------------
# Report


def print_tables(report):
    rows = report["ops"]
    if rows:
        print("\n== ops: ms (speedup vs default, grad=aten) ==")
        for case in dict.fromkeys(r["case"] for r in rows):
            for dt, lay in dict.fromkeys((r["dtype"], r["layout"]) for r in rows if r["case"] == case):
                sub = [r for r in rows if r["case"] == case and r["dtype"] == dt and r["layout"] == lay]
                base = {r["mode"]: r["ms"] for r in sub if r["variant"] == ops.IMPL_CHOICES[r["knob"]][0]
                        and r["grad"] == "aten"}
                print(f"{case} | {dt} {lay}")
                for variant, grad in dict.fromkeys((r["variant"], r["grad"]) for r in sub):
                    mine = [r for r in sub if r["variant"] == variant and r["grad"] == grad]
                    cells = " ".join(f"{r['mode']} {r['ms']:8.3f} (x{base.get(r['mode'], float('nan')) / r['ms']:4.2f})"
                                     for r in mine)
                    errs = " ".join(f"{k[4:]} {v:.1e}" for k, v in mine[0].items() if k.startswith("err_"))
                    flag = "" if mine[0]["ok"] else "  NOT OK"
                    print(f"    {variant:18s} {grad:7s} {cells}   err {errs}{flag}")
    best = report.get("best", {})
    if best:
        print("\n== best ==")
        for key, ranking in best.get("ranking", {}).items():
            print(f"  {key}: " + ", ".join(
                f"{r['variant']}/{r.get('grad', '-')} " + (f"x{r['speedup']:.2f}" if r.get("speedup") else
                                                           f"{r.get('rel_time', float('nan')):.2f}")
                for r in ranking[:4]))
        print(f"  train combo: {combo(best, 'train')}   infer combo: {combo(best, 'infer')}")
    if report["sg3_filtered_lrelu"]:
        print("\n== SG3 filtered_lrelu (diagnostic; SG3 is not switched by ops.set_impl) ==")
        for r in report["sg3_filtered_lrelu"]:
            print(f"  {r['precision']:14s} {r['impl']:18s} {r['ms']:8.3f} ms  err {r['err_vs_sg3_fp32']:.1e}")
    if report["compile"]:
        print("\n== compile (bf16) ==")
        for r in report["compile"]:
            print(f"  {r['case']:48s} {r['variant']:18s} {r['mode']} compiled {r['compiled_ms']:8.3f} ms  "
                  f"eager {r['eager_ms']:8.3f} ms  compile {r['compile_s']:.0f} s")
    if report["generator"]:
        print("\n== whole generator ==")
        for r in report["generator"]:
            print(f"  b{r['batch']:<3d} {r['precision']:6s} {'fused' if r['fused_modconv'] else 'dense'} "
                  f"{r['impl']:11s} {r['ms']:9.3f} ms "
                  f"({r['ms_per_image']:7.3f} ms/img, {1e3 / r['ms_per_image']:7.0f} img/s)  err {r['err_vs_fp32']:.1e}")
    if report["trainer"]:
        print("\n== trainer (emoji64) ==")
        for r in report["trainer"]:
            print(f"  {r['setting']:34s} {r['ms_per_iter']:8.1f} ms/iter {r['img_per_s']:7.0f} img/s x{r['speedup']:.2f}")
    if report["skipped"]:
        print(f"\nskipped ({len(report['skipped'])}): " + "; ".join(report["skipped"][:12])
              + (" ..." if len(report["skipped"]) > 12 else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="ops.json", help="JSON report path")
    ap.add_argument("--budget", type=float, default=315.0, help="seconds for all sections together")
    ap.add_argument("--sections", default="ops,compile,generator,trainer")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks this script, not speed")
    a = ap.parse_args()
    sections = a.sections.split(",")
    device = torch.device("cpu" if a.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU: run on the GPU machine, or use --smoke to check the script on the CPU")
    shares = {"ops": 150, "compile": 50, "generator": 50, "trainer": 75}
    clock = Clock(a.budget, {k: v for k, v in shares.items()})
    timer = Timer(device, a.smoke)
    torch.backends.cudnn.benchmark = True   # as the trainer does; the first call of each shape autotunes
    report = {"env": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                      "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                      "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
                      "cudnn_benchmark": True, "tf32_in_ops": False},
              "impl_choices": ops.IMPL_CHOICES, "default": ops.DEFAULT_IMPL,
              "ops": [], "sg3_filtered_lrelu": [], "best": {}, "compile": [], "generator": [], "trainer": [], "skipped": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        report["elapsed_s"] = clock.elapsed()
        out.write_text(json.dumps(report, indent=1, default=str))

    cases = make_cases(device, a.smoke)
    if "ops" in sections:
        print("== ops ==", flush=True)
        run_ops(cases, timer, clock, device, a.smoke, report["ops"], report["skipped"])
        run_sg3_filtered_lrelu(timer, clock, device, a.smoke, report["sg3_filtered_lrelu"], report["skipped"])
        report["best"] = pick_best(report["ops"], cases)
        save()
    best = report["best"] or {"train": {}, "infer": {}, "ranking": {}}
    if "compile" in sections:
        print("== compile ==", flush=True)
        run_compile(cases, best, timer, clock, device, a.smoke, report["compile"], report["skipped"])
        save()
    if "generator" in sections:
        print("== generator ==", flush=True)
        run_generator(best, timer, clock, device, a.smoke, report["generator"], report["skipped"])
        save()
    if "trainer" in sections:
        print("== trainer ==", flush=True)
        try:
            run_trainer(best, timer, clock, device, a.smoke, report["trainer"], report["skipped"], report)
        except Exception as exc:
            report["skipped"].append(f"trainer: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        save()
    print_tables(report)
    save()
    print(f"\nwrote {out} after {clock.elapsed():.0f} s")


if __name__ == "__main__":
    main()
