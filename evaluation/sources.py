"""Where images to evaluate come from: a folder, a .npy/.npz array, an array in memory, or a generator.

Every source yields uint8 batches [B, 3, H, W], so a generator's output is
measured exactly as its saved PNGs would be. Floats are quantised the NVlabs
way (x * 127.5 + 128, truncated, for [-1, 1]) — the same rounding as
pipelines' `to_uint8_images` — before the feature networks see them.
"""
from __future__ import annotations

import abc

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from core.errors import InputError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def quantize(images, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """Float images in `value_range` -> uint8 with round-half-up (x*127.5+128 truncated for [-1, 1])."""
    x = images.detach().cpu().numpy() if torch.is_tensor(images) else np.asarray(images)
    lo, hi = float(value_range[0]), float(value_range[1])
    if not hi > lo:
        raise InputError(f"value range must be (low, high) with high > low; got {value_range}")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise InputError("images contain NaN or infinite values")
    return np.clip(np.floor((x - lo) * (255.0 / (hi - lo)) + 0.5), 0, 255).astype(np.uint8)


def to_uint8_nchw(images, value_range: tuple[float, float] = (-1.0, 1.0), what: str = "images") -> np.ndarray:
    """Any of uint8/float, NCHW/NHWC, 1/3/4 channels, [N, H, W] -> uint8 [N, 3, H, W].

    Floats are taken to lie in `value_range` (the generator convention is [-1, 1]).
    """
    x = images.detach().cpu().numpy() if torch.is_tensor(images) else np.asarray(images)
    if x.ndim == 3:
        x = x[:, None]                                   # [N, H, W] grayscale
    if x.ndim != 4:
        raise InputError(f"{what}: expected images [N, C, H, W] or [N, H, W, C]; got shape {x.shape}")
    if x.shape[1] in (1, 3, 4):
        pass
    elif x.shape[-1] in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    else:
        raise InputError(f"{what}: cannot tell the channel axis of shape {x.shape}; need 1, 3 or 4 channels")
    if x.dtype != np.uint8:
        if np.issubdtype(x.dtype, np.floating):
            x = quantize(x, value_range)
        else:
            raise InputError(f"{what}: images must be uint8 or float; got {x.dtype}")
    if x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    elif x.shape[1] == 4:
        x = x[:, :3]                                     # drop alpha, as PIL's convert("RGB") does
    return np.ascontiguousarray(x)


class ImageSource(abc.ABC):
    """A finite, ordered set of images. Subclasses give `__len__`, `batches` and (if they can) `get`."""

    name: str = "images"

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """uint8 [B, 3, H, W] batches in order; a batch never mixes image sizes."""

    def get(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Random access: uint8 [3, H, W] per index."""
        raise InputError(f"{self.name}: this source cannot be read out of order")

    def keys(self) -> list[str]:
        """A name per image, used to pair two sources (file names for folders, indices otherwise)."""
        return [str(i) for i in range(len(self))]

    def fingerprint(self) -> str | None:
        """A string that changes when the images change, or None if that cannot be known (no caching)."""
        return None


class FolderSource(ImageSource):
    """Image files under a folder (recursively), in sorted relative-path order."""

    def __init__(self, folder: str | os.PathLike, files: Sequence[Path] | None = None, workers: int = 4):
        self.root = Path(folder)
        if not self.root.is_dir():
            raise InputError(f"{self.root} is not a folder")
        if files is None:
            files = sorted((p for p in self.root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()),
                           key=lambda p: p.relative_to(self.root).as_posix())
        self.files = list(files)
        if not self.files:
            raise InputError(f"{self.root} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        self.workers = max(1, int(workers))
        self.name = str(self.root)

    def __len__(self) -> int:
        return len(self.files)

    def _read(self, path: Path) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as im:
                arr = np.asarray(im.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise InputError(f"{path}: not a readable image ({exc})") from None
        return np.ascontiguousarray(arr.transpose(2, 0, 1))

    def get(self, indices: Sequence[int]) -> list[np.ndarray]:
        paths = [self.files[int(i)] for i in indices]
        if self.workers == 1 or len(paths) == 1:
            return [self._read(p) for p in paths]
        with ThreadPoolExecutor(self.workers) as pool:   # PIL decodes without the GIL
            return list(pool.map(self._read, paths))

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self.files), batch_size):
            yield from _same_size_runs(self.get(range(start, min(start + batch_size, len(self.files)))))

    def keys(self) -> list[str]:
        return [p.relative_to(self.root).with_suffix("").as_posix() for p in self.files]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for p in self.files:
            st = p.stat()
            h.update(f"{p.relative_to(self.root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return f"folder:{h.hexdigest()}"


def _same_size_runs(images: list[np.ndarray]) -> Iterator[np.ndarray]:
    run: list[np.ndarray] = []
    for im in images:
        if run and im.shape != run[0].shape:
            yield np.stack(run)
            run = []
        run.append(im)
    if run:
        yield np.stack(run)


class ArraySource(ImageSource):
    """Images held in an array (memory, or a memory-mapped .npy): uint8, or floats in `value_range`."""

    def __init__(self, array, name: str = "array", value_range: tuple[float, float] = (-1.0, 1.0),
                 fingerprint: str | None = None):
        a = array.detach().cpu().numpy() if torch.is_tensor(array) else array
        if not hasattr(a, "shape") or a.ndim not in (3, 4) or a.shape[0] == 0:
            raise InputError(f"{name}: expected a non-empty image array [N, C, H, W] or [N, H, W, C]; "
                             f"got shape {getattr(a, 'shape', None)}")
        to_uint8_nchw(a[:1], value_range, name)          # fail early on a bad layout or dtype
        self.array, self.name, self.value_range, self._fingerprint = a, name, value_range, fingerprint

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(self), batch_size):
            yield to_uint8_nchw(self.array[start:start + batch_size], self.value_range, self.name)

    def get(self, indices: Sequence[int]) -> list[np.ndarray]:
        idx = np.asarray(list(indices), dtype=np.int64)
        return list(to_uint8_nchw(self.array[np.sort(idx)], self.value_range, self.name)[np.argsort(np.argsort(idx))])

    def fingerprint(self) -> str | None:
        return self._fingerprint


class GeneratorSource(ImageSource):
    """`num` images from `sample(batch_size) -> images` (uint8, or floats in `value_range`, [-1, 1] by default).

    `sample` is called with the number still wanted (at most `batch_size`) until `num`
    images have come back; extra images are dropped.
    """

    def __init__(self, sample: Callable[[int], object], num: int, value_range: tuple[float, float] = (-1.0, 1.0),
                 name: str = "generator"):
        if int(num) < 1:
            raise InputError(f"{name}: the number of images to generate must be at least 1; got {num}")
        self.sample, self.num, self.value_range, self.name = sample, int(num), value_range, name

    def __len__(self) -> int:
        return self.num

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        done = 0
        while done < self.num:
            want = min(batch_size, self.num - done)
            with torch.no_grad():                        # a generator under evaluation needs no graph
                images = self.sample(want)
            out = to_uint8_nchw(images, self.value_range, self.name)[:want]
            if out.shape[0] == 0:
                raise InputError(f"{self.name}: the sampler returned no images")
            done += out.shape[0]
            yield out

    def materialize(self, batch_size: int = 64) -> ArraySource:
        """All images in memory, for metrics that need random access (LPIPS pairs)."""
        runs = list(self.batches(batch_size))
        if len({r.shape[1:] for r in runs}) > 1:
            raise InputError(f"{self.name}: the sampler returned images of different sizes")
        return ArraySource(np.concatenate(runs), name=self.name)


def _is_array_file(path: Path) -> bool:
    return path.suffix in (".npy", ".npz") or path.name.endswith(".npy.xz")


def _load_array_file(path: Path):
    if path.name.endswith(".npy.xz"):             # how data sets ship in assets/datasets (e.g. emoji64)
        import lzma

        try:
            with lzma.open(path) as f:
                return np.load(f, allow_pickle=False)
        except (lzma.LZMAError, ValueError, EOFError) as exc:
            raise InputError(f"{path}: not an xz-compressed plain .npy array ({exc})") from None
    if path.suffix == ".npy":
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise InputError(f"{path}: not a plain numeric .npy array ({exc})") from None
    with np.load(path, allow_pickle=False) as z:
        names = list(z.files)
        for preferred in ("images", "arr_0", "x", "samples"):
            if preferred in names:
                return z[preferred]
        arrays = [n for n in names if z[n].ndim in (3, 4)]
        if len(arrays) != 1:
            raise InputError(f"{path}: expected one image array (e.g. 'images' or 'arr_0'); found {names}")
        return z[arrays[0]]


def is_stats_file(path: str | os.PathLike) -> bool:
    """A .npz of precomputed feature statistics (mu, sigma) rather than images."""
    p = Path(path)
    if p.suffix != ".npz" or not p.is_file():
        return False
    with np.load(p, allow_pickle=False) as z:
        return "mu" in z.files and "sigma" in z.files


def open_source(spec, num: int | None = None, value_range: tuple[float, float] = (-1.0, 1.0),
                what: str = "images") -> ImageSource:
    """A path (folder, .npy, .npz, .npy.xz), an array/tensor, a sampler callable (needs `num`) or an ImageSource."""
    if isinstance(spec, ImageSource):
        return spec
    if callable(spec) and not isinstance(spec, (str, os.PathLike)):
        if num is None:
            raise InputError(f"{what}: a sampler needs the number of images to draw (num)")
        return GeneratorSource(spec, num, value_range)
    if isinstance(spec, (str, os.PathLike)):
        p = Path(spec).expanduser()
        if p.is_dir():
            return FolderSource(p)
        if not p.exists():
            raise InputError(f"{what}: {p} does not exist")
        if not _is_array_file(p):
            raise InputError(f"{what}: {p} is neither a folder of images nor a .npy/.npz/.npy.xz array")
        if is_stats_file(p):
            raise InputError(f"{what}: {p} holds feature statistics (mu, sigma), not images; "
                             f"it can only stand for the real set")
        st = p.stat()
        fp = f"file:{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
        return ArraySource(_load_array_file(p), name=str(p), value_range=value_range, fingerprint=fp)
    if isinstance(spec, np.ndarray) or torch.is_tensor(spec):
        return ArraySource(spec, name=what, value_range=value_range)
    raise InputError(f"{what}: cannot read images from a {type(spec).__name__}")


def paired(a: ImageSource, b: ImageSource) -> tuple[ImageSource, ImageSource]:
    """Two sources in matching order: folders are paired by relative file name (extension ignored)."""
    if isinstance(a, FolderSource) and isinstance(b, FolderSource):
        ka, kb = a.keys(), b.keys()
        index_b = {k: f for k, f in zip(kb, b.files)}
        only_a = [k for k in ka if k not in index_b]
        only_b = sorted(set(kb) - set(ka))
        if only_a or only_b:
            raise InputError(f"paired folders must hold the same file names: {len(only_a)} only in {a.name} "
                             f"(e.g. {only_a[:3]}), {len(only_b)} only in {b.name} (e.g. {only_b[:3]})")
        return a, FolderSource(b.root, files=[index_b[k] for k in ka], workers=b.workers)
    if len(a) != len(b):
        raise InputError(f"paired sets must hold the same number of images: {len(a)} in {a.name}, {len(b)} in {b.name}")
    return a, b
