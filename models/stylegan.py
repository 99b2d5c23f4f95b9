"""Load and save StyleGAN generators: NVlabs pickles, our safetensors format, weights-only .pt.

Formats, safest first:

- **ours**: `NAME.safetensors` (the state dict) + `NAME.json`
  (`{"format": "atelier-stylegan/1", "arch": "stylegan2"|"stylegan3", "init_kwargs": {...},
  "metadata": {...}}`). Loaded with safetensors and json only; pickle is never involved.
  The config is also embedded in the safetensors header, so a lone .safetensors still loads.
- **.pt / .ckpt / .pth**: `torch.load(weights_only=True)` of a plain state dict, plus the
  same JSON sidecar for the architecture.
- **NVlabs .pkl** (every public StyleGAN2/2-ADA/3 checkpoint): read by
  `models.nvlabs_pickle`, which only rebuilds records from an allow-list and never runs the
  source code embedded in the pickle; the records become our own classes here.

`convert_pickle` turns the last into the first. Every problem is a ModelLoadError with a
message that says what to do; UnsafeModelError (a pickle that asks to run code) passes through.
"""
from __future__ import annotations

import hashlib
import json
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.errors import InputError, ModelLoadError, UnsafeModelError
from models import stylegan2
from models.arch_limits import (build_checked, check_init_kwargs, load_or_drop, meta_shapes, shape_difference,
                                 tensor_shapes)
from models.nvlabs_pickle import PersistentRecord, read_network_pickle

__all__ = [
    "FORMAT",
    "ARCHS",
    "LoadedGenerator",
    "Snapshot",
    "load_generator",
    "save_generator",
    "convert_pickle",
    "load_snapshot",
    "build_generator",
    "detect_arch",
]

FORMAT = "atelier-stylegan/1"
ARCHS = ("stylegan2", "stylegan3")
PICKLE_SUFFIXES = (".pkl",)
TORCH_SUFFIXES = (".pt", ".ckpt", ".pth")
OUR_SUFFIXES = (".safetensors", ".json")
_HEADER_KEY = "atelier_config"  # where the JSON config sits in the safetensors header
_CENTRES_LOCK = threading.Lock()  # LoadedGenerator.class_centres: one cache per model, however many threads ask


@dataclass
class LoadedGenerator:
    """A generator ready for inference: eval mode, no gradients, float32 on `device`."""

    G: torch.nn.Module
    arch: str                          # 'stylegan2' | 'stylegan3'
    config: dict                       # {"format", "arch", "init_kwargs", "metadata"}
    source: Path                       # the file it was loaded from
    sha256: str                        # hex digest of that file (short form: `short_hash`)
    metadata: dict = field(default_factory=dict)  # z_dim, c_dim, w_dim, num_ws, resolution, img_channels + saved extras
    _centres: Any = field(default=None, init=False, repr=False, compare=False)   # models.class_centres.ClassCentres

    @property
    def short_hash(self) -> str:
        return self.sha256[:10]

    def class_centres(self):
        """The per-class w centres of this class-conditional generator (models.class_centres.ClassCentres): kept
        with the loaded model, so a class's centre is computed once per load, the first time a request draws it.
        A new one is started when `G` (or its mapping network) has been replaced. InputError when unconditional."""
        from models.class_centres import ClassCentres

        with _CENTRES_LOCK:
            if self._centres is None or self._centres.mapping is not self.G.mapping:
                self._centres = ClassCentres(self.G.mapping)
            return self._centres

    @property
    def c_dim(self) -> int:
        return int(self.metadata["c_dim"])

    @property
    def z_dim(self) -> int:
        return int(self.metadata["z_dim"])

    @property
    def resolution(self) -> int:
        return int(self.metadata["resolution"])

    @property
    def num_ws(self) -> int:
        return int(self.metadata["num_ws"])


@dataclass
class Snapshot:
    """The networks of an NVlabs training snapshot, for fine-tuning or resuming training.

    G and D are in train mode with gradients on; G_ema is in eval mode without gradients.
    """

    G: torch.nn.Module
    D: torch.nn.Module
    G_ema: torch.nn.Module
    arch: str
    G_kwargs: dict
    D_kwargs: dict
    training_set_kwargs: dict
    source: Path
    sha256: str


