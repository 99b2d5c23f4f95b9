"""Check and time the Triton FIR kernels against the reference ops on a GPU (one command, < 3 min).

    python3 scripts/fir_kernels_check.py --out fir.json
    python3 scripts/fir_kernels_check.py --fused-only --out fused.json   # only part 3 (+ part 4)
    python3 scripts/fir_kernels_check.py --smoke --out smoke.json        # CPU, Triton interpreter, tiny shapes
    python3 scripts/fir_kernels_check.py --compile-only                  # part 4 alone, no GPU needed

1. correctness: models.fir_triton.fir1d against ops.upfirdn2d (float64 reference) for up/down/pad
   cases in fp32, bf16 and fp16, NCHW and channels_last; StyleGAN2/3 filtered ops on real layer
   shapes; whole tiny generators with each kernel choice against the reference ops;
2. timing (CUDA events, median): StyleGAN3-T 1024's largest filtered_lrelu and StyleGAN2-1024's
   largest blur, reference vs triton vs shifts (compiled), in bf16, with the bytes each must move
   and the bandwidth that implies;
3. StyleGAN3's fused filtered_lrelu (models/filtered_lrelu_triton.py): every filtered_lrelu call of
   StyleGAN3-T-1024 at batch 1 (shapes from the config), fused kernel (autotuned; fp32 also with
   "ieee" FMA dots) against the four 1-D Triton passes (fir:triton-1d) and the nc1 reference, in fp32
   and bf16: CUDA-event median ms, relative error against float64, the tile the autotuner picked,
   the bytes a one-read/one-write kernel must move, and the per-generator sums;
4. the fused kernel compiled for sm_90 (no GPU needed): registers, spills, shared memory, MMA kind.

--smoke runs 1-3 on the CPU in Triton's interpreter at tiny shapes (host-clock times mean nothing
there) and 4 for the first config of each case: every code path of the GPU run, in about a minute.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:                 # Triton reads it when imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from models import fir_triton, ops  # noqa: E402
from models import stylegan3 as sg3  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_ms(fn, reps: int = 30, dev=None) -> float:
    """Median CUDA-event milliseconds of `fn` after 3 warm-up calls (the bench's own timer; host clock on the CPU)."""
    from bench.measure import device_times_ms, median

    dev = torch.device("cuda") if dev is None else torch.device(dev)
    for _ in range(3 if dev.type == "cuda" else 0):
        fn()
    times, _ = device_times_ms(lambda _x: fn(), [None] * reps, dev)
    return median(times)


def correctness(dev, smoke: bool = False) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(1, 1, 4, 2, 1), (2, 1, 4, 2, 1), (1, 2, 4, 1, 1), (2, 1, 12, 6, 5), (1, 2, 12, 0, 0), (2, 2, 12, 5, 4)]
    shape = (1, 2, 15, 17) if smoke else (2, 16, 37, 41)
    for up, down, T, p0, p1 in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for cl in (False, True):
                x = torch.randn(*shape, generator=g).to(dev)
                f = torch.randn(T, generator=g).to(dev)
                with ops.use_impl(fir="grouped"):
                    want = ops.upfirdn2d(x.double(), f.double(), up=up, down=down, padding=[p0, p1, p0, p1], gain=1.3)
                xi = x.to(dtype)
                if cl:
                    xi = xi.contiguous(memory_format=torch.channels_last)
                with ops.use_impl(fir="triton"), torch.no_grad():
                    got = ops.upfirdn2d(xi, f, up=up, down=down, padding=[p0, p1, p0, p1], gain=1.3)
                # the input rounding alone costs about eps(dtype); allow 4x that
                tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
                e = rel(got, want)
                rows.append({"case": f"up{up} down{down} taps{T} pad{p0}/{p1}", "dtype": str(dtype)[6:],
                             "channels_last": cl, "rel_err": e, "ok": bool(e < tol and torch.isfinite(got).all())})
    return rows


