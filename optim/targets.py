"""What a toggle acts on: a StyleGAN generator, a diffusers pipeline, or a bare diffusion module.

`prepare` accepts three forms and every toggle sees them through `Target`:

- kind="stylegan", a Generator (mapping + synthesis): the component is "generator";
  compile and TensorRT act on `G.synthesis` (the mapping network is a few small matmuls,
  and its Python-float truncation ψ would make torch.compile recompile on every value).
- kind="diffusion", a diffusers pipeline object (has `.unet` or `.transformer`, `.vae`,
  `.text_encoder` ...): components "unet", "vae", "text_encoder", "text_encoder_2".
- kind="diffusion", a bare nn.Module (e.g. `pipe.unet` alone): the component is "unet";
  pipeline-level toggles (CPU offload, casting the other components) are then reported as
  needing the pipeline object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from core.errors import InputError

KINDS = ("stylegan", "diffusion")
DIFFUSION_COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


@dataclass
class Context:
    """Everything a toggle needs besides the flags: where it runs and where caches live."""

    device: torch.device
    cache_dir: Path
    weights_hash: str | None = None          # identifies the weights for the TensorRT engine cache
    on_status: Callable[[str], None] | None = None
    offloaded: bool = False                  # model CPU offload is on: weights move every step


@dataclass
class Target:
    kind: str
    root: Any                                # what prepare returns: the generator, the pipeline or the module
    pipe: Any = None                         # the diffusers pipeline, when given one
    components: dict[str, torch.nn.Module] = field(default_factory=dict)

    @property
    def is_pipeline(self) -> bool:
        return self.pipe is not None

    def get(self, name: str) -> torch.nn.Module | None:
        return self.components.get(name)

    def set(self, name: str, module: torch.nn.Module) -> None:
        """Swap a component (e.g. for its compiled wrapper) wherever it lives."""
        self.components[name] = module
        if self.pipe is not None:
            setattr(self.pipe, name, module)
        elif self.kind == "diffusion":
            self.root = module

    def modules(self) -> list[tuple[str, torch.nn.Module]]:
        return [(k, m) for k, m in self.components.items() if isinstance(m, torch.nn.Module)]


def resolve(obj: Any, kind: str) -> Target:
    if kind not in KINDS:
        raise InputError(f"optimization target kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if kind == "stylegan":
        if not isinstance(obj, torch.nn.Module) or not hasattr(obj, "synthesis"):
            raise InputError("StyleGAN optimizations need a generator with a .synthesis network")
        return Target(kind, obj, None, {"generator": obj})
    if isinstance(obj, torch.nn.Module):
        return Target(kind, obj, None, {"unet": obj})
    comps: dict[str, torch.nn.Module] = {}
    for name in DIFFUSION_COMPONENTS:
        m = getattr(obj, name, None)
        if isinstance(m, torch.nn.Module):
            comps[name] = m
    if "unet" not in comps:
        raise InputError("diffusion optimizations need a diffusers pipeline with a UNet (.unet) or the UNet itself; "
                         f"got a {type(obj).__name__}")
    return Target(kind, obj, obj, comps)


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
