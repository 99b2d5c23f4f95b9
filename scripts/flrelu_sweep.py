"""Tile and dot-precision sweep of the fused filtered_lrelu kernel over StyleGAN3-T-1024's 15 calls (H200).

For each call and input dtype, every tile config that fits (models/filtered_lrelu_triton.configs) is
timed (CUDA events, median of `--reps`) at each dot precision in `--precisions`, and its error is taken
against the fp32 kernel with tf32x3 dots (≈ fp32 accuracy, checked against float64 by
scripts/fir_kernels_check.py). Prints, per dtype and precision, the generator total at the autotuner's
own pick and at the fastest config of every call, and writes every row to --out (JSON).

    python3 scripts/flrelu_sweep.py --out $OUT/sweep.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import filtered_lrelu_triton as flt  # noqa: E402
from models import stylegan3 as sg3  # noqa: E402
from scripts.fir_kernels_check import sg3t_1024_calls, time_ms  # noqa: E402  (the bench's CUDA-event timer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sweep.json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--precisions", default="bfloat16:tf32/fp16/bf16,float32:tf32x3/tf32/fp16")
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    precs = {}
    for item in a.precisions.split(","):
        name, _, ps = item.partition(":")
        precs[getattr(torch, name)] = ps.split("/")
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    rows, saved = [], dict(flt.DOT_PRECISION)
    for call in sg3t_1024_calls():
        args = call["args"]
        if call["fd"] is not None and call["fd"].ndim != 1:
            continue
        g = torch.Generator(device="cpu").manual_seed(0)
        x32 = (torch.randn(*call["shape"], generator=g) * 2).to(dev)
        b32 = torch.randn(call["bias_channels"], generator=g).to(dev)
        fu, fd = (None if f is None else f.to(dev) for f in (call["fu"], call["fd"]))
        tu = 1 if fu is None else int(fu.shape[0])
        td = 1 if fd is None else int(fd.shape[0])
        kw = dict(up=args["up"], down=args["down"], padding=args["padding"], gain=args["gain"],
                  slope=args["slope"], clamp=args["clamp"])
        flt.DOT_PRECISION[torch.float32] = "tf32x3"
        with torch.no_grad():
            want = flt.filtered_lrelu(x32, fu, fd, b32, **kw).float()
        for dtype in dtypes:
            x, b = x32.to(dtype), b32.to(dtype)
            for prec in precs.get(dtype, ["tf32"]):
                flt.DOT_PRECISION[dtype] = prec
                try:
                    with torch.no_grad():
                        auto_ms = time_ms(lambda: flt.filtered_lrelu(x, fu, fd, b, **kw), a.reps)
                        best = getattr(flt._kernel(args["up"], args["down"], tu, td), "best_config", None)
                        per = []
                        for cfg in flt.configs(args["up"], args["down"], tu, td):
                            got = flt.filtered_lrelu(x, fu, fd, b, config=cfg, **kw)
                            err = ((got.float() - want).norm() / want.norm()).item()
                            ms = time_ms(lambda cfg=cfg: flt.filtered_lrelu(x, fu, fd, b, config=cfg, **kw), a.reps)
                            per.append({"config": list(cfg), "ms": ms, "rel_err": err})
                    rows.append({"layer": call["layer"], "shape": list(call["shape"]), "up": args["up"],
                                 "down": args["down"], "taps": [tu, td], "dtype": str(dtype)[6:], "precision": prec,
                                 "auto_ms": auto_ms, "auto_tile": str(best), "configs": per})
                    fast = min(per, key=lambda r: r["ms"])
                    print(f"{call['layer']:<12} {str(call['shape']):<20} up{args['up']} d{args['down']} taps {tu}/{td} "
                          f"{str(dtype)[6:]:<9} {prec:<7} auto {auto_ms:7.3f}  fastest {fast['ms']:7.3f} "
                          f"{fast['config']}  err {fast['rel_err']:.1e}", flush=True)
                except Exception as e:                           # noqa: BLE001 - record and go on
                    rows.append({"layer": call["layer"], "dtype": str(dtype)[6:], "precision": prec,
                                 "error": f"{type(e).__name__}: {e}"[:400]})
                    print(f"{call['layer']} {dtype} {prec} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                finally:
                    flt.DOT_PRECISION.clear()
                    flt.DOT_PRECISION.update(saved)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    totals = {}
    for r in rows:
        if "error" in r:
            continue
        k = f"{r['dtype']} {r['precision']}"
        t = totals.setdefault(k, [0.0, 0.0, 0.0])
        t[0] += r["auto_ms"]
        t[1] += min(c["ms"] for c in r["configs"])
        t[2] = max(t[2], max(c["rel_err"] for c in r["configs"]))
    for k, (auto, fast, err) in totals.items():
        print(f"generator total {k:<18} autotuned {auto:7.3f} ms  fastest-per-call {fast:7.3f} ms  max rel err {err:.1e}")
    Path(a.out).write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
