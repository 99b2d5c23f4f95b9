"""Ahead-of-time compiled parts for the request graph: a second start without dynamo tracing.

On the H200 a second start of SD1.5 `best` with a warm compile cache still took 17.8 s to its first image
(2026-12-01): the cache spares inductor's code generation, but dynamo traces the UNet, the text encoder and the
VAE decoder again in every new process (11.0 + 3.9 + 1.9 s). A request graph needs none of dynamo's
machinery after recording (its replays run the recorded kernels), so its three parts can come from
AOTInductor instead: `torch.export` + `torch._inductor.aoti_compile_and_package` once per part and shape,
saved under the cache folder; a later start loads the package (a shared library and its kernels) and
records the graph, with no tracing.

The packages hold no weights (`aot_inductor.package_constants_in_so=False`): after loading, the model's
own parameters are handed over with `load_constants(..., user_managed=True)`, so nothing is copied and a
package never disagrees with the weights in memory (its key has the weights' hash too).

`ATELIER_REQUEST_GRAPH_AOT`:
- `auto` (the default): a part whose package is in the cache is loaded from it; none is built. Without
  packages nothing changes, so a start never pays for building them unasked.
- `1`: missing packages are exported and compiled on the first request of a shape (a first start of SD1.5
  took 220 s to its first image on the H200, against a 54 s first call without them), then loaded on every
  later start (its first call: 3.1 s). Build them once where the cache persists, e.g. with one
  `ATELIER_REQUEST_GRAPH_AOT=1 python app.py generate ... --request-graph` per model and size.
- `0`: never used.
If exporting or compiling a part fails (reported), the torch.compile'd / eager part is used.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ENV = "ATELIER_REQUEST_GRAPH_AOT"


MODES = ("auto", "1", "0")


def mode() -> str:
    """'auto' (load packages the cache has), '1' (build missing ones too) or '0' (off); see the module doc."""
    raw = os.environ.get(ENV, "").strip().lower() or "auto"
    return {"on": "1", "true": "1", "yes": "1", "off": "0", "false": "0", "no": "0"}.get(raw, raw)


def enabled() -> bool:
    """Whether AOT parts may serve at all (mode 'auto' or '1'). An unknown value turns them off, and the
    request graph's report says so (`aot_note`)."""
    return mode() in ("auto", "1")


AUTO_NOTE = ("AOT parts: loaded from the cache when it has them (none built unasked); "
             f"{ENV}=1 builds them on the first request of a shape")


def _eager(module: Any) -> torch.nn.Module:
    """The module under a torch.compile wrapper (its `_orig_mod`), or the module itself."""
    return getattr(module, "_orig_mod", module)


class _TextEncoder(torch.nn.Module):
    def __init__(self, te):
        super().__init__()
        self.te = te

    def forward(self, ids):
        return self.te(ids, attention_mask=None)[0]


class _UNet(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, emb):
        return self.unet(x, t, encoder_hidden_states=emb, timestep_cond=None, cross_attention_kwargs=None,
                         added_cond_kwargs=None, return_dict=False)[0]


class _Decoder(torch.nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, z):
        return self.decoder(z)


class _Loaded(torch.nn.Module):
    """An AOTInductor package called like the module it was exported from (positional tensors in, a tensor out)."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        out = self.compiled(*args)
        return out[0] if isinstance(out, (list, tuple)) else out


def _load(path: Path, device: torch.device) -> tuple[Any, str]:
    """An AOTInductor package, loaded (second value: which loader).

    A CUDA package is opened with AOTInductor's own loader class. `aoti_load_package` first collects "device
    information" for an advisory mismatch warning, and that includes the host CPU's vector ISA, which inductor
    finds by compiling test programs with the C++ compiler: on the H200 machine the first load in a process
    took 41-49 s, of a second start's 61 s (docs/benchmarks/runs/2026-12-04-a-69790b0-sd15-aot-warm.jsonl;
    pytorch/pytorch#191715). The ISA means nothing to a CUDA package's kernels, and nothing is checked on a
    mismatch anyway. A CPU package's code is built for the ISA, so CPU packages keep the public path."""
    if device.type == "cuda":
        try:
            from torch._inductor.package.package import AOTICompiledModel

            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, -1)
            return AOTICompiledModel(loader), "direct"
        except (ImportError, AttributeError, TypeError):    # another torch's loader signature: the public path
            pass
    # run_single_threaded: without it every call after the first asks the CUDA driver whether the last
    # one finished (cudaEventQuery on the container's own event), which is illegal while the request
    # graph records: "operation not permitted when stream is capturing" (H200, 2026-12-03)
    return torch._inductor.aoti_load_package(str(path), run_single_threaded=True), "aoti_load_package"


