"""Command-line options shared by `generate` and `bench`."""
from __future__ import annotations

import argparse

from core.types import OptimizationFlags


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (`--batch-size 0` is an error, not the default)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1; got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {v}")
    return v


def add_optimization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizations")
    g.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default="fp32",
                   help="fp32 reference; tf32 matmuls; fp16/bf16 via AMP autocast")
    g.add_argument("--channels-last", action="store_true", help="NHWC memory format for convolutions")
    g.add_argument("--attention", choices=["sdpa", "xformers", "math"], default="sdpa")
    g.add_argument("--compile", choices=["off", "default", "reduce-overhead"], default="off",
                   help="torch.compile; reduce-overhead adds CUDA graphs")
    g.add_argument("--fp8", action="store_true", help="FP8 linear layers (Hopper/Ada GPUs)")
    g.add_argument("--fuse-qkv", action="store_true",
                   help="diffusion: fuse each attention layer's Q/K/V projections into one matrix product")
    g.add_argument("--request-graph", action="store_true",
                   help="diffusion on a GPU: record each request (text encoder, all steps, VAE) as one CUDA graph")
    g.add_argument("--tiny-vae", action="store_true",
                   help="diffusion: decode (and preview) with the tiny autoencoder TAESD/TAESDXL: faster, softer "
                        "detail (weights: ATELIER_TINY_VAE / ATELIER_TINY_VAE_XL, default madebyollin/taesd[xl])")
    g.add_argument("--prune", type=float, default=0.0, metavar="AMOUNT", help="fraction of weights/channels to prune")
    g.add_argument("--prune-method", choices=["l1-unstructured", "structured"], default="l1-unstructured")
    g.add_argument("--tensorrt", action="store_true", help="run through a TensorRT engine")
    g.add_argument("--memory", action="append", default=[],
                   choices=["attention-slicing", "vae-tiling", "vae-slicing", "cpu-offload"],
                   help="memory savers (repeatable)")
    g.add_argument("--kernels", default="auto", metavar="SPEC",
                   help="StyleGAN op implementations: auto (fused Triton kernels on a CUDA GPU), reference, "
                        "or knob:choice pairs joined by '/' (e.g. fir:triton/up:subpixel-fused)")
    g.add_argument("--strict", action="store_true", help="fail instead of skipping a toggle that cannot run here")


def flags_from_args(a: argparse.Namespace) -> OptimizationFlags:
    return OptimizationFlags(precision=a.precision, channels_last=a.channels_last, attention=a.attention,
                             compile=a.compile, fp8=a.fp8, prune_amount=a.prune, prune_method=a.prune_method,
                             tensorrt=a.tensorrt, memory=tuple(a.memory), kernels=a.kernels, strict=a.strict,
                             fuse_qkv=a.fuse_qkv, request_graph=a.request_graph, tiny_vae=a.tiny_vae)
