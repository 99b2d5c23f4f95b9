"""First look at the GPU machine: our StyleGAN code on CUDA vs the CPU references, and eager timings.

python3 scripts/gpu_smoke.py --out $OUT/smoke.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch


def cuda_time(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="smoke.json")
    ap.add_argument("--testdata", default="shared/testdata/stylegan")
    a = ap.parse_args()
    res = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from models.stylegan import load_generator, build_generator

    td = Path(a.testdata)
    for name in ("sg2_uncond_32", "sg2_cond4_64_fp16", "sg3t_uncond_32", "sg3r_uncond_32"):
        pkl = td / f"{name}.pkl"
        if not pkl.exists():
            res[name] = "missing"
            continue
        G = load_generator(pkl, device="cuda").G
        ref = np.load(td / f"{name}_ref.npz")
        errs = {}
        for k in ref.files:
            s = int(k.split("_")[0][4:]); psi = float(k.split("_psi")[1])
            z = torch.from_numpy(np.random.RandomState(s).randn(1, G.z_dim).astype(np.float32)).cuda()
            c = torch.zeros(1, G.c_dim, device="cuda")
            if G.c_dim:
                c[0, s % G.c_dim] = 1
            with torch.no_grad():
                extra = {"force_fp32": True} if "force_fp32" in inspect.signature(G.forward).parameters else {}
                out = G(z, c, truncation_psi=psi, noise_mode="const", **extra).float().cpu().numpy()[0]
            errs[k] = float(np.linalg.norm(out - ref[k]) / np.linalg.norm(ref[k]))
        res[name] = {"max_rel_err_cuda_fp32": max(errs.values())}
        print(name, res[name], flush=True)

    # FFHQ-1024 configs with random weights: eager timings
    configs = {
        "stylegan2_1024": ("stylegan2", dict(z_dim=512, c_dim=0, w_dim=512, img_resolution=1024, img_channels=3,
                                              mapping_kwargs={"num_layers": 8}, channel_base=32768, channel_max=512,
                                              num_fp16_res=4, conv_clamp=256)),
        "stylegan3t_1024": ("stylegan3", dict(z_dim=512, c_dim=0, w_dim=512, img_resolution=1024, img_channels=3,
                                               mapping_kwargs={"num_layers": 2}, channel_base=32768, channel_max=512,
                                               num_fp16_res=4, conv_clamp=256)),
    }
    for name, (arch, kw) in configs.items():
        try:
            G = build_generator(arch, kw).cuda().eval().requires_grad_(False)
            r = {}
            for bs in (1, 32) if arch == "stylegan2" else (1,):
                z = torch.randn(bs, 512, device="cuda")
                with torch.no_grad():
                    if arch == "stylegan2":
                        r[f"fp32_forcefp32_b{bs}_ms"] = cuda_time(lambda: G(z, None, force_fp32=True), iters=10)
                    r[f"mixed_nvlabs_b{bs}_ms"] = cuda_time(lambda: G(z, None), iters=10)
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        r[f"bf16_autocast_b{bs}_ms"] = cuda_time(lambda: G(z, None), iters=10)
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            res[name] = r
        except Exception as exc:
            res[name] = f"error: {type(exc).__name__}: {exc}"
        print(name, res[name], flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
