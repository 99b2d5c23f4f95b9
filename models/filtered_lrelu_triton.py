"""StyleGAN3's filtered leaky ReLU as one Triton kernel per output tile, inference only.

The op (NVlabs' `_filtered_lrelu_ref`, flip_filter=False; models/stylegan3.py:filtered_lrelu):

    y = downfir(act(upfir(x + bias, fu, up, padding)), fd, down)

with separable 1-D filters fu / fd, act = clamp(leaky_relu(., slope) * gain, +-clamp). The four 1-D
passes of models/fir_triton.py each read and write a whole tensor, the up x up upsampled
intermediate among them (StyleGAN3-T-1024: 45 of 66.8 ms in fp32 on an H200, ~10 % of the copy
rate). Here one program computes a tile of outputs of one (n, c) and nothing but the input tile
(with its halo) is read from memory and nothing but the output tile is written.

Why matrix products. Triton has no explicit shared memory and cannot shift or slice a register
tensor, so a FIR along an axis of an on-chip tile cannot be a sum of shifted copies (only loads
from memory can shift, and re-deriving the upsampled tile once per down-filter tap would cost
~50x the multiply-adds). A 1-D upfirdn along one axis of a tile *is* a banded matrix product,
`rows @ M` (x) or `M @ cols` (y), which `tl.dot` computes in the tensor cores with its operands
staged in shared memory by the compiler. Per tile, along each axis (same block sizes for y and x):

    BI inputs  --up (M_up: BU x BI, polyphase taps, gain up folded in)-->  BU upsampled samples
    BU upsampled --act--> --down (M_down: BO x BU, taps every `down` columns)--> BO outputs

    X[BI, BI] -> X @ M_up_x^T [BI, BU] -> M_up_y @ . [BU, BU] -> act -> . @ M_down_x^T [BU, BO]
              -> M_down_y @ . [BO, BO]

of which VO <= BO outputs per axis are valid (the rest multiply padding; masked at the store). The
banded matrices are built in the kernel from the taps (a gather of at most TU + TD floats per
program, L1-resident): no host-side tensors per call, so CUDA graphs capture the op as it is.

Halo (per axis, output tile starting at j0): the upsampled samples it needs are
u in [j0*down, j0*down + (VO-1)*down + TD) (NU of them); upsampled sample u is
sum_k cu[k] * x[(u + k - pad0) / up] over the k where that index is an integer, so with
i0 = floor((j0*down - pad0) / up) and rem = j0*down - pad0 - up*i0 in [0, up) the inputs are
x[i0 + b], b in [0, NI), NI = (rem + NU - 1 + TU - 1) // up + 1, and M_up[a, b] = cu[up*b - rem - a].
`valid_outputs` picks VO so that NU <= BU and NI <= BI for every rem.

Cost per valid output: with (BI, BU, BO) = (32, 64, 32), up 2 / down 2, 12 + 12 taps, VO = 21:
32*32*64 + 64*32*64 + 64*64*32 + 32*64*32 MACs per 441 outputs = 892 MAC; (64, 64, 32), VO = 27: 988;
up 4 / down 2 (24 + 12 taps), (32, 64, 32), VO = 27: 539 MAC. That is ~10x the taps NVlabs' CUDA kernel multiplies (the
banded matrices are mostly zero) but it runs on tensor cores: fp32 inputs in "tf32x3" (three TF32
products, ~fp32 accuracy), bf16/fp16 inputs in single "tf32" (its 10-bit mantissa is at least the
input's). Registers: the largest live tile is BU x BU fp32 (64 x 64 = 16 KiB: 32 registers a thread at 4
warps; 128 x 128 needs 8 warps). Compiled for sm_90 (triton 3.7, ptxas, no GPU needed:
`scripts/fir_kernels_check.py --compile-only`) every config below uses wgmma (mma.sync for BU = 32)
and spills nothing: fp32/tf32x3 168-231 registers a thread at BU = 64, 255 at BU = 128 (8 warps);
bf16/tf32 79-127 (215 at BU = 128); fp32/ieee (FMA dots) 255 at BU = 64. The autotuner chooses among
the configs `configs` lists for the case.

Dtypes: fp32 / bf16 / fp16 in, float32 accumulation, x's dtype out. Any strides (NCHW or
channels_last; NCHW tiles are coalesced along W, channels_last loads are strided by C).
Not differentiable; `stylegan3.filtered_lrelu` calls this only with autograd off.
"""
from __future__ import annotations

