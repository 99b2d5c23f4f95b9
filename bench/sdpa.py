"""Which scaled-dot-product-attention backend is fastest for each attention shape a diffusion workload calls.

    python3 -m bench.sdpa --workloads sd15-512,sdxl-1024,sd-turbo-512 --out $OUT/sdpa.json   (H200: ~2 minutes)
    python3 -m bench.sdpa --workloads sd-tiny --out /tmp/sdpa.json                           (CPU: checks the tool)

1. Shapes as the workload really calls them: the workload's random-weight pipeline (bench.build, the real
   configs) runs one denoising step at its resolution with its guidance, while every call of
   `torch.nn.functional.scaled_dot_product_attention` is recorded with its shape (batch, heads, query and key
   lengths, head dim), its dtype and the part that made it (UNet, VAE, text encoder). UNet calls happen once per
   step, so a shape's calls per image are its count times the workload's steps.
2. Each distinct unmasked shape, with random inputs in the workload's precision, under each backend
   (`torch.nn.attention.sdpa_kernel`: flash, efficient, cudnn, math) and under none (what PyTorch picks by
   itself, "default"): on a GPU the median device time per call of 20 calls replayed from one CUDA graph (what a
   graph-captured UNet pays: no host dispatch in it), and the relative L2 error against an fp32 math reference.
   A backend that cannot take the shape is listed with PyTorch's reason.
3. Per shape the fastest backend within the error of the default, and what picking it would save per image.

Masked calls (CLIP's causal text encoder) are recorded but not timed: 77 tokens, once per image.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

BACKENDS = ("flash", "efficient", "cudnn", "math")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _backend_enum(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


@contextlib.contextmanager
def recording(parts: dict[str, torch.nn.Module]):
    """Record every SDPA call's shape and the part it came from, while the block runs. Yields the Counter of
    (part, batch, heads, q_len, k_len, head_dim, v_dim, dtype, masked) -> calls."""
    calls: Counter = Counter()
    current = {"part": "other"}
    entered: Counter = Counter()              # forward calls per part (the UNet's: denoising calls)
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        masked = attn_mask is not None or bool(kwargs.get("is_causal", False))
        if q.dim() == 4:
            b, h, lq, d = q.shape
            calls[(current["part"], b, h, lq, k.shape[-2], d, v.shape[-1], str(q.dtype).replace("torch.", ""),
                   masked)] += 1
        return original(q, k, v, attn_mask, *args, **kwargs)

    hooks = []
    for name, module in parts.items():
        if module is None:
            continue
        def enter(m, a, n=name):              # returns None: a pre-hook's return value would replace the args
            current["part"] = n
            entered[n] += 1
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(lambda m, a, o: current.__setitem__("part", "other")))
    F.scaled_dot_product_attention = spy
    calls.entered = entered                   # type: ignore[attr-defined]
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original
        for h in hooks:
            h.remove()


def workload_shapes(name: str, device: torch.device, seed: int = 0) -> tuple[dict, list[dict]]:
    """(workload facts, one row per distinct SDPA call shape with its calls per image) of one pipeline step."""
    from bench.build import random_diffusion_pipeline
    from bench.specs import get_workload

    wl = get_workload(name)
    if wl.kind != "diffusion":
        raise SystemExit(f"{name} is not a diffusion workload")
    precision = (wl.best or {}).get("precision", "fp16") if device.type == "cuda" else "fp32"
    dtype = DTYPES[precision]
    pipe = random_diffusion_pipeline(wl, device, seed)
    pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    # the decoder, not the VAE: the pipeline calls vae.decode, which no forward hook of the VAE sees
    parts = {"unet": pipe.unet, "vae_decoder": pipe.vae.decoder, "text_encoder": pipe.text_encoder,
             "text_encoder_2": getattr(pipe, "text_encoder_2", None)}
    with torch.no_grad(), recording(parts) as calls:
        pipe("a watercolor fox in a misty forest", num_inference_steps=1, guidance_scale=float(wl.guidance),
             height=wl.resolution, width=wl.resolution, output_type="np",
             generator=torch.Generator("cpu").manual_seed(seed))
    # UNet calls per image in the real workload: the scheduler's timesteps at its steps (PNDM adds one)
    pipe.scheduler.set_timesteps(wl.steps)
    unet_calls = len(pipe.scheduler.timesteps)
    ran = max(1, calls.entered["unet"])     # UNet calls in the one-step run (PNDM: two)
    rows = []
    for (part, b, h, lq, lk, d, dv, dt, masked), n in sorted(calls.items(), key=lambda kv: (kv[0][0], -kv[0][3])):
        per_call = n / ran if part == "unet" else n
        per_image = int(round(per_call * unet_calls)) if part == "unet" else n
        rows.append({"part": part, "batch": b, "heads": h, "q_len": lq, "k_len": lk, "head_dim": d, "v_dim": dv,
                     "dtype": dt, "masked": masked, "calls_per_unet_call": per_call if part == "unet" else None,
                     "calls_per_image": per_image})
    del pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    facts = {"workload": wl.name, "resolution": wl.resolution, "steps": wl.steps, "guidance": wl.guidance,
             "precision": precision, "unet_calls_per_image": unet_calls}
    return facts, rows


CALLS_PER_SAMPLE = 20    # calls replayed back to back per timed sample on a GPU


def _graph_of(fn, n: int, device: torch.device):
    """`fn` called n times, recorded in one CUDA graph (after a warm-up on a side stream, as capture needs), or
    None when the backend cannot be captured."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        return graph
    except Exception:             # RuntimeError / torch.AcceleratorError: "operation not permitted when capturing"
        torch.cuda.synchronize(device)
        return None


