"""Choosing the class of a class-conditional StyleGAN by name: the bundled emoji64 model is conditional on the 98
Unicode emoji subgroups, and its file names them, so `--class face-smiling` (or the studio's Class box) works
as well as an index."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.errors import InputError
from core.types import StyleGANParams
from models.common import resolve_class
from ui.controls import stylegan_params

ROOT = Path(__file__).resolve().parent.parent
EMOJI = ROOT / "assets" / "models" / "emoji64.safetensors"
NAMES = ["Smileys & Emotion/face-smiling", "Smileys & Emotion/face-hand", "Animals & Nature/animal-mammal",
         "Animals & Nature/animal-bird"]


@pytest.mark.parametrize("spec,want", [
    (None, None), (2, 2), ("3", 3), (" 1 ", 1),
    ("Animals & Nature/animal-bird", 3),        # the full name
    ("FACE-HAND", 1),                           # its last part, any case
    ("mammal", 2),                              # a piece of exactly one name
])
def test_resolve_class_by_index_or_name(spec, want):
    assert resolve_class(spec, len(NAMES), NAMES) == want


@pytest.mark.parametrize("spec,c_dim,names,needle", [
    ("animal", 4, NAMES, "matches 2 classes"),
    ("facehand", 4, NAMES, "did you mean face-hand"),
    ("zebra", 4, NAMES, "no class of this model is called 'zebra'"),
    (4, 4, NAMES, r"out of range: this model has 4 classes \(0..3\)"),
    (-1, 4, NAMES, "out of range"),
    ("mammal", 4, [], "names no classes"),
    (0, 0, [], "unconditional"),
    ("mammal", 0, [], "unconditional"),
])
def test_resolve_class_errors_say_what_exists(spec, c_dim, names, needle):
    with pytest.raises(InputError, match=needle):
        resolve_class(spec, c_dim, names)


def test_params_and_class_box_keep_names_and_indices():
    assert StyleGANParams(seeds=(0,), class_index="7").class_index == 7
    assert StyleGANParams(seeds=(0,), class_index=" face-hand ").class_index == "face-hand"
    assert StyleGANParams(seeds=(0,), class_index="  ").class_index is None
    with pytest.raises(InputError, match="whole number"):
        StyleGANParams(seeds=(0,), class_index=1.5)
    assert stylegan_params("0-3", 0.7, "", "const", "face-smiling", 4).class_index == "face-smiling"
    assert stylegan_params("0-3", 0.7, "", "const", "12", 4).class_index == 12
    assert stylegan_params("0-3", 0.7, "", "const", "", 4).class_index is None


def _pipe():
    from core.types import OptimizationFlags
    from models.stylegan import load_generator
    from pipelines.stylegan import StyleGANPipeline

    import torch

    return StyleGANPipeline(load_generator(EMOJI, device="cpu"), OptimizationFlags(), torch.device("cpu"))


def test_bundled_model_generates_a_named_class():
    from core.types import GenerationRequest, Job

    pipe = _pipe()
    names = pipe.class_names()
    assert len(names) == pipe.loaded.G.c_dim == 98 and names[0].endswith("/face-smiling")
    k = names.index(next(n for n in names if n.endswith("/animal-mammal")))
    flags = pipe.flags

    def run(cls):
        p = StyleGANParams(seeds=(5, 6), truncation_psi=0.7, class_index=cls, batch_size=2)
        return pipe.generate(GenerationRequest("stylegan", None, p, flags), Job())

    by_name, by_index, by_seed = run("animal-mammal"), run(k), run(None)
    assert [m["class_index"] for m in by_name.metadata] == [k, k]
    assert [m["class_name"] for m in by_name.metadata] == [names[k]] * 2
    np.testing.assert_allclose(by_name.raw, by_index.raw, atol=1e-5)
    # without a class, seed s draws class s % 98, and a different class is a different picture
    assert [m["class_index"] for m in by_seed.metadata] == [5, 6]
    assert np.abs(by_seed.raw - by_name.raw).mean() > 0.05
    with pytest.raises(InputError, match="did you mean"):
        run("animal-mamal")


def test_cli_class_by_name_and_a_clear_error(tmp_path):
    out = tmp_path / "smiles.png"
    p = subprocess.run([sys.executable, "app.py", "generate", "--backend", "stylegan", "--seeds", "0-1",
                        "--class", "face-smiling", "--truncation", "0.7", "--out", str(out), "--quiet"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    meta = json.loads(Image.open(out).text["atelier"])
    assert meta["class_index"] == 0
    p = subprocess.run([sys.executable, "app.py", "generate", "--backend", "stylegan", "--seeds", "0",
                        "--class", "no-such-emoji", "--out", str(tmp_path / "x.png"), "--quiet"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "no class of this model is called 'no-such-emoji'" in p.stderr
    assert not (tmp_path / "x.png").exists()


def test_class_sheet_draws_one_labelled_panel_per_class(tmp_path):
    """scripts/class_sheet.py: a panel per class, the same seeds in each, so panels differ only by class."""
    import importlib.util

    import torch

    from models import stylegan2
    from models.stylegan import save_generator

    torch.manual_seed(3)
    G = stylegan2.Generator(z_dim=8, c_dim=5, w_dim=8, img_resolution=16, img_channels=3,
                            mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
    model = save_generator(G, tmp_path / "cond.safetensors", "stylegan2",
                           metadata={"classes": {"key": "class", "names": [f"Group/c{i}" for i in range(5)]}})
    spec = importlib.util.spec_from_file_location("class_sheet", ROOT / "scripts" / "class_sheet.py")
    sheet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sheet)
    png = tmp_path / "sheet.png"
    assert sheet.main([str(model), str(png), "--seeds", "3", "--cols", "2", "--colors", "0"]) == 0
    im = np.asarray(Image.open(png).convert("RGB")).astype(int)
    pad, label_h, res = 6, 14, 16
    assert im.shape == (3 * (res + label_h + pad) + pad, 2 * (3 * res + pad) + pad, 3)   # 5 panels in 3 rows of 2

    def panel(k):
        x0, y0 = pad + (k % 2) * (3 * res + pad), pad + (k // 2) * (res + label_h + pad) + label_h
        return im[y0:y0 + res, x0:x0 + 3 * res]

    assert all(panel(k).std() > 1 for k in range(5))                     # every panel has a picture
    assert np.abs(panel(0) - panel(1)).mean() > 0.5                       # another class, another picture
    assert (im[-pad:, :] == 255).all()                                    # the margin stays white
    # truncated towards each class's own mean w by default; --truncation-centre global: towards w_avg
    assert sheet.main([str(model), str(tmp_path / "g.png"), "--seeds", "3", "--cols", "2", "--colors", "0",
                       "--truncation-centre", "global"]) == 0
    assert np.abs(np.asarray(Image.open(tmp_path / "g.png").convert("RGB")).astype(int) - im).mean() > 0.1
    # --agreement: a metrics JSON of this very file labels each class with its share and draws a bar under it
    import json

    from models.stylegan import load_generator
    sha = load_generator(model, device="cpu").sha256
    per = [{"name": f"Group/c{i}", "n": 10, "top1": t, "most_taken_for": None} for i, t in enumerate((1, .8, .5, .2, 0))]
    doc = {"snapshots": [{"file": str(model), "sha256": sha, "agreement": {"level": "class", "per_class": per}}]}
    (tmp_path / "m.json").write_text(json.dumps(doc))
    assert sheet.main([str(model), str(tmp_path / "a.png"), "--seeds", "3", "--cols", "2", "--colors", "0",
                       "--agreement", str(tmp_path / "m.json")]) == 0
    ag = np.asarray(Image.open(tmp_path / "a.png").convert("RGB")).astype(int)
    for k, share in enumerate((1, .8, .5, .2, 0)):
        x0, y0 = pad + (k % 2) * (3 * res + pad), pad + (k // 2) * (res + label_h + pad)
        bar = ag[y0 + label_h - 1, x0:x0 + 3 * res]
        green = ((bar[:, 1] > 150) & (bar[:, 0] < 100)).mean()
        assert abs(green - share) < 0.05, (k, green, share)
        assert (ag[y0 + label_h:y0 + label_h + res, x0:x0 + 3 * res] == im[y0 + label_h:y0 + label_h + res,
                                                                          x0:x0 + 3 * res]).all()
    doc["snapshots"][0]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match="other model files"):
        sheet.main([str(model), str(tmp_path / "b.png"), "--agreement", str(tmp_path / "other.json")])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InputError, match="not a scripts/emoji_metrics.py result"):
        sheet.main([str(model), str(tmp_path / "b.png"), "--agreement", str(tmp_path / "bad.json")])
    with pytest.raises(InputError, match="unconditional"):
        G0 = stylegan2.Generator(z_dim=8, c_dim=0, w_dim=8, img_resolution=16, img_channels=3,
                                 mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
        sheet.main([str(save_generator(G0, tmp_path / "u.safetensors", "stylegan2")), str(tmp_path / "u.png")])


def test_studio_job_by_class_name_captions_each_image_with_its_class(tmp_path):
    """The studio's path for the Class box: a name in, images captioned and saved with the class they drew."""
    from core.pnginfo import read_png_params
    from core.settings import Settings
    from pipelines.services import build_services
    from ui.controls import job_spec
    from ui.runner import StudioRuntime
    from ui.state import SessionState

    settings = Settings(models_dirs=(), extra_models=(), output_dir=tmp_path / "out", cache_dir=tmp_path / "cache")
    rt = StudioRuntime(build_services(settings))
    spec = job_spec({"backend": "stylegan", "seed": "3-4", "truncation_psi": 0.7, "class_index": "animal-mammal",
                     "sg_batch_size": 2}, "cpu")
    last = list(rt.run(SessionState(), spec))[-1]
    assert last.done and last.error is None, last.message
    assert [it.caption for it in last.items] == ["seed 3 · animal-mammal", "seed 4 · animal-mammal"]
    saved = read_png_params(last.items[0].path)
    assert saved["class_name"] == "Animals & Nature/animal-mammal" and saved["class_index"] == 32
    # a name the model does not have: a clear message, no images
    bad = job_spec({"backend": "stylegan", "seed": "0", "class_index": "unicorn", "sg_batch_size": 1}, "cpu")
    last = list(rt.run(SessionState(), bad))[-1]
    assert last.done and not last.items and "no class of this model is called 'unicorn'" in last.message