import functools
import os

import torch

from models.fir_triton import available, interpreting, unavailable_reason  # noqa: F401

__all__ = ["available", "unavailable_reason", "qualifies", "filtered_lrelu", "filtered_lrelu_op",
           "valid_outputs", "configs"]

# (BI, BU, BO, num_warps) candidates; `configs` keeps the ones that fit a case (VO >= BO / 2).
_CANDIDATES = ((32, 64, 32, 4), (32, 64, 16, 4), (64, 128, 64, 8), (64, 64, 32, 4), (32, 32, 16, 4),
               (16, 32, 16, 4))
_FACTORS = (1, 2, 4)
_MAX_TAPS = 48

# tl.dot precision per input dtype on a GPU: fp32 keeps ~fp32 accuracy (the NVlabs pickles reproduce
# to 1e-4). 16-bit inputs take fp16 operands: TF32's 10-bit mantissa at twice its MMA rate. Measured on
# the H200 over StyleGAN3-T-1024's 15 calls in bf16 (scripts/flrelu_sweep.py, docs/results/
# 2026-12-02-*-flrelu-sweep.json): tf32 9.10 ms, rel. err 3.8e-3; fp16 8.38 ms, 2.5e-3; bf16 operands
# 8.31 ms, 6.8e-3. "ieee" (CUDA-core FMAs) is the A/B alternative for fp32.
DOT_PRECISION = {torch.float32: "tf32x3", torch.bfloat16: "fp16", torch.float16: "fp16"}


def _dot_overrides(spec: str) -> dict:
    """ATELIER_FLRELU_DOT="bfloat16=fp16,float16=fp16": A/B runs of the dot precision per input dtype
    (tf32x3, tf32, ieee, or fp16 / bf16 operands), without a code change."""
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, prec = item.partition("=")
        prec = prec.strip()
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or prec not in ("tf32x3", "tf32", "ieee", "fp16", "bf16"):
            raise ValueError(f"ATELIER_FLRELU_DOT: cannot read {item!r}; write e.g. bfloat16=fp16,float32=tf32x3")
        out[dtype] = prec
    return out


DOT_PRECISION.update(_dot_overrides(os.environ.get("ATELIER_FLRELU_DOT", "")))

# With 16-bit dot operands one tile wins or ties at every size on the H200: (BI 32, BU 64, BO 32,
# 4 warps). Over SG3-T-1024's 15 calls (scripts/flrelu_sweep.py, docs/results/2026-12-02-fe84367-
# flrelu-sweep.json): 6.90 ms with it, 6.84 at each call's own best, 8.38 as autotuned (the
# autotuner's 10 ms timing windows picked worse tiles at the 1044-pixel layers). So those precisions
# take the fixed tile and skip autotuning (also 10-20 s off a first call); TF32 / fp32 dots, where
# (64, 64, 32) wins at the large layers, keep the autotuner. ATELIER_FLRELU_AUTOTUNE=1 autotunes all.
_FIXED_TILE = (32, 64, 32, 4)
_FIXED_TILE_PRECISIONS = ("fp16", "bf16")


