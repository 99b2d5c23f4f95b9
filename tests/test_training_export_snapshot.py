"""`--export RUN --snapshot KIMG|FILE`: a chosen G_ema snapshot of a run, with the run's recipe at that point.

Real tiny CPU runs through the trainer's CLI: a run with G_ema snapshots, then a retuned resume, so the
snapshot taken before the retune must be carded with the recipe it was trained under, not the final one."""
from __future__ import annotations

import json

import pytest
import torch

from core.errors import InputError
from models.stylegan import load_generator, save_generator
from tests.test_training_runs import write_tiny_dataset
from tests.training_helpers import retuned_tiny_run
from training import cli
from training.config import build_config, finalize
from training.export import export_run
from training.trainer import build_networks


@pytest.fixture(scope="module")
def retuned_run(tmp_path_factory):
    """A tiny run (batch 8, G_ema snapshots on) whose first snapshot is kept aside, then resumed with --retune."""
    r = retuned_tiny_run(tmp_path_factory.mktemp("snaprun"), write_tiny_dataset)
    return r["run"], r["early"]


def _meta(stem):
    return json.loads(stem.with_suffix(".json").read_text())["metadata"]


def test_snapshot_before_a_retune_gets_the_recipe_it_was_trained_under(retuned_run, tmp_path):
    run, early = retuned_run
    state = json.loads((run / "state.json").read_text())
    assert state["config"]["batch"] == 16                       # the final recipe
    paths = export_run(run, tmp_path / "early", grid_path=tmp_path / "early.png", snapshot="early")
    meta = _meta(paths["weights"])
    snap_kimg = json.loads(early.with_suffix(".json").read_text())["metadata"]["kimg"]
    assert meta["training"]["batch"] == 8                       # the retune came after this snapshot
    assert meta["training"]["kimg"] == pytest.approx(snap_kimg)
    assert meta["training"]["kimg"] < state["kimg"]
    assert meta["monitor"] == {} or meta["monitor"]["kimg"] <= snap_kimg + 1e-6
    card = paths["card"].read_text()
    assert "Batch 8," in card and "Exported from the run's G_ema snapshot" in card
    # the weights are the snapshot's, unchanged by the fp16 round trip
    a, b = load_generator(early).G.state_dict(), load_generator(paths["weights"]).G.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert paths["grid"].is_file()


def test_latest_snapshot_by_path_gets_the_retuned_recipe(retuned_run, tmp_path, capsys):
    run, _ = retuned_run
    latest = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))[-1]
    assert cli.main(["--export", str(run), "--snapshot", str(latest), "--to", str(tmp_path / "late")]) == 0
    capsys.readouterr()
    assert _meta(tmp_path / "late.safetensors")["training"]["batch"] == 16


def test_unknown_snapshot_lists_what_the_run_has(retuned_run, tmp_path, capsys):
    run, _ = retuned_run
    with pytest.raises(InputError, match=r"no snapshot '9999'.*early\.safetensors|no snapshot '9999'.*G_ema-"):
        export_run(run, tmp_path / "x", snapshot="9999")
    assert not (tmp_path / "x.safetensors").exists()
    assert cli.main(["--snapshot", "1"]) == 2
    assert "--snapshot picks what --export writes" in capsys.readouterr().err


def test_snapshot_of_another_network_is_refused(retuned_run, tmp_path):
    run, _ = retuned_run
    cfg = finalize(build_config("tiny", 16, device="cpu"), 16)
    cfg.g_kwargs["channel_max"] = cfg.g_kwargs.get("channel_max", 64) // 2
    G, _ = build_networks(cfg)
    other = save_generator(G, tmp_path / "other", cfg.arch, dtype="fp16", metadata={"kimg": 0.0})
    with pytest.raises(InputError, match="not a snapshot of the run"):
        export_run(run, tmp_path / "y", snapshot=other)
    assert not (tmp_path / "y.safetensors").exists()
