"""What every backend pipeline offers, and helpers they share."""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from PIL import Image

from core.types import GenerationRequest, GenerationResult, Job


class Pipeline(Protocol):
    backend: str
    model_id: str
    optimizations: dict

    def generate(self, request: GenerationRequest, job: Job) -> GenerationResult: ...

    def memory_bytes(self) -> int: ...


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def to_uint8_array(x: torch.Tensor | np.ndarray, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """[N, C, H, W] floats in `value_range` -> uint8 [N, H, W, C] (NVlabs rounding: x*127.5+128, clamp).

    The arithmetic runs where the tensor is (the GPU for a generator's output), so only the uint8
    pixels cross to the host; float32 math is the same on every device, and so are the pixels.
    """
    t = torch.as_tensor(x).detach().float()
    assert t.ndim == 4, f"expected [N, C, H, W], got {tuple(t.shape)}"
    lo, hi = value_range
    t = (t - lo) * (255.0 / (hi - lo))
    if value_range == (-1.0, 1.0):
        t = t + 0.5   # same as NVlabs' x * 127.5 + 128 followed by truncation
    # NHWC made contiguous where the tensor is: the host gets a plain array PIL wraps without a copy.
    return t.clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()


def uint8_to_images(arr: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(a[..., 0], "L") if a.shape[-1] == 1 else Image.fromarray(a[..., :3], "RGB") for a in arr]


def to_uint8_images(x: torch.Tensor | np.ndarray, value_range: tuple[float, float] = (-1.0, 1.0)) -> list[Image.Image]:
    """[N, C, H, W] floats in `value_range` -> PIL images (NVlabs rounding: x*127.5+128, clamp)."""
    return uint8_to_images(to_uint8_array(x, value_range))


def image_grid(images: list[Image.Image], cols: int | None = None, pad: int = 0, bg=(255, 255, 255)) -> Image.Image:
    if not images:
        raise ValueError("no images for a grid")
    n = len(images)
    cols = cols or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / cols))
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w + (cols - 1) * pad, rows * h + (rows - 1) * pad), bg)
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        grid.paste(im.convert("RGB"), (c * (w + pad), r * (h + pad)))
    return grid
