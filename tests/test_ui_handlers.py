"""The studio's top-level event handlers (ui/handlers.py) and its one request object (ui/form.py), called
directly on real services over the StyleGAN test pickle: no server, no browser."""
from __future__ import annotations

import inspect
from dataclasses import fields

import gradio as gr
import pytest
from gradio import utils as gr_utils

from core.errors import InputError
from core.settings import Settings
from pipelines.services import build_services
from tests.ui_helpers import SG_UNCOND
from ui import handlers
from ui.controls import DEFAULT_SEED_TEXT, compare_spec, job_spec
from ui.form import (CONTROL_NAMES, StudioForm, check_components, form_from_named, form_from_values,
                     request_values, spec_from_form)
from ui.state import SessionState


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, testdata):
    from ui.runner import StudioRuntime

    tmp = tmp_path_factory.mktemp("handlers")
    settings = Settings(extra_models=(str(SG_UNCOND),), models_dirs=(), output_dir=tmp / "out",
                        cache_dir=tmp / "cache", default_stylegan_model=str(SG_UNCOND), device="cpu")
    services = build_services(settings)
    return handlers.StudioContext(services, StudioRuntime(services), ("default", "euler"), False)


def _values(**given) -> list:
    """The controls' values in CONTROL_NAMES order, as Gradio passes them (None where not given)."""
    return [given.get(n) for n in CONTROL_NAMES]


# -- the request object ---------------------------------------------------------------------------
def test_the_form_fields_are_the_control_names_in_order():
    assert tuple(f.name for f in fields(StudioForm)) == CONTROL_NAMES
    assert len(CONTROL_NAMES) == len(set(CONTROL_NAMES)) == 41
    # controls added later go last, so positional API calls written before them keep working
    assert CONTROL_NAMES[:3] == ("backend", "model", "seed") and CONTROL_NAMES[-6:] == (
        "memory_savers", "fuse_qkv", "request_graph", "tiny_vae", "preview_method", "truncation_centre")


def test_form_from_values_maps_each_value_to_its_field():
    values = [f"v{i}" for i in range(len(CONTROL_NAMES))]
    form = form_from_values(values)
    assert [getattr(form, n) for n in CONTROL_NAMES] == values
    assert form_from_values(_values(backend="stylegan", seed="3")).given() == {"backend": "stylegan", "seed": "3"}


def test_a_wrong_number_of_values_is_a_clear_error():
    with pytest.raises(TypeError, match=r"takes 41 control values.*got 39 \(missing preview_method, truncation_centre\)"):
        form_from_values(_values()[:-2])
    with pytest.raises(TypeError, match=r"got 42 \(1 value\(s\) too many\)"):
        form_from_values(_values() + ["x"])
    with pytest.raises(TypeError, match="not studio controls: colour, sed"):
        form_from_named({"backend": "stylegan", "sed": "1", "colour": "red"})
    assert form_from_named({"seed": "1"}) == StudioForm(seed="1")


def test_the_layout_components_must_match_the_form():
    comps = {n: object() for n in CONTROL_NAMES}
    assert check_components(comps) == [comps[n] for n in CONTROL_NAMES]
    with pytest.raises(TypeError, match=r"missing \['fps'\], not in the form \['fps2'\]"):
        check_components({**{n: c for n, c in comps.items() if n != "fps"}, "fps2": object()})


def test_the_api_signature_is_every_control_then_ticket_and_session(ctx):
    """What gradio_client sees for /generate and /compare: every control by name, each optional; the request
    is filled in by Gradio (not a parameter of the API)."""
    for handler in (handlers.generate, handlers.compare):
        endpoint = handlers.form_endpoint(handler, ctx)
        assert endpoint.__name__ == handler.__name__ and endpoint.__doc__ == handler.__doc__
        assert inspect.isgeneratorfunction(endpoint)
        params = gr_utils.get_function_params(endpoint)
        assert [p[0] for p in params] == list(CONTROL_NAMES) + ["ticket", "sess"]
        assert all(has_default and default is None for _n, has_default, default, _t in params)
        assert gr_utils.get_type_hints(endpoint)["request"] is gr.Request


