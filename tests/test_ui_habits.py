"""The artist habits of the studio (issue 16): random diffusion seeds with ♻ reuse, parameter restore,
the browser's history, a training run folder as a model, and the small fixes. The handlers are called
directly, on real services over the StyleGAN test pickles; no server, no browser."""
from __future__ import annotations

import gradio as gr
import pytest

from core.errors import InputError
from core.settings import Settings
from pipelines.services import build_services
from tests.ui_helpers import SG_COND, SG_UNCOND
from ui import studio
from ui.controls import DEFAULT_SEED_TEXT, diffusion_seed, last_seed_text, seeds_used
from ui.state import ResultItem, SessionState


@pytest.fixture(scope="module")
def services(tmp_path_factory, testdata):
    tmp = tmp_path_factory.mktemp("habits")
    settings = Settings(extra_models=(str(SG_UNCOND), str(SG_COND)), models_dirs=(), output_dir=tmp / "out",
                        cache_dir=tmp / "cache", default_stylegan_model=str(SG_UNCOND))
    return build_services(settings)


# -- 1. diffusion seed: random by default, the seed used is shown, ♻ reuses it ------------------
def test_switching_to_diffusion_empties_the_seed_and_switching_back_restores_the_list(services):
    sess = SessionState()
    model, _sg, _df, seed, _mem = studio.switch_backend(services, False, "diffusion", "3-9", sess)
    assert seed.value == "" and DEFAULT_SEED_TEXT["diffusion"] == ""        # empty = random, as the label says
    assert seed.label == "Seed (empty = random)"
    # the diffusion seed the artist typed is kept for the next visit; StyleGAN's list comes back
    _m, _sg, _df, seed, _mem = studio.switch_backend(services, False, "stylegan", "77", sess)
    assert seed.value == "3-9" and seed.label.startswith("Seeds")
    _m, _sg, _df, seed, _mem = studio.switch_backend(services, False, "diffusion", "3-9", sess)
    assert seed.value == "77"


def test_an_empty_diffusion_seed_draws_a_fresh_one_each_time():
    drawn = {diffusion_seed("") for _ in range(20)}
    assert len(drawn) > 1                       # not a fixed 0 (a collision of all 20 in 2^31 cannot happen)
    assert diffusion_seed("-1") >= 0 and diffusion_seed("42") == 42


def test_reuse_seed_takes_the_selected_diffusion_image_and_the_whole_stylegan_run():
    sess = SessionState()
    with pytest.raises(gr.Error, match="no image yet"):
        studio.reuse_seed("diffusion", sess)
    sess.results = [ResultItem("a.png", {"backend": "diffusion", "seed": 1234}),
                    ResultItem("b.png", {"backend": "diffusion", "seed": 1235})]
    assert studio.reuse_seed("diffusion", sess) == "1234"
    sess.selected = 1
    assert studio.reuse_seed("diffusion", sess) == "1235"
    sess.results = [ResultItem(f"{s}.png", {"backend": "stylegan", "seed": s}) for s in (4, 5, 6, 9)]
    assert studio.reuse_seed("stylegan", sess) == "4-6,9"
    with pytest.raises(InputError):
        last_seed_text([{"backend": "diffusion"}], "diffusion")


def test_seeds_used_names_the_seeds_for_the_result_line():
    assert seeds_used([{"seed": 1234}]) == "seed 1234"
    assert seeds_used([{"seed": 7}, {"seed": 8}, {"seed": 9}]) == "seeds 7-9"
    assert seeds_used([{}]) == ""


# -- 3. parameter restore -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ctx(services):
    from ui.runner import StudioRuntime

    return studio.StudioContext(services, StudioRuntime(services), ("default", "euler", "dpm++2m-karras"), True)


def _by_name(restored):
    return dict(zip(studio.CONTROL_NAMES + ("sg_group", "df_group", "sg_tabs"), restored.updates))


