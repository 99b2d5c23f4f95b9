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


def quiet_third_party_output() -> None:
    """Silence diffusers'/transformers' own loading bars and advisory logs: the CLI and UI show
    their own progress, and the CLI's error convention is one line on stderr."""
    import logging
    import os

    import warnings

    # Import-time chatter (torchao's optional kernels, pytree deprecations) must not reach stderr
    # before our own one-line messages; set the levels before those libraries are imported.
    for noisy in ("torchao", "torch.utils._pytree", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchao")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in ("diffusers", "transformers"):
        try:
            mod = __import__(f"{name}.utils.logging", fromlist=["logging"])
            mod.disable_progress_bar()
            mod.set_verbosity_error()
        except Exception:  # the library is optional (e.g. StyleGAN-only installs)
            logging.getLogger(name).setLevel(logging.ERROR)
