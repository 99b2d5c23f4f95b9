"""Training data: every source format, the resumable sampler, rank slicing, mirroring, errors."""
from __future__ import annotations

import io
import lzma
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InputError
from training.dataset import ImageBatches, image_grid, load_images, to_float, to_uint8_hwc


def _imgs(n=12, res=16, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, res, res, 3), dtype=np.uint8)


def test_array_formats_round_trip(tmp_path):
    x = _imgs()
    np.save(tmp_path / "a.npy", x)
    np.savez_compressed(tmp_path / "b.npz", images=x)
    buf = io.BytesIO()
    np.save(buf, x)
    (tmp_path / "c.npy.xz").write_bytes(lzma.compress(buf.getvalue()))
    np.save(tmp_path / "nchw.npy", x.transpose(0, 3, 1, 2))
    for name in ("a.npy", "b.npz", "c.npy.xz", "nchw.npy"):
        arr, info = load_images(tmp_path / name)
        assert np.array_equal(np.asarray(arr), x), name
        assert (info.count, info.resolution) == (12, 16)


def test_folder_and_zip_decode_crop_resize_and_cache(tmp_path):
    folder = tmp_path / "imgs" / "sub"
    folder.mkdir(parents=True)
    rgba = Image.new("RGBA", (40, 32), (255, 0, 0, 0))       # transparent: composited on white
    rgba.paste((0, 0, 255, 255), (16, 12, 24, 20))
    rgba.save(folder / "a.png")
    Image.new("RGB", (32, 32), (0, 200, 0)).save(folder / "b.jpg")
    arr, info = load_images(tmp_path / "imgs", resolution=16, cache_dir=tmp_path / "cache")
    assert arr.shape == (2, 16, 16, 3) and info.decoder == "pillow"
    assert tuple(arr[0, 0, 0]) == (255, 255, 255)               # white where it was transparent
    assert arr[0, 8, 8, 2] > 200 and arr[0, 8, 8, 0] < 60       # the blue square stayed in the centre crop
    again, info2 = load_images(tmp_path / "imgs", resolution=16, cache_dir=tmp_path / "cache")
    assert info2.decoder == "cache" and np.array_equal(np.asarray(again), arr)

    with zipfile.ZipFile(tmp_path / "d.zip", "w") as zf:
        for i, im in enumerate(_imgs(3, 16)):
            b = io.BytesIO()
            Image.fromarray(im).save(b, format="PNG")
            zf.writestr(f"00000/img{i:08d}.png", b.getvalue())
        zf.writestr("dataset.json", "{}")
    arr, info = load_images(tmp_path / "d.zip")
    assert np.array_equal(arr, _imgs(3, 16)) and info.resolution == 16


def _transparent_pngs(folder):
    """PNGs of every transparency kind and awkward sizes, each with its true RGBA pixels.

    Random content, so a crop off by one pixel, another resampling filter or another
    background colour changes many pixels by far more than the tolerance."""
    rng = np.random.default_rng(7)
    cases = {}

    def rgba(w, h):
        return rng.integers(0, 256, size=(h, w, 4), dtype=np.uint8)

    x = rgba(45, 32)                                  # wider than tall, odd crop offset (6)
    x[:4, :, 3] = 0                                   # fully transparent rows, fully opaque rows
    x[-4:, :, 3] = 255
    Image.fromarray(x, "RGBA").save(folder / "rgba.png")
    cases["rgba.png"] = x

    la = rgba(30, 51)                                 # taller than wide, odd difference (offset 10)
    Image.fromarray(la[..., [0, 3]], "LA").save(folder / "la.png")
    la[..., 1] = la[..., 2] = la[..., 0]
    cases["la.png"] = la

    palette = np.array([[200, 30, 40], [10, 220, 60], [0, 0, 250], [250, 250, 0]], np.uint8)
    alpha = np.array([0, 128, 255, 60], np.uint8)
    idx = rng.integers(0, 4, size=(41, 37), dtype=np.uint8)
    p = Image.fromarray(idx, "P")
    p.putpalette(palette.flatten().tolist())
    p.save(folder / "palette.png", transparency=alpha.tobytes())      # tRNS per palette entry
    cases["palette.png"] = np.concatenate([palette[idx], alpha[idx][..., None]], axis=2)

    rgb = rgba(24, 40)
    rgb[..., 3] = 255
    rgb[::3, ::2, :3] = (1, 2, 3)                     # the colour key: transparent
    rgb[::3, ::2, 3] = 0
    Image.fromarray(rgb[..., :3], "RGB").save(folder / "rgb_key.png", transparency=(1, 2, 3))
    cases["rgb_key.png"] = rgb

    opaque = rgba(16, 20)                             # crop only: already 16 wide, no resize
    opaque[..., 3] = 255
    Image.fromarray(opaque[..., :3], "RGB").save(folder / "opaque.png")
    cases["opaque.png"] = opaque
    return cases


def _expected(rgba: np.ndarray, res: int) -> np.ndarray:
    """The documented preprocessing computed independently: float alpha blend on white, numpy crop."""
    a = rgba[..., 3:].astype(np.float64) / 255
    rgb = np.round(rgba[..., :3] * a + 255 * (1 - a)).astype(np.uint8)
    h, w = rgb.shape[:2]
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    rgb = rgb[top:top + s, left:left + s]
    if s == res:
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((res, res), Image.LANCZOS))