def fixed_tile(up: int, down: int, tu: int, td: int, precision: str) -> tuple | None:
    """The measured tile for this case and dot precision, or None (autotune)."""
    if precision not in _FIXED_TILE_PRECISIONS or os.environ.get("ATELIER_FLRELU_AUTOTUNE") == "1":
        return None
    bi, bu, bo = _normalize(*_FIXED_TILE[:3], up, down, tu, td)
    vo = valid_outputs(bi, bu, bo, up, down, tu, td)
    return (bi, bu, bo, vo, _FIXED_TILE[3]) if vo >= max(1, bo // 2) else None


def valid_outputs(bi: int, bu: int, bo: int, up: int, down: int, tu: int, td: int) -> int:
    """Valid outputs per tile axis for blocks (BI inputs, BU upsampled, BO outputs); 0 = does not fit.

    The halo (module docstring): NU = (VO - 1) * down + TD upsampled samples, NI inputs for the worst
    phase rem = up - 1. Without an up pass BI = BU; without a down pass BO = BU.
    """
    has_up, has_down = up > 1 or tu > 1, down > 1 or td > 1
    for vo in range(bo, 0, -1):
        nu = (vo - 1) * down + td if has_down else vo
        if nu > bu:
            continue
        if has_up and (up - 1 + nu - 1 + tu - 1) // up + 1 > bi:
            continue
        return vo
    return 0


def _normalize(bi: int, bu: int, bo: int, up: int, down: int, tu: int, td: int) -> tuple[int, int, int]:
    if not (up > 1 or tu > 1):
        bi = bu
    if not (down > 1 or td > 1):
        bo = bu
    return bi, bu, bo


@functools.lru_cache(maxsize=None)
def configs(up: int, down: int, tu: int, td: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """(BI, BU, BO, VO, num_warps) of the tiles that fit a case (at least half of BO valid), the autotuner's
    choices on a GPU; the first is the interpreter's and a fixed run's tile."""
    out = {}
    for bi, bu, bo, warps in _CANDIDATES:
        bi, bu, bo = _normalize(bi, bu, bo, up, down, tu, td)
        vo = valid_outputs(bi, bu, bo, up, down, tu, td)
        if vo >= max(1, bo // 2):
            out.setdefault((bi, bu, bo), (bi, bu, bo, vo, warps))
    # First (the interpreter's and a fixed run's pick): 64 upsampled samples a tile axis, most outputs.
    return tuple(sorted(out.values(), key=lambda c: (c[1] != 64, -c[3], _macs_per_output(c, up, down, tu, td))))


def _macs_per_output(cfg, up, down, tu, td) -> float:
    bi, bu, bo, vo, _ = cfg
    macs = 0
    if up > 1 or tu > 1:
        macs += bi * bi * bu + bu * bi * bu
    if down > 1 or td > 1:
        macs += bu * bu * bo + bo * bu * bo
    return (macs + bo * bo) / (vo * vo)


def qualifies(x: torch.Tensor, up_filter, down_filter, up: int, down: int) -> bool:
    """The fused kernel covers this call: 4-D input, separable (1-D) or absent filters, up/down in
    1/2/4, up to 48 taps, a tile config that fits. Radial (2-D) filters (StyleGAN3-R) do not."""
    if x.ndim != 4 or up not in _FACTORS or down not in _FACTORS:
        return False
    if any(f is not None and (f.ndim != 1 or f.shape[0] > _MAX_TAPS) for f in (up_filter, down_filter)):
        return False
    if up_filter is None and up != 1:
        return False
    tu = 1 if up_filter is None else int(up_filter.shape[0])
    td = 1 if down_filter is None else int(down_filter.shape[0])
    if torch.compiler.is_compiling():
        return _fits(up, down, tu, td)        # plain integer loops: Dynamo folds them to a constant
    key = (up, down, tu, td)
    fits = _FITS.get(key)
    if fits is None:                          # eager: a dict lookup per call after the first
        fits = _FITS[key] = _fits(up, down, tu, td)
    return fits


_FITS: dict[tuple[int, int, int, int], bool] = {}


def _fits(up: int, down: int, tu: int, td: int) -> bool:
    for bi, bu, bo, _ in _CANDIDATES:
        bi, bu, bo = _normalize(bi, bu, bo, up, down, tu, td)
        if valid_outputs(bi, bu, bo, up, down, tu, td) >= max(1, bo // 2):
            return True
    return False


_flrelu_dot = None          # the jitted dot helper, set by _jitted() (the kernel finds it by this name)


def _dot_body():
    """`_flrelu_dot(a, b, PRECISION)`: one tl.dot at the kernel's dot precision. fp16 operands (TF32's
    mantissa at twice its MMA rate: the 16-bit default) or bf16, or fp32 operands with a literal
    input_precision per branch (a compiled graph's launcher handed the constexpr over in a form
    tl.dot refused on the H200, 2026-12-02). Jitted next to the kernel, which finds it by name."""
    import triton.language as tl

    def _flrelu_dot(a, b, PRECISION: tl.constexpr):     # the name the kernel calls (inductor copies it)
        if PRECISION == "fp16":
            out = tl.dot(a.to(tl.float16), b.to(tl.float16))
        elif PRECISION == "bf16":
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif PRECISION == "tf32":
            out = tl.dot(a, b, input_precision="tf32")
        elif PRECISION == "ieee":
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision="tf32x3")
        return out

    return _flrelu_dot


def _body():
    import triton.language as tl

    def filtered_lrelu_kernel(
            x_ptr, y_ptr, cu_ptr, cd_ptr, bias_ptr,
            C, H, W, Ho, Wo,                      # channels, input and output height / width
            sN, sC, sH, sW, oN, oC, oH, oW,        # element strides of x and y
            QY, RY, QX, RX,                       # -pad0 = up * Q + R, R in [0, up): floor division by the host
            slope, gain, clamp,
            UP: tl.constexpr, DOWN: tl.constexpr, TU: tl.constexpr, TD: tl.constexpr,
            HAS_BIAS: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr, PRECISION: tl.constexpr,
            BI: tl.constexpr, BU: tl.constexpr, BO: tl.constexpr, VO: tl.constexpr):
        HAS_UP: tl.constexpr = UP > 1 or TU > 1
        HAS_DOWN: tl.constexpr = DOWN > 1 or TD > 1
        # One program: a VO x VO block of outputs of one (n, c); three scalar divisions, none per element.
        TILES_X = tl.cdiv(Wo, VO)             # grid = N * C * tiles_y * tiles_x
        TILES_Y = tl.cdiv(Ho, VO)
        pid = tl.program_id(0)
        tx = pid % TILES_X
        rest = pid // TILES_X
        ty = rest % TILES_Y
        nc = rest // TILES_Y
        n = (nc // C).to(tl.int64)
        c = nc % C
        jy0 = ty * VO
        jx0 = tx * VO
        uy0 = jy0 * DOWN                      # first upsampled row / column the tile needs
        ux0 = jx0 * DOWN
        x_base = x_ptr + n * sN + c.to(tl.int64) * sC

        ia = tl.arange(0, BI)
        ua = tl.arange(0, BU)
        oa = tl.arange(0, BO)

        # Index math stays 1-D; 2-D tensors come only from comparisons and pointer offsets (the
        # interpreter checks every 2-D int32 add for overflow, which made it 2x slower).
        if HAS_UP:
            # Input window (with halo): rows iy0 + b, columns ix0 + b, b < BI (module docstring).
            ty_ = uy0 + RY
            remy = ty_ % UP
            iy = ty_ // UP + QY + ia
            tx_ = ux0 + RX
            remx = tx_ % UP
            ix = tx_ // UP + QX + ia
        else:
            # No upsampling filter: upsampled sample u is the padded input x[u - pad0].
            iy = uy0 + QY + ua
            ix = ux0 + QX + ua
        ok = (((iy >= 0) & (iy < H))[:, None]) & (((ix >= 0) & (ix < W))[None, :])
        v = tl.load(x_base + (iy * sH)[:, None] + (ix * sW)[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = tl.where(ok, v + tl.load(bias_ptr + c).to(tl.float32), 0.0)   # never on the zero padding

        if HAS_UP:
            # M_up_x^T[b, a] = cu[up*b - remx - a]; M_up_y[a, b] = cu[up*b - remy - a] (gain up folded in).
            kx = UP * ia - remx
            mx = tl.load(cu_ptr + kx[:, None] - ua[None, :],
                         mask=(kx[:, None] >= ua[None, :]) & (kx[:, None] < ua[None, :] + TU), other=0.0)
            ky = UP * ia - remy
            my = tl.load(cu_ptr + ky[None, :] - ua[:, None],
                         mask=(ky[None, :] >= ua[:, None]) & (ky[None, :] < ua[:, None] + TU), other=0.0)
            t = _flrelu_dot(v, mx, PRECISION)            # [BI, BU]: along x
            s = _flrelu_dot(my, t, PRECISION)            # [BU, BU]: along y
        else:
            s = v

        if ACT:
            s = tl.where(s >= 0, s, s * slope)
        s = s * gain
        if CLAMP:
            s = tl.minimum(tl.maximum(s, -clamp), clamp)

        if HAS_DOWN:
            # M_down_x^T[a, o] = cd[a - o*down]; M_down_y[o, a] = cd[a - o*down].
            od = oa * DOWN
            dx = tl.load(cd_ptr + ua[:, None] - od[None, :],
                         mask=(ua[:, None] >= od[None, :]) & (ua[:, None] < od[None, :] + TD), other=0.0)
            dy = tl.load(cd_ptr + ua[None, :] - od[:, None],
                         mask=(ua[None, :] >= od[:, None]) & (ua[None, :] < od[:, None] + TD), other=0.0)
            s = _flrelu_dot(s, dx, PRECISION)            # [BU, BO]
            s = _flrelu_dot(dy, s, PRECISION)            # [BO, BO]

        jy = jy0 + oa
        jx = jx0 + oa
        live = (((oa < VO) & (jy < Ho))[:, None]) & (((oa < VO) & (jx < Wo))[None, :])
        y_ptrs = y_ptr + n * oN + c.to(tl.int64) * oC + (jy * oH)[:, None] + (jx * oW)[None, :]
        tl.store(y_ptrs, s.to(y_ptr.dtype.element_ty), mask=live)

    return filtered_lrelu_kernel


@functools.lru_cache(maxsize=None)
def _jitted():
    import triton

    globals()["_flrelu_dot"] = triton.jit(_dot_body())      # resolved by name when the kernel compiles
    return triton.jit(_body())


@functools.lru_cache(maxsize=None)
def _kernel(up: int, down: int, tu: int, td: int, fixed: tuple | None = None):
    """The jitted kernel; on a GPU autotuned over the configs that fit this (up, down, taps) case.
    `fixed` = one (BI, BU, BO, VO, warps) config (the interpreter, tests, A/B runs)."""
    import triton

    fn = _jitted()
    if fixed is not None or interpreting():
        return fn
    cfgs = [triton.Config({"BI": bi, "BU": bu, "BO": bo, "VO": vo}, num_warps=w)
            for bi, bu, bo, vo, w in configs(up, down, tu, td)]
    return triton.autotune(configs=cfgs, key=["H", "W", "Ho", "Wo", "C"], warmup=3, rep=10)(fn)


def out_size(length: int, up: int, down: int, tu: int, td: int, pad0: int, pad1: int) -> int:
    return (length * up + pad0 + pad1 - (tu - 1) - (td - 1) + (down - 1)) // down


def _launch(x, cu, cd, bias, up, down, pad, gain, slope, clamp, out=None, config=None, launcher=None):
    n, c, h, w = x.shape
    px0, px1, py0, py1 = (int(p) for p in pad)
    tu, td = int(cu.shape[0]), int(cd.shape[0])
    ho = out_size(h, up, down, tu, td, py0, py1)
    wo = out_size(w, up, down, tu, td, px0, px1)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"filtered_lrelu: output size {ho}x{wo} <= 0 (input {h}x{w}, up {up}, down {down}, "
                         f"taps {tu}/{td}, padding {list(pad)})")
    # NCHW always: a tile filters along W, so channels_last loads are strided by C (measured 3x slower
    # on the H200 at StyleGAN3-T-1024, 14.5 vs 5.0 ms: inductor hands conv outputs over as NHWC). One
    # copy of the input costs far less; the output is NCHW too.
    x = x.contiguous()
    fmt = torch.contiguous_format
    y = torch.empty([n, c, ho, wo], dtype=x.dtype, device=x.device, memory_format=fmt) if out is None else out
    if y.numel() == 0:
        return y
    cu = cu.to(device=x.device, dtype=torch.float32).contiguous()
    cd = cd.to(device=x.device, dtype=torch.float32).contiguous()
    has_bias = bias is not None
    b = bias.to(device=x.device).contiguous() if has_bias else cu      # any valid pointer when unused
    if config is None and interpreting():
        config = configs(up, down, tu, td)[0]
    if config is None:
        config = fixed_tile(up, down, tu, td, DOT_PRECISION[x.dtype])
    kernel = _kernel(up, down, tu, td, tuple(config) if config is not None else None)
    if launcher is not None:
        kernel = launcher(kernel)
    blocks = {}
    if config is not None:
        bi, bu, bo, vo, warps = config
        blocks = dict(BI=bi, BU=bu, BO=bo, VO=vo, num_warps=warps)
    qy, ry = divmod(-py0, up)            # Python floor division: the kernel divides only non-negative numbers
    qx, rx = divmod(-px0, up)

    def grid(meta):
        vo = meta["VO"]
        return (n * c * triton_cdiv(ho, vo) * triton_cdiv(wo, vo),)

    kernel[grid](x, y, cu, cd, b, c, h, w, ho, wo, *x.stride(), *y.stride(), qy, ry, qx, rx,
                 float(slope), float(gain), float(clamp if clamp is not None else 0.0),
                 UP=int(up), DOWN=int(down), TU=tu, TD=td,
                 HAS_BIAS=has_bias, ACT=float(slope) != 1.0, CLAMP=clamp is not None,
                 PRECISION=DOT_PRECISION[x.dtype], **blocks)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _taps(f: torch.Tensor | None, device, scale: float = 1.0) -> torch.Tensor:
    """Correlation taps of a 1-D convolution filter (None = identity [1]), gain folded in, float32."""
    if f is None:
        return torch.ones([1], dtype=torch.float32, device=device)
    return (f.to(device=device, dtype=torch.float32) * scale).flip(0)


def filtered_lrelu(x: torch.Tensor, up_filter: torch.Tensor | None, down_filter: torch.Tensor | None,
                   bias: torch.Tensor | None, up: int = 1, down: int = 1, padding=(0, 0, 0, 0),
                   gain: float = 2 ** 0.5, slope: float = 0.2, clamp: float | None = None,
                   config: tuple[int, int, int, int, int] | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel launched directly (same arguments as `stylegan3.filtered_lrelu`, 1-D filters).

    `config` = (BI, BU, BO, VO, num_warps) fixes the tile instead of the autotuner's pick; `out` is a
    preallocated output (tests fill it with NaN to see that every element is written).
    """
    if up_filter is None and up != 1:
        raise ValueError("upsampling by zero insertion needs an upsampling filter")
    cu = _taps(up_filter, x.device, up)
    cd = _taps(down_filter, x.device)
    return _launch(x, cu, cd, bias, int(up), int(down), padding, gain, slope, clamp, out=out, config=config)


def ensure_registered() -> None:
    """Register `atelier::filtered_lrelu` now (eagerly): before torch.compile traces code that calls it."""
    _registered()


@functools.lru_cache(maxsize=None)
def _registered():
    from torch.library import triton_op, wrap_triton

    @triton_op("atelier::filtered_lrelu", mutates_args=())
    def _filtered_lrelu_op(x: torch.Tensor, cu: torch.Tensor, cd: torch.Tensor, bias: torch.Tensor | None,
                           up: int, down: int, px0: int, px1: int, py0: int, py1: int,
                           gain: float, slope: float, clamp: float, use_clamp: bool) -> torch.Tensor:
        return _launch(x, cu, cd, bias, up, down, (px0, px1, py0, py1), gain, slope,
                       clamp if use_clamp else None, launcher=wrap_triton)

    return _filtered_lrelu_op


def filtered_lrelu_op(x: torch.Tensor, up_filter: torch.Tensor | None, down_filter: torch.Tensor | None,
                      bias: torch.Tensor | None, up: int = 1, down: int = 1, padding=(0, 0, 0, 0),
                      gain: float = 2 ** 0.5, slope: float = 0.2, clamp: float | None = None) -> torch.Tensor:
    """`filtered_lrelu` through the registered custom op (the form to use in compiled or graphed code).

    As with `fir1d_op`, Dynamo traces calls of the registered op, not `triton_op` itself: the op is
    registered on the first eager call and by `models.kernels.resolve` before any compiled run.
    """
    if up_filter is None and up != 1:
        raise ValueError("upsampling by zero insertion needs an upsampling filter")
    if not torch.compiler.is_compiling():
        _registered()
    px0, px1, py0, py1 = (int(p) for p in padding)
    b = bias.to(x.dtype) if bias is not None else None
    return torch.ops.atelier.filtered_lrelu(x, _taps(up_filter, x.device, up), _taps(down_filter, x.device), b,
                                            int(up), int(down), px0, px1, py0, py1, float(gain), float(slope),
                                            float(clamp if clamp is not None else 0.0), clamp is not None)
