"""What `bench` measures: workloads (a model at a size, steps and guidance) and
configurations (a set of OptimizationFlags, or the baseline a user would run instead).

Each configuration is expressed as OptimizationFlags and goes through the studio's own
pipelines, so the numbers describe the product. The one exception is `baseline`: the
stock diffusers pipeline in fp16 with SDPA for diffusion, and our generator called the
way NVlabs' gen_images.py calls theirs (eager, the checkpoint's own mixed precision)
for StyleGAN.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from core.errors import InputError
from core.types import OptimizationFlags

PROMPT = "a photograph of an astronaut riding a horse on the moon, highly detailed"


@dataclass(frozen=True)
class Target:
    """One line of the issue's target table, checked by the report."""

    metric: str                 # 'ms_per_image' | 'it_per_s' | 'images_per_s'
    op: str                     # '<' (lower is better) or '>=' (higher is better)
    value: float
    batch: str = "1"            # '1' or 'throughput'
    configs: str = "any"        # 'any' | 'fp8' (only FP8 rows count) | 'no-fp8'
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "op": self.op, "value": self.value, "batch": self.batch,
                "configs": self.configs, "label": self.label}


_SG2_FFHQ_1024 = dict(z_dim=512, c_dim=0, w_dim=512, img_resolution=1024, img_channels=3,
                      mapping_kwargs={"num_layers": 8}, channel_base=32768, channel_max=512,
                      num_fp16_res=4, conv_clamp=256)
_SG3T_1024 = dict(z_dim=512, c_dim=0, w_dim=512, img_resolution=1024, img_channels=3,
                  mapping_kwargs={"num_layers": 2}, channel_base=32768, channel_max=512,
                  num_fp16_res=4, conv_clamp=256)
_SG2_TINY = dict(z_dim=32, c_dim=0, w_dim=32, img_resolution=32, img_channels=3, mapping_kwargs={"num_layers": 2},
                 channel_base=512, channel_max=32, num_fp16_res=2, conv_clamp=256)
_SG3T_TINY = dict(z_dim=16, c_dim=0, w_dim=16, img_resolution=16, img_channels=3, channel_base=128, channel_max=16,
                  num_layers=4, num_critical=1, margin_size=2, mapping_kwargs={"num_layers": 1})

# Tiny diffusion models: the real SD 1.5 / SDXL configs with small widths, so the same code paths
# run on a CPU in seconds (the tests) or on the GPU as a harness check before the real sizes.
_SD_TINY_UNET = dict(block_out_channels=[32, 64], layers_per_block=1, cross_attention_dim=32, attention_head_dim=4,
                     norm_num_groups=8, sample_size=8,
                     down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                     up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"])
_SDXL_TINY_UNET = dict(block_out_channels=[32, 64], layers_per_block=1, cross_attention_dim=80,
                       attention_head_dim=[2, 4], norm_num_groups=8, sample_size=8, transformer_layers_per_block=1,
                       addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 48,
                       down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
                       up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"])
_TINY_VAE = dict(block_out_channels=[16, 16, 16, 16], layers_per_block=1, norm_num_groups=8, sample_size=64)
_TINY_TE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, projection_dim=32)
_TINY_TE2 = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, projection_dim=48)


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str                              # 'stylegan' | 'diffusion'
    arch: str                              # stylegan2 / stylegan3, or a diffusion arch (sd15, sdxl, sd-turbo)
    resolution: int
    description: str
    steps: int = 0                         # diffusion only
    guidance: float = 0.0
    batches: tuple[int, ...] = (1,)        # batch 1 and the throughput batch
    warmup: int = 2                        # calls before timing (compile configs get at least 2)
    repeats: int = 10                      # timed calls; the median is reported
    init_kwargs: dict = field(default_factory=dict)          # StyleGAN constructor kwargs
    overrides: dict = field(default_factory=dict)            # diffusion: component -> config overrides (tiny)
    best: dict = field(default_factory=dict)                 # OptimizationFlags kwargs of 'best'
    targets: tuple[Target, ...] = ()
    baseline: str = ""                     # what the baseline row is, in words
    tiny: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.name, "kind": self.kind, "arch": self.arch, "resolution": self.resolution,
                "description": self.description, "steps": self.steps, "guidance": self.guidance,
                "batches": list(self.batches), "targets": [t.to_dict() for t in self.targets],
                "baseline": self.baseline, "tiny": self.tiny}


