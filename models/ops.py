"""Plain-PyTorch ops behind the StyleGAN networks (no CUDA plugin is ever compiled).

These follow the semantics of NVlabs' `torch_utils.ops` (bias_act, upfirdn2d,
conv2d_resample) and of `modulated_conv2d` in their networks, so that weights
from their network pickles give the same images. Each op is written for speed
on a GPU as well:

- no Python loop over the batch, no `.item()` or other host sync, static shapes
  (so torch.compile and CUDA graphs can capture a whole generator);
- resampling goes through conv2d / conv_transpose2d (zero insertion and the
  low-pass filter in one depthwise op), 1-D filters run as two 1-D convs;
- everything is plain autograd, so it can be differentiated twice (R1 penalty,
  path-length regularisation).

Conventions (NVlabs'): a filter prepared by `setup_filter` is *convolved*
(flipped) unless `flip_filter=True`; padding is given with respect to the
upsampled image as `[x_before, x_after, y_before, y_after]`.

Alternative implementations of the resampling ops (for speed; same results) can be picked
with `set_impl` / `use_impl` (see "Alternative implementations" at the end). The defaults are
the code paths above, unchanged; no variant adds parameters, buffers or state-dict keys.

The StyleGAN3 engineer appends filtered_lrelu here; keep additions at the end.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from core.errors import InputError

__all__ = [
    "assert_shape",
    "ACTIVATIONS",
    "bias_act",
    "setup_filter",
    "upfirdn2d",
    "upsample2d",
    "downsample2d",
    "filter2d",
    "conv2d_resample",
    "modulated_conv2d",
    "normalize_2nd_moment",
    "FullyConnectedLayer",
    "IMPL_CHOICES",
    "DEFAULT_IMPL",
    "get_impl",
    "set_impl",
    "use_impl",
]


# ---------------------------------------------------------------------------------------------
# Shape checks


def assert_shape(x: torch.Tensor, shape: Sequence[int | None], what: str = "tensor") -> None:
    """Raise InputError unless `x` has len(shape) dims and matches every non-None size.

    Shapes are Python ints at trace time, so this costs nothing under torch.compile.
    """
    if x.ndim != len(shape):
        raise InputError(f"{what} should have {len(shape)} dimensions {list(shape)}, got shape {list(x.shape)}")
    for got, want in zip(x.shape, shape):
        if want is not None and got != want:
            raise InputError(f"{what} should have shape {list(shape)} (None = any), got {list(x.shape)}")


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    sx, sy = v
    return int(sx), int(sy)


def _parse_padding(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """int | [x, y] | [x0, x1, y0, y1] -> (x0, x1, y0, y1)."""
    if isinstance(padding, int):
        return padding, padding, padding, padding
    padding = [int(p) for p in padding]
    if len(padding) == 2:
        px, py = padding
        return px, px, py, py
    if len(padding) != 4:
        raise InputError(f"padding must be an int, [x, y] or [x0, x1, y0, y1]; got {padding}")
    return padding[0], padding[1], padding[2], padding[3]


def _filter_size(f: torch.Tensor | None) -> tuple[int, int]:
    """(width, height) of a prepared filter; a 1-D filter is used along both axes."""
    if f is None:
        return 1, 1
    if f.ndim == 1:
        return f.shape[0], f.shape[0]
    return f.shape[-1], f.shape[0]


# ---------------------------------------------------------------------------------------------
# bias + activation + gain + clamp


# name -> (function of (x, alpha), default alpha, default gain). The gains keep the signal's
# magnitude roughly constant through the layer (He init); NVlabs calls them def_gain.
ACTIVATIONS: dict[str, tuple] = {
    "linear": (lambda x, a: x, 0.0, 1.0),
    "relu": (lambda x, a: F.relu(x), 0.0, math.sqrt(2)),
    "lrelu": (lambda x, a: F.leaky_relu(x, a), 0.2, math.sqrt(2)),
    "tanh": (lambda x, a: torch.tanh(x), 0.0, 1.0),
    "sigmoid": (lambda x, a: torch.sigmoid(x), 0.0, 1.0),
    "elu": (lambda x, a: F.elu(x), 0.0, 1.0),
    "selu": (lambda x, a: F.selu(x), 0.0, 1.0),
    "softplus": (lambda x, a: F.softplus(x), 0.0, 1.0),
    "swish": (lambda x, a: F.silu(x), 0.0, math.sqrt(2)),
}


def activation_gain(act: str) -> float:
    try:
        return ACTIVATIONS[act][2]
    except KeyError:
        raise InputError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}") from None


def bias_act(
    x: torch.Tensor,
    b: torch.Tensor | None = None,
    dim: int = 1,
    act: str = "linear",
    alpha: float | None = None,
    gain: float | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """x + b (along `dim`), then the activation, then * gain, then clamp to [-clamp, clamp].

    gain=None uses the activation's default gain (sqrt(2) for lrelu/relu, 1 for linear);
    clamp=None or a negative clamp disables clamping. Same order as NVlabs' bias_act.
    """
    try:
        func, def_alpha, def_gain = ACTIVATIONS[act]
    except KeyError:
        raise InputError(f"unknown activation {act!r}; known: {', '.join(ACTIVATIONS)}") from None
    alpha = def_alpha if alpha is None else float(alpha)
    gain = def_gain if gain is None else float(gain)
    if b is not None:
        shape = [1] * x.ndim
        shape[dim] = -1
        x = x + b.to(x.dtype).reshape(shape)
    x = func(x, alpha)
    if gain != 1:
        x = x * gain
    if clamp is not None and clamp >= 0:
        x = x.clamp(-float(clamp), float(clamp))
    return x


# ---------------------------------------------------------------------------------------------
# FIR filtering with up/downsampling


def setup_filter(
    f,
    device: torch.device | str = "cpu",
    normalize: bool = True,
    flip_filter: bool = False,
    gain: float = 1.0,
    separable: bool | None = None,
) -> torch.Tensor:
    """Turn a list of taps into the float32 filter tensor the resampling ops expect.

    A short 1-D filter becomes its 2-D outer product (that is what NVlabs stores in
    every `resample_filter` buffer, e.g. [1,3,3,1] -> 4x4); a 1-D filter of 8 or more
    taps stays 1-D and is applied separably. normalize=True makes the taps sum to 1.
    """
    if f is None:
        f = 1
    # built on `device` explicitly, so that a network built under `with torch.device("meta")` (the
    # shape check of models.arch_limits) still gets its few filter taps
    f = torch.as_tensor(f, dtype=torch.float32, device=device)
    if f.ndim == 0:
        f = f[None]
    if f.ndim not in (1, 2) or f.numel() == 0:
        raise InputError(f"a resampling filter must be a non-empty 1-D or 2-D list, got shape {list(f.shape)}")
    if separable is None:
        separable = f.ndim == 1 and f.numel() >= 8
    if f.ndim == 1 and not separable:
        f = torch.outer(f, f)
    if normalize:
        f = f / f.sum()
    if flip_filter:
        f = f.flip(list(range(f.ndim)))
    f = f * (gain ** (f.ndim / 2))
    return f.to(device=device)


def _depthwise(f: torch.Tensor, channels: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    """A [channels, 1, kh, kw] weight that applies `f` to each channel on its own."""
    return f.to(dtype).reshape(1, 1, *shape).expand(channels, 1, *shape)


def _upfirdn_1pass(x, w, up: tuple[int, int], down: tuple[int, int], pad: tuple[int, int, int, int],
                   flip: bool) -> torch.Tensor:
    """One depthwise pass with a [kh, kw] filter `w` (already gain-scaled, in x's dtype).

    up > 1 runs as a strided transposed convolution: that is the zero-insertion upsampling
    and the filter in one op. The transposed conv yields the 'full' result, whose index
    (K - 1 - pad_before) is the first output pixel; one F.pad (negative = crop) then
    aligns it with the reference definition (insert zeros, pad, convolve, keep every down-th).
    """
    C = x.shape[1]
    kh, kw = w.shape
    upx, upy = up
    downx, downy = down
    px0, px1, py0, py1 = pad
    if upx > 1 or upy > 1:
        # conv_transpose2d correlates with the *flipped* weight, so an un-flipped f gives convolution.
        weight = _depthwise(w.flip([0, 1]) if flip else w, C, x.dtype, (kh, kw))
        crop_x0, crop_x1 = (kw - 1) - px0, kw - upx - px1
        crop_y0, crop_y1 = (kh - 1) - py0, kh - upy - py1
        if crop_x0 == crop_x1 >= 0 and crop_y0 == crop_y1 >= 0:
            x = _convolution(x, weight, stride=(upy, upx), padding=(crop_y0, crop_x0), groups=C, transposed=True)
        else:
            x = _convolution(x, weight, stride=(upy, upx), groups=C, transposed=True)
            x = F.pad(x, [-crop_x0, -crop_x1, -crop_y0, -crop_y1])
        if downx > 1 or downy > 1:
            x = x[:, :, ::downy, ::downx]
        return x
    weight = _depthwise(w if flip else w.flip([0, 1]), C, x.dtype, (kh, kw))
    if px0 == px1 >= 0 and py0 == py1 >= 0:
        return _convolution(x, weight, stride=(downy, downx), padding=(py0, px0), groups=C)
    x = F.pad(x, [px0, px1, py0, py1])
    return _convolution(x, weight, stride=(downy, downx), groups=C)


def upfirdn2d(
    x: torch.Tensor,
    f: torch.Tensor | None,
    up: int | Sequence[int] = 1,
    down: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    flip_filter: bool = False,
    gain: float = 1.0,
) -> torch.Tensor:
    """Upsample (insert zeros), pad, FIR-filter and downsample (keep every down-th pixel).

    x: [N, C, H, W]; f: a filter from setup_filter (1-D = separable, 2-D = full) or None.
    Output size per axis: (in * up + pad0 + pad1 - taps) // down + 1.
    """
    if x.ndim != 4:
        raise InputError(f"upfirdn2d expects [N, C, H, W], got shape {list(x.shape)}")
    if f is None:
        f = torch.ones([1, 1], dtype=torch.float32, device=x.device)
    upx, upy = _pair(up)
    downx, downy = _pair(down)
    px0, px1, py0, py1 = _parse_padding(padding)
    if _impl["fir"] != "grouped":
        y = _upfirdn2d_variant(x, f, (upx, upy), (downx, downy), (px0, px1, py0, py1), flip_filter, gain)
        if y is not None:
            return y
    if f.ndim == 2:
        w = f * gain
        return _upfirdn_1pass(x, w, (upx, upy), (downx, downy), (px0, px1, py0, py1), flip_filter)
    # Separable: horizontal pass then vertical pass, each with sqrt(gain).
    g = f * math.sqrt(gain)
    x = _upfirdn_1pass(x, g[None, :], (upx, 1), (downx, 1), (px0, px1, 0, 0), flip_filter)
    return _upfirdn_1pass(x, g[:, None], (1, upy), (1, downy), (0, 0, py0, py1), flip_filter)


def filter2d(x, f, padding=0, flip_filter=False, gain=1.0) -> torch.Tensor:
    """Filter without changing the size (padding is added on top of 'same')."""
    px0, px1, py0, py1 = _parse_padding(padding)
    fw, fh = _filter_size(f)
    p = [px0 + fw // 2, px1 + (fw - 1) // 2, py0 + fh // 2, py1 + (fh - 1) // 2]
    return upfirdn2d(x, f, padding=p, flip_filter=flip_filter, gain=gain)


def upsample2d(x, f, up=2, padding=0, flip_filter=False, gain=1.0) -> torch.Tensor:
    """Upsample by `up` with the low-pass filter `f`; the gain up**2 keeps the mean."""
    upx, upy = _pair(up)
    px0, px1, py0, py1 = _parse_padding(padding)
    fw, fh = _filter_size(f)
    p = [px0 + (fw + upx - 1) // 2, px1 + (fw - upx) // 2, py0 + (fh + upy - 1) // 2, py1 + (fh - upy) // 2]
    return upfirdn2d(x, f, up=(upx, upy), padding=p, flip_filter=flip_filter, gain=gain * upx * upy)


def downsample2d(x, f, down=2, padding=0, flip_filter=False, gain=1.0) -> torch.Tensor:
    """Low-pass filter with `f`, then keep every down-th pixel."""
    downx, downy = _pair(down)
    px0, px1, py0, py1 = _parse_padding(padding)
    fw, fh = _filter_size(f)
    p = [px0 + (fw - downx + 1) // 2, px1 + (fw - downx) // 2, py0 + (fh - downy + 1) // 2, py1 + (fh - downy) // 2]
    return upfirdn2d(x, f, down=(downx, downy), padding=p, flip_filter=flip_filter, gain=gain)


# ---------------------------------------------------------------------------------------------
# Convolution with up/downsampling


def _conv(x, w, stride=1, padding=0, groups=1, transpose=False, flip_weight=True):
    # F.conv2d is a correlation; flip_weight=False asks for a true convolution.
    kh, kw = w.shape[2], w.shape[3]
    if not flip_weight and (kh > 1 or kw > 1):
        w = w.flip([2, 3])
    return _convolution(x, w, stride=stride, padding=padding, groups=groups, transposed=transpose)


def conv2d_resample(
    x: torch.Tensor,
    w: torch.Tensor,
    f: torch.Tensor | None = None,
    up: int = 1,
    down: int = 1,
    padding: int | Sequence[int] = 0,
    groups: int = 1,
    flip_weight: bool = True,
    flip_filter: bool = False,
) -> torch.Tensor:
    """conv2d with optional up/downsampling by the low-pass filter `f`; padding is applied once.

    Picks the cheapest equivalent order NVlabs uses: downsample before a 1x1 conv, upsample
    after it, strided conv for down, transposed strided conv for up.
    """
    out_channels, in_per_group, kh, kw = w.shape
    fw, fh = _filter_size(f)
    px0, px1, py0, py1 = _parse_padding(padding)
    if up > 1:
        px0 += (fw + up - 1) // 2
        px1 += (fw - up) // 2
        py0 += (fh + up - 1) // 2
        py1 += (fh - up) // 2
    if down > 1:
        px0 += (fw - down + 1) // 2
        px1 += (fw - down) // 2
        py0 += (fh - down + 1) // 2
        py1 += (fh - down) // 2

    if (kw > 1 or kh > 1) and up > 1 and down == 1 and _impl["up"] != "transpose":
        return _upconv_variant(x, w, f, up, (px0, px1, py0, py1), groups, flip_weight, flip_filter)
    if (kw > 1 or kh > 1) and down > 1 and up == 1 and _impl["down"] != "blur-stride":
        return _downconv_variant(x, w, f, down, (px0, px1, py0, py1), groups, flip_weight, flip_filter)

    if kw == 1 and kh == 1 and down > 1 and up == 1:
        x = upfirdn2d(x, f, down=down, padding=[px0, px1, py0, py1], flip_filter=flip_filter)
        return _conv(x, w, groups=groups, flip_weight=flip_weight)
    if kw == 1 and kh == 1 and up > 1 and down == 1:
        x = _conv(x, w, groups=groups, flip_weight=flip_weight)
        return upfirdn2d(x, f, up=up, padding=[px0, px1, py0, py1], gain=up**2, flip_filter=flip_filter)
    if down > 1 and up == 1:
        x = upfirdn2d(x, f, padding=[px0, px1, py0, py1], flip_filter=flip_filter)
        return _conv(x, w, stride=down, groups=groups, flip_weight=flip_weight)
    if up > 1:
        # A transposed conv wants [in, out/groups, kh, kw]; regroup per group.
        if groups == 1:
            w = w.transpose(0, 1)
        else:
            w = w.reshape(groups, out_channels // groups, in_per_group, kh, kw)
            w = w.transpose(1, 2).reshape(groups * in_per_group, out_channels // groups, kh, kw)
        px0 -= kw - 1
        px1 -= kw - up
        py0 -= kh - 1
        py1 -= kh - up
        pxt = max(min(-px0, -px1), 0)
        pyt = max(min(-py0, -py1), 0)
        x = _conv(x, w, stride=up, padding=[pyt, pxt], groups=groups, transpose=True, flip_weight=not flip_weight)
        x = upfirdn2d(x, f, padding=[px0 + pxt, px1 + pxt, py0 + pyt, py1 + pyt], gain=up**2, flip_filter=flip_filter)
        if down > 1:
            x = upfirdn2d(x, f, down=down, flip_filter=flip_filter)
        return x
    if px0 == px1 >= 0 and py0 == py1 >= 0:
        return _conv(x, w, padding=[py0, px0], groups=groups, flip_weight=flip_weight)
    x = upfirdn2d(x, None, padding=[px0, px1, py0, py1])
    x = _conv(x, w, groups=groups, flip_weight=flip_weight)
    if down > 1:
        x = upfirdn2d(x, f, down=down, flip_filter=flip_filter)
    return x


def modulated_conv2d(
    x: torch.Tensor,                         # [N, I, H, W]
    weight: torch.Tensor,                    # [O, I, kh, kw]
    styles: torch.Tensor,                    # [N, I] per-sample input-channel scales
    noise: torch.Tensor | None = None,       # added to the output (broadcast to [N, O, H', W'])
    up: int = 1,
    down: int = 1,
    padding: int = 0,
    resample_filter: torch.Tensor | None = None,
    demodulate: bool = True,
    flip_weight: bool = True,
    fused_modconv: bool = True,
) -> torch.Tensor:
    """StyleGAN2 weight modulation/demodulation.

    fused_modconv=True folds the batch into the channels and runs one grouped conv with a
    per-sample weight (fast for inference, one launch for the whole batch); False scales
    the activations before and after a shared-weight conv (cheaper backward for training).
    """
    N = x.shape[0]
    O, I, kh, kw = weight.shape
    assert_shape(x, [N, I, None, None], "modulated_conv2d input")
    assert_shape(styles, [N, I], "modulated_conv2d styles")
    if fused_modconv and (_impl["modconv"] in ("activations", "activations-nhwc")
                          or (N > 1 and _impl["modconv"] == "auto")):
        fused_modconv = False

    # fp16 has a small range: scale weight and styles to max-abs 1 first. Demodulation
    # divides the scale back out, so the result is unchanged in exact arithmetic.
    if x.dtype == torch.float16 and demodulate:
        weight = weight * (1 / math.sqrt(I * kh * kw) / weight.abs().amax(dim=[1, 2, 3], keepdim=True))
        styles = styles / styles.abs().amax(dim=1, keepdim=True)

    w = None
    dcoefs = None
    if fused_modconv:
        w = weight.unsqueeze(0) * styles.reshape(N, 1, I, 1, 1)           # [N, O, I, kh, kw]
        if demodulate:
            dcoefs = (w.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt()      # [N, O]
    elif demodulate:
        # sum_ik (W_oik s_ni)^2 = sum_i s_ni^2 sum_k W_oik^2: one [N, I] x [I, O] product instead of
        # the [N, O, I, k, k] per-sample weights, which the unfused form never needs otherwise.
        # Autocast off: a bf16 product would round the 512-term sums (the reductions above stay fp32).
        with torch.autocast(device_type=styles.device.type, enabled=False):
            t = torch.promote_types(styles.dtype, torch.float32)
            dcoefs = (styles.to(t).square() @ weight.to(t).square().sum(dim=[2, 3]).t() + 1e-8).rsqrt()

    if not fused_modconv:
        x = x * styles.to(x.dtype).reshape(N, I, 1, 1)
        x = conv2d_resample(x, weight.to(x.dtype), f=resample_filter, up=up, down=down,
                            padding=padding, flip_weight=flip_weight)
        if demodulate:
            x = x * dcoefs.to(x.dtype).reshape(N, O, 1, 1)
        if noise is not None:
            x = x + noise.to(x.dtype)
        return x

    if demodulate:
        w = w * dcoefs.reshape(N, O, 1, 1, 1)
    x = x.reshape(1, N * I, *x.shape[2:])
    w = w.reshape(N * O, I, kh, kw)
    x = conv2d_resample(x, w.to(x.dtype), f=resample_filter, up=up, down=down, padding=padding,
                        groups=N, flip_weight=flip_weight)
    x = x.reshape(N, O, *x.shape[2:])
    if noise is not None:
        x = x + noise.to(x.dtype)
    return x


# ---------------------------------------------------------------------------------------------
# Equalized learning rate


def normalize_2nd_moment(x: torch.Tensor, dim: int = 1, eps: float = 1e-8) -> torch.Tensor:
    """Scale each vector to unit root-mean-square along `dim` (StyleGAN's 'PixelNorm' of z)."""
    return x * (x.square().mean(dim=dim, keepdim=True) + eps).rsqrt()


class FullyConnectedLayer(torch.nn.Module):
    """Dense layer with equalized learning rate.

    Parameters are stored at unit scale and multiplied at run time by
    weight_gain = lr_multiplier / sqrt(in_features) and bias_gain = lr_multiplier, so that
    Adam's per-parameter step sizes are equal across layers. State-dict keys `weight`,
    `bias` match NVlabs' StyleGAN2 and StyleGAN3 layers.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "linear",
        lr_multiplier: float = 1.0,
        bias_init: float = 0.0,
        weight_init: float = 1.0,
    ):
        super().__init__()
        activation_gain(activation)  # validate the name early
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = torch.nn.Parameter(torch.randn([out_features, in_features]) * (weight_init / lr_multiplier))
        if bias:
            self.bias = torch.nn.Parameter(torch.full([out_features], float(bias_init) / lr_multiplier))
        else:
            self.register_parameter("bias", None)
        self.weight_gain = lr_multiplier / math.sqrt(in_features)
        self.bias_gain = lr_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert_shape(x, [None, self.in_features], "FullyConnectedLayer input")
        w = self.weight.to(x.dtype) * self.weight_gain
        b = self.bias
        if b is not None:
            b = b.to(x.dtype)
            if self.bias_gain != 1:
                b = b * self.bias_gain
        if self.activation == "linear" and b is not None:
            return torch.addmm(b.unsqueeze(0), x, w.t())
        x = x.matmul(w.t())
        return bias_act(x, b, act=self.activation)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


# ---------------------------------------------------------------------------------------------
# Alternative implementations
#
# The profile of the emoji64 trainer on an H200 (docs/perf-notes.md) is dominated by cuDNN's
# indexed implicit-GEMM kernels for the strided/transposed resampling convs, by grouped direct
# kernels for the depthwise FIR blurs, and by the double backward of the R1 / path-length
# penalties. Each knob below swaps one of these for a formulation that computes the same
# numbers through different kernels; `bench/ops.py` times them on the GPU.
#
#   fir   how upfirdn2d runs (every blur, up/downsample2d, the FIR half of conv2d_resample):
#         grouped    one depthwise 2-D conv, groups=C (the reference above)
#         separable  two 1-D depthwise convs (groups=C), layout kept
#         nc1        two 1-D convs on an [N*C, 1, H, W] view: plain convs, 1 in / 1 out channel
#         shifts     sums of shifted slices (polyphase for up): elementwise only, so that
#                    torch.compile fuses it with its neighbours; many small kernels in eager
#         triton     two 1-D passes of models/fir_triton.py's kernel (one read, one write per
#                    axis, float32 sums, NCHW or channels_last); inference only: with autograd
#                    recording, or where Triton cannot run, the grouped reference runs instead.
#                    StyleGAN3's filtered_lrelu: one fused kernel per output tile
#                    (models/filtered_lrelu_triton.py: up FIR, bias/lrelu/clamp, down FIR on chip)
#         triton-1d  the same for upfirdn2d; StyleGAN3's filtered_lrelu as four 1-D Triton passes
#                    (the path before the fused kernel, kept to A/B them on a GPU)
#   up    conv2d_resample with up > 1 and a k x k kernel (k > 1), down = 1:
#         transpose          strided transposed conv, then the FIR (the reference above)
#         subpixel           the transposed conv as one dense conv with up^2 x the output
#                            channels (its phases) + pixel shuffle, then the FIR
#         subpixel-fused     conv and FIR folded into one (k+t-1)^2 kernel, split into its up^2
#                            phases: one dense conv at the input resolution + pixel shuffle, no FIR
#         transpose-fused    the folded kernel as one strided transposed conv, no FIR
#         zero-insert-fused  zero insertion, then one dense conv with the folded kernel at the
#                            output resolution (up^2 x the multiply-adds of subpixel-fused)
#   down  conv2d_resample with down > 1 and a k x k kernel (k > 1), up = 1:
#         blur-stride  FIR, then a strided conv (the reference above)
#         fused-stride FIR and conv folded into one strided conv with a (k+t-1)^2 kernel
#         fused-s2d    the folded kernel on a space-to-depth (pixel-unshuffled) input: a dense
#                      conv with down^2 x the input channels, stride 1
#   modconv  modulated_conv2d's fused form (per-sample weights, one grouped conv):
#         as-called  what the layer asks for (the reference)
#         auto       fused at batch 1 only; at batch > 1 the activations are modulated around
#                    one shared-weight dense conv, as NVlabs runs inference (a grouped conv with
#                    groups = N is slow and its per-sample weights cost N x the weight memory)
#         activations  modulated activations at every batch size, batch 1 included: the conv's
#                    weights (and what is folded into them: FIR, subpixel phases) then depend
#                    only on parameters, which a frozen compiled graph computes once
#   grad  how convolutions are differentiated:
#         aten     PyTorch's own autograd for conv2d / conv_transpose2d
#         gradfix  a custom autograd.Function whose backward is again made of convolutions, and
#                  whose weight gradient is aten.convolution_backward with only the weight
#                  requested. PyTorch's `_convolution_double_backward` computes the weight
#                  gradient of every conv it differentiates, needed or not, and for groups > 1
#                  in a Python-free but per-group loop: one conv launch per channel for a
#                  depthwise blur (seen on torch 2.13: 17 convolutions for a 16-channel blur).
#
# The setting is read when an op runs (eager) or is traced (torch.compile: set it before
# compiling). The separable FIR variants need the 2-D filter to be an outer product (every
# filter setup_filter makes from a 1-D list is); in eager mode that is checked once per filter
# tensor and anything else falls back to the grouped reference; under torch.compile the check
# cannot run and the filter is assumed separable.

IMPL_CHOICES: dict[str, tuple[str, ...]] = {
    "fir": ("grouped", "separable", "nc1", "shifts", "triton", "triton-1d"),
    "up": ("transpose", "subpixel", "subpixel-fused", "transpose-fused", "zero-insert-fused"),
    "down": ("blur-stride", "fused-stride", "fused-s2d"),
    "grad": ("aten", "gradfix"),
    "modconv": ("as-called", "auto", "activations", "activations-nhwc"),
}
DEFAULT_IMPL: dict[str, str] = {knob: choices[0] for knob, choices in IMPL_CHOICES.items()}
_impl: dict[str, str] = dict(DEFAULT_IMPL)


def get_impl() -> dict[str, str]:
    """The current implementation choice for each knob (a copy)."""
    return dict(_impl)


def set_impl(**choices: str) -> dict[str, str]:
    """Pick implementations, e.g. set_impl(fir="nc1", up="subpixel-fused"); returns the previous setting.

    Knobs left out keep their value; set_impl(**DEFAULT_IMPL) restores the reference paths.
    """
    for knob, value in choices.items():
        if knob not in IMPL_CHOICES:
            raise InputError(f"unknown ops implementation knob {knob!r}; known: {', '.join(IMPL_CHOICES)}")
        if value not in IMPL_CHOICES[knob]:
            raise InputError(f"{knob}={value!r} is not an implementation; choose one of "
                             f"{', '.join(IMPL_CHOICES[knob])}")
    previous = dict(_impl)
    _impl.update(choices)
    return previous


@contextlib.contextmanager
def use_impl(**choices: str) -> Iterator[dict[str, str]]:
    """`with use_impl(down="fused-stride"): ...` sets knobs for the block and restores them after."""
    previous = set_impl(**choices)
    try:
        yield get_impl()
    finally:
        _impl.clear()
        _impl.update(previous)


def _is_channels_last(x: torch.Tensor) -> bool:
    return x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


# -- convolution with a cheap double backward (grad="gradfix") --------------------------------
#
# cfg = (stride, padding, groups, transposed, output_padding), each spatial pair as (y, x).


def _convolution(x, w, stride=1, padding=0, groups=1, transposed=False):
    """F.conv2d / F.conv_transpose2d, or their gradfix form when grad="gradfix"."""
    if _impl["grad"] == "gradfix":
        cfg = (_yx(stride), _yx(padding), int(groups), bool(transposed), (0, 0))
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # The Function's backward runs outside autocast: cast once here so that its saved
            # tensors and the incoming gradients share a dtype.
            dtype = torch.get_autocast_dtype(device_type)
            x, w = x.to(dtype), w.to(dtype)
        return _ConvFn.apply(x, w, cfg)
    if transposed:
        return F.conv_transpose2d(x, w, stride=stride, padding=padding, groups=groups)
    if groups == 1 and w.shape[0] % 8 and x.is_cuda and _half_conv(x):
        return padded_out_conv2d(x, w, stride=stride, padding=padding)
    return F.conv2d(x, w, stride=stride, padding=padding, groups=groups)


def padded_out_conv2d(x: torch.Tensor, w: torch.Tensor, stride=1, padding=0) -> torch.Tensor:
    """F.conv2d with the output channels padded to a multiple of 8 by zero weight rows, then sliced off.

    A ragged output channel count (ToRGB's 3) sends cuBLAS/cuDNN to unaligned (align1) kernels: 7 of
    them took 0.22 of StyleGAN2-1024's 1.97 device-ms at batch 1 on an H200 (fp16/bf16 on CUDA takes
    this path). Each real output channel sums the same products.
    """
    out_ch = w.shape[0]
    w = F.pad(w, (0, 0, 0, 0, 0, 0, 0, -out_ch % 8))
    return F.conv2d(x, w, stride=stride, padding=padding)[:, :out_ch]


def _half_conv(x: torch.Tensor) -> bool:
    """True when a conv of x runs in fp16/bf16 (its own dtype, or CUDA autocast's)."""
    return x.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled("cuda")


def _yx(v) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    a, b = v
    return int(a), int(b)


def _conv_input_grad(gy: torch.Tensor, w: torch.Tensor, x_shape, cfg) -> torch.Tensor:
    """Gradient of a conv (or transposed conv) with weight w w.r.t. its input, as another conv."""
    stride, padding, groups, transposed, out_pad = cfg
    if transposed:
        return _ConvFn.apply(gy, w, (stride, padding, groups, False, (0, 0)))
    # The transposed conv may come out short of the input size when the stride dropped the last
    # rows/columns; output_padding gives them back (as zeros' gradient).
    op = tuple(int(x_shape[2 + i]) - ((gy.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + w.shape[2 + i])
               for i in range(2))
    return _ConvFn.apply(gy, w, (stride, padding, groups, True, op))


class _ConvFn(torch.autograd.Function):
    """conv2d / conv_transpose2d whose backward is built from _ConvFn and _ConvWeightGradFn again,

    so it can be differentiated any number of times, never computes a gradient nobody asked for
    (a blur's filter) and never goes through the per-group loop of the aten double backward.
    """

    @staticmethod
    def forward(ctx, x, w, cfg):
        stride, padding, groups, transposed, out_pad = cfg
        ctx.save_for_backward(x, w)
        ctx.cfg = cfg
        if transposed:
            return F.conv_transpose2d(x, w, stride=stride, padding=padding, output_padding=out_pad, groups=groups)
        return F.conv2d(x, w, stride=stride, padding=padding, groups=groups)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _conv_input_grad(gy, w, x.shape, ctx.cfg)
        if ctx.needs_input_grad[1]:
            gw = _ConvWeightGradFn.apply(gy, x, w.detach(), ctx.cfg)
        return gx, gw, None


class _ConvWeightGradFn(torch.autograd.Function):
    """The weight gradient of a _ConvFn: cuDNN's wgrad kernel, only the weight part requested."""

    @staticmethod
    def forward(ctx, gy, x, w_like, cfg):
        stride, padding, groups, transposed, out_pad = cfg
        ctx.save_for_backward(gy, x)
        ctx.cfg = cfg
        # w_like gives the weight's shape and memory format (cuDNN picks its layout from it).
        return torch.ops.aten.convolution_backward(gy, x, w_like, None, list(stride), list(padding), [1, 1],
                                                   transposed, list(out_pad), groups, [False, True, False])[1]

    @staticmethod
    def backward(ctx, ggw):
        gy, x = ctx.saved_tensors
        g_gy = g_x = None
        # gW is bilinear in (gy, x): <ggw, gW> = <gy, conv(x, ggw)>.
        if ctx.needs_input_grad[0]:
            g_gy = _ConvFn.apply(x, ggw, ctx.cfg)
        if ctx.needs_input_grad[1]:
            g_x = _conv_input_grad(gy, ggw, x.shape, ctx.cfg)
        return g_gy, g_x, None, None


# -- FIR variants ------------------------------------------------------------------------------

try:
    from torch.utils.weak import WeakTensorKeyDictionary as _WeakTensorKeyDictionary
except ImportError:  # pragma: no cover - every torch >= 2.0 has it
    _WeakTensorKeyDictionary = dict

# filter tensor -> (its _version when checked, is it an outer product)
_outer_product_checked = _WeakTensorKeyDictionary()


def _is_outer_product(f: torch.Tensor) -> bool:
    """Whether a 2-D filter equals outer(column sums, row sums) / total; checked once per tensor.

    Reads the taps on the host (one sync the first time a filter buffer is seen), which is why
    the answer is cached by tensor identity and version.
    """
    seen = _outer_product_checked.get(f)
    if seen is not None and seen[0] == f._version:
        return seen[1]
    h = f.detach().to(device="cpu", dtype=torch.float64)
    total = h.sum()
    ok = bool(total.abs() > 1e-12 * h.abs().sum()) and bool(
        torch.allclose(torch.outer(h.sum(1), h.sum(0)) / total, h, rtol=1e-6, atol=1e-9 * float(h.abs().max())))
    _outer_product_checked[f] = (f._version, ok)
    return ok


def _separable_taps(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(vertical taps, horizontal taps) whose outer product is f, or None if f has no such form."""
    if f.ndim == 1:
        return f, f
    if not torch.compiler.is_compiling() and not _is_outer_product(f):
        return None
    return f.sum(1), f.sum(0) / f.sum()


def _upfirdn2d_variant(x, f, up, down, pad, flip_filter, gain) -> torch.Tensor | None:
    """upfirdn2d by the fir knob; None = use the grouped reference (no filter, or not separable)."""
    kind = _impl["fir"]
    if f is None:
        return None
    taps = _separable_taps(f)
    if taps is None:
        return None
    fy, fx = taps
    fy = fy * gain                           # the whole gain rides on one pass
    (upx, upy), (downx, downy) = up, down
    px0, px1, py0, py1 = pad
    if kind in ("triton", "triton-1d"):
        return _fir_triton(x, fx, fy, upx, upy, downx, downy, pad, flip_filter)
    if kind == "shifts":
        channels_last = _is_channels_last(x)
        # Sum in float32: a 16-bit running sum would round after every tap (compiled, the casts
        # fuse into the same kernel and cost nothing).
        y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = _fir_shifts_1d(y, fx, upx, downx, px0, px1, flip_filter, dim=3)
        y = _fir_shifts_1d(y, fy, upy, downy, py0, py1, flip_filter, dim=2).to(x.dtype)
        return y.contiguous(memory_format=torch.channels_last) if channels_last else y
    N, C, H, W = x.shape
    channels_last = kind == "nc1" and _is_channels_last(x)
    y = x.reshape(N * C, 1, H, W) if kind == "nc1" else x
    y = _upfirdn_1pass(y, fx[None, :], (upx, 1), (downx, 1), (px0, px1, 0, 0), flip_filter)
    y = _upfirdn_1pass(y, fy[:, None], (1, upy), (1, downy), (0, 0, py0, py1), flip_filter)
    if kind == "nc1":
        y = y.reshape(N, C, y.shape[2], y.shape[3])
        if channels_last:
            y = y.contiguous(memory_format=torch.channels_last)
    return y


def triton_usable(x: torch.Tensor) -> bool:
    """The Triton FIR kernels can run on x: its device has them, no gradient is being recorded, and
    its dtype is one they sum exactly enough (float32 sums: float64 callers get the reference)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if torch.compiler.is_compiling():
        return x.device.type == "cuda"       # Inductor compiles for CUDA through Triton: it is there
    from models import fir_triton

    return fir_triton.available(x.device)


def _fir_triton(x, fx, fy, upx, upy, downx, downy, pad, flip_filter) -> torch.Tensor | None:
    """upfirdn2d as two passes of the Triton kernel (W, then H); None = fall back to the reference."""
    if not triton_usable(x):
        return None
    from models.fir_triton import fir1d_op

    px0, px1, py0, py1 = pad
    cx = (fx if flip_filter else fx.flip(0)).float()           # correlation taps
    cy = (fy if flip_filter else fy.flip(0)).float()
    if _is_channels_last(x):
        # NHWC is a contiguous [N, H, W, C] view: filter along its dims 2 (W) and 1 (H).
        t = x.permute(0, 2, 3, 1)
        t = fir1d_op(t, cx, dim=2, up=upx, down=downx, pad0=px0, pad1=px1)
        t = fir1d_op(t, cy, dim=1, up=upy, down=downy, pad0=py0, pad1=py1)
        return t.permute(0, 3, 1, 2)
    y = fir1d_op(x, cx, dim=3, up=upx, down=downx, pad0=px0, pad1=px1)
    return fir1d_op(y, cy, dim=2, up=upy, down=downy, pad0=py0, pad1=py1)


def _narrow_pad(x: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    """Zero-pad (positive) or crop (negative) one dimension."""
    if before == 0 and after == 0:
        return x
    pad = [0, 0] * (x.ndim - 1 - dim) + [before, after]
    return F.pad(x, pad)


def _every(x: torch.Tensor, dim: int, start: int, count: int, step: int) -> torch.Tensor:
    """x[..., start : start + step*(count-1)+1 : step, ...] along dim, as a view."""
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, start + step * (count - 1) + 1, step)
    return x[tuple(index)]


def _phases(taps: int, up: int, pad0: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """Polyphase split of 'insert up-1 zeros, pad pad0 in front, correlate with `taps` taps'.

    Output sample up*J + r only meets taps m = m0 + up*s (s = 0, 1, ...), which read input
    sample J + s + off. Returns [(m0, off, count)] per phase r, the smallest off, and the
    common tap count S once every phase is aligned to that offset (shorter phases padded).
    """
    info = []
    for r in range(up):
        m0 = (pad0 - r) % up
        off = (r + m0 - pad0) // up
        info.append((m0, off, len(range(m0, taps, up))))
    o_min = min(off for _, off, _ in info)
    span = max(off - o_min + count for _, off, count in info)
    return info, o_min, span


def _fir_shifts_1d(x, f, up, down, pad0, pad1, flip, dim) -> torch.Tensor:
    """upfirdn along one axis as a sum of shifted slices (polyphase when up > 1)."""
    taps = f.shape[0]
    c = (f if flip else f.flip(0)).to(x.dtype)   # correlation taps
    n = x.shape[dim]
    full = n * up + pad0 + pad1 - taps + 1        # length before keeping every down-th sample
    if up == 1:
        xp = _narrow_pad(x, dim, pad0, pad1)
        count = (full - 1) // down + 1
        y = None
        for k in range(taps):
            term = _every(xp, dim, k, count, down) * c[k]
            y = term if y is None else y + term
        return y
    info, _, _ = _phases(taps, up, pad0)
    per_phase = -(-full // up)
    parts = []
    for m0, off, cnt in info:
        # phase r: y[up*J + r] = sum_s c[m0 + up*s] * x[J + s + off], J = 0 .. per_phase-1
        xp = _narrow_pad(x, dim, -off, off + per_phase + cnt - 1 - n)
        acc = None
        for s in range(cnt):
            term = xp.narrow(dim, s, per_phase) * c[m0 + up * s]
            acc = term if acc is None else acc + term
        if acc is None:  # this phase meets no tap (fewer taps than up)
            shape = list(x.shape)
            shape[dim] = per_phase
            acc = x.new_zeros(shape)
        parts.append(acc)
    y = torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1).narrow(dim, 0, full)
    if down > 1:
        y = _every(y, dim, 0, (full - 1) // down + 1, down)
    return y


# -- folded kernels and phase weights for the up/down conv variants ----------------------------


def _map_dtype(w: torch.Tensor) -> torch.dtype:
    # Weight transforms are built in float32 (float64 for float64 weights), then cast to w's dtype.
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def _correlation_filter(f: torch.Tensor | None, flip_filter: bool, gain: float, w: torch.Tensor) -> torch.Tensor:
    """The FIR as a 2-D correlation kernel (what F.conv2d would apply), gain included."""
    if f is None:
        f = torch.ones([1, 1], device=w.device)
    if f.ndim == 1:
        f = torch.outer(f, f)
    f = f if flip_filter else f.flip([0, 1])
    return f.to(device=w.device, dtype=_map_dtype(w)) * gain


def _fold_map(kh: int, kw: int, flip_weight: bool, fc: torch.Tensor) -> torch.Tensor:
    """[kh*kw, Kh, Kw] linear map from raw weight taps to the folded correlation kernel.

    Folded kernel K = (weight as a correlation kernel) convolved with fc, size (kh+th-1, kw+tw-1):
    correlating with K is correlating with the weight and then with the filter. Built from the
    identity basis with one tiny conv, in fc's dtype and outside autocast, so the whole weight
    transform is then a single matmul (cheap, and differentiable any number of times).
    """
    th, tw = fc.shape
    with torch.autocast(fc.device.type, enabled=False):
        basis = torch.eye(kh * kw, dtype=fc.dtype, device=fc.device).reshape(kh * kw, 1, kh, kw)
        if not flip_weight:
            basis = basis.flip([2, 3])   # flip_weight=False: the weight is a true convolution
        basis = F.pad(basis, [tw - 1, tw - 1, th - 1, th - 1])
        folded = F.conv2d(basis, fc.flip([0, 1])[None, None])
    return folded.reshape(kh * kw, kh + th - 1, kw + tw - 1)


def _split_phases(m: torch.Tensor, factor: int, pad_y0: int, pad_x0: int):
    """[kk, Kh, Kw] -> [kk, f, f, Sy, Sx] phase kernels (up) and the input offsets (oy, ox)."""
    out = m
    offsets = []
    for axis, pad0 in ((-2, pad_y0), (-1, pad_x0)):
        info, o_min, span = _phases(out.shape[axis], factor, pad0)
        parts = []
        for m0, off, cnt in info:
            index = [slice(None)] * out.ndim
            index[axis] = slice(m0, None, factor)
            part = out[tuple(index)]
            lead = off - o_min
            parts.append(_narrow_pad(part, out.ndim + axis, lead, span - lead - cnt))
        out = torch.stack(parts, dim=out.ndim - 2)
        offsets.append(o_min)
    return out, offsets[0], offsets[1]


def _apply_map(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """w [O, I, kh, kw] through a [kh*kw, ...] map -> [O, I, ...] in w's dtype."""
    O, I, kh, kw = w.shape
    flat = w.reshape(O * I, kh * kw) @ m.reshape(kh * kw, -1).to(w.dtype)
    return flat.reshape(O, I, *m.shape[1:])


def _crop(y: torch.Tensor, cy0: int, cy1: int, cx0: int, cx1: int) -> torch.Tensor:
    if cy0 or cy1 or cx0 or cx1:
        return y[:, :, cy0:y.shape[2] - cy1, cx0:y.shape[3] - cx1]
    return y


def _conv_padded(x, w, pad, stride=1, groups=1):
    """Correlate x, zero-padded by (x0, x1, y0, y1) (negative = crop), with w; returns the result and the
    extra leading rows/columns (cy0, cx0) it has when an asymmetric pad ran as a symmetric one."""
    px0, px1, py0, py1 = pad
    if min(pad) >= 0:
        # conv2d pads symmetrically; pad both sides by the larger amount and drop the extra
        # leading outputs (cheaper than copying the input through F.pad).
        py, px = max(py0, py1), max(px0, px1)
        if (py - py0) % stride == 0 and (px - px0) % stride == 0:
            y = _convolution(x, w, stride=stride, padding=(py, px), groups=groups)
            return y, (py - py0) // stride, (px - px0) // stride
    return _convolution(F.pad(x, [px0, px1, py0, py1]), w, stride=stride, groups=groups), 0, 0


def _pixel_shuffle(y: torch.Tensor, factor: int, groups: int, channels_last: bool) -> torch.Tensor:
    """[N, C*f*f, J, K] -> [N, C, J*f, K*f]; channels ordered (c, ry, rx), or (g, ry, rx, c_g) when
    channels_last (each output pixel's channels then sit together in memory)."""
    if not channels_last:
        return F.pixel_shuffle(y, factor)
    N, Cff, J, K = y.shape
    C = Cff // (factor * factor)
    t = y.permute(0, 2, 3, 1).reshape(N, J, K, groups, factor, factor, C // groups)
    t = t.permute(0, 1, 4, 2, 5, 3, 6).reshape(N, J * factor, K * factor, C)
    return t.permute(0, 3, 1, 2)


def _pixel_unshuffle(x: torch.Tensor, factor: int, groups: int, channels_last: bool) -> torch.Tensor:
    """Inverse of _pixel_shuffle (same channel orders)."""
    if not channels_last:
        return F.pixel_unshuffle(x, factor)
    N, C, H, W = x.shape
    t = x.permute(0, 2, 3, 1).reshape(N, H // factor, factor, W // factor, factor, groups, C // groups)
    t = t.permute(0, 1, 3, 5, 2, 4, 6).reshape(N, H // factor, W // factor, C * factor * factor)
    return t.permute(0, 3, 1, 2)


def _upconv_variant(x, w, f, up, pad, groups, flip_weight, flip_filter) -> torch.Tensor:
    """conv2d_resample(up > 1, down = 1, k > 1) by the up knob. pad = total (x0, x1, y0, y1) padding
    of the zero-inserted image, as in the reference: zero-insert, pad, conv, FIR * up^2 (valid)."""
    kind = _impl["up"]
    O, Ig, kh, kw = w.shape
    N, _, H, W = x.shape
    px0, px1, py0, py1 = pad
    channels_last = _is_channels_last(x)
    fc = _correlation_filter(f, flip_filter, up * up, w)
    # The conv-only map (subpixel: the FIR runs after) or the folded conv+FIR map.
    fold = _fold_map(kh, kw, flip_weight, fc if kind != "subpixel" else torch.ones_like(fc[:1, :1]))
    Kh, Kw = fold.shape[1:]
    out_h = H * up + py0 + py1 - Kh + 1       # the folded map's output size (conv-only for subpixel)
    out_w = W * up + px0 + px1 - Kw + 1

    if kind == "transpose-fused":
        # conv_transpose2d is a true convolution of the zero-inserted input: flip the kernel;
        # its full output starts Kh-1-py0 samples before ours.
        k = _apply_map(w, fold).flip([2, 3])
        k = k.reshape(groups, O // groups, Ig, Kh, Kw).transpose(1, 2).reshape(groups * Ig, O // groups, Kh, Kw)
        c = [Kw - 1 - px0, Kw - up - px1, Kh - 1 - py0, Kh - up - py1]
        py, px = max(min(c[2], c[3]), 0), max(min(c[0], c[1]), 0)
        y = _convolution(x, k, stride=up, padding=(py, px), groups=groups, transposed=True)
        return F.pad(y, [px - c[0], px - c[1], py - c[2], py - c[3]]) if c != [px, px, py, py] else y

    if kind == "zero-insert-fused":
        k = _apply_map(w, fold)
        z = F.pad(x[:, :, :, None, :, None], [0, up - 1, 0, 0, 0, up - 1]).reshape(N, x.shape[1], H * up, W * up)
        if channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        y, cy0, cx0 = _conv_padded(z, k, pad, groups=groups)
        return _crop(y, cy0, y.shape[2] - cy0 - out_h, cx0, y.shape[3] - cx0 - out_w)

    # subpixel / subpixel-fused: one dense conv computing all up^2 output phases.
    phases, oy, ox = _split_phases(fold, up, py0, px0)                      # [kk, u, u, Sy, Sx]
    Sy, Sx = phases.shape[-2:]
    k = _apply_map(w, phases)                                               # [O, Ig, u, u, Sy, Sx]
    k = k.reshape(groups, O // groups, Ig, up, up, Sy, Sx)
    order = (0, 3, 4, 1, 2, 5, 6) if channels_last else (0, 1, 3, 4, 2, 5, 6)
    k = k.permute(*order).reshape(O * up * up, Ig, Sy, Sx)
    Jy, Jx = -(-out_h // up), -(-out_w // up)                               # outputs per phase
    in_pad = (-ox, ox + Jx + Sx - 1 - W, -oy, oy + Jy + Sy - 1 - H)
    y, cy0, cx0 = _conv_padded(x, k, in_pad, groups=groups)
    y = _pixel_shuffle(y, up, groups, channels_last)
    cy0, cx0 = cy0 * up, cx0 * up
    y = _crop(y, cy0, y.shape[2] - cy0 - out_h, cx0, y.shape[3] - cx0 - out_w)
    if kind == "subpixel":
        # y is the conv stage with the total padding already applied: the FIR is 'valid'.
        y = upfirdn2d(y, f, gain=up * up, flip_filter=flip_filter)
    return y


def _downconv_variant(x, w, f, down, pad, groups, flip_weight, flip_filter) -> torch.Tensor:
    """conv2d_resample(down > 1, up = 1, k > 1) by the down knob: one conv with the folded kernel."""
    kind = _impl["down"]
    O, Ig, kh, kw = w.shape
    N, C, H, W = x.shape
    px0, px1, py0, py1 = pad
    fold = _fold_map(kh, kw, flip_weight, _correlation_filter(f, flip_filter, 1.0, w))
    Kh, Kw = fold.shape[1:]
    k = _apply_map(w, fold)                                                  # [O, Ig, Kh, Kw]
    if kind == "fused-stride":
        y, cy0, cx0 = _conv_padded(x, k, pad, stride=down, groups=groups)
        out_h, out_w = (H + py0 + py1 - Kh) // down + 1, (W + px0 + px1 - Kw) // down + 1
        return _crop(y, cy0, y.shape[2] - cy0 - out_h, cx0, y.shape[3] - cx0 - out_w)

    # fused-s2d: output J reads padded input rows down*J + m, m < Kh, i.e. space-to-depth
    # row J + s, phase r with m = down*s + r. Pad the input to a multiple of `down` and the kernel
    # to down*S taps, then one stride-1 conv over down^2 x the channels.
    channels_last = _is_channels_last(x)
    out_h, out_w = (H + py0 + py1 - Kh) // down + 1, (W + px0 + px1 - Kw) // down + 1
    Sy, Sx = -(-Kh // down), -(-Kw // down)
    Lh, Lw = down * (out_h + Sy - 1), down * (out_w + Sx - 1)
    xp = F.pad(x, [px0, Lw - W - px0, py0, Lh - H - py0])
    if channels_last:
        xp = xp.contiguous(memory_format=torch.channels_last)
    xs = _pixel_unshuffle(xp, down, groups, channels_last)
    k = F.pad(k, [0, down * Sx - Kw, 0, down * Sy - Kh]).reshape(O, Ig, Sy, down, Sx, down)
    order = (0, 3, 5, 1, 2, 4) if channels_last else (0, 1, 3, 5, 2, 4)
    k = k.permute(*order).reshape(O, Ig * down * down, Sy, Sx)
    return _convolution(xs, k, groups=groups)
