"""The studio page: controls, gallery, PNG info, and the live side panel.

`build_app(services)` makes the Blocks; `launch(services)` serves it with the
host, port, share, auth and queue size from `services.settings`. The handlers are
top-level functions in `ui/handlers.py`; what they share (`services` and a
`StudioRuntime` made here) reaches them as a `StudioContext` bound when the page is
wired: there is no module-level model, option or queue. Generate and Compare read
the controls as one `StudioForm` (`ui/form.py`).

Serving rules:
- every GPU event runs in one queue (`concurrency_id="gpu"`, limit 1);
- Stop, the panel timer and other light events skip the queue (`queue=False`),
  so they answer at once while a job runs;
- every event has an `api_name`, so `gradio_client` can drive the studio.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import gradio as gr

from pipelines.services import Services
from telemetry.metrics import CONTENT_TYPE_LATEST
from ui import history, panel, startup_check, zerogpu
from ui.access import AccessGuard, LoginLimiter, share_warning
from ui.controls import DEFAULT_SEED_TEXT, MEMORY_SAVERS, PREVIEW_CHOICES, SIZE_PRESETS, seed_label
from ui.form import CONTROL_NAMES, check_components  # noqa: F401  (CONTROL_NAMES: tests)
# the handlers live in ui/handlers.py; these names stay importable from here (tests, scripts)
from ui.handlers import (ALREADY_RUNNING, FAST_TICK_S, MIX_LAYERS_UNKNOWN, NO_JOB, SLOW_TICK_S,  # noqa: F401
                         Restored, StudioContext, _availability, _entry_label, _model_choices, _scheduler_choices,
                         add_model, bind, class_choices, clear_history, compare, form_endpoint, generate, job_finished,
                         known_stylegan_model, list_models, mix_layer_sliders, mode_setter, model_defaults,
                         nothing_to_compare, page_load, page_unload, picker_update, prepare, prepare_compare,
                         read_dropped_png, read_png_info, record_history, render_nothing_to_compare,
                         restore_controls, reuse_seed, roll_seed, select_history, select_image, send_back,
                         send_png_params, show_history, stop, style_layer_count, switch_backend, telemetry)
from ui.runner import StudioRuntime
from ui.state import new_session
from ui.train_tab import build_train_tab, make_manager

log = logging.getLogger("atelier.ui")
ROOT = Path(__file__).resolve().parent.parent
CSS_PATH = ROOT / "assets" / "ui.css"
JS_PATH = ROOT / "assets" / "ui.js"
MAX_UPLOAD = "25mb"

def make_theme() -> gr.themes.Base:
    # system fonts: the default themes fetch Google fonts, which offline machines and Spaces proxies stall on
    theme = gr.themes.Soft(primary_hue="violet", secondary_hue="indigo", neutral_hue="slate", radius_size="md",
                           spacing_size="sm", text_size="sm",
                           font=["Inter", "ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "sans-serif"],
                           font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"])
    # quiet labels (plain text, not coloured pills): the images should be the loudest thing on the page
    return theme.set(block_title_background_fill="none", block_title_text_color="*neutral_600",
                     block_title_text_color_dark="*neutral_300", block_title_padding="0",
                     block_label_background_fill="none", block_label_text_color="*neutral_500",
                     block_label_text_color_dark="*neutral_400", block_title_text_weight="600",
                     # Stop: a red outline that fills on hover (present, but quieter than Generate)
                     button_cancel_background_fill="white", button_cancel_text_color="#dc2626",
                     button_cancel_border_color="#fca5a5", button_cancel_background_fill_hover="#dc2626",
                     button_cancel_text_color_hover="white", button_cancel_border_color_hover="#dc2626",
                     button_cancel_background_fill_dark="*neutral_800", button_cancel_text_color_dark="#f87171",
                     button_cancel_border_color_dark="#7f1d1d", button_cancel_background_fill_hover_dark="#b91c1c",
                     button_cancel_text_color_hover_dark="white")


def load_css() -> str:
    return CSS_PATH.read_text() if CSS_PATH.is_file() else ""


def load_js() -> str:
    """The page's keyboard shortcut (Ctrl/⌘+Enter = Generate) and the PNG drop on the prompt."""
    return JS_PATH.read_text() if JS_PATH.is_file() else "() => {}"


