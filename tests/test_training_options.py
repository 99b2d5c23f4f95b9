"""The trainer's speed and output options on the CPU: `kernels`, the process-wide switches,
`snapshot_ema`, the bench ladder, and scripts/snapshot_strip.py over the snapshots."""
from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from core.errors import InputError
from models import ops
from core.settings import ROOT
from tests.test_training_runs import write_tiny_dataset
from training import checkpoint as ckpt
from training import cli
from training.bench import run_bench
from training.config import build_config, finalize
from training.trainer import SNAPSHOT_DIR, Trainer, backend_switches, build_networks

FAST = "grad:gradfix/up:subpixel-fused/down:fused-s2d/fir:separable"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("opts"), 24, 16)


def _cfg(data, out, **kw):
    base = dict(data=str(data) if data else None, out=str(out), device="cpu", kimg=0.032, r1_interval=2, pl_interval=2,
                log_every=4)
    base.update(kw)
    return build_config("tiny", 16, **base)


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in module.parameters()])


def trained_enough(before: torch.Tensor, after: torch.Tensor, lr: float) -> bool:
    """Training really moved these weights: Adam moves a weight by about lr per step wherever its
    gradient is steady, so after a few steps nearly all move by well over lr/10 (measured on the
    tiny preset after 4-6 iterations: ~97 % of G's and D's weights, root-mean-square ~2.2 lr)."""
    d = (after - before).abs()
    return bool((d > lr / 10).double().mean() > 0.9 and d.pow(2).mean().sqrt() > lr)


def _record_during_forward(module, probe):
    """What `probe()` returns each time `module` runs (a forward pre-hook on the real module)."""
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(probe()))
    return seen


# -- kernels ------------------------------------------------------------------------------------------

def test_explicit_kernels_train_like_the_reference_and_leave_models_ops_alone(data, tmp_path):
    """Four iterations (two lazy R1 and two path-length steps, so the double backward of every
    formulation runs) from the same seed, reference ops against the training fast paths.

    The formulations compute the same numbers up to float rounding and the tiny run is not chaotic
    over 4 iterations: measured, the two runs' weights differ by ~2e-5 of the distance training
    moved them (G; ~2e-6 for D), steadily over 6 iterations. Tolerance: 1e-3 of that distance."""
    caller = ops.set_impl(fir="nc1")            # what someone else in the process chose
    try:
        runs = {}
        for spec in ("reference", FAST):
            tr = Trainer(_cfg(data, tmp_path / spec.replace("/", "_"), kernels=spec), write_outputs=False,
                         log=lambda s: None)
            seen = _record_during_forward(tr.G.synthesis, ops.get_impl)
            w0 = {n: _flat(getattr(tr, n)) for n in ("G", "D", "G_ema")}
            summary = tr.run()
            assert summary["iterations"] == 4 and tr.g_updates == 4 and tr.d_updates == 4 and tr.cfg.lr_g == 0.002
            assert ops.get_impl() == {**ops.DEFAULT_IMPL, "fir": "nc1"}, f"{spec} leaked into models.ops"
            runs[spec] = (w0, {n: _flat(getattr(tr, n)) for n in w0}, seen)
    finally:
        ops.set_impl(**caller)

    w0, ref, seen_ref = runs["reference"]
    _, fast, seen_fast = runs[FAST]
    # Inside the run exactly the configured formulations, whatever the process had set.
    assert seen_ref and all(s == ops.DEFAULT_IMPL for s in seen_ref)
    want = {**ops.DEFAULT_IMPL, **dict(p.split(":") for p in FAST.split("/"))}
    assert seen_fast and all(s == want for s in seen_fast)
    for name in ("G", "D", "G_ema"):
        assert torch.equal(w0[name], runs[FAST][0][name]), f"{name}: not the same initial weights"
        assert trained_enough(w0[name], ref[name], lr=0.002), f"{name} barely trained"
        moved = (ref[name] - w0[name]).norm()
        gap = (fast[name] - ref[name]).norm()
        assert gap <= 1e-3 * moved, f"{name}: fast ops {gap:.3g} from the reference after training moved {moved:.3g}"


@pytest.mark.parametrize("spec, msg", [
    ("fir:triton", "fir:triton is inference-only"),
    ("fir:separable/up:sideways", "kernels must be auto, reference, or knob:choice"),
    ("gradfix", "kernels must be auto, reference, or knob:choice"),
])
def test_untrainable_or_malformed_kernels_exit_2_with_a_message(data, tmp_path, capsys, spec, msg):
    rc = cli.main(["--config", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
                   "--kernels", spec])
    assert rc == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()            # refused before any work


