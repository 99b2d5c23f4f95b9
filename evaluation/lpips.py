"""LPIPS (Zhang et al. 2018): a learned perceptual distance between two images, in plain PyTorch.

Why not the `lpips` package or torchmetrics' LPIPS: both build the backbone with
torchvision (which Atelier does not install) and fetch its ImageNet weights from
the internet. tests/test_metrics_reference.py loads the same weight files into
this module and into the `lpips` package and checks that the distances agree.

Distance = sum over five backbone layers of the spatial mean of
w_l . (f_l(x) / |f_l(x)| - f_l(y) / |f_l(y)|)^2, where f_l are ImageNet
AlexNet (or VGG16) activations after a fixed input scaling, |.| is the norm
across channels and w_l >= 0 are the learned 1x1 "lin" heads (LPIPS v0.1).

Two published files are needed, both plain state dicts: the torchvision
backbone (`features.N.*` keys; `classifier.*` is ignored) and the lpips heads
(`linK.model.1.weight`). The backbone below is an nn.Sequential with the same
layer indices as torchvision's `alexnet().features` / `vgg16().features`, so
the keys map one to one. Images are [-1, 1] floats, as for the lpips package.
"""
from __future__ import annotations

import os
import numpy as np
import torch
import torch.nn as nn

from core.errors import InputError
from evaluation.inception import exact_fp32, progress_bar
from evaluation.scores import MeanStd
from evaluation.sources import ImageSource, paired
from evaluation.weights import (ALEXNET, LPIPS_ALEX, LPIPS_VGG, VGG16, WeightsSpec, find_weights, load_state_dict,
                                match_state_dict, weights_report)

# End index (exclusive) into `features` of each tapped layer: relu1..relu5 (AlexNet), relu1_2..relu5_3 (VGG16)
TAPS = {"alex": (2, 5, 8, 10, 12), "vgg": (4, 9, 16, 23, 30)}
CHANNELS = {"alex": (64, 192, 384, 256, 256), "vgg": (64, 128, 256, 512, 512)}
# lpips' ScalingLayer: [-1, 1] input -> roughly ImageNet-normalised
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)


def alexnet_features() -> nn.Sequential:
    """torchvision's alexnet().features, same indices (0..12)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(),          # 0, 1  -> relu1
        nn.MaxPool2d(3, 2), nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(),  # 2, 3, 4 -> relu2
        nn.MaxPool2d(3, 2), nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),  # 5, 6, 7 -> relu3
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),                   # 8, 9  -> relu4
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),                   # 10, 11 -> relu5
        nn.MaxPool2d(3, 2),                                             # 12 (unused by LPIPS)
    )


def vgg16_features() -> nn.Sequential:
    """torchvision's vgg16().features, same indices (0..30)."""
    layers: list[nn.Module] = []
    cin = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
            cin = v
    return nn.Sequential(*layers)


def _spec(net: str) -> tuple[WeightsSpec, WeightsSpec]:
    return (ALEXNET, LPIPS_ALEX) if net == "alex" else (VGG16, LPIPS_VGG)


