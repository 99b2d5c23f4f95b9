"""One CUDA graph per request: prompt ids → text encoder → UNet × steps (with CFG) → scheduler → VAE → 8-bit image.

Why: SD-Turbo's 1-step image is ~13.5 ms of GPU work, but a request through diffusers' `__call__` with per-module
CUDA graphs took 20.9 ms on the H200 (2026-12-01): three compiled modules' guard checks and graph replays,
diffusers' bookkeeping and the scheduler's Python ran on the critical path between the kernels. Here the whole
request is recorded once per shape and replayed with one launch: the host writes the token ids, the seeded noise
and the guidance scale into static input buffers, replays, waits once and reads a pinned 8-bit image.

What it mirrors: `StableDiffusionPipeline.__call__` for text-to-image (diffusers 0.42), op for op: the same
tokenization, prompt-embedding dtype and repeat, the initial noise drawn in float32 from the request's CPU
generators (as `pipelines.diffusion_noise` draws it on the normal path) and scaled by the scheduler's
`init_noise_sigma`, the scheduler's own `scale_model_input` / `step`, classifier-free guidance, the VAE decode and
the image processor's denormalisation. So a seed gives the same picture on both paths (tested on the CPU, where
the same function runs without capture, and on the GPU against the normal path).

What it serves (anything else runs the normal path, and the report says why): text-to-image with the SD
1.x/2.x family (SD-Turbo included) and SDXL (its two text encoders, pooled embedding, size conditioning and
empty-negative zeros as `StableDiffusionXLPipeline.__call__` makes them; bf16, not fp16 whose VAE decode
casts weights per request); deterministic schedulers (their step draws no noise that is used: Euler,
DDIM, DPM++ 2M, UniPC, Heun, LMS, PLMS); no safety checker, no live previews, no LCM-style guidance embedding,
no attention-masked text encoder, no CPU offload / VAE tiling / TensorRT. Progress jumps from 0 to N steps (a
50-step SD 1.5 image takes ~0.35 s on the H200), and a cancel is honoured before the replay, not during it.

Scheduler arithmetic (sigmas, alphas: host tables, `pipelines.overlap.host_timesteps`) is read on the host while
recording and baked into the graph as kernel arguments; the UNet gets its timesteps as device tensors made
before recording, so nothing in the graph reads pageable host memory.
"""
from __future__ import annotations

import inspect
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Scheduler classes whose step is deterministic (any noise they draw is multiplied by zero at eta = 0 / s_churn = 0).
DETERMINISTIC = frozenset({"EulerDiscreteScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler",
                           "UniPCMultistepScheduler", "HeunDiscreteScheduler", "LMSDiscreteScheduler",
                           "PNDMScheduler"})
# cuDNN's algorithm benchmark while a request is recorded: "0" (default) or "1". It runs again in every new
# process (nothing persists it) and bought nothing on the H200: SD1.5 best-graph 339.4 ms with it against 335.9
# without, 1 s more to the first image (docs/benchmarks/runs/2026-12-04-a-69790b0-sd15-aot-warm*.jsonl);
# SD-Turbo picked other tiles at the same device time (2026-12-03-b-8c96da0-turbo-graph.jsonl).
RECORD_CUDNN_BENCHMARK_ENV = "ATELIER_RECORD_CUDNN_BENCHMARK"


def cudnn_benchmark_when_recording() -> bool:
    return os.environ.get(RECORD_CUDNN_BENCHMARK_ENV, "0").strip() == "1"


# A first request whose parts are all AOT packages is served by record()'s first pass, run whole, and the graph
# is captured on the shape's next request: "1" (default) or "0" (warm-up pass, capture and replay in the first call).
DEFER_CAPTURE_ENV = "ATELIER_DEFER_CAPTURE"


def defer_capture() -> bool:
    return os.environ.get(DEFER_CAPTURE_ENV, "1").strip() != "0"


MAX_GRAPHS = 4          # shapes kept recorded (each holds its activations' memory pool); least recently used goes