_STOCK = "stock diffusers pipeline, fp16 weights, SDPA attention (as diffusers' docs recommend)"
_NVLABS = "our generator called as NVlabs' gen_images.py calls theirs: eager, the checkpoint's own mixed precision"

WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("sd15-512", "diffusion", "sd15", 512, "Stable Diffusion 1.5, 512², 50 steps, CFG 7.5",
             steps=50, guidance=7.5, batches=(1, 8), warmup=1, repeats=3,
             best=dict(precision="fp16", channels_last=True, compile="reduce-overhead"),
             targets=(Target("it_per_s", ">=", 150, label="≥ 150 it/s (denoising loop)"),
                      Target("ms_per_image", "<", 400, label="< 0.4 s per image with VAE")),
             baseline=_STOCK),
    Workload("sdxl-1024", "diffusion", "sdxl", 1024, "SDXL 1.0, 1024², 30 steps, CFG 5",
             steps=30, guidance=5.0, batches=(1, 4), warmup=1, repeats=3,
             # + fused QKV: 996.0 against 1026.3 ms for the same configuration without it, one H200 run, drift
             # unchanged at 45.9 dB (docs/benchmarks/runs/2026-12-06-b-c99b2c0-sdxl-fqkv.jsonl, rows best and
             # best-fqkv); best-fp8 is then FP8 + fused QKV (fp8-fqkv: 847-884 ms on 2026-12-05)
             best=dict(precision="bf16", channels_last=True, compile="reduce-overhead", fuse_qkv=True),
             targets=(Target("ms_per_image", "<", 850, configs="no-fp8", label="< 0.85 s per image (bf16)"),
                      Target("ms_per_image", "<", 650, configs="fp8", label="< 0.65 s per image with FP8")),
             baseline=_STOCK),
    Workload("sd-turbo-512", "diffusion", "sd-turbo", 512, "SD-Turbo, 512², 1 step, no CFG",
             steps=1, guidance=0.0, batches=(1, 16), warmup=3, repeats=10,
             # one CUDA graph per request + fused QKV: 14.5 ms against 21.0 for per-module CUDA graphs in the same
             # run (docs/benchmarks/runs/2026-12-03-b-8c96da0-turbo-graph.jsonl, rows best and graph-fqkv)
             best=dict(precision="fp16", channels_last=True, compile="reduce-overhead", request_graph=True,
                       fuse_qkv=True),
             targets=(Target("ms_per_image", "<", 15, label="< 15 ms per image"),),
             baseline=_STOCK),
    Workload("sg2-1024", "stylegan", "stylegan2", 1024, "StyleGAN2 1024² (FFHQ config)",
             batches=(1, 32), warmup=3, repeats=20, init_kwargs=_SG2_FFHQ_1024,
             best=dict(precision="bf16", channels_last=True, compile="reduce-overhead"),
             targets=(Target("ms_per_image", "<", 2, label="< 2 ms at batch 1"),
                      Target("images_per_s", ">=", 2000, batch="throughput", label="> 2000 images/s batched")),
             baseline=_NVLABS + " (fp16 in the 4 highest resolutions)"),
    Workload("sg3t-1024", "stylegan", "stylegan3", 1024, "StyleGAN3-T 1024² (FFHQ-U config)",
             batches=(1, 16), warmup=3, repeats=10, init_kwargs=_SG3T_1024,
             # fp16 over bf16: the same 11.1 ms on the H200 with the fused filtered_lrelu, 69.5 against
             # 60.5 dB from fp32 (docs/benchmarks/runs/2026-12-02-*-sg3ab-*.jsonl); no channels_last: the
             # fused kernel reads NCHW tiles. Compiled, `auto` kernels run the convs channels-last on
             # channels padded to 8 (modconv=activations-nhwc): 9.82 against 10.47 ms.
             best=dict(precision="fp16", compile="reduce-overhead"),
             targets=(Target("ms_per_image", "<", 10, label="< 10 ms at batch 1"),),
             baseline=_NVLABS + " (fp32: our StyleGAN3 leaves precision to the optimization toggles)"),
    # Tiny workloads: the tests, and a one-minute harness check on a new machine.
    Workload("sg2-tiny", "stylegan", "stylegan2", 32, "tiny StyleGAN2 (harness check)", batches=(1, 4),
             warmup=1, repeats=3, init_kwargs=_SG2_TINY, best=dict(precision="bf16"), baseline=_NVLABS, tiny=True),
    Workload("sg3t-tiny", "stylegan", "stylegan3", 16, "tiny StyleGAN3-T (harness check)", batches=(1, 4),
             warmup=1, repeats=3, init_kwargs=_SG3T_TINY, best=dict(precision="bf16"), baseline=_NVLABS, tiny=True),
    Workload("sd-tiny", "diffusion", "sd15", 64, "tiny SD 1.5-style pipeline (harness check)", steps=3,
             guidance=7.5, batches=(1, 2), warmup=1, repeats=2,
             overrides={"unet": _SD_TINY_UNET, "vae": _TINY_VAE, "text_encoder": _TINY_TE},
             best=dict(precision="bf16"), baseline=_STOCK, tiny=True),
    Workload("sdxl-tiny", "diffusion", "sdxl", 64, "tiny SDXL-style pipeline (harness check)", steps=2,
             guidance=5.0, batches=(1, 2), warmup=1, repeats=2,
             overrides={"unet": _SDXL_TINY_UNET, "vae": _TINY_VAE, "text_encoder": _TINY_TE,
                        "text_encoder_2": _TINY_TE2},
             best=dict(precision="bf16"), baseline=_STOCK, tiny=True),
]}
FULL_WORKLOADS = tuple(n for n, w in WORKLOADS.items() if not w.tiny)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    flags: OptimizationFlags | None        # None: the baseline
    description: str
    fp32_layers: bool = False              # StyleGAN: build without the checkpoint's fp16 layers

    @property
    def is_baseline(self) -> bool:
        return self.flags is None

    @property
    def uses_fp8(self) -> bool:
        return bool(self.flags is not None and self.flags.fp8)

    @property
    def uses_compile(self) -> bool:
        return bool(self.flags is not None and self.flags.compile != "off")