def backbone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchvision (`features.N.*`), bare (`N.*`) or lpips-module (`net.sliceK.N.*`) keys -> `features.N.*`."""
    out = {}
    for k, v in state.items():
        if k.startswith("features."):
            out[k] = v
        elif k.startswith("net.slice"):
            out["features." + k.split(".", 3)[3]] = v
        elif k.split(".")[0].isdigit():
            out["features." + k] = v
    return out


def heads_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lpips head keys (`linK.model.1.weight` with dropout, `linK.model.0.weight` without) -> `linK.weight`."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0].startswith("lin") and parts[0][3:].isdigit() and parts[-1] == "weight":
            out[f"{parts[0]}.weight"] = v
    return out


class LPIPS(nn.Module):
    """LPIPS v0.1 distance. `lpips(x, y)` on [-1, 1] images [N, 3, H, W] -> [N] distances (fp32).

    Differentiable (weights frozen), so it also serves as a perceptual loss; the metric
    helpers below call it under no_grad.
    """

    def __init__(self, lpips_weights: str | os.PathLike | None = None, backbone_weights: str | os.PathLike | None = None,
                 net: str = "alex", device: str | torch.device | None = None, load: bool = True):
        super().__init__()
        if net in ("vgg16",):
            net = "vgg"
        if net not in TAPS:
            raise InputError(f"LPIPS backbone must be 'alex' or 'vgg'; got {net!r}")
        self.net_name = net
        self.features = alexnet_features() if net == "alex" else vgg16_features()
        for k, c in enumerate(CHANNELS[net]):
            setattr(self, f"lin{k}", nn.Conv2d(c, 1, 1, bias=False))
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1), persistent=False)
        self.weights: dict[str, dict] = {}           # which files were loaded (path, sha256, published)
        if load:
            self.load_weights(lpips_weights, backbone_weights)
        self.eval().requires_grad_(False)
        from core.device import pick_device

        self.to(pick_device(str(device) if device is not None else None))   # default: the best device, as Inception

    @property
    def lins(self) -> list[nn.Conv2d]:
        return [getattr(self, f"lin{k}") for k in range(len(TAPS[self.net_name]))]

    def load_weights(self, lpips_weights=None, backbone_weights=None) -> None:
        """Read both published files (a path each, or a folder holding both) strictly by key name."""
        back_spec, head_spec = _spec(self.net_name)
        if backbone_weights is None and lpips_weights is not None and os.path.isdir(lpips_weights):
            backbone_weights = lpips_weights          # one folder with both files
        back_path = find_weights(back_spec, backbone_weights)
        head_path = find_weights(head_spec, lpips_weights)
        match_state_dict(self.features, {k[len("features."):]: v for k, v in
                                         backbone_state(load_state_dict(back_path)).items()}, back_path, back_spec)
        heads = nn.ModuleDict({f"lin{k}": lin for k, lin in enumerate(self.lins)})   # shares the layers
        match_state_dict(heads, heads_state(load_state_dict(head_path)), head_path, head_spec)
        self.weights = {"lpips_backbone": weights_report(back_spec, back_path),
                        "lpips_heads": weights_report(head_spec, head_path)}

    def layer_outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = (x - self.shift) / self.scale
        outs, start = [], 0
        for end in TAPS[self.net_name]:
            h = self.features[start:end](h)
            outs.append(h)
            start = end
        return outs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        assert x.ndim == 4 and x.shape[1] == 3, f"expected [N, 3, H, W], got {tuple(x.shape)}"
        assert x.shape == y.shape, f"LPIPS compares images of the same shape: {tuple(x.shape)} vs {tuple(y.shape)}"
        with torch.autocast(device_type=x.device.type, enabled=False):
            x, y = x.float(), y.float()
            total = x.new_zeros(x.shape[0])
            for lin, fx, fy in zip(self.lins, self.layer_outputs(x), self.layer_outputs(y)):
                # unit length across channels; lpips' eps keeps an all-zero feature vector finite
                nx = fx / (fx.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
                ny = fy / (fy.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
                total = total + lin((nx - ny) ** 2).mean(dim=(1, 2, 3))
        return total

    def distance(self, x, y) -> torch.Tensor:
        """Metric use: uint8 (0..255) or [-1, 1] float images, no grad, exact fp32 -> [N] on CPU."""
        dev = self.shift.device
        with exact_fp32(dev):
            return self(_to_signed_unit(x).to(dev), _to_signed_unit(y).to(dev)).float().cpu()


def _to_signed_unit(images) -> torch.Tensor:
    x = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    if x.dtype == torch.uint8:
        return x.float() / 127.5 - 1
    return x.float()


def _pairwise(lpips: LPIPS, a: ImageSource, b: ImageSource, pairs: np.ndarray, batch_size: int, progress: bool,
              desc: str) -> np.ndarray:
    """LPIPS of a[i] vs b[j] for each row (i, j) of `pairs`, read by random access in chunks."""
    out = []
    with progress_bar(len(pairs), desc, progress) as bar:
        for s in range(0, len(pairs), batch_size):
            chunk = pairs[s:s + batch_size]
            xs, ys = a.get(chunk[:, 0]), b.get(chunk[:, 1])
            for (i, j), x, y in zip(chunk, xs, ys):
                if x.shape != y.shape:
                    raise InputError(f"LPIPS compares images of one size: {a.name} image {i} is {x.shape[1:]}, "
                                     f"{b.name} image {j} is {y.shape[1:]}")
            out.append(lpips.distance(np.stack(xs), np.stack(ys)).numpy())
            bar.update(len(chunk))
    return np.concatenate(out).astype(np.float64)


def lpips_diversity(source: ImageSource, lpips: LPIPS, num_pairs: int | None = None, seed: int = 0,
                    batch_size: int = 16, progress: bool = True) -> MeanStd:
    """Mean (and std) LPIPS between random pairs of different images: low diversity hints at mode collapse.

    num_pairs=None pairs a random permutation two by two (each image used once);
    otherwise `num_pairs` pairs (i, j), i != j, are drawn at random.
    """
    n = len(source)
    if n < 2:
        raise InputError(f"LPIPS diversity needs at least 2 images; got {n}")
    rng = np.random.RandomState(seed)
    if num_pairs is None:
        perm = rng.permutation(n)[: n - n % 2]
        pairs = perm.reshape(-1, 2)
    else:
        if int(num_pairs) < 1:
            raise InputError("the number of LPIPS pairs must be at least 1")
        i = rng.randint(0, n, size=int(num_pairs))
        j = (i + rng.randint(1, n, size=int(num_pairs))) % n       # any other image, uniformly
        pairs = np.stack([i, j], axis=1)
    d = _pairwise(lpips, source, source, pairs, batch_size, progress, "lpips diversity")
    return MeanStd(float(d.mean()), float(d.std()))


def lpips_paired(a: ImageSource, b: ImageSource, lpips: LPIPS, batch_size: int = 16,
                 progress: bool = True) -> tuple[MeanStd, np.ndarray]:
    """LPIPS between a[i] and b[i] (folders paired by file name): drift of a toggle against the reference.

    Returns (mean, std) and the per-pair distances in `a`'s order.
    """
    a, b = paired(a, b)
    idx = np.arange(len(a))
    d = _pairwise(lpips, a, b, np.stack([idx, idx], axis=1), batch_size, progress, "lpips paired")
    return MeanStd(float(d.mean()), float(d.std())), d
