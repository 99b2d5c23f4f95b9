"""FP8 convolutions on Hopper: a Triton implicit-GEMM kernel for a UNet's 3×3 and 1×1 convolutions in e4m3.

Why: convolutions are 36 % of SDXL's UNet FLOPs and the cuDNN bf16 implicit GEMMs are its second-largest kernel
class after the linear layers' GEMMs, but torchao 0.18's FP8 convolution needs compute capability 10.0 and
cuDNN/cuBLAS have no FP8 convolution PyTorch calls on SM 9.0 (docs/perf-notes.md, "What limits SDXL now").
So this module supplies one: the convolution as a matrix product of the (N·Ho·Wo) × (KH·KW·C) patch matrix,
never materialised, and the (KH·KW·C) × Cout weight, fed to Hopper's FP8 tensor cores by `tl.dot`.

The layer (`StaticFP8Conv2d`) works like `optim.fp8.StaticFP8Linear`:
- the weight is stored in e4m3 once, one scale per output channel, laid out [Cout, KH·KW·C] (K contiguous,
  the layout Hopper's FP8 MMA reads its second operand in);
- the input gets one fixed scale, calibrated on a real request (2 × max |x| / 448); its quantization (x / s,
  clamp to ±448, cast) is a pointwise op that torch.compile fuses into the GroupNorm + SiLU before it, so it
  costs no pass of its own, and the activation moves at one byte an element instead of two;
- the kernel reads the NHWC (channels_last) input, accumulates in fp32, multiplies by the two scales, adds the
  bias and writes NHWC in the model's dtype: the result is a channels_last NCHW tensor, as cuDNN's would be.

Which convolutions: 1×1 or 3×3 (square, zero padding, stride 1 or 2, no dilation or groups) with C and Cout
multiples of 32 and 16 and at least `MIN_CHANNELS` wide; conv_in and conv_out (4 channels) never. Whether each shape
is faster than cuDNN's bf16 convolution is then measured on the GPU (`optim.fp8.measured_selection` does the
same for linears), so a shape where this kernel loses stays bf16.

`conv2d_fp8` launches the kernel directly (CUDA, or the CPU under TRITON_INTERPRET=1, which is how the CPU tests
run it); `conv2d_fp8_op` is the same registered as the custom op `atelier::conv2d_fp8`, so torch.compile traces
into the kernel and CUDA graphs capture it.
"""
from __future__ import annotations

import functools

import torch

from core.triton_support import import_error as _import_error, interpreting

E4M3_MAX = 448.0
MIN_CHANNELS = 256
SCALE_LB = 1e-12
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) the autotuner picks from per shape on a GPU; a BLOCK_K that
# does not divide the input channels is pruned before timing (a K block must not straddle two taps)
_CONFIGS = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 64, 64, 4, 4),
            (128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 32, 8, 4))


def unavailable_reason(device: torch.device | str) -> str | None:
    """None if the kernel can run on `device`: CUDA with FP8 tensor cores (SM 8.9+), or the CPU interpreter."""
    err = _import_error()
    if err:
        return err
    dev = torch.device(device)
    if dev.type == "cpu" and interpreting():
        return None
    if dev.type != "cuda":
        return f"the FP8 convolution kernel runs on CUDA GPUs (here: {dev.type})"
    if torch.cuda.get_device_capability(dev) < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or newer (Ada, Hopper)"
    return None


def eligible(conv: torch.nn.Module, min_channels: int = MIN_CHANNELS) -> str | None:
    """None if `conv` can run in this kernel, else why not."""
    if not isinstance(conv, torch.nn.Conv2d):
        return "not a Conv2d"
    kh, kw = conv.kernel_size
    if (kh, kw) not in ((1, 1), (3, 3)):
        return f"kernel {kh}×{kw} (1×1 and 3×3 only)"
    if conv.groups != 1 or conv.dilation != (1, 1) or conv.padding_mode != "zeros":
        return "grouped, dilated or non-zero padding"
    if conv.stride[0] != conv.stride[1] or conv.stride[0] not in (1, 2):
        return f"stride {conv.stride}"
    if isinstance(conv.padding, str) or conv.padding[0] != conv.padding[1]:
        return f"padding {conv.padding}"
    if conv.in_channels % 32 or conv.out_channels % 16:
        return "input channels not a multiple of 32 or output channels not a multiple of 16"
    if conv.in_channels < min_channels or conv.out_channels < min_channels:
        return f"narrower than {min_channels} channels"
    return None


