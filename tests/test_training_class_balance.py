"""--class-balance ALPHA: image i drawn with probability ~ n_c(i) ** -ALPHA, the generated images' classes alike.

Statistical checks use fixed seeds (so they are deterministic) and tolerances many standard errors wide."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.errors import InputError
from tests.test_training_runs import write_tiny_dataset
from training import cli
from training.config import build_config, finalize
from training.dataset import (ImageBatches, _mix, balanced_class_pool, class_balance_note, class_shares,
                              load_labels)
from training.trainer import Trainer

CPU = torch.device("cpu")
# deliberately imbalanced: class 0 x150, class 1 x40, class 2 x10, interleaved so that class is not position
LABELS = np.array([0] * 150 + [1] * 40 + [2] * 10)[np.random.default_rng(0).permutation(200)]
SQRT = np.sqrt([150, 40, 10]) / np.sqrt([150, 40, 10]).sum()      # 0.563, 0.291, 0.146


def _images(n=200, res=4):
    """Image i carries i in row 0 of channel 0 (kept by a flip) and a marker at the left of channel 1 (moved by
    one), so a batch says which images it holds and which of them were mirrored."""
    x = np.zeros((n, res, res, 3), np.uint8)
    x[:, 0, :, 0] = np.arange(n)[:, None]
    x[:, 0, 0, 1] = 1
    return x


def _indices(loader, steps):
    return [loader._next_indices().tolist() for _ in range(steps)]


def _class_freq(indices, labels=LABELS):
    flat = np.asarray(indices).ravel() % len(labels)
    return np.bincount(labels[flat], minlength=3) / flat.size


# ---------------------------------------------------------------------------------------------
# the real side: the sampler

# where="gpu" means "on the loader's device" (here the CPU); the ids avoid "gpu", which conftest reserves
ON_DEVICE = pytest.param("gpu", id="on-device")


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("where", [ON_DEVICE, "host"])
def test_alpha_zero_is_todays_permutation_sampler(mirror, where):
    x = _images()
    kw = dict(seed=7, mirror=mirror, where=where)
    length = 400 if mirror else 200
    steps = length // 20                            # per epoch
    plain = _indices(ImageBatches(x, 20, CPU, **kw), 3 * steps)
    labelled = _indices(ImageBatches(x, 20, CPU, labels=LABELS, **kw), 3 * steps)
    zero = _indices(ImageBatches(x, 20, CPU, labels=LABELS, class_balance=0.0, **kw), 3 * steps)
    assert zero == plain == labelled
    # and that is the permutation drawn from (seed, epoch) as before the option existed
    for epoch in range(3):
        g = torch.Generator().manual_seed(_mix(7, epoch, 0xDA7A))
        want = torch.randperm(length, generator=g).tolist()
        assert sum(zero[epoch * steps:(epoch + 1) * steps], []) == want


def test_alpha_one_evens_the_classes_and_half_gives_square_root_shares():
    x = _images()
    loader = ImageBatches(x, 20, CPU, seed=1, labels=LABELS, class_balance=1.0)
    draws = _indices(loader, 400)                           # 40 epochs, 8,000 images
    assert np.abs(_class_freq(draws) - 1 / 3).max() < 0.03  # data: 0.75 / 0.20 / 0.05
    assert loader.epoch == 39 and len(set(sum(draws[:10], []))) < 200   # with replacement: repeats within an epoch
    half = _indices(ImageBatches(x, 20, CPU, seed=1, labels=LABELS, class_balance=0.5), 400)
    assert np.abs(_class_freq(half) - SQRT).max() < 0.03
    assert np.allclose(class_shares(LABELS, 0.5), SQRT) and np.allclose(class_shares(LABELS, 1.0), 1 / 3)
    assert np.allclose(class_shares(LABELS, 0.0), [0.75, 0.2, 0.05])
    # within a class every image is equally likely: the 10 images of class 2 are all drawn
    assert set(np.flatnonzero(LABELS == 2)) <= set(np.asarray(draws).ravel().tolist())


def test_balanced_batches_carry_their_images_labels_and_mirror_both_copies():
    x = _images()
    loader = ImageBatches(x, 20, CPU, seed=2, mirror=True, labels=LABELS, class_balance=1.0)
    assert torch.equal(loader._weights[:200], loader._weights[200:])   # a mirrored copy weighs as its image
    ids, flipped, classes = [], [], []
    for _ in range(200):                                                # 10 epochs of 400
        batch, lab = loader.next_labeled()
        i = batch[:, 0, 0, 0].long()
        assert torch.equal(lab, torch.from_numpy(LABELS)[i])
        ids += i.tolist()
        flipped += (batch[:, 1, 0, 0] == 0).tolist()                   # the marker moved to the right
        classes += lab.tolist()
    assert abs(np.mean(flipped) - 0.5) < 0.03
    assert np.abs(np.bincount(classes, minlength=3) / len(classes) - 1 / 3).max() < 0.03


def test_ranks_take_their_slices_of_the_same_balanced_epoch():
    x = _images()
    kw = dict(seed=3, labels=LABELS, class_balance=0.5)
    whole = _indices(ImageBatches(x, 20, CPU, **kw), 25)               # crosses two epoch ends
    r0 = _indices(ImageBatches(x, 20, CPU, rank=0, world_size=2, **kw), 25)
    r1 = _indices(ImageBatches(x, 20, CPU, rank=1, world_size=2, **kw), 25)
    assert [a + b for a, b in zip(r0, r1)] == whole
    assert all(len(a) == 10 for a in r0 + r1)


@pytest.mark.parametrize("where", [ON_DEVICE, "host", "host-plain"])
def test_resume_mid_epoch_continues_the_same_draws(where):
    x = _images()
    kw = dict(seed=4, labels=LABELS, class_balance=0.5, mirror=True, where=where)

    def ids(loader, steps):
        return [loader.next()[:, 0, 0, 0].tolist() for _ in range(steps)]
    straight = ids(ImageBatches(x, 20, CPU, **kw), 30)
    first = ImageBatches(x, 20, CPU, **kw)
    ids(first, 13)                                  # epoch 0 (20 steps of 20 over 400), mid-way
    state = first.state_dict()
    assert state["epoch"] == 0 and state["pos"] == 260
    again = ImageBatches(x, 20, CPU, **kw)
    again.load_state_dict(json.loads(json.dumps(state)))      # as state.json keeps it
    assert ids(again, 17) == straight[13:]
    assert straight == ids(ImageBatches(x, 20, CPU, **dict(kw, where="gpu")), 30)   # placement does not matter
    assert straight != ids(ImageBatches(x, 20, CPU, **dict(kw, seed=5)), 30)


def test_the_loader_refuses_a_balance_it_cannot_apply():
    x = _images()
    with pytest.raises(InputError, match="needs the images' class labels"):
        ImageBatches(x, 20, CPU, class_balance=0.5)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InputError, match="between 0 and 1"):
            ImageBatches(x, 20, CPU, labels=LABELS, class_balance=bad)


# ---------------------------------------------------------------------------------------------
# the generated side: the classes G is given

def test_the_class_pool_holds_each_class_by_its_share():
    for alpha in (0.25, 0.5, 1.0):
        pool = balanced_class_pool(LABELS, alpha, 3)
        assert len(pool) == 65536 and pool.dtype == np.int64
        assert np.abs(np.bincount(pool) / len(pool) - class_shares(LABELS, alpha)).max() <= 1 / 65536
    # a class with no images gets no entry, even at alpha 1; the rarest class of a long tail keeps some
    with_empty = balanced_class_pool(LABELS, 1.0, 5)
    assert np.bincount(with_empty, minlength=5)[3:].sum() == 0
    tail = np.array([0] * 100_000 + [1])
    assert (balanced_class_pool(tail, 0.1) == 1).sum() >= 16
    note = class_balance_note(LABELS, 0.5)
    assert note == ("class balance 0.5: largest class (150 images) 75.0 % -> 56.4 % of samples, "
                    "smallest (10) 5.0 % -> 14.5 %")


def _labelled_trainer(tmp_path, alpha, **kw):
    data = write_tiny_dataset(tmp_path, 200, 16)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"kind": LABELS.tolist(), "kinds": ["big", "mid", "small"]}))
    cfg = build_config("tiny", 16, data=str(data), out=str(tmp_path / "run"), device="cpu", kimg=1.0,
                       cond="kind", labels=str(lab), class_balance=alpha, monitor_kimg=0.0, aug="none", **kw)
    return Trainer(cfg, write_outputs=False, log=lambda s: None)


def test_generated_classes_follow_the_real_sides_shares(tmp_path):
    balanced = _labelled_trainer(tmp_path, 0.5)
    pool = balanced.label_pool
    assert pool.shape == (65536,) and pool.device == balanced.device
    torch.manual_seed(11)
    drawn = torch.cat([balanced._gen_c(4096).argmax(1) for _ in range(4)])     # what G's D/G/PL steps use
    freq = np.bincount(drawn.numpy(), minlength=3) / len(drawn)
    assert np.abs(freq - SQRT).max() < 0.03
    # the real batches of the same run come in the same proportions
    real = torch.cat([balanced.loader.next_labeled()[1] for _ in range(1000)])   # batch 8: 40 epochs
    assert np.abs(np.bincount(real.numpy(), minlength=3) / len(real) - SQRT).max() < 0.03
    assert "3 classes (kind), class balance 0.5: largest class (150 images) 75.0 % -> 56.4 %" in balanced.describe()

    plain = _labelled_trainer(tmp_path, 0.0)
    assert plain.label_pool is plain.loader.labels      # alpha 0: the data's own labels, today's draws
    torch.manual_seed(11)
    today = plain.c_eye.index_select(0, plain.loader.labels.index_select(
        0, torch.randint(0, 200, (64,))))
    torch.manual_seed(11)
    assert torch.equal(plain._gen_c(64), today)
    assert "class balance" not in plain.describe()


# ---------------------------------------------------------------------------------------------
# the command line and the record

@pytest.mark.parametrize("extra, msg", [
    (["--class-balance", "1.5"], "between 0 and 1"),
    (["--class-balance", "-0.5"], "between 0 and 1"),
    (["--class-balance", "nan"], "between 0 and 1"),
    (["--class-balance", "0.5", "--no-cond"], "unconditional run has no classes: add --cond KEY"),
])
def test_the_cli_refuses_a_balance_out_of_range_or_without_classes(tmp_path, capsys, extra, msg):
    data = write_tiny_dataset(tmp_path, 24, 16)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": [i % 3 for i in range(24)]}))
    cond = [] if "--no-cond" in extra else ["--cond", "group", "--labels", str(lab)]
    argv = ["--config", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
            "--kimg", "0.016", "--no-progress", *cond, *[a for a in extra if a != "--no-cond"]]
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "o" / "state.json").exists()
    with pytest.raises(InputError, match="between 0 and 1|has no classes"):
        finalize(build_config("tiny", 16, class_balance=float(extra[1])), 16)


def test_a_balanced_conditional_run_trains_records_exports_and_retunes(tmp_path, capsys):
    from training.export import export_run

    data = write_tiny_dataset(tmp_path, 24, 16)
    labels = np.array([0] * 16 + [1] * 6 + [2] * 2)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": labels.tolist(), "groups": ["many", "some", "few"]}))
    run = tmp_path / "run"
    base = ["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--no-progress",
            "--cond", "group", "--labels", str(lab), "--monitor-kimg", "0"]
    assert cli.main([*base, "--kimg", "0.024", "--class-balance", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "3 classes (group), class balance 0.5: largest class (16 images) 66.7 % -> " in out
    state = json.loads((run / "state.json").read_text())
    assert state["config"]["class_balance"] == 0.5 and state["kimg"] == pytest.approx(0.024)
    assert load_labels(lab, "group", 24)[0].tolist() == labels.tolist()

    paths = export_run(run, tmp_path / "models" / "balanced")
    meta = json.loads(paths["config"].read_text())
    assert meta["metadata"]["training"]["class_balance"] == 0.5
    card = paths["card"].read_text()
    assert "Class balance 0.5 (`--class-balance`)" in card and "n^0.5 (square-root sampling)" in card

    # a plain resume keeps the run's balance; --retune changes it, and the log says so
    assert cli.main([*base, "--kimg", "0.032", "--resume", str(run)]) == 0
    assert json.loads((run / "state.json").read_text())["config"]["class_balance"] == 0.5
    assert cli.main([*base, "--kimg", "0.040", "--resume", str(run), "--retune", "--class-balance", "1"]) == 0
    assert json.loads((run / "state.json").read_text())["config"]["class_balance"] == 1.0
    retunes = [json.loads(r) for r in (run / "log.jsonl").read_text().splitlines() if '"retune"' in r]
    assert retunes[-1]["changed"] == {"class_balance": {"from": 0.5, "to": 1.0}}

    # an unbalanced export says nothing about it
    plain = tmp_path / "plain"
    assert cli.main([*base[:5], str(plain), *base[6:], "--kimg", "0.016"]) == 0
    plain_paths = export_run(plain, tmp_path / "models" / "plain")
    assert "class_balance" not in json.loads(plain_paths["config"].read_text())["metadata"]["training"]
    assert "Class balance" not in plain_paths["card"].read_text()


# ---------------------------------------------------------------------------------------------
# on a CUDA GPU: the device and pinned-host placements, and no host syncs in the inner loop

@pytest.mark.gpu
@pytest.mark.parametrize("where", ["gpu", "host"])
def test_balanced_sampling_on_the_gpu_keeps_labels_and_never_syncs(tmp_path, where):
    cuda = torch.device("cuda")
    kw = dict(seed=1, labels=LABELS, class_balance=1.0, mirror=True, where=where)
    loader = ImageBatches(_images(), 20, cuda, **kw)
    classes = []
    for _ in range(200):                                    # 10 epochs of 400
        batch, lab = loader.next_labeled()
        assert batch.device.type == "cuda" and lab.device.type == "cuda"
        assert torch.equal(lab.cpu(), torch.from_numpy(LABELS)[batch[:, 0, 0, 0].long().cpu()])
        classes += lab.tolist()
    assert np.abs(np.bincount(classes, minlength=3) / len(classes) - 1 / 3).max() < 0.03
    first = ImageBatches(_images(), 20, cuda, **kw)
    straight = [first.next()[:, 0, 0, 0].tolist() for _ in range(30)]
    again = ImageBatches(_images(), 20, cuda, **kw)
    [again.next() for _ in range(13)]
    resumed = ImageBatches(_images(), 20, cuda, **kw)
    resumed.load_state_dict(again.state_dict())
    assert [resumed.next()[:, 0, 0, 0].tolist() for _ in range(17)] == straight[13:]

    data = write_tiny_dataset(tmp_path, 256, 16)
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps({"group": [0] * 200 + [1] * 40 + [2] * 16}))
    cfg = build_config("tiny", 16, data=str(data), out=str(tmp_path / "c"), device="cuda", kimg=10, batch=32,
                       data_device=where, cond="group", labels=str(lab), class_balance=0.5, monitor_kimg=0.0,
                       r1_interval=2, pl_interval=2, ada_interval=1)
    tr = Trainer(cfg, log=lambda s: None, write_outputs=False)
    assert tr.label_pool.device.type == "cuda" and tr.label_pool.shape == (65536,)
    for _ in range(3):
        tr.iteration()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):                                  # batches 4-7 of the first epoch (8 of 32)
            tr.iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(tr.stats).all()