# name -> (OptimizationFlags kwargs, description); 'best' and 'best-fp8' come from the workload.
_CONFIGS: dict[str, tuple[dict | None, str]] = {
    "baseline": (None, "what a user would run instead"),
    "fp32": (dict(precision="fp32"), "fp32 everywhere, TF32 off: the drift reference"),
    "tf32": (dict(precision="tf32"), "fp32 weights, TF32 matmuls and convolutions"),
    "fp16": (dict(precision="fp16"), "the fp16 precision toggle (diffusion on a GPU: fp16 weights; StyleGAN: autocast)"),
    "bf16": (dict(precision="bf16"), "the bf16 precision toggle (diffusion on a GPU: bf16 weights; StyleGAN: autocast)"),
    "bf16-cl": (dict(precision="bf16", channels_last=True), "bf16 + channels_last"),
    "compile": (dict(precision="bf16", channels_last=True, compile="default"), "bf16 + channels_last + torch.compile"),
    "compile-cg": (dict(precision="bf16", channels_last=True, compile="reduce-overhead"),
                   "bf16 + channels_last + torch.compile with CUDA graphs (reduce-overhead)"),
    # 'compile' + FP8 and nothing else, so the two rows compare FP8 alone (FP8 pays only compiled)
    "fp8": (dict(precision="bf16", channels_last=True, fp8=True, compile="default"),
            "FP8 linear layers + bf16 + channels_last + torch.compile"),
    "prune-25": ({}, "the best combination + structured pruning of 25% of the channels (compare with best)"),
    "prune-50": ({}, "the best combination + structured pruning of 50% of the channels (compare with best)"),
    "tensorrt": (dict(precision="fp16", tensorrt=True), "TensorRT engine, fp16"),
    "best": ({}, "the best combination for this workload"),
    "best-fp8": ({}, "the best combination + FP8 linear layers"),
    # 'best' + fused QKV and nothing else, so the two rows A/B the fusion alone
    "best-fqkv": ({}, "the best combination + fused QKV projections (compare with best)"),
    # 'best' + one CUDA graph per request (diffusion), so the two rows A/B the recording alone
    "best-graph": ({}, "the best combination + one CUDA graph per request (compare with best)"),
    # 'best' + the tiny autoencoder decode: the VAE's share of the request, and the decoder's own drift
    "best-taesd": ({}, "the best combination + the tiny autoencoder (TAESD) decode (compare with best)"),
}
DEFAULT_CONFIGS = tuple(_CONFIGS)
_FLAG_KEYS = {"precision": str, "channels_last": bool, "attention": str, "compile": str, "fp8": bool,
              "prune": float, "prune_amount": float, "prune_method": str, "tensorrt": bool, "memory": str, "kernels": str,
              "fuse_qkv": bool, "request_graph": bool, "tiny_vae": bool}


def _parse_bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise InputError(f"expected a yes/no value, got {v!r}")


