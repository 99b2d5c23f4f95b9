"""StyleGAN3 generator ("Alias-Free Generative Adversarial Networks"), configs T and R, in plain PyTorch.

One readable file: the ops (FIR up/down-sampling, filtered leaky ReLU, modulated
convolution) followed by the network (mapping, Fourier-feature input, synthesis
layers, generator). Parameter and buffer names equal NVlabs' so that a state dict
read from one of their network pickles loads with `strict=True`, and a fresh
network built from the same constructor kwargs has the same layer names, filter
buffers and paddings as theirs.

There is no compiled plugin: NVlabs' CUDA plugins are built at import time and
fail on current toolchains. Everything here is standard differentiable torch ops
(so it supports double backward for R1 / path-length regularisation), with shapes
fixed by the config, no host synchronisation, and separable filters applied as
two 1-D passes, so that torch.compile / CUDA graphs can take it as it is.

Semantics follow NVlabs' reference code paths (`_filtered_lrelu_ref`,
`_upfirdn2d_ref`, `_bias_act_ref`, `networks_stylegan3.py`); the test data in
shared/testdata/stylegan checks that outputs match theirs to 1e-4 relative.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from core.errors import InputError, ModelLoadError
from models import ops
from models.arch_limits import build_and_load
from models.common import jsonable, load_state_strict, truncate, truncation_centre_for  # noqa: F401

__all__ = [
    "ARCH",
    "Generator",
    "MappingNetwork",
    "SynthesisInput",
    "SynthesisLayer",
    "SynthesisNetwork",
    "design_lowpass_filter",
    "filtered_lrelu",
    "generator_from_record",
]

ARCH = "stylegan3"

_NOISE_MODES = ("const", "random", "none")


def _assert_shape(x: torch.Tensor, shape: list[int | None], what: str) -> None:
    """Raise InputError unless `x` has `shape` (None = any size in that dimension)."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    ok = x.ndim == len(shape) and all(s is None or int(d) == s for d, s in zip(x.shape, shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{what} has shape {list(x.shape)}, expected {want}")


# ---------------------------------------------------------------------------------------------
# Filters and the filtered leaky ReLU
# ---------------------------------------------------------------------------------------------

def design_lowpass_filter(numtaps: int, cutoff: float, width: float, fs: float, radial: bool = False) -> torch.Tensor | None:
    """Kaiser-windowed low-pass filter, as NVlabs designs it.

    Returns None for the identity (1 tap), a 1-D separable filter [numtaps], or,
    with `radial`, a 2-D radially symmetric jinc filter [numtaps, numtaps]
    (rotation equivariance of config R needs a filter that is not separable).
    """
    import scipy.signal
    import scipy.special

    if numtaps < 1:
        raise ValueError(f"numtaps must be >= 1, got {numtaps}")
    if numtaps == 1:
        return None
    if not radial:
        f = scipy.signal.firwin(numtaps=numtaps, cutoff=cutoff, width=width, fs=fs)
        return torch.as_tensor(f, dtype=torch.float32)
    # The 2-D ideal low-pass of a disc is a jinc; window it with the Kaiser window the
    # separable design would use, then normalise to unit DC gain.
    x = (np.arange(numtaps) - (numtaps - 1) / 2) / fs
    r = np.hypot(*np.meshgrid(x, x))
    f = scipy.special.j1(2 * cutoff * (np.pi * r)) / (np.pi * r)
    beta = scipy.signal.kaiser_beta(scipy.signal.kaiser_atten(numtaps, width / (fs / 2)))
    window = np.kaiser(numtaps, beta)
    f *= np.outer(window, window)
    f /= np.sum(f)
    return torch.as_tensor(f, dtype=torch.float32)


