"""The studio page: controls, gallery, PNG info, and the live side panel.

`build_app(services)` makes the Blocks; `launch(services)` serves it with the
host, port, share, auth and queue size from `services.settings`. Everything the
handlers use comes from `services` and a `StudioRuntime` made here: there is
no module-level model, option or queue.

Serving rules:
- every GPU event runs in one queue (`concurrency_id="gpu"`, limit 1);
- Stop, the panel timer and other light events skip the queue (`queue=False`),
  so they answer at once while a job runs;
- every event has an `api_name`, so `gradio_client` can drive the studio.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from core.errors import AtelierError
from core.pnginfo import read_png_params
from pipelines.services import Services
from pipelines.tools import optimization_availability
from telemetry.live import DONE, FAILED, QUEUED, STOPPED
from telemetry.metrics import CONTENT_TYPE_LATEST
from ui import history, panel, startup_check, zerogpu
from ui.access import AccessGuard, LoginLimiter, redact_paths, share_warning
from ui.compare import render_comparison
from ui.controls import (DEFAULT_SCHEDULERS, DEFAULT_SEED_TEXT, MEMORY_SAVERS, SIZE_PRESETS, compare_spec,
                         controls_from_params, find_model, job_spec, last_seed_text, random_seed, seed_label, size_label)
from ui.runner import MAX_GALLERY, StudioRuntime
from ui.state import SessionState, new_session
from ui.train_tab import build_train_tab, make_manager

log = logging.getLogger("atelier.ui")
ROOT = Path(__file__).resolve().parent.parent
CSS_PATH = ROOT / "assets" / "ui.css"
JS_PATH = ROOT / "assets" / "ui.js"
FAST_TICK_S, SLOW_TICK_S = 0.5, 2.0      # panel refresh: about 2 Hz while a job runs, slower when idle
MAX_UPLOAD = "25mb"
# a second Generate (or Ctrl+Enter) while this tab's job runs: one job per tab, said rather than queued,
# so a double press never runs the same request twice
ALREADY_RUNNING = ("Not queued: this tab already has a job queued or running (one at a time). "
                   "Wait for it to finish, or press Stop, then Generate again.")

# every control the generate event reads, in the order of `generate`'s parameters (its API signature)
CONTROL_NAMES = (
    "backend", "model", "seed", "sg_mode", "truncation_psi", "truncation_cutoff", "noise_mode", "class_index",
    "sg_batch_size", "mix_rows", "mix_cols", "mix_from", "mix_to", "frames_per_seed", "interp_space",
    "animation_format", "fps", "prompt", "negative_prompt", "steps", "guidance", "size", "scheduler", "batch_size",
    "init_image", "strength", "preview_every", "precision", "channels_last", "attention", "compile_mode", "fp8",
    "prune_amount", "prune_method", "tensorrt", "memory_savers",
)


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


# -- small helpers ---------------------------------------------------------------------------
def _model_choices(services: Services, backend: str,
                   owner: str | None = None) -> tuple[list[tuple[str, str]], str | None, str]:
    """(choices, default value, note) for the model picker; `owner`: the session whose added models to list."""
    entries = services.catalogue.entries(backend, owner)
    choices = [(_entry_label(e), e.id) for e in entries]
    try:
        default = services.catalogue.default(backend).id
        note = ""
    except AtelierError as exc:
        default = None
        note = redact_paths(str(exc)) if services.settings.public else str(exc)
        if choices and backend == "diffusion":   # only hub entries: pick one, it downloads on first use
            default = choices[0][1]
            note = ("No local diffusion model yet: a hub model downloads on first use (several GB)"
                    + (", or add a path below." if services.settings.visitor_may("add-model") else "."))
    return choices, default, note


def _entry_label(e) -> str:
    """'ffhq.pkl · stylegan2 · local' — a file's name, not its whole path (the value stays the full id)."""
    name = Path(e.path).name if (e.path and e.source != "hub") else e.id
    where = {"bundled": "bundled", "local": "local", "hf-cache": "HF cache", "hub": "hub, downloads"}.get(e.source, e.source)
    size = f" · {e.size_bytes / 2**30:.1f} GB" if (e.source == "hub" and e.size_bytes) else ""
    return f"{name}  ·  {e.kind}, {where}{size}"


