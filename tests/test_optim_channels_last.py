"""channels_last against the fp32 reference: a layout change, so agreement is to rounding (rel. error < 1e-5;
measured 4e-7 to 5e-7 on the StyleGAN test networks)."""
import pytest
import torch

import optim
from core.types import OptimizationFlags as Flags
from tests.optim_helpers import CPU, generate, load_G, prepared, rel_err


@pytest.mark.parametrize("name", ["sg2_uncond_32", "sg3t_uncond_32"])
def test_stylegan_channels_last_matches_fp32(testdata, name):
    seeds = (0,) if name.startswith("sg3") else (0, 1)   # StyleGAN3 is slow on 2 CPU cores
    ref = generate(load_G(testdata, name), Flags(), seeds)
    G, report = prepared(testdata, name, Flags(channels_last=True))
    r = report["channels_last"]
    assert r["applied"] and r["layers"] > 5
    seen = []
    layer = next(m for m in G.synthesis.modules() if getattr(m, "_atelier_nhwc", False))
    h = layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    out = generate(G, Flags(channels_last=True), seeds)
    h.remove()
    assert seen and all(seen)                        # the layers really received NHWC activations
    assert rel_err(ref, out) < 1e-5


def test_unet_and_vae_channels_last_match_fp32():
    from tests.optim_tiny import tiny_pipeline, unet_inputs

    x, t, c = unet_inputs()
    base = tiny_pipeline()
    with torch.no_grad():
        ref = base.unet(x, t, c).sample
        ref_img = base.vae.decode(x).sample
    pipe, report = optim.prepare(tiny_pipeline(), Flags(channels_last=True), CPU, kind="diffusion")
    r = report["channels_last"]
    assert r["applied"] and r["components"] == ["unet", "vae"]
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = pipe.unet(x, t, c).sample
        img = pipe.vae.decode(x).sample
    assert rel_err(ref, out) < 1e-5 and rel_err(ref_img, img) < 1e-5
