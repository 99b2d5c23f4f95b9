"""Pruning: L1-unstructured (zeros, honest about no speed-up) and structured channel pruning (real speed-up).

- l1-unstructured: in every convolution / dense weight the `amount` fraction of entries with
  the smallest |w| become zero (per layer, torch.nn.utils.prune, then made permanent). The
  tensors keep their shape, so dense kernels multiply the zeros anyway: this shows what
  sparsity costs in quality, it does not make anything faster. The report says so.
- structured: whole channels go, so every later tensor is smaller and the dense kernels do
  less work. Channels are ranked by the L1 norm of the filter that produces them (Li et al.,
  "Pruning Filters for Efficient ConvNets") and removed together with everything that reads
  them (dependency-aware):
  * StyleGAN2: a channel is produced by a SynthesisLayer's weight row and bias, and read by
    the next layer's weight column and style (affine) row, the block's ToRGB, and a resnet
    skip conv. Done here by plain tensor slicing: torch-pruning traces through autograd and
    cannot follow the per-sample weights of a modulated convolution.
  * StyleGAN3: the same between consecutive synthesis layers (the Fourier input and ToRGB
    keep their channels).
  * Diffusion UNet: the inner channels of every ResNet block (conv1 -> time embedding ->
    GroupNorm -> conv2), through torch-pruning's dependency graph, the same number in each
    GroupNorm group so the groups stay aligned; and in every transformer block the feed-forward
    inner channels (a GEGLU's value and gate rows together, kept to a multiple of 64) and whole
    attention heads (their Q/K/V rows and output columns), by plain slicing. Channels on skip
    connections and the residual stream are left alone: cutting them reshapes the whole UNet.
  The report has the parameter count before and after and the drift from the unpruned
  output on a fixed probe input (PSNR and relative error).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from core.types import OptimizationFlags
from optim.hardware import has_package
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target, count_params

NO_SPEEDUP = ("none: the weights keep their shape and dense kernels still multiply the zeros; "
              "this shows the quality cost of sparsity, not a speed-up")


# ---------------------------------------------------------------------------------------------
# Drift measurement (optim may not import evaluation/, so the two formulas live here too)



class NotPrunable(Exception):
    """This model has no structure the chosen pruning method can cut (reported as a skip reason)."""


def psnr_db(ref: torch.Tensor, out: torch.Tensor, data_range: float) -> float:
    mse = float((ref.double() - out.double()).square().mean())
    return float("inf") if mse == 0 else 10 * math.log10(data_range**2 / mse)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((ref.double() - out.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _stylegan_probe(G: torch.nn.Module, device: torch.device) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, G.z_dim, generator=g).to(device)
    c = torch.zeros(2, G.c_dim, device=device)
    if G.c_dim:
        c[torch.arange(2), torch.arange(2) % G.c_dim] = 1
    def run() -> torch.Tensor:
        with torch.no_grad():       # mapping too: unstructured pruning also thins the mapping network
            return G.synthesis(G.mapping(z, c, truncation_psi=1.0), noise_mode="const").float()
    return run


def unet_probe_inputs(unet: torch.nn.Module, device: torch.device, size: int | None = None,
                      batch: int = 1, tokens: int = 77) -> dict:
    """Fixed random inputs a diffusers UNet2DConditionModel accepts (SD1.x/2.x and SDXL)."""
    cfg = unet.config
    size = int(size or cfg.sample_size)
    cross = cfg.cross_attention_dim
    cross = int(cross[0] if isinstance(cross, (list, tuple)) else cross)
    dtype = next(unet.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    kw = {
        "sample": torch.randn(batch, cfg.in_channels, size, size, generator=g),
        "timestep": torch.full((batch,), 500, dtype=torch.int64),
        "encoder_hidden_states": torch.randn(batch, tokens, cross, generator=g),
    }
    if getattr(cfg, "addition_embed_type", None) == "text_time":
        n_text = int(cfg.projection_class_embeddings_input_dim) - 6 * int(cfg.addition_time_embed_dim)
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, n_text, generator=g),
                                   "time_ids": torch.tensor([[size * 8, size * 8, 0, 0, size * 8, size * 8]] * batch,
                                                            dtype=torch.float32)}

    def move(v):
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        return v.to(device, dtype=dtype if v.is_floating_point() else v.dtype)
    return {k: move(v) for k, v in kw.items()}


def _unet_probe(unet: torch.nn.Module, device: torch.device) -> Callable[[], torch.Tensor]:
    inputs = unet_probe_inputs(unet, device)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return unet(**inputs, return_dict=False)[0].float()
    return run


def _counted(probe: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The probe's output and its FLOPs (matrix products and convolutions, as torch's FLOP counter counts)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        out = probe()
    return out, int(fc.get_total_flops())


def _drift(ref: torch.Tensor, out: torch.Tensor, what: str) -> dict:
    rng = float(ref.max() - ref.min()) if what == "unet" else 2.0
    return {"psnr_db": round(psnr_db(ref, out, rng), 2), "rel_err": round(rel_err(ref, out), 5),
            "probe": ("2 images, z from torch.Generator(0), const noise, pixel range [-1, 1]" if what == "stylegan"
                      else "one UNet pass on fixed random latents at the model's sample size, t=500; "
                           "PSNR over the reference's value range")}


# ---------------------------------------------------------------------------------------------
# L1 unstructured


def l1_unstructured(module: torch.nn.Module, amount: float, only: tuple[type, ...] | None = None) -> dict:
    """Zero the smallest-|w| `amount` of every weight (dim >= 2) in `module`, permanently."""
    from torch.nn.utils import prune as tprune

    pruned = total = zeros = 0
    for m in list(module.modules()):
        w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
        if not isinstance(w, torch.nn.Parameter) or w.ndim < 2:
            continue
        if only is not None and not isinstance(m, only):
            continue
        tprune.l1_unstructured(m, "weight", amount=amount)
        tprune.remove(m, "weight")
        pruned += 1
        total += m.weight.numel()
        zeros += int((m.weight == 0).sum())
    return {"layers": pruned, "sparsity": round(zeros / max(total, 1), 4), "pruned_weights": total}


# ---------------------------------------------------------------------------------------------
# Structured: StyleGAN


def _keep_index(score: torch.Tensor, amount: float) -> torch.Tensor:
    n = score.numel()
    keep = max(1, int(round(n * (1 - amount))))
    return torch.sort(torch.argsort(score, descending=True)[:keep]).values


def _slice_param(module: torch.nn.Module, name: str, idx: torch.Tensor, dim: int) -> None:
    t = getattr(module, name)
    new = t.data.index_select(dim, idx.to(t.device)).clone()
    if isinstance(t, torch.nn.Parameter):
        setattr(module, name, torch.nn.Parameter(new, requires_grad=t.requires_grad))
    else:
        module._buffers[name] = new


def _cut_producer(layer, idx) -> None:
    """Output channels of a modulated (or plain) conv layer."""
    _slice_param(layer, "weight", idx, 0)
    if getattr(layer, "bias", None) is not None:
        _slice_param(layer, "bias", idx, 0)
    layer.out_channels = int(idx.numel())


def _cut_consumer(layer, idx) -> None:
    """Input channels of a conv layer, and the matching style rows of its affine layer."""
    old_gain = getattr(layer, "weight_gain", None)
    _slice_param(layer, "weight", idx, 1)
    layer.in_channels = int(idx.numel())
    if isinstance(old_gain, float) and layer.weight.ndim == 4:
        # StyleGAN2 ToRGB / plain convs scale their weights by 1/sqrt(fan-in) at run time. Give the layer the
        # gain its new fan-in implies and fold the difference into the weights: the output is unchanged, and
        # the network equals one built from scratch with these channel counts (a saved pruned model loads
        # into exactly this).
        k = layer.weight.shape[-1]
        new_gain = 1 / math.sqrt(layer.in_channels * k * k)
        with torch.no_grad():
            layer.weight.mul_(old_gain / new_gain)
        layer.weight_gain = new_gain
    aff = getattr(layer, "affine", None)
    if aff is not None:
        _slice_param(aff, "weight", idx, 0)
        if aff.bias is not None:
            _slice_param(aff, "bias", idx, 0)
        aff.out_features = int(idx.numel())


def _l1_rows(w: torch.Tensor) -> torch.Tensor:
    return w.detach().abs().float().flatten(1).sum(1)


class _ChannelProbe:
    """Per-channel statistics of what each consumer layer reads, over one probe batch.

    StyleGAN's modulated convolutions demodulate: every output channel is rescaled to unit
    variance, so the size of a producer's own weight row says nothing about its channel. What
    decides is what the reader sees: channel c enters a consumer as rms(x_c) * |style_c| *
    ||W[:, c]|| (its activation after bias, noise and lrelu, its style, its weights)."""

    def __init__(self, G: torch.nn.Module, layers, n: int = 8):
        self.sq: dict[int, torch.Tensor] = {}
        self.style: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in layers:
            hooks.append(layer.register_forward_pre_hook(self._reader(id(layer))))
            aff = getattr(layer, "affine", None)
            if aff is not None:
                hooks.append(aff.register_forward_hook(self._styler(id(layer))))
        dev = next(G.parameters()).device
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(n, G.z_dim, generator=gen).to(dev)
        c = torch.zeros(n, G.c_dim, device=dev)
        if G.c_dim:
            c[torch.arange(n), torch.arange(n) % G.c_dim] = 1
        try:
            with torch.no_grad():
                ws = G.mapping(z, c)
                try:
                    G.synthesis(ws, noise_mode="const")
                except TypeError:                      # StyleGAN3 has no noise inputs
                    G.synthesis(ws)
        finally:
            for h in hooks:
                h.remove()

    def _reader(self, key):
        def hook(_module, args):
            x = args[0].detach().float()
            self.sq[key] = self.sq.get(key, 0) + x.square().mean(dim=(0, 2, 3))
        return hook

    def _styler(self, key):
        def hook(_module, _args, out):
            self.style[key] = self.style.get(key, 0) + out.detach().float().abs().mean(0)
        return hook

    def importance(self, consumers) -> torch.Tensor:
        """Each consumer's per-channel contribution, normalised to sum 1 (a ToRGB layer and a 3x3
        conv are on different scales), summed over the consumers."""
        total = None
        for layer in consumers:
            col = layer.weight.detach().float().transpose(0, 1).flatten(1).norm(dim=1)        # [in]
            score = col * self.sq[id(layer)].sqrt().to(col.device)
            if id(layer) in self.style:
                score = score * self.style[id(layer)].to(col.device)
            share = score / score.sum().clamp_min(1e-12)
            total = share if total is None else total + share
        return total


def structured_stylegan(G: torch.nn.Module, amount: float) -> dict:
    syn = G.synthesis
    if hasattr(syn, "block_resolutions"):
        readers = [m for b in (getattr(syn, f"b{r}") for r in syn.block_resolutions)
                   for m in (getattr(b, "conv1", None), getattr(b, "conv0", None), getattr(b, "torgb", None),
                             getattr(b, "skip", None)) if m is not None]
    else:
        readers = [getattr(syn, n) for n in getattr(syn, "layer_names", ())]
    probe = _ChannelProbe(G, readers)       # measured once, on the unpruned network
    channels_before, channels_after = {}, {}
    if hasattr(syn, "block_resolutions"):                      # StyleGAN2
        blocks = [getattr(syn, f"b{r}") for r in syn.block_resolutions]
        for i, b in enumerate(blocks):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            # (1) inside a block: conv0's output = conv1's input
            if hasattr(b, "conv0"):
                idx = _keep_index(probe.importance([b.conv1]), amount)
                channels_before[f"b{b.resolution}.conv0"] = b.conv0.out_channels
                _cut_producer(b.conv0, idx)
                _cut_consumer(b.conv1, idx)
                channels_after[f"b{b.resolution}.conv0"] = int(idx.numel())
            # (2) the block's output: conv1 (+ resnet skip) -> ToRGB, next block's conv0 (+ skip)
            if nxt is None and not hasattr(b, "torgb"):
                continue
            consumers = [getattr(b, "torgb", None)] + ([nxt.conv0, getattr(nxt, "skip", None)] if nxt is not None else [])
            idx = _keep_index(probe.importance([r for r in consumers if r is not None]), amount)
            channels_before[f"b{b.resolution}.conv1"] = b.conv1.out_channels
            _cut_producer(b.conv1, idx)
            if hasattr(b, "skip"):
                _cut_producer(b.skip, idx)
            if hasattr(b, "torgb"):
                _cut_consumer(b.torgb, idx)
            if nxt is not None:
                _cut_consumer(nxt.conv0, idx)
                if hasattr(nxt, "skip"):
                    _cut_consumer(nxt.skip, idx)
                nxt.in_channels = int(idx.numel())
            channels_after[f"b{b.resolution}.conv1"] = int(idx.numel())
    elif hasattr(syn, "layer_names"):                           # StyleGAN3
        layers = [getattr(syn, n) for n in syn.layer_names]
        for a, b in zip(layers[:-1], layers[1:]):
            idx = _keep_index(probe.importance([b]), amount)
            channels_before[syn.layer_names[layers.index(a)]] = a.out_channels
            old_in = b.in_channels
            _cut_producer(a, idx)
            _cut_consumer(b, idx)
            if getattr(b, "is_torgb", False):
                # StyleGAN3's ToRGB scales its styles by 1/sqrt(in_channels) at run time and has no
                # demodulation to cancel it: fold the old gain into the weight.
                with torch.no_grad():
                    b.weight.mul_(math.sqrt(b.in_channels / old_in))
            channels_after[syn.layer_names[layers.index(a)]] = int(idx.numel())
    else:
        raise NotPrunable(f"no channel pruning for {type(syn).__name__}")
    return {"channels_before": channels_before, "channels_after": channels_after}


# ---------------------------------------------------------------------------------------------
# Structured: diffusion UNet (torch-pruning)


def _slice_linear(lin: torch.nn.Linear, idx: torch.Tensor, dim: int) -> None:
    """Keep rows (dim 0: output features, and the bias) or columns (dim 1: input features) `idx` of a Linear."""
    _slice_param(lin, "weight", idx, dim)
    if dim == 0:
        if lin.bias is not None:
            _slice_param(lin, "bias", idx, 0)
        lin.out_features = int(idx.numel())
    else:
        lin.in_features = int(idx.numel())


def _aligned_keep(n: int, amount: float) -> int:
    """How many of n channels to keep: n·(1 - amount) rounded down to a multiple of 64 (8 for narrow layers), so
    the smaller GEMMs still fit the tensor cores' tiles; 0 when that would keep all of them."""
    align = 64 if n >= 256 else 8
    keep = max(align, int(n * (1 - amount)) // align * align)
    return keep if keep < n else 0


def _prune_feedforward(ff: torch.nn.Module, amount: float) -> tuple[int, int] | None:
    """The inner (hidden) channels of a diffusers FeedForward: rows of the input projection (both halves of a
    GEGLU's, the value and the gate of a channel go together) and columns of the output projection. Ranked by
    the weight magnitude on the channel's path: |W_in row|₁ · |W_out column|₁ (the gate's row too for GEGLU)."""
    net = getattr(ff, "net", None)
    if net is None or len(net) < 3 or not isinstance(net[2], torch.nn.Linear):
        return None
    proj, out = getattr(net[0], "proj", None), net[2]
    if not isinstance(proj, torch.nn.Linear):
        return None
    inner = out.in_features
    gated = proj.out_features == 2 * inner
    if not gated and proj.out_features != inner:
        return None
    keep = _aligned_keep(inner, amount)
    if not keep:
        return None
    w = proj.weight.detach().float().abs()
    score = w[:inner].sum(1) * out.weight.detach().float().abs().sum(0)
    if gated:
        score = score * w[inner:].sum(1)
    idx = torch.sort(torch.argsort(score, descending=True)[:keep]).values
    _slice_linear(proj, torch.cat([idx, idx + inner]) if gated else idx, 0)
    _slice_linear(out, idx, 1)
    return inner, keep


def _prune_heads(attn: torch.nn.Module, amount: float) -> tuple[int, int] | None:
    """Whole attention heads of a diffusers Attention: their rows of to_q / to_k / to_v and columns of to_out.
    Ranked by each head's value path, |W_v rows|₁ · |W_out columns|₁. Layers with extra projections (added K/V,
    query/key norms, grouped K/V heads) are left alone."""
    if not all(isinstance(getattr(attn, n, None), torch.nn.Linear) for n in ("to_q", "to_k", "to_v")):
        return None
    if getattr(attn, "add_k_proj", None) is not None or getattr(attn, "norm_q", None) is not None:
        return None
    heads, out = int(attn.heads), attn.to_out[0]
    inner = attn.to_q.out_features
    if inner % heads or attn.to_k.out_features != inner or attn.to_v.out_features != inner:
        return None
    drop = int(heads * amount)
    if drop < 1 or drop >= heads:
        return None
    d = inner // heads
    score = (attn.to_v.weight.detach().float().abs().view(heads, d, -1).sum((1, 2))
             * out.weight.detach().float().abs().view(out.out_features, heads, d).sum((0, 2)))
    kept = torch.sort(torch.argsort(score, descending=True)[:heads - drop]).values
    idx = (kept[:, None] * d + torch.arange(d, device=kept.device)).flatten()
    for lin in (attn.to_q, attn.to_k, attn.to_v):
        _slice_linear(lin, idx, 0)
    _slice_linear(out, idx, 1)
    attn.heads = attn.sliceable_head_dim = heads - drop
    attn.inner_dim = attn.inner_kv_dim = int(idx.numel())
    return heads, heads - drop


def structured_unet(unet: torch.nn.Module, amount: float, device: torch.device) -> dict:
    import torch_pruning as tp

    resnets = [(n, m) for n, m in unet.named_modules()
               if all(hasattr(m, a) for a in ("conv1", "conv2", "norm2")) and isinstance(m.norm2, torch.nn.GroupNorm)]
    if not resnets:
        raise NotPrunable(f"no ResNet blocks found in {type(unet).__name__}")
    down = len(getattr(unet.config, "block_out_channels", (1,)))
    example = unet_probe_inputs(unet, device, size=2 ** max(down - 1, 0) * 2, tokens=8)
    was = {n: p.requires_grad for n, p in unet.named_parameters()}
    unet.requires_grad_(True)                    # torch-pruning follows autograd to find dependencies
    try:
        dg = tp.DependencyGraph().build_dependency(unet, example_inputs=example)
        before, after = {}, {}
        for name, m in resnets:
            C, G = m.conv1.out_channels, m.norm2.num_groups
            per = C // G
            drop = int(per * amount)
            if drop < 1:
                continue
            score = _l1_rows(m.conv1.weight)
            idxs: list[int] = []
            for gi in range(G):          # the same count from every group keeps GroupNorm's groups aligned
                s = score[gi * per:(gi + 1) * per]
                idxs += (gi * per + torch.argsort(s)[:drop]).tolist()
            group = dg.get_pruning_group(m.conv1, tp.prune_conv_out_channels, idxs=idxs)
            group.prune()
            before[name] = C
            after[name] = m.conv1.out_channels
    finally:
        for n, p in unet.named_parameters():
            p.requires_grad_(was.get(n, False))
    if not after:
        raise ValueError(f"amount {amount} removes less than one channel per GroupNorm group; use a larger amount")
    # The transformer blocks, by plain slicing: their feed-forward inner channels and attention heads. Channels on
    # the residual stream (proj_in/out, the blocks' width) stay, as the ResNets' skip channels do.
    ff, heads = {}, {}
    with torch.no_grad():
        for name, m in unet.named_modules():
            if type(m).__name__ == "FeedForward":
                cut = _prune_feedforward(m, amount)
                if cut:
                    ff[name] = cut
            elif hasattr(m, "to_q") and hasattr(m, "heads") and hasattr(m, "to_out"):
                cut = _prune_heads(m, amount)
                if cut:
                    heads[name] = cut
    return {"channels_before": before, "channels_after": after,
            "feedforward_inner": {n: {"before": b, "after": a} for n, (b, a) in ff.items()},
            "attention_heads": {n: {"before": b, "after": a} for n, (b, a) in heads.items()},
            "scope": "inner channels of every ResNet block (conv1 -> GroupNorm -> conv2), the feed-forward inner "
                     "channels and whole attention heads of every transformer block"}


# ---------------------------------------------------------------------------------------------
# The toggle


def apply(target: Target, flags: OptimizationFlags, ctx: Context) -> ToggleReport:
    amount, method = float(flags.prune_amount), flags.prune_method
    base = {"method": method, "amount": amount}
    module = target.root if target.kind == "stylegan" else target.get("unet")
    # Where the weights are now (with CPU offload that is the CPU, not the request's device).
    dev = next(module.parameters()).device
    if target.kind == "stylegan":
        probe = _stylegan_probe(module, dev)
        what = "stylegan"
    else:
        if not hasattr(module, "config"):
            return skipped("pruning needs a diffusers UNet (with .config) to build probe inputs", **base)
        probe = _unet_probe(module, dev)
        what = "unet"
    if method == "structured" and what == "unet" and not has_package("torch_pruning"):
        return skipped("structured UNet pruning needs torch-pruning (pip install torch-pruning)", **base)
    ref, flops_before = _counted(probe)
    params_before = count_params(module)
    try:
        if method == "l1-unstructured":
            only = (torch.nn.Conv2d, torch.nn.Linear) if what == "unet" else None
            details = l1_unstructured(module, amount, only)
        elif what == "stylegan":
            details = structured_stylegan(module, amount)
        else:
            details = structured_unet(module, amount, dev)
    except (NotPrunable, ValueError) as exc:
        return skipped(f"could not prune this model: {exc}", **base)
    out, flops_after = _counted(probe)
    params_after = count_params(module)
    rep = {**base, "params_before": params_before, "params_after": params_after,
           "drift": _drift(ref, out, what), **details}
    if flops_before:
        # What the dense kernels have left to do on the probe: the speed-up a compute-bound run can reach
        # (the H200 eager runs were launch- and sync-bound, where pruning gained nothing: prune with --compile).
        rep["flops"] = {"before": flops_before, "after": flops_after,
                        "fraction_left": round(flops_after / flops_before, 4), "probe": "the drift probe's forward pass"}
    if method == "l1-unstructured":
        rep["nonzero_params_after"] = params_after - int(round(details["sparsity"] * details["pruned_weights"]))
        rep["speedup"] = NO_SPEEDUP
        return applied(f"{details['sparsity']:.0%} of the weights in {details['layers']} layers set to zero "
                       "(no speed-up on dense kernels)", **rep)
    rep["speedup"] = (f"real: {1 - params_after / params_before:.0%} fewer parameters, smaller dense convolutions"
                      + (" (UNet only)" if what == "unet" else ""))
    if what == "unet":
        return applied(f"{len(details['channels_after'])} ResNet blocks, {len(details['feedforward_inner'])} "
                       f"feed-forward layers and {len(details['attention_heads'])} attention layers cut to "
                       f"~{1 - amount:.0%} of their channels / heads", **rep)
    return applied(f"{len(details['channels_after'])} channel groups cut to ~{1 - amount:.0%} of their channels",
                   **rep)
