"""FP8 (Ada / Hopper): the large linear layers of a diffusion UNet as e4m3 matrix products.

Two scalings (ATELIER_FP8_SCALING):
- static (default): each selected Linear's input range is measured once, on a real request through the
  pipeline (two prompts, their empty negative prompt, 8 steps; `calibrate`), and fixed: scale = 2 × max |x| /
  448. The layer becomes a StaticFP8Linear: the input's quantization is one pointwise op (x / s, clamp,
  cast) that torch.compile fuses into whatever produced x, and the product is one cuBLAS FP8 GEMM with
  per-tensor scales (`torch._scaled_mm`), in the model's own dtype (fp16 or bf16). On the H200 it made
  SDXL 6 % faster than bf16 `best` (922 against 982 ms, 37.8 dB from fp32; run
  docs/benchmarks/runs/2026-12-03-d-8d45d28-sdxl-fp8static.jsonl).
- dynamic: torchao's float8 with one scale per row of the input, computed every call (an abs-max
  reduction, a scale and a cast per layer call). Measured slower than bf16 on the H200 (SDXL 1050 against
  991 ms, SD1.5 351 against 343), kept as the A/B reference.

It pays only under torch.compile and on large matrix products (shared/GPU.md: a 4096² MLP is
2× slower than bf16 eagerly, 1.1× faster compiled), so what is quantized is chosen twice:
- by role: layers whose product is small whatever their width stay bf16 (KEPT_BY_ROLE):
  cross-attention K/V project the 77 text tokens only, and the time / added-condition
  embeddings see one row per image;
- by size: a layer with fewer than `min_features()` input or output features stays bf16
  (640 static, 1024 dynamic, or ATELIER_FP8_MIN_FEATURES so a GPU run can compare thresholds).
Without --compile the report warns that FP8 will be slower. The report also says how much
of the UNet's work FP8 covers (`coverage`): FP8 can only speed up that share.

Never NaN: SDXL's empty negative prompt is exactly zeros (`force_zeros_for_empty_prompt`), and with
torchao's per-row scale (max |row| / 448) an all-zero row divided 0 by 0: NaN latents on the H200. The
dynamic path floors the row maximum at ACTIVATION_SCALE_LB (torchao's `activation_value_lb`); the static
path's scales are fixed positive numbers, and inputs beyond the calibrated range saturate at ±448·s
(clamped before the cast: e4m3 has no infinity, an unclamped overflow would be NaN).

Convolutions: torchao's FP8 convolution needs compute capability 10.0 (Blackwell) and the
mslk kernels package; elsewhere they stay in bf16, and the report says why. ATELIER_FP8_CONV=triton
(static scaling) runs the large 1×1 / 3×3 ones in this studio's own Triton kernel (optim/fp8_conv.py),
calibrated with the linears and, measured, only at the shapes where it beats cuDNN.

StyleGAN is not quantized: its convolutions are modulated (weights rebuilt per sample, so
there is no fixed weight to store in FP8) and its dense layers are 512 wide at most.

Under torch.compile the quantized layers trace into the UNet's one graph (no graph break:
tests hold it with fullgraph=True), and nothing in them syncs with the host (the scales are device
tensors), so CUDA graphs (reduce-overhead) capture them too. Dynamic path: in a bf16 UNet a quantized
Linear is left as it is (its weight becomes torchao's FP8 tensor); in any other dtype it sits behind
FP8Linear, which casts to bf16 and back and turns autocast off only where it is on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from core.errors import InputError
from core.types import OptimizationFlags
from optim.hardware import capability, has_package, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

# Both in_features and out_features must reach this. Why not 640: quantizing the input costs a pass over
# it (read bf16, write e4m3: 3-5 bytes per input element at ~3 TB/s), while the FP8 product saves 2·N FLOPs
# per input element, 0.58 fs each (1/788 - 1/1449 TFLOP/s, GPU.md): the number of rows (tokens) cancels, and
# even with both products at peak rate FP8 breaks even only at N ≈ 900-1400 output features. 640-wide
# outputs cannot gain, 1280-wide ones barely (a 4096² MLP gained 1.1× compiled). The same holds in SD1.5
# whatever the width: tokens × width² is constant (4096×320² = 1024×640² = 256×1280²), so a 640 filter
# adds products of the same size with half the N. ATELIER_FP8_MIN_FEATURES=640 / 320 lets a GPU run measure it.
FP8_MIN_FEATURES = 1024
# Static scaling (the default, below) has no per-call pass over the input: torch.compile fuses the cast into the
# producer, so the argument above does not hold and narrower layers can gain. Measured on the H200 (2026-12-03,
# docs/benchmarks/runs/2026-12-03-d-8d45d28-sdxl-fp8static.jsonl): SDXL with every linear >= 640 in FP8
# (98.8 % of its linear FLOPs) 922 ms against bf16 best 982. SD1.5 with every linear >= 320 tied (341 / 341 ms,
# run e): its layers are 320-1280 wide at 256-4096 tokens, GEMMs too small for FP8 to gain.
FP8_MIN_FEATURES_STATIC = 640
MIN_FEATURES_ENV = "ATELIER_FP8_MIN_FEATURES"
# A row's max |value| is floored here before the scale (max / 448) is taken: an all-zero row then
# quantizes to zeros instead of 0/0 = NaN. 1e-12 is torchao's own floor for float8 training
# (torchao.float8.float8_utils.EPS); any real activation row is far above it.
ACTIVATION_SCALE_LB = 1e-12
MIN_CAPABILITY = (8, 9)
CONV_MIN_CAPABILITY = (10, 0)
TORCHAO_MISSING = "FP8 needs torchao (pip install torchao)"
SIZE = "size filter"
MEASURED = "measured: faster unquantized at this shape"

# Linear layers kept in bf16 for what they compute, whatever their width: (role, name parts, why).
KEPT_BY_ROLE = (
    # attn2.to_kv: the same two projections after fuse_qkv (optim/fused_qkv.py) concatenated them
    ("cross-attention K/V", ("attn2.to_k", "attn2.to_v", "attn2.to_kv"),
     "they project the text embedding (77 tokens), a product too small to gain from FP8; SDXL's empty "
     "negative prompt is all zeros there"),
    ("time embeddings", ("time_embedding", "time_emb_proj", "add_embedding"),
     "one row per image: a matrix-vector product FP8 cannot speed up, and each call adds quantization kernels"),
)


def unavailable_reason(device: torch.device) -> str | None:
    cap = capability(device)
    if cap is None or cap < MIN_CAPABILITY:
        return f"FP8 needs compute capability 8.9 or newer (Ada/Hopper); {where(device)}"
    if not has_package("torchao"):
        return TORCHAO_MISSING
    return None


def min_features(env: dict[str, str] | None = None) -> int:
    """The size filter: ATELIER_FP8_MIN_FEATURES when set (read per call, not at import), else
    FP8_MIN_FEATURES_STATIC with static scaling (the default) and FP8_MIN_FEATURES with dynamic scaling."""
    raw = (os.environ if env is None else env).get(MIN_FEATURES_ENV, "").strip()
    if not raw:
        return FP8_MIN_FEATURES_STATIC if scaling(env) == "static" else FP8_MIN_FEATURES
    try:
        n = int(raw)
    except ValueError:
        raise InputError(f"{MIN_FEATURES_ENV} must be a whole number of features (e.g. 1024, 640 or 320); "
                         f"got {raw!r}") from None
    if n < 16:
        raise InputError(f"{MIN_FEATURES_ENV} must be at least 16 (the FP8 matrix product needs 16-wide tiles); got {n}")
    return n


def selects(module: torch.nn.Module, min_features: int = FP8_MIN_FEATURES) -> bool:
    """The size filter: a Linear large enough for FP8 to gain, with dims the FP8 GEMM accepts (multiples of 16)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    i, o = module.in_features, module.out_features
    return i >= min_features and o >= min_features and i % 16 == 0 and o % 16 == 0


