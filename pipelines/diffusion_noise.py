"""Seeded noise drawn in float32 at every precision, so a seed's picture does not depend on the precision toggle.

diffusers' `randn_tensor` draws the random stream in the dtype it is asked for. With the studio's CPU generators
and fp16/bf16 latents that is the CPU's half-precision normal sampler, which on some torch versions (2.11) gives
another stream than the float32 sampler for the same seed: the picture then changes when the user flips
precision, and the drift figures measure a different picture instead of rounding. A1111 draws every random
tensor in float32 from the seed and casts it to the working dtype; so do we.

`fp32_noise()` puts `randn_fp32` in place of `randn_tensor` in every loaded diffusers module for the duration of a
generation, which covers all of a generation's draws: the initial latents, image-to-image noise, the VAE
encoder's latent sample and the per-step noise of ancestral/SDE samplers. In float32 `randn_fp32` calls diffusers'
own function (moving its CPU draw to a GPU with a non-blocking copy from pinned memory, the same values), so an
fp32 image stays bit-identical to a plain diffusers call with the same generators.

The replacement only acts inside the `with` block that installed it (a context variable, so a stock diffusers
call running at the same time in another thread, such as the benchmark's baseline, keeps diffusers' own
behaviour), and the originals are put back when the last block exits, however it exits.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

from pipelines import overlap

HALF_DTYPES = (torch.float16, torch.bfloat16)
_NAME = "randn_tensor"

_active: ContextVar[bool] = ContextVar("atelier_fp32_noise", default=False)
_lock = threading.Lock()


class _Installed:
    users = 0                                   # open fp32_noise() blocks, all threads together
    original: Callable[..., torch.Tensor] | None = None   # diffusers' own randn_tensor while installed
    replacement: Callable[..., torch.Tensor] | None = None


def _diffusers_randn() -> Callable[..., torch.Tensor]:
    original = _Installed.original
    if original is not None:
        return original
    from diffusers.utils import torch_utils

    return torch_utils.randn_tensor


def randn_fp32(shape, generator=None, device=None, dtype=None, layout=None) -> torch.Tensor:
    """diffusers' `randn_tensor` (same arguments), with fp16/bf16 noise drawn in float32 and then cast.

    Outside an `fp32_noise()` block of this thread, or for any other dtype, it is diffusers' function as is."""
    draw = _diffusers_randn()
    if not _active.get():
        return draw(shape, generator=generator, device=device, dtype=dtype, layout=layout)
    gens = generator if isinstance(generator, list) else [generator]
    on_cpu = all(g is not None and g.device.type == "cpu" for g in gens)
    target = torch.device(device) if device is not None else None
    if dtype not in HALF_DTYPES:
        if not (on_cpu and target is not None and target.type == "cuda"):
            return draw(shape, generator=generator, device=device, dtype=dtype, layout=layout)
        # The same CPU draw diffusers makes, moved without a host/device synchronisation (a plain .to(cuda)
        # waits for the stream: once per step for an ancestral sampler).
        return overlap.to_device(draw(shape, generator=generator, device=torch.device("cpu"), dtype=dtype,
                                      layout=layout), target)
    # With CPU generators diffusers draws on the CPU and then moves; casting before the move halves the copy.
    noise = draw(shape, generator=generator, device=torch.device("cpu") if on_cpu else device,
                 dtype=torch.float32, layout=layout).to(dtype)
    return noise if target is None else overlap.to_device(noise, target)


_scan: dict[str, Any] = {"n": -1, "mods": []}


def _diffusers_modules() -> Iterator[Any]:
    """The loaded diffusers modules. The scan of sys.modules (thousands of entries, ~7 ms per generation when
    made twice a call) is remembered until a module is imported or removed."""
    n = len(sys.modules)
    if _scan["n"] != n:
        # vars() rather than getattr: diffusers' lazy package modules import on attribute access.
        _scan["mods"] = [mod for name, mod in list(sys.modules.items())
                         if (name == "diffusers" or name.startswith("diffusers.")) and mod is not None]
        _scan["n"] = n
    yield from _scan["mods"]


def _install() -> None:
    from diffusers.utils import torch_utils

    original = vars(torch_utils)[_NAME]
    replacement = randn_fp32
    _Installed.original, _Installed.replacement = original, replacement
    for mod in _diffusers_modules():
        if vars(mod).get(_NAME) is original:
            setattr(mod, _NAME, replacement)


def _restore() -> None:
    original, replacement = _Installed.original, _Installed.replacement
    if replacement is None:                      # _install failed before it replaced anything
        return
    # Also modules first imported inside the block: they picked the replacement up from torch_utils.
    for mod in _diffusers_modules():
        if vars(mod).get(_NAME) is replacement:
            setattr(mod, _NAME, original)
    _Installed.original = _Installed.replacement = None


@contextlib.contextmanager
def fp32_noise() -> Iterator[None]:
    """Within the block, every diffusers draw of this thread is made in float32 and cast (see the module doc)."""
    with _lock:
        if _Installed.users == 0:
            try:
                _install()
            except BaseException:
                _restore()
                raise
        _Installed.users += 1
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            _Installed.users -= 1
            if _Installed.users == 0:
                _restore()
