"""The trainer end to end on CPU through its CLI and API: WGAN-GP, D:G ratio, counter-measures, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.test_training_runs import write_tiny_dataset
from training import cli
from training.config import build_config, finalize
from training.trainer import Trainer, checkpoint_bytes, build_networks


def _data(tmp_path, n=24, res=16):
    return write_tiny_dataset(tmp_path, n, res)


def test_cli_wgan_gp_with_3_to_1_ratio(tmp_path, capsys):
    data = _data(tmp_path)
    out = tmp_path / "wgan"
    rc = cli.main(["--config", "tiny", "--data", str(data), "--out", str(out), "--kimg", "0.048",
                   "--loss", "wgan-gp", "--d-steps", "3", "--device", "cpu", "--log-every", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["iterations"] == 2                       # 3 D steps x batch 8 = 24 real images each
    state = json.loads((out / "state.json").read_text())
    assert state["config"]["optimizer"] == "wgan-gp" and state["d_updates"] == 6 and state["g_updates"] == 2
    assert state["optimizers"]["opt_G"]["class"] == "RAdam"
    assert state["optimizers"]["opt_G"]["param_groups"][0]["betas"] == [0.5 ** (4 / 5), 0.9 ** (4 / 5)]
    logs = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    train_logs = [r for r in logs if r["kind"] == "train"]
    assert all(r["gp"] is not None and np.isfinite(r["gp"]) for r in train_logs)
    assert (out / "samples.png").is_file()


@pytest.mark.parametrize("argv, msg", [
    (["--config", "tiny", "--data", "/nonexistent/x.npy"], "not found"),
    (["--config", "tiny", "--data", "{data}", "--batch", "7", "--device", "cpu"], "multiple of the minibatch"),
    (["--config", "tiny", "--data", "{data}", "--d-steps", "0", "--device", "cpu"], "D:G ratio"),
    (["--config", "tiny", "--data", "{data}", "--resume", "{tmp}/none", "--device", "cpu"], "no checkpoint"),
])
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, argv, msg):
    data = _data(tmp_path)
    argv = [a.format(data=data, tmp=tmp_path) for a in argv] + ["--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err


def test_emoji_preset_fits_the_shipping_budget():
    """The bundled model is G_ema in fp16 under 16 MiB; checkpoint files are split below 15 MiB."""
    from training.export import MAX_SHIPPED_BYTES

    cfg = finalize(build_config("emoji64"), 64)
    G, D = build_networks(cfg)
    assert 2 * sum(t.numel() for t in G.state_dict().values()) < MAX_SHIPPED_BYTES - 2**20
    sizes = checkpoint_bytes(G, D)
    assert sum(sizes.values()) > 15 * 2**20          # large enough that the 15 MiB file split matters
    assert cfg.g_kwargs["fused_modconv_default"] == "inference_only" and cfg.snapshot_ema


def test_cbase_cmax_set_both_networks():
    """--cbase/--cmax as NVlabs' train.py: the 2026-12-02 H200 run's wide emoji network."""
    ns = cli.build_parser().parse_args(["--preset", "emoji64", "--cbase", "8192", "--cmax", "256"])
    cfg = finalize(cli.config_from_args(ns), 64)
    assert cfg.g_kwargs["channel_max"] == cfg.d_kwargs["channel_max"] == 256
    G, D = build_networks(cfg)
    assert G.synthesis.b32.conv1.weight.shape[0] == 256 and G.synthesis.b64.conv1.weight.shape[0] == 128
    assert round(sum(p.numel() for p in G.parameters()) / 1e4) == 557          # 5.57 M, as in the run's log
    small = finalize(build_config("emoji64"), 64)
    assert small.g_kwargs["channel_max"] == 128 and small.d_kwargs["channel_max"] == 112


def test_countermeasures_apply_in_order_and_survive_resume(tmp_path):
    data = _data(tmp_path)
    cfg = build_config("tiny", 16, data=str(data), out=str(tmp_path / "cm"), kimg=0.064, device="cpu",
                       monitor_kimg=0.008, auto_countermeasures=True, monitor_samples=8, batch=8)
    tr = Trainer(cfg, log=lambda s: None)
    tr.monitor.settings.d_acc_threshold = -1.0     # every evaluation now reports a winning D
    tr.monitor.settings.patience = 1
    tr.run()
    applied = [a["measure"] for a in tr.monitor.state.applied]
    assert applied[:3] == ["augment", "dropout", "mbstd"], applied
    assert tr.runtime["d_dropout"] == 0.3 and isinstance(tr.D.b4.dropout, torch.nn.Dropout)
    assert tr.runtime["mbstd_group"] == 4 and tr.D.b4.mbstd.group_size == 4
    assert tr.ada.target == pytest.approx(0.7)
    monitor_lines = [json.loads(x) for x in (tmp_path / "cm" / "log.jsonl").read_text().splitlines()
                     if '"monitor"' in x]
    assert any("countermeasure" in r for r in monitor_lines)

    cfg2 = build_config("tiny", 16, data=str(data), out=str(tmp_path / "cm2"), kimg=0.072, device="cpu")
    tr2 = Trainer(cfg2, resume=tmp_path / "cm", log=lambda s: None)
    assert tr2.runtime == tr.runtime and tr2.D.b4.dropout is not None and tr2.D.b4.mbstd.group_size == 4
    assert tr2.ada.target == pytest.approx(tr.ada.target)
    assert tr2.cfg.auto_countermeasures is True     # the saved config, not cfg2's default


def test_sigterm_stops_at_a_log_point_with_a_checkpoint(tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    data = _data(tmp_path)
    out = tmp_path / "sig"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "training.cli", "--config", "tiny", "--data", str(data),
                             "--out", str(out), "--kimg", "1000", "--device", "cpu", "--log-every", "1"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "log.jsonl").is_file() and time.time() < deadline:
        time.sleep(0.2)
    proc.terminate()
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert json.loads(stdout.strip().splitlines()[-1])["stop_reason"] == "stop requested"
    assert (out / "state.json").is_file() and (out / "samples.png").is_file()


def test_export_any_size_for_users_and_a_budget_for_bundled_models(tmp_path, capsys):
    from core.errors import InputError
    from models.stylegan import load_generator
    from training.export import export_run

    data = _data(tmp_path)
    run = tmp_path / "run"
    assert cli.main(["--config", "tiny", "--data", str(data), "--out", str(run), "--kimg", "0.016",
                     "--device", "cpu"]) == 0
    capsys.readouterr()
    # the CLI path (a user's own model): no size cap, loads in the studio's format
    assert cli.main(["--export", str(run), "--to", str(tmp_path / "models" / "mine")]) == 0
    loaded = load_generator(tmp_path / "models" / "mine.safetensors")
    assert loaded.G.img_resolution == 16
    # the bundled-model path: over the budget is refused and leaves no half-written model behind
    with pytest.raises(InputError, match="budget for bundled models"):
        export_run(run, tmp_path / "bundled" / "tiny", max_bytes=1024)
    assert not (tmp_path / "bundled" / "tiny.safetensors").exists()


def test_dali_setting_of_old_runs_and_scripts_is_accepted_and_has_no_effect(tmp_path, capsys):
    """DALI decoding was removed; old state.json files say `"dali": true` and old scripts pass --no-dali."""
    from training.config import TrainConfig

    saved = {**TrainConfig().to_dict(), "dali": True}
    assert "dali" not in TrainConfig.from_dict(saved).to_dict()
    assert "dali" not in build_config("tiny", 16, dali=False).to_dict()
    data = _data(tmp_path)
    rc = cli.main(["--config", "tiny", "--data", str(data), "--out", str(tmp_path / "o"), "--device", "cpu",
                   "--no-dali", "--batch", "7"])
    err = capsys.readouterr().err
    assert rc == 2 and "multiple of the minibatch" in err        # parsed as far as the real check
    assert "--no-dali has no effect" in err