def _time(fn, device: torch.device, iters: int, warmup: int = 5) -> tuple[float, str]:
    """Median milliseconds of one call, and how they were taken.

    On a GPU a sample is CALLS_PER_SAMPLE calls replayed from one CUDA graph between two CUDA events, divided by
    the count ("cuda-graph"): the device time of the kernels as the studio's compiled, graph-captured UNet pays
    it. (Events around a single eager call also count the host's dispatch and launch, ~30 us, which for the
    small cross-attention shapes is ten times the kernel: on 2026-12-06 that timing suggested routing SDXL's
    cross-attention to the efficient kernel, and in the pipeline's own profile it cost 42.7 ms per image against
    cuDNN's 6.2.) A backend that cannot be captured is timed as CALLS_PER_SAMPLE eager calls queued back to back
    ("stream"). On the CPU: perf_counter around one call ("wall")."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        n = CALLS_PER_SAMPLE
        graph = _graph_of(fn, n, device)
        run = graph.replay if graph is not None else (lambda: [fn() for _ in range(n)])
        run()
        torch.cuda.synchronize(device)
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) / n)
        return statistics.median(samples), "cuda-graph" if graph is not None else "stream"
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), "wall"


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-12))


# A row names its dtype as torch prints it. (Until 2026-12-05 the names were rewritten with str.replace, which
# turned "bfloat16" into "bfp16", matched nothing and fell back to float32: every bf16 shape, SDXL's all, was
# timed in fp32, where flash and cuDNN attention have no kernel.)
ROW_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def row_dtype(row: dict) -> torch.dtype:
    try:
        return ROW_DTYPES[row["dtype"]]
    except KeyError:
        raise ValueError(f"attention shape with dtype {row['dtype']!r}: bench.sdpa times "
                         f"{', '.join(ROW_DTYPES)}") from None


def time_shape(row: dict, device: torch.device, iters: int, seed: int = 0) -> dict:
    """Each backend (and the default choice) on one shape: ms, relative error vs fp32 math, or why not."""
    from torch.nn.attention import sdpa_kernel

    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = row_dtype(row)
    shape_q = (row["batch"], row["heads"], row["q_len"], row["head_dim"])
    shape_k = (row["batch"], row["heads"], row["k_len"], row["head_dim"])
    shape_v = (row["batch"], row["heads"], row["k_len"], row["v_dim"])
    q, k, v = (torch.randn(s, generator=g).to(device, dtype) for s in (shape_q, shape_k, shape_v))
    with sdpa_kernel([_backend_enum("math")]):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    out: dict = {}
    for name in ("default",) + BACKENDS:
        ctx = contextlib.nullcontext() if name == "default" else sdpa_kernel([_backend_enum(name)])
        try:
            with ctx, torch.no_grad():
                got = F.scaled_dot_product_attention(q, k, v)
                ms, how = _time(lambda: F.scaled_dot_product_attention(q, k, v), device, iters)
            out[name] = {"ms": round(ms, 5), "rel_err": _rel_err(got, ref), "timing": how}
        except RuntimeError as exc:           # "No available kernel": PyTorch's reasons are in the warnings
            out[name] = {"unavailable": str(exc).strip().splitlines()[0][:300]}
    return out


def pick(row: dict, times: dict) -> dict:
    """The fastest backend whose error is at most 2x the default's (+1e-4), and its saving per image."""
    default = times.get("default", {})
    if "ms" not in default:
        return {"best": None}
    budget = 2 * default["rel_err"] + 1e-4
    ok = [(t["ms"], n) for n, t in times.items() if n != "default" and "ms" in t and t["rel_err"] <= budget]
    if not ok:
        return {"best": "default", "saving_ms_per_image": 0.0}
    ms, name = min(ok)
    saving = max(0.0, default["ms"] - ms) * row["calls_per_image"]
    return {"best": name, "best_ms": ms, "default_ms": default["ms"], "saving_ms_per_image": round(saving, 4)}