def _body():
    import triton.language as tl

    def conv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
                    M, H, W, HO, WO, C, CO, KTOT,
                    STRIDE: tl.constexpr, PAD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program: BLOCK_M output pixels (flattened n, oh, ow) × BLOCK_N output channels
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < CO
        img = offs_m // (HO * WO)
        rest = offs_m % (HO * WO)
        oh = rest // WO
        ow = rest % WO
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        base = img.to(tl.int64) * H
        w_rows = offs_n[None, :].to(tl.int64) * KTOT
        # one loop over K = (tap, channel block), so the compiler pipelines all KH·KW·C/BLOCK_K steps as one
        # (C is a multiple of BLOCK_K: a block never straddles two taps)
        for kk in range(0, KTOT, BLOCK_K):
            tap = kk // C
            c0 = kk - tap * C
            ih = oh * STRIDE - PAD + tap // KW
            iw = ow * STRIDE - PAD + tap % KW
            ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            row = tl.multiple_of(((base + ih) * W + iw) * C + c0, 16)       # NHWC: this pixel's channel block
            a = tl.load(x_ptr + row[:, None] + offs_k[None, :], mask=ok[:, None], other=0.0)
            # weight [CO, KTOT]: a K-contiguous [BLOCK_K, BLOCK_N] tile
            b = tl.load(w_ptr + w_rows + (kk + offs_k)[:, None], mask=n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * scale[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m[:, None].to(tl.int64) * CO + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return conv_kernel


def _autotuned(fn):
    """`fn` autotuned per shape over _CONFIGS (triton's default warm-up and repetitions: inductor refuses user
    kernels autotuned with others), a BLOCK_K that does not divide C pruned first."""
    import triton

    return triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                 for bm, bn, bk, w, st in _CONFIGS],
        key=["M", "C", "CO", "HO", "WO"], prune_configs_by={"early_config_prune": _dividing_configs})(fn)


@functools.lru_cache(maxsize=None)
def _kernel():
    """The kernel as launched: autotuned on a GPU; as written (one tile, chosen at launch) in the interpreter."""
    import triton

    jitted = triton.jit(_body())
    return jitted if interpreting() else _autotuned(jitted)


def _dividing_configs(configs, named_args, **kwargs):
    """The configurations whose BLOCK_K divides the input channels."""
    c = int(named_args["C"])
    return [cfg for cfg in configs if c % cfg.kwargs["BLOCK_K"] == 0]


def out_size(size: int, k: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - k) // stride + 1


def _block_k(c: int) -> int:
    return 64 if c % 64 == 0 else 32 if c % 32 == 0 else 16


