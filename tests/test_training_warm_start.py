"""scripts/warm_start_state.py: a resumable state from a newer G_ema snapshot + an older full state.

Real tiny CPU runs: a run saved at 0.032 kimg (the older state), continued with a retune to 0.064 kimg
(whose checkpoint is then treated as lost: only its snapshot and log are used); the joined state must
hold the snapshot's generator, the older D, the retuned recipe, and train on when resumed."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from core.errors import InputError
from models.stylegan import load_generator
from scripts.warm_start_state import main as warm_main, warm_start
from tests.test_training_runs import write_tiny_dataset
from tests.training_helpers import retuned_tiny_run
from training import checkpoint as ckpt
from training import cli


@pytest.fixture(scope="module")
def lost_run(tmp_path_factory):
    return retuned_tiny_run(tmp_path_factory.mktemp("warm"), write_tiny_dataset)


def test_joined_state_holds_the_snapshot_g_the_older_d_and_the_retuned_recipe(lost_run, tmp_path, capsys):
    out = tmp_path / "joined"
    rec = warm_start(lost_run["old"], lost_run["snap"], out, log=lost_run["run"] / "log.jsonl")
    doc = ckpt.read_state(out)
    ckpt.verify(out, doc)                                        # a normal checkpoint: sizes and hashes agree
    snap_meta = json.loads(lost_run["snap"].with_suffix(".json").read_text())["metadata"]
    assert doc["kimg"] == pytest.approx(snap_meta["kimg"]) and doc["step"] == snap_meta["step"]
    assert doc["config"]["batch"] == 16 and rec["retuned"] == ["batch"]
    assert doc["config"]["device"] == "cpu"                      # the older state's own (the tiny run's)
    g_snap = load_generator(lost_run["snap"]).G.state_dict()
    for name in ("G", "G_ema"):
        saved = load_file(str(out / f"{name}.safetensors"))
        assert saved.keys() == g_snap.keys()
        assert all(torch.equal(saved[k], g_snap[k].float()) for k in saved), name
    d_old, d_new = load_file(str(lost_run["old"] / "D.safetensors")), load_file(str(out / "D.safetensors"))
    assert all(torch.equal(d_old[k], d_new[k]) for k in d_old)
    d_lost = load_file(str(lost_run["run"] / "D.safetensors"))
    assert any(not torch.equal(d_lost[k], d_new[k]) for k in d_lost)     # not the lost run's D
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["kind"] == "warm_start" and all(r["kimg"] <= doc["kimg"] + 1e-6 for r in log)
    # the trainer resumes from it and trains on
    capsys.readouterr()
    assert cli.main(["--config", "tiny", "--data", str(lost_run["data"]), "--out", str(out), "--device", "cpu",
                     "--resume", str(out), "--kimg", "0.096", "--no-progress"]) == 0
    after = ckpt.read_state(out)
    assert after["kimg"] > doc["kimg"] and after["config"]["batch"] == 16
    g_after = load_file(str(out / "G.safetensors"))
    assert any(not torch.equal(g_after[k], g_snap[k].float()) for k in g_after)   # G moved


def test_refusals(lost_run, tmp_path, capsys):
    with pytest.raises(InputError, match="not newer than the state"):
        warm_start(lost_run["run"], lost_run["snap"], tmp_path / "a", log=lost_run["run"] / "log.jsonl")
    with pytest.raises(InputError, match="must be a new folder"):
        warm_start(lost_run["old"], lost_run["snap"], lost_run["old"], log=lost_run["run"] / "log.jsonl")
    assert warm_main(["--state", str(lost_run["old"]), "--g-ema", str(lost_run["snap"]), "--out",
                      str(tmp_path / "b"), "--log", str(tmp_path / "none.jsonl")]) == 2
    assert "no log at" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_exported_model_works_as_the_snapshot(lost_run, tmp_path):
    """The shipped model file (export of a snapshot: kimg under "training", no step) joins the same way;
    the iteration count is derived from the log's last train record and the batch."""
    from training.export import export_run

    exported = export_run(lost_run["run"], tmp_path / "model", snapshot=lost_run["snap"])["weights"]
    a = warm_start(lost_run["old"], lost_run["snap"], tmp_path / "a", log=lost_run["run"] / "log.jsonl")
    b = warm_start(lost_run["old"], exported, tmp_path / "b", log=lost_run["run"] / "log.jsonl")
    sa, sb = ckpt.read_state(tmp_path / "a"), ckpt.read_state(tmp_path / "b")
    assert a["kimg"] == b["kimg"] and sa["step"] == sb["step"] and sa["cur_nimg"] == sb["cur_nimg"]
    ga, gb = load_file(str(tmp_path / "a" / "G_ema.safetensors")), load_file(str(tmp_path / "b" / "G_ema.safetensors"))
    assert all(torch.equal(ga[k], gb[k]) for k in ga)
