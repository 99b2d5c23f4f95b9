"""Class-conditional training (NVlabs --cond): labels file, conditional G and D, resume, export, generation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from models.stylegan import load_generator
from tests.test_training_runs import write_tiny_dataset
from training import checkpoint as ckpt
from training import cli
from training.config import TrainConfig
from training.dataset import ImageBatches, load_labels
from training.export import export_run
from training.trainer import _mix, build_networks

EMOJI_LABELS = "assets/datasets/emoji64_labels.json"


def _labels_file(folder, labels, key="group", names=None):
    doc = {key: [int(v) for v in labels]}
    if names is not None:
        doc[key + "s"] = names
    path = folder / "labels.json"
    path.write_text(json.dumps(doc))
    return path


def test_emoji_labels_load_for_both_keys():
    groups, gnames = load_labels(EMOJI_LABELS, "group", 3916)
    classes, cnames = load_labels(EMOJI_LABELS, "class", 3916)
    assert len(gnames) == 10 and "Flags" in gnames and len(cnames) == 98
    assert groups.dtype == np.int64 and groups.shape == (3916,) and 0 <= groups.min() and groups.max() < 10
    assert classes.max() < 98 and len(np.unique(groups)) >= 9


@pytest.mark.parametrize("doc, key, msg", [
    ({"group": [0, 1]}, "group", "one class index per image"),
    ({"group": [0, 1, -1, 0]}, "group", "whole numbers >= 0"),
    ({"group": [0, 1, 1.5, 0]}, "group", "whole numbers >= 0"),
    ({"group": [0, 0, 0, 0]}, "group", "a single class"),
    ({"group": [0, 1, 2, 0], "groups": ["a", "b"]}, "group", "names 2 classes"),
    ({"group": [0, 1, 1, 0], "other": [1]}, "class", "lists in it: group, other"),
])
def test_bad_labels_files_are_clear_errors(tmp_path, doc, key, msg):
    path = tmp_path / "l.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=msg):
        load_labels(path, key, 4)


def test_missing_labels_file_and_cond_without_labels(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_labels(tmp_path / "nope.json", "group", 4)
    data = write_tiny_dataset(tmp_path)
    rc = cli.main(["--config", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
                   "--kimg", "0.016", "--cond", "group"])
    assert rc == 2 and not (tmp_path / "o" / "state.json").exists()


def test_batches_carry_the_labels_of_their_images():
    n = 10
    images = np.zeros((n, 4, 4, 3), np.uint8)
    images[..., 0] = np.arange(n)[:, None, None]       # each image says which one it is (mirrored too)
    labels = (np.arange(n) * 7) % 3
    for mirror in (False, True):
        loader = ImageBatches(images, 4, torch.device("cpu"), seed=3, mirror=mirror, labels=labels)
        for _ in range(6):
            x, lab = loader.next_labeled()
            ids = x[:, 0, 0, 0].long()
            assert torch.equal(lab, torch.from_numpy(labels)[ids])
    plain = ImageBatches(images, 4, torch.device("cpu"), seed=3)
    assert plain.next_labeled()[1] is None
    with pytest.raises(InputError, match="3 labels for 10 images"):
        ImageBatches(images, 4, torch.device("cpu"), labels=labels[:3])


def test_conditional_run_trains_resumes_and_exports(tmp_path):
    data = write_tiny_dataset(tmp_path, 24, 16)
    labels = np.arange(24) % 3
    lab_path = _labels_file(tmp_path, labels, "group", ["red", "green", "blue"])
    run = tmp_path / "run"
    base = ["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
            "--cond", "group", "--labels", str(lab_path), "--snapshot-ema"]
    assert cli.main([*base, "--kimg", "0.032"]) == 0

    doc, tensors = ckpt.load_checkpoint(run)
    cfg = TrainConfig.from_dict(doc["config"])
    assert cfg.c_dim == 3 and cfg.cond == "group"
    assert doc["classes"] == {"key": "group", "names": ["red", "green", "blue"]}
    G, D = build_networks(cfg)
    assert G.c_dim == 3 and D.c_dim == 3
    # the label embeddings of G's mapping and D's conditioning moved from their initial values (the trainer's
    # initial weights come from this seed): the labels reached both networks' training
    moved_g = [k for k in tensors["G"] if "embed" in k]
    moved_d = [k for k in tensors["D"] if k.startswith("mapping.")]
    assert moved_g and moved_d
    torch.manual_seed(_mix(cfg.seed, 0x6E7))
    G_init, D_init = build_networks(cfg)
    init_g, init_d = G_init.state_dict(), D_init.state_dict()
    assert any(not torch.equal(tensors["G"][k].float(), init_g[k].float()) for k in moved_g)
    assert any(not torch.equal(tensors["D"][k].float(), init_d[k].float()) for k in moved_d)

    # resume continues with the same labels; a labels file with another class count is refused
    assert cli.main([*base, "--kimg", "0.048", "--resume", str(run)]) == 0
    assert json.loads((run / "state.json").read_text())["kimg"] == pytest.approx(0.048)
    other = tmp_path / "other"
    other.mkdir()
    four = _labels_file(other, np.arange(24) % 4, "group")
    assert cli.main([*base[:-3], "--labels", str(four), "--kimg", "0.064", "--resume", str(run)]) == 2

    # export: the file is conditional, names its classes, and the studio's loader generates per class
    paths = export_run(run, tmp_path / "models" / "mine", grid_path=tmp_path / "grid.png")
    meta = json.loads(paths["config"].read_text())
    assert meta["init_kwargs"]["c_dim"] == 3
    assert json.dumps(meta).count("green") == 1
    loaded = load_generator(paths["weights"])
    assert loaded.G.c_dim == 3
    z = torch.from_numpy(np.random.RandomState(5).randn(1, loaded.G.z_dim)).float()
    with torch.no_grad():
        imgs = [loaded.G(z, torch.nn.functional.one_hot(torch.tensor([k]), 3).float(), noise_mode="const")
                for k in range(3)]
    assert all(torch.isfinite(i).all() for i in imgs)
    assert not torch.allclose(imgs[0], imgs[1], atol=1e-4)     # the class changes the picture
    snaps = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))
    assert snaps and load_generator(snaps[-1]).G.c_dim == 3

    # the studio's CLI: with a class every seed uses it; without one seed s uses class s % 3 (so seed 4 without
    # a class is seed 4 with class 1); a class out of range is an error that lists the classes by name
    import subprocess
    import sys

    from core.settings import ROOT

    def gen(out, *extra):
        return subprocess.run([sys.executable, "app.py", "generate", "--backend", "stylegan", "--model",
                               str(paths["weights"]), "--seeds", "3-4", "--out", str(tmp_path / out), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    for out, extra in (("cls1.npy", ("--class-index", "1")), ("none.npy", ()), ("cls1.png", ("--class-index", "1"))):
        r = gen(out, *extra)
        assert r.returncode == 0, r.stderr[-500:]
    with_class, without = np.load(tmp_path / "cls1.npy"), np.load(tmp_path / "none.npy")
    assert np.allclose(with_class[1], without[1], atol=1e-5)          # seed 4: 4 % 3 = 1
    assert not np.allclose(with_class[0], without[0], atol=1e-3)      # seed 3: class 0, not 1
    bad = gen("bad.png", "--class-index", "3")
    assert bad.returncode != 0 and "0 red, 1 green, 2 blue" in bad.stderr


def test_strip_and_grid_of_a_conditional_model_show_its_classes(tmp_path):
    """scripts/snapshot_strip.py and the trainer's grid give seed s class s % c_dim (they failed on c = None)."""
    import importlib.util

    from PIL import Image

    from core.settings import ROOT
    from models import stylegan2
    from models.stylegan import save_generator
    from training.trainer import grid_labels

    torch.manual_seed(3)
    G = stylegan2.Generator(z_dim=8, c_dim=4, w_dim=8, img_resolution=16, img_channels=3,
                            mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
    save_generator(G, tmp_path / "snaps" / "G_ema-000200kimg.safetensors", "stylegan2", dtype="fp16",
                   metadata={"kimg": 200})
    spec = importlib.util.spec_from_file_location("snapshot_strip", ROOT / "scripts" / "snapshot_strip.py")
    strip = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(strip)
    png = tmp_path / "strip.png"
    assert strip.main([str(tmp_path / "snaps"), str(png), "--device", "cpu", "--seeds", "5"]) == 0
    assert np.asarray(Image.open(png)).shape[0] == 16
    c = grid_labels(4, 6, 3)
    assert c.argmax(1).tolist() == [2, 3, 0] and grid_labels(0, 0, 3) is None


def test_conditional_wgan_gp_runs(tmp_path):
    """WGAN-GP's gradient penalty calls D on interpolates: a conditional D gets the real images' labels there."""
    data = write_tiny_dataset(tmp_path, 24, 16)
    lab = _labels_file(tmp_path, np.arange(24) % 2, "group")
    run = tmp_path / "w"
    assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
                     "--kimg", "0.016", "--loss", "wgan-gp", "--d-steps", "2", "--cond", "group",
                     "--labels", str(lab)]) == 0
    logs = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "train" and np.isfinite(r["gp"]) for r in logs)