# ---------------------------------------------------------------------------------------------
# Helpers


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stylegan3_module():
    """models.stylegan3, imported only when a StyleGAN3 network is met."""
    try:
        import models.stylegan3 as sg3
    except ModuleNotFoundError as exc:
        if exc.name == "models.stylegan3":
            raise ModelLoadError("this is a StyleGAN3 network, but StyleGAN3 support (models/stylegan3.py) is not "
                                 "installed in this build; use a StyleGAN2 model or update Atelier") from None
        raise
    return sg3


def _generator_class(arch: str) -> type:
    if arch == "stylegan2":
        return stylegan2.Generator
    if arch == "stylegan3":
        return _stylegan3_module().Generator
    raise ModelLoadError(f"unknown StyleGAN architecture {arch!r}; expected one of {', '.join(ARCHS)}")


def build_generator(arch: str, init_kwargs: dict, shapes: dict | None = None) -> torch.nn.Module:
    """A freshly initialised generator of `arch` from NVlabs-style constructor kwargs.

    The kwargs are bounds-checked first (models.arch_limits: every field named in the error).
    With `shapes` ({name: shape} of the tensors a file holds) the network is first built on the
    meta device and compared with them, so a config that does not fit its weights, or declares a
    huge network around tiny ones, is refused before any memory is taken.
    """
    cls = _generator_class(arch)
    if not isinstance(init_kwargs, dict):
        raise ModelLoadError(f"the model config's init_kwargs must be a JSON object, got {type(init_kwargs).__name__}")
    what = f"{arch} generator"
    check_init_kwargs(init_kwargs, what)
    if shapes is not None:
        return build_checked(lambda: cls(**init_kwargs), shapes, what)
    message = None
    try:
        return cls(**init_kwargs)
    except (TypeError, InputError, ValueError) as exc:
        message = f"cannot build a {arch} generator from the config {init_kwargs}: {exc}"
    raise ModelLoadError(message)


def _build_loaded(config: dict, state: dict[str, torch.Tensor], what: str) -> torch.nn.Module:
    """build_generator checked against `state`, then its strict load; nothing is kept on failure."""
    return load_or_drop(build_generator(config["arch"], config["init_kwargs"], shapes=tensor_shapes(state)),
                        state, what)


def detect_arch(rec: PersistentRecord) -> str:
    """'stylegan3' when the synthesis network starts from Fourier features, else 'stylegan2'."""
    if rec.class_name != "Generator":
        raise ModelLoadError(f"expected a StyleGAN 'Generator' in the pickle, found {rec.class_name!r}")
    synthesis = rec.children.get("synthesis")
    if synthesis is None:
        raise ModelLoadError("the pickled generator has no synthesis network; it is not a StyleGAN generator")
    if synthesis.find("SynthesisInput") or "input" in synthesis.children:
        return "stylegan3"
    if synthesis.find("SynthesisBlock"):
        return "stylegan2"
    raise ModelLoadError("the pickled generator is neither StyleGAN2 (SynthesisBlock) nor StyleGAN3 "
                         "(SynthesisInput); this architecture is not supported")


def _generator_from_record(rec: PersistentRecord) -> tuple[torch.nn.Module, str]:
    arch = detect_arch(rec)
    if arch == "stylegan3":
        G = _stylegan3_module().generator_from_record(rec)
    else:
        G = stylegan2.generator_from_record(rec)
    return G, arch


