"""Triton kernels for the StyleGAN FIR ops: one memory pass per axis, any dtype, inference only.

Why: cuDNN has no good kernel for a depthwise 1-D FIR. On an H200 the reference ops (grouped
depthwise convs, or 1-in/1-out channel convs on an [N*C, 1, H, W] view) run in half precision
as tensor-core implicit GEMMs that pad C = K = 1 into 64x64 tiles and transpose the layout
around every call: StyleGAN3-T spent 576 of 590 device-ms there (docs/perf-notes.md). The FIR is
bandwidth-bound work; this kernel reads each input once, accumulates in float32 and writes each
output once, whatever the dtype and memory format.

The op: 1-D upfirdn along one axis of a tensor seen as [A, L, B] (L = the filtered axis; B = the
stride-1 elements after it):

    y[a, j, b] = sum_k c[k] * z[a, j * down + k, b],   z = zero-insert(x, up), padded by (pad0, pad1)

with c the *correlation* taps (the caller flips a convolution filter and folds in the gains).
Optional fusions, so a StyleGAN layer needs no extra passes:
  - prologue: `+ bias[channel]` on each real input sample (never on inserted or padded zeros),
    the channel of row a being (a // bias_div) % bias_channels;
  - epilogue: leaky ReLU (slope), then * act_gain, then clamp to +-clamp.

`fir1d` launches the kernel directly (CUDA, or the CPU under TRITON_INTERPRET=1, which is how the
CPU tests run it); `fir1d_op` is the same thing registered as the custom op `atelier::fir1d`, so
torch.compile traces into the kernel and CUDA graphs capture it.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["available", "unavailable_reason", "fir1d", "fir1d_op"]


@functools.lru_cache(maxsize=None)
def _import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"Triton is not importable ({type(e).__name__}: {e})"
    return None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def unavailable_reason(device: torch.device | str) -> str | None:
    """None if the kernels can run on `device`, else why not (for the toggle's note)."""
    err = _import_error()
    if err:
        return err
    dev = torch.device(device)
    if dev.type == "cuda":
        return None
    if dev.type == "cpu" and interpreting():
        return None
    return f"the Triton FIR kernels run on CUDA GPUs (here: {dev.type}); the plain-PyTorch ops run instead"


def available(device: torch.device | str) -> bool:
    return unavailable_reason(device) is None


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fir1d_kernel(x_ptr, y_ptr, c_ptr, bias_ptr,
                     A, L, B, Lo,                       # x is [A, L, B], y is [A, Lo, B], contiguous
                     PAD0,                              # run time: one compiled kernel serves every padding
                     bias_div, bias_channels,
                     slope, act_gain, clamp,
                     TAPS: tl.constexpr, UP: tl.constexpr, DOWN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr,
                     BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        total = A.to(tl.int64) * Lo * B
        live = offs < total
        b = offs % B
        rest = offs // B
        j = rest % Lo
        a = rest // Lo
        row = a * L * B + b
        if HAS_BIAS:
            ch = (a // bias_div) % bias_channels
            bias = tl.load(bias_ptr + ch, mask=live, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(TAPS):
            m = j * DOWN + k - PAD0                     # index into the zero-inserted sequence
            i = m // UP
            ok = live & (m >= 0) & (i < L)
            if UP > 1:
                ok = ok & ((m % UP) == 0)
            v = tl.load(x_ptr + row + i * B, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                v = tl.where(ok, v + bias, 0.0)
            acc += v * tl.load(c_ptr + k).to(tl.float32)
        if ACT:
            acc = tl.where(acc >= 0, acc, acc * slope) * act_gain
        if CLAMP:
            acc = tl.minimum(tl.maximum(acc, -clamp), clamp)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=live)

    return fir1d_kernel


_BLOCK = 1024
_BLOCK_INTERPRETED = 1 << 16


def out_length(length: int, taps: int, up: int, down: int, pad0: int, pad1: int) -> int:
    return (length * up + pad0 + pad1 - taps) // down + 1


def _launch(x: torch.Tensor, taps: torch.Tensor, dim: int, up: int, down: int, pad0: int, pad1: int,
            bias: torch.Tensor | None, bias_div: int, slope: float | None, act_gain: float,
            clamp: float | None, out: torch.Tensor | None = None, launcher=None) -> torch.Tensor:
    x = x.contiguous()
    shape = list(x.shape)
    L = shape[dim]
    A = 1
    for s in shape[:dim]:
        A *= s
    B = 1
    for s in shape[dim + 1:]:
        B *= s
    T = int(taps.shape[0])
    Lo = out_length(L, T, up, down, pad0, pad1)
    if Lo <= 0:
        raise ValueError(f"fir1d: output length {Lo} <= 0 (length {L}, taps {T}, up {up}, down {down}, "
                         f"pad {pad0}/{pad1})")
    shape[dim] = Lo
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    c = taps.to(device=x.device, dtype=torch.float32).contiguous()
    has_bias = bias is not None
    b = bias.to(device=x.device).contiguous() if has_bias else c      # any valid pointer when unused
    total = A * Lo * B
    kernel = _kernel()
    if launcher is not None:
        kernel = launcher(kernel)
    # The interpreter runs each program as numpy calls: bigger blocks mean fewer, longer calls.
    block = _BLOCK_INTERPRETED if interpreting() else _BLOCK
    grid = ((total + block - 1) // block,)
    kernel[grid](x, y, c, b, A, L, B, Lo, int(pad0),
                 int(bias_div), int(b.shape[0]) if has_bias else 1,
                 float(slope if slope is not None else 1.0), float(act_gain), float(clamp or 0.0),
                 TAPS=T, UP=int(up), DOWN=int(down),
                 HAS_BIAS=has_bias, ACT=slope is not None, CLAMP=clamp is not None,
                 BLOCK=block, num_warps=4)
    return y


def fir1d(x: torch.Tensor, taps: torch.Tensor, dim: int, up: int = 1, down: int = 1, pad0: int = 0, pad1: int = 0,
          bias: torch.Tensor | None = None, bias_div: int = 1, slope: float | None = None, act_gain: float = 1.0,
          clamp: float | None = None) -> torch.Tensor:
    """1-D upfirdn of `x` along `dim` with correlation taps `taps` (float32 math, x's dtype out).

    Padding may be negative (a crop). `bias` (with `bias_div`) is added to every real input sample
    of row a before filtering; `slope`/`act_gain`/`clamp` run on the output (slope None = no
    activation). Not differentiable: inference only.
    """
    return _launch(x, taps, dim % x.ndim, up, down, pad0, pad1, bias, bias_div, slope, act_gain, clamp)


@functools.lru_cache(maxsize=None)
def _registered():
    """Register `atelier::fir1d` (a triton_op: torch.compile sees the kernel) once, lazily."""
    from torch.library import triton_op, wrap_triton

    @triton_op("atelier::fir1d", mutates_args=())
    def _fir1d_op(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None, dim: int, up: int, down: int,
                  pad0: int, pad1: int, bias_div: int, slope: float, use_act: bool, act_gain: float,
                  clamp: float, use_clamp: bool) -> torch.Tensor:
        return _launch(x, taps, dim, up, down, pad0, pad1, bias, bias_div, slope if use_act else None, act_gain,
                       clamp if use_clamp else None, launcher=wrap_triton)

    return _fir1d_op


def fir1d_op(x: torch.Tensor, taps: torch.Tensor, dim: int, up: int = 1, down: int = 1, pad0: int = 0,
             pad1: int = 0, bias: torch.Tensor | None = None, bias_div: int = 1, slope: float | None = None,
             act_gain: float = 1.0, clamp: float | None = None) -> torch.Tensor:
    """`fir1d` through the registered custom op (the form to use inside compiled or graphed code)."""
    op = _registered()
    return op(x.contiguous(), taps, bias, dim % x.ndim, int(up), int(down), int(pad0), int(pad1), int(bias_div),
              float(slope if slope is not None else 1.0), slope is not None, float(act_gain),
              float(clamp if clamp is not None else 0.0), clamp is not None)
