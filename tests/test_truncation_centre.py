"""Class-centred truncation (models/class_centres.py): a class-conditional model's ψ pulls w towards the class's own
mean w by default, or towards the global running mean w_avg (NVlabs' truncation) on request; an unconditional model
always takes the global mean. On the bundled 98-class emoji model, an NVlabs conditional pickle and a tiny
conditional StyleGAN3."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InputError
from core.types import GenerationRequest, Job, OptimizationFlags, StyleGANParams
from models import class_centres as cc
from models.common import seed_class_labels
from models.stylegan import load_generator, save_generator
from pipelines.stylegan import StyleGANPipeline, seed_to_z

ROOT = Path(__file__).resolve().parent.parent
EMOJI = ROOT / "assets" / "models" / "emoji64.safetensors"
SEEDS = (0, 1, 2, 3, 11, 20)          # classes 0, 1, 2, 3, 11 (heart), 20 when no class is chosen


@pytest.fixture(scope="module")
def emoji():
    return StyleGANPipeline(load_generator(EMOJI), OptimizationFlags(), torch.device("cpu"))


def _generate(pipe, seeds=SEEDS, batch=8, **kw):
    p = StyleGANParams(seeds=tuple(seeds), batch_size=batch, **kw)
    return pipe.generate(GenerationRequest("stylegan", None, p, OptimizationFlags()), Job())


def _old_call(G, seeds, psi, class_index=None, cutoff=None):
    """What the pipeline did before the option existed: G(z, c, ψ) towards w_avg."""
    z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in seeds]))
    if class_index is None:
        c = seed_class_labels(G.c_dim, seeds)
    else:
        c = torch.zeros([len(seeds), G.c_dim])
        c[:, class_index] = 1
    with torch.no_grad():
        return G(z, c, truncation_psi=psi, truncation_cutoff=cutoff, noise_mode="const").numpy()


# -- the centres ------------------------------------------------------------------------------------
def test_centres_are_deterministic_per_class_and_distinct():
    a, b = load_generator(EMOJI), load_generator(EMOJI)
    ca, cb = a.class_centres(), b.class_centres()
    one = ca([0, 11, 32])
    assert one.shape == (3, 256) and one.dtype == torch.float32 and ca.computed() == [0, 11, 32]
    # another load, the classes asked for in another order and with others: the same centres
    other = cb([32, 5, 0, 11])
    torch.testing.assert_close(other[[2, 3, 0]], one, rtol=0, atol=1e-6)
    # repeats come back as rows (one per image of a batch)
    torch.testing.assert_close(ca([11, 11, 0]), torch.stack([one[1], one[1], one[0]]))
    # every class has its own centre, and none is the global mean
    every = cb.all()
    assert every.shape == (98, 256) and cb.computed() == list(range(98))
    dist = torch.cdist(every, every) + torch.eye(98) * 1e9
    spread = every.std(0).norm()
    assert float(dist.min()) > 0.05 * float(spread), float(dist.min())
    w_avg = b.G.mapping.w_avg
    assert float((every - w_avg).norm(dim=1).min()) > 0.05 * float(spread)


def test_a_centre_is_the_class_mean_w():
    G = load_generator(EMOJI).G
    got = cc.class_centres(G.mapping, [11])[0]
    # the mean over other latents agrees to within the sampling error of 1,024 draws
    z = torch.randn([4096, G.z_dim], generator=torch.Generator().manual_seed(123))
    c = torch.zeros([4096, G.c_dim])
    c[:, 11] = 1
    with torch.no_grad():
        w = G.mapping(z, c, truncation_psi=1)[:, 0]
    err = (got - w.mean(0)).norm() / w.std(0).norm()
    assert float(err) < 0.1, float(err)
    # chunked the same as in one batch, up to float rounding
    torch.testing.assert_close(cc.class_centres(G.mapping, [11], chunk=100)[0], got, rtol=1e-5, atol=1e-5)


def test_the_centres_are_kept_with_the_loaded_model(monkeypatch):
    """One computation per class per load, however many requests draw it."""
    calls = []
    real = cc.class_centres
    monkeypatch.setattr(cc, "class_centres", lambda mapping, classes, **kw: calls.append(list(classes))
                        or real(mapping, classes, **kw))
    pipe = StyleGANPipeline(load_generator(EMOJI), OptimizationFlags(), torch.device("cpu"))
    _generate(pipe, seeds=(0, 1), truncation_psi=0.7)
    _generate(pipe, seeds=(1, 0, 99), truncation_psi=0.5)       # 99 % 98 = class 1
    _generate(pipe, seeds=(2,), truncation_psi=0.7)
    _generate(pipe, seeds=(5, 6), truncation_psi=0.7, class_index=0)
    assert calls == [[0, 1], [2]]
    assert pipe.loaded.class_centres() is pipe.loaded.class_centres()
    assert _generate(pipe, seeds=(4,), truncation_psi=1.0).metadata[0]["truncation_centre"] == "class"
    assert calls == [[0, 1], [2]]                               # ψ = 1: no centre needed, none computed


# -- the pipeline ---------------------------------------------------------------------------------------
def test_global_centre_reproduces_the_old_images(emoji):
    G = emoji.loaded.G
    got = _generate(emoji, truncation_psi=0.7, truncation_centre="global")
    np.testing.assert_allclose(got.raw, _old_call(G, SEEDS, 0.7), rtol=0, atol=1e-5)
    assert {m["truncation_centre"] for m in got.metadata} == {"global"}
    got = _generate(emoji, truncation_psi=0.6, truncation_centre="global", class_index=11, truncation_cutoff=4,
                    batch=4)
    np.testing.assert_allclose(got.raw, _old_call(G, SEEDS, 0.6, class_index=11, cutoff=4), rtol=0, atol=1e-5)


def test_class_centre_moves_the_image_below_psi_one_and_not_at_one(emoji):
    G = emoji.loaded.G
    cls, glob = (_generate(emoji, truncation_psi=0.7, truncation_centre=c).raw for c in ("class", "global"))
    assert np.abs(cls - glob).mean() > 0.02
    assert _generate(emoji, truncation_psi=0.7).metadata[0]["truncation_centre"] == "class"   # the default
    one_c, one_g = (_generate(emoji, truncation_psi=1.0, truncation_centre=c).raw for c in ("class", "global"))
    np.testing.assert_allclose(one_c, one_g, rtol=0, atol=1e-6)
    np.testing.assert_allclose(one_c, _old_call(G, SEEDS, 1.0), rtol=0, atol=1e-5)
    # the class-centred image is the w_avg one with the class centre in w_avg's place
    classes = [s % 98 for s in SEEDS]
    centre = emoji.loaded.class_centres()(classes)
    z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in SEEDS]))
    with torch.no_grad():
        ws = G.mapping(z, seed_class_labels(98, SEEDS), truncation_psi=1)
        want = G.synthesis(centre[:, None].lerp(ws, 0.7), noise_mode="const").numpy()
    np.testing.assert_allclose(cls, want, rtol=0, atol=1e-5)


def test_psi_zero_draws_each_class_average(emoji):
    """At ψ = 0 every seed of a class gives the class's centre image, and classes differ."""
    heart = _generate(emoji, seeds=(5, 6, 7), truncation_psi=0.0, class_index=11).raw
    np.testing.assert_allclose(heart[1:], np.repeat(heart[:1], 2, axis=0), rtol=0, atol=1e-5)
    hand = _generate(emoji, seeds=(5,), truncation_psi=0.0, class_index=16).raw
    assert np.abs(heart[0] - hand[0]).mean() > 0.05
    # the global centre draws one image for every class
    g = _generate(emoji, seeds=(5, 6), truncation_psi=0.0, truncation_centre="global").raw
    np.testing.assert_allclose(g[0], g[1], rtol=0, atol=1e-5)


