"""Restricted reader for NVlabs network pickles (StyleGAN2, StyleGAN2-ADA, StyleGAN3).

NVlabs' `torch_utils.persistence` pickles every network together with the
Python source of its module and rebuilds it with `exec`. We never run that
source. The unpickler below resolves only an allow-list of globals; the
persistent-object hook returns a plain `PersistentRecord` (class name, the
constructor arguments NVlabs recorded, and the module tree's tensors) that
`models.stylegan` turns into one of our own vetted classes.

A pickle that asks for any other global is refused with `UnsafeModelError`
before anything it names is imported or called.
"""
from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import ModelLoadError, UnsafeModelError

__all__ = ["PersistentRecord", "read_network_pickle", "load_pickle_bytes"]


@dataclass
class PersistentRecord:
    """What NVlabs' persistence layer saved for one network object."""

    class_name: str                        # e.g. "Generator", "SynthesisNetwork"
    module_src: str                        # the embedded source text, kept only for sniffing (never executed)
    init_args: tuple = ()
    init_kwargs: dict = field(default_factory=dict)
    attributes: dict = field(default_factory=dict)   # plain public attributes (img_resolution, …)
    parameters: dict = field(default_factory=dict)   # name -> Tensor | None, this module only
    buffers: dict = field(default_factory=dict)      # name -> Tensor | None, this module only
    children: dict = field(default_factory=dict)     # name -> PersistentRecord | ModuleRecord

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Flattened tensors of the whole subtree, keyed as torch would key them."""
        out: dict[str, torch.Tensor] = {}
        for name, t in list(self.parameters.items()) + list(self.buffers.items()):
            if t is not None:
                out[prefix + name] = t
        for name, child in self.children.items():
            out.update(child.state_dict(prefix + name + "."))
        return out

    def find(self, class_name: str) -> list["PersistentRecord"]:
        found = [self] if self.class_name == class_name else []
        for child in self.children.values():
            found.extend(child.find(class_name))
        return found


def _reconstruct_persistent_obj(meta: dict) -> PersistentRecord:
    if not isinstance(meta, dict) or meta.get("type") != "class":
        raise UnsafeModelError("network pickle holds a persistent object of an unknown kind; refusing it")
    state = meta.get("state")
    if not isinstance(state, dict):
        raise UnsafeModelError("network pickle holds a persistent object without a state dictionary")
    return _record_from_state(str(meta.get("class_name", "")), str(meta.get("module_src", "")), state)


def _record_from_state(class_name: str, module_src: str, state: dict) -> PersistentRecord:
    children = {}
    for name, child in (state.get("_modules") or {}).items():
        if child is None:
            continue
        if not isinstance(child, PersistentRecord):
            raise UnsafeModelError(f"submodule {name!r} is not a recorded network object")
        children[name] = child
    attributes = {k: v for k, v in state.items() if not k.startswith("_") and k != "training"}
    return PersistentRecord(
        class_name=class_name,
        module_src=module_src,
        init_args=tuple(state.get("_init_args") or ()),
        init_kwargs=dict(state.get("_init_kwargs") or {}),
        attributes=attributes,
        parameters=dict(state.get("_parameters") or {}),
        buffers=dict(state.get("_buffers") or {}),
        children=children,
    )


def _load_storage_from_bytes(data: bytes):
    # torch pickles each storage as a tiny torch.save() archive; read it with the weights-only unpickler.
    if not isinstance(data, (bytes, bytearray)):
        raise UnsafeModelError("tensor storage in network pickle is not a byte string")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message suggests weights_only=False; that is exactly what must never happen here.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeModelError(
            "refusing to load: a tensor inside the network pickle asks to run code or import names "
            f"that a plain tensor never needs ({first[:160]})") from None


class _EasyDict(dict):
    """Stand-in for dnnlib.util.EasyDict: a dict, attribute access not needed."""


def _numpy_global(name: str):
    core = getattr(np, "_core", None) or np.core
    return getattr(core.multiarray, name)


# (module, name) -> callable. Nothing outside this table is ever resolved.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch_utils.persistence", "_reconstruct_persistent_obj"): _reconstruct_persistent_obj,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "scalar"): _numpy_global("scalar"),
    ("numpy._core.multiarray", "scalar"): _numpy_global("scalar"),
    ("numpy.core.multiarray", "_reconstruct"): _numpy_global("_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_global("_reconstruct"),
    ("dnnlib.util", "EasyDict"): _EasyDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeModelError(
                f"refusing to load: the pickle asks for '{module}.{name}', which is not on the allow-list "
                "of an NVlabs network pickle. Only genuine StyleGAN network pickles can be read; "
                "convert other files to safetensors first."
            ) from None

    def persistent_load(self, pid):
        raise UnsafeModelError("network pickle uses persistent ids, which NVlabs pickles never do; refusing it")


def load_pickle_bytes(data: bytes) -> Any:
    """Unpickle with the allow-list. Raises UnsafeModelError or ModelLoadError."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except (UnsafeModelError, ModelLoadError):
        raise
    except Exception as exc:  # truncated, wrong protocol, corrupt tensor data …
        raise ModelLoadError(f"could not parse the network pickle: {type(exc).__name__}: {exc}") from None


def read_network_pickle(path: str | Path) -> dict[str, Any]:
    """Read an NVlabs snapshot pickle: returns {'G_ema': PersistentRecord, 'G': …, 'D': …, …}.

    A bare-network pickle (a single persistent object) is returned as {'G_ema': record}.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    data = path.read_bytes()
    if zipfile.is_zipfile(io.BytesIO(data)):
        raise ModelLoadError(
            f"{path.name} is a torch.save() archive, not an NVlabs network pickle; load it as a .pt checkpoint"
        )
    obj = load_pickle_bytes(data)
    if isinstance(obj, PersistentRecord):
        return {"G_ema": obj}
    if not isinstance(obj, dict) or not any(isinstance(v, PersistentRecord) for v in obj.values()):
        raise ModelLoadError(f"{path.name} holds no StyleGAN network (expected a dict with 'G_ema')")
    return dict(obj)