def _scheduler_choices() -> list[str]:
    # the diffusion pipeline names its schedulers (importing it does not import diffusers)
    try:
        from pipelines import diffusion
    except Exception:   # not landed yet, or diffusers missing: offer the common names
        return list(DEFAULT_SCHEDULERS)
    names = getattr(diffusion, "SCHEDULER_NAMES", None) or getattr(diffusion, "SCHEDULERS", None)
    names = list(names) if names else list(DEFAULT_SCHEDULERS)
    return names if "default" in names else ["default"] + names


def _match_scheduler(hint: str, choices: list[str], schedule_type: str | None = None) -> str:
    """'DPM++ 2M Karras' (A1111) -> our name for it when such a choice exists, else 'default'."""
    try:
        from pipelines.diffusion import resolve_scheduler_name

        name = resolve_scheduler_name(hint, schedule_type)
        if name in choices:
            return name
    except Exception:   # diffusion backend missing, or a sampler it does not know
        pass
    key = hint.strip().lower().replace(" ", "-").replace("_", "-")
    for c in choices:
        if c.lower().replace("_", "-") == key:
            return c
    return "default" if "default" in choices else choices[0]


def _diffusion_defaults(services: Services, model_id: str | None) -> dict | None:
    """The model's native size, steps, guidance and scheduler (SD-Turbo wants 1 step and guidance 0)."""
    if not model_id:
        return None
    entry = next((e for e in services.catalogue.entries("diffusion") if model_id in (e.id, e.path)), None)
    if entry is None:
        return None
    try:
        from pipelines.diffusion import defaults_for

        return defaults_for(entry.kind, entry.path)
    except Exception:   # unknown architecture name or the backend is missing: keep the controls as they are
        return None


def _model_for_backend(services: Services, backend: str, model: str | None) -> str | None:
    """The model to request; None (the backend's default) when `model` is one of the other backend's
    models, which is what an API call that names only `backend` carries (the picker's initial value)."""
    if not model:
        return None
    other = "diffusion" if backend == "stylegan" else "stylegan"
    theirs = {ref for e in services.catalogue.entries(other) for ref in (e.id, e.path) if ref}
    ours = {ref for e in services.catalogue.entries(backend) for ref in (e.id, e.path) if ref}
    return None if (model in theirs and model not in ours) else model