def test_folder_preprocessing_composites_on_white_centre_crops_and_resizes(tmp_path):
    """What docs/training.md promises for a folder: composite on white, centre crop, LANCZOS.

    Tolerance: Pillow composites in integer arithmetic (each channel within 1 of the float
    blend), and LANCZOS can amplify that by its negative lobes: at most 2 levels anywhere,
    under 0.5 on average; a wrong crop, filter or background is off by tens of levels."""
    folder = tmp_path / "pngs"
    folder.mkdir()
    cases = _transparent_pngs(folder)
    arr, info = load_images(folder, resolution=16)
    assert info.decoder == "pillow" and arr.shape == (len(cases), 16, 16, 3)
    for i, name in enumerate(sorted(cases)):                  # folders load in sorted name order
        got = np.asarray(arr[i]).astype(int)
        want = _expected(cases[name], 16).astype(int)
        diff = np.abs(got - want)
        assert diff.max() <= 2 and diff.mean() < 0.5, (name, int(diff.max()), float(diff.mean()))
    opaque = sorted(cases).index("opaque.png")
    assert np.array_equal(arr[opaque], _expected(cases["opaque.png"], 16))   # no blend, no resize: exact


@pytest.mark.parametrize("make, msg", [
    (lambda p: p / "missing", "not found"),
    (lambda p: (np.save(p / "f.npy", np.zeros((2, 16, 16, 3), np.float32)), p / "f.npy")[1], "uint8"),
    (lambda p: (np.save(p / "r.npy", np.zeros((2, 16, 12, 3), np.uint8)), p / "r.npy")[1], "square"),
    (lambda p: ((p / "e").mkdir(), p / "e")[1], "no images"),
    (lambda p: ((p / "x.txt").write_text("hi"), p / "x.txt")[1], "unsupported"),
])
def test_bad_data_is_an_input_error(tmp_path, make, msg):
    with pytest.raises(InputError, match=msg):
        load_images(make(tmp_path))


def _epoch_ids(loader, steps):
    out = []
    for _ in range(steps):
        b = loader.next()
        out.append(b[:, 0, 0, 0].tolist())
    return out


def _ids_images(n=10, res=8):
    """Image i has value i in pixel (0, 0, channel 0), so batches reveal their indices."""
    x = np.zeros((n, res, res, 3), np.uint8)
    x[:, 0, 0, 0] = np.arange(n)
    return x


def test_sampler_is_deterministic_covers_epochs_and_resumes():
    x = _ids_images()
    a = ImageBatches(x, 4, torch.device("cpu"), seed=3)
    seq = _epoch_ids(a, 6)
    first_epoch = sorted(sum(seq[:2], []))
    assert len(set(first_epoch)) == 8                       # no repeats inside an epoch (tail of 2 skipped)
    assert seq[:2] != seq[2:4]                              # a new permutation each epoch
    b = ImageBatches(x, 4, torch.device("cpu"), seed=3)
    _epoch_ids(b, 3)
    state = b.state_dict()
    c = ImageBatches(x, 4, torch.device("cpu"), seed=3)
    c.load_state_dict(state)
    assert _epoch_ids(c, 3) == seq[3:]
    assert _epoch_ids(ImageBatches(x, 4, torch.device("cpu"), seed=4), 1) != seq[:1]


def test_ranks_split_the_same_global_batch():
    x = _ids_images(16)
    whole = _epoch_ids(ImageBatches(x, 8, torch.device("cpu"), seed=1), 4)
    r0 = _epoch_ids(ImageBatches(x, 8, torch.device("cpu"), seed=1, rank=0, world_size=2), 4)
    r1 = _epoch_ids(ImageBatches(x, 8, torch.device("cpu"), seed=1, rank=1, world_size=2), 4)
    assert [a + b for a, b in zip(r0, r1)] == whole


def test_host_placement_matches_device_placement():
    x = _ids_images(12)
    g = _epoch_ids(ImageBatches(x, 4, torch.device("cpu"), seed=2, where="gpu"), 5)
    h = _epoch_ids(ImageBatches(x, 4, torch.device("cpu"), seed=2, where="host"), 5)
    assert g == h


def test_mirror_adds_flipped_copies():
    x = _imgs(4, 8)
    loader = ImageBatches(x, 8, torch.device("cpu"), seed=0, mirror=True)
    batch = loader.next().permute(0, 2, 3, 1).numpy()
    expected = {im.tobytes() for im in x} | {im[:, ::-1].copy().tobytes() for im in x}
    assert {im.tobytes() for im in batch} == expected


def test_resume_with_other_data_or_batch_is_refused():
    a = ImageBatches(_ids_images(10), 4, torch.device("cpu"))
    with pytest.raises(InputError, match="same --data"):
        ImageBatches(_ids_images(12), 4, torch.device("cpu")).load_state_dict(a.state_dict())
    with pytest.raises(InputError, match="same --batch"):
        ImageBatches(_ids_images(10), 2, torch.device("cpu")).load_state_dict(a.state_dict())
    with pytest.raises(InputError, match="fewer than one batch"):
        ImageBatches(_ids_images(3), 4, torch.device("cpu"))


def test_float_conversion_and_grid():
    u = torch.tensor([[[[0, 255], [128, 64]]]], dtype=torch.uint8).repeat(1, 3, 1, 1)
    f = to_float(u)
    assert f.min() == -1 and f.max() == 1
    assert np.array_equal(to_uint8_hwc(f)[0, :, :, 0], u[0, 0].numpy())
    g = image_grid(np.zeros((3, 4, 4, 3), np.uint8), cols=2)
    assert g.shape == (8, 8, 3) and g[4:, 4:].min() == 255    # the empty cell stays white
