"""Training data: decode once into a uint8 array, then serve batches from the GPU.

Sources: a folder of images (png/jpg/jpeg/webp/bmp, searched recursively), a .zip of
images (the NVlabs dataset_tool layout works), or an array file (.npy, .npz with an
`images` array, .npy.xz) of shape (N, H, W, 3) or (N, 3, H, W) uint8.

Why uint8 on the GPU: a 64x64 set of 4k images is 48 MB, a 256x256 set of 70k is
14 GB; either fits an H200 next to the networks, and gathering a batch there costs
one index_select with no host round trip. Sets that do not fit stay in pinned host
memory and are copied one batch ahead on a side stream.

The sampler is deterministic and resumable: epoch e visits a permutation drawn from
(seed, e); the state is (epoch, position), saved in every checkpoint. Each rank takes
its slice of the same global batch, so the global data order does not depend on the
number of GPUs. The tail of each epoch that does not fill a global batch is skipped.
With a class balance alpha > 0 (conditional training, `--class-balance`), an epoch is
instead as many draws with replacement, image i weighted n_c(i) ** -alpha, again from
(seed, e), so the state and the rank slicing stay the same.
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.errors import InputError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
ARRAY_SUFFIXES = (".npy", ".npz", ".xz")


@dataclass
class DatasetInfo:
    source: str
    count: int
    resolution: int
    channels: int
    decoder: str                 # pillow | array | cache
    cache_file: str | None = None


# ---------------------------------------------------------------------------------------------
# Decoding


def _to_square_rgb(img, resolution: int):
    """The one preprocessing of decoded images (docs/training.md "Data"), in this order:

    1. transparency composited on white: an alpha channel (RGBA, LA, PA) or a tRNS entry
       (palette, grey or RGB PNGs), as a browser shows the image on a white page;
    2. centre crop to a square of the shorter side (offsets rounded down);
    3. LANCZOS resize to `resolution` (skipped when the crop already has that size).
    """
    from PIL import Image

    if img.has_transparency_data:
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img)
    img = img.convert("RGB")
    w, h = img.size
    s = min(w, h)
    if w != h:
        img = img.crop(((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s))
    if s != resolution:
        img = img.resize((resolution, resolution), Image.LANCZOS)
    return np.asarray(img, dtype=np.uint8)


def _list_folder(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _decode_pillow(names: list[str], opener, resolution: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(names), resolution, resolution, 3), dtype=np.uint8)
    for i, name in enumerate(names):
        try:
            with opener(name) as f:
                img = Image.open(f)
                img.load()
        except (UnidentifiedImageError, OSError) as exc:
            raise InputError(f"could not read image {name}: {exc}; remove it or convert it to PNG/JPEG") from None
        out[i] = _to_square_rgb(img, resolution)
    return out


def _read_array(path: Path) -> np.ndarray:
    try:
        if path.name.endswith(".npy.xz"):
            with lzma.open(path) as f:
                arr = np.load(io.BytesIO(f.read()), allow_pickle=False)
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                if "images" not in z:
                    raise InputError(f"{path.name} has no 'images' array (found: {', '.join(z.files)})")
                arr = z["images"]
        else:
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, lzma.LZMAError, EOFError) as exc:
        raise InputError(f"could not read {path}: {exc}") from None
    if arr.dtype != np.uint8 or arr.ndim != 4:
        raise InputError(f"{path.name} must hold uint8 images of shape (N, H, W, 3) or (N, 3, H, W); "
                         f"got {arr.dtype} {list(arr.shape)}")
    if arr.shape[1] in (1, 3) and arr.shape[3] not in (1, 3):
        arr = arr.transpose(0, 2, 3, 1)        # NCHW -> NHWC
    if arr.shape[3] == 1:
        arr = np.repeat(arr, 3, axis=3)
    if arr.shape[3] != 3:
        raise InputError(f"{path.name}: images must have 1 or 3 channels; got shape {list(arr.shape)}")
    return arr


def _cache_key(path: Path, names: list[str], resolution: int, stat_of) -> str:
    # v2: DALI removed, tRNS transparency composited (a v1 cache may hold other pixels)
    h = hashlib.sha256(f"{path.resolve()}|{resolution}|v2".encode())
    for n in names:
        st = stat_of(n)
        h.update(f"{n}|{st[0]}|{st[1]}".encode())
    return h.hexdigest()[:16]


def load_images(path: str | Path, resolution: int = 0,
                cache_dir: str | Path | None = None) -> tuple[np.ndarray, DatasetInfo]:
    """All images of `path` as one (N, R, R, 3) uint8 array, decoded once and cached as .npy."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"training data not found: {path}; give a folder, a .zip or an .npy/.npz/.npy.xz file")
    if resolution and (resolution < 8 or resolution & (resolution - 1)):
        raise InputError(f"--resolution must be a power of two >= 8; got {resolution}")

    if path.is_file() and (path.suffix in (".npy", ".npz") or path.name.endswith(".npy.xz")):
        arr = _read_array(path)
        h, w = arr.shape[1:3]
        if h != w:
            raise InputError(f"{path.name}: images must be square; got {h}x{w}")
        if resolution and h != resolution:
            from PIL import Image

            arr = np.stack([np.asarray(Image.fromarray(a).resize((resolution, resolution), Image.LANCZOS))
                            for a in arr])
        res = arr.shape[1]
        if res < 8 or res & (res - 1):
            raise InputError(f"{path.name}: image size {res} is not a power of two >= 8; pass --resolution")
        return np.ascontiguousarray(arr), DatasetInfo(str(path), len(arr), res, 3, "array")

    if path.is_dir():
        names = [str(f.relative_to(path)) for f in _list_folder(path)]

        def opener(n):
            return open(path / n, "rb")

        def stat_of(n):
            st = (path / n).stat()
            return st.st_size, st.st_mtime_ns
    elif path.suffix.lower() == ".zip":
        try:
            zf = zipfile.ZipFile(path)
        except zipfile.BadZipFile as exc:
            raise InputError(f"{path.name} is not a readable zip file: {exc}") from None
        infos = {i.filename: i for i in zf.infolist()}
        names = sorted(n for n in infos if Path(n).suffix.lower() in IMAGE_SUFFIXES)

        def opener(n):
            return zf.open(n)

        def stat_of(n):
            return infos[n].file_size, infos[n].CRC
    else:
        raise InputError(f"unsupported training data {path.name}: give a folder of images, a .zip, "
                         "or an .npy/.npz/.npy.xz array")
    if not names:
        raise InputError(f"no images ({', '.join(IMAGE_SUFFIXES)}) found in {path}")

    if not resolution:
        from PIL import Image

        with opener(names[0]) as f:
            s = min(Image.open(f).size)
        resolution = 2 ** int(np.floor(np.log2(s)))
        if resolution < 8:
            raise InputError(f"the first image is only {s}px; images must be at least 8x8")

    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"{path.name}-{resolution}-{_cache_key(path, names, resolution, stat_of)}.npy"
        if cache.is_file():
            arr = np.load(cache, mmap_mode="r")
            return arr, DatasetInfo(str(path), len(arr), resolution, 3, "cache", str(cache))

    arr = _decode_pillow(names, opener, resolution)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, arr)
        os.replace(tmp, cache)
    return arr, DatasetInfo(str(path), len(arr), resolution, 3, "pillow", str(cache) if cache else None)