# -- the page --------------------------------------------------------------------------------
def build_app(services: Services) -> gr.Blocks:
    rt = StudioRuntime(services)
    settings = services.settings
    avail = _availability(rt.device)
    sg_choices, sg_default, sg_note = _model_choices(services, "stylegan")
    initial_classes = class_choices(services, "stylegan", sg_default)
    schedulers = _scheduler_choices()
    C: dict[str, Any] = {}                   # control name -> component
    train_manager = make_manager(settings)   # training runs: child processes, one at a time

    with gr.Blocks(title="Atelier studio", analytics_enabled=False) as demo:
        # a factory, not an instance: Gradio makes one per browser session (and would try to serialise an instance)
        session = gr.State(new_session, delete_callback=lambda s: s.cancel())
        # this browser's results across runs and reloads (localStorage, encrypted with the studio's key)
        history_state = gr.BrowserState([], storage_key=history.HISTORY_KEY,
                                        secret=history.browser_secret(settings.cache_dir))
        with gr.Row(elem_id="at-header", equal_height=True):
            gr.HTML('<div class="at-logo">Atelier <span>studio</span></div>', elem_id="at-logo", scale=0, min_width=210)
            C["backend"] = gr.Radio([("StyleGAN", "stylegan"), ("Diffusion", "diffusion")], value="stylegan",
                                    label="Backend", elem_id="backend-select", scale=2, min_width=230)
            C["model"] = gr.Dropdown(sg_choices, value=sg_default, label="Model", allow_custom_value=True,
                                     elem_id="model-select", scale=7, info=sg_note or None)
            refresh_btn = gr.Button("↻", elem_id="model-refresh", scale=0, min_width=44, size="sm")

        # Generate and Train: training is its own process (not in the GPU queue), see ui/train_tab.py
        with gr.Tabs(elem_id="studio-tabs", selected="generate"):
            with gr.Tab("Generate", id="generate", elem_id="generate-tab"):
                with gr.Row(elem_id="at-main", equal_height=False):
                    # ---------------------------------------------------------------- controls
                    with gr.Column(scale=5, min_width=360, elem_id="at-controls"):
                        with gr.Row(elem_id="at-seed-row"):
                            C["seed"] = gr.Textbox(DEFAULT_SEED_TEXT["stylegan"], label=seed_label("stylegan"),
                                                   elem_id="seed-input", scale=8)
                            dice_btn = gr.Button("🎲", elem_id="seed-dice", scale=0, min_width=44, size="sm")
                            reuse_btn = gr.Button("♻", elem_id="seed-reuse", scale=0, min_width=44, size="sm")

                        # StyleGAN controls
                        with gr.Group(visible=True, elem_id="stylegan-controls") as sg_group:
                            with gr.Row():
                                C["truncation_psi"] = gr.Slider(-1.0, 2.0, value=0.7, step=0.05, label="Truncation ψ",
                                                                elem_id="psi-input", scale=3,
                                                                info="1 = none; lower = closer to the centre")
                                # what ψ pulls towards (models/class_centres.py); an unconditional model has no
                                # class, so it always takes the global mean
                                C["truncation_centre"] = gr.Radio(
                                    [("Class", "class"), ("Global", "global")], value="class", label="ψ centre",
                                    info="class: the class's own mean (conditional models); global: the model's "
                                         "mean over all classes",
                                    elem_id="psi-centre", scale=2, min_width=150)
                            with gr.Row():
                                C["noise_mode"] = gr.Radio(["const", "random", "none"], value="const", label="Noise",
                                                           elem_id="noise-mode", scale=3)
                                # a conditional model's classes by name; typed text (an index or a name) works too
                                C["class_index"] = gr.Dropdown(initial_classes.choices, value=None, label="Class",
                                                               allow_custom_value=True, filterable=True,
                                                               info=initial_classes.info, elem_id="class-input",
                                                               scale=2, min_width=150)
                            with gr.Tabs(elem_id="sg-tabs") as sg_tabs:
                                with gr.Tab("Images", id="images") as tab_images:
                                    with gr.Row():
                                        C["sg_batch_size"] = gr.Slider(1, 64, value=8, step=1, label="Batch size",
                                                                       elem_id="sg-batch", scale=3)
                                        C["truncation_cutoff"] = gr.Textbox("", label="ψ cutoff",
                                                                            placeholder="all layers",
                                                                            elem_id="psi-cutoff", scale=1, min_width=90)
                                with gr.Tab("Style mixing", id="style-mix") as tab_mix:
                                    with gr.Row():
                                        C["mix_rows"] = gr.Textbox("1-4", label="Row seeds (give their styles)",
                                                                   elem_id="mix-rows")
                                        C["mix_cols"] = gr.Textbox("10-13", label="Column seeds", elem_id="mix-cols")
                                    with gr.Row():
                                        n_mix = style_layer_count(services, "stylegan", sg_default) or MIX_LAYERS_UNKNOWN
                                        C["mix_from"] = gr.Slider(0, n_mix - 1, value=0, step=1,
                                                                  label="Styles from layer", elem_id="mix-from",
                                                                  info=f"this model has {n_mix} style layers (0-{n_mix - 1})"
                                                                  if n_mix != MIX_LAYERS_UNKNOWN else None)
                                        C["mix_to"] = gr.Slider(1, n_mix, value=min(6, n_mix), step=1,
                                                                label="to layer (exclusive)", elem_id="mix-to")
                                with gr.Tab("Interpolation", id="interpolate") as tab_interp:
                                    with gr.Row():
                                        C["frames_per_seed"] = gr.Slider(2, 120, value=24, step=1,
                                                                         label="Frames per seed",
                                                                         elem_id="interp-frames")
                                        C["fps"] = gr.Slider(1, 60, value=24, step=1, label="Frames per second",
                                                             elem_id="interp-fps")
                                    with gr.Row():
                                        C["interp_space"] = gr.Radio([("W (linear)", "w"), ("Z (spherical)", "z")],
                                                                     value="w",
                                                                     label="Latent space", elem_id="interp-space")
                                        C["animation_format"] = gr.Radio(["gif", "mp4"], value="gif", label="Format",
                                                                         elem_id="interp-format")
                            C["sg_mode"] = gr.Textbox("images", visible=False, elem_id="sg-mode")
                        ticket_box = gr.Number(None, visible=False, precision=0, elem_id="ticket-id")

                        # diffusion controls
                        with gr.Group(visible="hidden", elem_id="diffusion-controls") as df_group:
                            C["prompt"] = gr.Textbox("", label="Prompt", lines=3, elem_id="prompt-input",
                                                     placeholder="a watercolor fox in a misty forest, soft light")
                            # a PNG dropped on the prompt lands here (assets/ui.js) and fills the controls
                            prompt_drop = gr.File(type="filepath", file_types=[".png", ".jpg", ".jpeg", ".webp"],
                                                  visible="hidden", elem_id="prompt-drop-file")
                            C["negative_prompt"] = gr.Textbox("", label="Negative prompt", lines=1,
                                                              elem_id="negative-prompt-input",
                                                              placeholder="blurry, low quality")
                            with gr.Row():
                                C["steps"] = gr.Slider(1, 150, value=25, step=1, label="Steps", elem_id="steps-input")
                                C["guidance"] = gr.Slider(0.0, 20.0, value=7.0, step=0.5, label="Guidance",
                                                          elem_id="guidance-input")
                            with gr.Row():
                                C["size"] = gr.Dropdown(list(SIZE_PRESETS), value=SIZE_PRESETS[0], label="Size",
                                                        allow_custom_value=True, elem_id="size-select")
                                C["scheduler"] = gr.Dropdown(schedulers, value="default", label="Scheduler",
                                                             allow_custom_value=True, elem_id="scheduler-select")
                            with gr.Row():
                                C["batch_size"] = gr.Slider(1, 8, value=1, step=1, label="Batch", elem_id="df-batch")
                                C["preview_every"] = gr.Slider(0, 10, value=5, step=1, label="Preview every",
                                                               info="steps; 0 = off",
                                                               elem_id="preview-every")
                                C["preview_method"] = gr.Dropdown(
                                    PREVIEW_CHOICES, value="auto", label="Preview with",
                                    info="previews only; Auto: TAESD when its weights are here, else the latent map",
                                    elem_id="preview-method")
                            with gr.Accordion("Image to image", open=False, elem_id="img2img"):
                                C["init_image"] = gr.Image(type="filepath", label="Start image",
                                                           sources=["upload", "clipboard"], elem_id="init-image", height=180)
                                C["strength"] = gr.Slider(0.05, 1.0, value=0.75, step=0.05,
                                                          label="Strength (how far from the start image)",
                                                          elem_id="strength-input")

                        # optimization toggles
                        with gr.Accordion("Optimization", open=False, elem_id="optimization-panel"):
                            ok, why = avail.get("precision", (True, ""))
                            C["precision"] = gr.Radio(["fp32", "tf32", "fp16", "bf16"], value="fp32",
                                                      label="Precision (AMP)",
                                                      elem_id="precision-select", info=why or None, interactive=ok)
                            _toggle_controls(C, avail)

                        with gr.Accordion("Add a model", open=False, elem_id="add-model",
                                          visible=settings.visitor_may("add-model")):
                            with gr.Row():
                                add_ref = gr.Textbox(label="File path or Hugging Face id",
                                                     placeholder="/models/ffhq.pkl  or  stabilityai/sd-turbo",
                                                     elem_id="add-model-input", scale=5)
                                add_btn = gr.Button("Add", elem_id="add-model-btn", scale=1, min_width=70)
                            add_status = gr.Markdown("", elem_id="add-model-status")

                    # ---------------------------------------------------------------- results
                    with gr.Column(scale=7, min_width=420, elem_id="at-results"):
                        with gr.Row(elem_id="at-actions"):
                            generate_btn = gr.Button("Generate", variant="primary", size="lg", elem_id="generate-btn",
                                                     scale=4)
                            stop_btn = gr.Button("Stop", variant="stop", size="lg", elem_id="stop-btn", scale=1)
                        progress_box = gr.HTML(panel.render_progress(new_session().tracker.snapshot(), None, 0),
                                               elem_id="progress-box")
                        preview = gr.Image(label="Preview", visible=False, interactive=False, elem_id="preview-image",
                                           height=256)
                        with gr.Tabs(elem_id="result-tabs"):
                            with gr.Tab("Results", id="results"):
                                gallery = gr.Gallery(label="Results", show_label=False, columns=4, height=520,
                                                     object_fit="contain", allow_preview=True, format="png",
                                                     elem_id="output-gallery", buttons=["download", "fullscreen"],
                                                     interactive=False)
                                with gr.Row():
                                    send_back_btn = gr.Button("Send parameters back", elem_id="send-back-btn",
                                                              size="sm")
                                    download_btn = gr.DownloadButton("Download with parameters", value=None,
                                                                     interactive=False,
                                                                     elem_id="download-btn", size="sm")
                                selected_params = gr.JSON(label="Parameters of the selected image",
                                                          elem_id="selected-params",
                                                          open=False)
                            with gr.Tab("History", id="history", elem_id="history-tab"):
                                history_gallery = gr.Gallery(label="This browser's last results", show_label=True,
                                                             columns=6, height=420, object_fit="contain",
                                                             allow_preview=True, format="png",
                                                             elem_id="history-gallery", interactive=False,
                                                             buttons=["download", "fullscreen"])
                                with gr.Row():
                                    history_send_btn = gr.Button("Send parameters back", elem_id="history-send",
                                                                 size="sm")
                                    history_clear_btn = gr.Button("Clear history", elem_id="history-clear", size="sm")
                                history_params = gr.JSON(label="Parameters of the selected image",
                                                         elem_id="history-params", open=False)
                            with gr.Tab("PNG info", id="pnginfo", elem_id="pnginfo-tab"):
                                with gr.Row():
                                    png_file = gr.File(label="PNG (Atelier or A1111)", type="filepath",
                                                       file_types=[".png", ".jpg", ".jpeg", ".webp"],
                                                       elem_id="pnginfo-file",
                                                       height=160)
                                    png_preview = gr.Image(label="Image", interactive=False, elem_id="pnginfo-image",
                                                           height=220)
                                png_params = gr.JSON(label="Parameters", elem_id="pnginfo-json", open=True)
                                png_send_btn = gr.Button("Send to controls", elem_id="pnginfo-send", size="sm")
                            with gr.Tab("Compare", id="compare", elem_id="compare-tab"):
                                gr.Markdown("Your settings against the **fp32 reference** (every toggle off), same "
                                            "model and seeds, one after the other: what the toggles do to speed, "
                                            "memory and the picture.", elem_id="compare-intro")
                                compare_btn = gr.Button("Compare with the fp32 reference", elem_id="compare-btn",
                                                        size="sm")
                                with gr.Row(equal_height=True):
                                    compare_slider = gr.ImageSlider(label="fp32 reference ↔ your settings", type="pil",
                                                                    interactive=False, elem_id="compare-slider",
                                                                    max_height=360, buttons=["fullscreen"], scale=1)
                                    compare_diff = gr.Image(label="Difference (amplified)", interactive=False,
                                                            elem_id="compare-diff", height=360, scale=1,
                                                            buttons=["fullscreen"])
                                compare_table = gr.HTML("", elem_id="compare-table")

                    # ---------------------------------------------------------------- live side panel
                    with gr.Column(scale=3, min_width=250, elem_id="perf-panel"):
                        first = rt.memory.sample()
                        snap0 = new_session().tracker.snapshot()
                        device_html = gr.HTML(panel.render_device(first, False), elem_id="device-readout")
                        vram_html = gr.HTML(panel.render_memory(first, snap0), elem_id="vram-readout")
                        job_html = gr.HTML(panel.render_job(snap0, None, 0, 0), elem_id="job-readout")
                        latency_html = gr.HTML(panel.render_latency(snap0), elem_id="latency-readout")
                        charts_html = gr.HTML(panel.render_charts(snap0, rt.memory.series(), first.kind),
                                              elem_id="perf-charts")
                        timer = gr.Timer(SLOW_TICK_S)
            # no tab (and no endpoints) in public mode without --allow train, nor on ZeroGPU, whose GPU exists
            # only inside a call of a few minutes
            if settings.visitor_may("train") and not zerogpu.on_zerogpu():
                build_train_tab(settings, train_manager, backend=C["backend"], model=C["model"],
                                model_update=bind(picker_update, services),
                                add_model=bind(known_stylegan_model, services))

        controls = check_components(C)          # in StudioForm's order: the values become one form (ui/form.py)
        panel_outputs = [device_html, vram_html, job_html, latency_html, charts_html, progress_box]
        send_outputs = controls + [sg_group, df_group, sg_tabs]
        memory_toggle = "memory" in avail          # memory savers are diffusion-only: shown with that backend
        ctx = StudioContext(services, rt, tuple(schedulers), memory_toggle)

        # -- wiring ------------------------------------------------------------------------------
        fast = dict(queue=False, show_progress="hidden")
        defaults = bind(model_defaults, ctx)
        diffusion_knobs = [C["steps"], C["guidance"], C["size"], C["scheduler"]]
        C["backend"].input(bind(switch_backend, services, memory_toggle), [C["backend"], C["seed"], session],
                           [C["model"], sg_group, df_group, C["seed"], C["memory_savers"]],
                           api_name="switch_backend", **fast
                           ).then(defaults, [C["backend"], C["model"]], diffusion_knobs,
                                  api_name="backend_model_defaults", **fast)
        C["model"].input(defaults, [C["backend"], C["model"]], diffusion_knobs, api_name="model_defaults", **fast)
        mix_in, mix_out = [C["backend"], C["model"], C["mix_from"], C["mix_to"]], [C["mix_from"], C["mix_to"]]
        mix_range = bind(mix_layer_sliders, services)
        C["model"].change(mix_range, mix_in, mix_out, api_name="mix_layers", **fast)
        C["model"].change(bind(class_choices, services), [C["backend"], C["model"]], C["class_index"],
                           api_name="class_choices", **fast)
        refresh_btn.click(bind(list_models, ctx), [C["backend"], C["model"], session], C["model"],
                          api_name="list_models", **fast)
        # the picker's value set by code fires no .input: the added model's native size and steps follow here
        add_btn.click(bind(add_model, ctx), [add_ref, C["backend"], session], [C["model"], add_status],
                      api_name="add_model", queue=False
                      ).success(defaults, [C["backend"], C["model"]], diffusion_knobs, api_name=False, **fast)
        add_ref.submit(bind(add_model, ctx), [add_ref, C["backend"], session], [C["model"], add_status],
                       api_name="add_model_submit", queue=False
                       ).success(defaults, [C["backend"], C["model"]], diffusion_knobs, api_name=False, **fast)
        dice_btn.click(roll_seed, None, C["seed"], api_name="random_seed", **fast)
        reuse_btn.click(reuse_seed, [C["backend"], session], C["seed"], api_name="reuse_seed", **fast)
        for tab, mode in ((tab_images, "images"), (tab_mix, "style-mix"), (tab_interp, "interpolate")):
            tab.select(mode_setter(mode), None, C["sg_mode"], api_name=f"mode_{mode.replace('-', '_')}", **fast)

        # the click takes a place in the GPU queue (shown at once); its generate event carries that
        # ticket, so a Stop while it waits cancels exactly this job, however many clicks follow.
        # It goes through Gradio's queue (its own lane, not the GPU's) because only a queued event's error
        # reaches the page as a toast: a refused press ("Not queued: …") must say why.
        prep = dict(concurrency_id="prepare", concurrency_limit=8, show_progress="hidden")
        gen_event = generate_btn.click(bind(prepare, ctx), controls + [session], [progress_box, timer, ticket_box],
                                       api_name="queue_job", **prep)
        gen_event.success(form_endpoint(generate, ctx), controls + [ticket_box, session],
                          [gallery, preview, progress_box, selected_params, download_btn],
                          api_name="generate", concurrency_id="gpu", concurrency_limit=1,
                          show_progress="hidden", trigger_mode="multiple"
                          ).then(bind(job_finished, ctx), [session, ticket_box], panel_outputs + [timer],
                                 api_name="job_finished", **fast
                                 ).then(bind(record_history, ctx), [session, history_state],
                                        [history_state, history_gallery], api_name="record_history", **fast
                                        ).then(mix_range, mix_in, mix_out, api_name=False, **fast)  # a pickle: now loaded
        cmp_event = compare_btn.click(bind(prepare_compare, ctx), controls + [session], [progress_box, timer, ticket_box],
                                      api_name="queue_compare", **prep)
        cmp_event.success(form_endpoint(compare, ctx), controls + [ticket_box, session],
                          [compare_slider, compare_diff, compare_table, progress_box],
                          api_name="compare", concurrency_id="gpu", concurrency_limit=1,
                          show_progress="hidden", trigger_mode="multiple"
                          ).then(bind(job_finished, ctx), [session, ticket_box], panel_outputs + [timer],
                                 api_name="compare_finished", **fast)
        C["prompt"].submit(lambda: None, None, None, js="() => document.querySelector('#generate-btn').click()",
                           api_name="prompt_submit", queue=False)
        stop_btn.click(bind(stop, ctx), session, progress_box, api_name="stop", **fast)
        timer.tick(bind(telemetry, ctx), session, panel_outputs + [timer], api_name="telemetry", **fast)
        gallery.select(select_image, session, [selected_params, download_btn], api_name="select_image", **fast)
        # queued (not in the GPU's): a model the parameters name but this studio lacks is said in a toast
        send_back_btn.click(bind(send_back, ctx), session, send_outputs, api_name="send_back",
                            concurrency_id="restore", show_progress="hidden")
        png_file.upload(bind(read_png_info, ctx), png_file, [png_preview, png_params, png_file],
                        api_name="read_png_info", concurrency_id="files", concurrency_limit=4)
        png_send_btn.click(bind(send_png_params, ctx), [png_params, session], send_outputs,
                           api_name="send_png_params", concurrency_id="restore", show_progress="hidden")
        demo.load(bind(page_load, ctx), session, panel_outputs + [timer], api_name="page_load", **fast)
        demo.load(bind(show_history, ctx), history_state, [history_state, history_gallery], api_name="show_history",
                  **fast)
        demo.load(None, None, None, js=load_js())
        history_gallery.select(select_history, history_state, history_params, api_name="select_history", **fast)
        history_send_btn.click(bind(send_png_params, ctx), [history_params, session], send_outputs,
                               api_name="send_history_params", concurrency_id="restore", show_progress="hidden")
        history_clear_btn.click(clear_history, None, [history_state, history_gallery, history_params],
                                api_name="clear_history", **fast)
        prompt_drop.upload(bind(read_dropped_png, ctx), [prompt_drop, session],
                           send_outputs + [png_params, prompt_drop], api_name="read_dropped_png",
                           concurrency_id="files", concurrency_limit=4, show_progress="hidden")
        demo.unload(bind(page_unload, ctx))

    demo.queue(max_size=settings.queue_max_size, default_concurrency_limit=4)
    demo.atelier_runtime = rt    # for launch() (the /metrics route) and tests
    demo.atelier_training = train_manager
    return demo


