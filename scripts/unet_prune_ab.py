"""One UNet step (the CFG batch) of a full and a structurally pruned UNet, each replayed from a CUDA graph, in one
process: a quick device-time A/B of what pruning removes before a full `python app.py bench` run (prune-25 against
best) is spent on it. Not a product benchmark: no scheduler, text encoder or VAE, no compile.

    python3 scripts/unet_prune_ab.py --model sd15 --amounts 0.25,0.5 --out ab.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def graphed_step_ms(unet, inputs, replays: int = 30, rounds: int = 5) -> list[float]:
    """Device ms of one UNet call, one value per round; a round is `replays` replays of one captured call
    (captured as bench.sdpa captures its attention calls: warm-up on a side stream, then the graph)."""
    from bench.sdpa import _graph_of

    dev = inputs["sample"].device
    with torch.no_grad():
        g = _graph_of(lambda: unet(**inputs), 1, dev)
    if g is None:
        raise RuntimeError("the UNet call could not be captured in a CUDA graph")
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / replays)
    del g
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sd15", help="a folder under assets/diffusion_configs (its unet/config.json)")
    ap.add_argument("--amounts", default="0.25,0.5")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg_path = ROOT / "assets" / "diffusion_configs" / a.model / "unet" / "config.json"
    if not cfg_path.is_file():
        known = sorted(p.parent.parent.name for p in (ROOT / "assets" / "diffusion_configs").glob("*/unet/config.json"))
        print(f"error: no UNet config for --model {a.model} (one of: {', '.join(known)})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: this A/B times CUDA graphs and needs a CUDA GPU", file=sys.stderr)
        return 2
    from diffusers import UNet2DConditionModel

    import optim
    from core.types import OptimizationFlags
    from optim.prune import unet_probe_inputs

    dev = torch.device("cuda")
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    cfg = json.loads(cfg_path.read_text())
    torch.manual_seed(0)
    full = UNet2DConditionModel.from_config(cfg).eval().requires_grad_(False).to(dev)
    rows = []
    for amount in [0.0] + [float(x) for x in a.amounts.split(",") if x]:
        unet, report = full, {}
        if amount:
            unet, rep = optim.prepare(copy.deepcopy(full), OptimizationFlags(prune_amount=amount,
                                                                             prune_method="structured"), dev,
                                      kind="diffusion")
            report = {k: rep["prune"].get(k) for k in ("applied", "reason", "params_after", "flops", "drift")}
            if not report["applied"]:
                print(f"{a.model} prune {amount:.2f}: not pruned: {report['reason']}", flush=True)
                rows.append({"amount": amount, **report})
                continue
        unet = copy.deepcopy(unet).to(dtype).to(memory_format=torch.channels_last)
        inputs = unet_probe_inputs(unet, dev, batch=2)
        ms = graphed_step_ms(unet, inputs)
        rows.append({"amount": amount, "step_ms": statistics.median(ms), "rounds_ms": ms,
                     "params": sum(p.numel() for p in unet.parameters()), **report})
        print(f"{a.model} prune {amount:.2f}: {statistics.median(ms):.3f} ms per CFG step "
              f"({rows[-1]['params'] / 1e6:.0f} M params)" + (f"; FLOPs left {report['flops']['fraction_left']}, "
                                                              f"drift {report['drift']['psnr_db']} dB" if amount else ""),
              flush=True)
        del unet
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"model": a.model, "dtype": a.dtype, "gpu": torch.cuda.get_device_name(),
                                       "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
