"""On a CUDA GPU: the fast path (bf16 / fp16 + GradScaler, channels_last, data on GPU or pinned host)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.config import build_config
from training.trainer import Trainer

pytestmark = pytest.mark.gpu


def iterate_without_sync(tr: Trainer, warm: int = 3, steps: int = 4) -> None:
    """`warm` iterations (cuDNN autotuning, lazy initialisation and compilation may sync), then `steps` with CUDA's
    sync debug mode raising on any host synchronisation (4 cover R1, path length, ADA updates and EMA at the
    tests' intervals of 2); the stats stay finite."""
    for _ in range(warm):
        tr.iteration()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            tr.iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(tr.stats).all()


def _data(tmp_path):
    rng = np.random.default_rng(0)
    p = tmp_path / "d.npy"
    np.save(p, rng.integers(0, 256, size=(256, 64, 64, 3), dtype=np.uint8))
    return str(p)


@pytest.mark.parametrize("precision, where", [("bf16", "gpu"), ("fp16", "host"), ("fp32", "gpu")])
def test_fast_path_trains_saves_and_resumes(tmp_path, precision, where):
    data = _data(tmp_path)
    cfg = build_config("emoji64", data=data, out=str(tmp_path / "r"), kimg=0.64, batch=32, precision=precision,
                       data_device=where, log_every=5, monitor_kimg=0.32, progress=False, r1_interval=4,
                       pl_interval=2)
    tr = Trainer(cfg, log=lambda s: None)
    assert tr.loader.where == where and tr.channels_last
    summary = tr.run()
    assert summary["iterations"] == 20 and summary["peak_mem_gib"] > 0
    logs = [json.loads(x) for x in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    train = [r for r in logs if r["kind"] == "train"]
    assert all(np.isfinite(r["loss_G"]) and np.isfinite(r["loss_D"]) for r in train)
    assert train[-1]["img_s"] > 0 and train[-1]["mem_gib"] > 0
    cfg2 = build_config("emoji64", data=data, out=str(tmp_path / "r"), kimg=0.96, batch=32, precision=precision,
                        data_device=where, progress=False)
    tr2 = Trainer(cfg2, resume=tmp_path / "r", log=lambda s: None)
    assert tr2.step == 20
    assert tr2.run()["iterations"] == 30
    for p in tr2.G.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_inner_loop_never_waits_for_the_gpu(tmp_path, compile_):
    """No host synchronisation inside iterations (bf16, data on the GPU): CUDA's sync debug mode raises.
    Compiled: the default scope, with G's no-grad pass and the augmentation inside the compiled graphs."""
    cfg = build_config("emoji64", data=_data(tmp_path), out=str(tmp_path / "s"), kimg=10, batch=32,
                       progress=False, r1_interval=2, pl_interval=2, ada_interval=1, compile=compile_)
    tr = Trainer(cfg, log=lambda s: None, write_outputs=False)
    assert tr.fused_augment == compile_
    iterate_without_sync(tr)


def test_tf32_and_cudnn_benchmark_hold_inside_iterations_only(tmp_path):
    """Issue 13: the trainer's TF32 / cuDNN autotuning switches are not left set for the process."""
    b = torch.backends

    def switches():
        return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark

    saved = switches()
    b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark = False, False, False
    try:
        cfg = build_config("emoji64", data=_data(tmp_path), out=str(tmp_path / "t"), kimg=0.064, batch=32,
                           precision="fp32", tf32=True, progress=False, log_every=1)
        tr = Trainer(cfg, log=lambda s: None)
        assert switches() == (False, False, False)          # building the trainer changes nothing
        seen = []
        tr.G.synthesis.register_forward_pre_hook(lambda m, args: seen.append(switches()))
        tr.run()
        assert seen and set(seen) == {(True, True, True)}
        assert switches() == (False, False, False)
    finally:
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark = saved


@pytest.mark.parametrize("where", ["gpu", "host"])
def test_conditional_training_on_the_gpu_keeps_labels_with_images_and_never_syncs(tmp_path, where):
    """--cond: the pinned-host prefetch carries each batch's labels with it, and the label draws and one-hot
    rows add no host synchronisation to the inner loop."""
    from training.dataset import ImageBatches

    n = 64
    images = np.zeros((n, 8, 8, 3), np.uint8)
    images[..., 0] = np.arange(n)[:, None, None]
    labels = np.arange(n) % 5
    loader = ImageBatches(images, 16, torch.device("cuda"), seed=1, where=where, labels=labels)
    for _ in range(7):
        x, lab = loader.next_labeled()
        assert torch.equal(lab.cpu(), torch.from_numpy(labels)[x[:, 0, 0, 0].long().cpu()])

    data = _data(tmp_path)
    lab_path = tmp_path / "labels.json"
    lab_path.write_text(json.dumps({"group": [i % 3 for i in range(256)]}))
    cfg = build_config("emoji64", data=data, out=str(tmp_path / "c"), kimg=10, batch=32, progress=False,
                       r1_interval=2, pl_interval=2, ada_interval=1, data_device=where, cond="group",
                       labels=str(lab_path))
    tr = Trainer(cfg, log=lambda s: None, write_outputs=False)
    assert tr.G.c_dim == 3 and tr.D.c_dim == 3
    iterate_without_sync(tr)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_fast_training_path_follows_the_fp32_reference(tmp_path, compile_):
    """The trainer's GPU path (bf16 autocast, channels_last, the training op formulations; compiled or not)
    on the wide emoji network gives the image, D's logits, R1's input gradient and every G and D parameter
    gradient of the fp32 reference ops on the same weights and batch, up to bf16 rounding (the CPU tests
    compare the reference with NVlabs' code). The report is kept under $OUT when the device sets it."""
    import os

    from training.parity import format_report, path_parity

    cfg = build_config("emoji64", data=_data(tmp_path), out=str(tmp_path / "p"), kimg=1, batch=32, progress=False,
                       style_mixing=0, cbase=8192, cmax=256, compile=compile_)
    tr = Trainer(cfg, log=lambda s: None, write_outputs=False)
    rep = path_parity(tr, batch=32)
    text = format_report(rep)
    if os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], f"training-parity-{'compiled' if compile_ else 'eager'}.json")
        with open(out, "w") as f:
            json.dump(rep, f, indent=1)
    rows = rep["rows"]
    assert rows["image"]["cos"] > 0.999 and rows["d_logits"]["rel"] < 0.05, text
    assert rows["r1_grad"]["cos"] > 0.98, text
    for grp, bound in (("G", 0.98), ("D", 0.98), ("R1", 0.95)):
        assert rep["groups"][grp]["cos"] > bound, text
    weights = {k: v for k, v in rows.items() if k.endswith("weight") and v["numel"] >= 256 and v["norm"] > 0}
    assert len(weights) > 30
    bent = {k: round(v["cos"], 4) for k, v in weights.items() if not v["cos"] > 0.9}
    assert not bent, f"{bent}\n{text}"