def _check_finite(state: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        listed = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
        raise ModelLoadError(f"{what} contains NaN or Inf weights ({listed}); the file is corrupt or the training "
                             "diverged. Use an earlier snapshot.")


def _derived_metadata(G: torch.nn.Module) -> dict:
    return {
        "z_dim": int(G.z_dim),
        "c_dim": int(G.c_dim),
        "w_dim": int(G.w_dim),
        "num_ws": int(G.num_ws),
        "resolution": int(G.img_resolution),
        "img_channels": int(G.img_channels),
    }


def _finish(G: torch.nn.Module, arch: str, config: dict, source: Path, device) -> LoadedGenerator:
    G = G.to(device).eval().requires_grad_(False)
    metadata = {**dict(config.get("metadata") or {}), **_derived_metadata(G)}
    return LoadedGenerator(G=G, arch=arch, config=config, source=source, sha256=_file_sha256(source),
                           metadata=metadata)


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    try:
        return names[str(dtype).lower()]
    except KeyError:
        raise InputError(f"unknown weight dtype {dtype!r}; use fp32, fp16 or bf16") from None


# ---------------------------------------------------------------------------------------------
# Our format: safetensors + JSON


def style_layers(arch: str, init_kwargs: dict) -> int | None:
    """How many ws (style layers) a generator built from `init_kwargs` takes, without building it: StyleGAN2
    2·log2(resolution) − 2 (18 at 1024 px, 10 at 64), StyleGAN3 its synthesis layers + 2. None if unsure."""
    try:
        res = int(init_kwargs["img_resolution"])
        if str(arch).startswith("stylegan3"):
            syn = init_kwargs.get("synthesis_kwargs") or {}
            return int(syn.get("num_layers", init_kwargs.get("num_layers", 14))) + 2
        if str(arch).startswith("stylegan2") and res >= 4 and res & (res - 1) == 0:
            return 2 * res.bit_length() - 4          # 2·log2(res) − 2
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    return None


def style_layers_of_file(path: str | Path) -> int | None:
    """The style-layer count of an Atelier .safetensors model or a training run folder, from its JSON alone (the
    sidecar's init_kwargs, the run's config); None where only the weights say (NVlabs pickles: known after load)."""
    p = Path(path).expanduser()
    try:
        run = run_folder_of(p)
        if run is not None:
            doc = json.loads((run / RUN_STATE_FILE).read_text())
            return style_layers(*run_init_kwargs(doc.get("config") or {}))
        if p.suffix == ".safetensors":
            doc = json.loads(p.with_suffix(".json").read_text())
            if isinstance(doc, dict) and isinstance(doc.get("init_kwargs"), dict):
                return style_layers(str(doc.get("arch", "stylegan2")), doc["init_kwargs"])
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return None


def classes_of_file(path: str | Path) -> tuple[int, list[str]] | None:
    """(class count, class names) of an Atelier .safetensors model from its JSON alone (init_kwargs.c_dim,
    metadata.classes.names; names may be []); None where the JSON does not say (NVlabs pickles, run folders)."""
    p = Path(path).expanduser()
    if p.suffix != ".safetensors":
        return None
    try:
        doc = json.loads(p.with_suffix(".json").read_text())
        c_dim = int((doc.get("init_kwargs") or {}).get("c_dim") or 0)
        names = (((doc.get("metadata") or {}).get("classes") or {}).get("names")) or []
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return c_dim, [str(n) for n in names][:c_dim] if isinstance(names, list) else []


def _sidecar_paths(path: Path) -> tuple[Path, Path]:
    """NAME.safetensors / NAME.json (either may be given)."""
    return path.with_suffix(".safetensors"), path.with_suffix(".json")


def _validate_config(config: Any, where: str) -> dict:
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where} is not a JSON object; expected an Atelier StyleGAN config")
    if config.get("format") != FORMAT:
        raise ModelLoadError(f"{where} has format {config.get('format')!r}; expected {FORMAT!r}. "
                             "Re-convert the model with `convert_pickle` / the CLI's convert command.")
    if config.get("arch") not in ARCHS:
        raise ModelLoadError(f"{where} names architecture {config.get('arch')!r}; expected one of {', '.join(ARCHS)}")
    if not isinstance(config.get("init_kwargs"), dict):
        raise ModelLoadError(f"{where} has no 'init_kwargs' object describing the network")
    return config


def _read_json_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the model config {path.name}: {exc}") from None
    return _validate_config(config, path.name)


def _load_ours(path: Path, device) -> LoadedGenerator:
    from safetensors import SafetensorError
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights, sidecar = _sidecar_paths(path)
    if not weights.is_file():
        raise ModelLoadError(f"the weights file {weights} is missing (a .json config needs its .safetensors next to it)")
    try:
        # config and tensor shapes first (the header only): a config declaring a network that does
        # not fit the file is refused before the weights are read or the network is built
        with safe_open(str(weights), framework="pt") as fh:
            header = (fh.metadata() or {}).get(_HEADER_KEY)
            shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        if sidecar.is_file():
            config = _read_json_config(sidecar)
        else:
            if header is None:
                raise ModelLoadError(f"{weights.name} has no config: put its {sidecar.name} next to it "
                                     "(written by save_generator / convert_pickle)")
            try:
                config = _validate_config(json.loads(header), f"the config inside {weights.name}")
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"the config inside {weights.name} is not valid JSON: {exc}") from None
        what = f"{config['arch']} generator of {weights.name}"
        check_init_kwargs(config["init_kwargs"], what)
        cls, kwargs = _generator_class(config["arch"]), config["init_kwargs"]
        diff = shape_difference(meta_shapes(lambda: cls(**kwargs), what), shapes)
        if diff:
            raise ModelLoadError(f"the weights in {weights.name} do not fit the {config['arch']} generator its "
                                 f"config declares (checked before building it): {diff}")
        state = load_file(str(weights), device="cpu")
    except SafetensorError as exc:
        raise ModelLoadError(f"{weights.name} is not a valid safetensors file: {exc}") from None
    _check_finite(state, weights.name)
    G = _build_loaded(config, state, what)
    return _finish(G, config["arch"], config, weights, device)