# ---------------------------------------------------------------------------------------------
# NVlabs' dataset.json (what their dataset_tool writes into a folder or .zip)


def _nvlabs_folder(root, n=12, res=16, as_zip=False, labels_of=None):
    """PNGs under 00000/ as dataset_tool names them, each filled with its class's colour, and dataset.json
    listing [name, class] in reverse order (matching must go by name, not position)."""
    import zipfile
    from PIL import Image

    labels_of = labels_of or (lambda i: i % 3)
    folder = root / "nvlabs"
    (folder / "00000").mkdir(parents=True)
    entries = []
    for i in range(n):
        name = f"00000/img{i:08d}.png"
        c = labels_of(i)
        Image.new("RGB", (res, res), (80 * c if isinstance(c, int) else 0, 0, 0)).save(folder / name)
        entries.append([name, c])
    (folder / "dataset.json").write_text(json.dumps({"labels": entries[::-1]}))
    if not as_zip:
        return folder
    z = root / "nvlabs.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(folder).as_posix())
    return z


@pytest.mark.parametrize("as_zip", [False, True], ids=["folder", "zip"])
def test_nvlabs_dataset_json_is_matched_to_the_images_by_name(tmp_path, as_zip):
    from training.dataset import image_names, load_images, nvlabs_labels_source

    data = _nvlabs_folder(tmp_path, as_zip=as_zip)
    source = nvlabs_labels_source(data)
    assert source == (f"{data}!dataset.json" if as_zip else str(data / "dataset.json"))
    names = image_names(data)
    images, _ = load_images(data)
    labels, class_names = load_labels(source, "anything", len(images), names=names)
    assert class_names == ["0", "1", "2"] and labels.tolist() == [i % 3 for i in range(12)]
    # each image's red channel says its class: the labels belong to the pixels they were written for
    # (a lossless PNG fill of 80·class; compared with a margin rather than exactly)
    assert np.abs(images[:, 0, 0, 0].astype(np.int64) - 80 * labels).max() <= 2


