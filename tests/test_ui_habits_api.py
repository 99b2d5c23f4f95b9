"""Artist habits over the studio's Gradio API (gradio_client against an in-process server on 127.0.0.1):
a random diffusion seed is drawn and named, and ♻ gives it back. Real tiny models, real files."""
from __future__ import annotations

import re

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from core.pnginfo import read_png_params  # noqa: E402
from tests.ui_helpers import running_studio, tiny_sd_folder  # noqa: E402


@pytest.fixture(scope="module")
def studio(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("studio-habits"), queue_max_size=8) as demo:
        yield demo


@pytest.fixture
def client(studio):
    return Client(studio.local_url, verbose=False)


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return tiny_sd_folder(tmp_path_factory)


def test_an_empty_diffusion_seed_is_random_named_in_the_result_and_reused_by_the_recycle_button(client, tiny_sd):
    client.predict(str(tiny_sd), "diffusion", api_name="/add_model")
    seeds = []
    for _ in range(2):
        gallery, _preview, progress, params, _dl = client.predict(
            backend="diffusion", model=str(tiny_sd), prompt="a red fox", seed="", steps=2, size="64x64",
            preview_every=0, api_name="/generate")
        meta = read_png_params(gallery[0]["image"])
        assert meta["seed"] == params["seed"]                         # the PNG records the seed it was made with
        assert f"seed {meta['seed']}" in re.sub(r"<[^>]+>", "", progress), progress   # and the result line names it
        seeds.append(meta["seed"])
    assert seeds[0] != seeds[1]                 # empty = random: not the same image twice
    assert client.predict("diffusion", api_name="/reuse_seed") == str(seeds[1])


def test_a_model_added_by_folder_path_gets_its_native_size_and_steps(client, tiny_sd):
    """The tiny SD folder is 64 px (UNet sample_size 8 × VAE factor 8), not its family's 512."""
    from models.diffusion_catalogue import folder_native_size

    assert folder_native_size(tiny_sd) == 64
    client.predict(str(tiny_sd), "diffusion", api_name="/add_model")
    updates = client.predict("diffusion", str(tiny_sd), api_name="/model_defaults")
    steps, guidance, size, scheduler = (u["value"] if isinstance(u, dict) else u for u in updates)
    assert (steps, size, scheduler) == (25, "64×64", "default") and guidance == pytest.approx(7.0)