def test_cutoff_truncates_only_the_first_ws_towards_the_class_centre(emoji):
    G = emoji.loaded.G
    z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in (1, 2)]))
    c = seed_class_labels(98, (1, 2))
    centre = emoji.loaded.class_centres()([1, 2])
    with torch.no_grad():
        full = G.mapping(z, c, truncation_psi=1)
        cut = G.mapping(z, c, truncation_psi=0.5, truncation_cutoff=3, truncation_centre=centre)
    torch.testing.assert_close(cut[:, 3:], full[:, 3:], rtol=0, atol=1e-6)
    torch.testing.assert_close(cut[:, :3], centre[:, None].lerp(full[:, :3], 0.5), rtol=0, atol=1e-6)
    # through the pipeline: the cutoff applies with the class centre too
    a = _generate(emoji, seeds=(1, 2), truncation_psi=0.5, truncation_cutoff=3).raw
    with torch.no_grad():
        want = G.synthesis(cut, noise_mode="const").numpy()
    np.testing.assert_allclose(a, want, rtol=0, atol=1e-5)


def test_style_mix_and_interpolation_take_the_class_centre(emoji):
    p = StyleGANParams(seeds=(0,), truncation_psi=0.7, class_index=11)
    _grid, raw = emoji.style_mix([1], [5, 6], (0, 4), p)
    plain = _generate(emoji, seeds=(5, 6), truncation_psi=0.7, class_index=11).raw
    np.testing.assert_allclose(raw[1:3], plain, rtol=0, atol=1e-5)          # the header row: plain column images
    frames = emoji.interpolate([5, 6], 2, p)
    first = np.asarray(frames[0], dtype=int)
    from pipelines.base import to_uint8_images
    want = np.asarray(to_uint8_images(torch.from_numpy(plain[:1]))[0], dtype=int)
    assert np.abs(first - want).max() <= 1
    zf = emoji.interpolate([5, 6], 2, p, space="z")
    assert np.abs(np.asarray(zf[0], dtype=int) - want).max() <= 1