def test_bind_keeps_the_special_parameters_gradio_fills_in(ctx):
    page_load = handlers.bind(handlers.page_load, ctx)
    assert page_load.__name__ == "page_load"
    assert [p[0] for p in gr_utils.get_function_params(page_load)] == ["sess"]      # request: Gradio's
    assert gr_utils.is_special_typed_parameter("request", gr_utils.get_type_hints(page_load))
    assert [p[0] for p in gr_utils.get_function_params(handlers.select_image)] == ["sess"]   # evt: Gradio's
    prepare = handlers.bind(handlers.prepare, ctx)
    assert list(inspect.signature(prepare).parameters) == ["values"]       # /queue_job: *values, as before


# -- the diffusion seed: StyleGAN's untouched default is random, a typed 0-7 is taken as typed -----
DIFFUSION = dict(backend="diffusion", prompt="a red fox", size="64x64", steps=2)


def test_a_diffusion_request_with_the_pages_stylegan_seed_is_random():
    form = StudioForm(**DIFFUSION, seed=DEFAULT_SEED_TEXT["stylegan"])
    assert request_values(form, "stylegan")["seed"] == ""                  # the field never given to diffusion
    seeds = {spec_from_form(form, job_spec, None, "stylegan").request.params.seed for _ in range(4)}
    assert len(seeds) > 1


def test_a_0_7_typed_for_diffusion_is_taken_as_typed():
    form = StudioForm(**DIFFUSION, seed="0-7")
    assert request_values(form, "diffusion")["seed"] == "0-7"              # not swapped for a random seed
    with pytest.raises(InputError, match="one whole number"):             # diffusion takes one seed: said
        spec_from_form(form, job_spec, None, "diffusion")
    assert spec_from_form(StudioForm(**DIFFUSION, seed="7"), job_spec, None, "diffusion").request.params.seed == 7
    assert spec_from_form(StudioForm(**DIFFUSION, seed="7"), job_spec, None, "stylegan").request.params.seed == 7


def test_stylegan_keeps_its_default_list():
    spec = spec_from_form(StudioForm(backend="stylegan", seed="0-7"), job_spec, None, "stylegan")
    assert spec.request.params.seeds == tuple(range(8))


def test_the_seed_field_belongs_to_the_backend_it_was_last_given_to(ctx):
    sess = SessionState()
    assert sess.seed_backend == "stylegan"                                  # the page opens on StyleGAN
    handlers.switch_backend(ctx.services, False, "diffusion", "0-7", sess)
    assert sess.seed_backend == "diffusion"
    handlers.switch_backend(ctx.services, False, "stylegan", "", sess)
    assert sess.seed_backend == "stylegan"
    handlers.send_png_params(ctx, {"backend": "diffusion", "prompt": "a cat", "seed": 5}, sess)   # a restore
    assert sess.seed_backend == "diffusion"


def test_prepare_after_a_switch_to_diffusion_refuses_a_typed_range(ctx):
    sess = SessionState()
    handlers.switch_backend(ctx.services, False, "diffusion", "0-7", sess)
    with pytest.raises(gr.Error, match="one whole number"):
        handlers.prepare(ctx, *_values(**DIFFUSION, seed="0-7"), sess)
    assert not sess.tickets                                                   # nothing queued


# -- the handlers, one by one ----------------------------------------------------------------------
def test_prepare_queues_once_and_refuses_a_second_press(ctx):
    sess = SessionState()
    html, timer, ticket = handlers.prepare(ctx, *_values(backend="stylegan", seed="0"), sess)
    assert ticket in sess.tickets and isinstance(html, str) and isinstance(timer, gr.Timer)
    with pytest.raises(gr.Error, match="Not queued"):
        handlers.prepare(ctx, *_values(backend="stylegan", seed="1"), sess)
    handlers.stop(ctx, sess)                                                  # Stop while it waits
    assert sess.waiting_ticket() is None
    handlers.job_finished(ctx, sess, ticket)
    assert not sess.tickets and ctx.rt.queue.counts() == (0, 0)


