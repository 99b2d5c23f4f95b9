"""TensorRT engines for the StyleGAN synthesis network and the diffusion UNet.

Path: ONNX export (torch.onnx.export with torch.export, dynamic batch / resolution) ->
engine build with one optimization profile (min / opt / max shapes) -> engine cache ->
execution through the TensorRT runtime on the current CUDA stream.

Engine cache: `<cache_dir>/tensorrt/<key>.plan`, the key a hash of the weights hash (the
model file's sha256 when the pipeline passes it, else a fingerprint of the tensors), the
network's structure (parameter names, shapes, dtypes: a weights hash that is only a name, such
as the benchmark's random weights, cannot then match another architecture), the transforms
applied before export (pruning, precision), the TensorRT version (read from the imported module),
the torch version that exported the graph, the GPU's compute capability and the shape profile.
A change in any of them builds a new engine; nothing stale is ever loaded.

Written against the TensorRT 10 Python API (Builder, create_network, OnnxParser.parse_from_file,
IBuilderConfig with a memory-pool limit and one optimization profile, build_serialized_network,
Runtime.deserialize_cuda_engine, and execution by tensor name: set_input_shape, set_tensor_address,
execute_async_v3 on torch's current stream). TensorRT 10.12 deprecated weakly typed networks and 11
removed the FP16/BF16 builder flags: where those flags are missing the network is built strongly
typed and the engine keeps the exported graph's types (the report says so).

A request outside the profile (a batch or size the engine was not built for, StyleGAN's
random noise, UNet extras such as ControlNet residuals) runs in PyTorch, and the report
counts these fallbacks with the last reason.

TensorRT's Python wheels come only from NVIDIA's own package index. Where `tensorrt` is not
importable the toggle is skipped with TENSORRT_MISSING; the ONNX export is tested on any
machine against onnxruntime.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import OptionalDependencyError
from core.types import OptimizationFlags
from optim.hardware import capability, has_package, package_version, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

TENSORRT_MISSING = ("TensorRT is not installed: its Python wheels come only from NVIDIA's own package index "
                    "(pip install tensorrt --extra-index-url https://pypi.nvidia.com); ran in PyTorch")
ONNX_OPSET = 18
FORMAT_VERSION = 1                 # bump when the export wrappers change what an engine computes


def unavailable_reason(device: torch.device) -> str | None:
    if not has_package("tensorrt"):
        return TENSORRT_MISSING
    if capability(device) is None:
        return f"TensorRT needs an NVIDIA GPU; {where(device)}; ran in PyTorch"
    return None


# ---------------------------------------------------------------------------------------------
# Shape profiles


@dataclass
class ShapeProfile:
    """min / opt / max shape of every engine input (TensorRT's optimization profile)."""

    inputs: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    notes: dict[str, str] = field(default_factory=dict)

    def accepts(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """None when every input shape lies inside the profile, else the reason it does not."""
        for name, shape in shapes.items():
            if name not in self.inputs:
                return f"the engine has no input {name!r}"
            lo, _, hi = self.inputs[name]
            shape = tuple(int(s) for s in shape)
            if len(shape) != len(lo) or any(s < a or s > b for s, a, b in zip(shape, lo, hi)):
                return f"input {name} of shape {list(shape)} is outside the engine's profile {list(lo)}..{list(hi)}"
            mult = self.notes.get(f"{name}.multiple")
            if mult and any(s % int(mult) for s in shape[2:]):
                return f"input {name} of shape {list(shape)}: height and width must be multiples of {mult} for this engine"
        return None

    @property
    def max_batch(self) -> int:
        return min(v[2][0] for v in self.inputs.values())

    def as_dict(self) -> dict:
        return {k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])} for k, v in self.inputs.items()}