def _upscaled(rgb, at_least: int = 256):
    """A small difference map blown up with nearest-neighbour, so each pixel stays a crisp square."""
    from PIL import Image

    img = Image.fromarray(rgb)
    k = max(1, -(-at_least // max(1, min(img.size))))
    return img.resize((img.width * k, img.height * k), Image.NEAREST) if k > 1 else img


def _gallery_value(items) -> list[tuple[str, str]]:
    return [(it.path, it.caption) for it in items[:MAX_GALLERY]]


def _availability(device) -> dict[str, tuple[bool, str]]:
    try:
        return dict(optimization_availability(device))
    except Exception as exc:   # the panel must come up even if a toggle's probe breaks
        log.warning("optimization availability probe failed: %s", exc)
        return {"precision": (True, "fp32")}


NO_JOB = -1        # the ticket of a press that starts no job (Compare with every toggle off)


def nothing_to_compare(request) -> str | None:
    """The Compare tab's note when the request's toggles are the fp32 reference (nothing to compare), else None."""
    from ui.compare import comparison_request

    try:
        comparison_request(request)
    except AtelierError as exc:
        if str(exc).startswith("Nothing to compare"):
            return str(exc)
        raise
    return None


def render_nothing_to_compare(note: str) -> str:
    """A quiet note (not an error): nothing went wrong, there is just nothing to compare yet."""
    import html

    return f'<div class="at-empty-note" id="compare-nothing">{html.escape(note)}</div>'


def _bound(fn, *args):
    """`fn` with its first arguments fixed, still named (Gradio names an event's function after it)."""
    bound = functools.partial(fn, *args)
    bound.__name__, bound.__doc__ = fn.__name__, fn.__doc__
    return bound


def _owner_of(settings, sess: SessionState | None) -> str | None:
    """Whose added models a picker lists: a visitor's own in public mode; everyone's in local mode."""
    return sess.id if (settings.public and sess is not None) else None


# -- event handlers (top level: each small, named and callable from a test) -------------------
@dataclass(frozen=True)
class StudioContext:
    """What the top-level handlers share: the services, the runtime and a few facts about the page."""

    services: Services
    rt: StudioRuntime
    schedulers: tuple[str, ...]
    memory_toggle: bool                      # the memory-savers toggle exists (shown with diffusion only)

    def visitor_text(self, text: str) -> str:
        return self.rt.visitor_text(text)


# the text fields among CONTROL_NAMES: a restored None becomes "" there
TEXT_CONTROLS = frozenset({"seed", "truncation_cutoff", "class_index", "mix_rows", "mix_cols", "sg_mode", "prompt",
                           "negative_prompt"})


@dataclass(frozen=True)
class Restored:
    """Control updates from saved parameters, in the order of `CONTROL_NAMES` + the two backend groups and
    the StyleGAN tabs; `note` says what could not be restored exactly (a model this studio lacks)."""

    updates: tuple
    note: str = ""


def restore_controls(ctx: StudioContext, meta: dict, owner: str | None = None) -> Restored:
    """Saved parameters (a result's, a PNG's, A1111's) -> every control they name set exactly: the
    backend, its seed field (value and label), the model the parameters name (by catalogue id, path,
    file name or A1111 model name) or, when this studio lacks it, the backend's default with a note."""
    try:
        vals = controls_from_params(meta)
    except AtelierError as exc:
        raise gr.Error(ctx.visitor_text(str(exc))) from None
    backend = vals.get("backend", "stylegan")
    choices, default, picker_note = _model_choices(ctx.services, backend, owner)
    named = vals.pop("model", None)
    entry = find_model(ctx.services.catalogue.entries(backend, owner), named)
    note = ""
    if named and entry is None:
        shown = Path(str(named)).name if ctx.services.settings.public else str(named)
        where = (" Add it under *Add a model* to restore it exactly."
                 if ctx.services.settings.visitor_may("add-model") else "")
        note = (f"These parameters were made with the model '{shown}', which this studio does not have; "
                f"the model picker shows this studio's default instead.{where}")
    model_update = gr.Dropdown(choices=choices, value=entry.id if entry else default,
                               info=(note or picker_note or None))
    if "scheduler_hint" in vals:
        vals["scheduler"] = _match_scheduler(vals.pop("scheduler_hint"), list(ctx.schedulers),
                                             vals.pop("schedule_type_hint", None))
    if backend == "diffusion":
        vals.setdefault("seed", "")          # no seed saved: random, never the StyleGAN list left in the field
    out = []
    for name in CONTROL_NAMES:
        if name == "model":
            out.append(model_update)
        elif name == "backend":
            out.append(backend)
        elif name == "seed":
            out.append(gr.Textbox(value=str(vals["seed"]), label=seed_label(backend)) if "seed" in vals
                       else gr.Textbox(label=seed_label(backend)))
        elif name == "memory_savers":
            out.append(gr.CheckboxGroup(value=vals["memory_savers"], visible=ctx.memory_toggle and backend != "stylegan")
                       if "memory_savers" in vals else gr.CheckboxGroup(visible=ctx.memory_toggle and backend != "stylegan"))
        elif name in vals:
            value = vals[name]
            out.append(("" if value is None else str(value)) if name in TEXT_CONTROLS else value)
        else:
            out.append(gr.skip())
    sg = backend == "stylegan"
    out += [gr.Group(visible=True if sg else "hidden"), gr.Group(visible="hidden" if sg else True),
            gr.Tabs(selected=vals["sg_mode"]) if (sg and vals.get("sg_mode")) else gr.skip()]
    return Restored(tuple(out), note)


def _restore(ctx: StudioContext, meta: dict, sess: SessionState | None) -> tuple:
    restored = restore_controls(ctx, meta, _owner_of(ctx.services.settings, sess))
    if restored.note:
        gr.Warning(restored.note)
    return restored.updates


def send_back(ctx: StudioContext, sess: SessionState):
    """Put the selected image's parameters back into the controls."""
    item = sess.selected_item()
    if item is None:
        raise gr.Error("Select an image in the gallery first.")
    return _restore(ctx, item.params, sess)


def read_dropped_png(ctx: StudioContext, path: str | None, sess: SessionState = None):
    """A PNG dropped on the prompt: its parameters into the controls (as PNG info → Send to controls), and
    into the PNG info tab; the drop zone empties for the next file."""
    if not path:
        return (gr.skip(),) * (len(CONTROL_NAMES) + 3) + (gr.skip(), None)
    try:
        params = read_png_params(path)
    except AtelierError as exc:
        raise gr.Error(ctx.visitor_text(str(exc))) from None
    return _restore(ctx, params, sess) + (params, None)


def record_history(ctx: StudioContext, sess: SessionState, stored: list | None):
    """After a job: its images go to the front of this browser's history (the last HISTORY_MAX kept)."""
    kept = history.add(history.valid(stored, ctx.services.settings.output_dir), sess.results[:history.HISTORY_MAX])
    return kept, history.gallery(kept)


def show_history(ctx: StudioContext, stored: list | None):
    """On page load: the history this browser kept, without the files that are gone."""
    kept = history.valid(stored, ctx.services.settings.output_dir)
    return kept, history.gallery(kept)


def select_history(stored: list | None, evt: gr.SelectData):
    """A history image picked: its parameters (ready for *Send parameters back*)."""
    i = evt.index if isinstance(evt.index, int) else None
    entries = stored or []
    return entries[i]["params"] if i is not None and 0 <= i < len(entries) else None


def clear_history():
    return [], [], None


def send_png_params(ctx: StudioContext, params: dict | None, sess: SessionState = None):
    """PNG info's *Send to controls*: the dropped PNG's parameters into the controls."""
    if not params:
        raise gr.Error("Drop a PNG with parameters first.")
    return _restore(ctx, params, sess)


MIX_LAYERS_UNKNOWN = 18     # the most a StyleGAN takes (1024 px); the sliders' range until a model says


def style_layer_count(services: Services, backend: str, model: str | None) -> int | None:
    """The selected StyleGAN's style-layer count where it is known without loading anything: from an Atelier
    model's JSON or a run's config, else from the model as loaded now (an NVlabs pickle after its first run)."""
    return services.manager.style_layers(model or None) if backend == "stylegan" else None


def mix_layer_sliders(services: Services, backend: str, model: str | None, mix_from, mix_to):
    """Style mixing's layer sliders span the selected model's layers (10 on a 64 px StyleGAN2, not 18)."""
    n = style_layer_count(services, backend, model)
    if not n:
        return gr.skip(), gr.skip()
    hi = min(int(mix_to if mix_to is not None else 6), n)
    lo = min(int(mix_from or 0), hi - 1)
    return (gr.Slider(maximum=n - 1, value=max(0, lo), info=f"this model has {n} style layers (0-{n - 1})"),
            gr.Slider(maximum=n, value=max(1, hi)))


def switch_backend(services: Services, memory_toggle: bool, backend: str, seed: str, sess: SessionState = None):
    """Show the controls of the chosen backend and its models. The seed field keeps each backend's own
    text: StyleGAN's list comes back when you return to it, and diffusion starts empty (= random)."""
    choices, default, note = _model_choices(services, backend, _owner_of(services.settings, sess))
    sg = backend == "stylegan"
    seed_text = DEFAULT_SEED_TEXT.get(backend, "")
    if sess is not None:
        sess.seed_texts["diffusion" if sg else "stylegan"] = seed or ""
        seed_text = sess.seed_texts.get(backend, seed_text)
    return (gr.Dropdown(choices=choices, value=default, info=note),
            gr.Group(visible=True if sg else "hidden"), gr.Group(visible="hidden" if sg else True),
            gr.Textbox(label=seed_label(backend), value=seed_text),
            gr.CheckboxGroup(visible=memory_toggle and not sg))


def roll_seed() -> str:
    """🎲: a fresh random seed in the field."""
    return str(random_seed())


def reuse_seed(backend: str, sess: SessionState) -> str:
    """♻: the seed the last result used (diffusion: the selected image's; StyleGAN: the run's seeds)."""
    try:
        return last_seed_text([it.params for it in sess.results], backend or "stylegan", sess.selected)
    except AtelierError as exc:
        raise gr.Error(str(exc)) from None


# -- the page --------------------------------------------------------------------------------
def build_app(services: Services) -> gr.Blocks:
    rt = StudioRuntime(services)
    settings = services.settings
    avail = _availability(rt.device)
    sg_choices, sg_default, sg_note = _model_choices(services, "stylegan")
    schedulers = _scheduler_choices()
    C: dict[str, Any] = {}                   # control name -> component
    train_manager = make_manager(settings)   # training runs: child processes, one at a time

    def _picker_update(backend: str, select: str | None):
        """The model picker listing `backend`'s models with `select` chosen (e.g. a model just exported)."""
        choices, default, note = _model_choices(services, backend)
        return gr.Dropdown(choices=choices, value=select if select in [c[1] for c in choices] else default,
                           info=note or None)

    def _known_model(path: str) -> str:
        """The catalogue id of a StyleGAN file, adding it when no scanned folder lists it."""
        for e in services.catalogue.entries("stylegan"):
            if path in (e.id, e.path):
                return e.id
        return services.catalogue.add(path, "stylegan").id

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
                            C["truncation_psi"] = gr.Slider(-1.0, 2.0, value=0.7, step=0.05, label="Truncation ψ",
                                                            elem_id="psi-input",
                                                            info="1 = none; lower = closer to the average face")
                            with gr.Row():
                                C["noise_mode"] = gr.Radio(["const", "random", "none"], value="const", label="Noise",
                                                           elem_id="noise-mode", scale=3)
                                C["class_index"] = gr.Textbox("", label="Class", placeholder="none",
                                                              elem_id="class-input",
                                                              scale=1, min_width=90)
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
                                model_update=_picker_update, add_model=_known_model)

        controls = [C[name] for name in CONTROL_NAMES]
        panel_outputs = [device_html, vram_html, job_html, latency_html, charts_html, progress_box]
        send_outputs = controls + [sg_group, df_group, sg_tabs]
        memory_toggle = "memory" in avail          # memory savers are diffusion-only: shown with that backend
        ctx = StudioContext(services, rt, tuple(schedulers), memory_toggle)

        # -- handlers ----------------------------------------------------------------------------
        def owner_of(sess: SessionState | None) -> str | None:
            return _owner_of(settings, sess)

        def model_defaults(backend: str, model: str | None):
            """Picking a diffusion model sets its native size, steps, guidance and scheduler."""
            d = _diffusion_defaults(services, model) if backend == "diffusion" else None
            if not d:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip()
            sched = d.get("scheduler", "default")
            return (gr.Slider(value=d["steps"]), gr.Slider(value=d["guidance"]),
                    gr.Dropdown(value=size_label(d["width"], d["height"])),
                    gr.Dropdown(value=sched if sched in schedulers else "default"))

        def list_models(backend: str, current: str | None, sess: SessionState = None):
            choices, default, note = _model_choices(services, backend, owner_of(sess))
            ids = [c[1] for c in choices]
            return gr.Dropdown(choices=choices, value=current if current in ids else default, info=note)

        def add_model(ref: str, backend: str, sess: SessionState):
            """Add a model by path or hub id (local mode: for everyone; public mode, where the host allows it:
            for this session only)."""
            if not settings.visitor_may("add-model"):
                raise gr.Error("Adding models is off on this public studio: pick one from the model list "
                               "(the host can allow it with --allow add-model).")
            owner = owner_of(sess)
            try:
                entry = services.catalogue.add(ref, backend, owner=owner)
            except AtelierError as exc:
                raise gr.Error(rt.visitor_text(str(exc))) from None
            choices, _default, note = _model_choices(services, backend, owner)
            return gr.Dropdown(choices=choices, value=entry.id, info=note), f"Added **{entry.id}** ({entry.source})."

        def prepare(*values):
            """Validate at once (errors show before the job queues) and mark this session as waiting."""
            return _prepare(values, job_spec)

        def prepare_compare(*values):
            """As prepare, for the Compare button."""
            return _prepare(values, compare_spec)

        def _prepare(values, make_spec):
            *vals, sess = values
            v = dict(zip(CONTROL_NAMES, vals))
            if sess.job is not None or sess.waiting_ticket() is not None:
                raise gr.Error(ALREADY_RUNNING)
            waiting, _running = rt.queue.counts()
            if settings.queue_max_size and waiting >= settings.queue_max_size:
                raise gr.Error(f"The GPU queue is full ({waiting} jobs waiting, the limit is {settings.queue_max_size}). "
                               "Try again in a minute.")
            try:
                spec = make_spec(v, settings.device)
            except AtelierError as exc:
                raise gr.Error(rt.visitor_text(str(exc))) from None
            if spec.kind == "compare" and nothing_to_compare(spec.request):
                return gr.skip(), gr.skip(), NO_JOB      # not an error: the Compare tab says what to turn on
            ticket = rt.enqueue(sess, spec.kind)
            html = panel.render_progress(sess.tracker.snapshot(), rt.queue.position(ticket), rt.queue.counts()[0])
            sess.timer_interval = FAST_TICK_S
            return html, gr.Timer(FAST_TICK_S), ticket.id

        def _spec_for_event(values: dict, make_spec, ticket, sess: SessionState, request):
            """The job an event's control values ask for; a bad value gives up the event's queue place
            and shows its message. None = not given (the API's optional parameters): defaults apply."""
            v = {k: val for k, val in values.items() if k in CONTROL_NAMES and val is not None}
            v["model"] = _model_for_backend(services, v.get("backend") or "stylegan", v.get("model"))
            rt.remember(getattr(request, "session_hash", None), sess)
            try:
                return make_spec(v, settings.device)
            except AtelierError as exc:
                t = sess.tickets.pop(int(ticket), None) if ticket else None
                if t is not None:
                    rt.queue.leave(t)
                sess.tracker.finish(FAILED, {}, message=rt.visitor_text(str(exc)))
                raise gr.Error(rt.visitor_text(str(exc))) from None

        def generate(backend=None, model=None, seed=None, sg_mode=None, truncation_psi=None, truncation_cutoff=None,
                     noise_mode=None, class_index=None, sg_batch_size=None, mix_rows=None, mix_cols=None, mix_from=None,
                     mix_to=None, frames_per_seed=None, interp_space=None, animation_format=None, fps=None, prompt=None,
                     negative_prompt=None, steps=None, guidance=None, size=None, scheduler=None, batch_size=None,
                     init_image=None, strength=None, preview_every=None, precision=None, channels_last=None,
                     attention=None, compile_mode=None, fp8=None, prune_amount=None, prune_method=None, tensorrt=None,
                     memory_savers=None, ticket=None, sess: SessionState = None, request: gr.Request = None):
            """Generate images with the StyleGAN or diffusion backend; yields progress, ends with the gallery."""
            spec = _spec_for_event(locals(), job_spec, ticket, sess, request)
            skip = gr.skip()
            for ev in rt.run(sess, spec, ticket):
                if not ev.done:
                    prev = gr.Image(value=ev.preview, visible=True) if ev.preview is not None else skip
                    yield skip, prev, skip, skip, skip
                    continue
                snap = sess.tracker.snapshot()
                html = panel.render_progress(snap, None, 0)
                if ev.state == DONE or (ev.state == STOPPED and ev.items):   # a stop keeps what it finished
                    first = ev.items[0] if ev.items else None
                    yield (_gallery_value(ev.items), gr.Image(value=None, visible=False), html,
                           first.params if first else None,
                           gr.DownloadButton(value=first.path if first else None, interactive=first is not None))
                elif ev.state == STOPPED:
                    yield (skip, skip, skip, skip, skip) if ev.quiet else (skip, gr.Image(visible=False), html, skip, skip)
                else:
                    yield skip, gr.Image(visible=False), html, skip, skip
                    raise gr.Error(ev.message)

        def compare(backend=None, model=None, seed=None, sg_mode=None, truncation_psi=None, truncation_cutoff=None,
                    noise_mode=None, class_index=None, sg_batch_size=None, mix_rows=None, mix_cols=None, mix_from=None,
                    mix_to=None, frames_per_seed=None, interp_space=None, animation_format=None, fps=None, prompt=None,
                    negative_prompt=None, steps=None, guidance=None, size=None, scheduler=None, batch_size=None,
                    init_image=None, strength=None, preview_every=None, precision=None, channels_last=None,
                    attention=None, compile_mode=None, fp8=None, prune_amount=None, prune_method=None, tensorrt=None,
                    memory_savers=None, ticket=None, sess: SessionState = None, request: gr.Request = None):
            """Run the request with the fp32 reference and with the chosen toggles; yields progress, ends with
            the two images on a slider, their difference map and a table of latency, memory and drift."""
            values = dict(locals())
            skip = gr.skip()
            if ticket == NO_JOB:          # every toggle off (see prepare): a note in the tab, no job, no error
                v = {k: val for k, val in values.items() if k in CONTROL_NAMES and val is not None}
                note = nothing_to_compare(compare_spec(v, settings.device).request)
                yield skip, skip, render_nothing_to_compare(note or ""), skip
                return
            spec = _spec_for_event(values, compare_spec, ticket, sess, request)
            for ev in rt.run(sess, spec, ticket):
                if not ev.done:
                    yield skip, skip, skip, skip
                    continue
                html = panel.render_progress(sess.tracker.snapshot(), None, 0)
                if ev.state == DONE and sess.comparison is not None:
                    c = sess.comparison
                    yield ((c.reference.images[0], c.candidate.images[0]),
                           gr.Image(value=_upscaled(c.heat), label=f"Difference, first image (amplified {c.gain:.0f}×)"),
                           render_comparison(c), html)
                elif ev.state == FAILED:
                    yield skip, skip, skip, html
                    raise gr.Error(ev.message)
                else:
                    yield (skip, skip, skip, skip) if ev.quiet else (skip, skip, skip, html)

        def job_finished(sess: SessionState, ticket=None):
            """After the event chain: drop the ticket if its job never started (e.g. the queue refused it),
            and refresh the panel at once rather than at the next timer tick."""
            t = sess.tickets.pop(int(ticket), None) if ticket else None
            if t is not None:
                rt.queue.leave(t)
                if sess.job is None and sess.tracker.state == QUEUED:
                    sess.tracker.finish(STOPPED, {}, message="The job did not start.")
            return telemetry(sess)

        def stop(sess: SessionState):
            """Stop this session's job (running or waiting). Other sessions' jobs are not touched."""
            hit = sess.cancel()
            rt.withdraw(sess)
            if sess.job is None and sess.tracker.state == QUEUED:
                sess.tracker.finish(STOPPED, {}, message="Stopped before it started.")
            snap = sess.tracker.snapshot()
            if not hit or not snap.active:
                return panel.render_progress(snap, None, 0)
            return panel.render_stopping(snap)

        def telemetry(sess: SessionState):
            """The side panel: device, memory, this session's job, last latency, charts, progress."""
            reading = rt.memory.sample()
            snap = sess.tracker.snapshot()
            pos = rt.queue.position(sess.waiting_ticket())
            waiting, running = rt.queue.counts()
            htmls = [panel.render_device(reading, snap.active), panel.render_memory(reading, snap),
                     panel.render_job(snap, pos, waiting, running), panel.render_latency(snap),
                     panel.render_charts(snap, rt.memory.series(), reading.kind),
                     panel.render_progress(snap, pos, waiting)]
            want = FAST_TICK_S if snap.active else SLOW_TICK_S
            timer_update = gr.Timer(want) if sess.timer_interval != want else gr.skip()
            sess.timer_interval = want
            return (*htmls, timer_update)

        def select_image(sess: SessionState, evt: gr.SelectData):
            sess.selected = evt.index if isinstance(evt.index, int) else None
            item = sess.selected_item()
            if item is None:
                return None, gr.DownloadButton(value=None, interactive=False)
            return item.params, gr.DownloadButton(value=item.path, interactive=True)

        def read_png_info(path: str | None):
            """Parameters embedded in a PNG (Atelier's own, or AUTOMATIC1111's 'parameters' text)."""
            if not path:
                return None, None, None
            try:
                params = read_png_params(path)
            except AtelierError as exc:
                raise gr.Error(rt.visitor_text(str(exc))) from None
            return path, params, None      # the drop zone empties, ready for the next file

        def mode_setter(mode: str):
            def set_mode():
                return mode
            set_mode.__name__ = f"mode_{mode.replace('-', '_')}"
            return set_mode

        def page_load(sess: SessionState, request: gr.Request):
            rt.remember(getattr(request, "session_hash", None), sess)
            return telemetry(sess)

        def page_unload(request: gr.Request):
            rt.forget(getattr(request, "session_hash", None))

        # -- wiring ------------------------------------------------------------------------------
        fast = dict(queue=False, show_progress="hidden")
        diffusion_knobs = [C["steps"], C["guidance"], C["size"], C["scheduler"]]
        C["backend"].input(_bound(switch_backend, services, memory_toggle), [C["backend"], C["seed"], session],
                           [C["model"], sg_group, df_group, C["seed"], C["memory_savers"]],
                           api_name="switch_backend", **fast
                           ).then(model_defaults, [C["backend"], C["model"]], diffusion_knobs,
                                  api_name="backend_model_defaults", **fast)
        C["model"].input(model_defaults, [C["backend"], C["model"]], diffusion_knobs, api_name="model_defaults", **fast)
        mix_in, mix_out = [C["backend"], C["model"], C["mix_from"], C["mix_to"]], [C["mix_from"], C["mix_to"]]
        mix_range = _bound(mix_layer_sliders, services)
        C["model"].change(mix_range, mix_in, mix_out, api_name="mix_layers", **fast)
        refresh_btn.click(list_models, [C["backend"], C["model"], session], C["model"], api_name="list_models", **fast)
        # the picker's value set by code fires no .input: the added model's native size and steps follow here
        add_btn.click(add_model, [add_ref, C["backend"], session], [C["model"], add_status], api_name="add_model",
                      queue=False
                      ).success(model_defaults, [C["backend"], C["model"]], diffusion_knobs, api_name=False, **fast)
        add_ref.submit(add_model, [add_ref, C["backend"], session], [C["model"], add_status],
                       api_name="add_model_submit", queue=False
                       ).success(model_defaults, [C["backend"], C["model"]], diffusion_knobs, api_name=False, **fast)
        dice_btn.click(roll_seed, None, C["seed"], api_name="random_seed", **fast)
        reuse_btn.click(reuse_seed, [C["backend"], session], C["seed"], api_name="reuse_seed", **fast)
        for tab, mode in ((tab_images, "images"), (tab_mix, "style-mix"), (tab_interp, "interpolate")):
            tab.select(mode_setter(mode), None, C["sg_mode"], api_name=f"mode_{mode.replace('-', '_')}", **fast)

        # the click takes a place in the GPU queue (shown at once); its generate event carries that
        # ticket, so a Stop while it waits cancels exactly this job, however many clicks follow.
        # It goes through Gradio's queue (its own lane, not the GPU's) because only a queued event's error
        # reaches the page as a toast: a refused press ("Not queued: …") must say why.
        prep = dict(concurrency_id="prepare", concurrency_limit=8, show_progress="hidden")
        gen_event = generate_btn.click(prepare, controls + [session], [progress_box, timer, ticket_box],
                                       api_name="queue_job", **prep)
        gen_event.success(generate, controls + [ticket_box, session],
                          [gallery, preview, progress_box, selected_params, download_btn],
                          api_name="generate", concurrency_id="gpu", concurrency_limit=1,
                          show_progress="hidden", trigger_mode="multiple"
                          ).then(job_finished, [session, ticket_box], panel_outputs + [timer], api_name="job_finished",
                                 **fast
                                 ).then(_bound(record_history, ctx), [session, history_state],
                                        [history_state, history_gallery], api_name="record_history", **fast
                                        ).then(mix_range, mix_in, mix_out, api_name=False, **fast)  # a pickle: now loaded
        cmp_event = compare_btn.click(prepare_compare, controls + [session], [progress_box, timer, ticket_box],
                                      api_name="queue_compare", **prep)
        cmp_event.success(compare, controls + [ticket_box, session],
                          [compare_slider, compare_diff, compare_table, progress_box],
                          api_name="compare", concurrency_id="gpu", concurrency_limit=1,
                          show_progress="hidden", trigger_mode="multiple"
                          ).then(job_finished, [session, ticket_box], panel_outputs + [timer],
                                 api_name="compare_finished", **fast)
        C["prompt"].submit(lambda: None, None, None, js="() => document.querySelector('#generate-btn').click()",
                           api_name="prompt_submit", queue=False)
        stop_btn.click(stop, session, progress_box, api_name="stop", **fast)
        timer.tick(telemetry, session, panel_outputs + [timer], api_name="telemetry", **fast)
        gallery.select(select_image, session, [selected_params, download_btn], api_name="select_image", **fast)
        # queued (not in the GPU's): a model the parameters name but this studio lacks is said in a toast
        send_back_btn.click(_bound(send_back, ctx), session, send_outputs, api_name="send_back",
                            concurrency_id="restore", show_progress="hidden")
        png_file.upload(read_png_info, png_file, [png_preview, png_params, png_file], api_name="read_png_info",
                        concurrency_id="files", concurrency_limit=4)
        png_send_btn.click(_bound(send_png_params, ctx), [png_params, session], send_outputs,
                           api_name="send_png_params", concurrency_id="restore", show_progress="hidden")
        demo.load(page_load, session, panel_outputs + [timer], api_name="page_load", **fast)
        demo.load(_bound(show_history, ctx), history_state, [history_state, history_gallery], api_name="show_history",
                  **fast)
        demo.load(None, None, None, js=load_js())
        history_gallery.select(select_history, history_state, history_params, api_name="select_history", **fast)
        history_send_btn.click(_bound(send_png_params, ctx), [history_params, session], send_outputs,
                               api_name="send_history_params", concurrency_id="restore", show_progress="hidden")
        history_clear_btn.click(clear_history, None, [history_state, history_gallery, history_params],
                                api_name="clear_history", **fast)
        prompt_drop.upload(_bound(read_dropped_png, ctx), [prompt_drop, session],
                           send_outputs + [png_params, prompt_drop], api_name="read_dropped_png",
                           concurrency_id="files", concurrency_limit=4, show_progress="hidden")
        demo.unload(page_unload)

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
                                 ("fp8", "FP8 linear layers", "opt-fp8"), ("tensorrt", "TensorRT engine", "opt-tensorrt")):
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
