"""Resumable training checkpoints: safetensors for tensors, one JSON for everything else.

A checkpoint is a folder:

    G.safetensors  G_ema.safetensors  D.safetensors      network state dicts (fp32)
    opt_G.safetensors  opt_D.safetensors                 optimizer states (moments, step counts;
                                                         hyperparameters in the file's metadata)
    state.json                                           config, counters, sampler, augmentation p,
                                                         running means, monitor history, file hashes

No pickle anywhere: a checkpoint from someone else cannot run code. A file larger
than `max_file_bytes` is split into NAME-00001-of-0000K.safetensors shards (to fit
transfer limits). Each file is written under a temporary name and moved into place;
state.json goes last and lists every file with its size and SHA-256, so a folder
with a missing or half-written file is refused with a clear message instead of
resuming from a mixture of two checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from core.errors import InputError, ModelLoadError

STATE_FILE = "state.json"
FORMAT = "atelier-train-checkpoint/1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def save_tensors(tensors: dict[str, torch.Tensor], folder: Path, name: str, max_file_bytes: int | None = None,
                 metadata: dict[str, str] | None = None) -> list[str]:
    """Write `tensors` as NAME.safetensors or, above max_file_bytes, as shards; returns the file names."""
    tensors = _cpu(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not max_file_bytes or total <= max_file_bytes:
        _atomic_save(tensors, folder / f"{name}.safetensors", metadata)
        return [f"{name}.safetensors"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_file_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    names = []
    for i, shard in enumerate(shards):
        fname = f"{name}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _atomic_save(shard, folder / fname, metadata)
        names.append(fname)
    return names


def load_tensors(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(folder / f)))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"could not read {folder / f}: {exc}") from None
    return out


# -- optimizers ------------------------------------------------------------------------------------

def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split opt.state_dict() into tensors ('state.<param>.<key>') and a JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{pid}.{k}"] = v
            else:
                scalars.setdefault(str(pid), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars, "class": type(opt).__name__}


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   what: str) -> None:
    if meta.get("class") != type(opt).__name__:
        raise InputError(f"the checkpoint's {what} optimizer is {meta.get('class')}, this run builds "
                         f"{type(opt).__name__}; resume with the same --optimizer / --loss")
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        _, pid, k = key.split(".", 2)
        state.setdefault(int(pid), {})[k] = t
    for pid, sc in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(sc)
    groups = meta["param_groups"]
    own = opt.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
        raise InputError(f"the checkpoint's {what} optimizer covers a different set of parameters; "
                         "resume with the same network settings")
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise InputError(f"the {what} optimizer state does not fit this run: {exc}") from None
    _match_param_layouts(opt)


def _match_param_layouts(opt: torch.optim.Optimizer) -> None:
    """Give each moment tensor its parameter's memory layout. Checkpoints store contiguous tensors,
    while channels_last parameters have NHWC strides; fused Adam refuses mixed layouts."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == p.shape and v.stride() != p.stride():
                    st[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


# -- whole checkpoint ------------------------------------------------------------------------------

def save_checkpoint(folder: str | Path, modules: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], state: dict[str, Any],
                    max_file_bytes: int | None = 15 * 2**20) -> dict[str, int]:
    """Write a complete checkpoint into `folder`; returns {file name: bytes}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    for name, module in modules.items():
        files[name] = save_tensors(module.state_dict(), folder, name, max_file_bytes)
    opt_meta = {}
    for name, opt in optimizers.items():
        tensors, meta = optimizer_tensors(opt)
        files[name] = save_tensors(tensors, folder, name, max_file_bytes, metadata={"optimizer": json.dumps(meta)})
        opt_meta[name] = meta
    listing = {f: {"bytes": (folder / f).stat().st_size, "sha256": _sha256(folder / f)}
               for fl in files.values() for f in fl}
    doc = {"format": FORMAT, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
           "listing": listing, "optimizers": opt_meta, **state}
    tmp = folder / f".{STATE_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=True))
    os.replace(tmp, folder / STATE_FILE)
    # Shards of an earlier, differently split save would otherwise linger.
    keep = set(listing) | {STATE_FILE}
    for name in list(files):
        for p in folder.glob(f"{name}*.safetensors"):
            if p.name not in keep:
                p.unlink()
    return {f: v["bytes"] for f, v in listing.items()}


def read_state(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.exists():
        raise InputError(f"no checkpoint at {folder}: the folder does not exist")
    path = folder / STATE_FILE if folder.is_dir() else folder
    if path.name != STATE_FILE:
        raise InputError(f"--resume wants a run folder (holding {STATE_FILE}); got {path}")
    if not path.is_file():
        raise InputError(f"no checkpoint in {folder}: {STATE_FILE} is missing (was the run saved?)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from None
    if doc.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not an Atelier training checkpoint (format {doc.get('format')!r})")
    return doc


def verify(folder: str | Path, doc: dict[str, Any], check_hashes: bool = True) -> None:
    folder = Path(folder)
    for fname, info in doc["listing"].items():
        p = folder / fname
        if not p.is_file():
            raise ModelLoadError(f"checkpoint file {p} is missing; copy the whole run folder")
        if p.stat().st_size != info["bytes"]:
            raise ModelLoadError(f"checkpoint file {p} has {p.stat().st_size} bytes, expected {info['bytes']}: "
                                 "it is incomplete or from another save")
        if check_hashes and _sha256(p) != info["sha256"]:
            raise ModelLoadError(f"checkpoint file {p} does not match the SHA-256 recorded in {STATE_FILE}: "
                                 "it is damaged or from another save")


def load_checkpoint(folder: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """(state.json contents, {module or optimizer name: tensors}), after checking every file."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    doc = read_state(folder)
    verify(folder, doc)
    tensors = {name: load_tensors(folder, fl) for name, fl in doc["files"].items()}
    return doc, tensors