def _toggle_controls(C: dict, avail: dict[str, tuple[bool, str]]) -> None:
    """The optional toggles, laid out compactly: shown when the optim package reports them, disabled
    with its reason when one cannot run here. Until a toggle is reported at all it stays hidden
    (before the toggles landed the panel showed precision only)."""
    def state(name, show_info_when_ok=False):
        if name not in avail:
            return False, False, None
        ok, why = avail[name]
        info = why if (not ok or show_info_when_ok) else None   # a reason for what cannot run; no chatter
        return True, bool(ok), info or None

    vis, ok, why = state("compile")
    C["compile_mode"] = gr.Radio(["off", "default", "reduce-overhead"], value="off", label="torch.compile",
                                 visible=vis, interactive=ok, info=why or "the first run at a new size compiles (minutes)",
                                 elem_id="opt-compile")
    vis, ok, why = state("attention", show_info_when_ok=True)
    C["attention"] = gr.Radio(["sdpa", "xformers", "math"], value="sdpa", label="Attention", visible=vis,
                              interactive=ok, info=why, elem_id="opt-attention")
    for name, label, elem_id in (("channels_last", "channels_last memory format", "opt-channels-last"),
                                 ("fp8", "FP8 linear layers", "opt-fp8"), ("tensorrt", "TensorRT engine", "opt-tensorrt"),
                                 ("fuse_qkv", "Fused QKV projections (diffusion)", "opt-fuse-qkv"),
                                 ("request_graph", "One CUDA graph per request (diffusion)", "opt-request-graph"),
                                 ("tiny_vae", "Tiny autoencoder decode, TAESD (diffusion)", "opt-tiny-vae")):
        vis, ok, why = state(name)
        C[name] = gr.Checkbox(False, label=label, visible=vis, interactive=ok, info=why, elem_id=elem_id)
    vis, ok, why = state("prune")
    with gr.Row(visible=vis):
        C["prune_amount"] = gr.Slider(0.0, 0.9, value=0.0, step=0.05, label="Pruning", visible=vis,
                                      interactive=ok, info=why, elem_id="opt-prune", scale=3)
        C["prune_method"] = gr.Radio(["l1-unstructured", "structured"], value="l1-unstructured", label="Method",
                                     visible=vis, interactive=ok, elem_id="opt-prune-method", scale=2)
    vis, ok, why = state("memory", show_info_when_ok=True)
    C["memory_savers"] = gr.CheckboxGroup(list(MEMORY_SAVERS), value=[], label="Memory savers",
                                          visible=False, interactive=ok, info=why, elem_id="opt-memory")  # diffusion only


