"""The studio's Train tab: start and stop a StyleGAN training run, watch it live, export it.

Training runs in a child process (`training.runs.TrainingRunManager`), never in the
generation queue: the tab starts it, a `gr.Timer` polls its files about once a second
while it runs (log.jsonl read incrementally, samples.png when it changes), and Stop sends
SIGTERM so the trainer saves a checkpoint first. One run at a time for the whole studio
(it takes the GPU); any tab may watch or stop it.

`build_train_tab(...)` is called inside the studio's `gr.Tabs`; it lays out the tab and
wires its events (every one with an `api_name`).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gradio as gr

from core.errors import AtelierError
from core.settings import Settings
from training.config import AUG_MODES, AUG_PIPES, LOSSES, PRESETS
from training.runs import TrainingRunManager, TrainRequest, generator_files, generator_info
from ui import train_view

log = logging.getLogger("atelier.ui")
TICK_S = 1.0                      # live view refresh while a run is going on

GPU_NOTE = ("Training runs as a separate process on the same GPU as generation: while it trains, images take "
            "longer and both share the GPU's memory. One run at a time; Stop saves a checkpoint first "
            "(at the trainer's next log point).")

# the start event's inputs, in the order of `train_start`'s parameters (its API signature)
START_FIELDS = ("data", "preset", "resolution", "kimg", "minutes", "batch", "loss", "d_steps", "aug", "aug_p",
                "auto_countermeasures", "name", "resume", "monitor_kimg", "log_every", "aug_pipe", "ada_max_p",
                "retune", "cond", "labels", "init_g", "freeze_g_kimg", "class_balance", "noisy_twins",
                "noisy_twins_sigma")
# "" is the preset's pipe (bgc; emoji64 upright): an untouched control never overrides a preset
PIPE_CHOICES = [("preset's", "")] + [(p, p) for p in AUG_PIPES]

INIT_NOTE = ("For a model whose run folder (its checkpoint) is gone, or one shared as a generator only: G starts "
             "from the file, **D starts fresh**, and the counters continue from the file's kimg, so *Length* "
             "counts from there too (a 3,500 kimg model and Length 5,000 train 1,500 kimg). A fresh D against a "
             "trained G spoils its detail: **train D alone first**, e.g. 400 kimg. The run builds the generator's "
             "network (size, width, classes), so pick the preset it was trained with. A run that still has its "
             "checkpoint: tick *Resume it* instead.")
BALANCE_INFO = ("0 = classes as often as your images have them, 0.5 = square-root (small classes more often), "
                "1 = every class equally often; only for class-conditional runs (a class key)")
TWINS_INFO = "keeps each class's pictures varied (NoisyTwins); 0 = off, the paper's 0.001-0.01; needs a class key"
TWINS_SIGMA_INFO = "std of NoisyTwins' noise on the class embedding; 0 = the trainer's 0.25"


@dataclass
class TrainView:
    """What this browser session's Train tab shows now, so a timer tick sends only what changed."""

    run: str | None = None
    version: int = -1                       # log records drawn (TrainingRunManager.log_version)
    samples_mtime: float | None = None
    timer_on: bool = False
    image_shown: bool = False

    def __deepcopy__(self, memo):
        return TrainView()

    def watch(self, run: str | None) -> None:
        if run != self.run:
            self.run, self.version, self.samples_mtime = run, -1, None


def new_train_view() -> TrainView:
    return TrainView()


def runs_folder(settings: Settings) -> Path:
    """settings.runs_dir, else a `runs` folder next to the output folder."""
    explicit = getattr(settings, "runs_dir", None)
    return Path(explicit) if explicit else Path(settings.output_dir).parent / "runs"


def export_folder(settings: Settings) -> Path:
    """Where exported models go: the first model folder the catalogue scans (models_local by default)."""
    return Path(settings.models_dirs[0]) if settings.models_dirs else runs_folder(settings).parent / "models_local"


def make_manager(settings: Settings) -> TrainingRunManager:
    device = settings.device if settings.device not in (None, "", "auto") else None
    return TrainingRunManager(runs_folder(settings), device=device)


