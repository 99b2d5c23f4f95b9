"""StyleGAN2 / StyleGAN2-ADA generator and discriminator in one readable file.

"Analyzing and Improving the Image Quality of StyleGAN" (Karras et al., 2020), config F,
as trained by NVlabs' stylegan2-ada-pytorch and stylegan3 repositories. Module and
parameter names are theirs, so the state of any of their network pickles loads here with
strict=True (see `generator_from_record`); the constructor takes the same keyword
arguments they record, and every module keeps them in `init_kwargs` for our own format.

Layout, top to bottom:
  Generator = MappingNetwork (z, c -> ws) + SynthesisNetwork (ws -> image)
  SynthesisNetwork = SynthesisBlock per resolution 4, 8, ..., img_resolution
  SynthesisBlock = [const | conv0 (up 2)] + conv1 + ToRGB ('skip') / skip conv ('resnet')
  Discriminator = DiscriminatorBlock per resolution img_resolution ... 8 + DiscriminatorEpilogue (4x4)

Precision: blocks of the `num_fp16_res` highest resolutions run in float16 on CUDA (with
`conv_clamp` keeping activations in range); on any other device, or with force_fp32=True,
everything runs in float32, as in NVlabs' code.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch

from core.errors import InputError, ModelLoadError
from models.arch_limits import build_and_load
from models.common import jsonable, load_state_strict, truncate, truncation_centre_for  # noqa: F401  (re-exported)
from models.ops import (
    FullyConnectedLayer,
    activation_gain,
    assert_shape,
    bias_act,
    conv2d_resample,
    downsample2d,
    modulated_conv2d,
    normalize_2nd_moment,
    setup_filter,
    upsample2d,
)

__all__ = [
    "FullyConnectedLayer",
    "Conv2dLayer",
    "MappingNetwork",
    "SynthesisLayer",
    "ToRGBLayer",
    "SynthesisBlock",
    "SynthesisNetwork",
    "Generator",
    "DiscriminatorBlock",
    "MinibatchStdLayer",
    "DiscriminatorEpilogue",
    "Discriminator",
    "generator_from_record",
    "discriminator_from_record",
    "jsonable",
]

NOISE_MODES = ("random", "const", "none")


# ---------------------------------------------------------------------------------------------
# Layers


class Conv2dLayer(torch.nn.Module):
    """Equalized-lr conv with optional up/downsampling, bias, activation and clamp."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        bias: bool = True,                 # add a bias before the activation
        activation: str = "linear",        # 'linear', 'lrelu', ...
        up: int = 1,                       # integer upsampling factor
        down: int = 1,                     # integer downsampling factor
        resample_filter=(1, 3, 3, 1),      # low-pass filter for resampling
        conv_clamp: float | None = None,   # clamp the output to +-X (keeps fp16 finite)
        channels_last: bool = False,       # store the weight channels_last
        trainable: bool = True,            # False = a buffer (Freeze-D), same state-dict key
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.activation = activation
        self.up = up
        self.down = down
        self.conv_clamp = conv_clamp
        self.register_buffer("resample_filter", setup_filter(list(resample_filter)))
        self.padding = kernel_size // 2
        self.weight_gain = 1 / math.sqrt(in_channels * kernel_size**2)
        self.act_gain = activation_gain(activation)

        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        weight = torch.randn([out_channels, in_channels, kernel_size, kernel_size]).to(memory_format=memory_format)
        bias_t = torch.zeros([out_channels]) if bias else None
        if trainable:
            self.weight = torch.nn.Parameter(weight)
            self.bias = torch.nn.Parameter(bias_t) if bias_t is not None else None
        else:
            self.register_buffer("weight", weight)
            if bias_t is not None:
                self.register_buffer("bias", bias_t)
            else:
                self.bias = None

    def forward(self, x: torch.Tensor, gain: float = 1) -> torch.Tensor:
        assert_shape(x, [None, self.in_channels, None, None], "Conv2dLayer input")
        w = self.weight * self.weight_gain
        b = self.bias.to(x.dtype) if self.bias is not None else None
        flip_weight = self.up == 1  # correlation is slightly faster; the up path needs convolution
        x = conv2d_resample(x, w.to(x.dtype), f=self.resample_filter, up=self.up, down=self.down,
                            padding=self.padding, flip_weight=flip_weight)
        act_gain = self.act_gain * gain
        act_clamp = self.conv_clamp * gain if self.conv_clamp is not None else None
        return bias_act(x, b, act=self.activation, gain=act_gain, clamp=act_clamp)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"activation={self.activation}, up={self.up}, down={self.down}")