def parse_custom(spec: str) -> tuple[str, dict]:
    """'NAME@precision=bf16+compile=default+fp8=1' -> (NAME, OptimizationFlags kwargs)."""
    name, _, body = spec.partition("@")
    if not name or not body:
        raise InputError(f"a custom configuration is NAME@key=value+key=value (e.g. mine@precision=bf16+compile=default); "
                         f"got {spec!r}")
    kw: dict[str, Any] = {}
    for part in body.split("+"):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _FLAG_KEYS:
            raise InputError(f"unknown setting {part!r} in {spec!r}; settings: {', '.join(sorted(_FLAG_KEYS))}")
        typ = _FLAG_KEYS[key]
        try:
            val = _parse_bool(value) if typ is bool else typ(value)
        except ValueError:
            raise InputError(f"bad value for {key} in {spec!r}: {value!r}") from None
        if key == "prune":
            key = "prune_amount"
        if key == "memory":
            val = tuple(v for v in str(val).split("/") if v)
        kw[key] = val
    return name, kw


def resolve_configs(workload: Workload, names: list[str] | tuple[str, ...] | None = None,
                    strict: bool = False) -> list[BenchConfig]:
    """Configurations by name (or NAME@key=value+...) for `workload`, in the order given."""
    out: list[BenchConfig] = []
    for raw in names or DEFAULT_CONFIGS:
        raw = raw.strip()
        if not raw:
            continue
        if "@" in raw:
            name, kw = parse_custom(raw)
            desc = "custom: " + ", ".join(f"{k}={v}" for k, v in kw.items())
        elif raw in _CONFIGS:
            name, (kw, desc) = raw, _CONFIGS[raw]
            if raw == "best":
                kw = dict(workload.best)
            elif raw == "best-fp8":
                kw = dict(workload.best, fp8=True)
                if kw.get("compile", "off") == "off":
                    kw["compile"] = "default"
            elif raw == "best-fqkv":
                kw = dict(workload.best, fuse_qkv=True)
            elif raw == "best-graph":
                kw = dict(workload.best, request_graph=True)
            elif raw == "best-taesd":
                kw = dict(workload.best, tiny_vae=True)
            elif raw in ("prune-25", "prune-50"):
                # Pruning composed with everything else: the H200's eager bf16 prune rows were launch- and
                # sync-bound, where fewer FLOPs buy nothing; against `best` the row shows what pruning adds.
                kw = dict(workload.best, prune_amount=int(raw[-2:]) / 100, prune_method="structured")
        else:
            raise InputError(f"unknown configuration {raw!r}; known: {', '.join(DEFAULT_CONFIGS)} "
                             f"(or NAME@key=value+key=value)")
        if kw is None:
            out.append(BenchConfig(name, None, f"baseline: {workload.baseline}"))
            continue
        flags = OptimizationFlags(**kw)
        if strict:
            flags = replace(flags, strict=True)
        if name in ("best", "best-fp8", "best-fqkv", "best-graph", "best-taesd", "prune-25", "prune-50"):
            desc = f"{desc}: " + describe_flags(flags)
        fp32_layers = workload.kind == "stylegan" and flags.precision in ("fp32", "tf32")
        out.append(BenchConfig(name, flags, desc, fp32_layers=fp32_layers))
    names_seen = [c.name for c in out]
    dupes = sorted({n for n in names_seen if names_seen.count(n) > 1})
    if dupes:
        raise InputError(f"configuration names must be unique; repeated: {', '.join(dupes)}")
    return out


def describe_flags(flags: OptimizationFlags) -> str:
    parts = [flags.precision]
    if flags.channels_last:
        parts.append("channels_last")
    if flags.attention != "sdpa":
        parts.append(f"attention={flags.attention}")
    if flags.compile != "off":
        parts.append(f"compile={flags.compile}")
    if flags.fuse_qkv:
        parts.append("fused QKV")
    if flags.request_graph:
        parts.append("request graph")
    if flags.tiny_vae:
        parts.append("tiny VAE")
    if flags.fp8:
        parts.append("fp8")
    if flags.prune_amount:
        parts.append(f"prune={flags.prune_amount:g} ({flags.prune_method})")
    if flags.tensorrt:
        parts.append("tensorrt")
    if flags.memory:
        parts.append("memory=" + "/".join(flags.memory))
    if flags.kernels != "auto":
        parts.append(f"kernels={flags.kernels}")
    return " + ".join(parts)


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise InputError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def parse_list(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]