def _snapshot(samples: Path, run: str) -> str | None:
    """A complete copy of samples.png in the temp folder (the trainer may be rewriting it), or None."""
    from PIL import Image

    try:
        data = samples.read_bytes()
        import io

        with Image.open(io.BytesIO(data)) as im:
            im.load()                       # a half-written PNG fails here; the next tick tries again
    except Exception:
        return None
    folder = Path(tempfile.gettempdir()) / "atelier-train-samples"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{run}-*.png"):           # keep the folder small: older copies of this run
        if time.time() - old.stat().st_mtime > 60:
            old.unlink(missing_ok=True)
    out = folder / f"{run}-{time.time_ns()}.png"
    out.write_bytes(data)
    return str(out)


def generator_folders(settings: Settings) -> list[Path]:
    """Where the generators a run may start from are: the bundled models, then the studio's model folders
    (the Train tab exports into the first)."""
    folders = [Path(settings.assets_dir) / "models", *map(Path, settings.models_dirs), export_folder(settings)]
    return list(dict.fromkeys(folders))


def generator_choices(settings: Settings) -> list[tuple[str, str]]:
    """The generator picker's (label, value) pairs: "" = none, then each known generator by name (never a
    server path: public visitors see these) with the kimg it was trained for."""
    out = [("none: a new G", "")]
    for name, path in generator_files(generator_folders(settings)).items():
        try:
            kimg = generator_info(path)["kimg"]
        except AtelierError:
            continue
        out.append((f"{name} ({kimg:g} kimg)" if kimg is not None else name, name))
    return out


def _check_visitor_data(settings: Settings, data: str,
                        what: str = "Training data must be a folder or file") -> str:
    """Public mode (with --allow train): training data only from the host's data folders, named by
    visitors relative to one of them; nothing else on the server is reachable."""
    roots = [Path(d).resolve() for d in settings.data_dirs]
    if not roots:
        raise gr.Error("Training is allowed on this studio, but the host has named no data folder "
                       "(--data-dir or ATELIER_DATA_DIRS).")
    rel = data.strip()
    for root in roots:
        candidate = (root / rel).resolve()
        if rel and candidate.is_relative_to(root) and candidate.exists():
            return str(candidate)
    names = ", ".join(r.name for r in roots)
    raise gr.Error(f"{what} inside the host's data folders ({names}), named relative to one of them.")


