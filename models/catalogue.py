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


RUN_STATE_FILE, RUN_FORMAT = "state.json", "atelier-train-checkpoint/1"   # a training run folder (models.stylegan)


def run_entry(folder: Path, source: str = "local") -> CatalogueEntry | None:
    """A training run folder as a StyleGAN model (its EMA generator), or None when `folder` is not one."""
    state = Path(folder) / RUN_STATE_FILE
    if not state.is_file():
        return None
    try:
        doc = json.loads(state.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT or not (doc.get("files") or {}).get("G_ema"):
        return None
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    size = sum(int(v.get("bytes", 0)) for k, v in (doc.get("listing") or {}).items()
               if k.startswith("G_ema") and isinstance(v, dict))
    return CatalogueEntry(id=str(folder), backend="stylegan", kind=f"{cfg.get('arch', 'stylegan2')} training run",
                          source=source, path=str(folder), size_bytes=size or None,
                          description=f"G_ema of the training run {Path(folder).name} at {doc.get('kimg', 0)} kimg")


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
    for sub in sorted(d for d in folder.iterdir() if d.is_dir()):   # training run folders one level down
        run = run_entry(sub, source)
        if run is not None:
            out.append(run)
    return out


def public_name(e: CatalogueEntry) -> str:
    """How an entry is named to a visitor: a file's name, never the folder it sits in on the server."""
    return Path(e.path).name if (e.path and e.source == "local" and e.id == e.path) else e.id


def _license(side: dict | None) -> str | None:
    if not side:
        return None
    return side.get("license") or (side.get("metadata") or {}).get("license")


class Catalogue:
    """Everything the studio can offer, from the folders the settings name."""

    def __init__(self, assets_dir: Path, model_dirs: tuple[Path, ...] = (), extra: tuple[str, ...] = (),
                 default_stylegan: str | None = None, public: bool = False, allow_hub: bool = True):
        """`public`: strangers use this studio, so a request may name only what is listed (no other path,
        no other hub id) and errors name no server path; `allow_hub`: list the well-known hub models
        (a pick downloads several GB)."""
        self.assets_dir = Path(assets_dir)
        self.model_dirs = tuple(Path(d) for d in model_dirs)
        self.extra = tuple(extra)
        self._default_stylegan = default_stylegan
        self.public = public
        self.allow_hub = allow_hub
        self._added: list[tuple[str | None, CatalogueEntry]] = []   # (owner, entry); owner None = everyone's

    def entries(self, backend: str | None = None, owner: str | None = None) -> list[CatalogueEntry]:
        """What a picker lists: the scanned folders, the operator's models, and the models added by
        `owner` (a visitor's session) or by the operator (owner None)."""
        return self._entries(backend, lambda o: o is None or o == owner)

    def _entries(self, backend: str | None, owned) -> list[CatalogueEntry]:
        found = scan_stylegan(self.assets_dir / "models", "bundled")
        for d in self.model_dirs:
            found += scan_stylegan(d, "local")
        for ref in self.extra:
            p = Path(ref)
            run = run_entry(p) if p.is_dir() else None
            if run is not None:
                found.append(run)
            elif p.is_file() and p.suffix in STYLEGAN_SUFFIXES:
                found += [e for e in scan_stylegan(p.parent, "local") if e.path == str(p)] or [
                    CatalogueEntry(id=str(p), backend="stylegan", kind="stylegan", source="local", path=str(p),
                                   size_bytes=p.stat().st_size)]
        found += self._diffusion_entries()
        found += [e for o, e in self._added if owned(o)]
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
        hub = list(getattr(dc, "KNOWN_HUB_MODELS", [])) if self.allow_hub else []
        return list(dc.scan_diffusion_models(dirs)) + hub

    def add(self, ref: str, backend: str, owner: str | None = None) -> CatalogueEntry:
        """Add a path or hub id typed in the UI; `owner` (a session) keeps it out of other sessions' lists."""
        ref = ref.strip()
        if not ref:
            raise ModelLoadError("type a model path or a Hugging Face id to add")
        p = Path(ref).expanduser()
        run = run_entry(p) if (backend == "stylegan" and p.is_dir()) else None
        if run is not None:
            e = run
        elif backend == "stylegan":
            if not p.is_file():
                raise ModelLoadError(f"no StyleGAN model file at {p}; give the path of a .pkl or .safetensors file, "
                                     "or a training run folder (it holds state.json)")
            e = CatalogueEntry(id=str(p), backend="stylegan", kind="stylegan", source="local", path=str(p),
                               size_bytes=p.stat().st_size)
        else:
            e = self._diffusion_entry(ref, p)
        self._added.append((owner, e))
        return e

    @staticmethod
    def _diffusion_entry(ref: str, p: Path) -> CatalogueEntry:
        """A typed diffusion path as the scanner lists it (so its architecture, hence its defaults, are known);
        a hub id, or a file the scanner does not recognise, as a plain entry."""
        if p.exists():
            try:
                from models import diffusion_catalogue as dc

                scanned = dc._entry_for_path(p)
            except ImportError:
                scanned = None
            if scanned is not None:
                return CatalogueEntry(**dict(scanned.to_dict(), id=ref))
            return CatalogueEntry(id=ref, backend="diffusion", kind="diffusion", source="local", path=str(p))
        return CatalogueEntry(id=ref, backend="diffusion", kind="diffusion", source="hub")

    def resolve(self, ref: str | None, backend: str) -> CatalogueEntry:
        """A catalogue id, a path, or (diffusion) a hub id -> the entry to load."""
        if ref is None or ref == "":
            return self.default(backend)
        entries = self._entries(backend, lambda o: True)
        for e in entries:
            if ref in (e.id, e.path):
                return e
        if self.public:   # a stranger names only what is listed: no other file, no hub download, no hint
            if backend == "diffusion" and ref in self.extra:
                return CatalogueEntry(id=ref, backend="diffusion", kind="diffusion", source="hub")
            names = ", ".join(public_name(e) for e in self.entries(backend)[:8]) or "none"
            shown = ref if len(ref) <= 80 else ref[:77] + "..."
            raise ModelLoadError(f"model {shown!r} is not available on this studio; pick one from the model list "
                                 f"({names})")
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