# -- process-wide switches -------------------------------------------------------------------------------

def _switches():
    b = torch.backends
    return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark


def _set_switches(values):
    b = torch.backends
    b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark = values


def test_backend_switches_apply_to_the_block_and_are_restored_even_on_error():
    """The trainer's CUDA scope, exercised on the CPU build (the switches are plain attributes there)."""
    saved = _switches()
    try:
        _set_switches((False, False, False))
        with backend_switches("cuda", tf32=True):
            assert _switches() == (True, True, True)
        assert _switches() == (False, False, False)
        _set_switches((True, True, False))
        with pytest.raises(RuntimeError):
            with backend_switches("cuda:0", tf32=False):
                assert _switches() == (False, False, True)
                raise RuntimeError("a failing iteration")
        assert _switches() == (True, True, False)
        with backend_switches("cpu", tf32=False):     # off CUDA nothing is touched
            assert _switches() == (True, True, False)
    finally:
        _set_switches(saved)


def test_a_cpu_run_leaves_tf32_and_cudnn_benchmark_as_the_caller_set_them(data, tmp_path):
    saved = _switches()
    try:
        for caller in ((True, False, True), (False, True, False)):
            _set_switches(caller)
            tr = Trainer(_cfg(data, tmp_path / "o", kimg=0.016, tf32=not caller[0]), write_outputs=False,
                         log=lambda s: None)
            seen = _record_during_forward(tr.G.synthesis, _switches)
            tr.run()
            assert seen and set(seen) == {caller}
            assert _switches() == caller
    finally:
        _set_switches(saved)


# -- snapshot_ema ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def snapshot_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "run"
    summary = Trainer(_cfg(data, out, kimg=0.048, snapshot_kimg=0.024, snapshot_ema=True, log_every=2),
                      log=lambda s: None).run()
    return out, summary


def test_snapshot_ema_writes_loadable_fp16_generators_with_their_kimg(snapshot_run):
    from models.stylegan import load_generator

    out, summary = snapshot_run
    files = sorted((out / SNAPSHOT_DIR).glob("G_ema-*kimg.safetensors"))
    # Snapshots are named by whole kimg: the 0.024 and the final 0.048 kimg ones share a name,
    # the last write wins.
    assert [f.name for f in files] == ["G_ema-000000kimg.safetensors"]
    side = json.loads(files[0].with_suffix(".json").read_text())
    assert side["dtype"] == "float16"
    assert side["metadata"]["kimg"] == summary["kimg"] == 0.048 and side["metadata"]["step"] == 6
    loaded = load_generator(files[0])
    assert loaded.config["metadata"]["kimg"] == 0.048
    # It is this run's G_ema (rounded to fp16), not some other generator.
    _, tensors = ckpt.load_checkpoint(out)
    sd = loaded.G.state_dict()
    for k, t in tensors["G_ema"].items():
        if t.is_floating_point():
            torch.testing.assert_close(sd[k], t.half().float(), rtol=0, atol=0, msg=k)
    with torch.no_grad():
        img = loaded.G(torch.randn(2, loaded.G.z_dim), None, noise_mode="const")
    assert img.shape == (2, 3, 16, 16) and torch.isfinite(img).all()


def test_a_run_folder_with_snapshots_still_verifies_and_resumes(snapshot_run, tmp_path):
    out, _ = snapshot_run
    run = tmp_path / "copy"
    shutil.copytree(out, run)
    doc = ckpt.read_state(run)
    ckpt.verify(run, doc)                          # snapshots/ is beside, not part of, the checkpoint
    assert not any(f.startswith(SNAPSHOT_DIR) for f in doc["listing"])
    tr = Trainer(_cfg(None, run, kimg=0.064), resume=run, log=lambda s: None)
    assert tr.step == 6 and tr.cfg.snapshot_ema     # the run's setting comes back with it
    assert tr.run()["iterations"] == 8
    kimgs = [json.loads(p.read_text())["metadata"]["kimg"] for p in (run / SNAPSHOT_DIR).glob("*.json")]
    assert kimgs == [0.064]


# -- bench ladder --------------------------------------------------------------------------------------------

