"""Which op implementations a StyleGAN generator runs with (the `kernels` optimization setting).

`models.ops` computes every resampling op several ways (IMPL_CHOICES); they give the same numbers
and differ only in speed. This module turns the user-facing setting into a choice per knob:

    auto       the fastest measured choice for the device and mode (below)
    reference  the plain-PyTorch reference ops (what NVlabs' reference code computes, op by op)
    a spec     knob:choice pairs joined by '/', e.g. "fir:triton/up:subpixel-fused/modconv:auto";
               knobs left out keep their reference choice

`auto` on a CUDA GPU with Triton (measured on an H200, docs/benchmarks.md):
    fir      triton          the FIR blurs and up/downsampling as one-pass Triton kernels, StyleGAN3's
                             filtered leaky ReLU as one fused kernel per output tile (eager and
                             compiled); fir:triton-1d runs it as four 1-D passes instead (A/B)
    up       subpixel-fused  each upsampling conv and its FIR folded into one dense conv (not in
                             fp32 with TF32 off: there cuDNN picks FFT convolutions for it)
    modconv  auto            fused per-sample weights at batch 1, modulated activations above;
                             compiled fp16/bf16: activations-nhwc (modulated activations at every
                             batch; StyleGAN3's convs channels-last on channels padded to 8)
On the CPU `auto` is the reference: it is what the tests check against NVlabs' pickles, and the
CPU has no faster path for these ops.
"""
from __future__ import annotations

import torch

from core.errors import InputError
from models import fir_triton, ops

KERNEL_CHOICES = ("auto", "reference")

_AUTO_CUDA = {"fir": "triton", "up": "subpixel-fused", "modconv": "auto"}


def parse(spec: str) -> dict[str, str] | str:
    """'auto' / 'reference' as they are, or a knob spec as {knob: choice}; InputError when malformed."""
    spec = (spec or "auto").strip()
    if spec in KERNEL_CHOICES:
        return spec
    out: dict[str, str] = {}
    for part in spec.split("/"):
        knob, sep, choice = part.strip().partition(":")
        if not sep or knob not in ops.IMPL_CHOICES or choice not in ops.IMPL_CHOICES[knob]:
            known = "; ".join(f"{k}: {', '.join(v)}" for k, v in ops.IMPL_CHOICES.items() if k != "grad")
            raise InputError(f"kernels must be auto, reference, or knob:choice pairs joined by '/' "
                             f"(e.g. fir:triton/up:subpixel-fused); got {spec!r}. Knobs — {known}")
        out[knob] = choice
    return out


def resolve(spec: str, device: torch.device | str, compiled: bool = False,
            precision: str = "bf16") -> tuple[dict[str, str], str]:
    """(ops knob settings for `spec` on `device` and `precision`, a sentence saying what runs and why)."""
    device = torch.device(device)
    parsed = parse(spec)
    if parsed == "reference":
        return {}, "reference ops (plain PyTorch convolutions, as NVlabs' reference code computes them)"
    if parsed == "auto":
        if device.type != "cuda":
            return {}, f"reference ops: the fused kernels are for CUDA GPUs (here: {device.type})"
        choice = dict(_AUTO_CUDA)
        if compiled and precision in ("fp16", "bf16"):
            # Compiled half precision: modulated activations at every batch, StyleGAN3's convs
            # channels-last on channels padded to 8 with the layout change fused into the modulation
            # (H200, batch 1: StyleGAN3-T 10.47 -> 9.82 ms, StyleGAN2 2.65 -> 2.57 ms in one run,
            # docs/benchmarks/runs/2026-12-02-g-599d463-*.jsonl).
            choice["modconv"] = "activations-nhwc"
        if precision == "fp32":
            # Without tensor cores cuDNN runs the larger folded up-convs as FFTs (an H200 run:
            # 97 ms and 65 GiB at 1024² against 14 ms for the plain transposed conv + FIR).
            choice.pop("up")
        why = fir_triton.unavailable_reason(device)
        if why is not None:
            choice.pop("fir")
            return choice, f"{describe(choice)} ({why})"
        fir_triton.ensure_registered()          # before torch.compile traces a call of the op
        return choice, describe(choice)
    choice = dict(parsed)
    if choice.get("fir") in ("triton", "triton-1d"):
        why = fir_triton.unavailable_reason(device)
        if why is not None:
            return choice, f"{describe(choice)}; fir:triton falls back to the reference here ({why})"
        fir_triton.ensure_registered()
    return choice, describe(choice)


def describe(choice: dict[str, str]) -> str:
    if not choice:
        return "reference ops"
    return "/".join(f"{k}:{v}" for k, v in choice.items())


# Training (`training/`): the ops must have gradients and second-order gradients (lazy R1 and path
# length), so the inference-only Triton FIR is out; what the conv double backward costs decides.
# Measured on the emoji64 trainer on an H200 (docs/training.md "Figures").
_TRAIN_AUTO_CUDA = {"grad": "gradfix", "up": "subpixel-fused", "down": "fused-s2d", "fir": "separable"}


def resolve_training(spec: str, device: torch.device | str, precision: str = "bf16",
                     tf32: bool = True) -> tuple[dict[str, str], str]:
    """(ops knob settings for a training run, a sentence saying what runs and why)."""
    device = torch.device(device)
    parsed = check_training(spec)
    if parsed == "reference":
        return {}, "reference ops"
    if parsed == "auto":
        if device.type != "cuda":
            return {}, f"reference ops (the training fast paths are measured on CUDA GPUs; here: {device.type})"
        choice = dict(_TRAIN_AUTO_CUDA)
        if precision == "fp32" and not tf32:
            # Without tensor cores cuDNN runs the folded convs as FFTs (see resolve above).
            choice.pop("up")
            choice.pop("down")
        return choice, describe(choice)
    return dict(parsed), describe(parsed)


def check_training(spec: str) -> dict[str, str] | str:
    """parse(spec), refusing what cannot train on any device (InputError); what a config validates."""
    parsed = parse(spec)
    if isinstance(parsed, dict) and parsed.get("fir") in ("triton", "triton-1d"):
        raise InputError(f"fir:{parsed['fir']} is inference-only (no gradients); for training use fir:separable, "
                         "fir:nc1 or fir:shifts")
    return parsed
