"""Helpers the StyleGAN2 and StyleGAN3 files share: JSON-safe constructor kwargs and a strict
state-dict load whose error says what differs."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.errors import InputError, ModelLoadError
from core.shapes import shape_difference  # noqa: F401  (re-exported for models/)


def jsonable(value: Any) -> Any:
    """Constructor kwargs as plain JSON values (numpy scalars/arrays -> Python, tuples -> lists)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InputError(f"constructor argument {value!r} of type {type(value).__name__} cannot be saved as JSON")


def seed_classes(c_dim: int, seeds) -> list[int]:
    """The class of each seed when none is chosen: seed s -> s % c_dim (c_dim > 0)."""
    return [int(s) % c_dim for s in seeds]


def resolve_class(spec: int | str | None, c_dim: int, names: list[str] | None = None) -> int | None:
    """The class index a user asked for: an index (0..c_dim-1) or a name from the model's file.

    A name matches case-insensitively, as the full name ("Animals & Nature/animal-mammal"), as its last part
    ("animal-mammal"), or as a piece of exactly one name ("mammal"). None stays None (the seed picks)."""
    if spec is None:
        return None
    if c_dim <= 0:
        raise InputError("this model is unconditional: leave the class empty")
    if isinstance(spec, str) and spec.strip().lstrip("+-").isdigit():
        spec = int(spec.strip())
    if not isinstance(spec, str):
        k = int(spec)
        if not 0 <= k < c_dim:
            listed = (" (" + ", ".join(f"{i} {n}" for i, n in enumerate((names or [])[:12]))
                      + (", …" if len(names or []) > 12 else "") + ")") if names else ""
            raise InputError(f"class index {k} is out of range: this model has {c_dim} classes (0..{c_dim - 1}){listed}")
        return k
    want = spec.strip().lower()
    if not names:
        raise InputError(f"this model's file names no classes, so {spec!r} cannot be looked up: give an index 0..{c_dim - 1}")
    low = [str(n).lower() for n in names]
    for candidates in ([i for i, n in enumerate(low) if n == want],
                       [i for i, n in enumerate(low) if n.rsplit("/", 1)[-1] == want],
                       [i for i, n in enumerate(low) if want in n]):
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) > 1:
            shown = ", ".join(f"{i} {names[i]}" for i in candidates[:8]) + (", …" if len(candidates) > 8 else "")
            raise InputError(f"class {spec!r} matches {len(candidates)} classes ({shown}); give more of the name or an index")
    import difflib
    close = difflib.get_close_matches(want, [n.rsplit("/", 1)[-1] for n in low], n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; the classes are {', '.join(names[:6])}, …"
    raise InputError(f"no class of this model is called {spec!r}{hint}")


def seed_class_labels(c_dim: int, seeds, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """One-hot class rows for a class-conditional generator drawn without a chosen class: seed s gets class
    s % c_dim, so each seed is one reproducible picture and a seed range walks through the classes (the studio,
    the training grids, the export grid and the snapshot strips all draw this way). None when c_dim is 0."""
    if not c_dim:
        return None
    idx = torch.tensor(seed_classes(c_dim, seeds), dtype=torch.long)
    return torch.nn.functional.one_hot(idx, c_dim).float().to(device)


def load_state_strict(module: torch.nn.Module, state: dict, what: str) -> None:
    """load_state_dict(strict=True) with a ModelLoadError that lists what differs."""
    diff = shape_difference({k: tuple(v.shape) for k, v in module.state_dict().items()},
                            {k: tuple(v.shape) for k, v in state.items()})
    if diff:
        raise ModelLoadError(f"the weights do not fit the {what} built from its config: {diff}")
    module.load_state_dict(state, strict=True)


def truncate(centre: torch.Tensor, w: torch.Tensor, psi) -> torch.Tensor:
    """centre + psi * (w - centre), computed in centre's dtype and returned in w's.

    `centre` is the tracked mean w_avg [w_dim] (the classic truncation trick), or one centre per sample
    [N, w_dim] (class-centred truncation: models/class_centres.py), which then applies to each of a sample's
    ws [N, num_ws, w_dim] alike. Under autocast the mapping network's output is bf16/fp16 while the centre stays
    fp32; lerp needs one dtype, and the centre is better kept exact than rounded to the autocast type."""
    if centre.dim() == 2 and w.dim() == 3:
        centre = centre.unsqueeze(1)
    if isinstance(psi, torch.Tensor):
        psi = psi.to(centre.dtype)
    return centre.lerp(w.to(centre.dtype), psi).to(w.dtype)


def truncation_centre_for(w_avg: torch.Tensor | None, centre: torch.Tensor | None, n: int, w_dim: int) -> torch.Tensor:
    """What a mapping network truncates towards: `centre` when given (checked: [w_dim] or one row per sample,
    [n, w_dim]; as float32, the dtype w_avg is kept in), else the tracked mean `w_avg`."""
    if centre is None:
        if w_avg is None:
            raise InputError("truncation needs the running mean of w, which this mapping network does not track; "
                             "pass a truncation centre")
        return w_avg
    if not isinstance(centre, torch.Tensor):
        raise InputError(f"the truncation centre must be a tensor of shape [{w_dim}] or [{n}, {w_dim}]")
    if tuple(centre.shape) not in ((w_dim,), (n, w_dim)):
        raise InputError(f"the truncation centre has shape {list(centre.shape)}; expected [{w_dim}] (one for all) "
                         f"or [{n}, {w_dim}] (one per sample)")
    return centre.to(w_avg.dtype if w_avg is not None else torch.float32)
