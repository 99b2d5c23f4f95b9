"""The FID Inception v3 ("2015-12-05") in plain PyTorch, the input paths of the FID tools, and a feature extractor.

FID, KID and IS are only comparable across papers when they use this exact
network: TensorFlow's 2015 Inception graph, as ported by pytorch-fid
(`FIDInceptionA/C/E`) and torch-fidelity (`FeatureExtractorInceptionV3`, which
torchmetrics uses too). It differs from torchvision's Inception v3 in three
places, each marked below: average pools ignore padded zeros (TF semantics), the
last block pools with a max instead of an average, and the classifier has 1008
outputs. Module and attribute names follow those ports, so the published state
dict loads by name; tests/test_metrics_reference.py loads one weight file into
this network and into torch-fidelity's and compares the features.

The tools agree on the network but not on how an image reaches 299x299, which
moves FID by a few percent, so the input path is a choice (`INPUT_MODES`):

  tf           torch-fidelity, NVlabs' StyleGAN metrics, the original TensorFlow FID (and
               torchmetrics with antialias=False): TF 1.x bilinear resize -> (x - 128) / 128  (default)
  torchmetrics torchmetrics' default (antialias=True): torch bilinear resize with antialiasing
               -> (x - 128) / 128
  pytorch-fid  pytorch-fid: x / 255 -> torch bilinear resize (align_corners=False) -> 2x - 1
  clean        clean-fid's default mode: PIL bicubic resize of each channel in float,
               clipped to [0, 255] -> (x - 128) / 128

Outputs: pool3 features (2048-d, for FID and KID) and 1008 logits for IS,
*without* the fc bias, as the original Inception Score code and torch-fidelity
("logits_unbiased") compute them.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.errors import InputError
from evaluation.weights import INCEPTION, file_digest, find_weights, load_state_dict, match_state_dict

INPUT_SIZE = 299
POOL_DIM = 2048
NUM_LOGITS = 1008           # TF's ImageNet graph: 1000 classes + 8 unused/background outputs
PREPROCESS_VERSION = 2     # part of the cache key, with the mode: change it when an input path changes
INPUT_MODES = ("tf", "torchmetrics", "pytorch-fid", "clean")
DEFAULT_INPUT_MODE = "tf"


class ConvBN(nn.Module):
    """Conv (no bias) -> BatchNorm (TF's eps 1e-3) -> ReLU: Inception's `BasicConv2d`."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _tf_avg_pool3(x: torch.Tensor) -> torch.Tensor:
    # FID difference 1: TensorFlow's average pool divides by the number of real pixels at the border
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35x35 block (Mixed_5b/c/d)."""

    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = ConvBN(cin, 64, 1)
        self.branch5x5_1 = ConvBN(cin, 48, 1)
        self.branch5x5_2 = ConvBN(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(96, 96, 3, padding=1)
        self.branch_pool = ConvBN(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_tf_avg_pool3(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """35x35 -> 17x17 reduction (Mixed_6a)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = ConvBN(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = ConvBN(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convolutions (Mixed_6b..e)."""

    def __init__(self, cin: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = ConvBN(cin, 192, 1)
        self.branch7x7_1 = ConvBN(cin, c7, 1)
        self.branch7x7_2 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = ConvBN(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = ConvBN(cin, c7, 1)
        self.branch7x7dbl_2 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = ConvBN(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = ConvBN(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = ConvBN(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        for conv in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            bd = conv(bd)
        bp = self.branch_pool(_tf_avg_pool3(x))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    """17x17 -> 8x8 reduction (Mixed_7a)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = ConvBN(cin, 192, 1)
        self.branch3x3_2 = ConvBN(192, 320, 3, stride=2)
        self.branch7x7x3_1 = ConvBN(cin, 192, 1)
        self.branch7x7x3_2 = ConvBN(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = ConvBN(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = ConvBN(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    """8x8 block with split 1x3/3x1 branches (Mixed_7b with an average pool, Mixed_7c with a max pool)."""

    def __init__(self, cin: int, pool: str):
        super().__init__()
        assert pool in ("avg", "max"), pool
        self.pool = pool
        self.branch1x1 = ConvBN(cin, 320, 1)
        self.branch3x3_1 = ConvBN(cin, 384, 1)
        self.branch3x3_2a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = ConvBN(cin, 448, 1)
        self.branch3x3dbl_2 = ConvBN(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = ConvBN(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        if self.pool == "avg":
            pooled = _tf_avg_pool3(x)
        else:
            # FID difference 2: the TF graph's last block max-pools here (pytorch-fid's FIDInceptionE_2)
            pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1)
        bp = self.branch_pool(pooled)
        return torch.cat([b1, b3, bd, bp], 1)


class FIDInceptionV3(nn.Module):
    """Inception v3 as in the TF FID graph. forward: [N, 3, 299, 299] in [-1, 1] -> pool3 [N, 2048]."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = ConvBN(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = ConvBN(32, 32, 3)
        self.Conv2d_2b_3x3 = ConvBN(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = ConvBN(64, 80, 1)
        self.Conv2d_4a_3x3 = ConvBN(80, 192, 3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, pool="avg")
        self.Mixed_7c = InceptionE(2048, pool="max")
        # FID difference 3: TF's classifier has 1008 outputs (torchvision's has 1000)
        self.fc = nn.Linear(POOL_DIM, NUM_LOGITS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.ndim == 4 and x.shape[1] == 3, f"expected [N, 3, H, W], got {tuple(x.shape)}"
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))       # N x 64 x 147 x 147
        x = F.max_pool2d(x, kernel_size=3, stride=2)                                # N x 64 x 73 x 73
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))                               # N x 192 x 71 x 71
        x = F.max_pool2d(x, kernel_size=3, stride=2)                                # N x 192 x 35 x 35
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a,  # -> N x 768 x 17 x 17
                      self.Mixed_6b, self.Mixed_6c, self.Mixed_6d, self.Mixed_6e,
                      self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):                 # -> N x 2048 x 8 x 8
            x = block(x)
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)                        # N x 2048

    def logits(self, pool: torch.Tensor) -> torch.Tensor:
        """1008 class logits from pool3, without the fc bias: the Inception Score's definition."""
        assert pool.ndim == 2 and pool.shape[1] == POOL_DIM, f"expected [N, {POOL_DIM}], got {tuple(pool.shape)}"
        return pool @ self.fc.weight.T


def to_pixels(images) -> torch.Tensor:
    """uint8 [N, 3, H, W] (0..255) or float [N, 3, H, W] in [0, 1] -> float32 tensor in [0, 255].

    The tools all read uint8 images; floats are scaled, not quantised (quantise first, as
    `compute_metrics` does, to reproduce their numbers exactly).
    """
    x = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    if x.ndim != 4 or x.shape[1] != 3:
        raise InputError(f"images must be [N, 3, H, W]; got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.to(torch.float32)
    if not x.is_floating_point():
        raise InputError(f"images must be uint8 (0..255) or float in [0, 1]; got {x.dtype}")
    x = x.to(torch.float32)
    lo, hi = float(x.min()), float(x.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise InputError("images contain NaN or infinite values")
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise InputError(f"float images must be in [0, 1]; these span [{lo:.3g}, {hi:.3g}] "
                         f"(generator outputs in [-1, 1] need (x + 1) / 2, or pass uint8)")
    return x * 255


def _tf1_bilinear_weights(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n_out, n_in]: row i holds TF 1.x's two bilinear weights for output pixel i along one axis."""
    pos = torch.arange(n_out, dtype=dtype, device=device) * (n_in / n_out)
    lo = pos.long()                                       # floor: positions are >= 0
    hi = (lo + 1).clamp_max(n_in - 1)                     # the last input pixel repeats past the edge
    frac = pos - lo.to(dtype)
    rows = torch.arange(n_out, device=device)
    w = torch.zeros(n_out, n_in, dtype=dtype, device=device)
    w.index_put_((rows, lo), 1 - frac, accumulate=True)
    w.index_put_((rows, hi), frac, accumulate=True)
    return w


def resize_bilinear_tf1(x: torch.Tensor, size: int) -> torch.Tensor:
    """TensorFlow 1.x `resize_bilinear` (align_corners=False), the resize inside the TF FID graph.

    Output pixel i samples the input at i * in / out, with no half-pixel offset (torch's
    align_corners=False samples at (i + 0.5) * in / out - 0.5), so a downscale keeps the
    top-left pixel and drops the bottom-right edge. Written as one weight matrix per axis
    (out = Wy x Wx^T): 15x faster on a CPU than gathering pixels, and within float32
    rounding of torch-fidelity's gather (~5e-5 on the 0..255 scale).
    """
    wy = _tf1_bilinear_weights(x.shape[2], size, x.dtype, x.device)
    wx = _tf1_bilinear_weights(x.shape[3], size, x.dtype, x.device)
    return wy @ x @ wx.T


def resize_bicubic_pil(x: torch.Tensor, size: int) -> torch.Tensor:
    """clean-fid's resize: each channel as a 32-bit float PIL image, bicubic (PIL filters with the
    kernel widened by the scale when shrinking, so no aliasing), then clipped to [0, 255]. On the CPU."""
    from PIL import Image

    arr = x.detach().to("cpu", torch.float32).numpy()
    out = np.empty((arr.shape[0], arr.shape[1], size, size), np.float32)
    for i in range(arr.shape[0]):
        for c in range(arr.shape[1]):
            out[i, c] = np.asarray(Image.fromarray(arr[i, c]).resize((size, size), Image.Resampling.BICUBIC))
    return torch.from_numpy(np.clip(out, 0, 255))


def preprocess(pixels: torch.Tensor, mode: str = DEFAULT_INPUT_MODE) -> torch.Tensor:
    """[N, 3, H, W] floats in [0, 255] -> the network's input [N, 3, 299, 299], by one of the tools' paths."""
    assert pixels.ndim == 4 and pixels.shape[1] == 3, f"expected [N, 3, H, W], got {tuple(pixels.shape)}"
    at_size = tuple(pixels.shape[-2:]) == (INPUT_SIZE, INPUT_SIZE)
    if mode == "tf":
        x = pixels if at_size else resize_bilinear_tf1(pixels, INPUT_SIZE)
        return (x - 128) / 128
    if mode == "torchmetrics":
        x = pixels if at_size else F.interpolate(pixels, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear",
                                                 align_corners=False, antialias=True)
        return (x - 128) / 128
    if mode == "pytorch-fid":
        x = pixels / 255
        if not at_size:
            x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)
        return x * 2 - 1
    if mode == "clean":
        x = pixels if at_size else resize_bicubic_pil(pixels, INPUT_SIZE).to(pixels.device)
        return (x - 128) / 128
    raise InputError(f"unknown Inception input mode {mode!r}; choose from {', '.join(INPUT_MODES)}")


@contextlib.contextmanager
def exact_fp32(device: torch.device) -> Iterator[None]:
    """Metrics are defined in fp32: no autocast from a caller, no TF32 convolutions or matmuls."""
    saved = None
    if device.type == "cuda":
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device_type=device.type, enabled=False), torch.no_grad():
            yield
    finally:
        if saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def progress_bar(total: int | None, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", file=sys.stderr, disable=not enabled, leave=False)


class InceptionFeatures:
    """The FID Inception network with its weights loaded, ready to turn images into features.

    >>> inc = InceptionFeatures("pt_inception-2015-12-05-6726825d.pth", device="cuda")
    >>> pool, logits = inc.features(uint8_images)      # [N, 2048], [N, 1008] float32 numpy

    `input_mode` picks the tool whose input path is reproduced (INPUT_MODES; "tf" by default).
    """

    def __init__(self, weights_path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 batch_size: int = 64, progress: bool = True, input_mode: str = DEFAULT_INPUT_MODE):
        from core.device import pick_device
        from evaluation.weights import weights_report

        self.weights_path: Path = find_weights(INCEPTION, weights_path)
        self.device = pick_device(str(device)) if device is not None else pick_device(None)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise InputError("batch size must be at least 1")
        self.progress = progress
        if input_mode not in INPUT_MODES:
            raise InputError(f"unknown Inception input mode {input_mode!r}; choose from {', '.join(INPUT_MODES)}")
        self.input_mode = input_mode
        net = FIDInceptionV3()
        match_state_dict(net, load_state_dict(self.weights_path), self.weights_path, INCEPTION)
        self.net = net.eval().requires_grad_(False).to(self.device)
        self.weights = weights_report(INCEPTION, self.weights_path)

    @property
    def identity(self) -> str:
        """What the features depend on besides the images: the weights' bytes and the input path."""
        return f"{file_digest(self.weights_path)}:{self.input_mode}-v{PREPROCESS_VERSION}"

    def _forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with exact_fp32(self.device):
            x = preprocess(pixels if self.input_mode == "clean" else pixels.to(self.device), self.input_mode)
            pool = self.net(x.to(self.device))
            logits = self.net.logits(pool)
        return pool.float().cpu(), logits.float().cpu()

    def features(self, images, batch_size: int | None = None, progress: bool | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [N, 3, H, W] or float [N, 3, H, W] in [0, 1] -> (pool3 [N, 2048], logits [N, 1008]) float32."""
        n = int(images.shape[0]) if hasattr(images, "shape") else len(images)
        bs = batch_size or self.batch_size
        return self.extract((images[i:i + bs] for i in range(0, n, bs)), total=n, progress=progress)

    def extract(self, batches: Iterable, total: int | None = None, progress: bool | None = None,
                desc: str = "inception") -> tuple[np.ndarray, np.ndarray]:
        """Features of a stream of image batches (each uint8 or [0, 1] float [B, 3, H, W])."""
        pools, logits = [], []
        with progress_bar(total, desc, self.progress if progress is None else progress) as bar:
            for batch in batches:
                pixels = to_pixels(batch)
                if pixels.shape[0] == 0:
                    continue
                p, l = self._forward(pixels)
                pools.append(p.numpy())
                logits.append(l.numpy())
                bar.update(pixels.shape[0])
        if not pools:
            raise InputError("no images to compute features of")
        pool, logit = np.concatenate(pools), np.concatenate(logits)
        assert pool.shape[1] == POOL_DIM and logit.shape[1] == NUM_LOGITS
        return pool, logit