def network_check(dev) -> list[dict]:
    from models.stylegan import build_generator
    from bench.specs import _SG2_TINY, _SG3T_TINY

    rows = []
    # TF32 is on by default for CUDA convolutions: it alone moves the image by ~3e-4 (an H200 run).
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    for arch, kw in (("stylegan2", _SG2_TINY), ("stylegan3", _SG3T_TINY)):
        torch.manual_seed(0)
        G = build_generator(arch, dict(kw, num_fp16_res=0)).to(dev).eval().requires_grad_(False)
        z = torch.randn(4, G.z_dim, device=dev)
        c = torch.zeros(4, G.c_dim, device=dev)
        with torch.no_grad():
            want = G(z, c, noise_mode="const")
            for impl in ({"fir": "triton"}, {"fir": "triton-1d"}, {"fir": "triton", "modconv": "auto"},
                         {"fir": "triton", "up": "subpixel-fused", "modconv": "auto"}, {"fir": "shifts"}):
                with ops.use_impl(**impl):
                    got = G(z, c, noise_mode="const")
                e = rel(got, want)
                rows.append({"arch": arch, "impl": impl, "rel_err": e, "ok": e < 1e-4})
    return rows


def compile_check(dev) -> list[dict]:
    """torch.compile(fullgraph=True) over the fused kernels: one graph, no recompiles, the eager numbers."""
    import torch._dynamo
    import torch._dynamo.testing
    from models import kernels
    from models.stylegan import build_generator
    from bench.specs import _SG2_TINY, _SG3T_TINY

    rows = []
    choice, _ = kernels.resolve("auto", dev, precision="bf16")
    for arch, kw in (("stylegan2", _SG2_TINY), ("stylegan3", _SG3T_TINY)):
        torch.manual_seed(0)
        G = build_generator(arch, dict(kw, num_fp16_res=0)).to(dev).eval().requires_grad_(False)
        z = torch.randn(2, G.z_dim, device=dev)
        c = torch.zeros(2, G.c_dim, device=dev)
        row = {"arch": arch, "impl": choice}
        try:
            with torch.no_grad(), ops.use_impl(**choice):
                want = G(z, c, noise_mode="const")
                cnt = torch._dynamo.testing.CompileCounterWithBackend("inductor")
                f = torch.compile(G, backend=cnt, fullgraph=True)
                for _ in range(3):
                    got = f(z, c, noise_mode="const")
            row.update(frames=cnt.frame_count, rel_err=rel(got, want), ok=cnt.frame_count == 1 and rel(got, want) < 1e-4)
        except Exception as e:  # report, do not stop the check
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800])
        torch._dynamo.reset()
        rows.append(row)
    return rows


def timings(dev) -> list[dict]:
    rows = []
    # StyleGAN3-T 1024's widest filtered_lrelu: 64 channels (bf16), 1044 -> up 2 -> 1044 (after down 2).
    for name, shape, up, down, T, pad in (("sg3 filtered_lrelu 64x532^2 up2/down2", (1, 64, 532, 532), 2, 2, 12, 11),
                                          ("sg3 filtered_lrelu 32x1044^2 up2/down2", (1, 32, 1044, 1044), 2, 2, 12, 11)):
        x = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        fu = sg3.design_lowpass_filter(T, 256, 128, 1024).to(dev)
        fd = fu.clone()
        b = torch.randn(shape[1], device=dev)
        args = dict(up=up, down=down, padding=[pad, pad, pad, pad], gain=math.sqrt(2), slope=0.2, clamp=256.0)
        with torch.no_grad():
            with ops.use_impl(fir="grouped"):
                want = sg3.filtered_lrelu(x.float(), fu, fd, b, **args)
            out = {}
            for kind in ("grouped", "triton"):
                def call(kind=kind):
                    with ops.use_impl(fir=kind):
                        return sg3.filtered_lrelu(x, fu, fd, b, **args)
                fn = call
                if kind == "shifts":
                    with ops.use_impl(fir="shifts"):
                        comp = torch.compile(lambda t: sg3.filtered_lrelu(t, fu, fd, b, **args), fullgraph=True)
                        comp(x)
                        fn = lambda: comp(x)  # noqa: E731
                out[kind] = (time_ms(fn), rel(fn(), want))
        n = x.numel()
        # bytes if each of the 4 passes reads and writes once (bf16): 1+2, 2+4, 4+2, 2+1 input sizes
        bytes_4pass = 2 * n * (3 + 6 + 6 + 3)
        for kind, (ms, e) in out.items():
            rows.append({"op": name, "impl": kind, "ms": ms, "rel_err_vs_fp32": e,
                         "GB_per_s_at_4pass_bytes": bytes_4pass / ms / 1e6})
    # StyleGAN2-1024's top blur: 32 channels 1024^2 -> 4-tap filter after the upsampling conv (NCHW and CL)
    for cl in (False, True):
        x = torch.randn(1, 32, 1027, 1027, device=dev, dtype=torch.bfloat16)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        f = ops.setup_filter([1, 3, 3, 1], device=dev)
        with torch.no_grad():
            want = ops.upfirdn2d(x.float(), f, gain=4)
            for kind in ("grouped", "triton", "separable"):
                def call(kind=kind):
                    with ops.use_impl(fir=kind):
                        return ops.upfirdn2d(x, f, gain=4)
                rows.append({"op": f"sg2 blur 32x1027^2 taps4 {'CL' if cl else 'NCHW'}", "impl": kind,
                             "ms": time_ms(call), "rel_err_vs_fp32": rel(call(), want)})
    return rows


