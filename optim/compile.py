"""torch.compile (inductor) with an on-disk cache, shape buckets and a "compiling" status.

What gets compiled: StyleGAN's synthesis network (ws -> image) and the diffusion UNet, the
parts that run for every image / every step. StyleGAN's mapping network stays eager: its
truncation ψ is a Python float, and dynamo specialises on floats, so compiling it would
recompile for every ψ an artist tries.

Shape buckets: compiled with dynamic=False, so each input shape is its own graph. StyleGAN
batches are padded up to the next bucket (1, 2, 4, 8, 16, 32, 64, then multiples of 64)
and the padding sliced off, so an artist changing the seed count compiles at most a handful
of graphs; a diffusion resolution (latent height × width × batch) compiles once. Each call
runs under no_grad so grad mode never causes a recompile. A test runs with
`torch._dynamo.config.error_on_recompile = True` after warm-up to hold this.

Cache: inductor's FX-graph cache and triton's kernel cache live under
`<cache_dir>/compile/` (process-wide, set once by `configure_process`: the first cache root wins),
and after each new bucket the portable cache artifacts (`torch.compiler.save_cache_artifacts`)
are written under each cache root and loaded at the next start, so a second start skips the
compile (it still traces, a few seconds instead of a minute).

Status: the first call of a bucket compiles (tens of seconds for a UNet). Callers learn it
before the call with `is_first_run(obj, shape_key)` and through `set_status_callback`, which
receives FIRST_RUN_STATUS before that call and "compiled ..." after it.

mode="reduce-overhead" adds CUDA graphs (replays the whole kernel sequence with one launch;
largest win for small batches). Outputs are cloned because a replay overwrites them. Inductor
runs a graph it cannot capture (a CPU tensor, an input mutation) without CUDA graphs and only logs
it; the report lists such shapes under `cudagraph_skips`.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from core import compile_artifacts
from core.errors import AtelierError
from core.types import OptimizationFlags
from optim.hardware import capability, cxx_compiler, has_package, where
from optim.report import ToggleReport, applied, skipped
from optim.targets import Context, Target

FIRST_RUN_STATUS = "compiling (first run for this size)"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_TRACKER_ATTR = "_atelier_compile_tracker"
_loaded_artifacts: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Availability and cache


def unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda":
        if not has_package("triton"):
            return "torch.compile on the GPU needs triton (it ships with the CUDA torch wheels; reinstall torch)"
        return None
    if device.type == "cpu":
        if cxx_compiler() is None:
            return "torch.compile on the CPU needs a C++ compiler (g++ or clang++) for inductor; none was found"
        return None
    return f"torch.compile is not supported for {device.type} here; {where(device)}"


_process_compile_dir: Path | None = None


def configure_process(root: Path | str) -> Path:
    """Set the process-wide compile settings once; returns the folder inductor and triton cache in.

    These are read by inductor and triton whenever they compile, long after any request that asked for a
    compile, so they cannot be scoped to a request; and one value is right for every request: kernels in
    inductor's FX-graph cache and triton's cache are keyed by their content (graph, torch/triton version,
    device), so requests with different flags share the folders without ever reading each other's entries.
    The dynamo limits are floors that only rise: room for every shape bucket of a few cached pipelines
    before dynamo gives up and runs a function eagerly. The first call wins: a later call with another root
    changes nothing (its CompileCache still saves and loads its portable artifacts under its own root).
    """
    global _process_compile_dir
    if _process_compile_dir is not None:
        return _process_compile_dir
    folder = (Path(root) / "compile").resolve()       # inductor and triton make their folders when they write
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    import torch._dynamo.config as dynamo_config

    for name, floor in (("recompile_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(dynamo_config, name):              # the names of torch >= 2.6
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), floor))
    _process_compile_dir = folder
    return folder


def process_compile_dir() -> Path | None:
    """The folder `configure_process` pointed inductor and triton at, or None before it ran."""
    return _process_compile_dir


class CompileCache:
    """Inductor / triton caches and portable cache artifacts under `<root>/compile/`."""

    def __init__(self, root: Path | str):
        self.dir = Path(root) / "compile"

    @property
    def artifacts_dir(self) -> Path:
        return self.dir / "artifacts"

    def activate(self) -> int:
        """Make sure the process-wide compile settings are in place (`configure_process`) and load this
        cache's saved artifacts; returns files loaded."""
        configure_process(self.dir.parent)
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.load_artifacts()

    def _prefix(self) -> str:
        return f"torch{torch.__version__.replace('+', '_')}-"

    def load_artifacts(self) -> int:
        if not compile_artifacts.supported() or not self.artifacts_dir.is_dir():
            return 0
        n = 0
        for path in sorted(self.artifacts_dir.glob(self._prefix() + "*.bin")):
            key = str(path.resolve())
            if key in _loaded_artifacts:
                continue
            try:
                compile_artifacts.load_file(path)
                n += 1
            except Exception:  # a stale or truncated file only costs a recompile; drop it
                path.unlink(missing_ok=True)
            _loaded_artifacts.add(key)
        return n

    def save_artifacts(self, key: str) -> Path | None:
        if not compile_artifacts.supported():
            return None
        path = self.artifacts_dir / f"{self._prefix()}{key}.bin"
        if compile_artifacts.save_file(path) is None:   # atomic: a crash never leaves half a file to load
            return None
        _loaded_artifacts.add(str(path.resolve()))
        return path


