"""pipelines/stylegan.py: seeds, classes, style mixing and interpolation on a real NVlabs pickle."""
import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InputError
from core.types import GenerationRequest, Job, OptimizationFlags, StyleGANParams
from models.stylegan import load_generator
from pipelines.base import to_uint8_images
from pipelines.stylegan import StyleGANPipeline, seed_to_z, write_animation


@pytest.fixture(scope="module")
def pipe(testdata):
    loaded = load_generator(testdata / "stylegan" / "sg2_uncond_32.pkl")
    return StyleGANPipeline(loaded, OptimizationFlags(), torch.device("cpu"))


def _images(pipe, seeds, psi=1.0):
    req = GenerationRequest("stylegan", None, StyleGANParams(seeds=tuple(seeds), truncation_psi=psi, batch_size=3))
    return pipe.generate(req, Job())


def test_batching_does_not_change_images(pipe):
    together = _images(pipe, [0, 1, 2, 3, 4]).raw
    alone = np.concatenate([_images(pipe, [s]).raw for s in (0, 3)])
    assert np.allclose(together[[0, 3]], alone, atol=1e-5)


def test_style_mix_cells_take_coarse_styles_from_rows(pipe):
    p = StyleGANParams(seeds=(0,), truncation_psi=1.0)
    grid, raw = pipe.style_mix([1, 2], [5, 6, 7], (0, 4), p)
    assert grid.size == (4 * 32, 3 * 32) and raw.shape[0] == 12
    G = pipe.G
    z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in (2, 6)]))
    with torch.no_grad():
        ws = G.mapping(z, None, truncation_psi=1.0)
        mixed = ws[1:2].clone()
        mixed[:, 0:4] = ws[0, 0:4]
        want = G.synthesis(mixed, noise_mode="const")[0].numpy()
    # row 2 (seed 2), column 2 (seed 6): cell index (1 + 1) * 4 + 2
    assert np.allclose(raw[2 * 4 + 2], want, atol=1e-5)
    # the header row holds the plain column images
    assert np.allclose(raw[2], _images(pipe, [6]).raw[0], atol=1e-5)
    with pytest.raises(InputError, match="layers"):
        pipe.style_mix([1], [2], (3, 99), p)


def test_interpolation_starts_at_each_seed_and_writes_gif_and_mp4(pipe, tmp_path):
    p = StyleGANParams(seeds=(0,), truncation_psi=1.0)
    frames = pipe.interpolate([3, 9], 4, p)
    assert len(frames) == 8 and all(isinstance(f, Image.Image) for f in frames)
    first = to_uint8_images(_images(pipe, [3]).raw)[0]
    assert np.abs(np.asarray(frames[0], dtype=int) - np.asarray(first, dtype=int)).max() <= 1
    second = to_uint8_images(_images(pipe, [9]).raw)[0]
    assert np.abs(np.asarray(frames[4], dtype=int) - np.asarray(second, dtype=int)).max() <= 1
    gif = write_animation(frames, tmp_path / "a.gif")
    assert Image.open(gif).n_frames == 8
    mp4 = write_animation(frames, tmp_path / "a.mp4")
    assert mp4.stat().st_size > 1000
    with pytest.raises(InputError, match="at least two seeds"):
        pipe.interpolate([3], 4, p)
    with pytest.raises(InputError, match=".gif or .mp4"):
        write_animation(frames, tmp_path / "a.avi")


def test_truncation_zero_gives_the_average_image(pipe):
    a, b = _images(pipe, [0, 1], psi=0.0).raw
    assert np.allclose(a, b, atol=1e-5)


def _cancel_at(step: int) -> Job:
    """A job that presses Stop when batch `step` reports (as Stop pressed while batch `step + 1` runs)."""
    job = Job(on_progress=lambda ev: ev.step == step and job.cancel())
    return job


def test_stop_keeps_the_finished_batches(pipe):
    req = GenerationRequest("stylegan", None, StyleGANParams(seeds=tuple(range(10, 20)), batch_size=3))
    full = pipe.generate(req, Job())
    for k in (1, 2, 3):                       # 4 batches of 3, 3, 3, 1
        part = pipe.generate(req, _cancel_at(k))
        assert part.cancelled and len(part.images) == 3 * k and part.raw.shape[0] == 3 * k
        assert [m["seed"] for m in part.metadata] == list(range(10, 10 + 3 * k))
        np.testing.assert_allclose(part.raw, full.raw[:3 * k], rtol=0, atol=1e-6)   # the same batches
        assert part.notes == [f"stopped after {3 * k} of 10 images"]
        assert "synthesis" in part.timings_ms and "postprocess" in part.timings_ms
    # a Stop that lands during the last batch is too late to stop anything: the job is done
    last = pipe.generate(req, _cancel_at(4))
    assert not last.cancelled and len(last.images) == 10 and not last.notes
    assert not full.cancelled


def test_stop_before_the_first_batch_keeps_nothing(pipe):
    from core.errors import Cancelled

    job = Job()
    job.cancel()
    with pytest.raises(Cancelled):
        pipe.generate(GenerationRequest("stylegan", None, StyleGANParams(seeds=(0, 1), batch_size=1)), job)