def test_unconditional_models_ignore_the_option(testdata):
    pipe = StyleGANPipeline(load_generator(testdata / "stylegan" / "sg2_uncond_32.pkl"), OptimizationFlags(),
                            torch.device("cpu"))
    a, b = (_generate(pipe, seeds=(0, 1, 2), truncation_psi=0.7, truncation_centre=c) for c in ("class", "global"))
    np.testing.assert_allclose(a.raw, b.raw, rtol=0, atol=1e-6)
    np.testing.assert_allclose(a.raw, _old_call(pipe.loaded.G, (0, 1, 2), 0.7), rtol=0, atol=1e-5)
    assert {m["truncation_centre"] for m in a.metadata + b.metadata} == {"global"}
    with pytest.raises(InputError, match="unconditional"):
        pipe.loaded.class_centres()


def test_nvlabs_conditional_pickle(testdata):
    """A conditional NVlabs pickle goes through the same loader and the same centres."""
    pipe = StyleGANPipeline(load_generator(testdata / "stylegan" / "sg2_cond4_64_fp16.pkl"), OptimizationFlags(),
                            torch.device("cpu"))
    centres = pipe.loaded.class_centres().all()
    assert centres.shape == (4, pipe.loaded.G.w_dim) and torch.isfinite(centres).all()
    assert float(torch.pdist(centres).min()) > 0
    g = _generate(pipe, seeds=(0, 1, 2, 3), truncation_psi=0.5, truncation_centre="global")
    np.testing.assert_allclose(g.raw, _old_call(pipe.loaded.G, (0, 1, 2, 3), 0.5), rtol=0, atol=1e-5)
    c = _generate(pipe, seeds=(0, 1, 2, 3), truncation_psi=0.5)
    assert np.abs(c.raw - g.raw).mean() > 1e-3 and c.metadata[0]["truncation_centre"] == "class"