class MappingNetwork(torch.nn.Module):
    """z (and an embedded class label c) -> w, broadcast to num_ws copies, with truncation."""

    def __init__(
        self,
        z_dim: int,                        # latent z size, 0 = no latent (the discriminator's c-mapping)
        c_dim: int,                        # label size, 0 = unconditional
        w_dim: int,                        # intermediate latent w size
        num_ws: int | None,                # copies of w to output, None = return [N, w_dim]
        num_layers: int = 8,               # dense layers
        embed_features: int | None = None, # label embedding size, None = w_dim
        layer_features: int | None = None, # hidden size, None = w_dim
        activation: str = "lrelu",
        lr_multiplier: float = 0.01,       # the mapping network learns 100x slower
        w_avg_beta: float | None = 0.998,  # decay of the running mean of w (truncation centre)
    ):
        super().__init__()
        self.z_dim = z_dim
        self.c_dim = c_dim
        self.w_dim = w_dim
        self.num_ws = num_ws
        self.num_layers = num_layers
        self.w_avg_beta = w_avg_beta

        if embed_features is None:
            embed_features = w_dim
        if c_dim == 0:
            embed_features = 0
        if layer_features is None:
            layer_features = w_dim
        features = [z_dim + embed_features] + [layer_features] * (num_layers - 1) + [w_dim]

        if c_dim > 0:
            self.embed = FullyConnectedLayer(c_dim, embed_features)
        for idx in range(num_layers):
            layer = FullyConnectedLayer(features[idx], features[idx + 1], activation=activation,
                                        lr_multiplier=lr_multiplier)
            setattr(self, f"fc{idx}", layer)
        if num_ws is not None and w_avg_beta is not None:
            self.register_buffer("w_avg", torch.zeros([w_dim]))

    def forward(self, z, c, truncation_psi: float = 1, truncation_cutoff: int | None = None,
                update_emas: bool = False, truncation_centre: torch.Tensor | None = None,
                embed_noise: float | torch.Tensor = 0.0) -> torch.Tensor:
        """truncation_centre: what psi pulls w towards, [w_dim] or one per sample [N, w_dim] (a class's own mean
        w: models/class_centres.py); None = the tracked mean w_avg, NVlabs' truncation. embed_noise: standard
        deviation of Gaussian noise added to the normalised class embedding (training with NoisyTwins only;
        0 = none, what inference uses)."""
        x = None
        if self.z_dim > 0:
            assert_shape(z, [None, self.z_dim], "z")
            x = normalize_2nd_moment(z.to(torch.float32))
        if self.c_dim > 0:
            if c is None:
                raise InputError(f"this network is conditional: give a class label c of shape [N, {self.c_dim}]")
            assert_shape(c, [None, self.c_dim], "c (class label)")
            y = normalize_2nd_moment(self.embed(c.to(torch.float32)))
            if isinstance(embed_noise, torch.Tensor) or embed_noise:      # a float, or one per sample [N, 1]
                y = y + embed_noise * torch.randn_like(y)
            x = torch.cat([x, y], dim=1) if x is not None else y
        if x is None:
            raise InputError("this mapping network has neither a latent (z_dim=0) nor a label (c_dim=0)")

        for idx in range(self.num_layers):
            x = getattr(self, f"fc{idx}")(x)

        if update_emas and self.w_avg_beta is not None:
            self.w_avg.copy_(x.detach().to(self.w_avg.dtype).mean(dim=0).lerp(self.w_avg, self.w_avg_beta))

        if self.num_ws is not None:
            x = x.unsqueeze(1).repeat([1, self.num_ws, 1])

        if truncation_psi != 1:
            centre = truncation_centre_for(getattr(self, "w_avg", None) if self.w_avg_beta is not None else None,
                                           truncation_centre, x.shape[0], self.w_dim)
            if self.num_ws is None or truncation_cutoff is None:
                x = truncate(centre, x, truncation_psi)
            else:
                # Only the first `cutoff` ws (coarse layers) move towards the mean; built
                # out of place so it stays differentiable and free of in-place writes.
                cutoff = int(truncation_cutoff)
                head = truncate(centre, x[:, :cutoff], truncation_psi)
                x = torch.cat([head, x[:, cutoff:]], dim=1)
        return x

    def extra_repr(self) -> str:
        return f"z_dim={self.z_dim}, c_dim={self.c_dim}, w_dim={self.w_dim}, num_ws={self.num_ws}"