# -- 3. the fused filtered_lrelu against the 1-D passes and the reference ---------------------------

def sg3t_1024_calls(smoke: bool = False) -> list[dict]:
    """Every filtered_lrelu call of StyleGAN3-T-1024 at batch 1, from the config (a meta-device build:
    no weights). The filters are redesigned from each layer's cutoffs, as the layer designs them."""
    from bench.specs import _SG3T_1024
    from models.stylegan import build_generator

    with torch.device("meta"):
        G = build_generator("stylegan3", dict(_SG3T_1024))
    calls = []
    for name in G.synthesis.layer_names:
        L = getattr(G.synthesis, name)
        size = L.in_size + L.conv_kernel - 1                       # the modulated conv's output
        fu = sg3.design_lowpass_filter(L.up_taps, L.in_cutoff, L.in_half_width * 2, L.tmp_sampling_rate)
        fd = sg3.design_lowpass_filter(L.down_taps, L.out_cutoff, L.out_half_width * 2, L.tmp_sampling_rate,
                                       radial=L.down_radial)
        channels = L.out_channels
        if smoke:                                                # same filters and paddings, tiny tensors
            channels, size = 2, min(size, 24 if L.up_factor == 2 else 16)
        calls.append(dict(layer=name, shape=(1, channels, size, size), fu=fu, fd=fd, bias_channels=channels,
                          args=dict(up=L.up_factor, down=L.down_factor, padding=list(L.padding), gain=L.act_gain,
                                    slope=L.act_slope, clamp=L.conv_clamp)))
    return calls


def _fused_bytes(shape, out_hw, elem: int) -> int:
    """What a one-read, one-write kernel must move: the input once and the output once."""
    n, c, h, w = shape
    return n * c * (h * w + out_hw[0] * out_hw[1]) * elem