# -- serving ---------------------------------------------------------------------------------
def mount_metrics(demo: gr.Blocks) -> None:
    """Prometheus text at /metrics (latency histograms, images, jobs, memory and queue gauges)."""
    from fastapi import Response

    rt: StudioRuntime = demo.atelier_runtime

    def metrics() -> Response:
        rt.metrics.set_memory(rt.memory.sample())
        rt.metrics.set_queue(*rt.queue.counts())
        return Response(rt.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    demo.app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


def mount_probes(demo: gr.Blocks) -> None:
    """/healthz (the process answers: always 200) and /readyz (200 once the default model is loaded and has
    generated once, 503 with a short reason before that and while draining), for load balancers and
    orchestrators. Both are open with --auth (ui/access.py) and say nothing beyond a status and a reason."""
    from fastapi.responses import JSONResponse

    rt: StudioRuntime = demo.atelier_runtime
    no_store = {"cache-control": "no-store"}

    def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"}, headers=no_store)

    def readyz() -> JSONResponse:
        ready, reason = rt.readiness()
        if ready:
            return JSONResponse({"status": "ready"}, headers=no_store)
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503, headers=no_store)

    demo.app.add_api_route("/healthz", healthz, methods=["GET", "HEAD"], include_in_schema=False)
    demo.app.add_api_route("/readyz", readyz, methods=["GET", "HEAD"], include_in_schema=False)


