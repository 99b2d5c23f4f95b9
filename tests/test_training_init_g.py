"""--init-g (a new run's G and G_ema from an exported generator, D fresh) and --freeze-g-kimg (D trains alone
first), on real tiny CPU runs: a run writes a G_ema snapshot, a second run starts from it."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from core.errors import AtelierError, InputError
from models.stylegan import load_generator
from tests.test_training_runs import write_tiny_dataset
from training import checkpoint as ckpt
from training import cli
from training.trainer import Trainer
from tests.training_helpers import tiny_cfg


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny run of 0.048 kimg with a G_ema snapshot: the generator the next runs start from."""
    tmp = tmp_path_factory.mktemp("initg")
    data = write_tiny_dataset(tmp, 24, 16)
    run = tmp / "src"
    assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--device", "cpu", "--snapshot-ema",
                     "--no-progress", "--kimg", "0.048", "--batch", "8"]) == 0
    snap = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))[-1]
    return {"data": data, "run": run, "snap": snap, "meta": json.loads(snap.with_suffix(".json").read_text())}


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_init_g_loads_g_and_g_ema_continues_the_counters_and_d_starts_fresh(source, tmp_path):
    snap_sd = load_generator(source["snap"]).G.state_dict()
    cfg = tiny_cfg(source["data"], tmp_path / "a", 1.0, init_g=str(source["snap"]), batch=8)
    tr = Trainer(cfg, log=lambda s: None)
    for net in (tr.G, tr.G_ema):
        sd = net.state_dict()
        assert sd.keys() == snap_sd.keys()
        assert all(torch.equal(sd[k], snap_sd[k].float()) for k in sd)
    meta = source["meta"]["metadata"]
    assert tr.cur_nimg == round(meta["kimg"] * 1000) and tr.step == meta["step"] > 0
    # D is what a new run of this seed builds, not the source run's trained D
    fresh = Trainer(tiny_cfg(source["data"], tmp_path / "b", 1.0, batch=8), log=lambda s: None)
    assert all(torch.equal(a, b) for a, b in zip(tr.D.state_dict().values(), fresh.D.state_dict().values()))
    src_d = load_file(str(source["run"] / "D.safetensors"))
    assert any(not torch.equal(src_d[k], v) for k, v in tr.D.state_dict().items())
    log = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert log[0]["kind"] == "init_g" and log[0]["from"] == str(source["snap"])


def test_freeze_g_trains_d_alone_then_g_and_resume_keeps_the_boundary(source, tmp_path):
    out = tmp_path / "run"
    base = ["--config", "tiny", "--data", str(source["data"]), "--out", str(out), "--device", "cpu", "--no-progress",
            "--batch", "8"]
    start_kimg = source["meta"]["metadata"]["kimg"]
    # 0.032 kimg = 4 iterations of D alone after the start
    assert cli.main([*base, "--init-g", str(source["snap"]), "--freeze-g-kimg", "0.032",
                     "--kimg", f"{start_kimg + 0.024:.3f}"]) == 0
    doc = ckpt.read_state(out)
    assert doc["freeze_until_nimg"] == round(start_kimg * 1000) + 32
    assert doc["g_updates"] == doc["step"] - 3 and doc["d_updates"] == doc["step"]     # 3 D-only iterations
    snap_sd = load_generator(source["snap"]).G.state_dict()
    for name in ("G", "G_ema"):
        saved = load_file(str(out / f"{name}.safetensors"))
        # only w_avg (the mapping's running mean, updated by every pass of G) may move while G is frozen
        moved = [k for k in saved if not torch.equal(saved[k], snap_sd[k].float())]
        assert moved == [] or all(k.endswith("w_avg") for k in moved), (name, moved)
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert any(r.get("g_frozen") for r in records if r.get("kind") == "train")
    # resumed past the boundary: G trains again, the boundary is kept
    assert cli.main([*base, "--resume", str(out), "--kimg", f"{start_kimg + 0.064:.3f}"]) == 0
    after = ckpt.read_state(out)
    assert after["freeze_until_nimg"] == doc["freeze_until_nimg"]
    assert after["g_updates"] > doc["g_updates"]
    g = load_file(str(out / "G.safetensors"))
    assert any(not torch.equal(g[k], snap_sd[k].float()) for k in g if not k.endswith("w_avg"))


def test_export_of_an_init_g_run_names_where_g_started(source, tmp_path):
    from training.export import export_run

    out = tmp_path / "run"
    start_kimg = source["meta"]["metadata"]["kimg"]
    assert cli.main(["--config", "tiny", "--data", str(source["data"]), "--out", str(out), "--device", "cpu",
                     "--no-progress", "--batch", "8", "--init-g", str(source["snap"]), "--freeze-g-kimg", "0.016",
                     "--kimg", f"{start_kimg + 0.032:.3f}"]) == 0
    paths = export_run(out, tmp_path / "m" / "cont")
    meta = json.loads(paths["config"].read_text())["metadata"]["training"]
    assert meta["init_g"] == {"from": str(source["snap"]), "freeze_g_kimg": 0.016, "kimg": pytest.approx(start_kimg),
                              "init_d": None}
    card = paths["card"].read_text()
    assert f"started from `{source['snap']}`" in card and "alone for its first 0.016 kimg" in card


def test_init_g_refusals(source, tmp_path):
    with pytest.raises(InputError, match="no such file"):
        Trainer(tiny_cfg(source["data"], tmp_path / "a", 1.0, init_g=str(tmp_path / "none.safetensors"), batch=8),
                log=lambda s: None)
    with pytest.raises(AtelierError, match="cbase/--cmax"):       # another width: the state dicts do not match
        Trainer(tiny_cfg(source["data"], tmp_path / "b", 1.0, init_g=str(source["snap"]), batch=8, cmax=8),
                log=lambda s: None)
    with pytest.raises(InputError, match="not both"):
        Trainer(tiny_cfg(source["data"], tmp_path / "c", 1.0, init_g=str(source["snap"]), batch=8),
                resume=source["run"], log=lambda s: None)
    with pytest.raises(InputError, match="freeze-g-kimg"):
        Trainer(tiny_cfg(source["data"], tmp_path / "d", 1.0, freeze_g_kimg=-1.0, batch=8), log=lambda s: None)
