"""Tiny diffusers components built from small configs (random weights, no downloads), for optim/ tests.

Speed and numerical agreement do not depend on the weights' values, so a UNet / VAE / CLIP
text encoder a few hundred kilobytes in size exercise the same code paths as SD1.5's.
"""
from __future__ import annotations

import torch

CROSS_DIM = 32
TOKENS = 8


def tiny_unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=CROSS_DIM, attention_head_dim=8,
    ).eval().requires_grad_(False)


def tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32,
    ).eval().requires_grad_(False)


def tiny_text_encoder(seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=1000, hidden_size=CROSS_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, projection_dim=CROSS_DIM,
                         bos_token_id=998, eos_token_id=999, pad_token_id=999)
    return CLIPTextModel(cfg).eval().requires_grad_(False)


def tiny_pipeline(seed: int = 0):
    """A StableDiffusionPipeline of tiny parts. No tokenizer: callers pass prompt_embeds."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=tiny_vae(seed), text_encoder=tiny_text_encoder(seed), tokenizer=None,
                                   unet=tiny_unet(seed),
                                   scheduler=DDIMScheduler(steps_offset=1, clip_sample=False), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def unet_inputs(batch: int = 2, size: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, size, size, generator=g)
    timestep = torch.tensor([500] * batch, dtype=torch.int64)
    context = torch.randn(batch, TOKENS, CROSS_DIM, generator=g)
    return sample, timestep, context


def prompt_embeds(batch: int = 1, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, TOKENS, CROSS_DIM, generator=g)


def tiny_sdxl_unet(seed: int = 0):
    """An SDXL-style UNet (text_time additional conditioning, linear projections, per-block head dims)."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=80, attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 48,
        transformer_layers_per_block=1, norm_num_groups=8,
    ).eval().requires_grad_(False)