NVLABS_LABELS = "dataset.json"


def image_names(path: str | Path) -> list[str] | None:
    """The image names of a folder or .zip data set, in the order load_images decodes them (relative paths
    with '/'), or None for an array file (its images have no names)."""
    path = Path(path)
    if path.is_dir():
        return [f.relative_to(path).as_posix() for f in _list_folder(path)]
    if path.is_file() and path.suffix.lower() == ".zip":
        try:
            with zipfile.ZipFile(path) as zf:
                return sorted(n for n in zf.namelist() if Path(n).suffix.lower() in IMAGE_SUFFIXES)
        except zipfile.BadZipFile as exc:
            raise InputError(f"{path.name} is not a readable zip file: {exc}") from None
    return None


def nvlabs_labels_source(data: str | Path) -> str | None:
    """Where the data set keeps NVlabs' dataset.json (a folder's file, or the member at a .zip's root), or None."""
    data = Path(data)
    if data.is_dir():
        return str(data / NVLABS_LABELS) if (data / NVLABS_LABELS).is_file() else None
    if data.is_file() and data.suffix.lower() == ".zip":
        try:
            with zipfile.ZipFile(data) as zf:
                return f"{data}!{NVLABS_LABELS}" if NVLABS_LABELS in zf.namelist() else None
        except zipfile.BadZipFile:
            return None
    return None


