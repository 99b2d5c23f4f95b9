"""Check and time the Triton FIR kernels against the reference ops on a GPU (one command, < 2 min).

    python3 scripts/fir_kernels_check.py --out fir.json

1. correctness: models.fir_triton.fir1d against ops.upfirdn2d (float64 reference) for up/down/pad
   cases in fp32, bf16 and fp16, NCHW and channels_last; StyleGAN2/3 filtered ops on real layer
   shapes; whole tiny generators with each kernel choice against the reference ops;
2. timing (CUDA events, median): StyleGAN3-T 1024's largest filtered_lrelu and StyleGAN2-1024's
   largest blur, reference vs triton vs shifts (compiled), in bf16, with the bytes each must move
   and the bandwidth that implies.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import fir_triton, ops  # noqa: E402
from models import stylegan3 as sg3  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_ms(fn, reps: int = 30) -> float:
    """Median CUDA-event milliseconds of `fn` after 3 warm-up calls (the bench's own timer)."""
    from bench.measure import device_times_ms, median

    dev = torch.device("cuda")
    for _ in range(3):
        fn()
    times, _ = device_times_ms(lambda _x: fn(), [None] * reps, dev)
    return median(times)


def correctness(dev) -> list[dict]:
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(1, 1, 4, 2, 1), (2, 1, 4, 2, 1), (1, 2, 4, 1, 1), (2, 1, 12, 6, 5), (1, 2, 12, 0, 0), (2, 2, 12, 5, 4)]
    for up, down, T, p0, p1 in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for cl in (False, True):
                x = torch.randn(2, 16, 37, 41, generator=g).to(dev)
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
            for impl in ({"fir": "triton"}, {"fir": "triton", "modconv": "auto"},
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fir.json")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1 (no timings)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    why = fir_triton.unavailable_reason(dev)
    if why:
        sys.exit(f"cannot run: {why}")
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    report["correctness"] = correctness(dev)
    report["network"] = network_check(dev)
    report["compile"] = compile_check(dev) if dev.type == "cuda" else []
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    report["timings"] = timings(dev) if dev.type == "cuda" else []
    Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    checks = report["correctness"] + report["network"] + report["compile"]
    bad = [r for r in checks if not r["ok"]]
    print(f"correctness: {len(checks) - len(bad)} ok, {len(bad)} failed")
    for r in report["compile"]:
        print("  compile", r)
    for r in bad:
        print("  FAILED", r)
    for r in report["timings"]:
        print(f"  {r['op']:<44} {r['impl']:<10} {r['ms']:8.3f} ms  rel err {r['rel_err_vs_fp32']:.1e}"
              + (f"  {r['GB_per_s_at_4pass_bytes']:.0f} GB/s" if "GB_per_s_at_4pass_bytes" in r else ""))


if __name__ == "__main__":
    main()
