"""Tiny, real Stable Diffusion pipelines for CPU tests, built from scratch (nothing downloaded).

- a CLIP BPE vocabulary of the 512 byte symbols plus a few merges, written as vocab.json/merges.txt;
- SD 1.5-style (one CLIP text tower, quick_gelu) and SDXL-style (two towers, text_time UNet) pipelines
  with a few-thousand-parameter UNet, VAE and text encoders, saved as diffusers folders;
- a writer for the original LDM / A1111 single-file key layout (the inverse of diffusers' converters),
  so the single-file path is exercised on real files.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ["a", "cat", "the", "photo", "of", "dog", "red", "fox", "in", "snow", "painting"]


def _byte_symbols() -> list[str]:
    from models.diffusion_catalogue import _byte_symbols as clip_byte_symbols   # the same table CLIP uses

    return clip_byte_symbols()


def write_tiny_vocab(folder: Path) -> tuple[Path, Path, int]:
    """vocab.json and merges.txt for a small CLIP BPE that spells WORDS as single tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    symbols = _byte_symbols()
    merges: list[tuple[str, str]] = []
    made: set[str] = set(symbols) | {s + "</w>" for s in symbols}
    for w in WORDS:
        parts = list(w[:-1]) + [w[-1] + "</w>"]
        while len(parts) > 1:        # merge left to right: ((c a) t</w>)
            pair = (parts[0], parts[1])
            joined = pair[0] + pair[1]
            if joined not in made:
                merges.append(pair)
                made.add(joined)
            parts = [joined] + parts[2:]
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return folder / "vocab.json", folder / "merges.txt", len(vocab)


def _tokenizer(tmp: Path, pad: str = "<|endoftext|>"):
    from transformers import CLIPTokenizer

    vocab, merges, n = write_tiny_vocab(tmp)
    return CLIPTokenizer(str(vocab), str(merges), pad_token=pad, model_max_length=77), n


def _text_encoder(vocab_size: int, hidden: int, act: str, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_attention_heads=4, num_hidden_layers=2,
                         vocab_size=vocab_size, max_position_embeddings=77, hidden_act=act, projection_dim=hidden,
                         bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg).eval()


def _vae():
    from diffusers import AutoencoderKL

    # Four blocks like the real VAE, so the spatial factor is 8 as in every SD model.
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 32, 32, 32),
                         layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=64).eval()


def build_tiny_sd(folder: Path, seed: int = 0):
    """A tiny SD 1.5-style pipeline saved as a diffusers folder; returns the pipeline."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(seed)
    tok, n = _tokenizer(folder.parent / f"{folder.name}-vocab")
    te = _text_encoder(n, 32, "quick_gelu", False)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=4, norm_num_groups=8).eval()
    sched = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                          set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=_vae(), text_encoder=te, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(str(folder))
    return pipe


def build_tiny_sdxl(folder: Path, seed: int = 0):
    """A tiny SDXL-style pipeline (two text towers of different widths, text_time UNet) as a diffusers folder."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(seed)
    tok, n = _tokenizer(folder.parent / f"{folder.name}-vocab")
    tok2, _ = _tokenizer(folder.parent / f"{folder.name}-vocab2", pad="!")
    te = _text_encoder(n, 32, "quick_gelu", False)
    te2 = _text_encoder(n, 48, "gelu", True)
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=80,
                                attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
                                addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 48,
                                transformer_layers_per_block=1, norm_num_groups=8).eval()
    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                   num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
    pipe = StableDiffusionXLPipeline(vae=_vae(), text_encoder=te, text_encoder_2=te2, tokenizer=tok, tokenizer_2=tok2,
                                     unet=unet, scheduler=sched, force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(str(folder))
    return pipe


# -- the original (LDM / A1111) single-file layout ----------------------------------------------------------

_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
           ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))


def unet_to_ldm(sd: dict, config) -> dict:
    L = config["layers_per_block"]
    out = {}
    top = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
           "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
           "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}

    def resnet(rest):
        for a, b in _RESNET:
            if rest.startswith(a + "."):
                return b + rest[len(a):]
        raise KeyError(rest)

    up_has_attn = {i: t.startswith("CrossAttn") for i, t in enumerate(config["up_block_types"])}
    for k, v in sd.items():
        parts = k.split(".")
        head = next((src for src in top if k.startswith(src + ".")), None)
        if head is not None:
            out[top[head] + k[len(head):]] = v
        elif parts[0] == "down_blocks":
            i, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
            if kind == "resnets":
                out[f"input_blocks.{1 + i * (L + 1) + j}.0.{resnet(rest)}"] = v
            elif kind == "attentions":
                out[f"input_blocks.{1 + i * (L + 1) + j}.1.{rest}"] = v
            else:   # downsamplers.0.conv.*
                out[f"input_blocks.{1 + i * (L + 1) + L}.0.op.{'.'.join(parts[5:])}"] = v
        elif parts[0] == "mid_block":
            kind, j, rest = parts[1], int(parts[2]), ".".join(parts[3:])
            if kind == "resnets":
                out[f"middle_block.{2 * j}.{resnet(rest)}"] = v
            else:
                out[f"middle_block.1.{rest}"] = v
        elif parts[0] == "up_blocks":
            i, kind, j = int(parts[1]), parts[2], int(parts[3])
            rest = ".".join(parts[4:])
            if kind == "resnets":
                out[f"output_blocks.{i * (L + 1) + j}.0.{resnet(rest)}"] = v
            elif kind == "attentions":
                out[f"output_blocks.{i * (L + 1) + j}.1.{rest}"] = v
            else:   # upsamplers.0.conv.*
                slot = 2 if up_has_attn[i] else 1
                out[f"output_blocks.{i * (L + 1) + L}.{slot}.{'.'.join(parts[4:])}"] = v
        else:
            raise KeyError(k)
    return {"model.diffusion_model." + k: v for k, v in out.items()}


