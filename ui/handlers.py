"""The studio's event handlers: each a small top-level function, named, and callable from a test.

What a handler shares with the others comes in explicitly: a `StudioContext` (services, runtime, a few facts
about the page) bound with `functools.partial` when the page is wired (`ui/studio.py`), and the tab's
`SessionState`. Generate and Compare take the controls as one `StudioForm` (`ui/form.py`); `form_endpoint`
gives them the API signature `gradio_client` sees (every control by name, each optional).
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import gradio as gr

from core.errors import AtelierError
from core.pnginfo import read_png_params
from pipelines.services import Services
from pipelines.tools import optimization_availability
from telemetry.live import DONE, FAILED, QUEUED, STOPPED
from ui import history, panel
from ui.access import redact_paths
from ui.compare import render_comparison
from ui.controls import (DEFAULT_SCHEDULERS, DEFAULT_SEED_TEXT, compare_spec, controls_from_params, find_model,
                         job_spec, last_seed_text, random_seed, seed_label, size_label)
from ui.form import CONTROL_NAMES, TEXT_CONTROLS, StudioForm, form_from_values, spec_from_form
from ui.runner import MAX_GALLERY, StudioRuntime
from ui.state import SessionState

log = logging.getLogger("atelier.ui")
FAST_TICK_S, SLOW_TICK_S = 0.5, 2.0      # panel refresh: about 2 Hz while a job runs, slower when idle
# a second Generate (or Ctrl+Enter) while this tab's job runs: one job per tab, said rather than queued,
# so a double press never runs the same request twice
ALREADY_RUNNING = ("Not queued: this tab already has a job queued or running (one at a time). "
                   "Wait for it to finish, or press Stop, then Generate again.")


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


def bind(fn: Callable, *first) -> Callable:
    """`fn` with its first arguments (the context, the services) fixed, as a plain function that Gradio reads
    as it reads `fn`: the same name and docstring, the rest of the signature and its type hints, so a
    `gr.Request` or `gr.SelectData` parameter is still filled in (a bare functools.partial hides them)."""
    sig = inspect.signature(fn)
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def bound(*args, **kwargs):
            yield from fn(*first, *args, **kwargs)
    else:
        @functools.wraps(fn)
        def bound(*args, **kwargs):
            return fn(*first, *args, **kwargs)
    bound.__signature__ = sig.replace(parameters=list(sig.parameters.values())[len(first):])
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

    @property
    def settings(self):
        return self.services.settings

    def visitor_text(self, text: str) -> str:
        return self.rt.visitor_text(text)


@dataclass(frozen=True)
class Restored:
    """Control updates from saved parameters, in the order of `CONTROL_NAMES` + the two backend groups and
    the StyleGAN tabs; `note` says what could not be restored exactly (a model this studio lacks)."""

    updates: tuple
    note: str = ""
    backend: str = "stylegan"                # whose seed the restored seed field holds


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
    return Restored(tuple(out), note, backend)


def _restore(ctx: StudioContext, meta: dict, sess: SessionState | None) -> tuple:
    restored = restore_controls(ctx, meta, _owner_of(ctx.services.settings, sess))
    if sess is not None:
        sess.seed_backend = restored.backend
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


def class_choices(services: Services, backend: str, model: str | None):
    """The Class box lists the selected model's classes ("32 · animal-mammal"; the value is the index) and still
    takes typed text (an index or a name). Unconditional: empty, and says so. A new model starts with no class."""
    known = services.manager.classes(model or None) if backend == "stylegan" else None
    if known is None:                        # a pickle not run yet: its classes are unknown until it loads
        return gr.Dropdown(choices=[], value=None,
                           info="type an index, or leave it empty"
                           if backend == "stylegan" else None)
    c_dim, names = known
    if not c_dim:
        return gr.Dropdown(choices=[], value=None, info="unconditional model")
    choices = [(f"{k} · {names[k].rsplit('/', 1)[-1]}" if k < len(names) else str(k), str(k)) for k in range(c_dim)]
    return gr.Dropdown(choices=choices, value=None, info=f"{c_dim} classes; empty: seed s draws class s % {c_dim}")


def switch_backend(services: Services, memory_toggle: bool, backend: str, seed: str, sess: SessionState = None):
    """Show the controls of the chosen backend and its models. The seed field keeps each backend's own
    text: StyleGAN's list comes back when you return to it, and diffusion starts empty (= random)."""
    choices, default, note = _model_choices(services, backend, _owner_of(services.settings, sess))
    sg = backend == "stylegan"
    seed_text = DEFAULT_SEED_TEXT.get(backend, "")
    if sess is not None:
        sess.seed_texts["diffusion" if sg else "stylegan"] = seed or ""
        seed_text = sess.seed_texts.get(backend, seed_text)
        sess.seed_backend = backend
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