def serve(services: Services, *, host: str | None = None, port: int | None = None, quiet: bool = False) -> gr.Blocks:
    """Build and start the studio without blocking; returns the running Blocks (`.local_url`, `.close()`)."""
    from starlette.middleware import Middleware

    s = services.settings
    warning = share_warning(s)
    if warning and not quiet:    # before the share link is asked for: it must be read even if that fails
        print(warning, file=sys.stderr, flush=True)
    demo = build_app(services)
    Path(s.output_dir).mkdir(parents=True, exist_ok=True)
    limiter = LoginLimiter()
    # the guard sits inside Gradio's own middleware and in front of every route, ours included
    guard = Middleware(AccessGuard, auth=s.auth, limiter=limiter)
    startup_check.install()          # Gradio's own "is it up" check gives up after one slow answer
    demo.launch(server_name=host or s.host, server_port=port or s.port, share=s.share, auth=s.auth,
                auth_message="Atelier studio: sign in" if s.auth else None, prevent_thread_lock=True, quiet=True,
                show_error=not s.public, allowed_paths=[str(Path(s.output_dir).resolve())], max_file_size=MAX_UPLOAD,
                theme=make_theme(), css=load_css(), ssr_mode=False, footer_links=["api", "gradio"],
                app_kwargs={"middleware": [guard]})
    demo.atelier_login_limiter = limiter
    mount_metrics(demo)
    mount_probes(demo)
    from pipelines import preload

    preload.start()       # diffusers' import in the background, once the studio is serving (ATELIER_PRELOAD=0: off)
    if s.warmup:
        demo.atelier_runtime.start_warmup()
    from ui.a1111_api import mount_a1111_api

    mount_a1111_api(demo)
    from ui.uploads import start_upload_janitor

    demo.atelier_uploads = start_upload_janitor(demo, s)   # visitors' uploads do not pile up in the temp folder
    if not quiet:
        print(startup_banner(s, demo), flush=True)
    return demo