def test_prepare_says_a_bad_value_at_once(ctx):
    with pytest.raises(gr.Error, match="seed"):
        handlers.prepare(ctx, *_values(backend="stylegan", seed="zero"), SessionState())


def test_generate_runs_a_form_to_the_gallery(ctx):
    sess = SessionState()
    *_, ticket = handlers.prepare(ctx, *_values(backend="stylegan", seed="0-1", sg_batch_size=2), sess)
    endpoint = handlers.form_endpoint(handlers.generate, ctx)
    outputs = list(endpoint(*_values(backend="stylegan", seed="0-1", sg_batch_size=2), ticket, sess, None))
    gallery, _preview, progress, params, download = outputs[-1]
    assert len(gallery) == 2 and "Done" in progress and params["backend"] == "stylegan"
    assert download.value is not None
    assert len(sess.results) == 2
    panel_out = handlers.job_finished(ctx, sess, ticket)
    assert len(panel_out) == 7                                                # six readouts and the timer
    item = handlers.select_image(sess, gr.SelectData(None, {"index": 1, "value": None}))
    assert item[0] is sess.results[1].params
    assert handlers.reuse_seed("stylegan", sess) == "0,1"


def test_a_bad_value_in_the_event_gives_up_its_queue_place(ctx):
    sess = SessionState()
    *_, ticket = handlers.prepare(ctx, *_values(backend="stylegan", seed="0"), sess)
    with pytest.raises(gr.Error, match="seed"):
        list(handlers.generate(ctx, StudioForm(backend="stylegan", seed="x"), ticket, sess, None))
    assert ticket not in sess.tickets and ctx.rt.queue.counts() == (0, 0)


def test_compare_with_every_toggle_off_is_a_note_not_a_job(ctx):
    sess = SessionState()
    form = StudioForm(backend="stylegan", seed="0", precision="fp32")
    assert handlers.prepare_compare(ctx, *_values(**form.given()), sess)[2] == handlers.NO_JOB
    [(_s, _d, table, _p)] = list(handlers.compare(ctx, form, handlers.NO_JOB, sess, None))
    assert 'id="compare-nothing"' in table and "Nothing to compare" in table
    assert not sess.tickets
    assert compare_spec(form.given()).kind == "compare"


def test_small_handlers(ctx):
    sess = SessionState()
    assert len(handlers.telemetry(ctx, sess)) == 7
    assert handlers.stop(ctx, sess) == handlers.panel.render_progress(sess.tracker.snapshot(), None, 0)  # idle
    assert handlers.model_defaults(ctx, "stylegan", str(SG_UNCOND)) == (gr.skip(),) * 4
    picker = handlers.list_models(ctx, "stylegan", "nope", sess)
    assert picker.value == ctx.services.catalogue.default("stylegan").id      # an unknown current: the default
    set_mix = handlers.mode_setter("style-mix")
    assert set_mix.__name__ == "mode_style_mix" and set_mix() == "style-mix"
    assert handlers.read_png_info(ctx, None) == (None, None, None)
    assert handlers.clear_history() == ([], [], None)


def test_the_train_tabs_model_callbacks(ctx):
    model_id = handlers.known_stylegan_model(ctx.services, str(SG_UNCOND))
    assert model_id == handlers.known_stylegan_model(ctx.services, model_id)       # known: not added twice
    assert handlers.picker_update(ctx.services, "stylegan", model_id).value == model_id
    assert handlers.picker_update(ctx.services, "stylegan", "missing").value == ctx.services.catalogue.default("stylegan").id