def test_bench_reports_each_configuration_as_it_goes_and_records_a_failing_one(data, tmp_path, monkeypatch):
    """Base batch 3 is no multiple of the tiny D's minibatch-stddev group (2): plain-fp32 is refused
    by the real config check; batch-x2 (6) trains. The ladder keeps going and says what failed."""
    monkeypatch.chdir(tmp_path)                     # the bench's dataset cache folder is relative
    cfg = build_config("tiny", 16, data=str(data), out=str(tmp_path / "b"), device="cpu", batch=3)
    reports, lines = [], []
    report = run_bench(cfg, seconds=0.0, warmup_seconds=0.0, configs=["plain-fp32", "batch-x2"],
                       log=lines.append, on_result=lambda r: reports.append(json.loads(json.dumps(r))))
    assert [list(r["configs"]) for r in reports] == [["plain-fp32"], ["plain-fp32", "batch-x2"]]
    failed = reports[0]["configs"]["plain-fp32"]
    assert failed["error"].startswith("InputError") and "minibatch-stddev group size 2" in failed["error"]
    assert failed["img_s"] == 0.0 and failed["batch"] == 3
    ok = report["configs"]["batch-x2"]
    assert "error" not in ok and ok["batch"] == 6 and ok["img_s"] > 0 and ok["iterations"] >= 10
    assert ok["loss_G_finite"]
    assert "speedup_vs_plain_fp32" not in ok        # no baseline to compare with
    assert any("plain-fp32" in ln and "failed" in ln and "minibatch-stddev" in ln for ln in lines)


def test_bench_refuses_unknown_configurations(data):
    cfg = build_config("tiny", 16, data=str(data), device="cpu")
    with pytest.raises(InputError, match=r"unknown bench configuration\(s\) fast-opz; known: plain-fp32"):
        run_bench(cfg, seconds=0.0, warmup_seconds=0.0, configs=["plain-fp32", "fast-opz"])


# -- scripts/snapshot_strip.py ----------------------------------------------------------------------------

def _strip_script():
    spec = importlib.util.spec_from_file_location("snapshot_strip", ROOT / "scripts" / "snapshot_strip.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_snapshot_strip_renders_one_row_per_snapshot(snapshot_run, tmp_path):
    from models.stylegan import load_generator, save_generator
    from training.dataset import to_uint8_hwc

    strip = _strip_script()
    out, _ = snapshot_run
    # The run's own snapshot, plus two more written the way the trainer writes them.
    folder = tmp_path / "snaps"
    shutil.copytree(out / SNAPSHOT_DIR, folder)
    cfg = finalize(build_config("tiny", 16), 16)
    for seed, kimg in ((1, 200), (2, 400)):
        torch.manual_seed(seed)
        G, _ = build_networks(cfg)
        save_generator(G, folder / f"G_ema-{kimg:06d}kimg.safetensors", "stylegan2", dtype="fp16",
                       metadata={"kimg": kimg})
    png = tmp_path / "strip" / "strip.png"
    assert strip.main([str(folder), str(png), "--device", "cpu", "--rows", "2", "--seeds", "3"]) == 0
    img = np.asarray(Image.open(png).convert("RGB"))
    label_w = 72
    assert img.shape == (2 * 16, label_w + 3 * 16, 3)   # first and last of 3 snapshots, 3 seeds each
    assert (img[:, :label_w] < 128).any()                # the kimg labels
    # Each row is its snapshot rendered as the studio renders seeds 0..2 at psi 0.7. The file is
    # loaded again here, so allow one 8-bit level where a float lands on a rounding boundary.
    z = torch.from_numpy(np.concatenate([np.random.RandomState(s).randn(1, 32) for s in range(3)])).float()
    for r, name in enumerate(("G_ema-000000kimg", "G_ema-000400kimg")):
        G = load_generator(folder / f"{name}.safetensors").G
        with torch.no_grad():
            want = to_uint8_hwc(G(z, None, truncation_psi=0.7, noise_mode="const"))
        diff = np.abs(img[r * 16:(r + 1) * 16, label_w:].astype(int) - np.concatenate(list(want), axis=1).astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.05, (name, diff.max(), diff.mean())

    assert strip.main([str(out / SNAPSHOT_DIR), str(tmp_path / "one.png"), "--device", "cpu", "--seeds", "2"]) == 0
    assert Image.open(tmp_path / "one.png").size == (label_w + 2 * 16, 16)


def test_snapshot_strip_on_a_folder_without_snapshots_says_so(tmp_path, capsys):
    strip = _strip_script()
    (tmp_path / "empty").mkdir()
    assert strip.main([str(tmp_path / "empty"), str(tmp_path / "s.png"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no G_ema-*kimg.safetensors" in err and "--snapshot-ema" in err
    assert not (tmp_path / "s.png").exists()
