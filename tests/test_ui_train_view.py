"""The Train tab's pure parts: status and warnings HTML, the plots' frames (no Gradio, no processes)."""
from __future__ import annotations

import math
from pathlib import Path

from training.runs import FAILED, RUNNING, STOPPED, RunStatus
from ui import train_view


def records(n: int = 10) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        out.append({"kind": "train", "kimg": i * 0.1, "loss_G": 1.0 + i, "loss_D": 0.5, "r1": 0.01 * i,
                    "gp": None, "pl": float("nan") if i == 3 else 0.2, "d_acc_real": 1.0, "d_acc_fake": 0.9,
                    "aug_p": 0.01 * i})
        if i % 5 == 0:
            out.append({"kind": "monitor", "kimg": i * 0.1, "diversity": 0.8, "duplicate_rate": 0.0,
                        "d_acc": 0.97, "warnings": ["diversity dropped <sharply>"] if i == 10 else []})
    return out


def test_frames_hold_every_series_even_without_points():
    for frame, colors in zip(train_view.empty_frames(),
                             (train_view.LOSS_COLORS, train_view.REG_COLORS, train_view.MONITOR_COLORS)):
        assert set(frame["series"]) == set(colors) and frame["value"].isna().all()
        assert str(frame["kimg"].dtype) == "float64" and str(frame["value"].dtype) == "float64"
    recs = records()
    loss = train_view.loss_frame(recs)
    assert len(loss) == 20 and loss[loss.series == "G"]["value"].tolist()[:2] == [2.0, 3.0]
    reg = train_view.regularizer_frame(recs)
    assert (reg.series == "path length").sum() == 9                     # the NaN point is left out
    assert reg[reg.series == "GP"]["value"].isna().all()                 # an R1 run: GP kept, without points
    mon = train_view.monitor_frame(recs)
    acc = mon[mon.series == "D accuracy"]["value"]
    assert len(acc) == 10 and math.isclose(acc.iloc[0], 0.95)
    assert (mon.series == "diversity").sum() == 2


def test_long_runs_are_thinned_keeping_the_newest_point():
    recs = records(3000)
    g = train_view.loss_frame(recs).query("series == 'G'")
    assert len(g) == train_view.MAX_POINTS and g["kimg"].iloc[-1] == recs[-1]["kimg"]


def test_status_and_warnings_html():
    assert "No training run yet" in train_view.render_status(None)
    st = RunStatus(name="mine", folder=Path("/runs/mine"), state=RUNNING, message="training: 1.2 kimg", kimg=1.2,
                   total_kimg=10, img_s=512.0, eta_s=17.2, elapsed_s=30, started=1.0,
                   last_train={"loss_G": 1.5, "loss_D": 0.7, "aug_p": 0.125})
    html = train_view.render_status(st)
    assert "at-b-running" in html and "1.2 / 10" in html and "512.0" in html and "17 s" in html
    assert 'style="width:12.0%"' in html and "0.125" in html
    failed = RunStatus(name="bad", folder=Path("/runs/bad"), state=FAILED, message="could not read x.npy <oops>")
    html = train_view.render_status(failed)
    assert "at-b-failed" in html and "&lt;oops&gt;" in html and "at-train-error" in html
    st = RunStatus(name="mine", folder=Path("/runs/mine"), state=STOPPED,
                   warnings=[{"kimg": 0.1 * i, "text": f"w{i} <b>"} for i in range(5)],
                   countermeasures=[{"kimg": 0.4, "measure": "dropout", "detail": "dropout 0.3"}])
    warn = train_view.render_warnings(st)
    assert warn.index("w4") < warn.index("w3") and "w1" not in warn and "2 earlier" in warn
    assert "&lt;b&gt;" in warn and "dropout 0.3" in warn
    assert train_view.render_warnings(RunStatus(name="x", folder=Path("/x"), state=RUNNING)) == ""


def test_an_empty_plot_gets_fixed_axes_and_a_plot_with_points_its_own():
    for frame in train_view.empty_frames():
        assert train_view.plot_limits(frame) == {"x_lim": [0, 1], "y_lim": [0, 1]}   # not a 0-width "0.000000" axis
    recs = records()
    for frame in (train_view.loss_frame(recs), train_view.regularizer_frame(recs), train_view.monitor_frame(recs)):
        assert train_view.plot_limits(frame) == {"x_lim": None, "y_lim": None}


def test_the_train_tab_plots_start_with_those_axes_and_the_samples_caption_sits_above_the_image(tmp_path):
    import gradio as gr

    from core.settings import Settings
    from training.runs import TrainingRunManager
    from ui.train_tab import build_train_tab

    settings = Settings(output_dir=tmp_path / "out", cache_dir=tmp_path / "cache", models_dirs=())
    with gr.Blocks() as demo:
        backend, model = gr.Radio(["stylegan"], value="stylegan"), gr.Dropdown([], allow_custom_value=True)
        build_train_tab(settings, TrainingRunManager(tmp_path / "runs"), backend=backend, model=model,
                        model_update=lambda b, m: gr.skip(), add_model=lambda p: p)
    cfg = {c["props"].get("elem_id"): c for c in demo.get_config_file()["components"]}
    for plot in ("train-loss-plot", "train-reg-plot", "train-monitor-plot"):
        assert cfg[plot]["props"]["x_lim"] == [0, 1] and cfg[plot]["props"]["y_lim"] == [0, 1], plot
    assert cfg["train-samples"]["props"]["show_label"] is False          # no label badge over the grid
    assert "Latest samples" in cfg["train-samples-caption"]["props"]["value"]


def test_a_conditional_run_plots_its_class_diversity():
    recs = records()
    for r in recs:
        if r["kind"] == "monitor":
            r["class_diversity"] = 0.6 if r["kimg"] < 0.9 else 0.4
    mon = train_view.monitor_frame(recs)
    cd = mon[mon.series == "class diversity"]
    assert cd["value"].tolist() == [0.6, 0.4] and cd["kimg"].tolist() == [0.5, 1.0]
    # an unconditional run keeps the series, without points
    plain = train_view.monitor_frame(records())
    assert plain[plain.series == "class diversity"]["value"].isna().all()