def startup_banner(s, demo) -> str:
    """What `python app.py` prints: where the studio is, in which mode, and how to share it (our flags,
    not Gradio's `launch(share=True)` hint)."""
    lines = [f"Atelier studio ({s.mode} mode) on {demo.local_url}"]
    if getattr(demo, "share_url", None):
        lines.append(f"Public link: {demo.share_url}")
    elif not s.on_space:
        lines.append("For a public link: python app.py --share --auth user:password")
    return "\n".join(lines)


def drain_and_close(demo: gr.Blocks, grace_s: float | None = None, why: str = "SIGTERM") -> dict[str, int]:
    """Shut the studio down cleanly: take no new jobs, let the running ones finish for `grace_s`
    seconds (env ATELIER_DRAIN_S, default 30), cancel what is left, stop training runs, close
    the server. Prints one line when it starts and one when it is done."""
    import os

    if grace_s is None:
        try:
            grace_s = float(os.environ.get("ATELIER_DRAIN_S", "30"))
        except ValueError:
            grace_s = 30.0
    rt: StudioRuntime = demo.atelier_runtime
    running = len(rt.active_jobs())
    print(f"Atelier studio: {why} received; taking no new jobs, waiting up to {grace_s:g} s for "
          f"{running} running job(s)", file=sys.stderr, flush=True)
    report = rt.drain(grace_s)
    training = getattr(demo, "atelier_training", None)
    if training is not None and hasattr(training, "stop_all"):
        try:
            training.stop_all(wait=True, grace_s=grace_s)
        except Exception as exc:   # shutting down regardless; say why the run may not have stopped cleanly
            print(f"Atelier studio: stopping training runs failed: {exc}", file=sys.stderr, flush=True)
    demo.close()
    print(f"Atelier studio: stopped ({report['finished']} job(s) finished, {report['cancelled']} cancelled, "
          f"{report['left']} still running)", file=sys.stderr, flush=True)
    return report


def launch(services: Services) -> None:
    """`python app.py`: serve on settings.host:port (127.0.0.1 unless told otherwise) until SIGTERM or
    Ctrl-C; then drain (no new jobs, the running one finishes or is cancelled) and return, so the
    process exits 0 and no half-written output is left behind."""
    import signal
    import threading

    stop = threading.Event()
    why = {"name": "SIGTERM"}

    def on_signal(signum, _frame):
        why["name"] = signal.Signals(signum).name
        stop.set()

    # installed before serving: a SIGTERM right after the banner must drain, not kill
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        demo = serve(services)
        while not stop.wait(1.0):   # a timed wait: the handler runs on this (main) thread between waits
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    drain_and_close(demo, why=why["name"])
