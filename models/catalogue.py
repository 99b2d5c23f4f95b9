"""The model catalogue: bundled, local and cached models the studio can load.

Listing is cheap: files are recognised by name and sidecar JSON, never unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

from core.errors import ModelLoadError
from models.catalogue_types import CatalogueEntry

STYLEGAN_SUFFIXES = (".pkl", ".safetensors", ".pt", ".ckpt", ".pth")
SIDE_FORMAT = "atelier-stylegan/1"


def _stylegan_sidecar(path: Path) -> dict | None:
    side = path.with_suffix(".json")
    if not side.is_file():
        return None
    try:
        data = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if str(data.get("format", "")).startswith("atelier-stylegan") else None


def scan_stylegan(folder: Path, source: str) -> list[CatalogueEntry]:
    """StyleGAN models in `folder` (not recursive below one level)."""
    out: list[CatalogueEntry] = []
    if not folder.is_dir():
        return out
    files = sorted(p for p in list(folder.glob("*")) + list(folder.glob("*/*")) if p.is_file() and p.suffix in STYLEGAN_SUFFIXES)
    for p in files:
        side = _stylegan_sidecar(p)
        if p.suffix == ".pkl":
            kind, desc = "stylegan (NVlabs pickle)", "NVlabs network pickle, read with the restricted reader"
        elif side is not None:
            kind = side.get("arch", "stylegan")
            desc = side.get("description") or side.get("metadata", {}).get("description", "")
        else:
            continue   # a .safetensors without our sidecar is not a StyleGAN model (diffusion scanner may list it)
        ident = p.stem if source == "bundled" else str(p)
        out.append(CatalogueEntry(id=ident, backend="stylegan", kind=kind, source=source, path=str(p),
                                  size_bytes=p.stat().st_size, license=_license(side), description=desc))
    return out


def _license(side: dict | None) -> str | None:
    if not side:
        return None
    return side.get("license") or (side.get("metadata") or {}).get("license")


class Catalogue:
    """Everything the studio can offer, from the folders the settings name."""

    def __init__(self, assets_dir: Path, model_dirs: tuple[Path, ...] = (), extra: tuple[str, ...] = (),
                 default_stylegan: str | None = None):
        self.assets_dir = Path(assets_dir)
        self.model_dirs = tuple(Path(d) for d in model_dirs)
        self.extra = tuple(extra)
        self._default_stylegan = default_stylegan
        self._added: list[CatalogueEntry] = []

    def entries(self, backend: str | None = None) -> list[CatalogueEntry]:
        found = scan_stylegan(self.assets_dir / "models", "bundled")
        for d in self.model_dirs:
            found += scan_stylegan(d, "local")
        for ref in self.extra:
            p = Path(ref)
            if p.is_file() and p.suffix in STYLEGAN_SUFFIXES:
                found += [e for e in scan_stylegan(p.parent, "local") if e.path == str(p)] or [
                    CatalogueEntry(id=str(p), backend="stylegan", kind="stylegan", source="local", path=str(p),
                                   size_bytes=p.stat().st_size)]
        found += self._diffusion_entries()
        found += self._added
        seen, uniq = set(), []
        for e in found:
            if (e.backend, e.id) not in seen:
                seen.add((e.backend, e.id))
                uniq.append(e)
        return [e for e in uniq if backend is None or e.backend == backend]

    def _diffusion_entries(self) -> list[CatalogueEntry]:
        try:
            from models import diffusion_catalogue as dc
        except ImportError:
            return []
        dirs = list(self.model_dirs) + [Path(r) for r in self.extra if Path(r).exists()]
        return list(dc.scan_diffusion_models(dirs)) + list(getattr(dc, "KNOWN_HUB_MODELS", []))

    def add(self, ref: str, backend: str) -> CatalogueEntry:
        """Add a path or hub id typed by the operator in the UI."""
        ref = ref.strip()
        if not ref:
            raise ModelLoadError("type a model path or a Hugging Face id to add")
        p = Path(ref).expanduser()
        if backend == "stylegan":
            if not p.is_file():
                raise ModelLoadError(f"no StyleGAN model file at {p}; give the path of a .pkl or .safetensors file")
            e = CatalogueEntry(id=str(p), backend="stylegan", kind="stylegan", source="local", path=str(p),
                               size_bytes=p.stat().st_size)
        else:
            e = CatalogueEntry(id=ref, backend="diffusion", kind="diffusion", source="local" if p.exists() else "hub",
                               path=str(p) if p.exists() else None)
        self._added.append(e)
        return e

    def resolve(self, ref: str | None, backend: str) -> CatalogueEntry:
        """A catalogue id, a path, or (diffusion) a hub id -> the entry to load."""
        if ref is None or ref == "":
            return self.default(backend)
        entries = self.entries(backend)
        for e in entries:
            if ref in (e.id, e.path):
                return e
        p = Path(ref).expanduser()
        if p.exists():
            return CatalogueEntry(id=str(p), backend=backend, kind=backend, source="local", path=str(p),
                                  size_bytes=p.stat().st_size if p.is_file() else None)
        if backend == "diffusion" and "/" in ref and not ref.startswith((".", "/")):
            return CatalogueEntry(id=ref, backend="diffusion", kind="diffusion", source="hub")
        names = ", ".join(e.id for e in entries[:8]) or "none"
        raise ModelLoadError(f"model {ref!r} not found: it is neither a catalogue entry nor an existing file. "
                             f"Known {backend} models: {names}")

    def default(self, backend: str) -> CatalogueEntry:
        entries = [e for e in self.entries(backend) if e.source != "hub"]
        if backend == "stylegan" and self._default_stylegan:
            return self.resolve(self._default_stylegan, backend)
        preferred = [e for e in entries if e.source == "bundled"]
        if preferred or entries:
            return (preferred or entries)[0]
        where = ", ".join(str(d) for d in (self.assets_dir / "models",) + self.model_dirs)
        raise ModelLoadError(
            f"no {backend} model is installed. Put a model file in one of: {where}, "
            f"or pass --model PATH (StyleGAN: an NVlabs .pkl or an Atelier .safetensors + .json).")
