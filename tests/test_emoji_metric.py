"""The emoji metric: labels, the shipped classifier, FD and precision/recall, the snapshot script."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import InputError, ModelLoadError
from evaluation.emoji_metric import (DEFAULT_DATA, DEFAULT_LABELS, DEFAULT_WEIGHTS, EmojiClassifier, class_agreement,
                                     class_map, features, frechet_distance, group_of_class, heads, knn_radii,
                                     load_classifier, load_emoji_dataset, load_labels, precision_recall, predict,
                                     quantize, to_input)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build_emoji_labels  # noqa: E402
import emoji_metrics  # noqa: E402


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return load_emoji_dataset()


@pytest.fixture(scope="module")
def labels() -> dict:
    return load_labels()


@pytest.fixture(scope="module")
def clf():
    return load_classifier()


@pytest.fixture(scope="module")
def subset() -> np.ndarray:
    """A fixed spread of 600 images, so tests stay fast on a busy 2-core machine."""
    return np.random.default_rng(0).choice(3916, 600, replace=False)


# -- labels ---------------------------------------------------------------------------------------

def test_every_image_has_a_consistent_label(labels, images):
    names = json.loads(DEFAULT_DATA.with_name("emoji64.json").read_text())["names"]
    n = len(images)
    assert labels["count"] == n == len(names)
    assert labels["names_sha256"] == hashlib.sha256("\n".join(names).encode()).hexdigest()
    assert len(labels["group"]) == len(labels["subgroup"]) == len(labels["class"]) == len(labels["match"]) == n
    assert sum(labels["matched"].values()) == n and set(labels["match"]) <= {"e", "r", "f"}
    groups, subgroups, classes = labels["groups"], labels["subgroups"], labels["classes"]
    assert len(set(classes)) == len(classes)
    for g, s, c in zip(labels["group"], labels["subgroup"], labels["class"]):
        group, sub = groups[g], subgroups[s]
        assert sub.startswith(group + "/")
        assert classes[c] in (sub, f"{group}/(other)")
    counts = np.bincount(labels["class"], minlength=len(classes))
    assert counts.min() >= 1
    merged = [c for c in classes if not c.endswith("/(other)")]
    assert all(counts[classes.index(c)] >= labels["min_class"] for c in merged)
    assert "Unicode" in labels["license"] and labels["source"].startswith("Unicode emoji-test.txt")


EMOJI_TEST = """\
# Version: 99.0
# group: Smileys & Emotion
# subgroup: face-smiling
1F600 ; fully-qualified # grinning face
# group: People & Body
# subgroup: person-activity
1F3C3 ; fully-qualified # person running
1F3C3 200D 2640 FE0F ; fully-qualified # woman running
# group: Symbols
# subgroup: arrow
2194 FE0F ; fully-qualified # left-right arrow
27A1 FE0F ; fully-qualified # right arrow
# subgroup: keycap
0023 FE0F 20E3 ; fully-qualified # keycap: #
# group: Flags
# subgroup: subdivision-flag
1F3F4 E0067 E0062 E0065 E006E E0067 E007F ; fully-qualified # flag: England
"""


def test_label_rules(tmp_path):
    path = tmp_path / "emoji-test.txt"
    path.write_text(EMOJI_TEST)
    table, version, order = build_emoji_labels.parse_emoji_test(path)
    assert version == "99.0" and order[0] == "Smileys & Emotion/face-smiling"
    lab = build_emoji_labels.Labeller(table)
    assert lab.label("1f600") == ("Smileys & Emotion", "face-smiling", "exact")
    assert lab.label("23-fe0f-20e3") == ("Symbols", "keycap", "exact")
    assert lab.label("2640-200d-1f3c3") == ("People & Body", "person-activity", "reordered")
    assert lab.label("1f3c3-1f3fd-200d-2640")[:2] == ("People & Body", "person-activity")        # skin tone
    assert lab.label("1f3c3-200d-27a1")[:2] == ("People & Body", "person-activity")               # facing right
    assert lab.label("1f3f4-e0075-e0073-e0074-e0078-e007f")[:2] == ("Flags", "subdivision-flag")  # newer tag flag
    assert lab.label("1f1e6")[:2] == ("Flags", "country-flag")
    assert lab.label("30") == ("Symbols", "keycap", "fallback")
    assert lab.label("2194-200d-1f600")[:2] == ("Smileys & Emotion", "face-smiling")             # not the arrow
    with pytest.raises(InputError, match="no fallback rule"):
        lab.label("1f9ff")
    with pytest.raises(InputError, match="unicode-data"):
        build_emoji_labels.parse_emoji_test(tmp_path / "missing.txt")


# -- the classifier -------------------------------------------------------------------------------

def test_shipped_classifier_loads_and_describes_itself(clf, labels):
    assert DEFAULT_WEIGHTS.stat().st_size < 2 * 2**20
    assert clf.classes == labels["classes"] and clf.groups == labels["groups"]
    assert not clf.training and not any(p.requires_grad for p in clf.parameters())
    meta = clf.config["metadata"]
    assert meta["split"]["test"]["class_top1"] > 0 and meta["data"]["images"] == 3916


def test_features_shape_and_input_forms_agree(clf, images):
    x = images[:16]
    f_u8 = features(x, clf, batch=5)
    assert f_u8.shape == (16, clf.feature_dim) and f_u8.dtype == np.float64 and np.isfinite(f_u8).all()
    f_nchw = features(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(), clf)
    f_float = features(torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1, clf)
    np.testing.assert_allclose(f_nchw, f_u8, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f_float, f_u8, rtol=1e-4, atol=1e-4)
    assert to_input(torch.zeros(2, 3, 32, 32)).shape == (2, 3, 64, 64)       # other sizes are resized
    assert torch.equal(quantize(torch.tensor([-1.5, -1.0, 0.0, 1.0])), torch.tensor([0, 0, 128, 255],
                                                                                   dtype=torch.uint8))
    with pytest.raises(InputError, match="NaN"):
        to_input(torch.full((1, 3, 64, 64), float("nan")))
    with pytest.raises(InputError):
        to_input(np.zeros((2, 64, 64), dtype=np.int32))


def test_shipped_classifier_accuracy(clf, images, labels, subset):
    # Measured on all 3916 training images: see assets/metrics/emoji_classifier.md; the bound leaves
    # room for a subset and for other CPUs' rounding.
    seen = clf.config["metadata"]["final"]["train"]
    pc, pg = predict(images[subset], clf, batch=200)
    cls, grp = np.array(labels["class"])[subset], np.array(labels["group"])[subset]
    assert (pc == cls).mean() > seen["class_top1"] - 0.06
    assert (pg == grp).mean() > seen["group_top1"] - 0.04


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_classifier(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_classifier(bad)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ModelLoadError, match="not an Atelier emoji classifier"):
        load_classifier(tmp_path / "plain.safetensors")


def test_save_and_load_round_trip(tmp_path):
    from evaluation.emoji_metric import save_classifier

    torch.manual_seed(0)
    m = EmojiClassifier(5, 2, widths=(8, 8, 16, 16)).eval()
    p = save_classifier(m, tmp_path / "c.safetensors", list("abcde"), ["g1", "g2"], {"note": "x"}, dtype=torch.float32)
    back = load_classifier(p)
    assert back.classes == list("abcde") and back.config["metadata"] == {"note": "x"}
    x = torch.rand(3, 3, 64, 64) * 2 - 1
    torch.testing.assert_close(back.features(x), m.features(x))


# -- precision / recall ---------------------------------------------------------------------------

def _brute_pr(real, fake, k):
    def radii(a):
        d = np.linalg.norm(a[:, None] - a[None], axis=-1)
        return np.sort(d, axis=1)[:, k]

    d = np.linalg.norm(fake[:, None] - real[None], axis=-1)
    precision = (d <= radii(real)[None]).any(1).mean()
    recall = (d.T <= radii(fake)[None]).any(1).mean()
    return precision, recall


def test_precision_recall_closed_forms():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 8))
    assert precision_recall(a, a, k=3) == {"precision": 1.0, "recall": 1.0}
    far = precision_recall(a, a + 1000.0, k=3)
    assert far == {"precision": 0.0, "recall": 0.0}
    # Reals 0, 1, 2, 3 (k = 1: radius 1 each); fakes 0.5, 2.9, 10, 11 (radii 2.4, 2.4, 1, 1):
    # half the fakes sit in a real ball, every real sits in a fake ball.
    real = np.array([[0.0], [1.0], [2.0], [3.0]])
    fake = np.array([[0.5], [2.9], [10.0], [11.0]])
    assert precision_recall(real, fake, k=1, chunk=3) == {"precision": 0.5, "recall": 1.0}
    np.testing.assert_allclose(knn_radii(torch.from_numpy(fake), 1, chunk=3).sqrt().numpy(), [2.4, 2.4, 1, 1])


def test_precision_recall_matches_brute_force():
    rng = np.random.default_rng(1)
    real, fake = rng.normal(size=(150, 5)), rng.normal(0.5, 1.3, size=(120, 5))
    got = precision_recall(real, fake, k=3, chunk=32)
    want = _brute_pr(real, fake, 3)
    assert got["precision"] == pytest.approx(want[0]) and got["recall"] == pytest.approx(want[1])
    with pytest.raises(InputError, match="more than 3"):
        precision_recall(real[:3], fake, k=3)
    with pytest.raises(InputError, match="width"):
        precision_recall(real, fake[:, :4])


# -- Fréchet distance -----------------------------------------------------------------------------

def test_frechet_distance_of_real_features(clf, images, subset):
    real = features(images[subset], clf)
    assert abs(frechet_distance(real, real)) < 1e-6
    a, b = real[:300], real[300:]
    floor = frechet_distance(a, b)
    noise = features(np.random.default_rng(0).integers(0, 256, size=(300, 64, 64, 3), dtype=np.uint8), clf)
    assert frechet_distance(a, noise) > 10 * floor > 0


# -- class agreement (GAN-test accuracy) ----------------------------------------------------------

def test_heads_from_features_match_the_full_forward(clf, images, subset):
    pc, pg = predict(images[subset], clf, batch=200)
    hc, hg = heads(features(images[subset], clf, batch=200), clf, batch=128)
    # the same float32 features through the same heads; argmax may differ only on an exact tie
    assert (pc == hc).mean() > 0.99 and (pg == hg).mean() > 0.99


def test_class_map_and_groups(clf):
    level, index = class_map(list(reversed(clf.classes[:5])), clf)
    assert level == "class" and index.tolist() == [4, 3, 2, 1, 0]
    level, index = class_map(clf.groups, clf)
    assert level == "group" and index.tolist() == list(range(len(clf.groups)))
    assert class_map(["Smileys & Emotion/face-smiling", "not an emoji class"], clf) is None
    assert class_map([], clf) is None
    g = group_of_class(clf)
    assert len(g) == len(clf.classes) == 98
    for name, gi in zip(clf.classes, g):
        assert name.startswith(clf.groups[gi] + "/")


def test_class_agreement_counts(clf):
    g = group_of_class(clf)
    asked = np.array([0, 0, 0, 0, 5, 5])
    other = int(np.flatnonzero(g != g[0])[0])          # a class of another group than class 0
    pred_c = np.array([0, 0, 7, 7, 5, other])
    pred_g = np.array([g[0], g[0], g[0], g[other], g[5], g[other]])
    out = class_agreement(pred_c, pred_g, asked, clf)
    assert out["level"] == "class" and out["n"] == 6
    assert out["class_top1"] == pytest.approx(3 / 6) and out["group_top1"] == pytest.approx(4 / 6)
    per = {r["name"]: r for r in out["per_class"]}
    first, sixth = per[clf.classes[0]], per[clf.classes[5]]
    assert first["n"] == 4 and first["top1"] == pytest.approx(0.5) and first["most_taken_for"] == clf.classes[7]
    assert sixth["n"] == 2 and sixth["top1"] == pytest.approx(0.5) and sixth["most_taken_for"] == clf.classes[other]
    assert out["balanced_top1"] == pytest.approx(0.5)
    lopsided = class_agreement(np.array([0, 0, 0, 0, 7, 7]), pred_g, asked, clf)   # all of class 0, none of 5
    assert lopsided["class_top1"] == pytest.approx(4 / 6) and lopsided["balanced_top1"] == pytest.approx(0.5)
    perfect = class_agreement(asked, g[asked], asked, clf)
    assert perfect["class_top1"] == 1.0 and all(r["most_taken_for"] is None for r in perfect["per_class"])
    # a generator conditioned on groups is scored on groups only
    grp = class_agreement(pred_c, pred_g, g[asked], clf, level="group")
    assert "class_top1" not in grp and grp["group_top1"] == pytest.approx(4 / 6)
    with pytest.raises(InputError, match="one prediction per sample"):
        class_agreement(pred_c[:5], pred_g, asked, clf)
    with pytest.raises(InputError, match="level"):
        class_agreement(pred_c, pred_g, asked, clf, level="subgroup")


def test_real_images_agree_as_the_classifier_card_says(clf, images, labels, subset):
    cls = np.array(labels["class"])[subset]
    pc, pg = heads(features(images[subset], clf), clf)
    out = class_agreement(pc, pg, cls, clf)
    seen = clf.config["metadata"]["final"]["train"]
    assert out["class_top1"] > seen["class_top1"] - 0.06 and out["group_top1"] > seen["group_top1"] - 0.04
    # a generator that ignored its class (every sample drawn as another class's image) scores near chance
    shuffled = class_agreement(pc, pg, np.roll(cls, 1), clf)
    assert shuffled["class_top1"] < 0.25 < out["class_top1"]


# -- the snapshot script --------------------------------------------------------------------------

def _tiny_snapshots(folder: Path) -> None:
    from models import stylegan2
    from models.stylegan import save_generator

    for kimg in (0, 40):
        torch.manual_seed(kimg)
        G = stylegan2.Generator(z_dim=8, c_dim=0, w_dim=8, img_resolution=16, img_channels=3,
                                mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
        save_generator(G, folder / f"G_ema-{kimg:06d}kimg", "stylegan2", metadata={"kimg": kimg})


@pytest.fixture
def small_data(tmp_path, images, subset) -> Path:
    """300 dataset images as a plain .npy: the script reads any uint8 NHWC array, and fewer reals keep it fast."""
    path = tmp_path / "small.npy"
    np.save(path, images[subset[:300]])
    return path


def test_snapshot_script_end_to_end(tmp_path, small_data):
    snaps = tmp_path / "snaps"
    _tiny_snapshots(snaps)
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    rc = emoji_metrics.main(["--snapshots", str(snaps), "--n", "40", "--batch", "16", "--device", "cpu",
                             "--data", str(small_data),
                             "--out", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["kimg"] for r in doc["snapshots"]] == [0.0, 40.0]
    for r in doc["snapshots"]:
        assert r["fd"] > 0 and 0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1 and len(r["sha256"]) == 64
    floor = doc["reference_floor"]
    assert floor["images_per_side"] == [150, 150] and floor["fd"] > 0 and floor["precision"] > 0.5
    assert doc["n"] == 40 and doc["k"] == 3 and doc["classifier"]["feature_dim"] == 192
    # the centre asked for, and per snapshot the one used: an unconditional generator has only the global one
    assert doc["truncation_centre"] == "class" and {r["truncation_centre"] for r in doc["snapshots"]} == {"global"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert doc["plot"] is None
    else:
        assert doc["plot"] == str(png) and png.stat().st_size > 1000


def test_snapshot_script_same_latents_give_same_numbers(tmp_path, small_data):
    snaps = tmp_path / "snaps"
    _tiny_snapshots(snaps)
    args = ["--snapshots", str(snaps / "G_ema-000040kimg.safetensors"), "--n", "20", "--batch", "10",
            "--device", "cpu", "--no-progress", "--data", str(small_data)]
    assert emoji_metrics.main(args + ["--out", str(tmp_path / "a.json")]) == 0
    assert emoji_metrics.main(args + ["--out", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f).read_text())["snapshots"][0] for f in ("a.json", "b.json"))
    assert a["fd"] == pytest.approx(b["fd"], rel=1e-9) and a["precision"] == b["precision"]


def test_snapshot_script_errors(tmp_path, capsys):
    assert emoji_metrics.main(["--snapshots", str(tmp_path), "--out", str(tmp_path / "m.json")]) == 2
    assert "G_ema-" in capsys.readouterr().err
    assert emoji_metrics.main(["--out", str(tmp_path / "m.json")]) == 2
    assert "nothing to score" in capsys.readouterr().err
    assert emoji_metrics.snapshot_kimg(Path("G_ema-000200kimg.safetensors"), {}) == 200.0
    assert emoji_metrics.snapshot_kimg(Path("x.safetensors"), {"training": {"kimg": 716.8}}) == 716.8


def _tiny_group_generator(tmp_path, subset, seed: int):
    """A tiny random generator conditioned on the 10 emoji groups, saved as tmp_path/cond/G_ema-000040kimg with
    its label key, and the labels of the 300 small_data images: (G, group names, labels file)."""
    from models import stylegan2
    from models.stylegan import save_generator
    from training.dataset import load_labels

    groups, names = load_labels(DEFAULT_LABELS, "group", 3916)
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"group": groups[subset[:300]].tolist(), "groups": names}))
    torch.manual_seed(seed)
    G = stylegan2.Generator(z_dim=8, c_dim=len(names), w_dim=8, img_resolution=16, img_channels=3,
                            mapping_kwargs={"num_layers": 1}, channel_base=64, channel_max=8)
    save_generator(G, tmp_path / "cond" / "G_ema-000040kimg", "stylegan2",
                   metadata={"kimg": 40, "classes": {"key": "group", "names": names}})
    return G, names, labels, groups[subset[:300]]


def test_snapshot_script_scores_a_conditional_generator(tmp_path, small_data, subset):
    """A class-conditional G draws its classes from the data's labels (key from the file's metadata)."""
    from models.stylegan import save_generator

    G, names, labels, _ = _tiny_group_generator(tmp_path, subset, seed=1)
    save_generator(G, tmp_path / "nokey" / "G_ema-000040kimg", "stylegan2", metadata={"kimg": 40})
    base = ["--n", "40", "--batch", "16", "--device", "cpu", "--data", str(small_data), "--labels", str(labels),
            "--no-progress"]
    out, cplot = tmp_path / "m.json", tmp_path / "classes.png"
    assert emoji_metrics.main(["--snapshots", str(tmp_path / "cond"), *base, "--out", str(out),
                               "--class-plot", str(cplot)]) == 0
    doc = json.loads(out.read_text())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert doc["class_plot"] is None
    else:
        assert doc["class_plot"] == str(cplot) and cplot.stat().st_size > 1000
    row = doc["snapshots"][0]
    assert row["kimg"] == 40.0 and row["fd"] > 0 and 0 <= row["recall"] <= 1
    # its classes are the classifier's groups, so the agreement is scored at the group level, with the data set's
    # own images as the ceiling (the shipped classifier names about 89 % of their groups)
    agree = row["agreement"]
    assert agree["level"] == "group" and agree["n"] == 40 and 0 <= agree["group_top1"] <= 1
    assert "class_top1" not in agree and sum(r["n"] for r in agree["per_class"]) == 40
    assert doc["real_agreement"]["n"] == 300 and doc["real_agreement"]["group_top1"] > 0.7
    # truncated: towards each class's own mean w by default, or the global w_avg; the JSON says which
    rows = {}
    for centre in ("class", "global"):
        o = tmp_path / f"psi07-{centre}.json"
        assert emoji_metrics.main(["--snapshots", str(tmp_path / "cond"), *base, "--truncation", "0.7",
                                   "--truncation-centre", centre, "--out", str(o)]) == 0
        doc = json.loads(o.read_text())
        assert doc["truncation"] == 0.7 and doc["truncation_centre"] == centre
        rows[centre] = doc["snapshots"][0]
        assert rows[centre]["truncation_centre"] == centre
    assert rows["class"]["fd"] != pytest.approx(rows["global"]["fd"], rel=1e-6)
    # without the label key in its metadata the script cannot know which classes the generator was trained on
    assert emoji_metrics.main(["--snapshots", str(tmp_path / "nokey"), *base]) == 2
    # class names the classifier does not know: scored for FD/precision/recall, without an agreement
    save_generator(G, tmp_path / "other" / "G_ema-000040kimg", "stylegan2",
                   metadata={"kimg": 40, "classes": {"key": "group", "names": [f"x{i}" for i in range(len(names))]}})
    o = tmp_path / "other.json"
    assert emoji_metrics.main(["--snapshots", str(tmp_path / "other"), *base, "--out", str(o)]) == 0
    doc = json.loads(o.read_text())
    assert doc["snapshots"][0]["agreement"] is None and "real_agreement" not in doc
    why = emoji_metrics.class_plot(doc, tmp_path / "none.png")
    assert "class agreement" in why or "matplotlib is not installed" in why
    assert not (tmp_path / "none.png").exists()


def test_two_generators_side_by_side_get_a_two_bar_class_plot(tmp_path, small_data, subset):
    """--generator CANDIDATE SHIPPED (what h200_train.sh finish runs): the JSON says it is a comparison and the
    class plot draws both models' bars per class (green the first, purple the second), not only the last one's."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from models.stylegan import save_generator

    _, names, labels, _ = _tiny_group_generator(tmp_path, subset, seed=1)
    (tmp_path / "b").mkdir()
    G2, _, _, _ = _tiny_group_generator(tmp_path / "b", subset, seed=2)
    save_generator(G2, tmp_path / "other-model", "stylegan2", metadata={"kimg": 80, "classes": {"key": "group",
                                                                                               "names": names}})
    a = tmp_path / "cond" / "G_ema-000040kimg.safetensors"
    base = ["--n", "40", "--batch", "16", "--device", "cpu", "--data", str(small_data), "--labels", str(labels),
            "--no-progress", "--per-class", "0"]
    out, cplot = tmp_path / "vs.json", tmp_path / "vs.png"
    assert emoji_metrics.main(["--generator", str(a), str(tmp_path / "other-model.safetensors"), *base,
                               "--out", str(out), "--class-plot", str(cplot)]) == 0
    doc = json.loads(out.read_text())
    assert doc["compare"] is True and len(doc["snapshots"]) == 2

    def purple_share(path):
        px = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).astype(int)
        # matplotlib's tab:purple (148, 103, 189)
        return float((np.abs(px - [148, 103, 189]).sum(1) < 40).mean())

    assert purple_share(cplot) > 0.001
    # the same numbers read as a series (not a comparison): one model's bars, no purple
    doc["compare"] = False
    single = tmp_path / "single.png"
    assert emoji_metrics.class_plot(doc, single) == ""
    assert purple_share(single) < 1e-4
    # one --generator is not a comparison
    o = tmp_path / "one.json"
    assert emoji_metrics.main(["--generator", str(a), *base, "--out", str(o)]) == 0
    assert json.loads(o.read_text())["compare"] is False