def _write_ours(state: dict[str, torch.Tensor], config: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    weights, sidecar = _sidecar_paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True)
    # Write to temporary names first so a crash never leaves a half-written model that looks complete.
    tmp_w, tmp_j = weights.with_name(weights.name + ".tmp"), sidecar.with_name(sidecar.name + ".tmp")
    save_file(state, str(tmp_w), metadata={_HEADER_KEY: text, "format": FORMAT})
    tmp_j.write_text(text + "\n", encoding="utf-8")
    tmp_w.replace(weights)
    tmp_j.replace(sidecar)
    return weights


def save_generator(G: torch.nn.Module, path: str | Path, arch: str, metadata: dict | None = None,
                   dtype=None) -> Path:
    """Write G as NAME.safetensors + NAME.json; returns the .safetensors path.

    dtype='fp16' halves the file for shipping (floating tensors are rounded; loading
    builds a float32 network from them). `metadata` is free-form JSON (description,
    license, training info) kept under config['metadata'].
    """
    if arch not in ARCHS:
        raise InputError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    init_kwargs = getattr(G, "init_kwargs", None)
    if not isinstance(init_kwargs, dict):
        raise InputError("this module has no init_kwargs dict; only Atelier StyleGAN generators can be saved")
    target = _resolve_dtype(dtype)
    state = {}
    for k, t in G.state_dict().items():
        t = t.detach().to("cpu")
        if target is not None and t.is_floating_point():
            t = t.to(target)
        state[k] = t.contiguous().clone()
    _check_finite(state, "the generator to save")
    config = {
        "format": FORMAT,
        "arch": arch,
        "init_kwargs": stylegan2.jsonable(init_kwargs),
        "dtype": str(next(iter(state.values())).dtype).replace("torch.", "") if state else "float32",
        "metadata": stylegan2.jsonable(dict(metadata or {})),
    }
    path = Path(path)
    if path.suffix not in OUR_SUFFIXES:
        path = path.with_name(path.name + ".safetensors")
    return _write_ours(state, config, path)


# ---------------------------------------------------------------------------------------------
# Weights-only torch checkpoints


