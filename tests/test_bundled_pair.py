"""The bundled model and the D kept beside it (training_state/emoji64-D.safetensors.xz) are one pair: the next GPU
sitting continues both (`--init-g assets/models/emoji64.safetensors --init-d training_state/emoji64-D.safetensors.xz`,
docs/gpu-runbook.md section 1). Replacing one without the other would leave that sitting a D trained against another
G, the failure the 2026-12-07 continuations measured; this test catches it on the CPU, with the real files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training import checkpoint as ckpt
from training.config import build_config
from training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
G_FILE = ROOT / "assets" / "models" / "emoji64.safetensors"
D_FILE = ROOT / "training_state" / "emoji64-D.safetensors.xz"


def test_the_bundled_g_and_its_kept_d_load_as_one_run(tmp_path, monkeypatch):
    if not D_FILE.exists():
        pytest.skip("no carried D in the tree (the bundled model is final)")
    monkeypatch.chdir(ROOT)                       # the preset's data and labels are repository paths
    card = json.loads(G_FILE.with_suffix(".json").read_text())
    meta, sd = ckpt.read_d_state(D_FILE)
    g_kimg = float(card["metadata"]["training"]["kimg"])
    # from the same checkpoint: the same kimg, the same classes
    assert meta["kimg"] == pytest.approx(g_kimg, abs=1e-3), (meta["kimg"], g_kimg)
    assert meta["config"]["cond"] == "class"
    cfg = build_config("emoji64", cbase=int(meta["config"]["cbase"]), cmax=int(meta["config"]["cmax"]),
                       cond="class", init_g=str(G_FILE), init_d=str(D_FILE), out=str(tmp_path / "r"),
                       device="cpu", batch=4, kimg=g_kimg + 1, progress=False, compile=False)
    said = []
    tr = Trainer(cfg, log=said.append)
    # D loaded strictly (a wrong network raises), bf16 weights as carried, G at the bundled model's kimg
    assert all(torch.equal(tr.D.state_dict()[k], v.to(tr.D.state_dict()[k].dtype)) for k, v in sd.items())
    rec = tr.init_d_record
    assert rec["kimg_gap"] == 0 and rec["aug_p"] == pytest.approx(min(meta["aug_p"], cfg.ada_max_p))
    assert any(s.startswith("[init] D from") and "G's kimg" in s for s in said)