# -- models ----------------------------------------------------------------------------------
def picker_update(services: Services, backend: str, select: str | None):
    """The model picker listing `backend`'s models with `select` chosen (e.g. a model the Train tab exported)."""
    choices, default, note = _model_choices(services, backend)
    return gr.Dropdown(choices=choices, value=select if select in [c[1] for c in choices] else default,
                       info=note or None)


def known_stylegan_model(services: Services, path: str) -> str:
    """The catalogue id of a StyleGAN file, adding it when no scanned folder lists it."""
    for e in services.catalogue.entries("stylegan"):
        if path in (e.id, e.path):
            return e.id
    return services.catalogue.add(path, "stylegan").id


def model_defaults(ctx: StudioContext, backend: str, model: str | None):
    """Picking a diffusion model sets its native size, steps, guidance and scheduler."""
    d = _diffusion_defaults(ctx.services, model) if backend == "diffusion" else None
    if not d:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip()
    sched = d.get("scheduler", "default")
    return (gr.Slider(value=d["steps"]), gr.Slider(value=d["guidance"]),
            gr.Dropdown(value=size_label(d["width"], d["height"])),
            gr.Dropdown(value=sched if sched in ctx.schedulers else "default"))


def list_models(ctx: StudioContext, backend: str, current: str | None, sess: SessionState = None):
    """↻: the picker's models again (a file copied into a models folder appears), keeping the current one."""
    choices, default, note = _model_choices(ctx.services, backend, _owner_of(ctx.settings, sess))
    ids = [c[1] for c in choices]
    return gr.Dropdown(choices=choices, value=current if current in ids else default, info=note)


def add_model(ctx: StudioContext, ref: str, backend: str, sess: SessionState):
    """Add a model by path or hub id (local mode: for everyone; public mode, where the host allows it:
    for this session only)."""
    if not ctx.settings.visitor_may("add-model"):
        raise gr.Error("Adding models is off on this public studio: pick one from the model list "
                       "(the host can allow it with --allow add-model).")
    owner = _owner_of(ctx.settings, sess)
    try:
        entry = ctx.services.catalogue.add(ref, backend, owner=owner)
    except AtelierError as exc:
        raise gr.Error(ctx.visitor_text(str(exc))) from None
    choices, _default, note = _model_choices(ctx.services, backend, owner)
    return gr.Dropdown(choices=choices, value=entry.id, info=note), f"Added **{entry.id}** ({entry.source})."


# -- Generate and Compare ----------------------------------------------------------------------
def form_spec(ctx: StudioContext, form: StudioForm, make_spec, sess: SessionState | None):
    """The job a form asks for, with the model the backend can use (None = its default, when the form names
    the other backend's model: the picker's initial value an API call carries). Raises AtelierError."""
    form = replace(form, model=_model_for_backend(ctx.services, form.backend or "stylegan", form.model))
    seed_backend = sess.seed_backend if sess is not None else "stylegan"
    return spec_from_form(form, make_spec, ctx.settings.device, seed_backend)