def test_snapshot_script_measures_within_class_diversity(tmp_path, small_data, subset):
    """--per-class N: N samples of every class on their own latents, each class's spread against the data's own
    images of it; the same model scored twice gives the same figure, and 0 skips it."""
    _, names, labels, small_groups = _tiny_group_generator(tmp_path, subset, seed=2)
    base = ["--snapshots", str(tmp_path / "cond"), "--n", "20", "--batch", "16", "--device", "cpu",
            "--data", str(small_data), "--labels", str(labels), "--no-progress"]
    docs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        assert emoji_metrics.main([*base, "--per-class", "3", "--out", str(out)]) == 0
        docs.append(json.loads(out.read_text())["snapshots"][0]["within_class"])
    wc = docs[0]
    present = {int(g) for g in np.unique(small_groups) if (small_groups == g).sum() >= 2}
    assert wc["per_class_samples"] == 3 and wc["classes"] == len(present)
    assert {r["name"] for r in wc["per_class"]} == {names[g] for g in present}
    assert all(r["n"] == 3 and r["n_real"] >= 2 and r["ratio"] >= 0 for r in wc["per_class"])
    assert wc["mean"] == pytest.approx(np.mean([r["ratio"] for r in wc["per_class"]]))
    assert 0 <= wc["below_half"] <= wc["classes"]
    assert wc["mean"] == pytest.approx(docs[1]["mean"], rel=1e-4)      # same latents, same model, same machine
    # 0 skips it; 1 cannot make a pair
    out = tmp_path / "off.json"
    assert emoji_metrics.main([*base, "--per-class", "0", "--out", str(out)]) == 0
    assert "within_class" not in json.loads(out.read_text())["snapshots"][0]
    assert emoji_metrics.main([*base, "--per-class", "1", "--out", str(out)]) == 2
