"""Check a model file's declared architecture before any network is built.

A model file carries two things: the constructor kwargs of the network (NVlabs' `init_kwargs`, or
our JSON config) and its tensors. Building `Generator(**init_kwargs)` allocates and randomly
initialises every weight the kwargs declare, so a 777-byte pickle declaring `img_resolution=2**20`
or `channel_max=10**6` would make the server allocate gigabytes before a single tensor is compared.

`check_init_kwargs` refuses kwargs outside sane bounds (naming the field), and `build_checked`
builds the network on the meta device (no memory), compares its state-dict shapes with the tensors
actually in the file, and only then builds it for real. A refused file therefore never allocates
the network, and nothing it took is kept alive by the exception (no module in any frame).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from core.errors import InputError, ModelLoadError
from models.common import load_state_strict, shape_difference

__all__ = ["check_init_kwargs", "load_or_drop", "shape_difference", "tensor_shapes", "meta_shapes", "build_checked", "build_and_load",
           "LIMITS", "MAX_RESOLUTION"]

MAX_RESOLUTION = 2048
MAX_NUMBER = 1 << 22           # no numeric setting of a StyleGAN network is larger (channel_base is 32768 or 65536)
MAX_LIST = 64                  # resample filters, bias inits: a handful of taps
MAX_KEYS = 64
MAX_DEPTH = 4
MAX_STRING = 64

# field -> (lowest, highest) for integer settings, wherever the field sits in the kwargs tree.
# NVlabs' published configs: z_dim = w_dim = 512, channel_base 16384-65536, channel_max 512-1024,
# 2-8 mapping layers, 14 StyleGAN3 layers, c_dim up to 1000 (ImageNet).
LIMITS: dict[str, tuple[int, int]] = {
    "z_dim": (0, 4096),        # 0 only in the discriminator's label mapping
    "w_dim": (1, 4096),
    "c_dim": (0, 65536),
    "img_channels": (1, 16),
    "channel_base": (1, 1 << 22),
    "channel_max": (1, 8192),
    "num_fp16_res": (0, 16),
    "cmap_dim": (1, 8192),
    "embed_features": (0, 8192),
    "layer_features": (1, 8192),
    "num_layers": (1, 64),      # mapping layers (2-8) and StyleGAN3 synthesis layers (14)
    "num_critical": (0, 63),
    "margin_size": (0, 256),
    "kernel_size": (1, 7),
    "conv_kernel": (1, 7),
    "filter_size": (1, 32),
    "lrelu_upsampling": (1, 8),
    "mbstd_group_size": (1, 1024),
    "mbstd_num_channels": (0, 64),
}
# pruned per-layer channel counts ({"b8.conv0": 115, ...}) are bounded like channel_max
_CHANNEL_MAPS = ("layer_channels",)


def _fail(field: str, problem: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"refusing to build the {what}: its config field {field!r} {problem}; "
                          "the file does not describe a sane StyleGAN network")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_value(field: str, key: str, value: Any, what: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _fail(field, f"is nested more than {MAX_DEPTH} levels deep", what)
    if isinstance(value, Mapping):
        if len(value) > MAX_KEYS:
            raise _fail(field, f"has {len(value)} entries (at most {MAX_KEYS})", what)
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > MAX_STRING:
                raise _fail(field, f"has a key {str(k)[:40]!r} that is not a short string", what)
            if key in _CHANNEL_MAPS:
                if not _is_int(v) or not 1 <= v <= LIMITS["channel_max"][1]:
                    raise _fail(f"{field}.{k}", f"is {v!r}; a channel count must be an integer in "
                                                f"[1, {LIMITS['channel_max'][1]}]", what)
                continue
            _check_value(f"{field}.{k}" if field else k, k, v, what, depth + 1)
        return
    if isinstance(value, (list, tuple)):
        if len(value) > MAX_LIST:
            raise _fail(field, f"is a list of {len(value)} values (at most {MAX_LIST})", what)
        for i, v in enumerate(value):
            _check_value(f"{field}[{i}]", key, v, what, depth + 1)
        return
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise _fail(field, f"is a string of {len(value)} characters (at most {MAX_STRING})", what)
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(field, f"is {value!r}, not a finite number", what)
        if abs(value) > MAX_NUMBER:
            raise _fail(field, f"is {value!r}, larger than any StyleGAN setting (at most {MAX_NUMBER})", what)
        if key in LIMITS:
            lo, hi = LIMITS[key]
            if not _is_int(value):
                raise _fail(field, f"is {value!r}; it must be an integer in [{lo}, {hi}]", what)
            if not lo <= value <= hi:
                raise _fail(field, f"is {value}; it must be between {lo} and {hi}", what)
        return
    raise _fail(field, f"has a value of type {type(value).__name__}, which a network config never holds", what)


def check_init_kwargs(kwargs: Any, what: str = "generator", min_resolution: int = 4) -> dict:
    """Refuse constructor kwargs outside sane bounds, naming the field. Returns `kwargs` unchanged.

    Bounds every numeric field (a generic cap, and the LIMITS table for the sizes that decide how
    much memory the network takes), img_resolution (a power of two in [min_resolution, 2048]),
    and the shape of the kwargs tree itself (depth, keys, list and string lengths).
    """
    if not isinstance(kwargs, Mapping):
        raise ModelLoadError(f"the {what} config must be a JSON object of constructor arguments, "
                             f"got {type(kwargs).__name__}")
    _check_value("", "", kwargs, what, 0)
    res = kwargs.get("img_resolution")
    if not _is_int(res) or not min_resolution <= res <= MAX_RESOLUTION or res & (res - 1):
        raise _fail("img_resolution", f"is {res!r}; it must be a power of two between {min_resolution} and "
                                      f"{MAX_RESOLUTION}", what)
    layers, critical = kwargs.get("num_layers"), kwargs.get("num_critical")
    if _is_int(layers) and _is_int(critical) and critical >= layers:
        raise _fail("num_critical", f"is {critical}; it must be smaller than num_layers ({layers})", what)
    return dict(kwargs)


def tensor_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(t.shape) for k, t in state.items()}


def meta_shapes(make: Callable[[], torch.nn.Module], what: str) -> dict[str, tuple]:
    """The state-dict shapes of `make()` built on the meta device: no weight is allocated."""
    try:
        with torch.device("meta"):
            probe = make()
    except (TypeError, ValueError, InputError) as exc:
        message = f"cannot build the {what} from its config: {exc}"
    else:
        shapes = tensor_shapes(probe.state_dict())
        del probe
        return shapes
    raise ModelLoadError(message)    # outside the except block: no chained exception, no frames kept


def build_checked(make: Callable[[], torch.nn.Module], found: Mapping[str, tuple], what: str) -> torch.nn.Module:
    """`make()` for real, but only once its meta-device twin has exactly the shapes in `found`.

    `make` must build the network from kwargs already passed through `check_init_kwargs`.
    The real build is a fresh construction (same initialisation and non-persistent buffers as
    always); its weights are then replaced by the caller's strict load.
    """
    diff = shape_difference(meta_shapes(make, what), found)
    if diff:
        raise ModelLoadError(f"the weights in the file do not fit the {what} its config declares "
                             f"(checked before building it): {diff}")
    try:
        return make()
    except (TypeError, ValueError, InputError) as exc:
        message = f"cannot build the {what} from its config: {exc}"
    raise ModelLoadError(message)


def build_and_load(make: Callable[[], torch.nn.Module], state: Mapping[str, torch.Tensor], what: str,
                   min_resolution: int = 4, kwargs: Mapping | None = None) -> torch.nn.Module:
    """check_init_kwargs (when `kwargs` is given), build_checked against `state`'s shapes, strict load.

    On any failure the half-built module is dropped before the error is raised, so neither the
    exception nor its traceback keeps the network alive.
    """
    if kwargs is not None:
        check_init_kwargs(kwargs, what, min_resolution=min_resolution)
    return load_or_drop(build_checked(make, tensor_shapes(state), what), state, what)


def load_or_drop(module: torch.nn.Module, state: dict, what: str) -> torch.nn.Module:
    """Strict load of `state` into `module`; on failure the module is dropped before the error is raised, so
    the exception (and its traceback) keeps nothing alive. Pass the module as a temporary, not a variable,
    for the same reason."""
    message = None
    try:
        load_state_strict(module, state, what)
    except (ModelLoadError, RuntimeError) as exc:
        message = str(exc)
    if message is not None:
        del module
        raise ModelLoadError(message)
    return module
