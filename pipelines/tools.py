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


def compress_stylegan(src: str, dst: str, amount: float, steps: int = 1000, batch: int = 8, lr: float = 1e-3,
                      device: str | None = None, fp16: bool = False, on_step=None) -> dict:
    """Structured pruning + distillation of a StyleGAN2 generator into a smaller model file.

    The pruned channel counts go into the saved config (`layer_channels`), so the result loads like
    any Atelier model; the report has the parameters and the probe PSNR before and after distilling."""
    import copy
    from pathlib import Path

    from core.device import pick_device
    from core.errors import InputError
    from models.stylegan import load_generator, save_generator
    from optim.distill import distill_synthesis
    from optim.prune import structured_stylegan

    if not (0.0 < float(amount) < 1.0):
        raise InputError(f"--amount is the fraction of channels to remove, in (0, 1); got {amount}")
    loaded = load_generator(src, device="cpu")
    if loaded.arch != "stylegan2":
        raise InputError(f"compress works on StyleGAN2 generators; {Path(src).name} is {loaded.arch}")
    dev = pick_device(device)
    teacher = loaded.G.float().eval().requires_grad_(False)
    student = copy.deepcopy(teacher)
    before = sum(p.numel() for p in teacher.synthesis.parameters())
    pruned = structured_stylegan(student, float(amount))
    student.init_kwargs = {**teacher.init_kwargs, "layer_channels": pruned["channels_after"]}
    report = distill_synthesis(student, teacher, steps, batch=batch, lr=lr, device=dev, on_step=on_step)
    after = sum(p.numel() for p in student.synthesis.parameters())
    meta = dict(loaded.config.get("metadata") or {})
    meta["compressed"] = {"source": str(src), "amount": float(amount), "synthesis_params_before": before,
                          "synthesis_params_after": after, **report}
    out = save_generator(student.cpu(), dst, "stylegan2", metadata=meta, dtype="fp16" if fp16 else None)
    return {"out": str(out), "amount": float(amount), "synthesis_params_before": before, "synthesis_params_after": after,
            "channels_after": pruned["channels_after"], "device": str(dev), **report}