def test_an_a1111_png_restores_the_diffusion_seed_field_and_says_its_model_is_missing(ctx, testdata):
    from core.pnginfo import read_png_params

    meta = read_png_params(testdata / "pnginfo" / "a1111_v1_6.png")
    r = studio.restore_controls(ctx, meta)
    u = _by_name(r)
    assert u["backend"] == "diffusion"
    assert u["seed"].value == "1234567890" and u["seed"].label == "Seed (empty = random)"   # not "Seeds (e.g. 0-7…)"
    assert u["prompt"].startswith("a portrait of a red fox") and u["steps"] == 28 and u["guidance"] == 6.5
    assert u["size"] == "640×768" and u["strength"] == 0.45 and u["scheduler"] == "dpm++2m-karras"
    # the PNG names v1-5-pruned-emaonly, which this studio lacks: said, not swapped in silently
    assert "v1-5-pruned-emaonly" in r.note and "does not have" in r.note
    assert u["model"].info == r.note
    assert u["df_group"].visible is True and u["sg_group"].visible == "hidden"


def test_an_a1111_png_whose_model_is_installed_selects_it(ctx, testdata, tmp_path):
    from core.pnginfo import read_png_params

    folder = tmp_path / "v1-5-pruned-emaonly"
    folder.mkdir()
    ctx.services.catalogue.add(str(folder), "diffusion")
    r = studio.restore_controls(ctx, read_png_params(testdata / "pnginfo" / "a1111_v1_6.png"))
    assert r.note == "" and _by_name(r)["model"].value == str(folder)


def test_send_back_names_the_catalogue_entry_not_the_raw_path(ctx, services):
    """A result's `model` is the loaded file's path; the picker's value is the catalogue id. A bundled model's id
    is its name (emoji64), so restoring must map the path back to that id instead of adding the path as a choice."""
    bundled = next(e for e in services.catalogue.entries("stylegan") if e.source == "bundled")
    meta = {"backend": "stylegan", "model": bundled.path, "seed": 5, "truncation_psi": 0.6, "noise_mode": "const"}
    u = _by_name(studio.restore_controls(ctx, meta))
    ids = [c[1] for c in u["model"].choices]
    assert u["model"].value == bundled.id != bundled.path and bundled.path not in ids
    assert u["seed"].value == "5" and u["seed"].label.startswith("Seeds") and u["sg_group"].visible is True
    # a StyleGAN file that is gone: the default is shown, with the reason
    r = studio.restore_controls(ctx, {**meta, "model": "/gone/ffhq.pkl"})
    assert "ffhq.pkl" in r.note and _by_name(r)["model"].value == services.catalogue.default("stylegan").id


def test_send_back_handler_restores_the_selected_result(ctx):
    sess = SessionState()
    with pytest.raises(gr.Error, match="Select an image"):
        studio.send_back(ctx, sess)
    sess.results = [ResultItem("x.png", {"backend": "stylegan", "model": str(SG_COND), "seed": 11, "class_index": 2})]
    sess.selected = 0
    u = dict(zip(studio.CONTROL_NAMES, studio.send_back(ctx, sess)))
    assert u["model"].value == str(SG_COND) and u["seed"].value == "11" and u["class_index"] == "2"


# -- 6. a training run folder is a model --------------------------------------------------------
@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    import numpy as np

    from training.config import build_config
    from training.trainer import train

    tmp = tmp_path_factory.mktemp("run-as-model")
    rng = np.random.default_rng(0)
    imgs = np.full((16, 16, 16, 3), 255, dtype=np.uint8)
    for i in range(16):
        imgs[i, 2 + i % 8:8 + i % 8, 3:9] = rng.integers(0, 255, size=3)
    np.save(tmp / "squares.npy", imgs)
    cfg = build_config("tiny", 16, data=str(tmp / "squares.npy"), out=str(tmp / "mine"), kimg=0.016, device="cpu",
                       log_every=1, snapshot_kimg=0.0, aug="none", monitor_kimg=0.0)
    train(cfg, log=lambda s: None)
    return tmp / "mine"


