"""Attention backends on a tiny UNet / VAE / CLIP: sdpa and math agree to rounding (rel. error < 1e-5;
measured ~1e-7); xformers is skipped with its reason where it is not installed."""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from optim.attention import XFORMERS_MISSING
from optim.hardware import has_package
from tests.optim_helpers import CPU, rel_err
from tests.optim_tiny import prompt_embeds, tiny_pipeline, unet_inputs


def _outputs(pipe):
    x, t, c = unet_inputs()
    ids = torch.arange(8)[None] % 1000
    with torch.no_grad():
        return (pipe.unet(x, t, c).sample, pipe.vae.decode(x).sample, pipe.text_encoder(ids).last_hidden_state)


def test_math_attention_matches_sdpa():
    ref = _outputs(tiny_pipeline())
    pipe, report = optim.prepare(tiny_pipeline(), Flags(attention="math"), CPU, kind="diffusion")
    r = report["attention"]
    assert r["applied"] and r["mode"] == "math"
    assert r["components"] == {"unet": "AttnProcessor", "vae": "AttnProcessor", "text_encoder": "eager"}
    procs = {type(p).__name__ for p in pipe.unet.attn_processors.values()}
    assert procs == {"AttnProcessor"}
    for a, b in zip(ref, _outputs(pipe)):
        assert rel_err(a, b) < 1e-5


def test_sdpa_is_default_and_not_reported_unless_asked():
    pipe, report = optim.prepare(tiny_pipeline(), Flags(), CPU, kind="diffusion")
    assert "attention" not in report
    assert {type(p).__name__ for p in pipe.unet.attn_processors.values()} == {"AttnProcessor2_0"}


@pytest.mark.skipif(has_package("xformers"), reason="xformers is installed here")
def test_xformers_missing_is_skipped_with_reason_and_image_still_made():
    pipe, report = optim.prepare(tiny_pipeline(), Flags(attention="xformers"), CPU, kind="diffusion")
    assert report["attention"] == {"applied": False, "reason": XFORMERS_MISSING, "mode": "sdpa"}
    pe = prompt_embeds()
    img = pipe(prompt_embeds=pe, negative_prompt_embeds=torch.zeros_like(pe), num_inference_steps=1, height=32,
               width=32, output_type="np").images
    assert img.shape == (1, 32, 32, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not has_package("xformers"), reason="xformers not installed")
def test_gpu_xformers_matches_sdpa():
    cuda = torch.device("cuda")
    ref_pipe, _ = optim.prepare(tiny_pipeline(), Flags(), cuda, kind="diffusion")
    pipe, report = optim.prepare(tiny_pipeline(), Flags(attention="xformers"), cuda, kind="diffusion")
    assert report["attention"]["applied"]
    x, t, c = (v.to(cuda) for v in unet_inputs())
    with torch.no_grad():
        assert rel_err(ref_pipe.unet(x, t, c).sample, pipe.unet(x, t, c).sample) < 1e-3