def kept_role(name: str) -> str | None:
    """The KEPT_BY_ROLE role a layer name has (matched on whole dotted parts), or None."""
    dotted = f".{name}."
    for role, parts, _ in KEPT_BY_ROLE:
        if any(f".{p}." in dotted for p in parts):
            return role
    return None


@dataclass
class Selection:
    """Which Linears go to FP8 and, for the others, why not (reason -> layer names)."""

    fp8: list[str] = field(default_factory=list)
    kept: dict[str, list[str]] = field(default_factory=dict)

    @property
    def kept_count(self) -> int:
        return sum(len(v) for v in self.kept.values())


def select(module: torch.nn.Module, min_features: int = FP8_MIN_FEATURES) -> Selection:
    """Size filter first, then roles: a role is reported only for layers it kept out of FP8."""
    sel = Selection()
    for name, m in module.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        role = kept_role(name)
        if not selects(m, min_features):
            sel.kept.setdefault(SIZE, []).append(name)
        elif role is not None:
            sel.kept.setdefault(role, []).append(name)
        else:
            sel.fp8.append(name)
    return sel


class FP8Linear(torch.nn.Module):
    """A torchao-quantized Linear behind a dtype boundary: bf16 inside, the caller's dtype outside.

    Only for layers of a model that is not bf16 (a bf16 model's quantized Linears need no boundary).
    Traces without a graph break; where the input is already bf16 and autocast is off it adds nothing."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.inner = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self):                  # code that peeks at .weight (e.g. dtype checks) still finds one
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and not torch.is_autocast_enabled(x.device.type):
            return self.inner(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.inner(x.to(torch.bfloat16)).to(x.dtype)


def _swap(root: torch.nn.Module, fqn: str, new: torch.nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def fp8_config():
    """torchao's per-row float8 config with the activation-scale floor."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    # set_inductor_config=False: torchao's "recommended" settings are process-wide (coordinate-descent
    # tuning, TF32 matmuls via set_float32_matmul_precision) and would change every other cached pipeline,
    # the fp32 reference included.
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_SCALE_LB,
                                                     set_inductor_config=False)