def _prepare(ctx: StudioContext, values: tuple, make_spec):
    *vals, sess = values
    form = form_from_values(vals)
    if sess.job is not None or sess.waiting_ticket() is not None:
        raise gr.Error(ALREADY_RUNNING)
    waiting, _running = ctx.rt.queue.counts()
    limit = ctx.settings.queue_max_size
    if limit and waiting >= limit:
        raise gr.Error(f"The GPU queue is full ({waiting} jobs waiting, the limit is {limit}). Try again in a minute.")
    try:
        spec = form_spec(ctx, form, make_spec, sess)
    except AtelierError as exc:
        raise gr.Error(ctx.visitor_text(str(exc))) from None
    if spec.kind == "compare" and nothing_to_compare(spec.request):
        return gr.skip(), gr.skip(), NO_JOB      # not an error: the Compare tab says what to turn on
    ticket = ctx.rt.enqueue(sess, spec.kind)
    html = panel.render_progress(sess.tracker.snapshot(), ctx.rt.queue.position(ticket), ctx.rt.queue.counts()[0])
    sess.timer_interval = FAST_TICK_S
    return html, gr.Timer(FAST_TICK_S), ticket.id


def prepare(ctx: StudioContext, *values):
    """Validate at once (errors show before the job queues) and mark this session as waiting."""
    # values: every control in CONTROL_NAMES order, then the session
    return _prepare(ctx, values, job_spec)


def prepare_compare(ctx: StudioContext, *values):
    """As prepare, for the Compare button."""
    return _prepare(ctx, values, compare_spec)


def _event_spec(ctx: StudioContext, form: StudioForm, make_spec, ticket, sess: SessionState, request):
    """The job an event's form asks for; a bad value gives up the event's queue place and shows its message."""
    ctx.rt.remember(getattr(request, "session_hash", None), sess)
    try:
        return form_spec(ctx, form, make_spec, sess)
    except AtelierError as exc:
        t = sess.tickets.pop(int(ticket), None) if ticket else None
        if t is not None:
            ctx.rt.queue.leave(t)
        sess.tracker.finish(FAILED, {}, message=ctx.visitor_text(str(exc)))
        raise gr.Error(ctx.visitor_text(str(exc))) from None


def generate(ctx: StudioContext, form: StudioForm, ticket=None, sess: SessionState = None,
             request: gr.Request = None) -> Iterator[tuple]:
    """Generate images with the StyleGAN or diffusion backend; yields progress, ends with the gallery."""
    spec = _event_spec(ctx, form, job_spec, ticket, sess, request)
    skip = gr.skip()
    for ev in ctx.rt.run(sess, spec, ticket):
        if not ev.done:
            prev = gr.Image(value=ev.preview, visible=True) if ev.preview is not None else skip
            yield skip, prev, skip, skip, skip
            continue
        html = panel.render_progress(sess.tracker.snapshot(), None, 0)
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


def compare(ctx: StudioContext, form: StudioForm, ticket=None, sess: SessionState = None,
            request: gr.Request = None) -> Iterator[tuple]:
    """Run the request with the fp32 reference and with the chosen toggles; yields progress, ends with
    the two images on a slider, their difference map and a table of latency, memory and drift."""
    skip = gr.skip()
    if ticket == NO_JOB:          # every toggle off (see prepare): a note in the tab, no job, no error
        note = nothing_to_compare(form_spec(ctx, form, compare_spec, sess).request)
        yield skip, skip, render_nothing_to_compare(note or ""), skip
        return
    spec = _event_spec(ctx, form, compare_spec, ticket, sess, request)
    for ev in ctx.rt.run(sess, spec, ticket):
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


# the parameters after the controls that Generate and Compare take (the ticket box and the session)
FORM_EXTRAS = ("ticket", "sess")


