"""Training configuration: one dataclass, named presets, and the derived hyperparameters.

A run is fully described by a `TrainConfig`; it is saved in every checkpoint's
state.json, so `--resume` rebuilds the same networks, optimizers and schedule.
Presets fill in network sizes and the StyleGAN2-ADA 'auto' heuristics
(batch, learning rate, R1 gamma, EMA half-life) from the resolution; any field
can still be overridden.

Augmentation guards (`aug_pipe='upright'`, `ada_max_p`): why they exist is in training/augment.py.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from core.errors import InputError

PRESETS = ("stylegan2", "stylegan3-t", "stylegan3-r", "emoji64", "tiny")
LOSSES = ("r1", "wgan-gp")
OPTIMIZERS = ("stylegan2", "wgan-gp")
PRECISIONS = ("fp32", "bf16", "fp16")
AUG_MODES = ("ada", "fixed", "none")
AUG_PIPES = ("blit", "geom", "color", "bg", "bgc", "bgcc", "upright")
COMPILE_SCOPES = ("full", "nets")
# Settings that once existed and no longer do anything. Accepted (and dropped) so old checkpoints'
# state.json and old scripts still load: `dali` chose NVIDIA DALI for decoding image folders, which
# was removed (folders are decoded once with Pillow and cached; see training/dataset.py).
LEGACY_SETTINGS = ("dali",)


@dataclass
class TrainConfig:
    # -- what and where ---------------------------------------------------------------------
    data: str = ""                          # folder / .zip / .npy / .npz / .npy.xz of images
    out: str = "runs/train"                 # run folder: checkpoint, log.jsonl, samples.png
    preset: str = "stylegan2"
    resolution: int = 0                     # 0 = the dataset's own
    mirror: bool = False                    # add x-flipped copies of the data (NVlabs --mirror)
    seed: int = 0

    # -- networks (NVlabs keyword arguments) --------------------------------------------------
    arch: str = "stylegan2"                 # generator family: stylegan2 | stylegan3
    g_kwargs: dict = field(default_factory=dict)
    d_kwargs: dict = field(default_factory=dict)
    cbase: int = 0                          # > 0: channel_base of G and D (NVlabs --cbase), over the preset's
    cmax: int = 0                           # > 0: channel_max of G and D (NVlabs --cmax)
    cond: str = ""                          # "" = unconditional; else class-conditional G and D (NVlabs --cond) on
                                            # the per-image class indices under this key of `labels`
    labels: str = ""                        # JSON with per-image class indices (emoji64: keys group, class)
    c_dim: int = 0                          # number of classes: set from the labels when the run starts and
                                            # saved, so that a resume rebuilds the same networks
    class_balance: float = 0.0              # with cond: image i is drawn with probability ~ n_c(i) ** -alpha, so a
                                            # class's share ~ n_c ** (1 - alpha), for real and generated images
                                            # alike: 0 = the data's proportions, 0.5 = square root, 1 = equal
    noisy_twins: float = 0.0                # with cond: NoisyTwins weight (0 = off): G's class embedding gets
                                            # Gaussian noise and a Barlow Twins loss on twin w's (same z and class,
                                            # independent noise) keeps classes consistent and diverse inside
    noisy_twins_sigma: float = 0.25         # std of that noise on the unit-second-moment class embedding
    noisy_twins_off_diagonal: float = 0.005 # Barlow Twins' weight of the cross-dimension correlations
    noisy_twins_start_kimg: float = 0.0     # switch it on at this kimg (the paper starts it on a trained model)
    noisy_twins_beta: float = 0.0           # > 0: each class's noise x its effective-number scale (rare classes
                                            # more; the paper's CIFAR10-LT 0.99); 0 = one std for every class

    # -- length -------------------------------------------------------------------------------
    kimg: float = 25000.0                   # stop after this many thousand real images shown to D
    minutes: float | None = None            # or when this wall-clock budget (whole process) is used up
    reserve_seconds: float = 45.0           # of `minutes`, kept for the final checkpoint and grid

    # -- batch and optimizers -------------------------------------------------------------------
    batch: int = 0                          # global batch over all GPUs; 0 = preset heuristic
    optimizer: str = "stylegan2"            # stylegan2: Adam (0, 0.99) | wgan-gp: G RAdam, D Adam (0.5, 0.9)
    lr_g: float = 0.0                       # 0 = preset / optimizer default
    lr_d: float = 0.0
    d_steps: int = 1                        # D updates per G update (D:G ratio)
    scale_lr_with_batch: bool = False       # lr *= batch / preset batch when the batch is overridden

    # -- losses and regularization --------------------------------------------------------------
    loss: str = "r1"                        # r1: non-saturating logistic + lazy R1 | wgan-gp
    r1_gamma: float = -1.0                  # < 0 = auto: 0.0002 * res^2 / batch (StyleGAN2-ADA)
    r1_interval: int = 16                   # lazy R1 every N D steps (0 = off)
    gp_lambda: float = 10.0                 # WGAN-GP gradient penalty weight
    gp_drift: float = 0.001                 # WGAN-GP drift term keeping D(real) near 0 (ProGAN)
    pl_weight: float = 2.0                  # path length regularization (0 = off)
    pl_interval: int = 4
    pl_batch_shrink: int = 2
    pl_decay: float = 0.01
    style_mixing: float = 0.9
    ema_kimg: float = -1.0                  # < 0 = auto: batch * 10 / 32
    ema_rampup: float | None = 0.05

    # -- augmentation (ADA) -----------------------------------------------------------------------
    aug: str = "ada"                        # ada: adaptive p | fixed: p = aug_p | none
    aug_pipe: str = "bgc"                   # b(lit) g(eom) c(olor) [+c(utout)] | upright (no flips/rotations)
    aug_p: float = 0.0                      # initial / fixed probability (<= ada_max_p)
    ada_max_p: float = 1.0                  # cap on p (1.0 = none, as NVlabs); flips/rotations leak near 1
    ada_target: float = 0.6                 # target for r_t = E[sign(D(real))]
    ada_interval: int = 4                   # adjust p every N iterations
    ada_kimg: float = 500.0                 # p can go 0 -> 1 in this many kimg

    # -- mode-collapse monitor --------------------------------------------------------------------
    monitor_kimg: float = 20.0              # evaluate every N kimg (0 = off)
    monitor_samples: int = 64
    monitor_per_class: int = 4              # conditional runs: samples per class for the class diversity (0 = off)
    auto_countermeasures: bool = False      # apply dropout / mbstd / D:G / augmentation on warnings
    d_dropout: float = 0.0                  # dropout before D's last layer (0.3 when a counter-measure)

    # -- speed --------------------------------------------------------------------------------------
    precision: str = "bf16"                 # bf16 autocast | fp16 autocast + GradScaler | fp32
    tf32: bool = True                       # TF32 matmuls/convs when precision is fp32
    channels_last: bool = True
    compile: bool = False                   # torch.compile the main forward passes (first compile: minutes)
    compile_scope: str = "full"             # with compile: full = also G's no-grad pass of the D step and the
                                            # augmentation inside D's graphs | nets = the network passes only
    compile_cache: str = ""                 # with compile: a folder of portable compile-cache files (loaded
                                            # before the first compile, saved after it; training/compile_cache.py)
    kernels: str = "auto"                   # op formulations (models.ops knobs): auto | reference | knob:choice/...
    grad_checkpointing: bool = False        # recompute activations in backward (memory for speed)
    data_device: str = "auto"               # auto | gpu | host: where the uint8 dataset lives
    device: str | None = None               # None = cuda when available (per-rank under torchrun)

    # -- starting point ------------------------------------------------------------------------------
    init_g: str = ""                        # a new run's G and G_ema start from this exported generator (a
                                            # G_ema snapshot or a studio model); D starts fresh
    freeze_g_kimg: float = 0.0              # the first N kimg of the run train D alone (G and G_ema fixed): a
                                            # fresh D catches up with a trained G before G learns from it
    init_d: str = ""                        # with init_g: D (and ADA's p) from a carried D state instead of
                                            # fresh (checkpoint.write_d_state: bf16, xz, < 12 MB)

    # -- outputs -------------------------------------------------------------------------------------
    log_every: int = 100                    # iterations between log lines (the only host syncs)
    snapshot_kimg: float = 200.0            # checkpoint + grid every N kimg (0 = only at the end)
    snapshot_minutes: float = 0.0           # also every N minutes of wall clock (0 = off)
    snapshot_ema: bool = False              # also keep G_ema of every snapshot (fp16) in snapshots/ for metrics
    progress: bool = True                   # tqdm progress bar on rank 0

    # ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = {k: v for k, v in d.items() if k not in LEGACY_SETTINGS}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown training setting(s): {', '.join(unknown)}")
        return cls(**copy.deepcopy(d))

    # Derived values. Kept as methods so the saved config stays what the user asked for.
    def r1_gamma_value(self) -> float:
        return self.r1_gamma if self.r1_gamma >= 0 else 0.0002 * self.resolution**2 / self.batch

    def ema_kimg_value(self) -> float:
        return self.ema_kimg if self.ema_kimg >= 0 else self.batch * 10 / 32


def _network_kwargs(preset: str, res: int, batch: int) -> tuple[str, dict, dict]:
    """(arch, G kwargs, D kwargs) for a preset at resolution `res`."""
    if preset == "emoji64":
        # The bundled model's network (1.92 M G, 1.27 M D parameters; fp16 G_ema 3.7 MiB). The
        # 2026-12-02 H200 run used --cbase 8192 --cmax 256 (5.57 M / 5.85 M); docs/training.md.
        g = dict(z_dim=256, w_dim=256, mapping_kwargs=dict(num_layers=2), channel_base=128 * 64,
                 channel_max=128, num_fp16_res=0, conv_clamp=256, fused_modconv_default="inference_only")
        d = dict(channel_base=112 * 64, channel_max=112, num_fp16_res=0, conv_clamp=256,
                 epilogue_kwargs=dict(mbstd_group_size=4, mbstd_num_channels=1))
        return "stylegan2", g, d
    if preset == "tiny":
        g = dict(z_dim=32, w_dim=32, mapping_kwargs=dict(num_layers=2), channel_base=16 * res,
                 channel_max=16, num_fp16_res=0, conv_clamp=256, fused_modconv_default="inference_only")
        d = dict(channel_base=16 * res, channel_max=16, num_fp16_res=0, conv_clamp=256,
                 epilogue_kwargs=dict(mbstd_group_size=2, mbstd_num_channels=1))
        return "stylegan2", g, d
    cbase = 32768 if res >= 512 else 16384
    d = dict(channel_base=cbase, channel_max=512, num_fp16_res=0, conv_clamp=256,
             epilogue_kwargs=dict(mbstd_group_size=4, mbstd_num_channels=1))
    if preset == "stylegan2":
        g = dict(z_dim=512, w_dim=512, mapping_kwargs=dict(num_layers=2), channel_base=cbase, channel_max=512,
                 num_fp16_res=0, conv_clamp=256, fused_modconv_default="inference_only")
        return "stylegan2", g, d
    if preset in ("stylegan3-t", "stylegan3-r"):
        g = dict(z_dim=512, w_dim=512, mapping_kwargs=dict(num_layers=2), channel_base=cbase * 2,
                 channel_max=1024 if preset == "stylegan3-r" else 512, num_fp16_res=0, conv_clamp=256,
                 magnitude_ema_beta=0.5 ** (batch / (20 * 1e3)))  # NVlabs: half-life 20 kimg
        if preset == "stylegan3-r":
            g.update(conv_kernel=1, use_radial_filters=True)
        return "stylegan3", g, d
    raise InputError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def build_config(preset: str = "stylegan2", resolution: int = 0, **overrides: Any) -> TrainConfig:
    """A complete config: the preset at `resolution`, then `overrides` (None values are ignored)."""
    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None and k not in LEGACY_SETTINGS}
    if preset == "emoji64":
        resolution = resolution or 64
    if resolution and (resolution < 8 or resolution & (resolution - 1)):
        raise InputError(f"resolution must be a power of two >= 8; got {resolution}")
    cfg = TrainConfig(preset=preset, resolution=resolution)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InputError(f"unknown training setting(s): {', '.join(unknown)}")

    # Preset defaults first, so explicit overrides win.
    if preset == "emoji64":
        cfg.data = "assets/datasets/emoji64.npy.xz"
        cfg.labels = "assets/datasets/emoji64_labels.json"   # --cond group (10 classes) or class (98)
        cfg.batch = 256         # H200, wide network: 1.46x the img/s of 128, no gain at 512 (docs/training.md)
        cfg.lr_g = cfg.lr_d = 0.0025
        cfg.r1_gamma = 0.05     # sharp glyph edges on flat white: more R1 than the auto 0.0064 keeps D smooth
        cfg.ema_kimg = 20.0
        cfg.snapshot_kimg = 200.0
        cfg.snapshot_ema = True  # per-snapshot G_ema for the emoji metric (scripts/emoji_metrics.py)
        cfg.monitor_kimg = 100.0
        cfg.mirror = False      # letters, digits and arrows are not mirror-symmetric
        # Emoji have one orientation and a white background. Two runs leaked augmentation into G: the
        # luma flip at p ~0.6 (black backgrounds) and, once ADA's p reached 1.0 with 'bg', 90-degree
        # rotations (faces on their side, recall 0.27 -> 0.05). So: no flips/rotations, and p <= 0.6.
        cfg.aug_pipe = "upright"
        cfg.ada_max_p = 0.6
    elif preset == "tiny":
        cfg.batch = 8
        cfg.lr_g = cfg.lr_d = 0.002
        cfg.kimg = 1.0
        cfg.log_every = 2
        cfg.snapshot_kimg = 0.0
        cfg.monitor_kimg = 0.0
        cfg.monitor_samples = 16
        cfg.precision = "fp32"
        cfg.channels_last = False
        cfg.progress = False
        cfg.reserve_seconds = 0.0

    for k, v in overrides.items():
        setattr(cfg, k, v)
    if cfg.loss == "wgan-gp" and "optimizer" not in overrides:
        cfg.optimizer = "wgan-gp"
    if cfg.optimizer == "wgan-gp" and "d_steps" not in overrides:
        cfg.d_steps = 5         # the WGAN-GP paper's n_critic
    return cfg


def finalize(cfg: TrainConfig, resolution: int, world_size: int = 1) -> TrainConfig:
    """Fill what depends on the data and the launch (resolution, batch, lr, networks); validate."""
    cfg = copy.deepcopy(cfg)
    if cfg.resolution and cfg.resolution != resolution:
        raise InputError(f"the data is {resolution}x{resolution} but the config says {cfg.resolution}")
    cfg.resolution = resolution
    if cfg.preset == "emoji64" and resolution != 64:
        raise InputError("the emoji64 preset is for 64x64 data; use --preset stylegan2 for other sizes")
    preset_batch = max(min(4096 // resolution, 32), 8) if cfg.preset in ("stylegan2", "stylegan3-t",
                                                                          "stylegan3-r") else 0
    if cfg.batch <= 0:
        cfg.batch = max(preset_batch * world_size, world_size)
    if cfg.batch % world_size:
        raise InputError(f"the global batch {cfg.batch} must be divisible by the number of GPUs ({world_size})")
    default_lr = {"stylegan2": 0.002 if resolution >= 1024 else 0.0025, "wgan-gp": 1e-4}[cfg.optimizer] \
        if cfg.optimizer in OPTIMIZERS else 0.0
    scale = cfg.batch / preset_batch if (cfg.scale_lr_with_batch and preset_batch) else 1.0
    if cfg.lr_g <= 0:
        cfg.lr_g = default_lr * scale
    if cfg.lr_d <= 0:
        cfg.lr_d = default_lr * scale
    if not cfg.g_kwargs or not cfg.d_kwargs:
        arch, g, d = _network_kwargs(cfg.preset, resolution, cfg.batch)
        cfg.arch = arch
        cfg.g_kwargs = cfg.g_kwargs or g
        cfg.d_kwargs = cfg.d_kwargs or d
        for kw in (cfg.g_kwargs, cfg.d_kwargs):
            if cfg.cbase > 0:
                kw["channel_base"] = cfg.cbase
            if cfg.cmax > 0:
                kw["channel_max"] = cfg.cmax
    validate(cfg, world_size)
    return cfg


def validate(cfg: TrainConfig, world_size: int = 1) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise InputError(msg)

    need(cfg.loss in LOSSES, f"--loss must be one of {', '.join(LOSSES)}; got {cfg.loss!r}")
    need(cfg.optimizer in OPTIMIZERS, f"optimizer preset must be one of {', '.join(OPTIMIZERS)}; got {cfg.optimizer!r}")
    need(cfg.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}; got {cfg.precision!r}")
    need(cfg.aug in AUG_MODES, f"--aug must be one of {', '.join(AUG_MODES)}; got {cfg.aug!r}")
    need(cfg.aug_pipe in AUG_PIPES, f"--aug-pipe must be one of {', '.join(AUG_PIPES)}; got {cfg.aug_pipe!r}")
    from models import kernels as _kernels

    _kernels.check_training(cfg.kernels)     # InputError naming the knobs when malformed; no fir:triton
    need(cfg.data_device in ("auto", "gpu", "host", "host-plain"),
         f"data_device must be auto, gpu or host; got {cfg.data_device!r}")
    need(cfg.arch in ("stylegan2", "stylegan3"), f"arch must be stylegan2 or stylegan3; got {cfg.arch!r}")
    need(cfg.cbase >= 0 and cfg.cmax >= 0, f"--cbase and --cmax must be positive; got {cfg.cbase}, {cfg.cmax}")
    need(cfg.cmax <= 4096 and cfg.cbase <= 2**20,
         f"--cmax {cfg.cmax} / --cbase {cfg.cbase} are beyond any StyleGAN configuration (cmax <= 4096)")
    need(cfg.kimg > 0, f"--kimg must be positive; got {cfg.kimg}")
    need(cfg.compile_scope in COMPILE_SCOPES,
         f"--compile-scope must be one of {', '.join(COMPILE_SCOPES)}; got {cfg.compile_scope!r}")
    need(cfg.freeze_g_kimg >= 0, f"--freeze-g-kimg must be 0 or more; got {cfg.freeze_g_kimg}")
    need(cfg.monitor_per_class == 0 or cfg.monitor_per_class >= 2,
         f"--monitor-per-class must be 0 (off) or at least 2 (a class's diversity needs pairs); got {cfg.monitor_per_class}")
    need(not cfg.init_d or cfg.init_g,
         "--init-d continues a D against the generator it was trained with: give that generator with --init-g")
    if cfg.cond and not cfg.labels:
        from training.dataset import nvlabs_labels_source
        from training.trainer import resolve_data_path

        need(bool(cfg.data) and nvlabs_labels_source(resolve_data_path(cfg.data)) is not None,
             f"--cond {cfg.cond} needs labels: --labels FILE (a JSON with a list of per-image class indices under "
             f"{cfg.cond!r}), or NVlabs' dataset.json inside the data folder or .zip")
    need(cfg.arch == "stylegan2" or not cfg.cond, "class-conditional training (--cond) is for StyleGAN2 networks")
    need(cfg.noisy_twins >= 0, f"--noisy-twins is a loss weight (0 = off, the paper's 0.001-0.01); got {cfg.noisy_twins}")
    need(cfg.noisy_twins == 0 or bool(cfg.cond),
         f"--noisy-twins {cfg.noisy_twins:g} regularises the class embedding of a class-conditional G; this run is "
         "unconditional: add --cond KEY (with --labels) or drop --noisy-twins")
    need(cfg.noisy_twins_sigma > 0, f"--noisy-twins-sigma must be > 0 (the paper's 0.1-0.75, on the raw embedding); got {cfg.noisy_twins_sigma}")
    need(cfg.noisy_twins_off_diagonal >= 0,
         f"--noisy-twins-off-diagonal must be >= 0 (Barlow Twins' 0.005); got {cfg.noisy_twins_off_diagonal}")
    need(cfg.noisy_twins_start_kimg >= 0, f"--noisy-twins-start-kimg must be >= 0; got {cfg.noisy_twins_start_kimg}")
    need(0.0 <= cfg.noisy_twins_beta < 1.0,
         f"--noisy-twins-beta must be in [0, 1) (0 = the same noise for every class; the paper's 0.99 gives rare "
         f"classes more); got {cfg.noisy_twins_beta}")
    need(0.0 <= cfg.class_balance <= 1.0,
         f"--class-balance must be between 0 and 1 (0 = classes as often as the data has them, 0.5 = square-root "
         f"sampling, 1 = every class equally often); got {cfg.class_balance}")
    need(cfg.class_balance == 0 or bool(cfg.cond),
         f"--class-balance {cfg.class_balance:g} evens out how often each class is trained, and an unconditional run "
         "has no classes: add --cond KEY (the class indices under KEY in --labels FILE, or in the data set's "
         "dataset.json), or leave --class-balance out")
    need(cfg.minutes is None or cfg.minutes > 0, f"--minutes must be positive; got {cfg.minutes}")
    need(1 <= cfg.d_steps <= 10, f"the D:G ratio (--d-steps) must be 1..10; got {cfg.d_steps}")
    need(0.0 <= cfg.aug_p <= 1.0, f"--aug-p must be in [0, 1]; got {cfg.aug_p}")
    need(0.0 < cfg.ada_max_p <= 1.0,
         f"--ada-max-p (the cap on augmentation p) must be in (0, 1]; got {cfg.ada_max_p}")
    need(cfg.aug == "none" or cfg.aug_p <= cfg.ada_max_p,
         f"--aug-p {cfg.aug_p} is above the cap --ada-max-p {cfg.ada_max_p}"
         + (" (the emoji64 preset's cap)" if cfg.preset == "emoji64" and cfg.ada_max_p == 0.6 else "")
         + f"; lower --aug-p or raise --ada-max-p to {cfg.aug_p}")
    need(0.0 < cfg.ada_target < 1.0, f"--ada-target must be in (0, 1); got {cfg.ada_target}")
    need(0.0 <= cfg.d_dropout < 1.0, f"D dropout must be in [0, 1); got {cfg.d_dropout}")
    need(0.0 <= cfg.style_mixing <= 1.0, f"style mixing probability must be in [0, 1]; got {cfg.style_mixing}")
    need(cfg.lr_g > 0 and cfg.lr_d > 0, "learning rates must be positive")
    need(cfg.log_every >= 1, "--log-every must be at least 1")
    batch_gpu = cfg.batch // world_size
    need(batch_gpu >= 2, f"each GPU needs a batch of at least 2 (global batch {cfg.batch} over {world_size} GPUs)")
    need(not cfg.noisy_twins or (batch_gpu >= 4 and batch_gpu % 2 == 0),
         f"--noisy-twins splits each GPU's G batch into twin pairs: it needs an even per-GPU batch of at least 4; "
         f"got {batch_gpu} (global {cfg.batch} over {world_size} GPUs)")
    if cfg.pl_weight > 0:
        need(batch_gpu // cfg.pl_batch_shrink >= 1,
             f"the per-GPU batch {batch_gpu} is smaller than --pl-batch-shrink {cfg.pl_batch_shrink}")
    mb = (cfg.d_kwargs.get("epilogue_kwargs") or {}).get("mbstd_group_size", 4)
    if mb and (cfg.d_kwargs.get("epilogue_kwargs") or {}).get("mbstd_num_channels", 1) > 0:
        g = min(mb, batch_gpu)
        need(batch_gpu % g == 0, f"the per-GPU batch {batch_gpu} must be a multiple of the minibatch-stddev "
                                 f"group size {g}; pick a batch divisible by {g * world_size}")
