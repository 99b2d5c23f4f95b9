"""The FID Inception v3 ("pt_inception-2015-12-05") in plain PyTorch, and a feature extractor around it.

FID, KID and IS are only comparable across papers when they use this exact
network: TensorFlow's 2015 Inception graph, ported to PyTorch by pytorch-fid
(`FIDInceptionA/C/E`) and torch-fidelity (`FeatureExtractorInceptionV3`). It
differs from torchvision's Inception v3 in three places, each marked below:
average pools ignore padded zeros (TF semantics), the last block pools with a
max instead of an average, and the classifier has 1008 outputs. Module and
attribute names follow those ports so the published state dict loads by name.

Input path (as pytorch-fid): images in [0, 1] -> bilinear resize to 299x299
(align_corners=False) -> x * 2 - 1. Outputs: pool3 features (2048-d, for FID
and KID) and 1008 logits (for IS). IS uses the logits *without* the fc bias by
default, as the original Inception Score code (and torch-fidelity) do: they
multiply pool3 by the softmax weight matrix only.
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
PREPROCESS_VERSION = "pt-fid-bilinear299-v1"   # part of the cache key: change it when the input path changes


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

    def logits(self, pool: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """1008 class logits from pool3. Without the bias by default, as the Inception Score was defined."""
        assert pool.ndim == 2 and pool.shape[1] == POOL_DIM, f"expected [N, {POOL_DIM}], got {tuple(pool.shape)}"
        out = pool @ self.fc.weight.T
        return out + self.fc.bias if bias else out


def to_unit_float(images) -> torch.Tensor:
    """uint8 [N, 3, H, W] (0..255) or float [N, 3, H, W] in [0, 1] -> float32 tensor in [0, 1]."""
    x = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    if x.ndim != 4 or x.shape[1] != 3:
        raise InputError(f"images must be [N, 3, H, W]; got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.to(torch.float32) / 255.0
    if not x.is_floating_point():
        raise InputError(f"images must be uint8 (0..255) or float in [0, 1]; got {x.dtype}")
    x = x.to(torch.float32)
    lo, hi = float(x.min()), float(x.max())
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise InputError("images contain NaN or infinite values")
    if lo < -1e-3 or hi > 1 + 1e-3:
        raise InputError(f"float images must be in [0, 1]; these span [{lo:.3g}, {hi:.3g}] "
                         f"(generator outputs in [-1, 1] need (x + 1) / 2, or pass uint8)")
    return x


def preprocess(x01: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1] -> the network's input: bilinear 299x299 (align_corners=False), then x * 2 - 1."""
    assert x01.ndim == 4 and x01.shape[1] == 3, f"expected [N, 3, H, W], got {tuple(x01.shape)}"
    if tuple(x01.shape[-2:]) != (INPUT_SIZE, INPUT_SIZE):
        x01 = F.interpolate(x01, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)
    return x01 * 2 - 1


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
    """

    def __init__(self, weights_path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 batch_size: int = 64, progress: bool = True, logits_bias: bool = False):
        from core.device import pick_device

        self.weights_path: Path = find_weights(INCEPTION, weights_path)
        self.device = pick_device(str(device)) if device is not None else pick_device(None)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise InputError("batch size must be at least 1")
        self.progress = progress
        self.logits_bias = logits_bias      # False: the Inception Score's definition (pool3 @ W, no bias)
        net = FIDInceptionV3()
        match_state_dict(net, load_state_dict(self.weights_path), self.weights_path, INCEPTION)
        self.net = net.eval().requires_grad_(False).to(self.device)

    @property
    def identity(self) -> str:
        """What the features depend on besides the images: the weights' bytes and the input path."""
        return f"{file_digest(self.weights_path)}:{PREPROCESS_VERSION}:bias={int(self.logits_bias)}"

    def _forward(self, x01: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with exact_fp32(self.device):
            x = preprocess(x01.to(self.device, torch.float32))
            pool = self.net(x)
            logits = self.net.logits(pool, bias=self.logits_bias)
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
                x01 = to_unit_float(batch)
                if x01.shape[0] == 0:
                    continue
                p, l = self._forward(x01)
                pools.append(p.numpy())
                logits.append(l.numpy())
                bar.update(x01.shape[0])
        if not pools:
            raise InputError("no images to compute features of")
        pool, logit = np.concatenate(pools), np.concatenate(logits)
        assert pool.shape[1] == POOL_DIM and logit.shape[1] == NUM_LOGITS
        return pool, logit