def test_stylegan3_conditional_mapping_shares_the_interface(tmp_path):
    from models.stylegan3 import Generator

    torch.manual_seed(0)
    G = Generator(z_dim=8, c_dim=3, w_dim=8, img_resolution=16, img_channels=3, channel_base=64, channel_max=8,
                  num_layers=4, num_critical=1, margin_size=2, mapping_kwargs={"num_layers": 2}).eval()
    with torch.no_grad():                       # a w_avg away from zero, as a trained model has
        G.mapping.w_avg.copy_(torch.randn(8))
    path = save_generator(G, tmp_path / "sg3c.safetensors", "stylegan3")
    pipe = StyleGANPipeline(load_generator(path), OptimizationFlags(), torch.device("cpu"))
    centres = pipe.loaded.class_centres().all()
    assert centres.shape == (3, 8) and float(torch.pdist(centres).min()) > 0
    z = torch.from_numpy(np.concatenate([seed_to_z(s, 8) for s in (0, 1)]))
    c = seed_class_labels(3, (0, 1))
    with torch.no_grad():
        ws = pipe.loaded.G.mapping(z, c, truncation_psi=0.5, truncation_cutoff=2, truncation_centre=centres[:2])
        full = pipe.loaded.G.mapping(z, c, truncation_psi=1)
    torch.testing.assert_close(ws[:, :2], centres[:2, None].lerp(full[:, :2], 0.5), rtol=0, atol=1e-6)
    torch.testing.assert_close(ws[:, 2:], full[:, 2:], rtol=0, atol=1e-6)
    g = _generate(pipe, seeds=(0, 1), truncation_psi=0.5, truncation_centre="global")
    np.testing.assert_allclose(g.raw, _old_call(pipe.loaded.G, (0, 1), 0.5), rtol=0, atol=1e-5)
    k = _generate(pipe, seeds=(0, 1), truncation_psi=0.5)
    assert np.abs(k.raw - g.raw).mean() > 1e-4


# -- bad values ---------------------------------------------------------------------------------------
def test_bad_centres_are_clear_input_errors(emoji):
    for bad in ("middle", "", None, 1):
        with pytest.raises(InputError, match="truncation centre must be 'class' .* or 'global'"):
            StyleGANParams(seeds=(0,), truncation_centre=bad)
    assert StyleGANParams(seeds=(0,), truncation_centre=" Global ").truncation_centre == "global"
    from ui.controls import job_spec
    with pytest.raises(InputError, match="truncation centre"):
        job_spec({"backend": "stylegan", "seed": "0", "truncation_centre": "mean"})
    assert job_spec({"backend": "stylegan", "seed": "0"}).request.params.truncation_centre == "class"
    G = emoji.loaded.G
    z, c = torch.zeros([2, G.z_dim]), seed_class_labels(98, (0, 1))
    with pytest.raises(InputError, match=r"truncation centre has shape \[3, 256\]"):
        G(z, c, truncation_psi=0.7, truncation_centre=torch.zeros([3, 256]))
    with pytest.raises(InputError, match="out of range"):
        emoji.loaded.class_centres()([98])


