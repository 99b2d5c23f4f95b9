"""Model-side services the UI and CLI may call (they do not import models/ or optim/ directly)."""
from __future__ import annotations

import torch


def convert_stylegan_pickle(src: str, dst: str, dtype: str | None = None):
    """NVlabs .pkl -> Atelier .safetensors + .json (no pickle needed to load the result)."""
    from models.stylegan import convert_pickle

    return convert_pickle(src, dst, dtype=dtype)


def optimization_availability(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """name -> (can run here, reason) for every optimization toggle, for the UI's panel."""
    import optim

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fn = getattr(optim, "availability", None)
    if fn is None:
        return {"precision": (True, "fp32, tf32 (GPU), fp16 (GPU), bf16")}
    return fn(dev)