def _read_labels_doc(path: str | Path):
    """JSON from a file, or from a zip member written 'archive.zip!member'."""
    text = str(path)
    if "!" in text and text.split("!", 1)[0].lower().endswith(".zip"):
        archive, member = text.split("!", 1)
        try:
            with zipfile.ZipFile(archive) as zf:
                return json.loads(zf.read(member))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
            raise InputError(f"cannot read {member} in {archive}: {exc}") from None
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"the labels file {path} does not exist; give --labels FILE (a JSON file)") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the labels file {path}: {exc}") from None


def _nvlabs_labels(doc: dict, path, names: list[str] | None) -> tuple[np.ndarray, list[str]]:
    """NVlabs' dataset.json: {"labels": [[file name relative to the data set, class index], ...]}, matched to
    the images by name (its order need not be ours)."""
    raw = doc["labels"]
    if raw is None:
        raise InputError(f"{path} has \"labels\": null (NVlabs' way of saying the data set is unlabeled); "
                         "train without --cond, or give per-image class indices")
    if names is None:
        raise InputError(f"{path} labels images by file name, and an array data set has none; "
                         "give --labels FILE with a list of class indices in the array's order")
    by_name: dict[str, object] = {}
    for item in raw:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise InputError(f"{path}: every entry of \"labels\" must be [file name, class index]; found {item!r}")
        by_name[item[0].replace("\\", "/")] = item[1]
    missing = [n for n in names if n not in by_name]
    if missing:
        raise InputError(f"{path} has no label for {len(missing)} of the {len(names)} images, e.g. {missing[0]!r}")
    values = [by_name[n] for n in names]
    bad = next((v for v in values if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0)), None)
    if bad is not None:
        what = "a label vector" if isinstance(bad, list) else repr(bad)
        raise InputError(f"{path}: found {what}; class-conditional training here takes one class index (a whole "
                         "number >= 0) per image, not NVlabs' float label vectors")
    labels = np.asarray(values, dtype=np.int64)
    n_classes = int(labels.max()) + 1
    if n_classes < 2:
        raise InputError(f"{path} has a single class: conditional training needs at least 2")
    return labels, [str(i) for i in range(n_classes)]