def _load_torch(path: Path, device) -> LoadedGenerator:
    _, sidecar = _sidecar_paths(path)
    if not sidecar.is_file():
        raise ModelLoadError(f"{path.name} is a bare PyTorch checkpoint; put its config {sidecar.name} next to it "
                             f"(format {FORMAT!r}: arch and init_kwargs) so the network can be built")
    config = _read_json_config(sidecar)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        if "Unsupported global" in msg or "Weights only load failed" in msg:
            raise UnsafeModelError(
                f"refusing to load {path.name}: it asks to build Python objects beyond plain tensors "
                "(torch.load with weights_only=True rejected it). If it is an NVlabs network pickle, name it .pkl; "
                "otherwise re-save it as a plain state dict or safetensors.") from None
        raise ModelLoadError(f"could not read {path.name}: {msg.splitlines()[0] if msg else exc!r}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read {path.name} as a PyTorch checkpoint: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                      for k, v in obj.items()):
        raise ModelLoadError(f"{path.name} does not hold a state dict (a mapping of names to tensors)")
    _check_finite(obj, path.name)
    G = _build_loaded(config, obj, f"{config['arch']} generator of {path.name}")
    return _finish(G, config["arch"], config, path, device)


# ---------------------------------------------------------------------------------------------
# NVlabs pickles


def _pick(networks: dict, which: str, path: Path) -> PersistentRecord:
    rec = networks.get(which)
    if not isinstance(rec, PersistentRecord):
        have = ", ".join(k for k, v in networks.items() if isinstance(v, PersistentRecord)) or "none"
        raise ModelLoadError(f"{path.name} has no network {which!r} (it has: {have})")
    return rec


def _load_pickle(path: Path, device, which: str = "G_ema") -> LoadedGenerator:
    networks = read_network_pickle(path)
    rec = _pick(networks, which, path)
    _check_finite(rec.state_dict(), f"{path.name} ({which})")
    G, arch = _generator_from_record(rec)
    config = {"format": FORMAT, "arch": arch, "init_kwargs": G.init_kwargs,
              "metadata": {"source_format": "nvlabs-pickle", "network": which}}
    return _finish(G, arch, config, path, device)


def _safe_jsonable(value: Any) -> Any:
    try:
        return stylegan2.jsonable(dict(value))
    except (InputError, TypeError, ValueError):
        return {}


def convert_pickle(src: str | Path, dst: str | Path, which: str = "G_ema", dtype=None,
                   metadata: dict | None = None) -> Path:
    """NVlabs network pickle -> our NAME.safetensors + NAME.json. Returns the .safetensors path.

    `dst` may be a directory (the pickle's stem is used) or a file name.
    """
    src = Path(src)
    if not src.is_file():
        raise ModelLoadError(f"model file not found: {src}")
    if src.suffix.lower() not in PICKLE_SUFFIXES:
        raise ModelLoadError(f"{src.name} is not an NVlabs network pickle (.pkl); nothing to convert")
    if which not in ("G_ema", "G"):
        raise InputError(f"which must be 'G_ema' or 'G', got {which!r}")
    networks = read_network_pickle(src)
    rec = _pick(networks, which, src)
    _check_finite(rec.state_dict(), f"{src.name} ({which})")
    G, arch = _generator_from_record(rec)
    dst = Path(dst)
    if dst.is_dir():
        dst = dst / (src.stem + ".safetensors")
    meta = {
        "source_format": "nvlabs-pickle",
        "source_file": src.name,
        "source_sha256": _file_sha256(src),
        "network": which,
    }
    if isinstance(networks.get("training_set_kwargs"), dict):
        meta["training_set_kwargs"] = _safe_jsonable(networks["training_set_kwargs"])
    meta.update(metadata or {})
    return save_generator(G, dst, arch, metadata=meta, dtype=dtype)


def load_snapshot(path: str | Path) -> Snapshot:
    """G, D and G_ema of an NVlabs training snapshot (.pkl), as our modules on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"snapshot file not found: {path}")
    if path.suffix.lower() not in PICKLE_SUFFIXES:
        raise ModelLoadError(f"{path.name}: training snapshots are NVlabs network pickles (.pkl)")
    networks = read_network_pickle(path)
    recs = {k: _pick(networks, k, path) for k in ("G", "D", "G_ema")}
    for k, rec in recs.items():
        _check_finite(rec.state_dict(), f"{path.name} ({k})")
    G, arch = _generator_from_record(recs["G"])
    G_ema, arch_ema = _generator_from_record(recs["G_ema"])
    if arch != arch_ema:
        raise ModelLoadError(f"{path.name}: G is {arch} but G_ema is {arch_ema}; the snapshot is inconsistent")
    # StyleGAN3 training also uses the StyleGAN2 discriminator.
    D = stylegan2.discriminator_from_record(recs["D"])
    G.train().requires_grad_(True)
    D.train().requires_grad_(True)
    G_ema.eval().requires_grad_(False)
    tsk = networks.get("training_set_kwargs")
    return Snapshot(G=G, D=D, G_ema=G_ema, arch=arch, G_kwargs=G.init_kwargs, D_kwargs=D.init_kwargs,
                    training_set_kwargs=_safe_jsonable(tsk) if isinstance(tsk, dict) else {},
                    source=path, sha256=_file_sha256(path))


# ---------------------------------------------------------------------------------------------
# Entry point


# -- a training run folder (training/checkpoint.py writes it): its EMA generator is a model -------------
RUN_STATE_FILE = "state.json"
RUN_FORMAT = "atelier-train-checkpoint/1"       # training.checkpoint.FORMAT (models may not import training)


def run_folder_of(path: str | Path) -> Path | None:
    """The training run folder `path` is, or is a file of (its state.json, a G_ema shard); else None."""
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    if p.is_file() and not (p.name == RUN_STATE_FILE or p.name.startswith("G_ema")):
        return None
    return folder if (folder / RUN_STATE_FILE).is_file() else None


def read_run_state(folder: Path) -> dict:
    """state.json of a run folder, checked to be one (the format) and to hold a G_ema."""
    f = Path(folder) / RUN_STATE_FILE
    try:
        doc = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{f} cannot be read as a training checkpoint ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        raise ModelLoadError(f"{f} is not an Atelier training checkpoint (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if not (doc.get("files") or {}).get("G_ema"):
        raise ModelLoadError(f"the run folder {folder} has no G_ema weights (was the run saved?)")
    if not isinstance(doc.get("config"), dict):
        raise ModelLoadError(f"{f} has no training config; the checkpoint is damaged")
    return doc


def run_init_kwargs(config: dict) -> tuple[str, dict]:
    """(arch, NVlabs constructor kwargs) of the generator a training config builds (training.trainer's
    build_networks: unconditional, RGB, the config's resolution and g_kwargs)."""
    g = dict(config.get("g_kwargs") or {})
    arch = str(config.get("arch") or "stylegan2")
    kwargs = {"z_dim": int(g.pop("z_dim", 512)), "c_dim": 0, "w_dim": int(g.pop("w_dim", 512)),
              "img_resolution": int(config.get("resolution", 0)), "img_channels": 3, **g}
    return arch, kwargs


def _load_run(folder: Path, device) -> LoadedGenerator:
    """The EMA generator of a training run folder, straight from its checkpoint shards: every shard's size
    and SHA-256 are checked against state.json first, the network is built from the run's config and the
    weights loaded strictly. The hash recorded is over the shards' hashes (the folder has no single file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    doc = read_run_state(folder)
    listing = doc.get("listing") or {}
    shards = [str(n) for n in doc["files"]["G_ema"]]
    for name in shards:
        f = folder / name
        info = listing.get(name) or {}
        if Path(name).name != name or not f.is_file():
            raise ModelLoadError(f"checkpoint file {f} is missing; copy the whole run folder")
        if info.get("bytes") is not None and f.stat().st_size != info["bytes"]:
            raise ModelLoadError(f"checkpoint file {f} has {f.stat().st_size} bytes, expected {info['bytes']}: it is "
                                 "incomplete or from another save (is the run still writing it?)")
        if info.get("sha256") and _file_sha256(f) != info["sha256"]:
            raise ModelLoadError(f"checkpoint file {f} does not match the SHA-256 in {RUN_STATE_FILE}: damaged or "
                                 "from another save")
    state: dict[str, torch.Tensor] = {}
    try:
        for name in shards:
            state.update(load_file(str(folder / name), device="cpu"))
    except SafetensorError as exc:
        raise ModelLoadError(f"a G_ema shard of {folder} is not a valid safetensors file: {exc}") from None
    _check_finite(state, f"G_ema of {folder.name}")
    arch, kwargs = run_init_kwargs(doc["config"])
    config = {"format": FORMAT, "arch": arch,
              "init_kwargs": kwargs,
              "metadata": {"description": f"training run {folder.name} at {float(doc.get('kimg', 0)):g} kimg (G_ema)",
                           "kimg": doc.get("kimg"), "run": folder.name}}
    G = _build_loaded(config, state, f"{arch} G_ema of the run {folder.name}")
    G = G.to(device).eval().requires_grad_(False)
    digest = hashlib.sha256("".join(str((listing.get(n) or {}).get("sha256", n)) for n in shards).encode()).hexdigest()
    return LoadedGenerator(G=G, arch=arch, config=config, source=folder, sha256=digest,
                           metadata={**config["metadata"], **_derived_metadata(G)})


def load_generator(path: str | Path, device: str | torch.device = "cpu") -> LoadedGenerator:
    """Load a StyleGAN generator from .pkl (NVlabs), .safetensors/.json (ours), .pt/.ckpt/.pth, or a training
    run folder (its EMA generator; also when given the folder's state.json or a G_ema shard)."""
    path = Path(path).expanduser()
    run = run_folder_of(path)
    if run is not None:
        return _load_run(run, device)
    suffix = path.suffix.lower()
    if suffix in OUR_SUFFIXES:
        weights, sidecar = _sidecar_paths(path)
        if not weights.is_file() and not sidecar.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        return _load_ours(path, device)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    if suffix in PICKLE_SUFFIXES:
        return _load_pickle(path, device)
    if suffix in TORCH_SUFFIXES:
        return _load_torch(path, device)
    raise ModelLoadError(f"{path.name}: unknown model file type {suffix or '(none)'}; StyleGAN models are NVlabs "
                         ".pkl pickles, Atelier .safetensors + .json, or .pt/.ckpt state dicts with a .json config")