ROUTE_MIN_GAIN = 0.03     # a route must take 3 % off its part's attention time: less is within the timing noise


def _route_part(row: dict) -> str | None:
    """The ATELIER_SDPA_ROUTE part a recorded shape belongs to: UNet self-attention (keys are the queries' own
    tokens: as long as the queries), UNet cross-attention (keys from the text: another length), the VAE's."""
    if row["part"] == "unet":
        return "self" if row["k_len"] == row["q_len"] else "cross"
    if row["part"].startswith("vae"):
        return "vae"
    return None


def suggest_route(facts: dict) -> dict:
    """The ATELIER_SDPA_ROUTE value for a workload: per route part, the one backend (or PyTorch's default) with
    the least total time per image over that part's shapes, counting only backends that ran every shape of the
    part within pick()'s error budget. A route takes one backend for all shapes of a part, so its saving can be
    below the fastest-per-shape figure; a part is routed only when that takes ROUTE_MIN_GAIN of its time.
    {"value": "" ...} when the default is best (or as good) everywhere."""
    parts: dict[str, list[dict]] = {}
    for r in facts.get("shapes", []):
        part = _route_part(r)
        if part and r.get("times") and "ms" in (r["times"].get("default") or {}):
            parts.setdefault(part, []).append(r)
    chosen: dict[str, dict] = {}
    for part, rows in parts.items():
        totals: dict[str, float] = {}
        for name in ("default",) + BACKENDS:
            total = 0.0
            for r in rows:
                t, d = r["times"].get(name) or {}, r["times"]["default"]
                if "ms" not in t or t["rel_err"] > 2 * d["rel_err"] + 1e-4:
                    break
                total += t["ms"] * r["calls_per_image"]
            else:
                totals[name] = total
        best = min(totals, key=lambda n: (totals[n], n != "default"))
        if best != "default" and totals["default"] - totals[best] >= ROUTE_MIN_GAIN * totals["default"]:
            chosen[part] = {"backend": best, "saving_ms_per_image": round(totals["default"] - totals[best], 4)}
    value = ",".join(f"{p}={c['backend']}" for p, c in sorted(chosen.items()))
    return {"value": value, "parts": chosen,
            "saving_ms_per_image": round(sum(c["saving_ms_per_image"] for c in chosen.values()), 4)}


def run(workloads: list[str], device: torch.device, iters: int, out: Path | None) -> dict:
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workloads": []}
    for name in workloads:
        facts, rows = workload_shapes(name, device)
        for row in rows:
            if row["masked"]:
                row["times"] = None
                row["note"] = "masked (causal text encoder): not timed"
                continue
            row["times"] = time_shape(row, device, iters)
            row.update(pick(row, row["times"]))
        facts["shapes"] = rows
        facts["saving_ms_per_image"] = round(sum(r.get("saving_ms_per_image") or 0.0 for r in rows), 4)
        facts["route"] = suggest_route(facts)
        report["workloads"].append(facts)
        print_table(facts)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report


def print_table(facts: dict) -> None:
    print(f"== {facts['workload']} ({facts['precision']}, {facts['steps']} steps): per-image saving if each shape "
          f"used its fastest backend: {facts['saving_ms_per_image']:.3f} ms")
    print(f"{'part':<14}{'B':>3}{'H':>4}{'Lq':>7}{'Lk':>7}{'D':>5}{'calls/img':>10}  "
          + "".join(f"{b:>11}" for b in ("default",) + BACKENDS) + "   best")
    for r in facts["shapes"]:
        cells = []
        for b in ("default",) + BACKENDS:
            t = (r.get("times") or {}).get(b)
            cells.append(f"{t['ms']:>11.4f}" if t and "ms" in t else f"{'-':>11}")
        print(f"{r['part']:<14}{r['batch']:>3}{r['heads']:>4}{r['q_len']:>7}{r['k_len']:>7}{r['head_dim']:>5}"
              f"{r['calls_per_image']:>10}  " + "".join(cells) + f"   {r.get('best') or r.get('note', '')}")
    route = facts.get("route") or {}
    if route.get("value"):
        print(f"route: ATELIER_SDPA_ROUTE={route['value']} saves {route['saving_ms_per_image']:.3f} ms per image "
              "here (A/B it in the bench: scripts/h200_diffusion.sh envab)")
    elif route:
        print("route: none (PyTorch's default is the fastest backend for every route part)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="sd15-512,sdxl-1024,sd-turbo-512",
                    help="comma-separated diffusion workloads (bench list)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per backend and shape (median)")
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    args = ap.parse_args(argv)
    run([w.strip() for w in args.workloads.split(",") if w.strip()], torch.device(args.device), args.iters, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