def fused_check(dev, smoke: bool = False) -> dict:
    """Part 3: per call, per dtype, per implementation: ms, error against float64, bytes, the autotuned tile."""
    from models import filtered_lrelu_triton as flt

    rows = []
    reps = 2 if smoke else 30
    impls = (("nc1", "grouped", None), ("triton-1d", "triton-1d", None), ("fused", "triton", None),
             ("fused-ieee", "triton", "ieee"))
    for call in sg3t_1024_calls(smoke):
        shape, args = call["shape"], call["args"]
        g = torch.Generator(device="cpu").manual_seed(0)
        x32 = torch.randn(*shape, generator=g).to(dev) * 2
        b32 = torch.randn(call["bias_channels"], generator=g).to(dev)
        fu = None if call["fu"] is None else call["fu"].to(dev)
        fd = None if call["fd"] is None else call["fd"].to(dev)
        for dtype in (torch.float32, torch.bfloat16):
            x, b = x32.to(dtype), b32.to(dtype)
            with torch.no_grad():
                with ops.use_impl(fir="grouped"):
                    want = sg3.filtered_lrelu(x.double(), *(t.double() if t is not None else None for t in (fu, fd, b)),
                                              **args)
                for label, fir, precision in impls:
                    if precision is not None and dtype != torch.float32:
                        continue
                    saved = dict(flt.DOT_PRECISION)
                    if precision is not None:
                        flt.DOT_PRECISION[dtype] = precision
                    try:
                        def fn(fir=fir):
                            with ops.use_impl(fir=fir):
                                return sg3.filtered_lrelu(x, fu, fd, b, **args)
                        got = fn()
                        ms = time_ms(fn, reps=reps if label != "nc1" else max(2, reps // 3), dev=dev)
                        up, down = args["up"], args["down"]
                        tu = 1 if fu is None else fu.shape[0]
                        td = 1 if fd is None else fd.shape[0]
                        tile = None
                        if label.startswith("fused") and dev.type == "cuda":
                            best = getattr(flt._kernel(up, down, int(tu), int(td)), "best_config", None)
                            tile = str(best) if best is not None else None
                    finally:
                        flt.DOT_PRECISION.clear()
                        flt.DOT_PRECISION.update(saved)
                    nbytes = _fused_bytes(shape, got.shape[2:], x.element_size())
                    e = rel(got, want)
                    tol = 2e-6 if dtype == torch.float32 else 1.5e-2
                    rows.append({"layer": call["layer"], "shape": list(shape), "out": list(got.shape[2:]),
                                 "up": args["up"], "down": args["down"], "taps": [int(tu), int(td)],
                                 "radial": fd is not None and fd.ndim == 2, "dtype": str(dtype)[6:], "impl": label,
                                 "ms": ms, "rel_err_vs_fp64": e, "ok": bool(e < tol and torch.isfinite(got).all()),
                                 "fused_bytes": nbytes, "GB_per_s_at_fused_bytes": nbytes / ms / 1e6, "tile": tile})
    totals = {}
    for r in rows:
        key = f"{r['dtype']} {r['impl']}"
        totals[key] = totals.get(key, 0.0) + r["ms"]
    return {"rows": rows, "generator_total_ms": totals}


# -- 4. the fused kernel compiled for sm_90, without a GPU --------------------------------------------

def sm90_compile(first_only: bool = False) -> list[dict]:
    """Compile the fused kernel for every tile config of StyleGAN3's cases (PTX + cubin by the ptxas Triton
    bundles): what the GPU will run, its registers and spills, before any GPU time is spent."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from models import filtered_lrelu_triton as flt

    flt._flrelu_dot = JITFunction(flt._dot_body())     # the helper the kernel calls by name, compiled with it
    fn = JITFunction(flt._body())              # not triton.jit: that is the interpreter under TRITON_INTERPRET=1
    names = list(fn.arg_names)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []
    for case in ((2, 2, 12, 12), (4, 2, 24, 12), (1, 1, 1, 1)):
        cfgs = flt.configs(*case)
        for cfg in cfgs[:1] if first_only else cfgs:
            bi, bu, bo, vo, warps = cfg
            for dtype, precision in (("fp32", "tf32x3"), ("fp32", "ieee"), ("bf16", "tf32"), ("bf16", "fp16")):
                const = dict(UP=case[0], DOWN=case[1], TU=case[2], TD=case[3], HAS_BIAS=True, ACT=True, CLAMP=True,
                             PRECISION=precision, BI=bi, BU=bu, BO=bo, VO=vo)
                sig = {}
                for a in names:
                    if a in const:
                        sig[a] = "constexpr"
                    elif a.endswith("_ptr"):
                        sig[a] = f"*{dtype}" if a in ("x_ptr", "y_ptr") else "*fp32"
                    else:
                        sig[a] = "fp32" if a in ("slope", "gain", "clamp") else "i32"
                row = {"case": list(case), "config": list(cfg), "dtype": dtype, "precision": precision}
                try:
                    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
                    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
                    ptx = k.asm["ptx"]
                    row["mma"] = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma")
                    if cuobjdump.exists():
                        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                            f.write(k.asm["cubin"])
                            f.flush()
                            usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True,
                                                   text=True).stdout
                        m = re.search(r"REG:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", usage, re.S)
                        if m:
                            row.update(registers=int(m[1]), static_shared=int(m[2]), local_spill_bytes=int(m[3]))
                    row["dynamic_shared"] = int(k.metadata.shared)
                    row["ok"] = row.get("local_spill_bytes", 0) == 0
                except Exception as e:  # report, do not stop the check
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                rows.append(row)
    return rows


def sm90_compile_clean(first_only: bool) -> list[dict]:
    """Part 4 in a fresh interpreter without TRITON_INTERPRET (the interpreter's patches of triton.language
    break the real compiler within one process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "compile.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-only", "--out", str(out)]
        proc = subprocess.run(cmd + (["--first-only"] if first_only else []), env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return [{"ok": False, "case": None, "config": None, "dtype": None, "precision": None,
                     "error": (proc.stderr or proc.stdout)[-800:]}]
        return json.loads(out.read_text())["sm90_compile"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fir.json")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 (no timings)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes: every code path")
    ap.add_argument("--fused-only", action="store_true", help="only part 3 (the fused filtered_lrelu A/B) and 4")
    ap.add_argument("--compile-only", action="store_true", help="only part 4 (sm_90 compile; no GPU needed)")
    ap.add_argument("--first-only", action="store_true", help="with --compile-only: the first config of each case")
    a = ap.parse_args()
    report = {"torch": torch.__version__}
    if a.compile_only:
        report["sm90_compile"] = sm90_compile(first_only=a.first_only)
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
        _print_compile(report["sm90_compile"])
        return
    dev = torch.device("cpu" if a.smoke else a.device)
    why = fir_triton.unavailable_reason(dev)
    if why:
        sys.exit(f"cannot run: {why}")
    report["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)"
    if dev.type == "cuda":
        # TF32 off: the fp32 rows compare against float64, and the nc1 reference must run true fp32.
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    checks = []
    if not a.fused_only:
        report["correctness"] = correctness(dev, smoke=a.smoke)
        report["network"] = network_check(dev)
        report["compile"] = compile_check(dev) if dev.type == "cuda" else []
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
        report["timings"] = timings(dev) if dev.type == "cuda" else []
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
        checks = report["correctness"] + report["network"] + report["compile"]
    report["fused"] = fused_check(dev, smoke=a.smoke)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    report["sm90_compile"] = sm90_compile_clean(first_only=a.smoke)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    checks = checks + report["fused"]["rows"] + report["sm90_compile"]
    bad = [r for r in checks if not r["ok"]]
    print(f"correctness: {len(checks) - len(bad)} ok, {len(bad)} failed")
    for r in report.get("compile", []):
        print("  compile", r)
    for r in bad:
        print("  FAILED", {k: v for k, v in r.items() if k not in ("fu", "fd")})
    for r in report.get("timings", []):
        print(f"  {r['op']:<44} {r['impl']:<10} {r['ms']:8.3f} ms  rel err {r['rel_err_vs_fp32']:.1e}"
              + (f"  {r['GB_per_s_at_4pass_bytes']:.0f} GB/s" if "GB_per_s_at_4pass_bytes" in r else ""))
    print("  StyleGAN3-T-1024 filtered_lrelu, batch 1" + (" (smoke: tiny shapes, host clock)" if a.smoke else ""))
    for r in report["fused"]["rows"]:
        print(f"  {r['layer']:<13} {str(r['shape']):<20} up{r['up']}/down{r['down']} {r['dtype']:<9} {r['impl']:<10} "
              f"{r['ms']:9.3f} ms  rel err {r['rel_err_vs_fp64']:.1e}  {r['GB_per_s_at_fused_bytes']:7.0f} GB/s"
              + (f"  {r['tile']}" if r["tile"] else ""))
    for key, ms in report["fused"]["generator_total_ms"].items():
        print(f"  generator total {key:<22} {ms:9.3f} ms")
    _print_compile(report["sm90_compile"])


def _print_compile(rows: list[dict]) -> None:
    for r in rows:
        print(f"  sm_90 {r['case']} {r['config']} {r['dtype']}/{r['precision']}: "
              + (f"{r.get('mma')} regs {r.get('registers')} spill {r.get('local_spill_bytes')} B "
                 f"smem {r.get('dynamic_shared')} B" if r["ok"] or "error" not in r else r["error"]))


if __name__ == "__main__":
    main()
