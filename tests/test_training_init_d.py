"""The carried D state (training/checkpoint.py write_d_state / read_d_state; `train_default_model.py --carry-d`)
and --init-d, on real tiny CPU runs: a run with ADA writes a checkpoint and a G_ema snapshot; its D goes into one
bf16 .safetensors.xz; a new run starts from the snapshot (--init-g) and that D (--init-d)."""
from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from core.errors import AtelierError, InputError
from tests.test_training_runs import write_tiny_dataset
from tests.training_helpers import tiny_cfg
from training import checkpoint as ckpt
from training import cli
from training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny ADA run of 0.048 kimg (p moves from 0.3) with its G_ema snapshot, and its D carried."""
    tmp = tmp_path_factory.mktemp("initd")
    data = write_tiny_dataset(tmp, 24, 16)
    run = tmp / "src"
    # with ADA from p = 0.3 (tiny_cfg)
    train(tiny_cfg(data, run, 0.048, batch=8, snapshot_ema=True, progress=False), log=lambda s: None)
    snap = sorted((run / "snapshots").glob("G_ema-*kimg.safetensors"))[-1]
    carried = tmp / "carry" / "D.safetensors.xz"
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import train_default_model
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert train_default_model.main(["--carry-d", str(run), "--carry-d-to", str(carried)]) == 0
    return {"data": data, "run": run, "snap": snap, "carried": carried, "state": ckpt.read_state(run)}


def test_the_carried_state_is_d_alone_in_bf16_and_xz_with_the_run_s_counters_and_p(source):
    raw = lzma.decompress(source["carried"].read_bytes())       # a plain xz stream: `xz -d` opens it
    assert len(source["carried"].read_bytes()) < len(raw)
    meta, sd = ckpt.read_d_state(source["carried"])
    d = load_file(str(source["run"] / "D.safetensors"))
    assert sd.keys() == d.keys()
    for k, v in d.items():
        # bf16 keeps 8 significant bits: each weight within half a unit in the last place of its own value
        assert torch.allclose(sd[k], v, rtol=2 ** -8, atol=0), k
        if v.is_floating_point():
            assert torch.equal(sd[k], v.to(torch.bfloat16).float()), k
    st = source["state"]
    assert meta["format"] == ckpt.D_STATE_FORMAT and meta["dtype"] == "bfloat16"
    assert meta["kimg"] == st["kimg"] and meta["step"] == st["step"]
    assert meta["aug_p"] == pytest.approx(st["aug_p"]) and meta["aug_p"] > 0
    assert meta["ada"] == st["ada"] and meta["config"]["cond"] == st["config"]["cond"]


def test_init_d_loads_d_and_ada_p_and_the_run_trains_on(source, tmp_path):
    meta, sd = ckpt.read_d_state(source["carried"])
    # this run's own p (0.05) is not the carried one: without --aug-p given, the carried p is taken
    cfg = tiny_cfg(source["data"], tmp_path / "a", 1.0, init_g=str(source["snap"]), init_d=str(source["carried"]),
                   batch=8, aug_p=0.05)
    said = []
    tr = Trainer(cfg, log=said.append)
    assert all(torch.equal(tr.D.state_dict()[k], v) for k, v in sd.items())
    assert float(tr.aug.p) == pytest.approx(meta["aug_p"]) and meta["aug_p"] != pytest.approx(0.05)
    assert any(s.startswith("[init] D from") and "G's kimg" in s for s in said)
    # --aug-p given on the command line wins over the carried p
    kept = Trainer(cfg, log=lambda s: None, given={"aug_p"})
    assert float(kept.aug.p) == pytest.approx(0.05)
    # a whole run through the CLI: trains past the start, logs where D came from, the export's card says it
    out = tmp_path / "run"
    start = source["state"]["kimg"]
    assert cli.main(["--config", "tiny", "--data", str(source["data"]), "--out", str(out), "--device", "cpu",
                     "--no-progress", "--batch", "8", "--init-g", str(source["snap"]), "--init-d",
                     str(source["carried"]), "--kimg", f"{start + 0.024:.3f}"]) == 0
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    init_d = next(r for r in records if r.get("kind") == "init_d")
    assert init_d["from"] == str(source["carried"]) and init_d["kimg_gap"] == 0
    doc = ckpt.read_state(out)
    assert doc["g_updates"] > source["state"]["g_updates"] and doc["kimg"] > start
    moved = load_file(str(out / "D.safetensors"))
    assert any(not torch.equal(moved[k], sd[k]) for k in sd)          # D trained on from the carried weights
    from training.export import export_run

    paths = export_run(out, tmp_path / "m" / "cont")
    assert f"D from the carried state `{source['carried']}`" in paths["card"].read_text()


def test_init_d_refusals(source, tmp_path):
    with pytest.raises(InputError, match="--init-g"):          # a D without the G it was trained against
        Trainer(tiny_cfg(source["data"], tmp_path / "a", 1.0, init_d=str(source["carried"]), batch=8),
                log=lambda s: None)
    with pytest.raises(InputError, match="no such file"):
        Trainer(tiny_cfg(source["data"], tmp_path / "b", 1.0, init_g=str(source["snap"]),
                         init_d=str(tmp_path / "none.xz"), batch=8), log=lambda s: None)
    junk = tmp_path / "junk.xz"
    junk.write_bytes(b"not an xz stream at all")
    with pytest.raises(InputError, match="not an xz"):
        Trainer(tiny_cfg(source["data"], tmp_path / "c", 1.0, init_g=str(source["snap"]), init_d=str(junk),
                         batch=8), log=lambda s: None)
    plain = tmp_path / "plain.xz"      # an xz of a safetensors that is not a carried state
    plain.write_bytes(lzma.compress(save({"w": torch.zeros(2)})))
    with pytest.raises(InputError, match="not a carried D state"):
        ckpt.read_d_state(plain)
    inner = tmp_path / "inner.xz"
    inner.write_bytes(lzma.compress(b"\xff" * 64))
    with pytest.raises(InputError, match="not a readable safetensors"):
        ckpt.read_d_state(inner)
    with pytest.raises(AtelierError, match="cbase/--cmax"):       # another width: D's state dict does not match
        Trainer(tiny_cfg(source["data"], tmp_path / "d", 1.0, init_g=str(source["snap"]),
                         init_d=str(source["carried"]), batch=8, cmax=8), log=lambda s: None)


def test_carry_d_refuses_a_state_over_the_repository_budget(source, tmp_path):
    with pytest.raises(InputError, match="over the 0.0001 MB"):
        ckpt.write_d_state(source["run"], tmp_path / "big.xz", max_bytes=100)
    assert not (tmp_path / "big.xz").exists()