class SynthesisLayer(torch.nn.Module):
    """Modulated 3x3 conv (optionally upsampling 2x) + per-pixel noise + bias + lrelu."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        w_dim: int,
        resolution: int,                   # output resolution of this layer
        kernel_size: int = 3,
        up: int = 1,                       # 2 for the first conv of a block
        use_noise: bool = True,
        activation: str = "lrelu",
        resample_filter=(1, 3, 3, 1),
        conv_clamp: float | None = None,
        channels_last: bool = False,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.w_dim = w_dim
        self.resolution = resolution
        self.up = up
        self.use_noise = use_noise
        self.activation = activation
        self.conv_clamp = conv_clamp
        self.register_buffer("resample_filter", setup_filter(list(resample_filter)))
        self.padding = kernel_size // 2
        self.act_gain = activation_gain(activation)

        self.affine = FullyConnectedLayer(w_dim, in_channels, bias_init=1)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.weight = torch.nn.Parameter(
            torch.randn([out_channels, in_channels, kernel_size, kernel_size]).to(memory_format=memory_format))
        if use_noise:
            self.register_buffer("noise_const", torch.randn([resolution, resolution]))
            self.noise_strength = torch.nn.Parameter(torch.zeros([]))
        self.bias = torch.nn.Parameter(torch.zeros([out_channels]))

    def forward(self, x, w, noise_mode: str = "random", fused_modconv: bool = True, gain: float = 1):
        if noise_mode not in NOISE_MODES:
            raise InputError(f"noise_mode must be one of {NOISE_MODES}, got {noise_mode!r}")
        in_resolution = self.resolution // self.up
        assert_shape(x, [None, self.in_channels, in_resolution, in_resolution], "SynthesisLayer input")
        styles = self.affine(w)

        noise = None
        if self.use_noise and noise_mode == "random":
            noise = torch.randn([x.shape[0], 1, self.resolution, self.resolution], device=x.device) * self.noise_strength
        if self.use_noise and noise_mode == "const":
            noise = self.noise_const * self.noise_strength

        flip_weight = self.up == 1
        x = modulated_conv2d(x, self.weight, styles, noise=noise, up=self.up, padding=self.padding,
                             resample_filter=self.resample_filter, flip_weight=flip_weight,
                             fused_modconv=fused_modconv)
        act_gain = self.act_gain * gain
        act_clamp = self.conv_clamp * gain if self.conv_clamp is not None else None
        return bias_act(x, self.bias.to(x.dtype), act=self.activation, gain=act_gain, clamp=act_clamp)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, w_dim={self.w_dim}, "
                f"resolution={self.resolution}, up={self.up}, activation={self.activation}")


class ToRGBLayer(torch.nn.Module):
    """Modulated 1x1 conv to image channels, without demodulation."""

    def __init__(self, in_channels: int, out_channels: int, w_dim: int, kernel_size: int = 1,
                 conv_clamp: float | None = None, channels_last: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.w_dim = w_dim
        self.conv_clamp = conv_clamp
        self.affine = FullyConnectedLayer(w_dim, in_channels, bias_init=1)
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.weight = torch.nn.Parameter(
            torch.randn([out_channels, in_channels, kernel_size, kernel_size]).to(memory_format=memory_format))
        self.bias = torch.nn.Parameter(torch.zeros([out_channels]))
        self.weight_gain = 1 / math.sqrt(in_channels * kernel_size**2)

    def forward(self, x, w, fused_modconv: bool = True):
        # Without demodulation the equalized-lr gain goes on the styles instead.
        styles = self.affine(w) * self.weight_gain
        x = modulated_conv2d(x, self.weight, styles, demodulate=False, fused_modconv=fused_modconv)
        return bias_act(x, self.bias.to(x.dtype), clamp=self.conv_clamp)

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, out_channels={self.out_channels}, w_dim={self.w_dim}"


# ---------------------------------------------------------------------------------------------
# Synthesis


class SynthesisBlock(torch.nn.Module):
    """One resolution of the synthesis network: features x [N, C, R, R] and the RGB image so far."""

    def __init__(
        self,
        in_channels: int,                  # 0 = first block (starts from the learned constant)
        out_channels: int,
        w_dim: int,
        resolution: int,
        img_channels: int,
        is_last: bool,
        architecture: str = "skip",        # 'orig', 'skip' (config F) or 'resnet'
        resample_filter=(1, 3, 3, 1),
        conv_clamp: float | None = 256,
        use_fp16: bool = False,
        fp16_channels_last: bool = False,
        fused_modconv_default: bool | str = True,  # 'inference_only' = fused in eval, not in training
        mid_channels: int | None = None,   # conv1's input (conv0's output / the constant); None = out_channels
        **layer_kwargs,                    # for SynthesisLayer: kernel_size, use_noise, activation
    ):
        if architecture not in ("orig", "skip", "resnet"):
            raise InputError(f"architecture must be 'orig', 'skip' or 'resnet', got {architecture!r}")
        super().__init__()
        self.in_channels = in_channels
        self.w_dim = w_dim
        self.resolution = resolution
        self.img_channels = img_channels
        self.is_last = is_last
        self.architecture = architecture
        self.use_fp16 = use_fp16
        self.channels_last = use_fp16 and fp16_channels_last
        self.fused_modconv_default = fused_modconv_default
        self.register_buffer("resample_filter", setup_filter(list(resample_filter)))
        self.num_conv = 0
        self.num_torgb = 0

        mid = out_channels if mid_channels is None else int(mid_channels)
        if in_channels == 0:
            self.const = torch.nn.Parameter(torch.randn([mid, resolution, resolution]))
        if in_channels != 0:
            self.conv0 = SynthesisLayer(in_channels, mid, w_dim=w_dim, resolution=resolution, up=2,
                                        resample_filter=resample_filter, conv_clamp=conv_clamp,
                                        channels_last=self.channels_last, **layer_kwargs)
            self.num_conv += 1
        self.conv1 = SynthesisLayer(mid, out_channels, w_dim=w_dim, resolution=resolution,
                                    conv_clamp=conv_clamp, channels_last=self.channels_last, **layer_kwargs)
        self.num_conv += 1
        if is_last or architecture == "skip":
            self.torgb = ToRGBLayer(out_channels, img_channels, w_dim=w_dim, conv_clamp=conv_clamp,
                                    channels_last=self.channels_last)
            self.num_torgb += 1
        if in_channels != 0 and architecture == "resnet":
            self.skip = Conv2dLayer(in_channels, out_channels, kernel_size=1, bias=False, up=2,
                                    resample_filter=resample_filter, channels_last=self.channels_last)

    def forward(self, x, img, ws, force_fp32: bool = False, fused_modconv=None, update_emas: bool = False,
                **layer_kwargs):
        del update_emas  # nothing to update in the synthesis network
        assert_shape(ws, [None, self.num_conv + self.num_torgb, self.w_dim], f"ws of block {self.resolution}")
        w_iter = iter(ws.unbind(dim=1))
        if ws.device.type != "cuda":
            force_fp32 = True  # fp16 convs are slow or missing off the GPU
        dtype = torch.float16 if self.use_fp16 and not force_fp32 else torch.float32
        memory_format = torch.channels_last if self.channels_last and not force_fp32 else torch.contiguous_format
        if fused_modconv is None:
            fused_modconv = self.fused_modconv_default
        if fused_modconv == "inference_only":
            fused_modconv = not self.training

        if self.in_channels == 0:
            # const is [C, H, W]; a memory format needs the batch dimension first
            x = self.const.to(dtype=dtype).unsqueeze(0).repeat([ws.shape[0], 1, 1, 1])
            x = x.contiguous(memory_format=memory_format)
        else:
            assert_shape(x, [None, self.in_channels, self.resolution // 2, self.resolution // 2],
                         f"features into block {self.resolution}")
            x = x.to(dtype=dtype, memory_format=memory_format)

        if self.in_channels == 0:
            x = self.conv1(x, next(w_iter), fused_modconv=fused_modconv, **layer_kwargs)
        elif self.architecture == "resnet":
            y = self.skip(x, gain=math.sqrt(0.5))
            x = self.conv0(x, next(w_iter), fused_modconv=fused_modconv, **layer_kwargs)
            x = self.conv1(x, next(w_iter), fused_modconv=fused_modconv, gain=math.sqrt(0.5), **layer_kwargs)
            x = y + x
        else:
            x = self.conv0(x, next(w_iter), fused_modconv=fused_modconv, **layer_kwargs)
            x = self.conv1(x, next(w_iter), fused_modconv=fused_modconv, **layer_kwargs)

        if img is not None:
            assert_shape(img, [None, self.img_channels, self.resolution // 2, self.resolution // 2],
                         f"image into block {self.resolution}")
            img = upsample2d(img, self.resample_filter)
        if self.is_last or self.architecture == "skip":
            y = self.torgb(x, next(w_iter), fused_modconv=fused_modconv)
            y = y.to(dtype=torch.float32, memory_format=torch.contiguous_format)
            img = img + y if img is not None else y
        return x, img

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, architecture={self.architecture}, use_fp16={self.use_fp16}"


class SynthesisNetwork(torch.nn.Module):
    """ws [N, num_ws, w_dim] -> image [N, img_channels, img_resolution, img_resolution] (float32, ~[-1, 1])."""

    def __init__(
        self,
        w_dim: int,
        img_resolution: int,
        img_channels: int,
        channel_base: int = 32768,         # channels at resolution r = min(channel_base // r, channel_max)
        channel_max: int = 512,
        num_fp16_res: int = 4,             # fp16 (on CUDA) for the N highest resolutions
        layer_channels: dict | None = None,  # per-layer output channels after structured pruning, e.g.
                                           # {"b8.conv0": 115, "b8.conv1": 115}; None = channel_base/max
        **block_kwargs,                    # for SynthesisBlock (architecture, conv_clamp, ...)
    ):
        if img_resolution < 4 or img_resolution & (img_resolution - 1) != 0:
            raise InputError(f"img_resolution must be a power of two >= 4, got {img_resolution}")
        super().__init__()
        self.w_dim = w_dim
        self.img_resolution = img_resolution
        self.img_resolution_log2 = int(np.log2(img_resolution))
        self.img_channels = img_channels
        self.num_fp16_res = num_fp16_res
        self.block_resolutions = [2**i for i in range(2, self.img_resolution_log2 + 1)]
        channels = {res: min(channel_base // res, channel_max) for res in self.block_resolutions}
        fp16_resolution = max(2 ** (self.img_resolution_log2 + 1 - num_fp16_res), 8)

        overrides = {str(k): int(v) for k, v in (layer_channels or {}).items()}
        known = {f"b{r}.conv1" for r in self.block_resolutions} | {f"b{r}.conv0" for r in self.block_resolutions[1:]}
        if set(overrides) - known or any(v < 1 for v in overrides.values()):
            raise InputError(f"layer_channels names unknown layers or non-positive counts: {overrides}; "
                             f"known layers are b<res>.conv0 / b<res>.conv1")

        self.num_ws = 0
        prev_out = 0
        for res in self.block_resolutions:
            out_channels = overrides.get(f"b{res}.conv1", channels[res])
            # conv1 reads conv0's output (the learned constant in the first block, which is never pruned)
            mid_channels = overrides.get(f"b{res}.conv0", channels[res]) if res > 4 else channels[res]
            is_last = res == self.img_resolution
            block = SynthesisBlock(prev_out, out_channels, w_dim=w_dim, resolution=res,
                                   img_channels=img_channels, is_last=is_last, mid_channels=mid_channels,
                                   use_fp16=res >= fp16_resolution, **block_kwargs)
            prev_out = out_channels
            # Consecutive blocks share a w: a block's ToRGB uses the same w as the next block's conv0.
            self.num_ws += block.num_conv
            if is_last:
                self.num_ws += block.num_torgb
            setattr(self, f"b{res}", block)

    def forward(self, ws, **block_kwargs) -> torch.Tensor:
        assert_shape(ws, [None, self.num_ws, self.w_dim], "ws")
        ws = ws.to(torch.float32)
        x = img = None
        w_idx = 0
        for res in self.block_resolutions:
            block = getattr(self, f"b{res}")
            block_ws = ws.narrow(1, w_idx, block.num_conv + block.num_torgb)
            w_idx += block.num_conv
            x, img = block(x, img, block_ws, **block_kwargs)
        return img

    def extra_repr(self) -> str:
        return (f"w_dim={self.w_dim}, num_ws={self.num_ws}, img_resolution={self.img_resolution}, "
                f"img_channels={self.img_channels}, num_fp16_res={self.num_fp16_res}")


class Generator(torch.nn.Module):
    """z [N, z_dim], c [N, c_dim] -> image [N, img_channels, R, R], float32, roughly in [-1, 1].

    Keyword arguments are NVlabs' (`mapping_kwargs` for MappingNetwork, the rest for
    SynthesisNetwork / SynthesisBlock / SynthesisLayer: channel_base, channel_max,
    num_fp16_res, conv_clamp, architecture, resample_filter, fp16_channels_last,
    fused_modconv_default, kernel_size, use_noise, activation).
    """

    def __init__(self, z_dim: int, c_dim: int, w_dim: int, img_resolution: int, img_channels: int,
                 mapping_kwargs: dict | None = None, **synthesis_kwargs):
        super().__init__()
        mapping_kwargs = dict(mapping_kwargs or {})
        self.init_kwargs = jsonable(dict(z_dim=z_dim, c_dim=c_dim, w_dim=w_dim, img_resolution=img_resolution,
                                         img_channels=img_channels, mapping_kwargs=mapping_kwargs,
                                         **synthesis_kwargs))
        self.z_dim = z_dim
        self.c_dim = c_dim
        self.w_dim = w_dim
        self.img_resolution = img_resolution
        self.img_channels = img_channels
        self.synthesis = SynthesisNetwork(w_dim=w_dim, img_resolution=img_resolution, img_channels=img_channels,
                                          **synthesis_kwargs)
        self.num_ws = self.synthesis.num_ws
        self.mapping = MappingNetwork(z_dim=z_dim, c_dim=c_dim, w_dim=w_dim, num_ws=self.num_ws, **mapping_kwargs)

    def forward(self, z, c=None, truncation_psi: float = 1, truncation_cutoff: int | None = None,
                noise_mode: str = "const", force_fp32: bool = False, fused_modconv=None,
                update_emas: bool = False, truncation_centre: torch.Tensor | None = None) -> torch.Tensor:
        """noise_mode defaults to 'const' (same seed, same image); training passes 'random'.
        truncation_centre: see MappingNetwork.forward (None = w_avg)."""
        if c is None:
            if self.c_dim > 0:
                raise InputError(f"this generator is conditional: give a class label c of shape [N, {self.c_dim}]")
            c = z.new_zeros([z.shape[0], 0])
        ws = self.mapping(z, c, truncation_psi=truncation_psi, truncation_cutoff=truncation_cutoff,
                          update_emas=update_emas, truncation_centre=truncation_centre)
        img = self.synthesis(ws, noise_mode=noise_mode, force_fp32=force_fp32, fused_modconv=fused_modconv,
                             update_emas=update_emas)
        return img


# ---------------------------------------------------------------------------------------------
# Discriminator


class DiscriminatorBlock(torch.nn.Module):
    """One resolution of the discriminator: two 3x3 convs, the second downsampling 2x."""

    def __init__(
        self,
        in_channels: int,                  # 0 = first block (reads the image through fromrgb)
        tmp_channels: int,
        out_channels: int,
        resolution: int,
        img_channels: int,
        first_layer_idx: int,              # for Freeze-D
        architecture: str = "resnet",
        activation: str = "lrelu",
        resample_filter=(1, 3, 3, 1),
        conv_clamp: float | None = None,
        use_fp16: bool = False,
        fp16_channels_last: bool = False,
        freeze_layers: int = 0,            # Freeze-D: layers with index < this are buffers
    ):
        if in_channels not in (0, tmp_channels):
            raise InputError(f"DiscriminatorBlock in_channels must be 0 or {tmp_channels}, got {in_channels}")
        if architecture not in ("orig", "skip", "resnet"):
            raise InputError(f"architecture must be 'orig', 'skip' or 'resnet', got {architecture!r}")
        super().__init__()
        self.in_channels = in_channels
        self.resolution = resolution
        self.img_channels = img_channels
        self.first_layer_idx = first_layer_idx
        self.architecture = architecture
        self.use_fp16 = use_fp16
        self.channels_last = use_fp16 and fp16_channels_last
        self.register_buffer("resample_filter", setup_filter(list(resample_filter)))

        self.num_layers = 0

        def next_trainable() -> bool:
            trainable = self.first_layer_idx + self.num_layers >= freeze_layers
            self.num_layers += 1
            return trainable

        if in_channels == 0 or architecture == "skip":
            self.fromrgb = Conv2dLayer(img_channels, tmp_channels, kernel_size=1, activation=activation,
                                       trainable=next_trainable(), conv_clamp=conv_clamp,
                                       channels_last=self.channels_last)
        self.conv0 = Conv2dLayer(tmp_channels, tmp_channels, kernel_size=3, activation=activation,
                                 trainable=next_trainable(), conv_clamp=conv_clamp, channels_last=self.channels_last)
        self.conv1 = Conv2dLayer(tmp_channels, out_channels, kernel_size=3, activation=activation, down=2,
                                 trainable=next_trainable(), resample_filter=resample_filter,
                                 conv_clamp=conv_clamp, channels_last=self.channels_last)
        if architecture == "resnet":
            self.skip = Conv2dLayer(tmp_channels, out_channels, kernel_size=1, bias=False, down=2,
                                    trainable=next_trainable(), resample_filter=resample_filter,
                                    channels_last=self.channels_last)

    def forward(self, x, img, force_fp32: bool = False):
        if (x if x is not None else img).device.type != "cuda":
            force_fp32 = True
        dtype = torch.float16 if self.use_fp16 and not force_fp32 else torch.float32
        memory_format = torch.channels_last if self.channels_last and not force_fp32 else torch.contiguous_format

        if x is not None:
            assert_shape(x, [None, self.in_channels, self.resolution, self.resolution],
                         f"features into D block {self.resolution}")
            x = x.to(dtype=dtype, memory_format=memory_format)
        if self.in_channels == 0 or self.architecture == "skip":
            assert_shape(img, [None, self.img_channels, self.resolution, self.resolution],
                         f"image into D block {self.resolution}")
            img = img.to(dtype=dtype, memory_format=memory_format)
            y = self.fromrgb(img)
            x = x + y if x is not None else y
            img = downsample2d(img, self.resample_filter) if self.architecture == "skip" else None

        if self.architecture == "resnet":
            y = self.skip(x, gain=math.sqrt(0.5))
            x = self.conv0(x)
            x = self.conv1(x, gain=math.sqrt(0.5))
            x = y + x
        else:
            x = self.conv0(x)
            x = self.conv1(x)
        return x, img

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, architecture={self.architecture}, use_fp16={self.use_fp16}"


class MinibatchStdLayer(torch.nn.Module):
    """Append the standard deviation across groups of samples as extra channels (diversity signal).

    Sample i is in group i % (N // G), as in NVlabs; N must be divisible by the group size.
    """

    def __init__(self, group_size: int | None, num_channels: int = 1):
        super().__init__()
        self.group_size = group_size
        self.num_channels = num_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, C, H, W = x.shape
        G = min(self.group_size, N) if self.group_size is not None else N
        if N % G != 0:
            raise InputError(f"the discriminator's batch size {N} must be a multiple of mbstd_group_size {G}")
        Fc = self.num_channels
        c = C // Fc
        y = x.reshape(G, -1, Fc, c, H, W)        # [G n F c H W]: n groups of size G, F channel groups
        y = y - y.mean(dim=0)                    # deviation from the group mean
        y = y.square().mean(dim=0)               # [n F c H W] variance over the group
        y = (y + 1e-8).sqrt()                    # standard deviation
        y = y.mean(dim=[2, 3, 4])                # [n F] averaged over channels and pixels
        y = y.reshape(-1, Fc, 1, 1)
        y = y.repeat(G, 1, H, W)                 # [N F H W]
        return torch.cat([x, y], dim=1)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, num_channels={self.num_channels}"


class DiscriminatorEpilogue(torch.nn.Module):
    """The 4x4 end of the discriminator: mbstd, conv, fc, (dropout), out, label projection."""

    def __init__(
        self,
        in_channels: int,
        cmap_dim: int,                     # size of the mapped label, 0 = unconditional
        resolution: int,
        img_channels: int,
        architecture: str = "resnet",
        mbstd_group_size: int | None = 4,  # None = whole minibatch
        mbstd_num_channels: int = 1,       # 0 = no minibatch-stddev layer
        activation: str = "lrelu",
        conv_clamp: float | None = None,
        dropout: float = 0.0,              # dropout before the last layer; 0 = off (no state-dict keys)
    ):
        if architecture not in ("orig", "skip", "resnet"):
            raise InputError(f"architecture must be 'orig', 'skip' or 'resnet', got {architecture!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise InputError(f"discriminator dropout must be in [0, 1), got {dropout}")
        super().__init__()
        self.in_channels = in_channels
        self.cmap_dim = cmap_dim
        self.resolution = resolution
        self.img_channels = img_channels
        self.architecture = architecture
        self.dropout_p = float(dropout)

        if architecture == "skip":
            self.fromrgb = Conv2dLayer(img_channels, in_channels, kernel_size=1, activation=activation)
        self.mbstd = (MinibatchStdLayer(group_size=mbstd_group_size, num_channels=mbstd_num_channels)
                      if mbstd_num_channels > 0 else None)
        self.conv = Conv2dLayer(in_channels + mbstd_num_channels, in_channels, kernel_size=3,
                                activation=activation, conv_clamp=conv_clamp)
        self.fc = FullyConnectedLayer(in_channels * resolution**2, in_channels, activation=activation)
        # nn.Dropout has no parameters, so the state dict is the same with or without it.
        self.dropout = torch.nn.Dropout(self.dropout_p) if self.dropout_p > 0 else None
        self.out = FullyConnectedLayer(in_channels, 1 if cmap_dim == 0 else cmap_dim)

    def forward(self, x, img, cmap, force_fp32: bool = False):
        del force_fp32  # the epilogue always runs in float32, also under autocast (as NVlabs' does):
        # the logits feed the losses, the ADA statistic and R1's gradient; bf16 would round them to 3 digits
        with torch.autocast(x.device.type, enabled=False):
            return self._epilogue(x, img, cmap)

    def _epilogue(self, x, img, cmap):
        assert_shape(x, [None, self.in_channels, self.resolution, self.resolution], "features into D epilogue")
        x = x.to(dtype=torch.float32, memory_format=torch.contiguous_format)
        if self.architecture == "skip":
            assert_shape(img, [None, self.img_channels, self.resolution, self.resolution], "image into D epilogue")
            img = img.to(dtype=torch.float32, memory_format=torch.contiguous_format)
            x = x + self.fromrgb(img)

        if self.mbstd is not None:
            x = self.mbstd(x)
        x = self.conv(x)
        x = self.fc(x.flatten(1))
        if self.dropout is not None:
            x = self.dropout(x)
        x = self.out(x)

        if self.cmap_dim > 0:
            # Projection discriminator: score = <features, mapped label> / sqrt(cmap_dim).
            assert_shape(cmap, [None, self.cmap_dim], "mapped label")
            x = (x * cmap).sum(dim=1, keepdim=True) * (1 / math.sqrt(self.cmap_dim))
        return x

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, architecture={self.architecture}, dropout={self.dropout_p}"


class Discriminator(torch.nn.Module):
    """image [N, C, R, R], c [N, c_dim] -> realness logit [N, 1].

    Keyword arguments are NVlabs'. `epilogue_kwargs` takes mbstd_group_size,
    mbstd_num_channels and our `dropout` (before the last layer, default 0 = off); the
    top-level `dropout`, when given, is the same setting.
    """

    def __init__(
        self,
        c_dim: int,
        img_resolution: int,
        img_channels: int,
        architecture: str = "resnet",
        channel_base: int = 32768,
        channel_max: int = 512,
        num_fp16_res: int = 4,
        conv_clamp: float | None = 256,
        cmap_dim: int | None = None,       # None = channels at 4x4
        block_kwargs: dict | None = None,
        mapping_kwargs: dict | None = None,
        epilogue_kwargs: dict | None = None,
        dropout: float | None = None,
    ):
        if img_resolution < 8 or img_resolution & (img_resolution - 1) != 0:
            raise InputError(f"discriminator img_resolution must be a power of two >= 8, got {img_resolution}")
        super().__init__()
        block_kwargs = dict(block_kwargs or {})
        mapping_kwargs = dict(mapping_kwargs or {})
        epilogue_kwargs = dict(epilogue_kwargs or {})
        if dropout is not None:
            epilogue_kwargs["dropout"] = float(dropout)
        self.init_kwargs = jsonable(dict(
            c_dim=c_dim, img_resolution=img_resolution, img_channels=img_channels, architecture=architecture,
            channel_base=channel_base, channel_max=channel_max, num_fp16_res=num_fp16_res, conv_clamp=conv_clamp,
            cmap_dim=cmap_dim, block_kwargs=block_kwargs, mapping_kwargs=mapping_kwargs,
            epilogue_kwargs=epilogue_kwargs))
        self.c_dim = c_dim
        self.img_resolution = img_resolution
        self.img_resolution_log2 = int(np.log2(img_resolution))
        self.img_channels = img_channels
        self.block_resolutions = [2**i for i in range(self.img_resolution_log2, 2, -1)]
        channels = {res: min(channel_base // res, channel_max) for res in self.block_resolutions + [4]}
        fp16_resolution = max(2 ** (self.img_resolution_log2 + 1 - num_fp16_res), 8)

        if cmap_dim is None:
            cmap_dim = channels[4]
        if c_dim == 0:
            cmap_dim = 0

        common = dict(img_channels=img_channels, architecture=architecture, conv_clamp=conv_clamp)
        layer_idx = 0
        for res in self.block_resolutions:
            in_channels = channels[res] if res < img_resolution else 0
            block = DiscriminatorBlock(in_channels, channels[res], channels[res // 2], resolution=res,
                                       first_layer_idx=layer_idx, use_fp16=res >= fp16_resolution,
                                       **block_kwargs, **common)
            setattr(self, f"b{res}", block)
            layer_idx += block.num_layers
        if c_dim > 0:
            self.mapping = MappingNetwork(z_dim=0, c_dim=c_dim, w_dim=cmap_dim, num_ws=None, w_avg_beta=None,
                                          **mapping_kwargs)
        self.b4 = DiscriminatorEpilogue(channels[4], cmap_dim=cmap_dim, resolution=4, **epilogue_kwargs, **common)

    def forward(self, img, c=None, update_emas: bool = False, force_fp32: bool = False) -> torch.Tensor:
        del update_emas
        assert_shape(img, [None, self.img_channels, self.img_resolution, self.img_resolution], "image into D")
        x = None
        for res in self.block_resolutions:
            x, img = getattr(self, f"b{res}")(x, img, force_fp32=force_fp32)
        cmap = None
        if self.c_dim > 0:
            if c is None:
                raise InputError(f"this discriminator is conditional: give a class label c of shape [N, {self.c_dim}]")
            cmap = self.mapping(None, c)
        return self.b4(x, img, cmap)

    def extra_repr(self) -> str:
        return f"c_dim={self.c_dim}, img_resolution={self.img_resolution}, img_channels={self.img_channels}"


# ---------------------------------------------------------------------------------------------
# From NVlabs pickle records (models.nvlabs_pickle.PersistentRecord)

_GENERATOR_POSITIONAL = ("z_dim", "c_dim", "w_dim", "img_resolution", "img_channels")
_DISCRIMINATOR_POSITIONAL = ("c_dim", "img_resolution", "img_channels")


def _record_kwargs(rec, expected_class: str, positional: tuple[str, ...]) -> dict:
    if getattr(rec, "class_name", None) != expected_class:
        raise ModelLoadError(
            f"expected an NVlabs StyleGAN2 {expected_class}, found {getattr(rec, 'class_name', type(rec).__name__)!r}")
    args = tuple(rec.init_args or ())
    if len(args) > len(positional):
        raise ModelLoadError(f"the pickled {expected_class} has {len(args)} positional arguments; expected at most "
                             f"{len(positional)}")
    kwargs = dict(zip(positional, args))
    kwargs.update(copy.deepcopy(dict(rec.init_kwargs or {})))
    try:
        return jsonable(kwargs)
    except InputError as exc:
        raise ModelLoadError(f"the pickled {expected_class} has an argument we cannot use: {exc}") from None


def _build(cls, kwargs: dict, what: str):
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"the {what} config has arguments this StyleGAN2 code does not know: {exc}") from None
    except InputError as exc:
        raise ModelLoadError(f"the {what} config is invalid: {exc}") from None


def _child(rec, *names):
    for name in names:
        rec = getattr(rec, "children", {}).get(name)
        if rec is None:
            return None
    return rec


def _fp16_count(blocks) -> int:
    return sum(1 for b in blocks if b is not None and bool(b.attributes.get("use_fp16", False)))


def _generator_kwargs(rec) -> dict:
    """The constructor kwargs of a pickled Generator, with defaults taken from the saved tree.

    stylegan2-ada-pytorch records `synthesis_kwargs` as one dict and its defaults differ
    from the stylegan3 repository's (num_fp16_res 0 vs 4, conv_clamp None vs 256,
    w_avg_beta 0.995 vs 0.998). Values the pickle leaves out are therefore read from the
    sub-networks it saved (each block's use_fp16, each layer's conv_clamp, the mapping
    network's w_avg_beta) rather than from our defaults.
    """
    kwargs = _record_kwargs(rec, "Generator", _GENERATOR_POSITIONAL)
    nested = kwargs.pop("synthesis_kwargs", None)
    if isinstance(nested, dict):
        kwargs = {**nested, **kwargs}
    synthesis = _child(rec, "synthesis")
    if synthesis is not None:
        blocks = [b for name, b in synthesis.children.items() if name.startswith("b")]
        if "num_fp16_res" not in kwargs and blocks:
            kwargs["num_fp16_res"] = _fp16_count(blocks)
        layer = _child(synthesis, "b4", "conv1")
        if "conv_clamp" not in kwargs and layer is not None and "conv_clamp" in layer.attributes:
            kwargs["conv_clamp"] = jsonable(layer.attributes["conv_clamp"])
    mapping = _child(rec, "mapping")
    mapping_kwargs = dict(kwargs.get("mapping_kwargs") or {})
    if mapping is not None and "w_avg_beta" not in mapping_kwargs and "w_avg_beta" in mapping.attributes:
        mapping_kwargs["w_avg_beta"] = jsonable(mapping.attributes["w_avg_beta"])
    kwargs["mapping_kwargs"] = mapping_kwargs
    return kwargs


def _discriminator_kwargs(rec) -> dict:
    """Like _generator_kwargs: fill num_fp16_res / conv_clamp from the saved blocks when absent."""
    kwargs = _record_kwargs(rec, "Discriminator", _DISCRIMINATOR_POSITIONAL)
    blocks = [b for name, b in rec.children.items() if name.startswith("b") and name != "b4"]
    if "num_fp16_res" not in kwargs and blocks:
        kwargs["num_fp16_res"] = _fp16_count(blocks)
    first = _child(rec, f"b{kwargs.get('img_resolution')}", "conv0")
    if "conv_clamp" not in kwargs and first is not None and "conv_clamp" in first.attributes:
        kwargs["conv_clamp"] = jsonable(first.attributes["conv_clamp"])
    return kwargs


def generator_from_record(rec) -> Generator:
    """Build our Generator from a pickled NVlabs Generator record and load its state (strict).

    The recorded kwargs are bounds-checked and the network is first built on the meta device and
    compared with the record's tensors (models.arch_limits), so a pickle that declares a huge
    network is refused before anything is allocated."""
    kwargs = _generator_kwargs(rec)
    return build_and_load(lambda: _build(Generator, kwargs, "generator"), rec.state_dict(),
                          "StyleGAN2 generator", kwargs=kwargs)


def discriminator_from_record(rec) -> Discriminator:
    """Build our Discriminator from a pickled NVlabs Discriminator record and load its state (strict)."""
    kwargs = _discriminator_kwargs(rec)
    return build_and_load(lambda: _build(Discriminator, kwargs, "discriminator"), rec.state_dict(),
                          "StyleGAN2 discriminator", min_resolution=8, kwargs=kwargs)