def engine_key(weights_hash: str, transforms: dict, trt_version: str, cap: tuple[int, int] | None,
               profile: ShapeProfile, component: str, structure: str = "") -> str:
    raw = json.dumps({"weights": weights_hash, "structure": structure, "transforms": transforms,
                      "tensorrt": trt_version, "torch": torch.__version__.split("+")[0],
                      "capability": list(cap) if cap else None, "profile": profile.as_dict(),
                      "component": component, "opset": ONNX_OPSET, "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def structure_fingerprint(module: torch.nn.Module) -> str:
    """A hash of the parameter and buffer names, shapes and dtypes (no data read: cheap for any size)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def tensorrt_version() -> str:
    """The imported module's own version: the pip distribution may be named tensorrt, tensorrt-cu12 or
    tensorrt_cu13, so the package metadata alone can miss it."""
    try:
        import tensorrt as trt

        return str(trt.__version__)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return package_version("tensorrt") or "unknown"


def precision_plan(precision: str, builder_flags: set[str] | frozenset[str]) -> tuple[bool, str | None, str]:
    """(strongly typed network?, builder flag to set, note) for an engine of `precision`, given the names
    of the installed TensorRT's BuilderFlag members. TensorRT 10 builds reduced precision from a weakly
    typed network with the FP16 / BF16 flag; TensorRT 11 has no such flags and types every tensor from
    the graph itself, so the engine runs in the dtype the graph was exported in."""
    flag = {"fp16": "FP16", "bf16": "BF16"}.get(precision)
    if flag is None:
        return False, None, ""
    if flag in builder_flags:
        return False, flag, ""
    return True, None, (f"this TensorRT has no {flag} builder flag (strongly typed networks only): the engine keeps "
                        f"the exported graph's dtypes")


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A content hash of every parameter and buffer (used when no file hash is given)."""
    h = hashlib.sha256()
    for name, t in list(module.state_dict().items()):
        h.update(name.encode())
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
                 if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Export wrappers: plain tensor in, plain tensor out


class StyleGANSynthesisForExport(torch.nn.Module):
    """ws -> image with constant noise. StyleGAN2 uses the unfused modulated conv (a shared-weight
    conv between per-sample scalings, equal to the fused one up to rounding) so the batch can be
    dynamic: the fused form folds the batch into conv groups, which ONNX cannot leave dynamic."""

    def __init__(self, synthesis: torch.nn.Module):
        super().__init__()
        self.synthesis = synthesis
        self.is_sg2 = hasattr(synthesis, "block_resolutions")

    def forward(self, ws: torch.Tensor) -> torch.Tensor:
        if self.is_sg2:
            return self.synthesis(ws, noise_mode="const", force_fp32=True, fused_modconv=False)
        return self.synthesis(ws, noise_mode="const")


class UNetForExport(torch.nn.Module):
    """(sample, timestep [B] float, encoder_hidden_states[, text_embeds, time_ids]) -> noise prediction."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet
        self.sdxl = getattr(unet.config, "addition_embed_type", None) == "text_time"

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds=None, time_ids=None):
        added = {"text_embeds": text_embeds, "time_ids": time_ids} if self.sdxl else None
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False)[0]


def stylegan_profile(synthesis: torch.nn.Module, max_batch: int = 32, opt_batch: int = 8) -> ShapeProfile:
    num_ws, w_dim = int(synthesis.num_ws), int(synthesis.w_dim)
    if not hasattr(synthesis, "block_resolutions"):
        # StyleGAN3's modulated conv always folds the batch into groups: engines are built for
        # batch 1 and a larger batch runs image by image through the same engine.
        s = (1, num_ws, w_dim)
        return ShapeProfile({"ws": (s, s, s)}, {"batch": "static 1 (StyleGAN3): larger batches run image by image"})
    return ShapeProfile({"ws": ((1, num_ws, w_dim), (min(opt_batch, max_batch), num_ws, w_dim), (max_batch, num_ws, w_dim))})


def _spatial_multiple(unet) -> int:
    return 2 ** max(len(getattr(unet.config, "block_out_channels", (1,))) - 1, 0)


def unet_profile(unet: torch.nn.Module, max_batch: int = 8, tokens: int = 77) -> ShapeProfile:
    cfg = unet.config
    s = int(cfg.sample_size)
    mult = _spatial_multiple(unet)
    lo = max(mult, (s // 2) // mult * mult)
    hi = s * 2 if s <= 64 else s
    cross = cfg.cross_attention_dim
    cross = int(cross[0] if isinstance(cross, (list, tuple)) else cross)
    c = int(cfg.in_channels)
    opt_b = min(2, max_batch)
    inputs = {
        "sample": ((1, c, lo, lo), (opt_b, c, s, s), (max_batch, c, hi, hi)),
        "timestep": ((1,), (opt_b,), (max_batch,)),
        "encoder_hidden_states": ((1, tokens, cross), (opt_b, tokens, cross), (max_batch, tokens, cross)),
    }
    if getattr(cfg, "addition_embed_type", None) == "text_time":
        n_text = int(cfg.projection_class_embeddings_input_dim) - 6 * int(cfg.addition_time_embed_dim)
        inputs["text_embeds"] = ((1, n_text), (opt_b, n_text), (max_batch, n_text))
        inputs["time_ids"] = ((1, 6), (opt_b, 6), (max_batch, 6))
    return ShapeProfile(inputs, {"sample.multiple": str(mult)})


# ---------------------------------------------------------------------------------------------
# ONNX export


def _export(module: torch.nn.Module, args: tuple, path: Path, input_names: list[str],
            dynamic_shapes, output_name: str) -> Path:
    if not has_package("onnxscript"):
        raise OptionalDependencyError("ONNX export needs onnxscript (pip install onnxscript)")
    path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=input_names, output_names=[output_name],
                          dynamic_shapes=dynamic_shapes, opset_version=ONNX_OPSET, verbose=False,
                          external_data=True)
    return path


def export_stylegan_onnx(synthesis: torch.nn.Module, path: str | Path, profile: ShapeProfile | None = None) -> tuple[Path, ShapeProfile]:
    """Export a StyleGAN2/3 synthesis network (ws -> image) to ONNX with the profile's batch range."""
    profile = profile or stylegan_profile(synthesis)
    lo, opt, hi = profile.inputs["ws"]
    device = next(synthesis.parameters()).device
    ws = torch.randn(*opt, device=device)
    dyn = None
    if hi[0] > lo[0]:
        dyn = ({0: torch.export.Dim("batch", min=lo[0], max=hi[0])},)
    return _export(StyleGANSynthesisForExport(synthesis), (ws,), Path(path), ["ws"], dyn, "img"), profile


def export_unet_onnx(unet: torch.nn.Module, path: str | Path, profile: ShapeProfile | None = None) -> tuple[Path, ShapeProfile]:
    """Export a diffusers UNet2DConditionModel to ONNX with dynamic batch and latent size."""
    profile = profile or unet_profile(unet)
    mult = int(profile.notes.get("sample.multiple", "1"))
    device = next(unet.parameters()).device
    dtype = next(unet.parameters()).dtype
    names = list(profile.inputs)
    args = []
    for n in names:
        shape = profile.inputs[n][1]
        args.append(torch.full(shape, 500.0, device=device, dtype=torch.float32) if n == "timestep"
                    else torch.randn(*shape, device=device, dtype=dtype))
    b_lo, b_hi = profile.inputs["sample"][0][0], profile.inputs["sample"][2][0]
    s_lo, s_hi = profile.inputs["sample"][0][2], profile.inputs["sample"][2][2]
    batch = torch.export.Dim("batch", min=b_lo, max=b_hi)
    dyn_h = torch.export.Dim("h_blocks", min=max(1, s_lo // mult), max=s_hi // mult)
    dyn_w = torch.export.Dim("w_blocks", min=max(1, s_lo // mult), max=s_hi // mult)
    spec: dict = {"sample": {0: batch, 2: mult * dyn_h if mult > 1 else dyn_h, 3: mult * dyn_w if mult > 1 else dyn_w},
                  "timestep": {0: batch}, "encoder_hidden_states": {0: batch}}
    if "text_embeds" in names:
        spec["text_embeds"] = {0: batch}
        spec["time_ids"] = {0: batch}
    dynamic_shapes = tuple(spec[n] for n in names)
    return _export(UNetForExport(unet), tuple(args), Path(path), names, dynamic_shapes, "noise_pred"), profile


# ---------------------------------------------------------------------------------------------
# Engine build and execution (needs tensorrt and a GPU)


def _torch_dtype(trt_dtype):
    import tensorrt as trt

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.bool: torch.bool, trt.int8: torch.int8}
    for trt_name, torch_dtype in (("bfloat16", torch.bfloat16), ("uint8", torch.uint8)):
        if hasattr(trt, trt_name):
            table[getattr(trt, trt_name)] = torch_dtype
    if trt_dtype not in table:
        raise RuntimeError(f"the engine has an input or output of TensorRT type {trt_dtype}, which this wrapper "
                           f"does not map to a torch dtype")
    return table[trt_dtype]


def build_engine(onnx_path: Path, profile: ShapeProfile, precision: str, engine_path: Path,
                 workspace_bytes: int = 8 << 30, details: dict | None = None) -> Path:
    import tensorrt as trt

    flag_names = set(getattr(trt.BuilderFlag, "__members__", {}))
    strong, flag, note = precision_plan(precision, flag_names)
    if details is not None:
        details["network_typing"] = "strong" if strong else "weak"
        if note:
            details["precision_note"] = note
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Explicit batch is the only mode since TensorRT 10 (its flag is ignored), so 0 means a weakly typed network.
    net_flags = (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)) if strong else 0
    network = builder.create_network(net_flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):      # from the file, so external weight data is found
        errors = "; ".join(str(parser.get_error(i)) for i in range(min(parser.num_errors, 3)))
        raise RuntimeError(f"TensorRT could not parse the ONNX graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if flag:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    elif precision == "fp32" and "TF32" in flag_names:
        config.clear_flag(trt.BuilderFlag.TF32)         # the fp32 reference means no TF32 either
    prof = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.inputs.items():
        prof.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(prof)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT could not build an engine from this graph (its log above says why)")
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = engine_path.with_suffix(".tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(engine_path)
    return engine_path


class TRTEngine:
    """A deserialized engine with one execution context; call with named CUDA tensors."""

    def __init__(self, engine_path: Path, device: torch.device):
        import tensorrt as trt

        self.device = device
        self._logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self._logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load the engine {engine_path} (built by another version?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep = []
        for name in self.inputs:
            t = feeds[name].to(self.device, _torch_dtype(self.engine.get_tensor_dtype(name))).contiguous()
            keep.append(t)                                  # alive until the stream has run
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=_torch_dtype(self.engine.get_tensor_dtype(name)), device=self.device)
            self.context.set_tensor_address(name, out.data_ptr())
            outs[name] = out
        stream = torch.cuda.current_stream(self.device)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return outs


class _Fallbacks:
    def __init__(self, report: dict):
        self.report = report
        report.setdefault("fallbacks", 0)

    def note(self, reason: str) -> None:
        self.report["fallbacks"] += 1
        self.report["last_fallback"] = reason


class TRTSynthesis(torch.nn.Module):
    """StyleGAN synthesis through an engine, PyTorch for what the engine was not built for."""

    def __init__(self, eager: torch.nn.Module, engine: TRTEngine, profile: ShapeProfile, report: dict):
        super().__init__()
        self.eager = eager
        self._engine = engine
        self._profile = profile
        self._fallbacks = _Fallbacks(report)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["eager"], name)

    def forward(self, ws: torch.Tensor, noise_mode: str = "const", **kwargs) -> torch.Tensor:
        if noise_mode != "const":
            self._fallbacks.note(f"the engine bakes in constant noise; noise mode {noise_mode!r} ran in PyTorch")
            return self.eager(ws, noise_mode=noise_mode, **kwargs)
        chunk = self._profile.max_batch
        reason = self._profile.accepts({"ws": (min(ws.shape[0], chunk), *ws.shape[1:])})
        if reason:
            self._fallbacks.note(reason + "; ran in PyTorch")
            return self.eager(ws, noise_mode=noise_mode, **kwargs)
        outs = [self._engine({"ws": ws[i:i + chunk].float()})["img"].float() for i in range(0, ws.shape[0], chunk)]
        return torch.cat(outs)


def _given(v) -> bool:
    """An optional UNet input that was actually passed (None and {} mean 'not used')."""
    return v is not None and not (isinstance(v, dict) and not v)


class _TRTUNetForward:
    """Replaces `unet.forward`; the UNet object (its config, dtype, device) stays what diffusers expects."""

    _HANDLED = {"added_cond_kwargs", "return_dict", "cross_attention_kwargs", "timestep_cond", "class_labels",
                "attention_mask", "encoder_attention_mask", "down_block_additional_residuals",
                "mid_block_additional_residual", "down_intrablock_additional_residuals"}

    def __init__(self, eager_forward, engine: TRTEngine, profile: ShapeProfile, report: dict, dtype: torch.dtype):
        self.eager_forward = eager_forward
        self.engine = engine
        self.profile = profile
        self.fallbacks = _Fallbacks(report)
        self.dtype = dtype

    def __call__(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        reason = None
        extras = sorted(k for k in self._HANDLED - {"added_cond_kwargs", "return_dict"} if _given(kwargs.get(k)))
        unknown = [k for k in kwargs if k not in self._HANDLED]
        if args or extras or unknown:
            reason = f"the engine has no inputs for {', '.join(extras + unknown) or 'extra positional arguments'}"
        feeds = None
        if reason is None:
            b = sample.shape[0]
            t = torch.as_tensor(timestep, device=sample.device).float().reshape(-1)
            t = t.expand(b) if t.numel() == 1 else t
            feeds = {"sample": sample, "timestep": t, "encoder_hidden_states": encoder_hidden_states}
            added = kwargs.get("added_cond_kwargs") or {}
            if "text_embeds" in self.profile.inputs:
                if "text_embeds" not in added or "time_ids" not in added:
                    reason = "SDXL engine needs text_embeds and time_ids"
                else:
                    feeds.update(text_embeds=added["text_embeds"], time_ids=added["time_ids"])
            if reason is None:
                reason = self.profile.accepts({k: tuple(v.shape) for k, v in feeds.items()})
        if reason:
            self.fallbacks.note(reason + "; ran in PyTorch")
            return self.eager_forward(sample, timestep, encoder_hidden_states, *args, **kwargs)
        out = self.engine(feeds)["noise_pred"].to(sample.dtype)
        if kwargs.get("return_dict", True):
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)
        return (out,)


# ---------------------------------------------------------------------------------------------
# The toggle


def _engine_for(export_fn, module, profile: ShapeProfile, key: str, precision: str, ctx: Context,
                details: dict) -> Path:
    engine_path = ctx.cache_dir / "tensorrt" / f"{key}.plan"
    details["engine"] = str(engine_path)
    if engine_path.is_file():
        details["engine_cache"] = "hit"
        return engine_path
    details["engine_cache"] = "miss: built now"
    onnx_dir = ctx.cache_dir / "onnx" / key
    t0 = time.perf_counter()
    onnx_path, _ = export_fn(module, onnx_dir / "model.onnx", profile)
    details["export_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    build_engine(onnx_path, profile, precision, engine_path, details=details)
    details["build_s"] = round(time.perf_counter() - t0, 1)
    (engine_path.with_suffix(".json")).write_text(json.dumps(
        {"profile": profile.as_dict(), "precision": precision, "tensorrt": tensorrt_version(),
         "capability": capability(ctx.device), "network_typing": details.get("network_typing")}, indent=1))
    for f in onnx_dir.glob("*"):                         # the engine has the weights; the ONNX copy is large
        f.unlink()
    onnx_dir.rmdir()
    return engine_path


def apply(target: Target, flags: OptimizationFlags, ctx: Context, fp8_applied: bool = False) -> ToggleReport:
    reason = unavailable_reason(ctx.device)
    if reason:
        return skipped(reason)
    if ctx.offloaded:
        return skipped("TensorRT is not combined with model CPU offload; turn off cpu-offload")
    if fp8_applied:
        return skipped("TensorRT is not combined with torchao FP8 here (an FP8-quantized UNet does not export to "
                       "ONNX); use one or the other")
    trt_version = tensorrt_version()
    transforms = {"precision": flags.precision, "prune": [flags.prune_amount, flags.prune_method],
                  "channels_last": flags.channels_last}
    details: dict = {"tensorrt_version": trt_version}
    try:
        if target.kind == "stylegan":
            G = target.root
            syn = G.synthesis
            profile = stylegan_profile(syn)
            key = engine_key(ctx.weights_hash or weights_fingerprint(syn), transforms, trt_version,
                             capability(ctx.device), profile, "stylegan-synthesis", structure_fingerprint(syn))
            path = _engine_for(export_stylegan_onnx, syn, profile, key, flags.precision, ctx, details)
            rep = applied("synthesis network runs as a TensorRT engine", component="synthesis",
                          profile=profile.as_dict(), **details)
            G.synthesis = TRTSynthesis(syn, TRTEngine(path, ctx.device), profile, rep)
        else:
            unet = target.get("unet")
            profile = unet_profile(unet)
            key = engine_key(ctx.weights_hash or weights_fingerprint(unet), transforms, trt_version,
                             capability(ctx.device), profile, "unet", structure_fingerprint(unet))
            path = _engine_for(export_unet_onnx, unet, profile, key, flags.precision, ctx, details)
            rep = applied("UNet runs as a TensorRT engine", component="unet", profile=profile.as_dict(), **details)
            unet.forward = _TRTUNetForward(unet.forward, TRTEngine(path, ctx.device), profile, rep,
                                           next(unet.parameters()).dtype)
    except Exception as exc:  # export / parse / build failures: the image is still made, in PyTorch
        first = (str(exc).splitlines() or [""])[0][:300]
        return skipped(f"TensorRT engine could not be made ({type(exc).__name__}: {first}); ran in PyTorch", **details)
    return rep