def _signature(args: tuple) -> list:
    return [[list(a.shape), str(a.dtype), str(a.device), list(a.stride())] for a in args]


def _key(kind: str, wrapper: torch.nn.Module, args: tuple, ident: str, flags_json: str) -> str:
    cap = torch.cuda.get_device_capability(args[0].device) if args[0].is_cuda else None
    raw = json.dumps([kind, ident, flags_json, _signature(args), torch.__version__, cap,
                      type(next(iter(wrapper.children()))).__name__], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


class AotParts:
    """The AOT-compiled text encoder, UNet and VAE decoder of one pipeline, by input signature.

    `report` (the request graph's report) gets, per part and shape, whether it was compiled (and how long
    it took) or loaded from the cache, or why it failed."""

    def __init__(self, cache_dir: Path, ident: str, flags_json: str, report: dict, build: bool | None = None):
        self.dir = Path(cache_dir) / "aoti"
        self.ident = ident
        self.flags_json = flags_json
        self.report = report
        self.build = (mode() == "1") if build is None else bool(build)   # False: load what the cache has, build nothing
        self._parts: dict[str, Callable] = {}

    def _get(self, kind: str, wrapper: torch.nn.Module, args: tuple) -> Callable | None:
        key = f"{kind}-{_key(kind, wrapper, args, self.ident, self.flags_json)}"
        if key in self._parts:
            return self._parts[key]
        path = self.dir / f"{key}.pt2"
        if not self.build and not path.is_file():      # auto: the torch.compile'd / eager part, as without AOT
            self.report.setdefault("aot_note", AUTO_NOTE)
            self._parts[key] = None
            return None
        entry: dict = {}
        self.report.setdefault("aot", {})[f"{kind} {'x'.join(str(s) for s in args[0].shape)}"] = entry
        t0 = time.perf_counter()
        try:
            wrapper.eval()
            if not path.is_file():
                with torch.no_grad():
                    ep = torch.export.export(wrapper, args, strict=False)
                self.dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
                torch._inductor.aoti_compile_and_package(
                    ep, package_path=str(tmp), inductor_configs={"aot_inductor.package_constants_in_so": False})
                os.replace(tmp, path)               # a half-written package is never loaded
                entry["compiled_s"] = round(time.perf_counter() - t0, 2)
            else:
                entry["loaded_from_cache"] = True
            t1 = time.perf_counter()
            compiled, entry["loader"] = _load(path, args[0].device)
            wanted = set(compiled.get_constant_fqns())
            # parameters and every buffer, non-persistent ones too (CLIP's position ids are not in a state dict);
            # check_full_update: a constant left unset is an error here, not a crash in the first call
            named = dict(wrapper.named_parameters(remove_duplicate=False))
            named.update(wrapper.named_buffers(remove_duplicate=False))
            state = {k: v.detach() for k, v in named.items() if k in wanted}
            compiled.load_constants(state, check_full_update=True, user_managed=True)
            entry["load_s"] = round(time.perf_counter() - t1, 3)
        except Exception as exc:          # the compiled / eager part serves instead; the report says why
            entry["failed"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"
            self._parts[key] = None
            return None
        part = _Loaded(compiled)
        self._parts[key] = part
        return part

    def serves_all(self, kinds: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")) -> bool:
        """True when a package serves every one of `kinds` (no dynamo, no eager fallback in the request)."""
        served = {key.split("-", 1)[0] for key, part in self._parts.items() if part is not None}
        return set(kinds) <= served

    # -- what the recorded request calls ------------------------------------------------------------------
    def text_encoder(self, te, ids: torch.Tensor) -> Callable | None:
        return self._get("text_encoder", _TextEncoder(_eager(te)), (ids,))

    def unet(self, unet, x: torch.Tensor, t: torch.Tensor, emb: torch.Tensor) -> Callable | None:
        return self._get("unet", _UNet(_eager(unet)), (x, t, emb))


class _LazyDecoder(torch.nn.Module):
    """Stands in for `vae.decoder` while a request is recorded: the AOT part for the latents' shape (built
    on first use), or the original decoder when there is none."""

    def __init__(self, parts: AotParts, original):
        super().__init__()
        self.parts = parts
        self.original = original

    def forward(self, z):
        part = self.parts._get("vae_decoder", _Decoder(_eager(self.original)), (z,))
        return part(z) if part is not None else self.original(z)


@contextlib.contextmanager
def swapped_decoder(vae, parts: AotParts | None) -> Iterator[None]:
    """`vae.decoder` served by `parts` for the block (diffusers' decode calls it inside AutoencoderKL)."""
    if parts is None:
        yield
        return
    original = vae.decoder
    vae.decoder = _LazyDecoder(parts, original)
    try:
        yield
    finally:
        vae.decoder = original
