"""Per-class centres of a class-conditional StyleGAN's w space: what class-centred truncation pulls towards.

The truncation trick moves w towards a centre: w' = centre + psi * (w - centre). NVlabs' centre is w_avg, the
running mean of w that training tracks over every class. For a class-conditional model that mean sits between the
classes, so at psi < 1 every class is pulled towards one generic picture (for the bundled emoji model, a yellow
face) and a class's own look fades first. Conditional-GAN practice truncates towards the class's own mean w
instead: StyleGAN-XL keeps a w_avg per class, and Kocasari et al. 2022, "Rethinking the Truncation Trick in
Conditional GANs" (CVPR workshops), compare the two centres.

The centre of class k here is the mean of mapping(z, onehot(k)) over a fixed set of latents:

- the same `samples` latents for every class, drawn on the CPU from a seeded torch.Generator (so they are the
  same on every device, as the studio's seed -> z rule is), then moved to the mapping network's device;
- one class per mapping call (all its latents in one batch, or in `chunk`-sized pieces), so a class's centre
  does not depend on which other classes were asked for with it or in what order;
- in float32 with autocast off and without gradients; the result is float32, the dtype w_avg is kept in.

`ClassCentres` keeps the centres of one loaded generator, each computed on first use (1,024 latents through
the emoji model's 2-layer mapping: about 10 ms a class on a 2-core CPU), so a model load computes a class once
however many requests draw it, and a 1,000-class model does not pay for classes nobody draws.
`models.stylegan.LoadedGenerator.class_centres()` holds one per loaded model.
"""
from __future__ import annotations

import threading
from typing import Iterable

import torch

from core.errors import InputError

CENTRE_SAMPLES = 1024       # latents averaged per class: the mean's error is ~3% of w's spread per dimension
CENTRE_SEED = 0             # torch.Generator seed of those latents (recorded: a centre is reproducible)
CENTRE_CHUNK = 4096         # latents per mapping call at most (memory: [chunk, num_ws, w_dim] floats)


def _device_of(mapping: torch.nn.Module) -> torch.device:
    for t in list(mapping.parameters()) + list(mapping.buffers()):
        return t.device
    return torch.device("cpu")


def centre_latents(z_dim: int, samples: int = CENTRE_SAMPLES, seed: int = CENTRE_SEED) -> torch.Tensor:
    """The latents every class's centre averages over: [samples, z_dim] float32 on the CPU."""
    if samples < 1:
        raise InputError(f"a class centre needs at least one latent; got {samples}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randn([int(samples), int(z_dim)], generator=gen, dtype=torch.float32)


@torch.no_grad()
def class_centres(mapping: torch.nn.Module, classes: Iterable[int], samples: int = CENTRE_SAMPLES,
                  seed: int = CENTRE_SEED, chunk: int = CENTRE_CHUNK, z: torch.Tensor | None = None) -> torch.Tensor:
    """The mean w of each class in `classes` under a conditional mapping network (StyleGAN2 or StyleGAN3: both take
    `mapping(z, c, truncation_psi=1)` and return [N, num_ws, w_dim], or [N, w_dim] without num_ws).
    Returns [len(classes), w_dim] float32 on the mapping's device. `z`: the latents (default: centre_latents)."""
    c_dim, z_dim, w_dim = int(getattr(mapping, "c_dim", 0)), int(mapping.z_dim), int(mapping.w_dim)
    if c_dim <= 0:
        raise InputError("class centres need a class-conditional generator; this one is unconditional")
    classes = [int(k) for k in classes]
    bad = [k for k in classes if not 0 <= k < c_dim]
    if bad:
        raise InputError(f"class index {bad[0]} is out of range: this model has {c_dim} classes (0..{c_dim - 1})")
    device = _device_of(mapping)
    z = (centre_latents(z_dim, samples, seed) if z is None else z.float().cpu()).to(device)
    chunk = max(1, int(chunk))
    out = torch.empty([len(classes), w_dim], dtype=torch.float32, device=device)
    with torch.autocast(device_type=device.type, enabled=False):
        for i, k in enumerate(classes):
            total = torch.zeros([w_dim], dtype=torch.float64, device=device)
            for j in range(0, z.shape[0], chunk):
                zc = z[j:j + chunk]
                c = torch.zeros([zc.shape[0], c_dim], dtype=torch.float32, device=device)
                c[:, k] = 1
                w = mapping(zc, c, truncation_psi=1)
                w = w[:, 0] if w.dim() == 3 else w       # the num_ws copies are identical before truncation
                total += w.double().sum(0)
            out[i] = (total / z.shape[0]).float()
    return out


class ClassCentres:
    """The class centres of one mapping network, each computed the first time it is asked for and then kept.
    Thread-safe: two requests asking for the same new class compute it once."""

    def __init__(self, mapping: torch.nn.Module, samples: int = CENTRE_SAMPLES, seed: int = CENTRE_SEED):
        if int(getattr(mapping, "c_dim", 0)) <= 0:
            raise InputError("class centres need a class-conditional generator; this one is unconditional")
        self.mapping = mapping
        self.samples = int(samples)
        self.seed = int(seed)
        self._centres: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def c_dim(self) -> int:
        return int(self.mapping.c_dim)

    def computed(self) -> list[int]:
        """The classes whose centres are kept so far."""
        with self._lock:
            return sorted(self._centres)

    def __call__(self, classes: Iterable[int]) -> torch.Tensor:
        """[len(classes), w_dim] float32 on the mapping's device: the centre of each listed class (repeats allowed,
        e.g. one row per image of a batch)."""
        classes = [int(k) for k in classes]
        device = _device_of(self.mapping)
        with self._lock:
            missing = list(dict.fromkeys(k for k in classes if k not in self._centres))
            if missing:
                new = class_centres(self.mapping, missing, samples=self.samples, seed=self.seed)
                self._centres.update({k: new[i] for i, k in enumerate(missing)})
            rows = [self._centres[k].to(device) for k in classes]
        if not rows:
            return torch.empty([0, int(self.mapping.w_dim)], dtype=torch.float32, device=device)
        return torch.stack(rows)

    def all(self) -> torch.Tensor:
        """[c_dim, w_dim]: every class's centre."""
        return self(range(self.c_dim))