def _launch(xq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kh: int, kw: int,
            stride: int, pad: int, out_dtype: torch.dtype, launcher=None) -> torch.Tensor:
    """xq: [N, H, W, C] e4m3, contiguous; wq: [CO, KH*KW*C] e4m3; scale: [CO] fp32 (input × weight scale);
    bias: [CO] or None. Returns [N, HO, WO, CO] in out_dtype."""
    n, h, w, c = xq.shape
    co, ktot = wq.shape
    if ktot != kh * kw * c:
        raise ValueError(f"weight has {ktot} columns, expected {kh}×{kw}×{c}")
    ho, wo = out_size(h, kh, stride, pad), out_size(w, kw, stride, pad)
    y = torch.empty((n, ho, wo, co), device=xq.device, dtype=out_dtype)
    m = n * ho * wo
    kernel = _kernel()
    if launcher is not None:
        kernel = launcher(kernel)
    blocks: dict[str, int] = {}
    if interpreting():
        blocks.update(BLOCK_M=32, BLOCK_N=32, BLOCK_K=_block_k(c))

        def grid(meta):
            return ((m + 31) // 32, (co + 31) // 32)
    else:
        def grid(meta):
            return ((m + meta["BLOCK_M"] - 1) // meta["BLOCK_M"], (co + meta["BLOCK_N"] - 1) // meta["BLOCK_N"])
    kernel[grid](xq, wq, scale, bias if bias is not None else scale, y, m, h, w, ho, wo, c, co, ktot,
                 STRIDE=stride, PAD=pad, KH=kh, KW=kw, HAS_BIAS=bias is not None, **blocks)
    return y


def conv2d_fp8(xq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kh: int, kw: int,
               stride: int, pad: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel, called directly (eager; tests)."""
    return _launch(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype)


@functools.lru_cache(maxsize=None)
def _registered():
    """Register `atelier::conv2d_fp8` once, lazily: on a GPU a triton_op (torch.compile traces the kernel into
    its graph); in Triton's CPU interpreter an opaque custom op with a shape-only fake, since the interpreter
    cannot run on the fake tensors a compile traces with (the CPU tests compile modules that call it)."""
    from torch.library import custom_op, triton_op, wrap_triton

    def out_shape(xq, wq, kh, kw, stride, pad, out_dtype):
        n, h, w, _ = xq.shape
        return xq.new_empty((n, out_size(h, kh, stride, pad), out_size(w, kw, stride, pad), wq.shape[0]),
                            dtype=out_dtype)

    if interpreting():
        @custom_op("atelier::conv2d_fp8", mutates_args=())
        def _op(xq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kh: int, kw: int,
                stride: int, pad: int, out_dtype: torch.dtype) -> torch.Tensor:
            return _launch(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype)

        @_op.register_fake
        def _(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype):
            return out_shape(xq, wq, kh, kw, stride, pad, out_dtype)
    else:
        @triton_op("atelier::conv2d_fp8", mutates_args=())
        def _op(xq: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kh: int, kw: int,
                stride: int, pad: int, out_dtype: torch.dtype) -> torch.Tensor:
            return _launch(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype, launcher=wrap_triton)

    return torch.ops.atelier.conv2d_fp8


def conv2d_fp8_op(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype):
    """The registered op (what StaticFP8Conv2d calls: traced by torch.compile, captured by CUDA graphs).
    Dynamo cannot trace the registration itself, only calls of the registered op: StaticFP8Conv2d registers it
    when it is built, eagerly, before anything compiles it."""
    if not torch.compiler.is_compiling():
        _registered()
    return torch.ops.atelier.conv2d_fp8(xq, wq, scale, bias, kh, kw, stride, pad, out_dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[CO, C, KH, KW] -> ([CO, KH*KW*C] e4m3, [CO] fp32 scales): one scale per output channel, K ordered
    (kh, kw, c) as the kernel walks it."""
    w = weight.detach().float().permute(0, 2, 3, 1).reshape(weight.shape[0], -1)
    scale = w.abs().amax(dim=1).clamp(min=SCALE_LB) / E4M3_MAX
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous(), scale


class StaticFP8Conv2d(torch.nn.Module):
    """A Conv2d run by the FP8 kernel: weight in e4m3 with per-output-channel scales, the input with one fixed
    calibrated scale (its quantization fuses into the producer under torch.compile), fp32 accumulation, the
    result in the model's dtype and channels_last. Inputs beyond the calibrated range saturate at ±448·s; an
    all-zero input gives the bias; never inf or NaN."""

    def __init__(self, conv: torch.nn.Conv2d, input_amax: float, margin: float = 2.0):
        super().__init__()
        why = eligible(conv, min_channels=16)
        if why:
            raise ValueError(f"this convolution cannot run in the FP8 kernel: {why}")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.padding = conv.kernel_size, conv.stride, conv.padding
        self.out_dtype = conv.weight.dtype
        dev = conv.weight.device
        _registered()                  # the custom op exists before torch.compile traces a call of it
        wq, ws = quantize_weight(conv.weight)
        x_scale = max(float(input_amax) * margin, SCALE_LB) / E4M3_MAX
        self.register_buffer("weight_fp8", wq)
        self.register_buffer("scale", (ws * x_scale).to(dev, torch.float32))       # input scale × weight scale
        self.register_buffer("input_scale_inv", torch.tensor(1.0 / x_scale, dtype=torch.float32, device=dev))
        b = conv.bias
        self.register_buffer("bias", None if b is None else b.detach().to(dev, torch.float32))
        self.input_amax = float(input_amax)

    @property
    def weight(self):                  # code that peeks at .weight (dtype checks) finds the stored tensor
        return self.weight_fp8

    def extra_repr(self) -> str:
        k = self.kernel_size[0]
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={k}×{k}, stride={self.stride[0]}, "
                f"padding={self.padding[0]}, e4m3 (per-channel weight scales), input max {self.input_amax:.4g}, "
                f"out {self.out_dtype}")

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, H, W, C] e4m3, contiguous (a view's copy-free when x is channels_last)."""
        q = (x.float() * self.input_scale_inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.permute(0, 2, 3, 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.quantize_input(x)
        y = conv2d_fp8_op(xq, self.weight_fp8, self.scale, self.bias, self.kernel_size[0], self.kernel_size[1],
                          self.stride[0], self.padding[0], self.out_dtype)
        return y.permute(0, 3, 1, 2)          # NCHW view, channels_last strides