def load_labels(path: str | Path, key: str, count: int,
                names: list[str] | None = None) -> tuple[np.ndarray, list[str]]:
    """Per-image class indices (int64 [count], in the data set's image order) and the class names.

    Two formats:
    - Atelier's: JSON with a list of `count` whole numbers under `key` and, optionally, the class names
      under its plural (`classes` for `class`, `groups` for `group`): assets/datasets/emoji64_labels.json
      has both for `group` (10 Unicode groups) and `class` (98 subgroups);
    - NVlabs' dataset.json (`{"labels": [["00000/img00000000.png", 6], ...]}`, as their dataset_tool
      writes it), matched to the images by `names` (image_names of the data set) whatever `key` is.
    `path` may name a zip member as 'archive.zip!dataset.json'."""
    doc = _read_labels_doc(path)
    if isinstance(doc, dict) and "labels" in doc and (doc["labels"] is None or (
            isinstance(doc["labels"], list) and doc["labels"] and isinstance(doc["labels"][0], (list, tuple)))):
        labels, class_names = _nvlabs_labels(doc, path, names)
        if len(labels) != count:
            raise InputError(f"{path} labels {len(labels)} images; the data set has {count}")
        return labels, class_names
    if not isinstance(doc, dict) or key not in doc:
        keys = ", ".join(k for k, v in (doc.items() if isinstance(doc, dict) else []) if isinstance(v, list))
        raise InputError(f"{path} has no per-image labels under {key!r}; lists in it: {keys or 'none'}")
    raw = doc[key]
    if not isinstance(raw, list) or len(raw) != count:
        n = len(raw) if isinstance(raw, list) else "no list"
        raise InputError(f"{path}[{key!r}] must list one class index per image: the data set has {count} images, "
                         f"the file {n}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw):
        bad = next(v for v in raw if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
        raise InputError(f"{path}[{key!r}] must hold whole numbers >= 0 (class indices); found {bad!r}")
    labels = np.asarray(raw, dtype=np.int64)
    names = next((doc[k] for k in (key + "es", key + "s") if isinstance(doc.get(k), list)), None)
    n_classes = int(labels.max()) + 1
    if names is None:
        names = [str(i) for i in range(n_classes)]
    elif len(names) < n_classes:
        raise InputError(f"{path} names {len(names)} classes under {key!r}s but an image has class {n_classes - 1}")
    if len(names) < 2:
        raise InputError(f"{path}[{key!r}] has a single class: conditional training needs at least 2")
    return labels, [str(n) for n in names]


def read_dataset_meta(path: str | Path) -> dict:
    """The JSON sidecar of a bundled array dataset (license, count), or {}."""
    p = Path(path)
    side = p.with_name(p.name.split(".")[0] + ".json")
    if side.is_file():
        try:
            return json.loads(side.read_text())
        except json.JSONDecodeError:
            return {}
    return {}


# ---------------------------------------------------------------------------------------------
# Class balance (--class-balance): how often each class is shown, on the real and the generated side


def _class_counts(labels: np.ndarray, num_classes: int = 0) -> np.ndarray:
    labels = np.asarray(labels, dtype=np.int64)
    return np.bincount(labels, minlength=max(int(num_classes), int(labels.max()) + 1)).astype(np.float64)


def effective_number_scale(labels: np.ndarray, beta: float, num_classes: int = 0) -> np.ndarray:
    """Per-class noise scale from the effective number of samples (Cui et al. 2019), as NoisyTwins' code scales its
    class-embedding noise: E_c = (1 - beta ** n_c) / (1 - beta), scale_c proportional to 1 / E_c, normalised to a
    mean of 1 over the classes that have images (a class without any gets 0: it is never drawn). Rare classes get
    more noise; beta = 0 gives 1 for every class with images. float64 [classes]."""
    n = _class_counts(labels, num_classes)
    beta = float(beta)
    e = np.where(n > 0, (1.0 - beta ** n) / (1.0 - beta), 0.0)
    inv = np.where(n > 0, 1.0 / np.where(n > 0, e, 1.0), 0.0)
    return inv * (np.count_nonzero(n) / inv.sum())


def class_balance_weights(labels: np.ndarray, alpha: float) -> np.ndarray:
    """Per-image sampling weights n_c(i) ** -alpha (float64, not normalised), n_c the image count of class c."""
    labels = np.asarray(labels, dtype=np.int64)
    return _class_counts(labels)[labels] ** -float(alpha)


def class_shares(labels: np.ndarray, alpha: float, num_classes: int = 0) -> np.ndarray:
    """Each class's share of the samples (float64 [classes], sums to 1) under balance alpha: proportional to
    n_c ** (1 - alpha); a class without images gets none (at alpha = 1, 0 ** 0 would give it a full share)."""
    n = _class_counts(labels, num_classes)
    share = np.where(n > 0, n ** (1.0 - float(alpha)), 0.0)
    return share / share.sum()


def balanced_class_pool(labels: np.ndarray, alpha: float, num_classes: int = 0, size: int = 1 << 16) -> np.ndarray:
    """Class indices (int64) in which each class appears in proportion to its share under `alpha`, so a uniform
    draw from the pool draws classes as the balanced real sampler does. Built by quota (largest remainder), not
    by random draws, so the proportions are exact to 1/size; every class with images keeps at least one entry.
    The pool grows past `size` (up to 2 ** 22) when the rarest class would otherwise get fewer than 16 entries."""
    share = class_shares(labels, alpha, num_classes)
    present = share > 0
    size = int(min(max(size, np.ceil(16 / share[present].min())), 1 << 22))
    exact = share * size
    counts = np.floor(exact).astype(np.int64)
    short = size - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    counts[present & (counts == 0)] = 1
    return np.repeat(np.arange(len(share), dtype=np.int64), counts)


def _percent(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def class_balance_note(labels: np.ndarray, alpha: float) -> str:
    """One line for the run's start: how the balance moves the largest and the smallest class."""
    n = _class_counts(labels)
    present = np.flatnonzero(n > 0)
    big, small = present[np.argmax(n[present])], present[np.argmin(n[present])]
    before, after = class_shares(labels, 0.0) * 100, class_shares(labels, alpha) * 100
    return (f"class balance {alpha:g}: largest class ({int(n[big])} images) {_percent(before[big])} % -> "
            f"{_percent(after[big])} % of samples, smallest ({int(n[small])}) {_percent(before[small])} % -> "
            f"{_percent(after[small])} %")


# ---------------------------------------------------------------------------------------------
# Serving batches


def _mix(*xs: int) -> int:
    """A 63-bit seed from integers (splitmix-style), so nearby (seed, epoch) pairs are unrelated."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h ^= (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


class ImageBatches:
    """Deterministic, resumable batches of uint8 images [b, 3, R, R] for one rank.

    where: 'gpu' keeps the whole set on the device; 'host' keeps it in pinned memory
    and prefetches one batch ahead on a side stream; 'host-plain' is the naive loop
    (float conversion on the CPU, blocking copy), kept only as the benchmark baseline.
    class_balance: alpha in [0, 1]; 0 visits every image once per epoch (a permutation), > 0 draws each
    epoch's images with replacement, image i with probability proportional to n_c(i) ** -alpha (needs labels).
    """

    def __init__(self, images: np.ndarray, global_batch: int, device: torch.device, seed: int = 0,
                 rank: int = 0, world_size: int = 1, mirror: bool = False, where: str = "auto",
                 labels: np.ndarray | None = None, class_balance: float = 0.0):
        if labels is not None and len(labels) != len(images):
            raise InputError(f"{len(labels)} labels for {len(images)} images")
        if not 0.0 <= class_balance <= 1.0:
            raise InputError(f"the class balance must be between 0 and 1; got {class_balance}")
        if class_balance > 0 and labels is None:
            raise InputError("a class balance needs the images' class labels (class-conditional training)")
        if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
            raise InputError(f"expected (N, R, R, 3) uint8 images; got {images.dtype} {list(images.shape)}")
        n = len(images) * (2 if mirror else 1)
        if n < global_batch:
            raise InputError(f"the dataset has {len(images)} images{' (x2 mirrored)' if mirror else ''}, fewer "
                             f"than one batch of {global_batch}; lower --batch or add images")
        if global_batch % world_size:
            raise InputError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        self.device = torch.device(device)
        self.num_images = len(images)
        self.length = n
        self.global_batch = global_batch
        self.batch = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.mirror = mirror
        self.class_balance = float(class_balance)
        self.epoch = 0
        self.pos = 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1
        self._handed = self._cursor()
        self._prefetched = None

        if where == "auto":
            where = "host"
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                where = "gpu" if images.nbytes < 0.25 * free else "host"
            elif self.device.type == "cpu":
                where = "gpu"  # "on the device" is host memory anyway; no copies needed
        self.where = where
        if not images.flags.writeable:      # a memory-mapped cache: torch wants writable memory
            images = np.array(images)
        chw = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)   # a view, NCHW order
        if where == "gpu":
            self.data = chw.to(self.device).contiguous()
        elif where in ("host", "host-plain"):
            self.data = chw.contiguous()
            if self.device.type == "cuda" and where == "host":
                self.data = self.data.pin_memory()
                self._stream = torch.cuda.Stream(self.device)
                self._staging = [torch.empty((self.batch, *self.data.shape[1:]), dtype=torch.uint8).pin_memory()
                                 for _ in range(2)]
                self._events = [None, None]
                self._slot = 0
        else:
            raise InputError(f"data placement must be auto, gpu, host or host-plain; got {where!r}")
        # class indices (conditional training): on the device, and a pinned copy for the host prefetch
        self.labels = None if labels is None else torch.as_tensor(np.asarray(labels, dtype=np.int64)).to(self.device)
        self._labels_host = None
        if labels is not None and where == "host" and self.device.type == "cuda":
            self._labels_host = torch.as_tensor(np.asarray(labels, dtype=np.int64))
            self._label_staging = [torch.empty(self.batch, dtype=torch.int64).pin_memory() for _ in range(2)]
        # per-index sampling weights where the epoch's index list is drawn (a mirrored copy weighs as its image)
        self._weights = None
        if self.class_balance > 0:
            w = class_balance_weights(labels, self.class_balance)
            w = np.concatenate([w, w]) if mirror else w
            self._weights = torch.from_numpy(w).to(self.device if where == "gpu" else torch.device("cpu"))

    # -- sampler -----------------------------------------------------------------------------------
    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s global index list (`length` entries; >= num_images: mirrored): a permutation, or with a
        class balance, draws with replacement by the per-index weights. Both from (seed, epoch) alone."""
        if self._perm_epoch != epoch:
            dev = self.device if self.where == "gpu" else torch.device("cpu")
            g = torch.Generator(device=dev)
            g.manual_seed(_mix(self.seed, epoch, 0xDA7A))
            if self._weights is None:
                self._perm = torch.randperm(self.length, generator=g, device=dev)
            else:
                self._perm = torch.multinomial(self._weights, self.length, replacement=True, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def _next_indices(self) -> torch.Tensor:
        if self.pos + self.global_batch > self.length:
            self.epoch += 1
            self.pos = 0
        perm = self._epoch_perm(self.epoch)
        start = self.pos + self.rank * self.batch
        idx = perm[start:start + self.batch]
        self.pos += self.global_batch
        return idx

    def _cursor(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "length": self.length, "global_batch": self.global_batch}

    def state_dict(self) -> dict:
        """The sampler state after the last batch handed out (a prefetched batch does not count)."""
        return dict(self._handed)

    def load_state_dict(self, state: dict, allow_batch_change: bool = False) -> None:
        """Continue after the saved position. With `allow_batch_change` (a retuned resume) the saved
        position, counted in images, is kept and the next batch of the new size starts there."""
        if int(state["length"]) != self.length:
            raise InputError(f"the checkpoint was trained on {state['length']} images (with mirroring) but this "
                             f"dataset has {self.length}; resume with the same --data and --mirror")
        if int(state["global_batch"]) != self.global_batch and not allow_batch_change:
            raise InputError(f"the checkpoint used a global batch of {state['global_batch']}; resume with the "
                             f"same --batch (it was {self.global_batch})")
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._handed = self._cursor()
        self._prefetched = None

    # -- batches -------------------------------------------------------------------------------------
    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.mirror:
            return self.data.index_select(0, idx)
        flip = idx >= self.num_images
        imgs = self.data.index_select(0, idx % self.num_images)
        return torch.where(flip[:, None, None, None], imgs.flip(3), imgs)

    def _labels_of(self, idx: torch.Tensor) -> torch.Tensor | None:
        if self.labels is None:
            return None
        return self.labels.index_select(0, (idx % self.num_images).to(self.labels.device))

    def _host_batch(self) -> tuple[torch.Tensor, object, dict, torch.Tensor | None]:
        idx = self._next_indices()
        cursor = self._cursor()
        if self.device.type != "cuda":
            return self._gather(idx), None, cursor, self._labels_of(idx)
        slot = self._slot
        self._slot ^= 1
        if self._events[slot] is not None:
            self._events[slot].synchronize()    # the copy out of this buffer, two batches ago
        torch.index_select(self.data, 0, idx % self.num_images, out=self._staging[slot])
        buf = self._staging[slot]
        if self.mirror:
            flip = idx >= self.num_images
            buf[flip] = buf[flip].flip(3)
        lab_buf = None
        if self._labels_host is not None:
            lab_buf = self._label_staging[slot]
            torch.index_select(self._labels_host, 0, idx % self.num_images, out=lab_buf)
        with torch.cuda.stream(self._stream):
            out = buf.to(self.device, non_blocking=True)
            lab = lab_buf.to(self.device, non_blocking=True) if lab_buf is not None else None
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events[slot] = ev
        return out, ev, cursor, lab

    def next(self) -> torch.Tensor:
        """The next uint8 batch [b, 3, R, R] of this rank, on the device."""
        return self.next_labeled()[0]

    def next_labeled(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next batch and its class indices [b] (int64, on the device; None without labels)."""
        if self.where in ("gpu", "host-plain"):
            idx = self._next_indices()
            x = self._gather(idx)
            self._handed = self._cursor()
            return (x if self.where == "gpu" else x.to(self.device)), self._labels_of(idx)
        if self._prefetched is None:
            self._prefetched = self._host_batch()
        out, ev, self._handed, lab = self._prefetched
        self._prefetched = self._host_batch()      # start copying the following batch now
        if ev is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ev)
            out.record_stream(stream)
            if lab is not None:
                lab.record_stream(stream)
        return out, lab


def to_float(batch_uint8: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 [0, 255] -> float32 [-1, 1] (the generator's output range)."""
    x = batch_uint8.to(torch.float32).div_(127.5).sub_(1.0)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """float [-1, 1] [N, C, H, W] -> uint8 [N, H, W, C] numpy (for grids and previews)."""
    x = (images.detach().float().clamp(-1, 1) + 1) * 127.5
    return x.round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def image_grid(images_hwc: np.ndarray, cols: int = 8) -> np.ndarray:
    n, h, w, c = images_hwc.shape
    rows = (n + cols - 1) // cols
    grid = np.full((rows * h, cols * w, c), 255, dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, cols)
        grid[r * h:(r + 1) * h, q * w:(q + 1) * w] = images_hwc[i]
    return grid