def quantize_linears(module: torch.nn.Module, min_features: int = FP8_MIN_FEATURES) -> Selection:
    """Quantize the selected Linears of `module` in place; returns the selection."""
    from torchao.quantization import quantize_

    sel = select(module, min_features)
    config = fp8_config()
    for name in sel.fp8:
        lin = module.get_submodule(name)
        boundary = lin.weight.dtype != torch.bfloat16
        lin.to(torch.bfloat16)
        quantize_(lin, config)         # a bare Linear: the default filter takes it
        if boundary:
            _swap(module, name, FP8Linear(lin))
    return sel


# ---------------------------------------------------------------------------------------------
# Coverage: how much of the work FP8 can speed up


def linear_flops(module: torch.nn.Module, run: Callable[[], object]) -> tuple[dict[str, int], int]:
    """FLOPs of each Linear of `module` during `run()` (2 × rows × in × out), and all FLOPs torch's
    flop counter sees in that call (matmuls, convolutions; attention on CUDA only)."""
    from torch.utils.flop_counter import FlopCounterMode

    per_layer: dict[str, int] = {}

    def hook(name):
        def count(m, args, out):
            x = args[0]
            per_layer[name] = per_layer.get(name, 0) + 2 * (x.numel() // m.in_features) * m.in_features * m.out_features
        return count

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            run()
    finally:
        for h in handles:
            h.remove()
    return per_layer, int(counter.get_total_flops())


def coverage(sel: Selection, per_layer: dict[str, int], total: int) -> dict:
    """Shares of the Linear FLOPs (and of all counted FLOPs) in FP8 and in each kept group."""
    linear = sum(per_layer.values())
    if not linear:
        return {"linear_flops_in_fp8": 0.0}
    fp8 = sum(per_layer.get(n, 0) for n in sel.fp8)
    return {"linear_flops_in_fp8": round(fp8 / linear, 4),
            "unet_flops_in_fp8": round(fp8 / total, 4) if total else None,
            "linear_share_of_unet": round(linear / total, 4) if total else None,
            "kept_linear_flops": {k: round(sum(per_layer.get(n, 0) for n in v) / linear, 4) for k, v in sel.kept.items()}}


def _unet_flops(unet: torch.nn.Module, device: torch.device) -> dict:
    """The Linear FLOPs of one UNet pass (before quantizing: the layers as they run) and the notes that go with
    them, or {"error": ...}: a figure for the report only, never a reason to lose the toggle."""
    from optim.prune import unet_probe_inputs

    try:
        inputs = unet_probe_inputs(unet, device)
        per_layer, total = linear_flops(unet, lambda: unet(**inputs))
    except Exception as exc:
        return {"error": f"not measured ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"}
    size = int(unet.config.sample_size)           # unet_probe_inputs ran at it
    notes = {"measured_on": (f"one UNet pass at its {size}×{size} sample size, 77 text tokens (the shares do not "
                             "depend on the batch; at other resolutions the 77-token and per-image layers weigh "
                             "differently)")}
    if device.type != "cuda":
        notes["note"] = ("attention FLOPs are counted on CUDA only, so unet_flops_in_fp8 and linear_share_of_unet "
                         "are overstated here")
    return {"per_layer": per_layer, "total": total, "notes": notes}


def _coverage_report(sel: Selection, flops: dict) -> dict:
    if "error" in flops:
        return {"error": flops["error"]}
    return {**coverage(sel, flops["per_layer"], flops["total"]), **flops["notes"]}


# ---------------------------------------------------------------------------------------------
# The toggle


CONV_ENV = "ATELIER_FP8_CONV"
CONV_MODES = ("off", "triton")


def conv_mode(env: dict[str, str] | None = None) -> str:
    """'off' (default: convolutions stay in the model's dtype) or 'triton' (the UNet's large 1×1 and 3×3
    convolutions through optim.fp8_conv's FP8 kernel, where measured faster), from ATELIER_FP8_CONV."""
    raw = (os.environ if env is None else env).get(CONV_ENV, "").strip().lower() or "off"
    if raw not in CONV_MODES:
        raise InputError(f"{CONV_ENV} must be one of {', '.join(CONV_MODES)}; got {raw!r}")
    return raw


def _conv_note(device: torch.device) -> str:
    cap = capability(device)
    if cap is None or cap < CONV_MIN_CAPABILITY or not has_package("mslk"):
        here = f"this GPU is {cap[0]}.{cap[1]}" if cap else where(device)
        return ("convolutions stay bf16: torchao's FP8 convolution needs compute capability 10.0 (Blackwell) "
                f"and the mslk package; {here}; {CONV_ENV}=triton runs the large ones in this studio's own FP8 "
                "kernel (static scaling)")
    return "convolutions stay bf16: torchao's FP8 convolution is not enabled in this build"


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    reason = unavailable_reason(ctx.device)
    if reason:
        return skipped(reason)
    if target.kind == "stylegan":
        return skipped("StyleGAN is not quantized to FP8: its convolutions are modulated per sample (no fixed weight "
                       "to store in FP8) and its dense layers are too small to gain")
    if ctx.offloaded:
        return skipped("FP8 is not combined with model CPU offload here; turn off cpu-offload")
    unet = target.get("unet")
    threshold = min_features()
    source = MIN_FEATURES_ENV if os.environ.get(MIN_FEATURES_ENV, "").strip() else "default"
    planned = select(unet, threshold)
    if not planned.fp8:
        return skipped(f"no linear layer of this UNet is large enough for FP8 (size filter: in and out features "
                       f">= {threshold}); all left as they were", size_filter=threshold, size_filter_from=source)
    flops = _unet_flops(unet, ctx.device)                   # before quantizing: the layers as they run
    mode = scaling()
    convs: dict | None = None
    static_details: dict = {}
    if mode == "static":
        sel = planned
        if ctx.on_status is not None:
            ctx.on_status(f"calibrating FP8 scales ({len(planned.fp8)} layers, one short request)")
        tokens: dict[str, int] = {}
        convs = conv_candidates(unet, ctx.device) if conv_mode() == "triton" else None
        conv_names = list(convs["layers"]) if convs and "layers" in convs else []
        in_shapes: dict[str, tuple[int, ...]] = {}
        amax, how = calibrate(target, planned.fp8 + conv_names, ctx.device, tokens=tokens, shapes=in_shapes)
        conv_amax = {n: amax.pop(n) for n in conv_names}
        kept_extra: dict[str, list[str]] = {}
        selection = {"mode": "size"}
        if select_mode() == "measure":
            _, slower, selection = measured_selection(unet, planned.fp8, tokens, ctx.device)
            if slower:
                kept_extra[MEASURED] = slower
                amax = {k: v for k, v in amax.items() if k not in set(slower)}
        if not any(v == v for v in amax.values()) and kept_extra.get(MEASURED):
            return skipped(f"measured on this GPU, none of the {len(planned.fp8)} candidate layers' shapes is faster "
                           "in FP8 than unquantized (including the quantization pass); all left as they were",
                           scaling=mode, selection=selection, size_filter=threshold, size_filter_from=source)
        if convs is not None and conv_names:
            convs = quantize_convs_static(unet, conv_amax, in_shapes, ctx.device, measure=select_mode() == "measure")
        done = quantize_linears_static(unet, amax)
        left = [n for n in planned.fp8 if n not in set(done) and n not in set(kept_extra.get(MEASURED, []))]
        if left:
            kept_extra["not called while calibrating"] = left
        if kept_extra:
            sel = Selection(fp8=done, kept=dict(planned.kept, **kept_extra))
        seen = [v for v in amax.values() if v == v]
        static_details = {"calibration": how, "margin": STATIC_MARGIN, "selection": selection,
                          "input_max_range": [round(min(seen), 4), round(max(seen), 4)] if seen else None}
    else:
        sel = quantize_linears(unet, threshold)
    cover = _coverage_report(sel, flops)
    roles = {role: why for role, _, why in KEPT_BY_ROLE}
    roles[MEASURED] = ("timed on this GPU at its shape (M = 2 × tokens), the unquantized GEMM was faster than FP8 "
                       "plus the quantization pass (selection.shapes)")
    roles["not called while calibrating"] = "no input range was measured, so there is no scale to give it"
    kept = {k: {"layers": len(v), "why": roles.get(k, f"in or out features below {threshold}, or not a multiple of 16")}
            for k, v in sel.kept.items()}
    share = cover.get("linear_flops_in_fp8")
    details = {"component": "unet", "scaling": mode,
               "granularity": "per-tensor, static (calibrated once)" if mode == "static" else "per-row, dynamic",
               "size_filter": threshold, "size_filter_from": source,
               "fp8_layers": len(sel.fp8), "kept_bf16_layers": sel.kept_count, "kept_bf16": kept,
               "activation_scale_lb": ACTIVATION_SCALE_LB,
               "activation_scale": (f"per-row max |x| floored at {ACTIVATION_SCALE_LB:g} before the scale: an all-zero row "
                                    "(SDXL's empty negative prompt) quantizes to zeros, not 0/0 = NaN" if mode == "dynamic" else
                                    f"{STATIC_MARGIN:g} × the calibrated max |x| per layer, fixed: no per-call reduction, "
                                    "an all-zero row (SDXL's empty negative prompt) quantizes to zeros and larger inputs "
                                    "saturate, never NaN"),
               **static_details,
               "coverage": cover, "layers": sel.fp8,
               "convolutions": convs if mode == "static" and convs is not None else _conv_note(ctx.device),
               "other_components": "text encoders run once per image and the VAE has no large linears: unchanged"}
    if flags.compile == "off":
        details["warning"] = "without --compile FP8 is slower than bf16 (eager per-call quantization); add --compile default"
    covered = f"; they carry {share:.1%} of the UNet's linear FLOPs" if isinstance(share, float) else ""
    scales = "one calibrated scale per tensor" if mode == "static" else "per-row scales"
    conv_part = ""
    if mode == "static" and convs is not None and convs.get("fp8_layers"):
        conv_part = f" and {len(convs['fp8_layers'])} convolutions"
    return applied(f"{len(sel.fp8)} UNet linear layers{conv_part} in FP8 (e4m3, {scales}){covered}; "
                   f"{sel.kept_count} left as they were (see kept_bf16)", **details)


# ---------------------------------------------------------------------------------------------
# Static scaling: one scale per tensor, calibrated once, the quantization fused into the producer

SCALING_ENV = "ATELIER_FP8_SCALING"
SCALINGS = ("static", "dynamic")
E4M3_MAX = 448.0
# The calibrated max |x| of a layer's input is multiplied by this before it becomes the scale: a prompt
# that drives an activation higher than the calibration prompts did keeps one binade of headroom before
# it saturates at ±448 (e4m3 is floating point: the headroom costs no relative precision, only range at
# the small end, 2^-9 of the max instead of 2^-10).
STATIC_MARGIN = 2.0
CALIBRATION_PROMPTS = ("a photograph of an astronaut riding a horse on the moon, highly detailed",
                       "an oil painting of a red fox in a snowy forest at dusk")
CALIBRATION_STEPS = 8


def scaling(env: dict[str, str] | None = None) -> str:
    """'static' (default) or 'dynamic' (torchao per-row), from ATELIER_FP8_SCALING."""
    raw = (os.environ if env is None else env).get(SCALING_ENV, "").strip().lower() or "static"
    if raw not in SCALINGS:
        raise InputError(f"{SCALING_ENV} must be one of {', '.join(SCALINGS)}; got {raw!r}")
    return raw


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().float()
    scale = (w.abs().amax().clamp(min=ACTIVATION_SCALE_LB) / E4M3_MAX).reshape(())
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous(), scale


class StaticFP8Linear(torch.nn.Module):
    """y = x·Wᵀ + b with x and W in e4m3, one fixed scale each, as one `torch._scaled_mm` (per-tensor scales:
    cuBLAS's FP8 GEMM on Hopper, no per-call reduction over x).

    The input's quantization is a plain pointwise op (x / s, clamp to ±448, cast) that torch.compile fuses
    into whatever produced x (a LayerNorm, a GELU, the attention output's reshape): no extra pass over the
    activation, which is what made the dynamic per-row path slower than bf16. The result comes out in the
    model's own dtype (fp16 or bf16; fp32 models get the product in fp32 and the bias added after), so an
    fp16 model needs no dtype boundary. Out-of-range inputs saturate at ±448·s, never inf or NaN; an
    all-zero row gives the bias."""

    def __init__(self, linear: torch.nn.Linear, input_amax: float, margin: float = STATIC_MARGIN):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dev = linear.weight.device
        self.out_dtype = linear.weight.dtype
        wq, ws = _quantize_weight(linear.weight)
        x_scale = max(float(input_amax) * margin, ACTIVATION_SCALE_LB) / E4M3_MAX
        self.register_buffer("weight_fp8", wq)
        self.register_buffer("weight_scale", ws.to(dev))
        self.register_buffer("input_scale", torch.tensor(x_scale, dtype=torch.float32, device=dev))
        self.register_buffer("input_scale_inv", torch.tensor(1.0 / x_scale, dtype=torch.float32, device=dev))
        b = linear.bias
        self.half = self.out_dtype in (torch.float16, torch.bfloat16)     # cuBLAS adds the bias in fp16/bf16 only
        self.register_buffer("bias", None if b is None else b.detach().to(self.out_dtype if self.half else torch.float32))
        self.input_amax = float(input_amax)

    @property
    def weight(self):                  # code that peeks at .weight (dtype checks) finds the stored tensor
        return self.weight_fp8

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-tensor, "
                f"input max {self.input_amax:.4g}, out {self.out_dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        q = (x2.float() * self.input_scale_inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=self.input_scale, scale_b=self.weight_scale,
                             bias=self.bias if self.half else None, out_dtype=self.out_dtype)
        if self.half:
            return y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features).to(x.dtype)