# -- the CLI, the metadata, the studio --------------------------------------------------------------------
def _cli(*args):
    p = subprocess.run([sys.executable, "app.py", "generate", *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_cli_flag_reaches_the_image_metadata_and_reproduces(tmp_path):
    from core.pnginfo import read_png_params

    glob, cls = tmp_path / "global.png", tmp_path / "class.png"
    rc, _, se = _cli("--backend", "stylegan", "--seeds", "11", "--truncation", "0.7", "--truncation-centre", "global",
                     "--out", glob, "--quiet")
    assert rc == 0, se
    meta = read_png_params(glob)
    assert meta["truncation_centre"] == "global" and meta["truncation_psi"] == 0.7
    assert "Truncation centre: global" in Image.open(glob).text["parameters"]
    rc, _, se = _cli("--backend", "stylegan", "--seeds", "11", "--truncation", "0.7", "--out", cls, "--quiet")
    assert rc == 0, se
    assert read_png_params(cls)["truncation_centre"] == "class"               # the default for a conditional model
    # a visible change, not rounding: the mean pixel moves by more than one level of 255
    diff = np.abs(np.asarray(Image.open(glob), dtype=np.int16) - np.asarray(Image.open(cls), dtype=np.int16))
    assert diff.mean() > 1.0, diff.mean()
    again = tmp_path / "again.png"
    rc, _, se = _cli("--from-png", glob, "--out", again, "--quiet")
    assert rc == 0, se
    # the same image again, within one level of 255 (a separate process: no exact equality across runs)
    again_diff = np.abs(np.asarray(Image.open(again), dtype=np.int16) - np.asarray(Image.open(glob), dtype=np.int16))
    assert again_diff.max() <= 1, again_diff.max()
    rc, _, se = _cli("--backend", "stylegan", "--seeds", "0", "--truncation-centre", "middle",
                     "--out", tmp_path / "bad.png", "--quiet")
    lines = [ln for ln in se.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "truncation centre must be 'class'" in lines[0], se
    assert not (tmp_path / "bad.png").exists()


def test_an_image_saved_before_the_option_reproduces_with_the_global_centre(tmp_path):
    """A PNG without `truncation_centre` was truncated towards w_avg: --from-png and Send back keep that."""
    import argparse

    from cli.generate import _request_from_png, build_parser
    from core.pnginfo import save_png
    from ui.controls import controls_from_params

    old = {"backend": "stylegan", "model": str(EMOJI), "seed": 11, "truncation_psi": 0.7, "class_index": 11,
           "noise_mode": "const"}
    png = save_png(Image.new("RGB", (8, 8)), tmp_path / "old.png", old)
    a = build_parser().parse_args(["--from-png", str(png)])
    assert isinstance(a, argparse.Namespace)
    assert _request_from_png(str(png), a, OptimizationFlags()).params.truncation_centre == "global"
    assert controls_from_params(old)["truncation_centre"] == "global"
    assert controls_from_params({**old, "truncation_centre": "class"})["truncation_centre"] == "class"
    a = build_parser().parse_args(["--from-png", str(png), "--truncation-centre", "class"])   # asked for: wins
    assert _request_from_png(str(png), a, OptimizationFlags()).params.truncation_centre == "class"


def test_studio_jobs_record_the_centre(tmp_path):
    """The studio's paths: images, style mixing and interpolation all record the centre they used."""
    from core.pnginfo import read_png_params
    from core.settings import Settings
    from pipelines.services import build_services
    from ui.controls import job_spec
    from ui.runner import StudioRuntime
    from ui.state import SessionState

    settings = Settings(models_dirs=(), extra_models=(), output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    rt = StudioRuntime(build_services(settings))
    for extra, want in (({}, "class"), ({"truncation_centre": "global"}, "global"),
                        ({"sg_mode": "style-mix", "mix_rows": "1", "mix_cols": "2", "mix_from": 0, "mix_to": 4},
                         "class"),
                        ({"sg_mode": "interpolate", "seed": "3,4", "frames_per_seed": 2}, "class")):
        spec = job_spec({"backend": "stylegan", "seed": "3", "truncation_psi": 0.7, "sg_batch_size": 1, **extra},
                        "cpu")
        last = list(rt.run(SessionState(), spec))[-1]
        assert last.done and last.error is None, last.message
        assert last.items[0].params["truncation_centre"] == want, extra
        if last.items[0].path.endswith(".png"):
            assert read_png_params(last.items[0].path)["truncation_centre"] == want