def form_endpoint(handler: Callable[..., Iterator], ctx: StudioContext) -> Callable[..., Iterator]:
    """`handler(ctx, form, ticket, sess, request)` as the event function Gradio calls with every control, the
    ticket and the session, in that order. Its signature names each control (CONTROL_NAMES), all optional:
    that is the API `gradio_client` sees (`c.predict(backend="stylegan", seed="0-7", api_name="/generate")`)."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
              for n in CONTROL_NAMES + FORM_EXTRAS]
    params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                    annotation=gr.Request))
    sig = inspect.Signature(params)

    def endpoint(*args, **kwargs):
        given = sig.bind(*args, **kwargs).arguments
        form = form_from_values([given.get(n) for n in CONTROL_NAMES])
        yield from handler(ctx, form, given.get("ticket"), given.get("sess"), given.get("request"))

    endpoint.__name__ = endpoint.__qualname__ = handler.__name__
    endpoint.__doc__ = handler.__doc__
    endpoint.__signature__ = sig
    endpoint.__annotations__ = {"sess": SessionState, "request": gr.Request}   # what Gradio's type hints read
    return endpoint


# -- the side panel, Stop, the gallery ---------------------------------------------------------
def telemetry(ctx: StudioContext, sess: SessionState):
    """The side panel: device, memory, this session's job, last latency, charts, progress."""
    rt = ctx.rt
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


def job_finished(ctx: StudioContext, sess: SessionState, ticket=None):
    """After the event chain: drop the ticket if its job never started (e.g. the queue refused it),
    and refresh the panel at once rather than at the next timer tick."""
    t = sess.tickets.pop(int(ticket), None) if ticket else None
    if t is not None:
        ctx.rt.queue.leave(t)
        if sess.job is None and sess.tracker.state == QUEUED:
            sess.tracker.finish(STOPPED, {}, message="The job did not start.")
    return telemetry(ctx, sess)


def stop(ctx: StudioContext, sess: SessionState):
    """Stop this session's job (running or waiting). Other sessions' jobs are not touched."""
    hit = sess.cancel()
    ctx.rt.withdraw(sess)
    if sess.job is None and sess.tracker.state == QUEUED:
        sess.tracker.finish(STOPPED, {}, message="Stopped before it started.")
    snap = sess.tracker.snapshot()
    if not hit or not snap.active:
        return panel.render_progress(snap, None, 0)
    return panel.render_stopping(snap)


def select_image(sess: SessionState, evt: gr.SelectData):
    """A result picked in the gallery: its parameters, and the download of its file."""
    sess.selected = evt.index if isinstance(evt.index, int) else None
    item = sess.selected_item()
    if item is None:
        return None, gr.DownloadButton(value=None, interactive=False)
    return item.params, gr.DownloadButton(value=item.path, interactive=True)


def read_png_info(ctx: StudioContext, path: str | None):
    """Parameters embedded in a PNG (Atelier's own, or AUTOMATIC1111's 'parameters' text)."""
    if not path:
        return None, None, None
    try:
        params = read_png_params(path)
    except AtelierError as exc:
        raise gr.Error(ctx.visitor_text(str(exc))) from None
    return path, params, None      # the drop zone empties, ready for the next file


def mode_setter(mode: str) -> Callable[[], str]:
    """The StyleGAN tab `mode` selected: the hidden sg_mode field follows (a function per tab, named for it)."""
    def set_mode():
        return mode
    set_mode.__name__ = f"mode_{mode.replace('-', '_')}"
    return set_mode


def page_load(ctx: StudioContext, sess: SessionState, request: gr.Request):
    """A tab opened: its session is known by its hash (for the A1111 API's progress) and the panel fills."""
    ctx.rt.remember(getattr(request, "session_hash", None), sess)
    return telemetry(ctx, sess)


def page_unload(ctx: StudioContext, request: gr.Request):
    ctx.rt.forget(getattr(request, "session_hash", None))