def scheduler_reason(scheduler: Any) -> str | None:
    """Why `scheduler` cannot be recorded into a graph, or None."""
    name = type(scheduler).__name__
    if name not in DETERMINISTIC:
        return f"{name} draws fresh noise every step (ancestral/SDE/LCM sampling)"
    algo = str(getattr(scheduler, "config", {}).get("algorithm_type", ""))
    if "sde" in algo:
        return f"{name} with algorithm {algo} draws fresh noise every step"
    for key in ("s_churn", "eta"):
        if float(getattr(scheduler, "config", {}).get(key, 0.0) or 0.0) > 0:
            return f"{name} with {key} > 0 draws fresh noise every step"
    return None


@dataclass(frozen=True)
class GraphKey:
    batch: int
    height: int
    width: int
    steps: int
    scheduler: str
    cfg: bool
    zero_negative: bool = False     # SDXL: an empty negative prompt is zero embeddings (force_zeros_for_empty_prompt)


class RecordedRequest:
    """Static buffers and (on CUDA) the recorded graph of one request shape.

    `capture=False` runs the same function eagerly on every call, through the same static buffers: the CPU
    tests use it to check the function against diffusers' pipeline call."""

    def __init__(self, key: GraphKey, view: Any, scheduler: Any, device: torch.device,
                 vae_decode: Callable[[Any, torch.Tensor], torch.Tensor], runtime: Callable[[], Any],
                 capture: bool, aot: Any = None):
        self.key = key
        self.view = view
        self.scheduler = scheduler
        self.device = device
        self.vae_decode = vae_decode
        self.runtime = runtime
        self.capture = capture and device.type == "cuda"
        unet = view.unet
        scale = int(getattr(view, "vae_scale_factor", 8))
        self.latent_shape = (key.batch, int(unet.config.in_channels), key.height // scale, key.width // scale)
        self.xl = getattr(view, "text_encoder_2", None) is not None
        toks = [view.tokenizer] + ([view.tokenizer_2] if self.xl else [])
        n_tok = max(int(t.model_max_length) for t in toks)
        rows = 4 if self.xl else 2          # (prompt, negative) per tokenizer
        pin = self.capture
        self.ids_host = torch.zeros((rows, n_tok), dtype=torch.long, pin_memory=pin)
        self.noise_host = torch.zeros(self.latent_shape, dtype=torch.float32, pin_memory=pin)
        self.guidance_host = torch.zeros((), dtype=torch.float32, pin_memory=pin)
        self.ids = torch.zeros((rows, n_tok), dtype=torch.long, device=device)
        self._time_ids = None
        if self.xl:       # SDXL's size conditioning: (original size, crop top-left, target size), as diffusers builds it
            dtype = view.text_encoder_2.dtype
            self._time_ids = torch.tensor([[key.height, key.width, 0, 0, key.height, key.width]], dtype=dtype).to(device)
        self.noise = torch.zeros(self.latent_shape, dtype=torch.float32, device=device)
        self.guidance = torch.zeros((), dtype=torch.float32, device=device)
        out_shape = (key.batch, key.height, key.width, 3)
        self.u8_host = torch.zeros(out_shape, dtype=torch.uint8, pin_memory=pin)
        self.raw_host = torch.zeros((key.batch, 3, key.height, key.width), dtype=torch.float32, pin_memory=pin)
        self.finite_host = torch.zeros((), dtype=torch.bool, pin_memory=pin)
        self.scheduler.set_timesteps(key.steps, device="cpu")
        self._t_host = list(self.scheduler.timesteps)
        self._t_dev = [t.to(device) for t in self._t_host]       # before recording: no host reads inside the graph
        params = inspect.signature(self.scheduler.step).parameters
        self._step_kwargs = {"eta": 0.0} if "eta" in params else {}
        self.aot = aot                    # pipelines.aot_parts.AotParts: the parts ahead-of-time compiled, or None
        self.record_s: dict = {}          # seconds of each warm-up pass and of the capture (record())
        self.graph: Any = None
        self.replays = 0
        # the first pass (record()) ran this whole request on the AOT parts: run() hands its picture over once,
        # and the graph is captured on the shape's next request (defer_capture)
        self._served = False
        self._whole_pass = False

    # -- inputs ----------------------------------------------------------------------------------------
    def load(self, ids_pos, ids_neg, noise: torch.Tensor, guidance: float) -> None:
        """Write one request's inputs into the static buffers (host staging, then one copy each). `ids_pos` /
        `ids_neg`: the token ids, or for SDXL a pair (first tokenizer's, second's); `ids_neg` None without CFG."""
        self._served = False            # new inputs: the first pass's picture is not theirs
        pos = ids_pos if isinstance(ids_pos, (tuple, list)) else (ids_pos,)
        neg = ids_neg if isinstance(ids_neg, (tuple, list)) else (ids_neg,)
        for i, ids in enumerate(pos):
            self.ids_host[2 * i].copy_(ids.reshape(-1))
        for i, ids in enumerate(neg):
            if ids is not None:
                self.ids_host[2 * i + 1].copy_(ids.reshape(-1))
        self.noise_host.copy_(noise)
        self.guidance_host.fill_(float(guidance))
        nb = self.capture
        self.ids.copy_(self.ids_host, non_blocking=nb)
        self.noise.copy_(self.noise_host, non_blocking=nb)
        self.guidance.copy_(self.guidance_host, non_blocking=nb)

    # -- the request, op for op as diffusers' text-to-image call ------------------------------------------
    def _embed(self, row: int) -> torch.Tensor:
        te = self.view.text_encoder
        ids = self.ids[row:row + 1]
        part = self.aot.text_encoder(te, ids) if self.aot is not None else None
        emb = part(ids) if part is not None else te(ids, attention_mask=None)[0]
        emb = emb.to(dtype=te.dtype, device=self.device)
        b = self.key.batch
        return emb.repeat(1, b, 1).view(b, emb.shape[1], -1)

    def _encode_xl(self, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """SDXL's encode_prompt for one prompt: both encoders' penultimate hidden states side by side, and the
        pooled embedding (the first 2-D output, the second encoder's projection)."""
        embs, pooled = [], None
        for te, row in ((self.view.text_encoder, rows[0]), (self.view.text_encoder_2, rows[1])):
            out = te(self.ids[row:row + 1], output_hidden_states=True)
            if pooled is None and out[0].ndim == 2:
                pooled = out[0]
            embs.append(out.hidden_states[-2])
        return torch.concat(embs, dim=-1), pooled

    def _prompt_xl(self) -> tuple[torch.Tensor, dict]:
        key, b = self.key, self.key.batch
        dtype = self.view.text_encoder_2.dtype
        pe, pooled = self._encode_xl((0, 2))

        def batch(e, p):
            e = e.to(dtype=dtype, device=self.device)
            return e.repeat(1, b, 1).view(b, e.shape[1], -1), p.repeat(1, b).view(b, -1)

        pe, pooled = batch(pe, pooled)
        time_ids = self._time_ids
        if key.cfg:
            if key.zero_negative:
                ne, npooled = torch.zeros_like(pe), torch.zeros_like(pooled)
            else:
                ne, npooled = batch(*self._encode_xl((1, 3)))
            pe, pooled = torch.cat([ne, pe]), torch.cat([npooled, pooled])
            time_ids = torch.cat([time_ids, time_ids])
        return pe, {"text_embeds": pooled, "time_ids": time_ids.repeat(b, 1)}

    def _forward(self, unet_calls: int | None = None, stages: dict | None = None, whole_if_aot: bool = False) -> None:
        """The request, on the static buffers. `unet_calls` (a warm-up pass) stops the denoising loop after that
        many UNet calls and goes on to the decode, so the pass meets every kernel of the full request sooner;
        with `whole_if_aot` it runs every step anyway once AOT packages serve the text encoder and the UNet (nothing
        compiles, and the pass's picture can serve the request: `_whole_pass` says whether it did).
        `stages` (a warm-up pass, never a capture) gets the seconds of each stage, the device synchronized at
        each boundary: text encoding, the first UNet call (with its scheduler step), the other UNet calls, the
        decode with its copies out; a second start's first call is mostly these first runs."""
        t_last = [time.perf_counter()]

        def stage(name: str) -> None:
            if stages is None:
                return
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            now = time.perf_counter()
            stages[name] = round(stages.get(name, 0.0) + now - t_last[0], 4)
            t_last[0] = now

        key, sched, unet = self.key, self.scheduler, self.view.unet
        sched.set_timesteps(key.steps, device="cpu")            # resets the scheduler's per-run state
        if self.xl:
            embeds, added = self._prompt_xl()
        else:
            pos = self._embed(0)
            embeds, added = (torch.cat([self._embed(1), pos]) if key.cfg else pos), None
        latents = self.noise.to(embeds.dtype) * sched.init_noise_sigma
        stage("text")
        whole, done = unet_calls is None, 0
        for n, (t_host, t_dev) in enumerate(zip(sched.timesteps, self._t_dev)):
            if not whole and n >= unet_calls:
                break
            x = torch.cat([latents] * 2) if key.cfg else latents
            x = sched.scale_model_input(x, t_host)
            part = self.aot.unet(unet, x, t_dev, embeds) if (self.aot is not None and not self.xl) else None
            if part is not None:
                # the text encoder has been asked for its package by now (the decoder's comes after the loop): a
                # pass whose picture cannot serve the request anyway (warmup_passes 2) stops at the warm-up's calls
                whole = whole or (whole_if_aot and self.aot.serves_all(("text_encoder", "unet")))
                pred = part(x, t_dev, embeds)
            else:
                pred = unet(x, t_dev, encoder_hidden_states=embeds, timestep_cond=None, cross_attention_kwargs=None,
                            added_cond_kwargs=added, return_dict=False)[0]
            if key.cfg:
                uncond, text = pred.chunk(2)
                pred = uncond + self.guidance * (text - uncond)
            latents = sched.step(pred, t_host, latents, **self._step_kwargs, return_dict=False)[0]
            done = n + 1
            if n == 0:
                stage("unet_first")
        if done > 1:            # one synchronization for the rest of the loop: the launches overlap the device
            stage("unet_rest")
        self._whole_pass = done == len(self._t_dev)
        from pipelines import aot_parts

        with aot_parts.swapped_decoder(self.view.vae, None if self.xl else self.aot):
            image = self.vae_decode(self.view, latents)
        pt = self.view.image_processor.postprocess(image, output_type="pt",
                                                   do_denormalize=[True] * image.shape[0]).detach().float()
        u8 = (pt * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        nb = self.capture
        self.finite_host.copy_(torch.isfinite(image).all(), non_blocking=nb)
        self.u8_host.copy_(u8, non_blocking=nb)
        self.raw_host.copy_(pt, non_blocking=nb)
        stage("decode")

    def record(self) -> None:
        """Warm up (compiles what is compiled, autotunes) on a side stream, then record the graph.

        When AOT packages serve the text encoder, the UNet and the VAE decoder, the first pass runs the whole
        request (nothing compiles, so it is the request as the graph would replay it) and its picture serves
        this request: the capture waits for the shape's next request (`defer_capture`), which takes a first
        image on a second start from warm-up + capture + replay to one eager pass.

        cuDNN benchmarks its convolution algorithms during the warm-up when ATELIER_RECORD_CUDNN_BENCHMARK is "1"
        (cudnn.benchmark, for this block only): the graph then replays the fastest one it found for each of
        the VAE's and UNet's convolution shapes, where the heuristic pick serves otherwise. `record_s` gets the
        seconds of each warm-up pass and of the capture (the request graph's report shows them)."""
        if not self.capture:
            return
        from pipelines import switches

        bench = cudnn_benchmark_when_recording()
        times = self.record_s
        times["cudnn_benchmark"] = bench
        calls = warmup_unet_calls(len(self._t_host))
        times["unet_calls_per_warmup"] = calls
        served = False
        with torch.no_grad(), self.runtime(), switches.scoped(cudnn_benchmark=bench):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for i in range(2):
                    t0 = time.perf_counter()
                    stages: dict = {}
                    self._forward(calls, stages=stages if i == 0 else None, whole_if_aot=i == 0 and defer_capture())
                    side.synchronize()
                    if i == 0:
                        times["first_pass_stages"] = stages     # (not warmup_*: a count of passes)
                    # the first pass loads AOT parts / compiles and autotunes; the second is a plain run that
                    # settles what a first dynamo call can leave unsettled (a recompile on changed guards)
                    times[f"warmup_{i + 1}"] = round(time.perf_counter() - t0, 3)
                    if warmup_passes(self.aot, self.xl) == 1:
                        served = i == 0 and self._whole_pass
                        break
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
        if served:       # the pass was this request, on the parts the graph would replay: its picture serves it
            times["unet_calls_per_warmup"] = len(self._t_host)
            times["capture"] = "deferred to the next request of this shape"
            self._served = True
            return
        self._capture(bench)

    def _capture(self, cudnn_benchmark: bool) -> None:
        """Record the request into a CUDA graph (its parts already warm: loaded, compiled, tuned)."""
        from pipelines import switches

        with torch.no_grad(), self.runtime(), switches.scoped(cudnn_benchmark=cudnn_benchmark):
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the studio's metrics thread may query the device while this thread records
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._forward()
        torch.cuda.synchronize(self.device)
        self.record_s["capture"] = round(time.perf_counter() - t0, 3)
        self.graph = graph

    def run(self) -> tuple[Any, Any, bool]:
        """Run the loaded request; returns (uint8 [N, H, W, 3], float32 [N, 3, H, W] in [0, 1], all finite).
        The uint8 array is a view of the pinned output buffer, valid until the next run (make the PIL images
        from it at once: PIL copies); the float array is the caller's own. Right after a record() whose first
        pass was this request, that pass's picture is returned as it is; a capture it deferred happens here."""
        if self._served:            # record()'s first pass computed this very request (its inputs not reloaded)
            self._served = False
        else:
            if self.graph is None and self.capture:
                self._capture(cudnn_benchmark_when_recording())
            if self.graph is not None:
                self.graph.replay()
                torch.cuda.current_stream(self.device).synchronize()
            else:
                with torch.no_grad(), self.runtime():
                    self._forward()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self.replays += 1
        return self.u8_host.numpy(), self.raw_host.numpy().copy(), bool(self.finite_host)


# UNet calls of a warm-up pass: every call of a request has the same shapes, so a few load and tune all that
# the full loop would (three reach a multistep scheduler's third order); the rest of a pass is decode and output.
# A full 50-step pass was 1.49 s of SD1.5's 2.5 s first call on a second start (H100, 2026-12-05-f).
WARMUP_UNET_CALLS = 3


def warmup_unet_calls(n_timesteps: int) -> int:
    """UNet calls in each warm-up pass before a request is recorded: WARMUP_UNET_CALLS, or all of a shorter
    request's."""
    return min(int(n_timesteps), WARMUP_UNET_CALLS)


def warmup_passes(aot: Any, xl: bool) -> int:
    """Warm-up passes before a request is recorded: 1 when AOT packages serve the text encoder, the UNet and
    the VAE decoder (nothing traces or compiles; the pass has loaded the kernels, set up cuBLAS/cuDNN and the
    allocator), else 2. Asked after the first pass, which is when the parts are loaded. The second pass cost
    0.5 s of SD1.5's 3.1 s first call on a second start (run 2026-12-04-b)."""
    return 1 if (aot is not None and not xl and aot.serves_all()) else 2


class RequestGraphs:
    """The recorded shapes of one pipeline (least recently used evicted past MAX_GRAPHS) and the token-id cache."""

    def __init__(self):
        self.graphs: OrderedDict[GraphKey, RecordedRequest] = OrderedDict()
        self.failed: dict[GraphKey, str] = {}
        self._ids: dict[tuple[int, str], torch.Tensor] = {}

    def ids(self, tokenizer: Any, text: str) -> torch.Tensor:
        """Token ids as diffusers' encode_prompt makes them (padded to the model length, truncated)."""
        got = self._ids.get((id(tokenizer), text))
        if got is None:
            got = tokenizer(text, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids
            if len(self._ids) >= 256:
                self._ids.clear()
            self._ids[(id(tokenizer), text)] = got
        return got

    def get(self, key: GraphKey, build: Callable[[], RecordedRequest]) -> tuple[RecordedRequest, bool]:
        """The recorded request for `key` (built and recorded on first use); second value: newly built."""
        got = self.graphs.get(key)
        if got is not None:
            self.graphs.move_to_end(key)
            return got, False
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        got = build()
        got.record()
        self.graphs[key] = got
        return got, True

    def clear(self) -> None:
        self.graphs.clear()