@pytest.mark.parametrize("doc, names, msg", [
    ({"labels": None}, ["a.png"], "unlabeled"),
    ({"labels": [["a.png", 0], ["b.png", 1]]}, ["a.png", "b.png", "c.png"], "no label for 1 of the 3 images, e.g. 'c.png'"),
    ({"labels": [["a.png", [0.5, 0.5]], ["b.png", [1.0, 0.0]]]}, ["a.png", "b.png"], "label vector"),
    ({"labels": [["a.png", 0], ["b.png", 0]]}, ["a.png", "b.png"], "a single class"),
    ({"labels": [["a.png", 0], ["b.png", 1]]}, None, "an array data set has none"),
    ({"labels": [["a.png", 0], "b.png"]}, ["a.png"], r"\[file name, class index\]"),
])
def test_bad_nvlabs_labels_are_clear_errors(tmp_path, doc, names, msg):
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=msg):
        load_labels(path, "group", len(names or [0, 0]), names=names)


def test_cond_without_labels_trains_on_the_data_sets_own_dataset_json(tmp_path):
    """NVlabs users' habit: --cond with the labels inside the data set; no --labels needed."""
    data = _nvlabs_folder(tmp_path, n=16)
    run = tmp_path / "run"
    assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
                     "--cond", "label", "--kimg", "0.016"]) == 0
    doc, _ = ckpt.load_checkpoint(run)
    assert TrainConfig.from_dict(doc["config"]).c_dim == 3
    assert doc["classes"] == {"key": "label", "names": ["0", "1", "2"]}
    # without dataset.json and without --labels: refused before training, naming both ways out
    (data / "dataset.json").unlink()
    with pytest.raises(InputError, match="dataset.json inside the data folder"):
        from training.config import validate
        validate(TrainConfig(data=str(data), cond="label"))
