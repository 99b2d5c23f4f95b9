"""Differentiable augmentation on the GPU with an adaptive probability (ADA).

"Training Generative Adversarial Networks with Limited Data" (Karras et al., 2020):
every image the discriminator sees, real or generated, goes through the same random
transformations, each applied with probability p. Because the transformations are
differentiable, the generator learns through them; because each is applied with
p < ~0.8 and is invertible in distribution, the generator is not pushed to
produce augmented-looking images ("non-leaking"). p adapts so that the overfitting
heuristic r_t = E[sign(D(real))] stays near a target (0.6).

Pipelines (ADA's names): 'blit' = x-flip, 90-degree rotations, integer translation;
'geom' = isotropic scale, rotation, anisotropic scale, fractional translation;
'color' = brightness, contrast, luma flip, hue rotation, saturation; 'bg', 'bgc'
combine them; 'bgcc' adds cutout.

'upright' (ours, not ADA's): integer and fractional translation, isotropic and
anisotropic scale, brightness, contrast, hue, saturation; no x-flip, no 90-degree or
arbitrary rotation, no luma flip. For data with a canonical orientation and background
(emoji, glyphs, icons): "non-leaking" holds only while p stays below ~0.8, and ADA's p
does not stay there when the data set is small. Two emoji64 runs leaked: one with the luma
flip in its pipe at p ~0.6 drew black backgrounds; with 'bg' at p = 1 (reached by
1,550 kimg) G drew emoji rotated by 90 degrees and recall fell from 0.27 to 0.05. Every
op 'upright' keeps maps an upright image to an upright one and keeps light above dark
(positive scales, no inversion), so even a leak of it is still a plausible sample.
LEAK_PRONE_OPS names the ops whose leak is not; `AdaController(max_p=...)` caps p.

Implementation: all geometric transformations of a sample compose into one 2x3
matrix and are applied with a single grid_sample (reflection padding; nearest
sampling when only pixel-exact 'blit' transforms are used, bilinear otherwise); all
colour transformations compose into one 4x4 matrix applied as a batched matmul.
Every random number comes from the global torch RNG, which the trainer reseeds per
step, so a resumed run augments exactly as an uninterrupted one. p is a 0-d tensor
on the device, updated there: no host synchronisation.

Note on R1 with augmentation: the trainer computes the R1 gradient with respect to
the augmented real images (what D actually sees), so grid_sample never needs a
second derivative (PyTorch has none for it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from core.errors import InputError

PIPES = {
    "blit": dict(xflip=1, rotate90=1, xint=1),
    "geom": dict(scale=1, rotate=1, aniso=1, xfrac=1),
    "color": dict(brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1),
    "bg": dict(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1),
    "bgc": dict(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1,
                brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1),
    "bgcc": dict(xflip=1, rotate90=1, xint=1, scale=1, rotate=1, aniso=1, xfrac=1,
                 brightness=1, contrast=1, lumaflip=1, hue=1, saturation=1, cutout=1),
    "upright": dict(xint=1, scale=1, aniso=1, xfrac=1, brightness=1, contrast=1, hue=1, saturation=1),
}
# Ops whose leak produces samples outside the data (sideways, mirrored or colour-inverted images); the
# collapse monitor warns when p stays high with any of them in the pipe (training/monitor.py).
LEAK_PRONE_OPS = ("xflip", "rotate90", "rotate", "lumaflip")
_GEOM_OPS = ("xflip", "rotate90", "xint", "scale", "rotate", "aniso", "xfrac")
_COLOR_OPS = ("brightness", "contrast", "lumaflip", "hue", "saturation")


def leak_prone_ops(pipe: str) -> list[str]:
    """The LEAK_PRONE_OPS that pipeline `pipe` contains (empty for 'upright')."""
    return [op for op in LEAK_PRONE_OPS if PIPES.get(pipe, {}).get(op)]


def _eye(n: int, batch: int, device) -> torch.Tensor:
    return torch.eye(n, device=device).unsqueeze(0).repeat(batch, 1, 1)


def _mat(rows, device) -> torch.Tensor:
    """Stack a nested list of [N] tensors / floats into [N, r, c]."""
    n = next(x.shape[0] for row in rows for x in row if torch.is_tensor(x))
    out = [torch.stack([x if torch.is_tensor(x) else torch.full((n,), float(x), device=device) for x in row], -1)
           for row in rows]
    return torch.stack(out, -2)


def _translate2d(tx, ty, device):
    return _mat([[1, 0, tx], [0, 1, ty], [0, 0, 1]], device)


def _scale2d(sx, sy, device):
    return _mat([[sx, 0, 0], [0, sy, 0], [0, 0, 1]], device)


def _rotate2d(theta, device):
    c, s = torch.cos(theta), torch.sin(theta)
    return _mat([[c, -s, 0], [s, c, 0], [0, 0, 1]], device)


class AugmentPipe(torch.nn.Module):
    """images [N, C, H, W] float in [-1, 1] -> augmented images, same shape; p is a 0-d buffer."""

    def __init__(self, pipe: str = "bgc", p: float = 0.0,
                 xint_max: float = 0.125, scale_std: float = 0.2, rotate_max: float = 1.0,
                 aniso_std: float = 0.2, xfrac_std: float = 0.125, brightness_std: float = 0.2,
                 contrast_std: float = 0.5, hue_max: float = 1.0, saturation_std: float = 1.0,
                 cutout_size: float = 0.5):
        super().__init__()
        if pipe not in PIPES:
            raise InputError(f"augmentation pipeline must be one of {', '.join(PIPES)}; got {pipe!r}")
        self.pipe = pipe
        self.ops = dict(PIPES[pipe])
        self.register_buffer("p", torch.tensor(float(p)))
        # The grey (luma) axis, kept as a buffer: building it per call with torch.tensor(...)
        # would be a host-to-device copy, which synchronises the GPU stream every step.
        self.register_buffer("luma", torch.tensor([1.0, 1.0, 1.0, 0.0]) / math.sqrt(3), persistent=False)
        self.xint_max = xint_max
        self.scale_std = scale_std
        self.rotate_max = rotate_max
        self.aniso_std = aniso_std
        self.xfrac_std = xfrac_std
        self.brightness_std = brightness_std
        self.contrast_std = contrast_std
        self.hue_max = hue_max
        self.saturation_std = saturation_std
        self.cutout_size = cutout_size

    def _on(self, name: str, n: int, device) -> torch.Tensor:
        """[N] float mask: 1 where op `name` is applied to the sample (probability p)."""
        return (torch.rand(n, device=device) < self.p * self.ops.get(name, 0)).float()

    # -- geometry ------------------------------------------------------------------------------
    def _geometry(self, n: int, h: int, w: int, device) -> torch.Tensor:
        """[N, 3, 3]: output normalized coordinates -> input normalized coordinates."""
        G = _eye(3, n, device)
        ops = self.ops
        if ops.get("xflip"):
            i = torch.randint(0, 2, (n,), device=device).float() * self._on("xflip", n, device)
            G = G @ _scale2d(1 - 2 * i, torch.ones(n, device=device), device)
        if ops.get("rotate90"):
            i = torch.randint(0, 4, (n,), device=device).float() * self._on("rotate90", n, device)
            G = G @ _rotate2d(-math.pi / 2 * i, device)
        if ops.get("xint"):
            t = (torch.rand(n, 2, device=device) * 2 - 1) * self.xint_max * self._on("xint", n, device)[:, None]
            # whole pixels: k pixels = 2k / size in normalized coordinates
            tx = torch.round(t[:, 0] * w) * 2 / w
            ty = torch.round(t[:, 1] * h) * 2 / h
            G = G @ _translate2d(tx, ty, device)
        if ops.get("scale"):
            s = torch.exp2(torch.randn(n, device=device) * self.scale_std * self._on("scale", n, device))
            G = G @ _scale2d(s, s, device)
        if ops.get("rotate"):
            theta = (torch.rand(n, device=device) * 2 - 1) * math.pi * self.rotate_max
            G = G @ _rotate2d(theta * self._on("rotate", n, device), device)
        if ops.get("aniso"):
            s = torch.exp2(torch.randn(n, device=device) * self.aniso_std * self._on("aniso", n, device))
            G = G @ _scale2d(s, 1 / s, device)
        if ops.get("xfrac"):
            t = torch.randn(n, 2, device=device) * self.xfrac_std * self._on("xfrac", n, device)[:, None]
            G = G @ _translate2d(t[:, 0] * 2, t[:, 1] * 2, device)
        return G

    # -- colour ----------------------------------------------------------------------------------
    def _color(self, n: int, device) -> torch.Tensor:
        """[N, 4, 4] acting on homogeneous RGB."""
        C = _eye(4, n, device)
        ops = self.ops
        v = self.luma.to(device)
        vv = torch.outer(v, v)
        if ops.get("brightness"):
            b = torch.randn(n, device=device) * self.brightness_std * self._on("brightness", n, device)
            C = _mat([[1, 0, 0, b], [0, 1, 0, b], [0, 0, 1, b], [0, 0, 0, 1]], device) @ C
        if ops.get("contrast"):
            c = torch.exp2(torch.randn(n, device=device) * self.contrast_std * self._on("contrast", n, device))
            C = _mat([[c, 0, 0, 0], [0, c, 0, 0], [0, 0, c, 0], [0, 0, 0, 1]], device) @ C
        if ops.get("lumaflip"):
            i = torch.randint(0, 2, (n,), device=device).float() * self._on("lumaflip", n, device)
            C = (torch.eye(4, device=device) - 2 * vv * i[:, None, None]) @ C
        if ops.get("hue"):
            theta = (torch.rand(n, device=device) * 2 - 1) * math.pi * self.hue_max * self._on("hue", n, device)
            C = self._rotate_about_luma(theta, device) @ C
        if ops.get("saturation"):
            s = torch.exp2(torch.randn(n, device=device) * self.saturation_std * self._on("saturation", n, device))
            C = (vv + (torch.eye(4, device=device) - vv) * s[:, None, None]) @ C
        return C

    @staticmethod
    def _rotate_about_luma(theta: torch.Tensor, device) -> torch.Tensor:
        """Rodrigues rotation by theta about the grey axis (1, 1, 1)/sqrt(3): a hue rotation."""
        a = 1 / math.sqrt(3)
        c, s = torch.cos(theta), torch.sin(theta)
        k = 1 - c
        rows = [[c + a * a * k, a * a * k - a * s, a * a * k + a * s, 0],
                [a * a * k + a * s, c + a * a * k, a * a * k - a * s, 0],
                [a * a * k - a * s, a * a * k + a * s, c + a * a * k, 0],
                [0, 0, 0, 1]]
        return _mat(rows, device)

    # -- forward -------------------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.ndim != 4:
            raise InputError(f"augmentation expects images [N, C, H, W]; got shape {list(images.shape)}")
        # Always in float32, autocast or not: under bf16 the colour matrix product alone rounded every
        # image D sees (reals too, even at p = 0) to bf16's 8-bit mantissa, near one uint8 level at +-1,
        # and bilinear resampling of bf16 adds its own rounding. The cost is a few elementwise passes.
        with torch.autocast(images.device.type, enabled=False):
            return self._forward(images.float())

    def _forward(self, images: torch.Tensor) -> torch.Tensor:
        n, c, h, w = images.shape
        device = images.device
        x = images
        if any(self.ops.get(k) for k in _GEOM_OPS):
            G = self._geometry(n, h, w, device)
            grid = F.affine_grid(G[:, :2, :], [n, c, h, w], align_corners=False)
            pixel_exact = not any(self.ops.get(k) for k in ("scale", "rotate", "aniso", "xfrac"))
            x = F.grid_sample(x, grid, mode="nearest" if pixel_exact else "bilinear",
                              padding_mode="reflection", align_corners=False)
        if c == 3 and any(self.ops.get(k) for k in _COLOR_OPS):
            C = self._color(n, device)
            flat = x.reshape(n, 3, h * w)
            x = (C[:, :3, :3] @ flat + C[:, :3, 3:]).reshape(n, 3, h, w)
        if self.ops.get("cutout"):
            on = self._on("cutout", n, device)
            centre = torch.rand(n, 2, 1, 1, device=device)
            size = (self.cutout_size * on)[:, None, None]
            yy = ((torch.arange(h, device=device) + 0.5) / h)[None, :, None]
            xx = ((torch.arange(w, device=device) + 0.5) / w)[None, None, :]
            keep = ((xx - centre[:, 0]).abs() >= size / 2) | ((yy - centre[:, 1]).abs() >= size / 2)
            x = x * keep[:, None].to(x.dtype)
        return x


class AdaController:
    """Keeps r_t = E[sign(D(real))] near `target` by nudging p every `interval` iterations.

    The running sums live on the device; `update()` changes p there, so the trainer's
    inner loop never waits for the GPU. The step size lets p go from 0 to 1 in
    `speed_kimg` thousand images (ADA's ada_kimg = 500). p never exceeds `max_p`: NVlabs has no
    cap (max_p = 1), but on a small data set r_t can stay above target whatever p is, and p then
    climbs to 1, where flips and rotations leak into G (see the module docstring).
    """

    def __init__(self, pipe: AugmentPipe, target: float = 0.6, interval: int = 4, speed_kimg: float = 500.0,
                 batch: int = 32, device=None, max_p: float = 1.0):
        if not 0.0 < max_p <= 1.0:
            raise InputError(f"the cap on ADA's p (--ada-max-p) must be in (0, 1]; got {max_p}")
        self.pipe = pipe
        self.max_p = float(max_p)
        self.target = float(target)
        self.interval = int(interval)
        self.speed_kimg = float(speed_kimg)
        self.batch = int(batch)
        self.stats = torch.zeros(2, device=device)       # [sum of sign(D(real)), count]
        self.last_rt = torch.zeros((), device=device)

    def accumulate(self, real_logits: torch.Tensor) -> None:
        self.stats[0] += real_logits.detach().float().sign().sum()
        self.stats[1] += real_logits.shape[0]

    def update(self, all_reduce=None) -> None:
        stats = self.stats
        if all_reduce is not None:
            stats = stats.clone()
            all_reduce(stats)
        rt = stats[0] / stats[1].clamp(min=1)
        step = (self.batch * self.interval) / (self.speed_kimg * 1000)
        adjust = torch.sign(rt - self.target) * step * (stats[1] > 0).float()
        # clamp with Python bounds: p stays a device tensor and nothing waits for the GPU
        self.pipe.p.copy_((self.pipe.p + adjust).clamp(0.0, self.max_p))
        self.last_rt.copy_(rt)
        self.stats.zero_()

    def state_dict(self) -> dict:
        return {"p": float(self.pipe.p), "stats": [float(v) for v in self.stats.tolist()],
                "last_rt": float(self.last_rt), "target": self.target}

    def load_state_dict(self, state: dict) -> None:
        self.pipe.p.fill_(float(state["p"]))
        self.stats.copy_(torch.tensor(state["stats"], dtype=torch.float32))
        self.last_rt.fill_(float(state["last_rt"]))
        self.target = float(state.get("target", self.target))