def test_a_run_folder_loads_its_ema_generator(run_folder):
    import torch

    from core.errors import ModelLoadError
    from models.stylegan import load_generator
    from training.export import _load_g_ema

    loaded = load_generator(run_folder)
    reference, _doc = _load_g_ema(run_folder)          # the trainer's own way of building G_ema
    z = torch.randn(2, loaded.z_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = loaded.G(z, None, truncation_psi=1.0, noise_mode="const")
        b = reference(z, None, truncation_psi=1.0, noise_mode="const")
    assert a.shape == b.shape == (2, 3, 16, 16)
    assert torch.allclose(a, b, atol=1e-5)             # the same weights; built twice, so not bit-compared
    assert loaded.source == run_folder and len(loaded.short_hash) == 10
    shard = sorted(run_folder.glob("G_ema*.safetensors"))[0]
    assert load_generator(shard).sha256 == loaded.sha256      # the shard itself names its run
    with shard.open("r+b") as fh:                             # a damaged shard is refused, with the file named
        fh.seek(200)
        byte = fh.read(1)
        fh.seek(200)
        fh.write(bytes([byte[0] ^ 0xFF]))
    try:
        with pytest.raises(ModelLoadError, match="SHA-256"):
            load_generator(run_folder)
    finally:
        with shard.open("r+b") as fh:
            fh.seek(200)
            fh.write(byte)


def test_a_run_folder_is_listed_added_and_generates_in_the_studio(run_folder, tmp_path):
    from core.types import GenerationRequest, StyleGANParams

    settings = Settings(extra_models=(str(run_folder),), models_dirs=(), output_dir=tmp_path / "out",
                        cache_dir=tmp_path / "cache", default_stylegan_model=str(run_folder))
    svc = build_services(settings)
    [entry] = [e for e in svc.catalogue.entries("stylegan") if e.path == str(run_folder)]
    assert "training run" in entry.kind and entry.size_bytes
    assert run_folder.name in studio._entry_label(entry)
    result = svc.manager.generate(GenerationRequest("stylegan", entry.id, StyleGANParams(seeds=(0, 1), batch_size=2)))
    assert len(result.images) == 2 and result.images[0].size == (16, 16)
    assert result.metadata[0]["model"] == str(run_folder)
    # the picker's "Add a model" takes the folder too (a models folder holding runs lists them as well)
    other = build_services(Settings(extra_models=(str(SG_UNCOND),), models_dirs=(run_folder.parent,),
                                    output_dir=tmp_path / "o2", cache_dir=tmp_path / "c2",
                                    default_stylegan_model=str(SG_UNCOND)))
    assert any(e.path == str(run_folder) for e in other.catalogue.entries("stylegan"))
    assert other.catalogue.add(str(run_folder), "stylegan").kind.endswith("training run")


# -- 8. the smaller items -----------------------------------------------------------------------
def test_an_exported_model_keeps_a_dotted_name_whole(run_folder, tmp_path):
    from models.stylegan import load_generator
    from training.runs import export_for_studio

    paths = export_for_studio(run_folder, tmp_path / "ux-probe-0.5")
    assert paths["weights"].name == "ux-probe-0.5.safetensors" and paths["config"].name == "ux-probe-0.5.json"
    assert paths["card"].name == "ux-probe-0.5.md" and paths["card"].read_text().startswith("# ux-probe-0.5:")
    assert load_generator(paths["weights"]).resolution == 16


def test_nothing_to_compare_is_a_note_not_an_error():
    from core.types import GenerationRequest, OptimizationFlags, StyleGANParams

    off = GenerationRequest("stylegan", None, StyleGANParams(seeds=(0,)), OptimizationFlags(), "cpu")
    note = studio.nothing_to_compare(off)
    assert note.startswith("Nothing to compare") and "Optimization panel" in note
    html = studio.render_nothing_to_compare(note)
    assert "at-empty-note" in html and "error" not in html and "failed" not in html
    on = GenerationRequest("stylegan", None, StyleGANParams(seeds=(0,)), OptimizationFlags(precision="bf16"), "cpu")
    assert studio.nothing_to_compare(on) is None


def test_the_startup_banner_names_our_share_flag_not_gradios_launch_argument():
    class Served:
        local_url, share_url = "http://127.0.0.1:7860/", None

    text = studio.startup_banner(Settings(), Served())
    assert "--share" in text and "share=True" not in text and "launch()" not in text
    assert "http://127.0.0.1:7860/" in text


# -- style mixing's layer range follows the model --------------------------------------------------------------

def test_style_layer_counts_from_configs_without_loading():
    from models.stylegan import style_layers, style_layers_of_file

    assert style_layers("stylegan2", {"img_resolution": 1024}) == 18
    assert style_layers("stylegan2", {"img_resolution": 64}) == 10
    assert style_layers("stylegan3", {"img_resolution": 256, "synthesis_kwargs": {"num_layers": 10}}) == 12
    assert style_layers("stylegan2", {"img_resolution": 48}) is None            # not a StyleGAN2 size: unknown
    assert style_layers_of_file(studio.Path(__file__).parent.parent / "assets/models/emoji64.safetensors") == 10
    assert style_layers_of_file(SG_UNCOND) is None                               # a pickle says only once loaded


def _slider(update) -> dict:
    return update if isinstance(update, dict) else {"maximum": update.maximum, "value": update.value}


def test_mix_sliders_span_the_models_layers_a_pickle_after_its_first_run(services):
    from core.types import GenerationRequest, StyleGANParams

    bundled = str(studio.Path(__file__).parent.parent / "assets/models/emoji64.safetensors")
    lo, hi = studio.mix_layer_sliders(services, "stylegan", bundled, 0, 12)
    assert (_slider(lo)["maximum"], _slider(hi)["maximum"], _slider(hi)["value"]) == (9, 10, 10)   # 10 layers
    skip = studio.mix_layer_sliders(services, "stylegan", str(SG_UNCOND), 0, 6)
    assert skip == (gr.skip(), gr.skip())                                         # not loaded: range unchanged
    services.manager.generate(GenerationRequest("stylegan", str(SG_UNCOND), StyleGANParams(seeds=(0,)),
                                                device="cpu"))
    lo, hi = studio.mix_layer_sliders(services, "stylegan", str(SG_UNCOND), 7, 12)
    assert (_slider(lo)["maximum"], _slider(hi)["maximum"]) == (7, 8)             # 32 px StyleGAN2: 8 layers
    assert (_slider(lo)["value"], _slider(hi)["value"]) == (7, 8)                 # values kept inside the range
    assert studio.mix_layer_sliders(services, "diffusion", "x", 0, 6) == (gr.skip(), gr.skip())


def test_a_diffusion_call_carrying_the_pages_stylegan_seed_gets_a_random_one():
    """gradio_client sends the seed field's initial value, StyleGAN's 0-7, when a diffusion call names no seed:
    while the session's field was never given to diffusion, that value means "no seed" (random)."""
    from ui.controls import job_spec
    from ui.form import StudioForm, spec_from_form

    form = StudioForm(backend="diffusion", prompt="a red fox", size="64x64", steps=2, seed=DEFAULT_SEED_TEXT["stylegan"])
    seeds = {spec_from_form(form, job_spec, None, seed_backend="stylegan").request.params.seed for _ in range(3)}
    assert len(seeds) > 1                                            # random each time, not an error
    with pytest.raises(InputError, match="one whole number"):
        job_spec({"backend": "diffusion", "prompt": "a red fox", "seed": "0-8"})   # a range typed on purpose: refused