# -- travel form ----------------------------------------------------------------------------------

COMPACT_DROPPED = ("opt_G", "opt_D")


def compact_checkpoint(src: str | Path, dst: str | Path, dtype: str = "float16",
                       max_file_bytes: int | None = 15 * 2**20) -> dict[str, int]:
    """A smaller copy of the checkpoint in `src` for moving a run between machines: G, G_ema and D
    in 16-bit floats (`dtype` float16 or bfloat16), no optimizer moments; everything else in
    state.json (counters, sampler, ADA, monitor, config) as it was. Resuming from it continues the run
    with Adam's moments started afresh (see Trainer._load). Returns {file name: bytes}.

    Why this is enough for the StyleGAN2 recipe: with beta1 = 0, Adam's first moment is the last
    gradient and carries nothing over; the second moment is re-estimated with bias correction from the
    first step, whose update is then lr * sign(g), the size of an ordinary step."""
    if dtype not in ("float16", "bfloat16"):
        raise InputError(f"a compact checkpoint stores float16 or bfloat16; got {dtype!r}")
    src, dst = Path(src), Path(dst)
    doc, tensors = load_checkpoint(src)
    if doc.get("compact"):
        raise InputError(f"{src} is already a compact checkpoint")
    if src.resolve() == dst.resolve():
        raise InputError("write the compact checkpoint to another folder; the full one stays as it is")
    dst.mkdir(parents=True, exist_ok=True)
    t = getattr(torch, dtype)
    files: dict[str, list[str]] = {}
    for name, tens in tensors.items():
        if name in COMPACT_DROPPED:
            continue
        small = {k: (v.to(t) if v.is_floating_point() else v) for k, v in tens.items()}
        files[name] = save_tensors(small, dst, name, max_file_bytes)
    listing = {f: {"bytes": (dst / f).stat().st_size, "sha256": _sha256(dst / f)} for fl in files.values() for f in fl}
    out = dict(doc)
    out.update(files=files, listing=listing, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               compact={"dtype": dtype, "dropped": list(COMPACT_DROPPED), "from_saved_at": doc.get("saved_at")})
    tmp = dst / f".{STATE_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(out, indent=1, allow_nan=True))
    os.replace(tmp, dst / STATE_FILE)
    return {f: v["bytes"] for f, v in listing.items()}


# -- the carried discriminator ------------------------------------------------------------------------

D_STATE_FORMAT = "atelier-d-state/1"
D_STATE_MAX_BYTES = 12_000_000     # what the repository keeps of a run in progress (issue 12: < 12 MB, bf16)


def write_d_state(src: str | Path, dst: str | Path, max_bytes: int | None = D_STATE_MAX_BYTES) -> dict[str, Any]:
    """D of the checkpoint in `src`, alone, in one small file `dst`: a bfloat16 safetensors compressed with xz
    (`xz -d` opens it). With the exported generator of the same checkpoint (its G_ema, which the studio ships
    anyway), it is what a later run needs to continue without a fresh D (--init-g FILE --init-d THIS): G's
    raw weights and both optimizers' moments stay behind (Adam restarts, as from a compact checkpoint).
    The metadata keeps the counters, ADA's p and controller, the classes and the run's config. Returns
    {"path", "bytes", "raw_bytes", "kimg"}; refuses a file over `max_bytes` (None: any size)."""
    import lzma

    from safetensors.torch import save as save_bytes

    doc, tensors = load_checkpoint(src)
    if "D" not in tensors:
        raise InputError(f"{src}: the checkpoint has no discriminator")
    small = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors["D"].items()}
    meta = {"format": D_STATE_FORMAT, "kimg": doc.get("kimg"), "step": doc.get("step"),
            "train_seconds": doc.get("train_seconds"), "aug_p": doc.get("aug_p"), "ada": doc.get("ada"),
            "classes": doc.get("classes"), "config": doc.get("config"), "from_saved_at": doc.get("saved_at"),
            "dtype": "bfloat16"}
    raw = save_bytes(small, metadata={"atelier": json.dumps(meta, allow_nan=True)})
    packed = lzma.compress(raw, preset=6)
    if max_bytes is not None and len(packed) > max_bytes:
        raise InputError(f"D's carried state would be {len(packed) / 1e6:.1f} MB, over the {max_bytes / 1e6:g} MB "
                         "the repository keeps; carry the compact checkpoint instead (--compact)")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.write_bytes(packed)
    os.replace(tmp, dst)
    return {"path": str(dst), "bytes": len(packed), "raw_bytes": len(raw), "kimg": doc.get("kimg")}


def read_d_state(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, D's tensors in float32) of a file write_d_state wrote; clear errors for anything else."""
    import lzma

    from safetensors.torch import load as load_bytes

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--init-d {path}: no such file (give the .safetensors.xz that "
                         "`train_default_model.py --carry-d RUN` or the GPU sitting's finish wrote)")
    try:
        raw = lzma.decompress(path.read_bytes())
    except lzma.LZMAError as exc:
        raise InputError(f"--init-d {path.name} is not an xz-compressed D state ({exc}); it is damaged or another "
                         "kind of file") from None
    try:
        tensors = load_bytes(raw)
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        meta = json.loads((header.get("__metadata__") or {}).get("atelier", "{}"))
    except (SafetensorError, ValueError, KeyError) as exc:
        raise InputError(f"--init-d {path.name}: the file inside the xz is not a readable safetensors ({exc})") from None
    if meta.get("format") != D_STATE_FORMAT:
        raise InputError(f"--init-d {path.name} is not a carried D state (format {meta.get('format')!r}, want "
                         f"{D_STATE_FORMAT!r})")
    return meta, {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