def _record_amax(module: torch.nn.Module, names: list[str], tokens: dict[str, int] | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None):
    """Forward pre-hooks keeping each named layer's running max |input| as a device tensor (no host sync),
    in `tokens` the most rows per image it saw (the sequence length of a (batch, tokens, features) input),
    and in `shapes` the largest input shape it saw."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def seen(m, args):
            if shapes is not None:
                shapes[name] = max(shapes.get(name, ()), tuple(args[0].shape))
            if tokens is not None:
                x = args[0]
                t = int(x.shape[-2]) if x.dim() >= 3 else 1
                tokens[name] = max(tokens.get(name, 0), t)
            a = args[0].detach().abs().amax().float()
            prev = amax.get(name)
            amax[name] = a if prev is None else torch.maximum(prev, a)
        return seen

    handles = [module.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    return amax, handles


def calibrate(target: Target, names: list[str], device: torch.device, steps: int = CALIBRATION_STEPS,
              tokens: dict[str, int] | None = None,
              shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict[str, float], dict]:
    """Max |input| of each named UNet Linear over a real request: the pipeline itself, eager, with two prompts
    and its empty negative prompt (classifier-free guidance), `steps` denoising steps, latents out (the VAE
    is not run). A bare UNet (no pipeline given) is probed instead at timesteps across the schedule with the
    fixed random inputs of optim.prune.unet_probe_inputs. Returns (name -> max, how it was calibrated)."""
    import time

    unet = target.get("unet")
    amax, handles = _record_amax(unet, names, tokens, shapes)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            how: dict = {}
            if target.pipe is not None:
                pipe = target.pipe
                prev = getattr(pipe, "_progress_bar_config", None)
                pipe.set_progress_bar_config(disable=True)
                try:
                    pipe(prompt=list(CALIBRATION_PROMPTS), num_inference_steps=steps, output_type="latent",
                         generator=torch.Generator("cpu").manual_seed(0))
                    how = {"source": "pipeline", "prompts": list(CALIBRATION_PROMPTS), "steps": steps,
                           "guidance": "the pipeline's default (empty negative prompt)"}
                except Exception as exc:   # e.g. a pipeline without a tokenizer: calibrate on probe inputs instead
                    amax.clear()
                    how = {"pipeline_failed": f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"}
                finally:
                    if prev is None:
                        pipe.__dict__.pop("_progress_bar_config", None)
                    else:
                        pipe._progress_bar_config = prev
            if not how.get("source"):
                from optim.prune import unet_probe_inputs

                inputs = unet_probe_inputs(unet, device, batch=2)
                ts = [999, 750, 500, 250, 1][:max(1, steps)]
                for t in ts:
                    unet(**dict(inputs, timestep=torch.full((2,), t, dtype=torch.int64, device=device)))
                how.update(source="probe inputs (fixed random latents and text, no prompt)", timesteps=ts)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in amax]
    values = torch.stack([amax[n] for n in names if n in amax]).cpu().tolist() if len(missing) < len(names) else []
    out = dict(zip([n for n in names if n in amax], values))
    for n in missing:                  # never called in the calibration request: a scale from nothing would be 0
        out[n] = float("nan")
    how["seconds"] = round(time.perf_counter() - t0, 2)
    if missing:
        how["never_called"] = len(missing)
    return out, how


def quantize_linears_static(module: torch.nn.Module, amax: dict[str, float],
                            margin: float = STATIC_MARGIN) -> list[str]:
    """Swap each Linear named in `amax` for a StaticFP8Linear with that input max. A layer whose max is not a
    finite number (not seen during calibration) is left as it was. Returns the names swapped."""
    done = []
    for name, a in amax.items():
        if not (a == a) or a in (float("inf"), float("-inf")):
            continue
        _swap(module, name, StaticFP8Linear(module.get_submodule(name), a, margin))
        done.append(name)
    return done



# ---------------------------------------------------------------------------------------------
# Measured selection: FP8 only for the matrix shapes where it is faster on this GPU

SELECT_ENV = "ATELIER_FP8_SELECT"
SELECTS = ("measure", "size")
# FP8 is kept for a shape only if its GEMM plus the quantization pass is this much faster than the bf16 GEMM
SELECT_GAIN = 0.03
# The quantization pass, counted as if inductor could not fuse it (read 2 bytes, write 1 per input element)
# at this memory rate: conservative, so a kept shape gains even where the cast is a kernel of its own.
QUANT_BYTES_PER_ELEMENT = 3
HBM_BYTES_PER_S = 3.0e12


def select_mode(env: dict[str, str] | None = None) -> str:
    """'measure' (default): time each layer shape in bf16 and FP8 on the GPU and keep FP8 where it wins;
    'size': the size filter alone (ATELIER_FP8_SELECT)."""
    raw = (os.environ if env is None else env).get(SELECT_ENV, "").strip().lower() or "measure"
    if raw not in SELECTS:
        raise InputError(f"{SELECT_ENV} must be one of {', '.join(SELECTS)}; got {raw!r}")
    return raw


def shapes_of(module: torch.nn.Module, names: list[str], tokens: dict[str, int],
              rows_per_token: int = 2) -> dict[tuple[int, int, int], list[str]]:
    """(M, K, N) of each named Linear's product -> the layers with it. M = tokens per image × `rows_per_token`
    (2: one image with classifier-free guidance, the studio's usual call)."""
    out: dict[tuple[int, int, int], list[str]] = {}
    for n in names:
        if n not in tokens:
            continue
        lin = module.get_submodule(n)
        out.setdefault((tokens[n] * rows_per_token, lin.in_features, lin.out_features), []).append(n)
    return out


def quant_us(m: int, k: int) -> float:
    """Microseconds of an unfused quantization pass over an M×K input (QUANT_BYTES_PER_ELEMENT at HBM_BYTES_PER_S)."""
    return m * k * QUANT_BYTES_PER_ELEMENT / HBM_BYTES_PER_S * 1e6


def decide(times: dict[tuple[int, int, int], tuple[float, float]], gain: float = SELECT_GAIN) -> dict:
    """Per shape: FP8 if its GEMM plus the quantization pass beats the bf16 GEMM by `gain`.
    `times`: (M, K, N) -> (bf16 µs, FP8 µs)."""
    out = {}
    for (m, k, n), (t16, t8) in times.items():
        q = quant_us(m, k)
        out[(m, k, n)] = {"bf16_us": round(t16, 2), "fp8_us": round(t8, 2), "quant_us": round(q, 2),
                          "fp8": bool(t8 + q <= t16 * (1 - gain))}
    return out


def _graph_time_us(fn, calls: int = 10, reps: int = 7) -> float:
    """Median µs of one `fn()` call, replayed `calls` at a time from a CUDA graph (no launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the studio's metrics thread may query the device while this thread records
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def time_shape(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(bf16-or-fp16 GEMM µs, FP8 per-tensor _scaled_mm µs) of y = x·Wᵀ + b at this shape, on `device`."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, device=device, dtype=dtype, generator=g)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=device, dtype=torch.float32)
    with torch.no_grad():
        t16 = _graph_time_us(lambda: torch.nn.functional.linear(x, w, b))
        t8 = _graph_time_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, bias=b, out_dtype=dtype))
    return t16, t8


def measured_selection(unet: torch.nn.Module, names: list[str], tokens: dict[str, int],
                       device: torch.device) -> tuple[list[str], list[str], dict]:
    """Time every distinct layer shape on `device` and split `names` into (FP8, kept in the model's dtype,
    report). Needs CUDA and an fp16/bf16 model; elsewhere every name stays FP8 and the report says why."""
    dtype = next(unet.parameters()).dtype
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return list(names), [], {"mode": "size", "why": "the measured selection needs CUDA and an fp16/bf16 model"}
    import time

    t0 = time.perf_counter()
    groups = shapes_of(unet, names, tokens)
    try:
        verdict = decide({shape: time_shape(*shape, dtype, device) for shape in groups})
    except Exception as exc:   # a timing that cannot run must not cost the artist the toggle: the size filter decides
        return list(names), [], {"mode": "size", "why": f"the measured selection failed ({type(exc).__name__}: "
                                                        f"{' '.join(str(exc).split())[:160]}); the size filter decided"}
    fp8, kept, rows = [], [], []
    for shape, layers in sorted(groups.items()):
        v = verdict[shape]
        (fp8 if v["fp8"] else kept).extend(layers)
        rows.append({"m": shape[0], "k": shape[1], "n": shape[2], "layers": len(layers), **v})
    unseen = [n for n in names if n not in tokens]
    fp8.extend(unseen)                   # never called while calibrating: quantize_linears_static leaves them
    return fp8, kept, {"mode": "measure", "shapes": rows, "seconds": round(time.perf_counter() - t0, 2),
                       "rule": (f"FP8 where its GEMM + an unfused quantization pass ({QUANT_BYTES_PER_ELEMENT} bytes an "
                                f"input element at {HBM_BYTES_PER_S / 1e12:g} TB/s) beats the {str(dtype)[6:]} GEMM by "
                                f"{SELECT_GAIN:.0%}; M = 2 × tokens (one image with CFG); CUDA-graph timings")}


# ---------------------------------------------------------------------------------------------
# Convolutions in FP8 (ATELIER_FP8_CONV=triton): the studio's own kernel, optim/fp8_conv.py

def conv_candidates(unet: torch.nn.Module, device: torch.device, min_channels: int | None = None) -> dict:
    """The UNet's convolutions the FP8 kernel can take ({"layers": [...]}), or why none ({"why": ...})."""
    from optim import fp8_conv

    reason = fp8_conv.unavailable_reason(device)
    if reason:
        return {"why": reason}
    width = fp8_conv.MIN_CHANNELS if min_channels is None else min_channels
    names = [n for n, m in unet.named_modules()
             if isinstance(m, torch.nn.Conv2d) and fp8_conv.eligible(m, width) is None]
    if not names:
        return {"why": f"no convolution is 1×1 or 3×3 with both sides >= {width} channels"}
    return {"layers": names}


def time_conv(shape: tuple[int, int, int, int], conv: torch.nn.Conv2d, device: torch.device) -> tuple[float, float]:
    """(cuDNN convolution µs in the model's dtype, channels_last; the FP8 kernel's µs) at input `shape`."""
    from optim import fp8_conv

    dtype = conv.weight.dtype
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype, generator=g).to(memory_format=torch.channels_last)
    w = conv.weight.detach().to(memory_format=torch.channels_last)
    b = None if conv.bias is None else conv.bias.detach()
    q = fp8_conv.StaticFP8Conv2d(conv, input_amax=4.0)
    xq = q.quantize_input(x)
    k, st, pad = q.kernel_size[0], q.stride[0], q.padding[0]
    with torch.no_grad():
        t16 = _graph_time_us(lambda: torch.nn.functional.conv2d(x, w, b, st, pad))
        t8 = _graph_time_us(lambda: fp8_conv.conv2d_fp8(xq, q.weight_fp8, q.scale, q.bias, k, k, st, pad, dtype))
    return t16, t8