def build_train_tab(settings: Settings, manager: TrainingRunManager, *, backend: gr.Radio, model: gr.Dropdown,
                    model_update: Callable[[str, str | None], object], add_model: Callable[[str], str]) -> gr.Tab:
    """Lay out the Train tab (inside an open gr.Tabs) and wire it. `model_update(backend, select)` returns the
    picker's update listing `select`; `add_model(path)` makes an exported file known to the catalogue."""
    C: dict = {}
    with gr.Tab("Train", id="train", elem_id="train-tab") as tab:
        view = gr.State(new_train_view)     # a factory: one view per browser session
        with gr.Row(elem_id="train-main", equal_height=False):
            with gr.Column(scale=4, min_width=330, elem_id="train-controls"):
                C["data"] = gr.Textbox("", label="Training data", elem_id="train-data",
                                       placeholder=("my_images  (in the host's data folders: "
                                                    + ", ".join(Path(d).name for d in settings.data_dirs) + ")")
                                       if settings.public else
                                       "/data/my_images  (a folder, a .zip, or an .npy/.npz array)",
                                       info="a folder or file in the host's data folders" if settings.public
                                       else "a path on the studio's machine")
                with gr.Row():
                    C["preset"] = gr.Dropdown(list(PRESETS), value="stylegan2", label="Preset", elem_id="train-preset",
                                              scale=2, min_width=120)
                    C["resolution"] = gr.Number(0, label="Resolution", precision=0, elem_id="train-resolution",
                                                minimum=0, scale=1, min_width=90, info="0 = the data's")
                    C["batch"] = gr.Number(0, label="Batch", precision=0, elem_id="train-batch", minimum=0, scale=1,
                                           min_width=90, info="0 = preset's")
                with gr.Row():
                    C["kimg"] = gr.Number(1000, label="Length (kimg)", elem_id="train-kimg", minimum=0,
                                          info="thousand real images shown to D")
                    C["minutes"] = gr.Number(0, label="or minutes", elem_id="train-minutes", minimum=0,
                                             info="time budget; 0 = none")
                with gr.Row():
                    C["loss"] = gr.Radio([("R1", "r1"), ("WGAN-GP", "wgan-gp")], value="r1", label="Loss",
                                         elem_id="train-loss")
                    C["aug"] = gr.Radio([("ADA", "ada"), ("fixed", "fixed"), ("off", "none")], value="ada",
                                        label="Augmentation", elem_id="train-aug")
                with gr.Row():
                    C["d_steps"] = gr.Slider(0, 10, value=0, step=1, label="D:G ratio", elem_id="train-d-steps",
                                             info="D steps per G step; 0 = the loss's")
                    C["aug_p"] = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Augmentation p",
                                           elem_id="train-aug-p", info="ADA's start, or fixed")
                with gr.Row():
                    C["aug_pipe"] = gr.Dropdown(PIPE_CHOICES, value="", label="Augmentation pipe",
                                                elem_id="train-aug-pipe",
                                                info="upright: no flips or rotations (emoji, text, logos)")
                    C["ada_max_p"] = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Max p",
                                               elem_id="train-ada-max-p", info="cap on ADA's p; 0 = preset's")
                C["auto_countermeasures"] = gr.Checkbox(
                    False, label="Automatic counter-measures", elem_id="train-auto-cm",
                    info="on a monitor warning: more augmentation, D dropout, larger mbstd group or more D steps")
                with gr.Row():
                    C["name"] = gr.Textbox("", label="Run name", placeholder="empty = preset-date-time",
                                           elem_id="train-name", scale=3)
                    C["resume"] = gr.Checkbox(False, label="Resume it", elem_id="train-resume", scale=1,
                                              min_width=100, info="from its checkpoint")
                    C["retune"] = gr.Checkbox(False, label="Retune", elem_id="train-retune", scale=1, min_width=100,
                                              info="take this recipe")
                with gr.Accordion("Classes (conditional)", open=False, elem_id="train-classes"):
                    with gr.Row():
                        C["cond"] = gr.Textbox("", label="Class key", elem_id="train-cond", scale=1,
                                               placeholder="empty = unconditional",
                                               info="emoji64: group (10) or class (98); any name for NVlabs' "
                                                    "dataset.json")
                        C["labels"] = gr.Textbox("", label="Labels file", elem_id="train-labels", scale=2,
                                                 placeholder="empty = the preset's, or the data's dataset.json",
                                                 info="JSON: per-image class indices under the key, or NVlabs' "
                                                      "dataset.json")
                    C["class_balance"] = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label="Class balance",
                                                   elem_id="train-class-balance", info=BALANCE_INFO)
                    with gr.Row():
                        # Numbers, not sliders: the paper's weights span 0.001 to 0.01, too fine for a slider
                        C["noisy_twins"] = gr.Number(0, label="NoisyTwins weight", minimum=0, step=0.001,
                                                     elem_id="train-noisy-twins", info=TWINS_INFO)
                        C["noisy_twins_sigma"] = gr.Number(0, label="Twins noise", minimum=0, step=0.05,
                                                           elem_id="train-noisy-twins-sigma", info=TWINS_SIGMA_INFO)
                with gr.Accordion("Start from a trained generator", open=False, elem_id="train-init") as init_box:
                    gr.Markdown(INIT_NOTE, elem_id="train-init-note")
                    with gr.Row():
                        C["init_g"] = gr.Dropdown(generator_choices(settings), value="", label="Generator",
                                                  allow_custom_value=True, elem_id="train-init-g", scale=2,
                                                  info="one of the studio's models, or a .safetensors (with its "
                                                       ".json) in the host's data folders" if settings.public
                                                  else "one of the studio's models, or the path of a .safetensors "
                                                       "(with its .json), e.g. RUN/snapshots/G_ema-…kimg")
                        C["freeze_g_kimg"] = gr.Number(0, label="Train D alone first (kimg)", minimum=0,
                                                       elem_id="train-freeze-g-kimg", scale=1,
                                                       info="G fixed while the fresh D catches up; 0 = none")
                with gr.Accordion("Monitor and logging", open=False, elem_id="train-more"):
                    with gr.Row():
                        C["monitor_kimg"] = gr.Number(0, label="Monitor every (kimg)", elem_id="train-monitor-kimg",
                                                      minimum=0, info="0 = the preset's (stylegan2: 20)")
                        C["log_every"] = gr.Number(0, label="Log every (iterations)", precision=0, minimum=0,
                                                   elem_id="train-log-every", info="0 = the preset's (100)")
                with gr.Row(elem_id="train-actions"):
                    start_btn = gr.Button("Start training", variant="primary", elem_id="train-start-btn", scale=3)
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="train-stop-btn", scale=1)
                gr.Markdown(GPU_NOTE, elem_id="train-gpu-note", elem_classes=["at-note-box"])

            with gr.Column(scale=8, min_width=420, elem_id="train-live"):
                with gr.Row(equal_height=True):
                    run_select = gr.Dropdown([], value=None, label="Run", elem_id="train-run-select", scale=6,
                                             allow_custom_value=True)
                    runs_btn = gr.Button("↻", elem_id="train-runs-refresh", scale=0, min_width=44, size="sm")
                status_html = gr.HTML(train_view.render_status(None), elem_id="train-status")
                warnings_html = gr.HTML("", elem_id="train-warnings")
                frames = train_view.empty_frames()
                plot = dict(x="kimg", y="value", color="series", color_title="", x_title="kimg", height=220,
                            show_label=False)
                with gr.Row():
                    loss_plot = gr.LinePlot(frames[0], title="Losses", y_title="loss", elem_id="train-loss-plot",
                                            color_map=train_view.LOSS_COLORS,
                                            **train_view.plot_limits(frames[0]), **plot)
                    reg_plot = gr.LinePlot(frames[1], title="R1 / GP / path length", y_title="penalty",
                                           elem_id="train-reg-plot", color_map=train_view.REG_COLORS,
                                           **train_view.plot_limits(frames[1]), **plot)
                with gr.Row():
                    monitor_plot = gr.LinePlot(frames[2], title="Monitor",
                                               y_title="fraction", elem_id="train-monitor-plot",
                                               color_map=train_view.MONITOR_COLORS,
                                               **train_view.plot_limits(frames[2]), **plot)
                    # the caption above the grid, not Gradio's label badge, which sits on the image's top left
                    with gr.Column(elem_id="train-samples-box"):
                        gr.Markdown(train_view.SAMPLES_CAPTION, elem_id="train-samples-caption")
                        samples = gr.Image(None, label="Latest samples (samples.png)", show_label=False,
                                           interactive=False, height=260, type="filepath", elem_id="train-samples",
                                           buttons=["fullscreen"])
                with gr.Row(equal_height=False, elem_id="train-export-row"):
                    export_name = gr.Textbox("", label="Model name", placeholder="empty = RUN-KIMGkimg",
                                             elem_id="train-export-name", scale=3)
                    export_btn = gr.Button("Export to studio", elem_id="train-export-btn", scale=2, min_width=140)
                export_status = gr.Markdown("", elem_id="train-export-status")
                with gr.Accordion("Raw status", open=False, elem_id="train-raw"):
                    status_json = gr.JSON(label="Status", elem_id="train-status-json")
        timer = gr.Timer(TICK_S, active=False)

    # -- handlers ------------------------------------------------------------------------------
    def pick_run(select: str | None = None) -> tuple[list[str], str | None]:
        names = manager.runs()
        return names, (select if select in names else (manager.active() or (names[0] if names else None)))

    def runs_update(select: str | None = None):
        names, value = pick_run(select)
        return gr.Dropdown(choices=names, value=value)

    def train_start(data="", preset="stylegan2", resolution=0, kimg=0, minutes=0, batch=0, loss="r1", d_steps=0,
                    aug="ada", aug_p=0.0, auto_countermeasures=False, name="", resume=False, monitor_kimg=0,
                    log_every=0, aug_pipe="", ada_max_p=0.0, retune=False, cond="", labels="", init_g="",
                    freeze_g_kimg=0.0, class_balance=0.0, noisy_twins=0.0, noisy_twins_sigma=0.0,
                    view: TrainView = None):
        """Start a training run in a separate process; the live view follows it. `cond` (a class key) trains a
        class-conditional model on the labels under that key of `labels` (or of the data set's dataset.json).
        `init_g` (a generator's name in the picker, or a path) starts a new run's G from that exported generator,
        D fresh; `freeze_g_kimg` trains D alone for the run's first N kimg. `class_balance` (0..1, with a class key)
        evens out how often the classes are trained: 0 = the data's proportions, 0.5 = square root, 1 = equal.
        `noisy_twins` (a weight, with a class key; 0 = off, the paper's 0.001-0.01) adds NoisyTwins against
        class-wise mode collapse, with class-embedding noise of std `noisy_twins_sigma` (0 = the trainer's 0.25)."""
        if settings.public:
            data = _check_visitor_data(settings, str(data or ""))
            if str(labels or "").strip():
                labels = _check_visitor_data(settings, str(labels))
        init_g = str(init_g or "").strip()
        known = generator_files(generator_folders(settings)) if init_g else {}
        if init_g in known:
            init_g = str(known[init_g])
        elif init_g and settings.public:
            init_g = _check_visitor_data(settings, init_g, "The generator must be one of the listed models, "
                                                           "or a .safetensors file")
        try:
            req = TrainRequest(data=str(data or ""), preset=preset or "stylegan2", resolution=int(resolution or 0),
                               kimg=float(kimg or 0), minutes=float(minutes or 0), batch=int(batch or 0),
                               loss=loss or "r1", d_steps=int(d_steps or 0), aug=aug or "ada",
                               aug_p=float(aug_p or 0), auto_countermeasures=bool(auto_countermeasures),
                               name=str(name or "").strip(), resume=bool(resume),
                               monitor_kimg=float(monitor_kimg or 0), log_every=int(log_every or 0),
                               aug_pipe=str(aug_pipe or ""), ada_max_p=float(ada_max_p or 0), retune=bool(retune),
                               cond=str(cond or "").strip(), labels=str(labels or "").strip(), init_g=init_g,
                               freeze_g_kimg=float(freeze_g_kimg or 0), class_balance=float(class_balance or 0),
                               noisy_twins=float(noisy_twins or 0), noisy_twins_sigma=float(noisy_twins_sigma or 0))
            st = manager.start(req)
        except AtelierError as exc:
            raise gr.Error(str(exc)) from None
        if req.auto_countermeasures and not monitor_kimg and preset == "tiny":
            gr.Warning("Automatic counter-measures act on the monitor's warnings, and the tiny preset has the "
                       "monitor off: set 'Monitor every (kimg)' for them to do anything.")
        if req.aug == "none" and (req.aug_pipe or req.ada_max_p):
            gr.Warning("Augmentation is off, so the augmentation pipe and Max p do nothing in this run.")
        if req.freeze_g_kimg and not req.init_g:
            gr.Warning("'Train D alone first' is for a run that starts from a trained generator: without one, "
                       "G stays at its random start for those kimg.")
        if req.noisy_twins_sigma and not req.noisy_twins and not req.resume:
            # (on a resume with Retune the noise alone retunes a run that has NoisyTwins on)
            gr.Warning("Twins noise is NoisyTwins' noise: with a NoisyTwins weight of 0 it does nothing in this run.")
        if st.request.get("cbase") and st.request.get("cmax"):      # the form has no width: the generator's
            gr.Info(f"The run builds the generator's network width (channel base {st.request['cbase']}, most "
                    f"channels {st.request['cmax']}, for G and D), not the {req.preset} preset's.")
        view.watch(st.name)
        view.timer_on = True
        return runs_update(st.name), train_view.render_status(st), gr.Timer(TICK_S, active=True)

    def train_stop(view: TrainView = None):
        """Stop the training run (SIGTERM: it saves a checkpoint at its next log point; SIGKILL after a grace period)."""
        try:
            st = manager.stop()
        except AtelierError as exc:
            raise gr.Error(str(exc)) from None
        view.watch(st.name)
        view.timer_on = True            # keep polling until it has exited
        return train_view.render_status(st), gr.Timer(TICK_S, active=True)

    def train_status(run: str | None = None, view: TrainView = None):
        """The live view of `run` (default: the run going on, else the newest): status, warnings, plots,
        samples, raw status, and the timer (on while the run is active)."""
        skip = gr.skip()
        names = manager.runs()
        name = run if run in names else (manager.active() or next(iter(names), None))   # (a deleted run: the newest)
        if name is None:
            view.timer_on = False
            return (train_view.render_status(None), "", skip, skip, skip, skip, None, gr.Timer(active=False))
        try:
            st = manager.status(name)
            records = manager.records(name)
            version = manager.log_version(name)
        except AtelierError as exc:
            raise gr.Error(str(exc)) from None
        view.watch(name)
        plots = (skip, skip, skip)
        if version != view.version:
            view.version = version
            frames = (train_view.loss_frame(records), train_view.regularizer_frame(records),
                      train_view.monitor_frame(records))
            plots = tuple(gr.LinePlot(value=f, **train_view.plot_limits(f)) for f in frames)
        image = skip
        if st.samples is not None:
            mtime = st.samples.stat().st_mtime
            if mtime != view.samples_mtime:
                snap = _snapshot(st.samples, name)
                if snap is not None:
                    view.samples_mtime = mtime
                    view.image_shown = True
                    image = snap
        elif view.image_shown:         # another run's grid is on show
            view.image_shown = False
            image = None
        timer_update = skip
        if st.active != view.timer_on:
            view.timer_on = st.active
            timer_update = gr.Timer(TICK_S, active=st.active)
        return (train_view.render_status(st), train_view.render_warnings(st), *plots, image, st.to_dict(),
                timer_update)

    def train_generators(current: str = ""):
        """The generators a new run may start from (the bundled and exported models), listed again."""
        return gr.Dropdown(choices=generator_choices(settings), value=current or "")

    def train_runs(run: str | None = None):
        """The runs in the runs folder, newest first (the run going on is selected)."""
        return runs_update(run)

    def train_open(run: str | None, view: TrainView = None):
        """Opening the tab: list the runs, pick the one going on (or keep the selection), show it."""
        names, value = pick_run(run)
        view.watch(None)                # redraw everything for the run shown
        return (gr.Dropdown(choices=names, value=value), *train_status(value, view))

    def train_export(run: str | None, model_name: str = "", backend_value: str = "stylegan"):
        """Export the run's G_ema to the studio's model folder (fp16 safetensors + JSON + model card)."""
        if not run:
            raise gr.Error("Pick a run to export first.")
        try:
            st = manager.status(run)
            stem = (model_name or "").strip() or f"{run}-{st.kimg:g}kimg"
            dest = export_folder(settings)
            if (dest / f"{stem}.safetensors").exists():
                raise gr.Error(f"A model named {stem!r} is already in {dest}; type another model name.")
            paths = manager.export(run, dest, stem=stem)
        except AtelierError as exc:
            raise gr.Error(str(exc)) from None
        model_id = add_model(str(paths["weights"]))
        where = "" if backend_value == "stylegan" else " Switch the backend to StyleGAN to use it."
        msg = (f"Exported **{stem}** ({st.kimg:g} kimg) to `{paths['weights']}` and selected it in the model picker."
               if backend_value == "stylegan" else f"Exported **{stem}** to `{paths['weights']}`.{where}")
        pick = model_update(backend_value, model_id) if backend_value == "stylegan" else gr.skip()
        return msg, pick

    # -- wiring --------------------------------------------------------------------------------
    fast = dict(queue=False, show_progress="hidden")
    live_outputs = [status_html, warnings_html, loss_plot, reg_plot, monitor_plot, samples, status_json, timer]
    start_inputs = [C[k] for k in START_FIELDS] + [view]
    # queued (not in the GPU queue: training is its own process), one start at a time
    start_btn.click(train_start, start_inputs, [run_select, status_html, timer], api_name="train_start",
                    concurrency_id="train", concurrency_limit=1, show_progress="hidden"
                    ).success(train_status, [run_select, view], live_outputs, api_name="train_started", **fast)
    stop_btn.click(train_stop, view, [status_html, timer], api_name="train_stop", **fast)
    timer.tick(train_status, [run_select, view], live_outputs, api_name="train_status", **fast)
    run_select.input(train_status, [run_select, view], live_outputs, api_name="train_select", **fast)
    runs_btn.click(train_runs, run_select, run_select, api_name="train_runs", **fast)
    tab.select(train_open, [run_select, view], [run_select] + live_outputs, api_name="train_open", **fast)
    export_btn.click(train_export, [run_select, export_name, backend], [export_status, model],
                     api_name="train_export", concurrency_id="train-export", concurrency_limit=1
                     ).success(train_generators, C["init_g"], C["init_g"], api_name="train_exported", **fast)
    init_box.expand(train_generators, C["init_g"], C["init_g"], api_name="train_generators", **fast)
    tab.atelier_manager = manager
    return tab
