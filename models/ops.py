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

The StyleGAN3 engineer appends filtered_lrelu here; keep additions at the end.
"""
from __future__ import annotations

import math
from typing import Sequence

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
    f = torch.as_tensor(f, dtype=torch.float32)
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
            x = F.conv_transpose2d(x, weight, stride=(upy, upx), padding=(crop_y0, crop_x0), groups=C)
        else:
            x = F.conv_transpose2d(x, weight, stride=(upy, upx), groups=C)
            x = F.pad(x, [-crop_x0, -crop_x1, -crop_y0, -crop_y1])
        if downx > 1 or downy > 1:
            x = x[:, :, ::downy, ::downx]
        return x
    weight = _depthwise(w if flip else w.flip([0, 1]), C, x.dtype, (kh, kw))
    if px0 == px1 >= 0 and py0 == py1 >= 0:
        return F.conv2d(x, weight, stride=(downy, downx), padding=(py0, px0), groups=C)
    x = F.pad(x, [px0, px1, py0, py1])
    return F.conv2d(x, weight, stride=(downy, downx), groups=C)


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
    if transpose:
        return F.conv_transpose2d(x, w, stride=stride, padding=padding, groups=groups)
    return F.conv2d(x, w, stride=stride, padding=padding, groups=groups)


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

    # fp16 has a small range: scale weight and styles to max-abs 1 first. Demodulation
    # divides the scale back out, so the result is unchanged in exact arithmetic.
    if x.dtype == torch.float16 and demodulate:
        weight = weight * (1 / math.sqrt(I * kh * kw) / weight.abs().amax(dim=[1, 2, 3], keepdim=True))
        styles = styles / styles.abs().amax(dim=1, keepdim=True)

    w = None
    dcoefs = None
    if demodulate or fused_modconv:
        w = weight.unsqueeze(0) * styles.reshape(N, 1, I, 1, 1)           # [N, O, I, kh, kw]
    if demodulate:
        dcoefs = (w.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt()          # [N, O]

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