def _pad_dim(x: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    """Zero-pad (positive) or crop (negative) dimension `dim` (2 = H, 3 = W) of a 4-D tensor."""
    if before == 0 and after == 0:
        return x
    pad = [before, after] if dim == 3 else [0, 0, before, after]
    return F.pad(x, pad)


def _upsample_1d(x: torch.Tensor, f: torch.Tensor, up: int, pad0: int, pad1: int, dim: int) -> torch.Tensor:
    """upfirdn along one axis: insert up-1 zeros after each sample, pad/crop, convolve with `f`, gain `up`.

    `x` is [B, 1, H, W]. A strided transposed convolution computes the zero-stuffed
    convolution without multiplying the zeros; the requested padding then becomes
    a crop/pad of that full result.
    """
    taps = f.shape[0]
    length = x.shape[dim]
    out_len = length * up + pad0 + pad1 - taps + 1
    # Output sample j of upfirdn is sample j + start of the full (transposed) convolution.
    start = taps - 1 - pad0
    # Input samples that no output sample reaches are dropped before the convolution
    # (the critically sampled layers crop their margin away here).
    first = max(0, -(pad0 // up))
    last = min(length - 1, (start + out_len - 1) // up)
    if first > 0 or last < length - 1:
        x = x.narrow(dim, first, last - first + 1)
        start -= first * up
    full_len = (x.shape[dim] - 1) * up + taps
    crop_lo, crop_hi = start, full_len - start - out_len
    w = (f * up).to(x.dtype)
    w = w.view(1, 1, 1, taps) if dim == 3 else w.view(1, 1, taps, 1)
    stride = (1, up) if dim == 3 else (up, 1)
    if 0 <= crop_hi <= crop_lo < crop_hi + up:
        # The crop is (nearly) symmetric, which the transposed convolution does itself
        # (`padding` crops both ends, `output_padding` gives back up to up-1 samples at the end):
        # no extra pass over the upsampled tensor.
        pad = (0, crop_lo) if dim == 3 else (crop_lo, 0)
        out_pad = (0, crop_lo - crop_hi) if dim == 3 else (crop_lo - crop_hi, 0)
        return F.conv_transpose2d(x, w, stride=stride, padding=pad, output_padding=out_pad)
    return _pad_dim(F.conv_transpose2d(x, w, stride=stride), dim, -crop_lo, -crop_hi)


def _upsample_2d(x: torch.Tensor, f: torch.Tensor, up: int, padding: list[int]) -> torch.Tensor:
    """Non-separable upfirdn ([B, 1, H, W], 2-D filter, gain up**2); SG3 never needs it but it keeps the op general."""
    px0, px1, py0, py1 = padding
    th, tw = f.shape
    h, w_ = x.shape[2], x.shape[3]
    out_h = h * up + py0 + py1 - th + 1
    out_w = w_ * up + px0 + px1 - tw + 1
    y = F.conv_transpose2d(x, (f * (up * up)).to(x.dtype)[None, None], stride=up)
    sy, sx = th - 1 - py0, tw - 1 - px0
    y = _pad_dim(y, 2, -sy, sy + out_h - y.shape[2])
    return _pad_dim(y, 3, -sx, sx + out_w - y.shape[3])


def _downsample_1d(x: torch.Tensor, f: torch.Tensor, down: int, dim: int) -> torch.Tensor:
    """Convolve one axis of [B, 1, H, W] with `f` (valid region only) and keep every `down`-th sample."""
    taps = f.shape[0]
    w = f.flip(0).to(x.dtype)  # conv2d correlates; flipping makes it a convolution like upfirdn2d
    if dim == 3:
        return F.conv2d(x, w.view(1, 1, 1, taps), stride=(1, down))
    return F.conv2d(x, w.view(1, 1, taps, 1), stride=(down, 1))


def filtered_lrelu(
    x: torch.Tensor,                  # [N, C, H, W]
    up_filter: torch.Tensor | None,   # [taps] separable, [th, tw] 2-D, or None (identity)
    down_filter: torch.Tensor | None, # same forms
    bias: torch.Tensor | None,        # [C]
    up: int = 1,                      # upsampling factor
    down: int = 1,                    # downsampling factor
    padding: list[int] | tuple[int, int, int, int] = (0, 0, 0, 0),  # [x0, x1, y0, y1] on the upsampled image
    gain: float = math.sqrt(2),       # scale after the activation
    slope: float = 0.2,               # leaky ReLU negative slope (1 = linear)
    clamp: float | None = None,       # clamp |value| after the activation, None = off
) -> torch.Tensor:
    """Bias, upsample (FIR), leaky ReLU with gain and clamp, downsample (FIR), like NVlabs' op.

    Equal to NVlabs' `_filtered_lrelu_ref` with flip_filter=False: bias; upfirdn2d
    (up, padding, gain up**2); bias_act lrelu (slope, gain, clamp); upfirdn2d (down).
    The nonlinearity runs at the higher sampling rate so that its new harmonics
    fall below the downsampling filter's stopband.
    """
    n, c, h, w = x.shape
    px0, px1, py0, py1 = (int(p) for p in padding)
    fu_h, fu_w = (1, 1) if up_filter is None else (up_filter.shape[0], up_filter.shape[-1])
    fd_h, fd_w = (1, 1) if down_filter is None else (down_filter.shape[0], down_filter.shape[-1])
    out_h = (h * up + py0 + py1 - (fu_h - 1) - (fd_h - 1) + (down - 1)) // down
    out_w = (w * up + px0 + px1 - (fu_w - 1) - (fd_w - 1) + (down - 1)) // down

    separable = all(f is None or f.ndim == 1 for f in (up_filter, down_filter))
    kind = ops._impl["fir"]
    triton = separable and kind in ("triton", "triton-1d") and _triton_usable(x, bias)
    if triton and kind == "triton" and _fused_qualifies(x, up_filter, down_filter, up, down):
        # One kernel per output tile: no upsampled intermediate in memory (models/filtered_lrelu_triton.py).
        from models.filtered_lrelu_triton import filtered_lrelu_op

        x = filtered_lrelu_op(x, up_filter, down_filter, bias, up, down, (px0, px1, py0, py1), gain, slope, clamp)
    elif triton:
        x = _filtered_lrelu_triton(x, up_filter, down_filter, bias, up, down, (px0, px1, py0, py1),
                                   gain, slope, clamp)
    elif separable and kind == "shifts":
        x = _filtered_lrelu_shifts(x, up_filter, down_filter, bias, up, down, (px0, px1, py0, py1),
                                   gain, slope, clamp)
    else:
        x = _filtered_lrelu_nc1(x, up_filter, down_filter, bias, up, down, (px0, px1, py0, py1),
                                gain, slope, clamp)
    assert x.shape[2] == out_h and x.shape[3] == out_w, (tuple(x.shape), out_h, out_w)
    return x


def _triton_usable(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The inference-only Triton kernels may run: see ops.triton_usable; a bias that records a gradient
    (training) also sends the op to the differentiable reference."""
    if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
        return False
    return ops.triton_usable(x)


def _fused_qualifies(x, up_filter, down_filter, up, down) -> bool:
    """The fused kernel covers the call (separable filters, up/down 1/2/4, <= 48 taps). Radial 2-D
    filters (StyleGAN3-R's non-critical layers) never get here: they run the nc1 reference."""
    from models.filtered_lrelu_triton import qualifies

    return qualifies(x, up_filter, down_filter, up, down)


def _taps(f: torch.Tensor | None, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Correlation taps of a 1-D convolution filter (None = identity), gain folded in, float32."""
    if f is None:
        return torch.ones([1], dtype=torch.float32, device=device)
    return (f.float() * scale).flip(0)


def _filtered_lrelu_triton(x, up_filter, down_filter, bias, up, down, pad, gain, slope, clamp):
    """Four passes of the Triton FIR kernel on NCHW: up along W (+ bias), up along H (+ leaky ReLU, gain,
    clamp), down along H, down along W. Each pass reads its input once and writes its output once."""
    from models.fir_triton import fir1d_op

    n, c, h, w = x.shape
    px0, px1, py0, py1 = pad
    if up_filter is None and up != 1:
        raise ValueError("upsampling by zero insertion needs an upsampling filter")
    x = x.contiguous()
    b = bias.to(x.dtype) if bias is not None else None
    fu = _taps(up_filter, x.device, up)
    fd = _taps(down_filter, x.device)
    x = fir1d_op(x, fu, dim=3, up=up, pad0=px0, pad1=px1, bias=b, bias_div=h)
    x = fir1d_op(x, fu, dim=2, up=up, pad0=py0, pad1=py1, slope=slope, act_gain=gain, clamp=clamp)
    x = fir1d_op(x, fd, dim=2, down=down)
    return fir1d_op(x, fd, dim=3, down=down)


def _filtered_lrelu_shifts(x, up_filter, down_filter, bias, up, down, pad, gain, slope, clamp):
    """The same op as sums of shifted slices (models.ops' `fir=shifts`): elementwise only, so
    torch.compile fuses each pass (and the activation) into one generated kernel. Sums in float32."""
    px0, px1, py0, py1 = pad
    if up_filter is None and up != 1:
        raise ValueError("upsampling by zero insertion needs an upsampling filter")
    dtype = x.dtype
    y = x.float()
    if bias is not None:
        y = y + bias.float().view(1, -1, 1, 1)
    one = torch.ones([1], dtype=torch.float32, device=x.device)
    fu = up_filter.float() * up if up_filter is not None else one
    y = ops._fir_shifts_1d(y, fu, up, 1, px0, px1, False, dim=3)
    y = ops._fir_shifts_1d(y, fu, up, 1, py0, py1, False, dim=2)
    if slope != 1:
        y = F.leaky_relu(y, slope)
    y = y * gain
    if clamp is not None:
        y = y.clamp(-clamp, clamp)
    fd = down_filter.float() if down_filter is not None else one
    y = ops._fir_shifts_1d(y, fd, 1, down, 0, 0, False, dim=2)
    y = ops._fir_shifts_1d(y, fd, 1, down, 0, 0, False, dim=3)
    return y.to(dtype)


def _filtered_lrelu_nc1(x, up_filter, down_filter, bias, up, down, pad, gain, slope, clamp):
    """The reference: plain convolutions on an [N*C, 1, H, W] view (differentiable twice)."""
    n, c, h, w = x.shape
    px0, px1, py0, py1 = pad
    if bias is not None:
        x = x + bias.to(x.dtype).view(1, c, 1, 1)

    # Every channel gets the same filter: fold channels into the batch so each FIR pass is
    # one single-channel convolution (no per-channel copies of the filter).
    x = x.reshape(n * c, 1, h, w)

    if up_filter is None:
        if up != 1:
            raise ValueError("upsampling by zero insertion needs an upsampling filter")
        x = _pad_dim(_pad_dim(x, 3, px0, px1), 2, py0, py1)
    elif up_filter.ndim == 1:
        x = _upsample_1d(x, up_filter, up, px0, px1, dim=3)
        x = _upsample_1d(x, up_filter, up, py0, py1, dim=2)
    else:
        x = _upsample_2d(x, up_filter, up, [px0, px1, py0, py1])

    # gain * clamp(y, c / gain) == clamp(gain * y, c), and the gain commutes with the linear
    # down filter, so it rides on the filter taps instead of costing a pass over the largest tensor.
    fold_gain = down_filter is not None
    if slope != 1:
        x = F.leaky_relu(x, slope)
    if gain != 1 and not fold_gain:
        x = x * gain
    if clamp is not None:
        x = x.clamp(-clamp / gain, clamp / gain) if fold_gain else x.clamp(-clamp, clamp)

    if down_filter is None:
        if down != 1:
            x = x[:, :, ::down, ::down]
    elif down_filter.ndim == 1:
        x = _downsample_1d(x, down_filter, down, dim=2)
        x = _downsample_1d(x, down_filter * gain, down, dim=3)
    else:
        x = F.conv2d(x, (down_filter * gain).flip([0, 1]).to(x.dtype)[None, None], stride=down)

    return x.reshape(n, c, x.shape[2], x.shape[3])


def _full_precision(x: torch.Tensor):
    """Autocast off for the small per-sample math (mapping, Fourier phases, styles, demodulation).

    Under AMP only the big convolutions should drop to fp16/bf16: Fourier phases in
    bf16 visibly shift the image, and demodulation sums overflow fp16.
    """
    return torch.autocast(device_type=x.device.type, enabled=False)


def modulated_conv2d(
    x: torch.Tensor,                   # [N, I, H, W]
    weight: torch.Tensor,              # [O, I, k, k]
    styles: torch.Tensor,              # [N, I]
    demodulate: bool = True,
    padding: int = 0,
    input_gain: torch.Tensor | None = None,  # [], [I] or [N, I]: scale of each input channel
) -> torch.Tensor:                     # [N, O, H + 2 * padding - k + 1, ...]
    """StyleGAN3's modulated convolution: per-sample weights w * s, demodulated per output channel.

    The per-sample weights are built in fp32 and the batch runs as one grouped
    convolution (for batch 1, a plain convolution). Folding styles, demodulation
    and input gain into the small weight tensor costs no pass over the activations
    and keeps the convolution's output at unit scale, which fp16 needs. With the ops knob
    modconv=auto and a batch > 1, the same numbers come from modulating the activations around
    one shared-weight dense conv instead (see `models.ops`).
    """
    n, in_ch, h, w = x.shape
    out_ch, _, kh, kw = weight.shape
    nhwc = ops._impl["modconv"] == "activations-nhwc"
    batched = nhwc or ops._impl["modconv"] == "activations" or (n > 1 and ops._impl["modconv"] == "auto")
    with _full_precision(x):
        weight, styles = weight.float(), styles.float()
        if demodulate:
            # Pre-normalise so the products below stay in range. NVlabs takes the style RMS
            # over the whole batch; the factor cancels in demodulation either way, and a
            # per-sample RMS keeps each sample independent of its batch-mates.
            weight = weight * weight.square().mean([1, 2, 3], keepdim=True).rsqrt()
            styles = styles * styles.square().mean(dim=1, keepdim=True).rsqrt()
        gain = input_gain.float().expand(n, in_ch) if input_gain is not None else None      # [N, I]
        if batched:      # sum_ik (W s)^2 as one [N, I] x [I, O] product (models.ops.modulated_conv2d)
            dcoefs = (styles.square() @ weight.square().sum(dim=[2, 3]).t() + 1e-8).rsqrt() if demodulate else None
        else:
            wts = weight.unsqueeze(0) * styles.view(n, 1, in_ch, 1, 1)               # [N, O, I, k, k]
            dcoefs = (wts.square().sum(dim=[2, 3, 4]) + 1e-8).rsqrt() if demodulate else None  # [N, O]
            if demodulate:
                wts = wts * dcoefs.view(n, out_ch, 1, 1, 1)
            if gain is not None:
                wts = wts * gain.view(n, 1, in_ch, 1, 1)
    if batched:
        scale_in = styles * gain if gain is not None else styles
        x = x * scale_in.to(x.dtype).view(n, in_ch, 1, 1)
        if nhwc:
            return _nhwc_conv(x, weight.to(x.dtype), dcoefs, padding)
        x = F.conv2d(x, weight.to(x.dtype), padding=padding)
        return x * dcoefs.to(x.dtype).view(n, out_ch, 1, 1) if dcoefs is not None else x
    x = x.reshape(1, n * in_ch, h, w)
    x = F.conv2d(x, wts.reshape(n * out_ch, in_ch, kh, kw).to(x.dtype), padding=padding, groups=n)
    return x.reshape(n, out_ch, x.shape[2], x.shape[3])


def _nhwc_conv(x: torch.Tensor, weight: torch.Tensor, dcoefs: torch.Tensor | None, padding: int) -> torch.Tensor:
    """The shared-weight conv of modulated activations, run channels-last with channel counts padded
    to multiples of 8, handed back NCHW (modconv=activations-nhwc).

    StyleGAN3-T-1024's inner layers have 323, 203, 81 and 51 channels, and the fused filtered_lrelu
    kernel reads and writes NCHW. Given NCHW half-precision tensors with such counts, cuDNN on an H200
    transformed every input, weight and output to NHWC and back (35 transform kernels, 1.3 of 10.5
    device-ms at batch 1) and ran the ragged channel counts on small tiles. Here the modulation
    multiply, the zero channels and the layout change are one pointwise pass under torch.compile,
    the conv sees aligned NHWC operands, and the demodulation multiply writes NCHW. The zero input
    channels meet zero weights and the zero output channels are sliced off: the same sums.
    """
    n, in_ch = x.shape[:2]
    out_ch = weight.shape[0]
    pad_i, pad_o = -in_ch % 8, -out_ch % 8
    if pad_i:
        x = F.pad(x, (0, 0, 0, 0, 0, pad_i))
    if pad_i or pad_o:
        weight = F.pad(weight, (0, 0, 0, 0, 0, pad_i, 0, pad_o))
    y = F.conv2d(x.contiguous(memory_format=torch.channels_last),
                 weight.contiguous(memory_format=torch.channels_last), padding=padding)[:, :out_ch]
    if dcoefs is not None:
        y = y * dcoefs.to(y.dtype).view(n, out_ch, 1, 1)
    return y.contiguous()


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------

class FullyConnectedLayer(torch.nn.Module):
    """Linear layer with equalised learning rate (weights scaled at run time, not at init)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: str = "linear",   # "linear" or "lrelu"
        bias: bool = True,
        lr_multiplier: float = 1.0,   # learning-rate multiplier (the mapping network uses 0.01)
        weight_init: float = 1.0,     # initial std of the effective weight
        bias_init: float | list[float] = 0.0,
    ):
        super().__init__()
        if activation not in ("linear", "lrelu"):
            raise ValueError(f"unsupported activation {activation!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = torch.nn.Parameter(torch.randn([out_features, in_features]) * (weight_init / lr_multiplier))
        bias_init = np.broadcast_to(np.asarray(bias_init, dtype=np.float32), [out_features])
        self.bias = torch.nn.Parameter(torch.from_numpy(bias_init / lr_multiplier)) if bias else None
        self.weight_gain = lr_multiplier / math.sqrt(in_features)
        self.bias_gain = lr_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.weight_gain
        if self.bias is None:
            x = x.matmul(w.t())
        else:
            b = self.bias.to(x.dtype)
            if self.bias_gain != 1:
                b = b * self.bias_gain
            x = torch.addmm(b.unsqueeze(0), x, w.t())
        if self.activation == "lrelu":
            x = F.leaky_relu(x, 0.2) * math.sqrt(2)
        return x


class MappingNetwork(torch.nn.Module):
    """z (+ label) -> w, broadcast to num_ws copies, with truncation towards the tracked mean w_avg (or a given
    centre, e.g. a class's own mean w: models/class_centres.py)."""

    def __init__(
        self,
        z_dim: int,                   # latent z dimension
        c_dim: int,                   # label dimension, 0 = unconditional
        w_dim: int,                   # intermediate latent w dimension
        num_ws: int,                  # how many copies of w the synthesis network consumes
        num_layers: int = 2,          # number of fully connected layers
        lr_multiplier: float = 0.01,  # learning-rate multiplier of those layers
        w_avg_beta: float = 0.998,    # decay of the running mean of w (training)
    ):
        super().__init__()
        self.z_dim = z_dim
        self.c_dim = c_dim
        self.w_dim = w_dim
        self.num_ws = num_ws
        self.num_layers = num_layers
        self.w_avg_beta = w_avg_beta

        self.embed = FullyConnectedLayer(c_dim, w_dim) if c_dim > 0 else None
        features = [z_dim + (w_dim if c_dim > 0 else 0)] + [w_dim] * num_layers
        for idx in range(num_layers):
            layer = FullyConnectedLayer(features[idx], features[idx + 1], activation="lrelu", lr_multiplier=lr_multiplier)
            setattr(self, f"fc{idx}", layer)
        self.register_buffer("w_avg", torch.zeros([w_dim]))

    def forward(
        self,
        z: torch.Tensor,                     # [N, z_dim]
        c: torch.Tensor | None,              # [N, c_dim], or None / [N, 0] when unconditional
        truncation_psi: float | torch.Tensor = 1.0,  # 1 = no truncation; a 0-d tensor is fine
        truncation_cutoff: int | None = None,        # truncate only the first this many ws, None = all
        update_emas: bool = False,
        truncation_centre: torch.Tensor | None = None,  # [w_dim] or [N, w_dim] (a class's mean w), None = w_avg
    ) -> torch.Tensor:                               # [N, num_ws, w_dim]
        _assert_shape(z, [None, self.z_dim], "z")
        if truncation_cutoff is None:
            truncation_cutoff = self.num_ws
        if not 0 <= int(truncation_cutoff) <= self.num_ws:
            raise InputError(f"truncation_cutoff must be between 0 and {self.num_ws} (the number of ws), "
                             f"got {truncation_cutoff}")

        with _full_precision(z):  # w is tiny and every layer depends on it
            # Normalise the second moment of each input so its scale does not matter.
            x = z.to(torch.float32)
            x = x * (x.square().mean(1, keepdim=True) + 1e-8).rsqrt()
            if self.c_dim > 0:
                if c is None:
                    raise InputError(f"this generator is conditional: pass a label tensor c of shape [N, {self.c_dim}]")
                _assert_shape(c, [z.shape[0], self.c_dim], "c")
                y = self.embed(c.to(torch.float32))
                y = y * (y.square().mean(1, keepdim=True) + 1e-8).rsqrt()
                x = torch.cat([x, y], dim=1)

            for idx in range(self.num_layers):
                x = getattr(self, f"fc{idx}")(x)

            if update_emas:
                with torch.no_grad():
                    self.w_avg.copy_(x.detach().to(self.w_avg.dtype).mean(dim=0).lerp(self.w_avg, self.w_avg_beta))

        ws = x.unsqueeze(1).repeat([1, self.num_ws, 1])
        # A tensor psi always takes the lerp, so a compiled graph serves every psi without re-tracing.
        if isinstance(truncation_psi, torch.Tensor) or truncation_psi != 1:
            cut = int(truncation_cutoff)
            centre = truncation_centre_for(self.w_avg, truncation_centre, ws.shape[0], self.w_dim)
            truncated = truncate(centre, ws[:, :cut], truncation_psi)
            ws = torch.cat([truncated, ws[:, cut:]], dim=1)
        return ws


class SynthesisInput(torch.nn.Module):
    """Fourier features on a sampling grid, rotated and translated by an affine transform of w."""

    def __init__(
        self,
        w_dim: int,            # intermediate latent dimension
        channels: int,         # number of Fourier features = output channels
        size: int,             # output height = width (including the margin)
        sampling_rate: float,  # output sampling rate
        bandwidth: float,      # frequencies are drawn from a disc of this radius
    ):
        super().__init__()
        self.w_dim = w_dim
        self.channels = channels
        self.size = int(size)
        self.sampling_rate = float(sampling_rate)
        self.bandwidth = float(bandwidth)

        # Random frequencies from the disc of radius `bandwidth` (density falling off with radius).
        freqs = torch.randn([channels, 2])
        radii = freqs.square().sum(dim=1, keepdim=True).sqrt()
        freqs /= radii * radii.square().exp().pow(0.25)
        freqs *= bandwidth
        phases = torch.rand([channels]) - 0.5

        self.weight = torch.nn.Parameter(torch.randn([channels, channels]))
        # Starts at the identity transform: rotation (cos, sin) = (1, 0), no translation.
        self.affine = FullyConnectedLayer(w_dim, 4, weight_init=0, bias_init=[1, 0, 0, 0])
        self.register_buffer("transform", torch.eye(3, 3))  # user-set inverse transform of the output image
        self.register_buffer("freqs", freqs)
        self.register_buffer("phases", phases)

        # Pixel centres in the input's coordinate frame, as NVlabs' affine_grid(align_corners=False) gives them.
        coords = (torch.arange(self.size, dtype=torch.float64) + 0.5 - self.size / 2) / self.sampling_rate
        grid = torch.stack(torch.meshgrid(coords, coords, indexing="xy"), dim=-1)  # [H, W, (x, y)]
        self.register_buffer("grid", grid.to(torch.float32), persistent=False)

    def forward(self, w: torch.Tensor) -> torch.Tensor:  # [N, w_dim] -> [N, channels, size, size]
        _assert_shape(w, [None, self.w_dim], "w")
        n = w.shape[0]

        with _full_precision(w):  # phases in fp16/bf16 would visibly shift the image
            # Rotation (r_c, r_s) normalised to unit length, and translation (t_x, t_y).
            t = self.affine(w)
            t = t / t[:, :2].norm(dim=1, keepdim=True)
            rc, rs, tx, ty = t.unbind(dim=1)
            zero, one = torch.zeros_like(rc), torch.ones_like(rc)
            m_r = torch.stack([rc, -rs, zero, rs, rc, zero, zero, zero, one], dim=1).view(n, 3, 3)
            m_t = torch.stack([one, zero, -tx, zero, one, -ty, zero, zero, one], dim=1).view(n, 3, 3)
            # Rotate the output image first, then translate, then apply the user's transform.
            transforms = m_r @ m_t @ self.transform.unsqueeze(0)

            freqs = self.freqs.unsqueeze(0)                                         # [N, C, 2]
            phases = self.phases.unsqueeze(0) + (freqs @ transforms[:, :2, 2:]).squeeze(2)
            freqs = freqs @ transforms[:, :2, :2]

            # A user transform may push frequencies past the band; fade those out instead of aliasing.
            amplitudes = (1 - (freqs.norm(dim=2) - self.bandwidth) / (self.sampling_rate / 2 - self.bandwidth)).clamp(0, 1)

            x = self.grid.unsqueeze(0) @ freqs.permute(0, 2, 1).unsqueeze(1)      # [N, H, W, C]
            x = x + phases.view(n, 1, 1, -1)
            x = torch.sin(x * (2 * math.pi))
            x = x * amplitudes.view(n, 1, 1, -1)

            x = x @ (self.weight / math.sqrt(self.channels)).t()
        x = x.permute(0, 3, 1, 2)
        _assert_shape(x, [n, self.channels, self.size, self.size], "SynthesisInput output")
        return x


class SynthesisLayer(torch.nn.Module):
    """Modulated conv, then bias + leaky ReLU at twice the sampling rate between FIR up/down-sampling."""

    def __init__(
        self,
        w_dim: int,                        # intermediate latent dimension
        is_torgb: bool,                    # final layer: 1x1 conv, no demodulation, linear, no resampling
        is_critically_sampled: bool,       # cutoff at Nyquist (last layers): separable down filter even in R
        use_fp16: bool,                    # NVlabs' per-layer precision flag; recorded, precision is set by optim/
        in_channels: int,
        out_channels: int,
        in_size: int,                      # input height = width
        out_size: int,                     # output height = width
        in_sampling_rate: int,
        out_sampling_rate: int,
        in_cutoff: float,                  # f_c of the input
        out_cutoff: float,                 # f_c of the output
        in_half_width: float,              # transition band half-width f_h of the input
        out_half_width: float,             # transition band half-width f_h of the output
        conv_kernel: int = 3,              # 1 in config R; ignored for ToRGB
        filter_size: int = 6,              # filter taps per lower-rate sample when resampling
        lrelu_upsampling: int = 2,         # how much higher the activation's sampling rate is
        use_radial_filters: bool = False,  # 2-D jinc down filter (config R), not for critical layers
        conv_clamp: float | None = 256,    # clamp activations to [-X, X], None = off
        magnitude_ema_beta: float = 0.999, # decay of the running input magnitude (training)
    ):
        super().__init__()
        self.w_dim = w_dim
        self.is_torgb = bool(is_torgb)
        self.is_critically_sampled = bool(is_critically_sampled)
        self.use_fp16 = bool(use_fp16)
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)
        self.in_size = int(in_size)
        self.out_size = int(out_size)
        self.in_sampling_rate = int(in_sampling_rate)
        self.out_sampling_rate = int(out_sampling_rate)
        self.tmp_sampling_rate = max(self.in_sampling_rate, self.out_sampling_rate) * (1 if is_torgb else lrelu_upsampling)
        self.in_cutoff = float(in_cutoff)
        self.out_cutoff = float(out_cutoff)
        self.in_half_width = float(in_half_width)
        self.out_half_width = float(out_half_width)
        self.conv_kernel = 1 if is_torgb else int(conv_kernel)
        self.conv_clamp = None if conv_clamp is None else float(conv_clamp)
        self.magnitude_ema_beta = float(magnitude_ema_beta)

        self.affine = FullyConnectedLayer(w_dim, self.in_channels, bias_init=1)
        self.weight = torch.nn.Parameter(torch.randn([self.out_channels, self.in_channels, self.conv_kernel, self.conv_kernel]))
        self.bias = torch.nn.Parameter(torch.zeros([self.out_channels]))
        self.register_buffer("magnitude_ema", torch.ones([]))

        # Upsampling filter: from the input rate to the activation's rate.
        self.up_factor = int(round(self.tmp_sampling_rate / self.in_sampling_rate))
        if self.in_sampling_rate * self.up_factor != self.tmp_sampling_rate:
            raise ValueError("activation sampling rate must be an integer multiple of the input rate")
        self.up_taps = filter_size * self.up_factor if self.up_factor > 1 and not self.is_torgb else 1
        self.register_buffer("up_filter", design_lowpass_filter(
            numtaps=self.up_taps, cutoff=self.in_cutoff, width=self.in_half_width * 2, fs=self.tmp_sampling_rate))

        # Downsampling filter: from the activation's rate to the output rate.
        self.down_factor = int(round(self.tmp_sampling_rate / self.out_sampling_rate))
        if self.out_sampling_rate * self.down_factor != self.tmp_sampling_rate:
            raise ValueError("activation sampling rate must be an integer multiple of the output rate")
        self.down_taps = filter_size * self.down_factor if self.down_factor > 1 and not self.is_torgb else 1
        self.down_radial = bool(use_radial_filters) and not self.is_critically_sampled
        self.register_buffer("down_filter", design_lowpass_filter(
            numtaps=self.down_taps, cutoff=self.out_cutoff, width=self.out_half_width * 2,
            fs=self.tmp_sampling_rate, radial=self.down_radial))

        # Padding of the upsampled image so that the output has out_size samples, with sample
        # positions shifted per the symmetric interpretation of the paper's Appendix C.3.
        pad_total = (self.out_size - 1) * self.down_factor + 1                 # size needed before downsampling
        pad_total -= (self.in_size + self.conv_kernel - 1) * self.up_factor    # size after conv and upsampling
        pad_total += self.up_taps + self.down_taps - 2                        # shrinkage of the two filters
        pad_lo = (pad_total + self.up_factor) // 2
        pad_hi = pad_total - pad_lo
        self.padding = [pad_lo, pad_hi, pad_lo, pad_hi]  # [x0, x1, y0, y1]

        self.act_gain = 1.0 if self.is_torgb else math.sqrt(2)
        self.act_slope = 1.0 if self.is_torgb else 0.2

    def forward(
        self,
        x: torch.Tensor,              # [N, in_channels, in_size, in_size]
        w: torch.Tensor,              # [N, w_dim]
        noise_mode: str = "const",    # accepted for API parity; StyleGAN3 has no noise inputs
        update_emas: bool = False,
    ) -> torch.Tensor:                # [N, out_channels, out_size, out_size]
        _assert_shape(x, [None, self.in_channels, self.in_size, self.in_size], "SynthesisLayer input")
        _assert_shape(w, [x.shape[0], self.w_dim], "w")

        if update_emas:
            with torch.no_grad():
                magnitude = x.detach().to(torch.float32).square().mean()
                self.magnitude_ema.copy_(magnitude.lerp(self.magnitude_ema, self.magnitude_ema_beta))
        # Normalise the input by its running RMS so every layer sees unit-magnitude activations.
        input_gain = self.magnitude_ema.rsqrt()

        with _full_precision(w):
            styles = self.affine(w.float())
            if self.is_torgb:
                styles = styles * (1 / math.sqrt(self.in_channels * self.conv_kernel ** 2))

        x = modulated_conv2d(x, self.weight, styles, demodulate=not self.is_torgb,
                             padding=self.conv_kernel - 1, input_gain=input_gain)
        x = filtered_lrelu(x, self.up_filter, self.down_filter, self.bias,
                           up=self.up_factor, down=self.down_factor, padding=self.padding,
                           gain=self.act_gain, slope=self.act_slope, clamp=self.conv_clamp)
        _assert_shape(x, [None, self.out_channels, self.out_size, self.out_size], "SynthesisLayer output")
        return x

    def extra_repr(self) -> str:
        return (f"in={self.in_channels}x{self.in_size}@{self.in_sampling_rate}, "
                f"out={self.out_channels}x{self.out_size}@{self.out_sampling_rate}, "
                f"up={self.up_factor}, down={self.down_factor}, radial={self.down_radial}, torgb={self.is_torgb}")


class SynthesisNetwork(torch.nn.Module):
    """Input Fourier features, then num_layers + 1 layers whose cutoffs grow geometrically up to Nyquist."""

    def __init__(
        self,
        w_dim: int,                          # intermediate latent dimension
        img_resolution: int,                 # output resolution
        img_channels: int,                   # output colour channels
        channel_base: int = 32768,           # channels = min(channel_base / 2 / cutoff, channel_max)
        channel_max: int = 512,
        num_layers: int = 14,                # layers excluding the input and ToRGB
        num_critical: int = 2,               # critically sampled layers at the end
        first_cutoff: float = 2,             # f_c of the first layer
        first_stopband: float = 2 ** 2.1,    # minimum stopband f_t of the first layer
        last_stopband_rel: float = 2 ** 0.3, # minimum stopband of the last layer relative to its cutoff
        margin_size: int = 10,               # extra pixels around the image in the inner layers
        output_scale: float = 0.25,          # scale of the output image
        num_fp16_res: int = 4,               # NVlabs' fp16 flag for the highest resolutions (recorded only)
        **layer_kwargs: Any,                 # SynthesisLayer hyperparameters (conv_kernel, conv_clamp, …)
    ):
        super().__init__()
        self.w_dim = w_dim
        self.num_ws = num_layers + 2
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.num_layers = num_layers
        self.num_critical = num_critical
        self.margin_size = margin_size
        self.output_scale = float(output_scale)
        self.num_fp16_res = num_fp16_res

        # Cutoffs and minimum stopbands progress geometrically, then stay at Nyquist for the critical layers.
        last_cutoff = img_resolution / 2
        last_stopband = last_cutoff * last_stopband_rel
        exponents = np.minimum(np.arange(num_layers + 1) / (num_layers - num_critical), 1)
        cutoffs = first_cutoff * (last_cutoff / first_cutoff) ** exponents
        stopbands = first_stopband * (last_stopband / first_stopband) ** exponents

        # Smallest power-of-two sampling rate that holds the stopband (capped at the image resolution).
        sampling_rates = np.exp2(np.ceil(np.log2(np.minimum(stopbands * 2, img_resolution))))
        half_widths = np.maximum(stopbands, sampling_rates / 2) - cutoffs
        sizes = sampling_rates + margin_size * 2
        sizes[-2:] = img_resolution
        channels = np.rint(np.minimum((channel_base / 2) / cutoffs, channel_max))
        channels[-1] = img_channels

        self.input = SynthesisInput(w_dim=w_dim, channels=int(channels[0]), size=int(sizes[0]),
                                    sampling_rate=float(sampling_rates[0]), bandwidth=float(cutoffs[0]))
        self.layer_names: list[str] = []
        for idx in range(num_layers + 1):
            prev = max(idx - 1, 0)
            layer = SynthesisLayer(
                w_dim=w_dim,
                is_torgb=(idx == num_layers),
                is_critically_sampled=(idx >= num_layers - num_critical),
                use_fp16=bool(sampling_rates[idx] * (2 ** num_fp16_res) > img_resolution),
                in_channels=int(channels[prev]), out_channels=int(channels[idx]),
                in_size=int(sizes[prev]), out_size=int(sizes[idx]),
                in_sampling_rate=int(sampling_rates[prev]), out_sampling_rate=int(sampling_rates[idx]),
                in_cutoff=float(cutoffs[prev]), out_cutoff=float(cutoffs[idx]),
                in_half_width=float(half_widths[prev]), out_half_width=float(half_widths[idx]),
                **layer_kwargs,
            )
            name = f"L{idx}_{layer.out_size}_{layer.out_channels}"
            setattr(self, name, layer)
            self.layer_names.append(name)

    def forward(
        self,
        ws: torch.Tensor,             # [N, num_ws, w_dim]
        noise_mode: str = "const",    # accepted for API parity; StyleGAN3 has no noise inputs
        update_emas: bool = False,
        force_fp32: bool = True,      # accepted for NVlabs call compatibility; dtype follows the module/autocast
    ) -> torch.Tensor:                # [N, img_channels, img_resolution, img_resolution], float32
        _assert_shape(ws, [None, self.num_ws, self.w_dim], "ws")
        if noise_mode not in _NOISE_MODES:
            raise InputError(f"noise_mode must be one of {', '.join(_NOISE_MODES)}; got {noise_mode!r}")
        ws = ws.to(torch.float32).unbind(dim=1)

        x = self.input(ws[0])
        for name, w in zip(self.layer_names, ws[1:]):
            x = getattr(self, name)(x, w, noise_mode=noise_mode, update_emas=update_emas)
        if self.output_scale != 1:
            x = x * self.output_scale

        _assert_shape(x, [None, self.img_channels, self.img_resolution, self.img_resolution], "synthesis output")
        return x.to(torch.float32)


class Generator(torch.nn.Module):
    """StyleGAN3 generator: mapping network z -> ws, synthesis network ws -> image."""

    def __init__(
        self,
        z_dim: int,                                   # latent z dimension
        c_dim: int,                                   # label dimension, 0 = unconditional
        w_dim: int,                                   # intermediate latent w dimension
        img_resolution: int,                          # output resolution
        img_channels: int,                            # output colour channels
        mapping_kwargs: dict[str, Any] | None = None, # MappingNetwork hyperparameters (num_layers, …)
        **synthesis_kwargs: Any,                      # SynthesisNetwork / SynthesisLayer hyperparameters
    ):
        super().__init__()
        mapping_kwargs = dict(mapping_kwargs or {})
        self.init_kwargs = jsonable(dict(z_dim=z_dim, c_dim=c_dim, w_dim=w_dim, img_resolution=img_resolution,
                                           img_channels=img_channels, mapping_kwargs=mapping_kwargs,
                                           **synthesis_kwargs))
        self.z_dim = int(z_dim)
        self.c_dim = int(c_dim)
        self.w_dim = int(w_dim)
        self.img_resolution = int(img_resolution)
        self.img_channels = int(img_channels)
        self.synthesis = SynthesisNetwork(w_dim=self.w_dim, img_resolution=self.img_resolution,
                                          img_channels=self.img_channels, **synthesis_kwargs)
        self.num_ws = self.synthesis.num_ws
        self.mapping = MappingNetwork(z_dim=self.z_dim, c_dim=self.c_dim, w_dim=self.w_dim,
                                      num_ws=self.num_ws, **mapping_kwargs)

    def forward(
        self,
        z: torch.Tensor,                      # [N, z_dim]
        c: torch.Tensor | None = None,        # [N, c_dim]; None or [N, 0] when unconditional
        truncation_psi: float | torch.Tensor = 1.0,  # 1 = no truncation; a 0-d tensor is fine
        truncation_cutoff: int | None = None, # truncate only the first this many ws, None = all
        noise_mode: str = "const",
        update_emas: bool = False,
        truncation_centre: torch.Tensor | None = None,  # what psi pulls towards: MappingNetwork.forward
    ) -> torch.Tensor:                        # [N, img_channels, img_resolution, img_resolution]
        ws = self.mapping(z, c, truncation_psi=truncation_psi, truncation_cutoff=truncation_cutoff,
                          update_emas=update_emas, truncation_centre=truncation_centre)
        return self.synthesis(ws, noise_mode=noise_mode, update_emas=update_emas)


def generator_from_record(rec: Any) -> Generator:
    """Build our Generator from an NVlabs StyleGAN3 `G`/`G_ema` PersistentRecord and load its tensors.

    The saved filter buffers, Fourier frequencies and magnitude EMAs are loaded as
    saved (not recomputed), so the network is the one that was trained.
    Raises ModelLoadError when the record is not a StyleGAN3 generator or does not fit.
    """
    class_name = getattr(rec, "class_name", None)
    if class_name != "Generator":
        raise ModelLoadError(f"expected an NVlabs StyleGAN3 'Generator' record, got {class_name!r}; "
                             "use the pickle's 'G_ema' entry")
    if getattr(rec, "init_args", ()):
        raise ModelLoadError("the StyleGAN3 generator was saved with positional constructor arguments, "
                             "which NVlabs' code never does; the pickle is not a supported network pickle")
    state = rec.state_dict()
    if "synthesis.input.freqs" not in state:
        raise ModelLoadError("this generator has no Fourier-feature input (synthesis.input.freqs), so it is not "
                             "StyleGAN3; load it as StyleGAN2")
    try:
        kwargs = jsonable(dict(rec.init_kwargs))
    except InputError as exc:
        raise ModelLoadError(f"the pickled StyleGAN3 generator has an argument we cannot use: {exc}") from None
    # bounds first, then a meta-device build compared with the tensors, then the real build (arch_limits)
    G = build_and_load(lambda: Generator(**kwargs), {k: v.to(torch.float32) for k, v in state.items()},
                       "StyleGAN3 generator", kwargs=kwargs)
    return G.eval()
