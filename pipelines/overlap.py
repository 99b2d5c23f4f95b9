"""Keeping the host ahead of the GPU in diffusers' denoising loop.

A CUDA-graph UNet step is one launch, so the host can queue step i+1 while the GPU runs step i,
as long as nothing in between waits for the GPU. Stock diffusers waits in two places:

- Schedulers index their CPU tables (alphas_cumprod, sigmas) with the step's timestep, a 0-d CUDA
  tensor when the timesteps live on the GPU: every such index or comparison is a `.item()`, a
  synchronisation. PNDM (SD 1.5's default) does it twice a step; on the H200 the GPU then sat idle
  25 % of an SD 1.5 image (shared/gpu-runs/2026-12-01, sd-b1.jsonl, profile of `best`).
- Moving a CPU tensor to the GPU with a plain `.to(device)` synchronises the stream after the copy.

So, on a GPU: `host_timesteps` keeps a scheduler's timesteps on the CPU (its arithmetic is scalar
work), the UNet gets its timestep through `timestep_to_device`, a pinned, non-blocking copy, and
`StepPacer` lets the host run at most `lag` steps ahead, so progress reports stay honest and a
cancel stops within two steps. On the CPU none of this changes anything.
"""
from __future__ import annotations

import functools
import inspect
from collections import deque
from typing import Any

import torch

_HOST_ATTR = "_atelier_host_timesteps"
_HOOK_ATTR = "_atelier_timestep_hook"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without synchronising: a copy from pinned memory, ordered on the current stream.
    (The caching host allocator keeps the pinned block alive until the copy has run.)"""
    if t.device == device:
        return t
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_timesteps(scheduler: Any) -> Any:
    """Make `scheduler.set_timesteps` build its state on the CPU whatever device diffusers asks for. Idempotent.

    The loop's `t` is then a CPU 0-d tensor: the scheduler's table lookups are host work, and the UNet gets
    the value through `install_timestep_hook`."""
    if getattr(scheduler, _HOST_ATTR, False):
        return scheduler
    original = scheduler.set_timesteps
    sig = inspect.signature(original)

    @functools.wraps(original)           # keeps the signature: diffusers inspects it for `timesteps` / `sigmas`
    def set_timesteps(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs)
        if "device" in sig.parameters:
            bound.arguments["device"] = "cpu"
        return original(*bound.args, **bound.kwargs)

    scheduler.set_timesteps = set_timesteps
    setattr(scheduler, _HOST_ATTR, True)
    return scheduler


def _timestep_pre_hook(module, args, kwargs):
    """Forward pre-hook of a UNet: a CPU timestep goes to the sample's GPU without a synchronisation."""
    sample = args[0] if args else kwargs.get("sample")
    if not isinstance(sample, torch.Tensor) or sample.device.type != "cuda":
        return None
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].device.type == "cpu":
        return (args[0], to_device(args[1], sample.device), *args[2:]), kwargs
    t = kwargs.get("timestep")
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        return args, {**kwargs, "timestep": to_device(t, sample.device)}
    return None


def install_timestep_hook(unet: torch.nn.Module) -> bool:
    """Register the timestep pre-hook on `unet` once; returns whether one was added."""
    if getattr(unet, _HOOK_ATTR, None) is not None:
        return False
    handle = unet.register_forward_pre_hook(_timestep_pre_hook, with_kwargs=True)
    object.__setattr__(unet, _HOOK_ATTR, handle)
    return True


class StepPacer:
    """Bounds how far the host runs ahead of the GPU: after queueing step i it waits for step i - lag to finish.

    lag = 2 keeps one step queued behind the running one (the GPU never idles on the host) while the progress
    the studio reports is at most two steps early. A no-op off CUDA."""

    def __init__(self, device: torch.device, lag: int = 2):
        self.on = torch.device(device).type == "cuda"
        self.lag = max(1, int(lag))
        self.events: deque = deque()

    def step(self) -> None:
        if not self.on:
            return
        ev = torch.cuda.Event()
        ev.record()
        self.events.append(ev)
        while len(self.events) > self.lag:
            self.events.popleft().synchronize()
