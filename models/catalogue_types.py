"""One entry of the model catalogue (shared by the StyleGAN and diffusion scanners)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CatalogueEntry:
    id: str                      # what a request names: a path, a hub id or a bundled name
    backend: str                 # 'stylegan' | 'diffusion'
    kind: str                    # 'stylegan2', 'stylegan3', 'sd15', 'sdxl', …
    source: str                  # 'bundled' | 'local' | 'hf-cache' | 'hub'
    path: str | None = None
    size_bytes: int | None = None
    license: str | None = None
    description: str = ""

    @property
    def label(self) -> str:
        where = {"bundled": "bundled", "local": "local file", "hf-cache": "HF cache", "hub": "hub, download"}.get(self.source, self.source)
        return f"{self.id}  ({self.kind}, {where})"

    def to_dict(self) -> dict:
        return asdict(self)