def quantize_convs_static(unet: torch.nn.Module, amax: dict[str, float], shapes: dict[str, tuple[int, ...]],
                          device: torch.device, measure: bool = True, margin: float = STATIC_MARGIN) -> dict:
    """Swap each named Conv2d for a StaticFP8Conv2d with its calibrated input max: all of them (measure=False,
    or off CUDA), or, measured, only those whose shape runs faster in the FP8 kernel (plus an unfused
    quantization pass) than in cuDNN by SELECT_GAIN. Timed at batch 2 (one image with CFG). The report."""
    import time

    from optim import fp8_conv

    t0 = time.perf_counter()
    seen = {n: a for n, a in amax.items() if a == a and n in shapes}
    report: dict = {"kernel": "optim/fp8_conv.py (Triton implicit GEMM, e4m3, per-output-channel weight scales)",
                    "candidates": len(amax), "not_called_while_calibrating": len(amax) - len(seen)}
    chosen = list(seen)
    if measure and device.type == "cuda":
        groups: dict[tuple, list[str]] = {}
        for n in seen:
            m = unet.get_submodule(n)
            _, c, h, w = shapes[n]
            key = ((2, c, h, w), m.out_channels, m.kernel_size[0], m.stride[0], m.padding[0])
            groups.setdefault(key, []).append(n)
        rows, chosen = [], []
        try:
            for key, layers in sorted(groups.items()):
                t16, t8 = time_conv(key[0], unet.get_submodule(layers[0]), device)
                n_, c, h, w = key[0]
                quant = quant_us(n_ * h * w, c)
                win = t8 + quant <= t16 * (1 - SELECT_GAIN)
                rows.append({"input": list(key[0]), "out_channels": key[1], "kernel": key[2], "stride": key[3],
                             "layers": len(layers), "cudnn_us": round(t16, 2), "fp8_us": round(t8, 2),
                             "quant_us": round(quant, 2), "fp8": win})
                if win:
                    chosen.extend(layers)
        except Exception as exc:   # a timing that cannot run leaves the convolutions as they were
            report.update(fp8_layers=[], why=f"the measurement failed ({type(exc).__name__}: "
                                              f"{' '.join(str(exc).split())[:160]}); convolutions left as they were")
            return report
        report["selection"] = {"mode": "measure", "shapes": rows}
    for n in chosen:
        _swap(unet, n, fp8_conv.StaticFP8Conv2d(unet.get_submodule(n), seen[n], margin))
    report["fp8_layers"] = chosen
    report["kept"] = len(amax) - len(chosen)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report
