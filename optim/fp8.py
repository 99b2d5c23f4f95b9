"""FP8 (Ada / Hopper): torchao float8 dynamic activation + weight quantization of the large linear layers.

Each selected nn.Linear gets an FP8 (e4m3) weight with one scale per output row, and at
run time its input is quantized to FP8 with one scale per row too; the product runs on FP8
tensor cores (`torch._scaled_mm`, 1449 TFLOP/s on the H200 vs 788 for bf16) and comes out
in bf16.

It pays only under torch.compile and on large matrix products (shared/GPU.md: a 4096² MLP is
2× slower than bf16 eagerly, 1.1× faster compiled), so:
- a size filter keeps layers with fewer than FP8_MIN_FEATURES input or output features in
  bf16 (the per-call quantization costs more than the faster matmul saves);
- without --compile the report warns that FP8 will be slower.
Convolutions: torchao's FP8 convolution needs compute capability 10.0 (Blackwell) and the
mslk kernels package; elsewhere they stay in bf16, and the report says why.

StyleGAN is not quantized: its convolutions are modulated (weights rebuilt per sample, so
there is no fixed weight to store in FP8) and its dense layers are 512 wide at most.

The quantized layers compute from bf16 (torchao's per-row scaling needs bf16 weights);
each is wrapped so that it takes and returns the surrounding dtype with autocast off.
"""
from __future__ import annotations

import torch

from core.types import OptimizationFlags
from optim.hardware import capability, has_package, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

FP8_MIN_FEATURES = 1024          # both in_features and out_features must reach this
MIN_CAPABILITY = (8, 9)
CONV_MIN_CAPABILITY = (10, 0)
TORCHAO_MISSING = "FP8 needs torchao (pip install torchao)"


def unavailable_reason(device: torch.device) -> str | None:
    cap = capability(device)
    if cap is None or cap < MIN_CAPABILITY:
        return f"FP8 needs compute capability 8.9 or newer (Ada/Hopper); {where(device)}"
    if not has_package("torchao"):
        return TORCHAO_MISSING
    return None


def selects(module: torch.nn.Module, min_features: int = FP8_MIN_FEATURES) -> bool:
    """The size filter: a Linear large enough for FP8 to gain, with dims the FP8 GEMM accepts (multiples of 16)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    i, o = module.in_features, module.out_features
    return i >= min_features and o >= min_features and i % 16 == 0 and o % 16 == 0


class FP8Linear(torch.nn.Module):
    """A torchao-quantized Linear behind a dtype boundary: bf16 inside, the caller's dtype outside."""

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
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.inner(x.to(torch.bfloat16)).to(x.dtype)


def _swap(root: torch.nn.Module, fqn: str, new: torch.nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def quantize_linears(module: torch.nn.Module, min_features: int = FP8_MIN_FEATURES) -> tuple[list[str], int]:
    """Quantize the selected Linears of `module` in place; returns (FP8 layer names, layers kept)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    chosen = [(n, m) for n, m in module.named_modules() if selects(m, min_features)]
    kept = sum(1 for _, m in module.named_modules() if isinstance(m, torch.nn.Linear)) - len(chosen)
    # set_inductor_config=False: torchao's "recommended" settings are process-wide (coordinate-descent
    # tuning, TF32 matmuls via set_float32_matmul_precision) and would change every other cached pipeline,
    # the fp32 reference included.
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    for name, lin in chosen:
        lin.to(torch.bfloat16)
        quantize_(lin, config)         # a bare Linear: the default filter takes it
        _swap(module, name, FP8Linear(lin))
    return [n for n, _ in chosen], kept


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
    layers, kept = quantize_linears(unet)
    if not layers:
        return skipped(f"no linear layer of this UNet is large enough for FP8 (size filter: in and out features "
                       f">= {FP8_MIN_FEATURES}); all left as they were", size_filter=FP8_MIN_FEATURES)
    cap = capability(ctx.device)
    conv_note = ("convolutions stay bf16: torchao's FP8 convolution needs compute capability 10.0 (Blackwell) "
                 f"and the mslk package; this GPU is {cap[0]}.{cap[1]}" if cap < CONV_MIN_CAPABILITY or not has_package("mslk")
                 else "convolutions stay bf16: torchao's FP8 convolution is not enabled in this build")
    details = {"component": "unet", "granularity": "per-row", "size_filter": FP8_MIN_FEATURES,
               "fp8_layers": len(layers), "kept_bf16_layers": kept, "layers": layers, "convolutions": conv_note,
               "other_components": "text encoders run once per image and the VAE has no large linears: unchanged"}
    if flags.compile == "off":
        details["warning"] = "without --compile FP8 is slower than bf16 (eager per-call quantization); add --compile default"
    return applied(f"{len(layers)} UNet linear layers in FP8 (e4m3, per-row scales); {kept} smaller ones left as they were",
                   **details)
