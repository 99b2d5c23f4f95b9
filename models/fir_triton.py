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

import torch

from core.triton_support import import_error as _import_error, interpreting  # noqa: F401  (re-exported)

__all__ = ["available", "unavailable_reason", "ensure_registered", "fir1d", "fir1d_op"]


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


# Tiles (BLOCK_L outputs along L by BLOCK_B columns) and warps the autotuner picks from, per shape. The
# contiguous axis is the tile's inner one: B, or L when the columns are the tensor's rows.
_CONFIGS = ((16, 128, 4), (8, 256, 8), (128, 16, 4), (256, 8, 8))
_TILE_INTERPRETED = 1 << 15     # the interpreter runs each program as numpy calls: one big tile


def _body():
    import triton
    import triton.language as tl

    def fir1d_kernel(x_ptr, y_ptr, c_ptr, bias_ptr,
                     L, Lo, ROWS,                       # filtered length in and out; rows of the [ROWS, L, B] view
                     sA, sL, sB, oA, oL, oB,            # element strides of x and y: row, position, column
                     B,                                 # columns (the tensor's rows when ROWS_IN_B)
                     PAD0,                              # run time: one compiled kernel serves every padding
                     bias_div, bias_channels,
                     slope, act_gain, clamp,
                     TAPS: tl.constexpr, UP: tl.constexpr, DOWN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, ROWS_IN_B: tl.constexpr,
                     BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr):
        # One program: a BLOCK_L x BLOCK_B tile (outputs along L by columns along B) of one row. The
        # (row, tile) split is three scalar divisions per program, none per element.
        nb = tl.cdiv(B, BLOCK_B)
        nj = tl.cdiv(Lo, BLOCK_L)
        pid = tl.program_id(0)
        bt = pid % nb
        rest = pid // nb
        jt = rest % nj
        a = (rest // nj).to(tl.int64)
        j = jt * BLOCK_L + tl.arange(0, BLOCK_L)
        b = (bt * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        # The contiguous axis goes last in the tile, where Triton lays out a warp's threads.
        if ROWS_IN_B:
            jj = j[None, :]
            bb = b[:, None]
        else:
            jj = j[:, None]
            bb = b[None, :]
        live = (jj < Lo) & (bb < B)
        if HAS_BIAS:
            if ROWS_IN_B:        # columns are the tensor's rows: one bias per column
                bias = tl.load(bias_ptr + (bb // bias_div) % bias_channels, mask=bb < B, other=0.0)
            else:
                bias = tl.load(bias_ptr + (a // bias_div) % bias_channels)
            bias = bias.to(tl.float32)
        x_tile = x_ptr + a * sA + bb * sB
        acc = (jj + bb).to(tl.float32) * 0.0            # zeros of the tile's shape
        for k in tl.static_range(TAPS):
            m = jj * DOWN + (k - PAD0)                  # index into the zero-inserted sequence
            ok = live & (m >= 0) & (m < L * UP)
            if UP > 1:
                ok = ok & ((m % UP) == 0)
            i = tl.where(ok, m // UP, 0).to(tl.int64)
            v = tl.load(x_tile + i * sL, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                v = tl.where(ok, v + bias, 0.0)
            acc += v * tl.load(c_ptr + k)
        if ACT:
            acc = tl.where(acc >= 0, acc, acc * slope) * act_gain
        if CLAMP:
            acc = tl.minimum(tl.maximum(acc, -clamp), clamp)
        y_ptrs = y_ptr + a * oA + jj.to(tl.int64) * oL + bb * oB
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live)

    return fir1d_kernel


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted kernel: autotuned over _CONFIGS on a GPU, one large tile in the interpreter."""
    import triton

    fn = triton.jit(_body())
    if interpreting():
        return fn
    configs = [triton.Config({"BLOCK_L": bl, "BLOCK_B": bb}, num_warps=w) for bl, bb, w in _CONFIGS]
    return triton.autotune(configs=configs, key=["L", "Lo", "B", "ROWS", "TAPS", "UP", "DOWN", "ROWS_IN_B"],
                           warmup=3, rep=10)(fn)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interpreted_blocks(Lo: int, B: int, rows_in_b: bool) -> dict[str, int]:
    tile = _TILE_INTERPRETED
    if rows_in_b:
        block_l = min(tile, _pow2(Lo))
        return {"BLOCK_L": block_l, "BLOCK_B": max(1, min(tile // block_l, _pow2(B)))}
    block_b = min(tile, _pow2(B))
    return {"BLOCK_L": max(1, min(tile // block_b, _pow2(Lo))), "BLOCK_B": block_b}


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
    if y.numel() == 0:
        return y
    c = taps.to(device=x.device, dtype=torch.float32).contiguous()
    has_bias = bias is not None
    b = bias.to(device=x.device).contiguous() if has_bias else c      # any valid pointer when unused
    kernel = _kernel()
    if launcher is not None:
        kernel = launcher(kernel)
    rows_in_b = B == 1
    if rows_in_b:
        # Filtering the last axis: the rows become the tile's columns (stride L), so one program
        # covers many rows instead of one.
        rows, cols = 1, A
        strides = (0, 1, L, 0, 1, Lo)
    else:
        rows, cols = A, B
        strides = (L * B, B, 1, Lo * B, B, 1)
    blocks = _interpreted_blocks(Lo, cols, rows_in_b) if interpreting() else {}

    def grid(meta):
        return (rows * triton_cdiv(Lo, meta["BLOCK_L"]) * triton_cdiv(cols, meta["BLOCK_B"]),)

    kernel[grid](x, y, c, b, L, Lo, rows, *strides, cols, int(pad0),
                 int(bias_div), int(b.shape[0]) if has_bias else 1,
                 float(slope if slope is not None else 1.0), float(act_gain), float(clamp or 0.0),
                 TAPS=T, UP=int(up), DOWN=int(down),
                 HAS_BIAS=has_bias, ACT=slope is not None, CLAMP=clamp is not None, ROWS_IN_B=rows_in_b,
                 **blocks)
    return y


def triton_cdiv(n: int, d: int) -> int:
    return (n + d - 1) // d


def fir1d(x: torch.Tensor, taps: torch.Tensor, dim: int, up: int = 1, down: int = 1, pad0: int = 0, pad1: int = 0,
          bias: torch.Tensor | None = None, bias_div: int = 1, slope: float | None = None, act_gain: float = 1.0,
          clamp: float | None = None) -> torch.Tensor:
    """1-D upfirdn of `x` along `dim` with correlation taps `taps` (float32 math, x's dtype out).

    Padding may be negative (a crop). `bias` (with `bias_div`) is added to every real input sample
    of row a before filtering; `slope`/`act_gain`/`clamp` run on the output (slope None = no
    activation). Not differentiable: inference only.
    """
    return _launch(x, taps, dim % x.ndim, up, down, pad0, pad1, bias, bias_div, slope, act_gain, clamp)


def ensure_registered() -> None:
    """Register the custom ops now (eagerly): call before torch.compile traces code that uses them
    (`atelier::fir1d` and the fused `atelier::filtered_lrelu` of models/filtered_lrelu_triton.py)."""
    from models import filtered_lrelu_triton

    _registered()
    filtered_lrelu_triton.ensure_registered()


@functools.lru_cache(maxsize=None)
def _registered():
    """Register `atelier::fir1d` (a triton_op: torch.compile sees the kernel) once. Lazily, because importing
    the registration machinery pulls in Triton and Inductor (seconds at start-up on a CPU)."""
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
    """`fir1d` through the registered custom op (the form to use inside compiled or graphed code).

    Dynamo cannot trace `triton_op` itself, only calls of the registered op: the op is registered on the
    first eager call, and `models.kernels.resolve` registers it before any compiled run.
    """
    if not torch.compiler.is_compiling():
        _registered()
    return torch.ops.atelier.fir1d(x.contiguous(), taps, bias, dim % x.ndim, int(up), int(down), int(pad0), int(pad1), int(bias_div),
              float(slope if slope is not None else 1.0), slope is not None, float(act_gain),
              float(clamp if clamp is not None else 0.0), clamp is not None)