def test_class_box_lists_the_models_classes_without_loading_it(tmp_path):
    """The Class dropdown: a conditional Atelier model's classes come from its JSON ("32 · animal-mammal", value
    "32"), an unconditional one says so, a model whose classes are unknown (a pickle not yet run) offers none."""
    from core.settings import Settings
    from models import stylegan2
    from models.stylegan import classes_of_file
    from pipelines.services import build_services
    from models.stylegan import save_generator
    from ui.handlers import class_choices

    c_dim, names = classes_of_file(EMOJI)
    assert c_dim == 98 and len(names) == 98 and names[32] == "Animals & Nature/animal-mammal"
    G0 = stylegan2.Generator(z_dim=8, c_dim=0, w_dim=8, img_resolution=16, img_channels=3,
                             mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
    uncond = save_generator(G0, tmp_path / "u.safetensors", "stylegan2")
    from tests.ui_helpers import SG_COND
    settings = Settings(models_dirs=(), extra_models=(str(uncond), str(SG_COND)), output_dir=tmp_path / "out",
                        cache_dir=tmp_path / "cache")
    services = build_services(settings)
    assert not services.manager.loaded()                              # listing classes loads nothing
    box = class_choices(services, "stylegan", str(EMOJI))
    assert len(box.choices) == 98 and box.choices[32] == ("32 · animal-mammal", "32")
    assert box.value is None and "98 classes" in box.info
    box = class_choices(services, "stylegan", str(uncond))
    assert box.choices == [] and box.info == "unconditional model"
    assert class_choices(services, "diffusion", str(EMOJI)).choices == []
    assert classes_of_file(SG_COND) is None                           # a pickle: no JSON to read before it runs
    box = class_choices(services, "stylegan", str(SG_COND))
    assert box.choices == [] and "type an index" in box.info
    assert not services.manager.loaded()


def test_class_sheet_beside_a_second_model_and_chosen_classes(tmp_path):
    """--beside OTHER --classes LIST: per chosen class, this model's seeds then the other's, under a title line."""
    import importlib.util

    import torch

    from core.errors import InputError
    from models import stylegan2
    from models.stylegan import save_generator

    names = [f"Group/c{i}" for i in range(5)]
    paths = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        G = stylegan2.Generator(z_dim=8, c_dim=5, w_dim=8, img_resolution=16, img_channels=3,
                                mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
        paths.append(save_generator(G, tmp_path / f"m{seed}" / "cond.safetensors", "stylegan2",
                                    metadata={"classes": {"key": "class", "names": names}}))
    spec = importlib.util.spec_from_file_location("class_sheet", ROOT / "scripts" / "class_sheet.py")
    sheet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sheet)
    common = ["--seeds", "2", "--cols", "1", "--colors", "0"]
    png = tmp_path / "beside.png"
    assert sheet.main([str(paths[0]), str(png), "--beside", str(paths[1]), "--classes", "1,c3", *common]) == 0
    im = np.asarray(Image.open(png).convert("RGB")).astype(int)
    pad, label_h, res, gap = 6, 14, 16, 12
    head = label_h + pad
    pw = 2 * 2 * res + gap
    assert im.shape == (head + 2 * (res + label_h + pad) + pad, pw + 2 * pad, 3)        # 2 classes, one column

    def half(row, m):
        x0, y0 = pad + m * (2 * res + gap), head + pad + row * (res + label_h + pad) + label_h
        return im[y0:y0 + res, x0:x0 + 2 * res]

    assert all(half(r, m).std() > 1 for r in (0, 1) for m in (0, 1))      # both models drew both classes
    assert np.abs(half(0, 0) - half(0, 1)).mean() > 0.5                    # another model, another picture
    # the left halves are what the model's own sheet draws for classes 1 and 3
    alone = tmp_path / "alone.png"
    assert sheet.main([str(paths[0]), str(alone), "--classes", "1,3", *common]) == 0
    a = np.asarray(Image.open(alone).convert("RGB")).astype(int)
    for row in (0, 1):
        y0 = pad + row * (res + label_h + pad) + label_h
        assert np.abs(a[y0:y0 + res, pad:pad + 2 * res] - half(row, 0)).max() <= 2     # a rounding step at most
    # models of other classes cannot stand side by side
    torch.manual_seed(5)
    G3 = stylegan2.Generator(z_dim=8, c_dim=3, w_dim=8, img_resolution=16, img_channels=3,
                             mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
    three = save_generator(G3, tmp_path / "three.safetensors", "stylegan2",
                           metadata={"classes": {"key": "class", "names": names[:3]}})
    with pytest.raises(InputError, match="other classes"):
        sheet.main([str(paths[0]), str(tmp_path / "x.png"), "--beside", str(three), *common])
    with pytest.raises(InputError):
        sheet.main([str(paths[0]), str(tmp_path / "x.png"), "--classes", "no-such-class", *common])
