"""Comparing a model's own tensor shapes with what a weights file holds, for load errors that say what differs."""
from __future__ import annotations

from typing import Mapping


def shape_difference(own: Mapping[str, tuple], found: Mapping[str, tuple]) -> str:
    """'' when the two {name: shape} maps agree, else what differs (missing, unexpected, wrong shape)."""
    missing = sorted(set(own) - set(found))
    unexpected = sorted(set(found) - set(own))
    wrong = sorted(k for k in set(own) & set(found) if tuple(own[k]) != tuple(found[k]))

    def head(keys):
        return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")

    parts = []
    if missing:
        parts.append(f"missing {head(missing)}")
    if unexpected:
        parts.append(f"unexpected {head(unexpected)}")
    if wrong:
        parts.append("wrong shape " + head([f"{k} {list(found[k])} vs {list(own[k])}" for k in wrong]))
    return "; ".join(parts)