def vae_to_ldm(sd: dict, n_blocks: int) -> dict:
    out = {}
    for k, v in sd.items():
        new = k.replace("conv_norm_out", "norm_out")
        for side in ("encoder", "decoder"):
            for i in range(n_blocks):
                src = n_blocks - 1 - i if side == "decoder" else i
                blk = "up" if side == "decoder" else "down"
                new = new.replace(f"{side}.{blk}_blocks.{i}.resnets.", f"{side}.{blk}.{src}.block.")
                new = new.replace(f"{side}.{blk}_blocks.{i}.downsamplers.0.", f"{side}.{blk}.{src}.downsample.")
                new = new.replace(f"{side}.{blk}_blocks.{i}.upsamplers.0.", f"{side}.{blk}.{src}.upsample.")
            for j in range(2):
                new = new.replace(f"{side}.mid_block.resnets.{j}.", f"{side}.mid.block_{j + 1}.")
            if f"{side}.mid_block.attentions.0." in new:
                new = new.replace(f"{side}.mid_block.attentions.0.", f"{side}.mid.attn_1.")
                new = (new.replace("group_norm.", "norm.").replace("to_q.", "q.").replace("to_k.", "k.")
                       .replace("to_v.", "v.").replace("to_out.0.", "proj_out."))
                if v.ndim == 2:
                    v = v[:, :, None, None]     # LDM keeps these as 1x1 convolutions
        new = new.replace("conv_shortcut", "nin_shortcut")
        out["first_stage_model." + new] = v
    return out


def clip_to_ldm(sd: dict, prefix: str) -> dict:
    """HF CLIPTextModel (flattened, transformers ≥ 5.6) -> '<prefix>text_model.*' as SD 1.x files store it."""
    return {prefix + "text_model." + k: v for k, v in sd.items() if not k.endswith("position_ids")}


def open_clip_to_ldm(sd: dict, prefix: str) -> dict:
    """HF CLIPTextModelWithProjection -> OpenCLIP layout ('<prefix>transformer.resblocks.N...')."""
    out = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        if k.endswith("position_ids"):
            continue
        if k == "text_projection.weight":
            out[prefix + "text_projection"] = v.T.contiguous()
        elif k == "text_model.embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = v
        elif k == "text_model.embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = v
        elif k.startswith("text_model.final_layer_norm."):
            out[prefix + "ln_final." + k.split(".")[-1]] = v
        elif k.startswith("text_model.encoder.layers."):
            n = int(k.split(".")[3])
            rest = ".".join(k.split(".")[4:])
            layers.setdefault(n, {})[rest] = v
        else:
            raise KeyError(k)
    for n, t in layers.items():
        base = f"{prefix}transformer.resblocks.{n}."
        for kind in ("weight", "bias"):
            out[base + f"attn.in_proj_{kind}"] = torch.cat([t[f"self_attn.{q}_proj.{kind}"] for q in "qkv"])
            out[base + f"attn.out_proj.{kind}"] = t[f"self_attn.out_proj.{kind}"]
            out[base + f"ln_1.{kind}"] = t[f"layer_norm1.{kind}"]
            out[base + f"ln_2.{kind}"] = t[f"layer_norm2.{kind}"]
            out[base + f"mlp.c_fc.{kind}"] = t[f"mlp.fc1.{kind}"]
            out[base + f"mlp.c_proj.{kind}"] = t[f"mlp.fc2.{kind}"]
    return out


def pipeline_to_ldm(pipe) -> dict:
    """The whole pipeline in the original single-file layout."""
    sd = unet_to_ldm(pipe.unet.state_dict(), pipe.unet.config)
    sd.update(vae_to_ldm(pipe.vae.state_dict(), len(pipe.vae.config.block_out_channels)))
    if hasattr(pipe, "text_encoder_2"):
        sd.update(clip_to_ldm(pipe.text_encoder.state_dict(), "conditioner.embedders.0.transformer."))
        sd.update(open_clip_to_ldm(pipe.text_encoder_2.state_dict(), "conditioner.embedders.1.model."))
    else:
        sd.update(clip_to_ldm(pipe.text_encoder.state_dict(), "cond_stage_model.transformer."))
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def build_tiny_taesd(folder: Path, seed: int = 0, levels: int = 4) -> Path:
    """A diffusers AutoencoderTiny folder with TAESD's structure at a few channels (random weights): `levels` decoder
    stages, so 2**(levels-1)x upsampling (4 matches the tiny SD's VAE, as TAESD matches SD's)."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    AutoencoderTiny(encoder_block_out_channels=(8,) * levels, decoder_block_out_channels=(8,) * levels,
                    num_encoder_blocks=(1,) * levels, num_decoder_blocks=(1,) * levels).save_pretrained(folder)
    return folder
