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