# ---------------------------------------------------------------------------------------------
# Buckets and status


def batch_bucket(n: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """The compiled batch size a batch of n runs at."""
    if n < 1:
        raise ValueError("batch size must be at least 1")
    for b in buckets:
        if n <= b:
            return b
    step = buckets[-1]
    return -(-n // step) * step


class BucketTracker:
    """Which shapes have compiled, how long each took, and who to tell when one is compiling."""

    def __init__(self, report: dict, on_status: Callable[[str], None] | None = None):
        self.seen: dict[tuple, float] = {}
        self.failed: dict[tuple, str] = {}
        self.on_status = on_status
        self.report = report               # the live compile report: buckets are added as they compile

    def status(self, message: str) -> None:
        if self.on_status is not None:
            self.on_status(message)


class _BucketedCall:
    """Replaces an OptimizedModule's forward: bucket the shape, announce first runs, fall back on failure."""

    def __init__(self, compiled_forward, eager: torch.nn.Module, tracker: BucketTracker, kind: str,
                 cudagraphs: bool, cache: CompileCache | None, cache_key: str):
        self.compiled_forward = compiled_forward
        self.eager = eager
        self.tracker = tracker
        self.kind = kind
        self.cudagraphs = cudagraphs
        self.cache = cache
        self.cache_key = cache_key
        self.defaults = _keyword_defaults(eager) if kind == "stylegan" else {}

    def __call__(self, *args, **kwargs):
        n = None
        if self.kind == "stylegan":
            ws = args[0] if args else kwargs.pop("ws")
            args = args[1:]
            # Callers pass different keyword sets (G.forward passes four, style mixing one); dynamo
            # guards on the set, so every call gets the full set with the network's defaults.
            kwargs = {**self.defaults, **kwargs}
            n = int(ws.shape[0])
            key = stylegan_key(n, kwargs.get("noise_mode", "const"))
            pad = key[0] - n
            if pad:
                ws = torch.cat([ws, ws[-1:].expand(pad, *ws.shape[1:])])
            call_args: tuple = (ws, *args)
        elif self.kind == "unet":      # a UNet: (batch, latent height, latent width)
            sample = args[0] if args else kwargs.get("sample")
            key = unet_key(sample)
            call_args = args
        else:                          # a text encoder (token ids), a VAE decoder (latents), any module: its input's shape
            first = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            key = tuple(int(s) for s in first.shape) if isinstance(first, torch.Tensor) else ()
            call_args = args
        tr = self.tracker
        if key in tr.failed:
            return self._eager(call_args, kwargs, n)
        first = key not in tr.seen
        if first:
            tr.status(FIRST_RUN_STATUS)
            t0 = time.perf_counter()
            skips0 = _cudagraph_skips() if self.cudagraphs else 0
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            with torch.no_grad():
                out = self.compiled_forward(*call_args, **kwargs)
        except AtelierError:
            raise
        except Exception as exc:
            if not first:
                raise
            # A compiler failure must not cost the artist the image: run eagerly and say so.
            reason = f"torch.compile failed for shape {list(key)} ({_describe(exc)}); ran eagerly"
            tr.failed[key] = reason
            tr.report.setdefault("failures", {})[_key_str(key)] = reason
            tr.status(reason)
            return self._eager(call_args, kwargs, n)
        if first:
            if out is not None and isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.synchronize(out.device)
            ms = (time.perf_counter() - t0) * 1e3
            tr.seen[key] = ms
            tr.report.setdefault("buckets", {})[_key_str(key)] = {"first_call_ms": round(ms, 1)}
            skipped_graphs = _cudagraph_skips() - skips0 if self.cudagraphs else 0
            if skipped_graphs:
                # Inductor quietly runs a graph without CUDA graphs when it cannot capture it (a CPU tensor,
                # an input mutation, a dynamic shape): the report must not claim replays that never happen.
                tr.report.setdefault("cudagraph_skips", {})[_key_str(key)] = (
                    f"{skipped_graphs} compiled graph(s) of this shape run without CUDA graphs; "
                    "TORCH_LOGS=perf_hints names the reason")
            tr.status(f"compiled {_key_str(key)} in {ms / 1e3:.1f} s")
            if self.cache is not None:
                try:
                    saved = self.cache.save_artifacts(self.cache_key)
                    if saved:
                        tr.report["cache_artifacts"] = str(saved)
                except OSError as exc:  # a read-only cache folder only costs the next start a compile
                    tr.report["cache_warning"] = f"could not save compile artifacts: {exc}"
        return self._finish(out, n)

    def _eager(self, args, kwargs, n):
        with torch.no_grad():
            return self._finish(self.eager(*args, **kwargs), n, clone=False)

    def _finish(self, out, n, clone: bool = True):
        if self.kind == "stylegan":
            out = out[:n]
        if self.cudagraphs and clone:
            out = _clone_outputs(out)
        return out


def _cudagraph_skips() -> int:
    """Graphs inductor has declined to capture as CUDA graphs so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _describe(exc: BaseException) -> str:
    """The root cause in one line (dynamo wraps compiler errors in BackendCompilerFailed)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    text = " ".join(str(inner).split())
    return f"{type(inner).__name__}: {text[:200]}"


# StyleGAN2's SynthesisNetwork.forward takes **block_kwargs; these are the ones Generator.forward passes.
_SG2_BLOCK_DEFAULTS = {"noise_mode": "const", "force_fp32": False, "fused_modconv": None, "update_emas": False}


def _keyword_defaults(module: torch.nn.Module) -> dict:
    sig = inspect.signature(module.forward)
    out = {k: p.default for k, p in list(sig.parameters.items())[1:]
           if p.default is not inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()) and hasattr(module, "block_resolutions"):
        out = {**_SG2_BLOCK_DEFAULTS, **out}
    return out


def _clone_outputs(out):
    """Copies of a CUDA-graph replay's outputs (the next replay overwrites them): tensors, tuples of them, and the
    output dataclasses of diffusers and transformers (a text encoder's hidden states included)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return type(out)(_clone_outputs(o) for o in out) if not hasattr(out, "_fields") else \
            type(out)(*(_clone_outputs(o) for o in out))
    if isinstance(out, list):
        return [_clone_outputs(o) for o in out]
    if isinstance(out, dict) and hasattr(out, "to_tuple"):              # a ModelOutput (an ordered dict + attributes)
        for k in list(out.keys()):
            out[k] = _clone_outputs(out[k])
        return out
    if hasattr(out, "sample") and isinstance(out.sample, torch.Tensor):   # diffusers output dataclass
        out.sample = out.sample.clone()
    return out


def stylegan_key(batch: int, noise_mode: str = "const") -> tuple:
    return (batch_bucket(int(batch)), str(noise_mode))


def unet_key(sample: torch.Tensor) -> tuple:
    return tuple(int(s) for s in (sample.shape[0], *sample.shape[2:]))


def _key_str(key: tuple) -> str:
    return "x".join(str(k) for k in key)


def _find_trackers(obj: Any) -> list[BucketTracker]:
    """The trackers of everything compiled in `obj`: the UNet (or synthesis network) first, then a pipeline's
    text encoders and VAE decoder."""
    cands = [obj]
    if not isinstance(obj, torch.nn.Module):
        vae = getattr(obj, "vae", None)
        cands += [getattr(obj, "unet", None), getattr(obj, "text_encoder", None), getattr(obj, "text_encoder_2", None),
                  getattr(vae, "decoder", None) if vae is not None else None]
    elif hasattr(obj, "synthesis"):
        cands.append(obj.synthesis)
    out: list[BucketTracker] = []
    for c in cands:
        tr = getattr(c, _TRACKER_ATTR, None) if c is not None else None
        if isinstance(tr, BucketTracker) and tr not in out:
            out.append(tr)
    return out


def _find_tracker(obj: Any) -> BucketTracker | None:
    found = _find_trackers(obj)
    return found[0] if found else None


def is_first_run(obj: Any, shape_key) -> bool:
    """True when the next call at this shape will compile (the UI then says FIRST_RUN_STATUS).

    `obj`: what prepare returned (generator, pipeline, UNet). `shape_key`: for StyleGAN the
    batch size (int) or (batch, noise_mode); for diffusion (unet_batch, latent_h, latent_w),
    where unet_batch counts both halves of classifier-free guidance.
    False when nothing is compiled.
    """
    tr = _find_tracker(obj)
    if tr is None:
        return False
    if isinstance(shape_key, int):
        key = stylegan_key(shape_key)
    elif len(shape_key) == 2 and isinstance(shape_key[1], str):
        key = stylegan_key(*shape_key)
    else:
        key = tuple(int(k) for k in shape_key)
    return key not in tr.seen and key not in tr.failed


def set_status_callback(obj: Any, fn: Callable[[str], None] | None) -> bool:
    """Route compile status messages (FIRST_RUN_STATUS, "compiled ...") to `fn` (e.g. the job's
    progress message). Returns False when nothing is compiled."""
    trackers = _find_trackers(obj)
    for tr in trackers:
        tr.on_status = fn
    return bool(trackers)


# ---------------------------------------------------------------------------------------------
# The toggle


def compile_module(module: torch.nn.Module, kind: str, mode: str, device: torch.device, report: dict,
                   cache: CompileCache | None = None, cache_key: str = "", backend: str = "inductor",
                   on_status: Callable[[str], None] | None = None,
                   inductor_options: dict | None = None) -> torch.nn.Module:
    """torch.compile `module` (a StyleGAN synthesis network or a UNet) behind the bucketing call.

    `inductor_options`: inductor config for this module only; torch.compile takes a mode or options, so
    reduce-overhead is then spelled as its one option, `triton.cudagraphs`."""
    cudagraphs = mode == "reduce-overhead" and device.type == "cuda"
    if inductor_options and backend == "inductor":
        opts = dict(inductor_options, **({"triton.cudagraphs": True} if cudagraphs else {}))
        report["inductor_options"] = dict(inductor_options)

        def make() -> torch.nn.Module:
            return torch.compile(module, options=opts, dynamic=False, backend=backend, fullgraph=False)
    else:
        def make() -> torch.nn.Module:
            return torch.compile(module, mode=mode if cudagraphs else "default", dynamic=False,
                                 backend=backend, fullgraph=False)
    tracker = BucketTracker(report, on_status)
    wrapper = _deferred_wrapper(module)
    wrapper.forward = _BucketedCall(_DeferredCompile(make, cache, report), module, tracker, kind, cudagraphs, cache,
                                    cache_key)
    object.__setattr__(module, _TRACKER_ATTR, tracker)   # found through the wrapper's __getattr__ too
    return wrapper


def _deferred_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    """The OptimizedModule that stands where `module` stood (attributes, parameters and `_orig_mod` as
    torch.compile's own wrapper has them, so diffusers and transformers see a compiled module), made without
    torch.compile: its forward is replaced by the caller, and the compile happens at the first call."""
    from torch._dynamo.eval_frame import DisableContext, OptimizedModule

    return OptimizedModule(module, DisableContext())


class _DeferredCompile:
    """`torch.compile(module)`'s forward, made at the first call.

    torch.compile imports inductor's compiler (`torch._inductor.compile_fx`, lowering, templates) when it is
    called, before anything is traced: 2.56 s of a second start's 13.7 s on the H200 (2026-12-05, the
    `compile` toggle's row in prepare_toggles_s) when AOT packages served every part and the compiled modules
    were never called. Deferred, a start pays for the compiler only when a compiled part runs; the compile
    cache's portable artifacts are loaded then too (`cache_artifacts_loaded` in the report)."""

    def __init__(self, make: Callable[[], torch.nn.Module], cache: CompileCache | None, report: dict):
        self.make, self.cache, self.report = make, cache, report
        self.forward: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self.forward is None:
            if self.cache is not None:
                self.report["cache_artifacts_loaded"] = self.report.get("cache_artifacts_loaded", 0) + \
                    self.cache.activate()
            self.compiled = self.make()          # kept: its forward is dynamo's frame wrapper around the module
            self.forward = self.compiled.forward
        return self.forward(*args, **kwargs)

    @property
    def made(self) -> bool:
        return self.forward is not None


def _stylegan_options(synthesis: torch.nn.Module) -> dict | None:
    """StyleGAN3: no inductor layout optimization. Inductor otherwise hands the convolutions' outputs on
    as channels_last, and the fused filtered_lrelu kernel reads NCHW tiles, so every call would add a
    layout copy (1.2 ms of the compiled SG3-T-1024's 11.1 ms on the H200, 2026-12-02).

    ATELIER_INDUCTOR_FREEZING=1 (an A/B switch, not yet measured): inductor's `freezing`, which treats the
    parameters as constants in inference and computes once what depends on them alone (weight gains,
    FIR folds, subpixel phases: with `--kernels ...modconv:activations` that is every weight transform)."""
    opts = {}
    if type(synthesis).__module__.endswith("stylegan3"):
        opts["layout_optimization"] = False
    if os.environ.get("ATELIER_INDUCTOR_FREEZING") == "1":
        opts["freezing"] = True
    return opts or None


# Inductor's kernel tuning for the diffusion parts, an A/B switch for the H200 (not the default until measured):
# "coordinate" = coordinate-descent tuning of every generated (pointwise, reduction, norm) kernel's launch
# config, all directions, and 1x1 convolutions as matrix products (what PyTorch's "Diffusion, fast" SDXL recipe
# sets); "max-autotune" = that plus GEMM/convolution template autotuning against cuBLAS/cuDNN. Both lengthen
# the first compile (minutes for SDXL); the compile cache keeps the choices for later starts.
TUNING_ENV = "ATELIER_INDUCTOR_TUNING"
TUNINGS = ("off", "coordinate", "max-autotune")


def diffusion_tuning() -> str:
    raw = os.environ.get(TUNING_ENV, "").strip().lower() or "off"
    if raw not in TUNINGS:
        raise AtelierError(f"{TUNING_ENV} must be one of {', '.join(TUNINGS)}; got {raw!r}")
    return raw


def _diffusion_options() -> dict | None:
    """The inductor options of the diffusion parts under ATELIER_INDUCTOR_TUNING, or None (inductor's defaults)."""
    tuning = diffusion_tuning()
    if tuning == "off":
        return None
    opts = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
            "conv_1x1_as_mm": True}
    if tuning == "max-autotune":
        opts["max_autotune"] = True
    return opts


def _cache_key(target: Target, flags: OptimizationFlags, ctx: Context, component: torch.nn.Module) -> str:
    """Names the artifacts file. Every flag that changes the traced graph is in it (FP8, pruning, layout,
    attention...): two configurations of one model must not overwrite each other's file, or the next
    start of the other one compiles from scratch again."""
    ident = ctx.weights_hash or ",".join(f"{tuple(p.shape)}" for p in list(component.parameters())[:64])
    graph_flags = json.dumps({k: v for k, v in flags.to_dict().items() if k != "strict"}, sort_keys=True)
    tuning = diffusion_tuning() if target.kind == "diffusion" else "off"
    raw = f"{target.kind}|{graph_flags}|{capability(ctx.device)}|{type(component).__name__}|{ident}"
    if tuning != "off":                      # another tuning is another artifact (keys of untuned parts unchanged)
        raw += f"|tuning={tuning}"
    from optim.attention import sdpa_routes

    routes = sdpa_routes() if target.kind == "diffusion" else {}
    if routes:                               # routed attention traces other SDPA kernels
        raw += "|sdpa=" + ",".join(f"{p}={'/'.join(b)}" for p, b in sorted(routes.items()))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def apply(target: Target, flags: OptimizationFlags, ctx: Context, backend: str = "inductor",
          exclude: dict[str, str] | None = None, request_graph: bool = False) -> ToggleReport:
    """`exclude`: component -> reason it is served by something else (a TensorRT engine).
    `request_graph`: the pipeline records whole requests as CUDA graphs (optim/request_graph.py), so the
    modules are compiled without CUDA graphs of their own (a graph cannot be recorded inside another)."""
    mode = flags.compile
    reason = unavailable_reason(ctx.device) if backend == "inductor" else None
    if reason:
        return skipped(reason, mode=mode)
    if ctx.offloaded:
        return skipped("torch.compile is not combined with model CPU offload here (weights move every step); "
                       "turn off cpu-offload to compile", mode=mode)
    name = "generator" if target.kind == "stylegan" else "unet"
    if exclude and name in exclude:
        return skipped(exclude[name], mode=mode)
    cache = CompileCache(ctx.cache_dir)
    if backend == "inductor":
        configure_process(cache.dir.parent)   # inductor's folders and dynamo's limits (cheap); artifacts load at the first call
    effective = mode if (mode != "reduce-overhead" or ctx.device.type == "cuda") else "default"
    details: dict = {"mode": effective, "backend": backend, "dynamic": False, "cache_dir": str(cache.dir),
                     "cache_artifacts_loaded": 0, "buckets": {}}
    if backend == "inductor":         # process-wide (configure_process): may be another root's folder
        details["kernel_cache_dir"] = str(process_compile_dir())
    if effective != mode:
        details["note"] = "CUDA graphs (reduce-overhead) need a CUDA GPU; compiled in default mode"
    if request_graph and effective == "reduce-overhead":
        effective = "default"
        details["mode"] = effective
        details["note"] = ("compiled without per-module CUDA graphs: the request graph records the compiled kernels "
                           "of a whole request instead")
    rep = applied("", **details)
    if target.kind == "stylegan":
        G = target.root
        syn = G.synthesis
        key = _cache_key(target, flags, ctx, syn)
        G.synthesis = compile_module(syn, "stylegan", effective, ctx.device, rep, cache if backend == "inductor" else None,
                                     key, backend, ctx.on_status, inductor_options=_stylegan_options(syn))
        rep.update(component="synthesis", batch_buckets=list(BATCH_BUCKETS),
                   reason="synthesis network compiled; batches padded to the next bucket, each bucket compiles once "
                          "(first run for a size takes a while, later runs reuse it)")
    else:
        unet = target.get("unet")
        key = _cache_key(target, flags, ctx, unet)
        target.set("unet", compile_module(unet, "unet", effective, ctx.device, rep,
                                          cache if backend == "inductor" else None, key, backend, ctx.on_status,
                                          inductor_options=_diffusion_options()))
        rep.update(component="unet",
                   reason="UNet compiled; each resolution and batch compiles once (first run for a size takes a while)")
        if diffusion_tuning() != "off":
            rep["tuning"] = diffusion_tuning()
        others = _compile_other_parts(target, flags, ctx, effective, rep, cache if backend == "inductor" else None,
                                      backend, exclude or {})
        if others:
            rep["reason"] = rep["reason"].replace("UNet compiled", "UNet, " + ", ".join(others) + " compiled")
    if effective == "reduce-overhead":
        rep["reason"] += "; CUDA graphs replay each step with one launch"
    elif request_graph:
        rep["reason"] += "; the request graph replays them with one launch per request"
    return rep


# The parts of a diffusion pipeline besides the UNet that run once per image: eagerly they are launch-bound
# (a CLIP text encoder is ~300 small kernels; the VAE decoder 30 GroupNorms at 512²), so they are compiled
# too, each with its own shape buckets. ATELIER_COMPILE_PARTS (comma-separated, of unet,text_encoder,vae)
# narrows this for measurements; the UNet is always compiled.
OTHER_PARTS = ("text_encoder", "vae")


def compiled_parts() -> tuple[str, ...]:
    raw = os.environ.get("ATELIER_COMPILE_PARTS", "").strip()
    if not raw:
        return OTHER_PARTS
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    unknown = sorted(set(names) - set(OTHER_PARTS) - {"unet"})
    if unknown:
        raise AtelierError(f"ATELIER_COMPILE_PARTS: unknown part(s) {', '.join(unknown)}; "
                           f"use a comma-separated list of unet, {', '.join(OTHER_PARTS)}")
    return tuple(n for n in OTHER_PARTS if n in names)


def _compile_other_parts(target: Target, flags: OptimizationFlags, ctx: Context, mode: str, rep: dict,
                         cache: CompileCache | None, backend: str, exclude: dict[str, str]) -> list[str]:
    """Compile the text encoder(s) and the VAE decoder of a pipeline; returns the names compiled. Each part's
    buckets and failures are reported under rep["parts"][name]."""
    if not target.is_pipeline:
        return []
    wanted = compiled_parts()
    parts_rep: dict = rep.setdefault("parts", {})
    done: list[str] = []
    if "text_encoder" in wanted:
        for name in ("text_encoder", "text_encoder_2"):
            te = target.get(name)
            if te is None:
                continue
            if name in exclude:
                parts_rep[name] = {"applied": False, "reason": exclude[name]}
                continue
            sub: dict = {"applied": True}
            key = _cache_key(target, flags, ctx, te)
            target.set(name, compile_module(te, "module", mode, ctx.device, sub, cache, key, backend, ctx.on_status,
                                            inductor_options=_diffusion_options()))
            parts_rep[name] = sub
            done.append(name)
    # The VAE's decoder, and the tiny autoencoder's when that toggle decodes instead (one fixed shape per
    # resolution, ~1 M parameters in 30-odd small convolutions: launch-bound when eager). Both are part "vae".
    from optim import tiny_vae

    vae = target.get("vae")
    decoders = [("vae_decoder", "VAE decoder", vae if vae is not None and hasattr(vae, "decoder") else None),
                ("tiny_vae_decoder", "tiny VAE decoder", tiny_vae.get(target.pipe))]
    for rep_name, label, owner in decoders:
        if "vae" not in wanted or owner is None:
            continue
        if owner is vae and "vae-tiling" in flags.memory:
            parts_rep[rep_name] = {"applied": False, "reason": "VAE tiling decodes tiles of several shapes (each "
                                                               "would compile); the decoder runs eagerly"}
        elif owner is vae and "vae" in exclude:
            parts_rep[rep_name] = {"applied": False, "reason": exclude["vae"]}
        else:
            sub = {"applied": True}
            key = _cache_key(target, flags, ctx, owner.decoder)
            owner.decoder = compile_module(owner.decoder, "module", mode, ctx.device, sub, cache, key, backend,
                                           ctx.on_status, inductor_options=_diffusion_options())
            parts_rep[rep_name] = sub
            done.append(label)
    return done
