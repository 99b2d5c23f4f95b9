"""The StyleGAN training loop: phases, EMA, ADA, monitor, logging, checkpoints, time budget.

One iteration, as in NVlabs' StyleGAN2-ADA:

  1. D step, `d_steps` times (the D:G ratio): generated images (no grad) and the next
     real batch go through the augmentation and D; logistic (or WGAN-GP) loss.
     Every `r1_interval`-th D step adds a separate lazy R1 step (weight x interval,
     Adam lr and betas adjusted by interval/(interval+1)).
  2. G step: non-saturating loss through the augmentation and a frozen D; every
     `pl_interval`-th G step adds a lazy path-length step.
  3. G_ema <- lerp towards G (half-life `ema_kimg`, ramped up over the first kimg).
  4. Every `ada_interval` iterations ADA nudges p on the device.

Speed: the inner loop never waits for the GPU. Losses, accuracies and ADA statistics
are summed into device tensors and read once per `log_every` iterations; time-budget
and snapshot decisions are made at those points (and broadcast from rank 0, so all
ranks stop at the same step). bf16 autocast (fp16 + GradScaler on request), channels_last,
the uint8 dataset on the GPU, fused Adam on CUDA, optional torch.compile and activation
checkpointing.

Exact resume: every random number in an iteration comes from the global torch RNG,
reseeded at the start of the iteration from (seed, rank, iteration). The sampler
position, optimizer moments, EMA, ADA p and its running sums, the path-length mean,
the D:G ratio and every counter-measure, the monitor history and the GradScaler
scale are in the checkpoint. An interrupted run continued from its checkpoint therefore
repeats the uninterrupted run bit for bit on the CPU (tested); on the GPU, cuDNN's
non-deterministic kernels make the two close but not bit-identical.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import signal
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from core.errors import InputError
from models import kernels as _kernels
from models import ops
from models.common import seed_class_labels
from training import checkpoint as ckpt
from training import distributed as dist_utils
from training import losses
from training.augment import AdaController, AugmentPipe, leak_prone_ops
from training.config import TrainConfig, finalize
from training.dataset import (ImageBatches, _mix, balanced_class_pool, class_balance_note, effective_number_scale,
                              image_grid, image_names, load_images, load_labels, to_float, to_uint8_hwc)
from training.monitor import CollapseMonitor

# Settings a resumed run may change: where/how long/how fast, never what is trained.
RESUME_OVERRIDABLE = ("out", "kimg", "minutes", "reserve_seconds", "log_every", "snapshot_kimg", "snapshot_minutes",
                      "progress", "device", "data", "data_device", "compile", "precision", "tf32",
                      "channels_last", "grad_checkpointing", "auto_countermeasures", "kernels",
                      "snapshot_ema", "labels", "compile_scope", "compile_cache")
# Settings of the training recipe (not of the networks) that a resumed run changes only when asked to
# (`--retune`, NVlabs' resume-from-a-pickle freedom): the networks, EMA, optimizer moments, ADA p and
# the counters carry over; a new learning rate or Adam beta replaces the saved one.
RESUME_RETUNABLE = ("batch", "lr_g", "lr_d", "r1_gamma", "r1_interval", "pl_weight", "style_mixing", "ema_kimg",
                    "aug", "aug_pipe", "ada_target", "ada_kimg", "ada_max_p", "d_steps", "class_balance",
                    "noisy_twins", "noisy_twins_sigma", "noisy_twins_start_kimg", "noisy_twins_beta")

LOG_FILE = "log.jsonl"
GRID_FILE = "samples.png"
SNAPSHOT_DIR = "snapshots"
GRID_SEED = 0xE0E0
MONITOR_CLASS_REFERENCE = 16    # real images per class for the monitor's class diversity


def build_networks(cfg: TrainConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(G, D) from the config's NVlabs keyword arguments."""
    from models import stylegan2

    g_kwargs = dict(cfg.g_kwargs)
    z_dim = g_kwargs.pop("z_dim", 512)
    w_dim = g_kwargs.pop("w_dim", 512)
    if cfg.arch == "stylegan3":
        from models import stylegan3

        G = stylegan3.Generator(z_dim, 0, w_dim, cfg.resolution, 3, **g_kwargs)
    else:
        G = stylegan2.Generator(z_dim, cfg.c_dim, w_dim, cfg.resolution, 3, **g_kwargs)
    d_kwargs = dict(cfg.d_kwargs)
    D = stylegan2.Discriminator(cfg.c_dim, cfg.resolution, 3, **d_kwargs)
    return G, D


@contextmanager
def backend_switches(device: torch.device | str, tf32: bool):
    """On CUDA: TF32 matmuls/convolutions per `tf32` and cuDNN autotuning for the block, restored after it.

    torch keeps these switches process-wide. Set once by the trainer and never restored, they
    changed what every later computation in the process did (an fp32 reference, a metric, a
    generation after a training run). Off CUDA nothing is set: cuDNN is not used there, and the
    legacy TF32 matmul switch also moves torch's float32 matmul precision, which CPU backends read."""
    if torch.device(device).type != "cuda":
        yield
        return
    b = torch.backends
    saved = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark)
    b.cuda.matmul.allow_tf32 = bool(tf32)
    b.cudnn.allow_tf32 = bool(tf32)
    b.cudnn.benchmark = True
    try:
        yield
    finally:
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark = saved


def grid_labels(c_dim: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """One-hot labels for samples start..start+n of a grid: sample i is class i % c_dim (None when unconditional),
    so a conditional model's grid shows its classes in order."""
    return seed_class_labels(c_dim, range(start, start + n), device)


def resolve_data_path(data: str) -> Path:
    """A relative path is looked up from the working directory, then from the repository root."""
    if not data:
        raise InputError("no training data given; pass --data PATH (a folder, .zip or .npy/.npz/.npy.xz)")
    p = Path(data)
    if not p.exists() and not p.is_absolute():
        from core.settings import ROOT

        if (ROOT / p).exists():
            return ROOT / p
    return p


def labels_source(cfg) -> str:
    """Where a conditional run reads its labels: --labels, else the data set's own NVlabs dataset.json."""
    if cfg.labels:
        text = str(cfg.labels)
        return text if ".zip!" in text.lower() else str(resolve_data_path(text))   # archive.zip!dataset.json
    from training.dataset import nvlabs_labels_source

    found = nvlabs_labels_source(resolve_data_path(cfg.data)) if cfg.data else None
    if found is None:
        raise InputError(f"--cond {cfg.cond} needs labels: --labels FILE (a JSON with a list of per-image class "
                         f"indices under {cfg.cond!r}), or NVlabs' dataset.json inside the data folder or .zip")
    return found


def param_count(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def checkpoint_bytes(G: torch.nn.Module, D: torch.nn.Module) -> dict[str, int]:
    """Sizes of the resumable checkpoint's files in fp32 (Adam keeps two moments per parameter)."""
    def tensor_bytes(m):
        return sum(t.numel() * t.element_size() for t in m.state_dict().values())
    pg, pd = param_count(G), param_count(D)
    return {"G": tensor_bytes(G), "G_ema": tensor_bytes(G), "D": tensor_bytes(D), "opt_G": 8 * pg, "opt_D": 8 * pd}


class GeneratorStep(torch.nn.Module):
    """G as one module for DDP: z -> (image, ws) with style mixing; the mapping stays fp32."""

    def __init__(self, G: torch.nn.Module, style_mixing: float):
        super().__init__()
        self.G = G
        self.style_mixing = float(style_mixing)
        self.embed_noise = 0.0      # NoisyTwins: noise on the class embedding of every generated image once on
        self.class_noise = None     # ... times a per-class scale [c_dim] (--noisy-twins-beta), or the same for all

    def forward(self, z: torch.Tensor, c: torch.Tensor, update_emas: bool = False):
        G = self.G
        noise = {}
        if self.embed_noise:
            scale = self.embed_noise
            if self.class_noise is not None:
                scale = (c.to(torch.float32) @ self.class_noise)[:, None] * scale      # c: one-hot rows
            noise = {"embed_noise": scale}
        with torch.autocast(z.device.type, enabled=False):
            ws = G.mapping(z, c, update_emas=update_emas, **noise)
            if self.style_mixing > 0:
                n, num_ws = ws.shape[0], ws.shape[1]
                # Per-sample crossover point; samples that do not mix get cutoff = num_ws.
                cutoff = torch.randint(1, num_ws, (n, 1), device=z.device)
                mix = torch.rand(n, 1, device=z.device) < self.style_mixing
                cutoff = torch.where(mix, cutoff, torch.full_like(cutoff, num_ws))
                ws2 = G.mapping(torch.randn_like(z), c, update_emas=False, **noise)
                take2 = torch.arange(num_ws, device=z.device)[None, :] >= cutoff
                ws = torch.where(take2[:, :, None], ws2, ws)
        img = G.synthesis(ws, noise_mode="random", update_emas=update_emas)
        return img, ws


def _set_requires_grad(module: torch.nn.Module, flag: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(flag)


def _checkpoint_blocks(module: torch.nn.Module, names: list[str]) -> None:
    """Recompute these submodules' activations in backward (torch.utils.checkpoint, non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    for name in names:
        block = getattr(module, name)
        fwd = block.forward

        def wrapped(*args, _fwd=fwd, **kwargs):
            return checkpoint(_fwd, *args, use_reentrant=False, **kwargs)
        block.forward = wrapped


def next_interval_estimate(interval_seconds: float, first_iteration_s: float | None, iterations: int) -> float:
    """How long the next log interval will take, for the time budget's stop decision.

    The last interval's length, except for a piece's first: its first iteration holds torch.compile (151 s
    cold on an H100 for emoji64, where the other 99 iterations take about 9 s), cuDNN's autotuning and lazy setup, so
    the other iterations' mean stands for the next interval. Judged by the first interval as it was, a run
    with a few minutes' budget stopped at its first log point with most of its budget unused."""
    if first_iteration_s is None or iterations < 2:
        return interval_seconds
    rest = max(interval_seconds - first_iteration_s, 0.0)
    return rest * iterations / (iterations - 1)


class Trainer:
    # Indices into the device-side log accumulator.
    _STATS = ("g_loss", "g_n", "d_loss", "d_n", "r1", "r1_n", "pl", "pl_n", "gp", "gp_n",
              "acc_real", "acc_fake", "acc_n", "twins", "twins_n")

    def __init__(self, cfg: TrainConfig, resume: str | Path | None = None, log: Callable[[str], None] = print,
                 t_start: float | None = None, write_outputs: bool = True, data: tuple | None = None,
                 retune: dict[str, Any] | None = None, given: set[str] | frozenset = frozenset()):
        self.t_start = time.time() if t_start is None else t_start
        self.say = log
        self.write_outputs = write_outputs
        resume_doc = None
        self.retuned: dict[str, tuple[Any, Any]] = {}
        if retune and resume is None:
            raise InputError("--retune changes the recipe of a resumed run; give --resume RUN with it")
        if resume is not None and cfg.init_g:
            raise InputError("--init-g starts a new run from a generator; a resumed run already has its G: "
                             "give --resume RUN or --init-g FILE, not both")
        if resume is not None:
            resume_doc = ckpt.read_state(resume)
            cfg = self._merge_resume_config(resume_doc["config"], cfg, given)
            cfg, self.retuned = self._retune(cfg, retune or {})
        self.dist = dist_utils.setup(cfg.device)
        self.device = self.dist.device
        self.is_main = self.dist.is_main

        # -- data -------------------------------------------------------------------------------
        if data is None:
            images, info = load_images(resolve_data_path(cfg.data), cfg.resolution,
                                       cache_dir=Path(".cache") / "atelier" / "datasets")
        else:
            images, info = data
        self.data_info = info
        cfg = finalize(cfg, info.resolution, self.dist.world_size)
        labels, self.class_names = None, []
        if cfg.cond:
            source = labels_source(cfg)
            names = image_names(resolve_data_path(cfg.data)) if data is None else None
            labels, self.class_names = load_labels(source, cfg.cond, len(images), names=names)
            if resume_doc is not None and cfg.c_dim != len(self.class_names):
                raise InputError(f"the checkpoint's networks have {cfg.c_dim} classes, but {cfg.labels} has "
                                 f"{len(self.class_names)} under {cfg.cond!r}; resume with the run's own labels")
            cfg.c_dim = len(self.class_names)
        elif cfg.c_dim:
            raise InputError(f"the config has {cfg.c_dim} classes but no --cond key to read them from")
        self.cfg = cfg
        self.batch_gpu = cfg.batch // self.dist.world_size
        self.loader = ImageBatches(images, cfg.batch, self.device, seed=cfg.seed, rank=self.dist.rank,
                                   world_size=self.dist.world_size, mirror=cfg.mirror, where=cfg.data_device,
                                   labels=labels, class_balance=cfg.class_balance)
        # fake images get class labels drawn from the data set's own (NVlabs: a random training image's label)
        self.label_pool = self.loader.labels          # the loader's device copy: [num_images] int64, or None
        self.class_balance_note = ""
        if cfg.class_balance > 0:
            # G's classes must come in the proportions D sees real ones in, or a conditional D could tell real
            # from fake by how often a class turns up: a pool holding each class by its balanced share
            pool = balanced_class_pool(labels, cfg.class_balance, cfg.c_dim)
            self.label_pool = torch.from_numpy(pool).to(self.device)
            self.class_balance_note = class_balance_note(labels, cfg.class_balance)
        self.c_eye = torch.eye(cfg.c_dim, device=self.device)
        self.class_noise_scale = None
        if cfg.noisy_twins and cfg.noisy_twins_beta > 0 and labels is not None:
            self.class_noise_scale = effective_number_scale(labels, cfg.noisy_twins_beta, cfg.c_dim)
        ref_idx = np.linspace(0, len(images) - 1, num=min(cfg.monitor_samples, len(images))).round().astype(int)
        self._monitor_real = torch.from_numpy(np.ascontiguousarray(images[ref_idx])).permute(0, 3, 1, 2)
        # class-conditional: up to 16 real images of every class, the yardstick of each class's own spread
        self._monitor_class_real = None
        if labels is not None and cfg.monitor_per_class and cfg.monitor_kimg > 0:
            lab = np.asarray(labels)
            idx = np.concatenate([np.flatnonzero(lab == c)[:MONITOR_CLASS_REFERENCE] for c in range(cfg.c_dim)])
            self._monitor_class_real = (torch.from_numpy(np.ascontiguousarray(images[idx])).permute(0, 3, 1, 2),
                                        torch.from_numpy(lab[idx].astype(np.int64)))

        # -- precision ----------------------------------------------------------------------------
        # TF32 and cuDNN autotuning are switched on only around the trainer's own work (_scope).
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        if self.amp_dtype is torch.float16 and self.device.type != "cuda":
            raise InputError("fp16 training needs a CUDA GPU; use --precision bf16 or fp32 on the CPU")
        self.channels_last = cfg.channels_last and self.device.type == "cuda"
        # Which op formulations run (same numbers, different kernels; models/ops.py). Set for the
        # duration of each iteration / render, so nothing leaks into other users of models.ops.
        self.kernels, self.kernels_note = _kernels.resolve_training(cfg.kernels, self.device, cfg.precision,
                                                                    cfg.tf32)
        # Every knob, the ones the setting leaves out at their reference choice: what runs follows
        # from the config alone, not from what else in the process last set models.ops to.
        self._impl = {**ops.DEFAULT_IMPL, **self.kernels}

        # -- networks -----------------------------------------------------------------------------
        torch.manual_seed(_mix(cfg.seed, 0x6E7))     # same initial weights on every rank
        G, D = build_networks(cfg)
        self.G = G.to(self.device).train()
        self.D = D.to(self.device).train()
        self.G_ema = copy.deepcopy(G).eval().requires_grad_(False)
        if self.channels_last:
            for m in (self.G, self.D, self.G_ema):
                m.to(memory_format=torch.channels_last)
                for sub in m.modules():
                    # Blocks keep their activations channels_last. The 4x4 synthesis block starts
                    # from a 3-D learned constant, which has no channels_last form (older
                    # models/stylegan2.py fails there); it is tiny, so it stays NCHW.
                    if getattr(sub, "in_channels", None) == 0 and hasattr(sub, "const"):
                        continue
                    if hasattr(sub, "channels_last") and isinstance(sub.channels_last, bool):
                        sub.channels_last = True
        if cfg.grad_checkpointing:
            syn = self.G.synthesis
            _checkpoint_blocks(syn, [n for n, _ in syn.named_children() if n.startswith(("b", "L"))])
            _checkpoint_blocks(self.D, [n for n, _ in self.D.named_children() if n.startswith("b") and n != "b4"])
        self.G_step = GeneratorStep(self.G, cfg.style_mixing)
        self.G_train = dist_utils.wrap(self.G_step, self.dist)
        self.D_train = dist_utils.wrap(self.D, self.dist)
        self.D_frozen = self.D                       # G phase: gradients reach the images, not D
        # The lazy R1 / path-length steps need double backward, which compiled graphs do not
        # support: they always run the eager modules.
        self.G_reg = self.G_train
        self.D_reg = self.D_train
        # The D step's images (no gradients; the unwrapped G: nothing for DDP to reduce).
        self.G_fake = self.G_step
        # "full" scope: the augmentation runs inside D's compiled graphs and G's no-grad pass is compiled too.
        # Eagerly those are ~1,500 small kernel launches per iteration (about 860 for the three augmentations,
        # 620 for G), which at 64x64 cost more host time than the GPU spends on them. Not under DDP, whose
        # compiled graphs are split at its gradient buckets; not for WGAN-GP, whose penalty needs the
        # augmented images themselves.
        self.fused_augment = cfg.compile and cfg.compile_scope == "full" and not self.dist.enabled \
            and cfg.loss == "r1"
        if cfg.compile:
            self.G_train = torch.compile(self.G_train)
            if self.fused_augment:
                self.G_fake = torch.compile(self.G_step)
                self.D_train = torch.compile(self._augmented(self.D_train))
                self.D_frozen = torch.compile(self._augmented(self.D_frozen))
            else:
                self.D_train = torch.compile(self.D_train)
                self.D_frozen = torch.compile(self.D_frozen)
        # The portable compile cache (--compile-cache): loaded before the first call compiles anything.
        self.compile_cache_loaded: dict | None = None
        if cfg.compile and cfg.compile_cache:
            from training import compile_cache

            self.compile_cache_loaded = compile_cache.load(cfg.compile_cache, self.device)

        # -- optimizers --------------------------------------------------------------------------
        self.opt_G, self.opt_D = self._build_optimizers()
        self.scaler_G = self.scaler_D = None
        if self.amp_dtype is torch.float16:
            self.scaler_G = torch.amp.GradScaler("cuda")
            self.scaler_D = torch.amp.GradScaler("cuda")

        # -- augmentation, regularizer state, monitor ---------------------------------------------
        self.aug: AugmentPipe | None = None
        self.ada: AdaController | None = None
        if cfg.aug != "none":
            self._enable_augment(cfg.aug_p, adaptive=cfg.aug == "ada", target=cfg.ada_target)
        self.pl_mean = torch.zeros((), device=self.device)
        self.monitor = CollapseMonitor(device=self.device) if cfg.monitor_kimg > 0 else None
        self.stats = torch.zeros(len(self._STATS), device=self.device)
        self.acc_since_monitor = torch.zeros(3, device=self.device)    # [acc_real, acc_fake, n]
        self.runtime = {"d_steps": cfg.d_steps, "d_dropout": 0.0, "mbstd_group": None}
        if cfg.d_dropout > 0:
            self._set_d_dropout(cfg.d_dropout)

        # -- counters ------------------------------------------------------------------------------
        self.freeze_until_nimg = 0   # D-only iterations while cur_nimg is below this (--freeze-g-kimg)
        self.g_frozen = False        # whether the last iteration left G alone (the log says so)
        self.step = 0            # iterations done
        self.cur_nimg = 0        # real images shown to D
        self.d_updates = 0
        self.g_updates = 0
        self.train_seconds = 0.0  # summed over all pieces of a resumed run
        self.pieces = 0
        self.sync_every_step = False   # the benchmark's plain baseline reads losses every step
        self.c_empty = torch.zeros(self.batch_gpu, 0, device=self.device)

        self.init_record = None
        self.init_d_record = None
        if resume_doc is not None:
            self._load(resume)
        else:
            if cfg.init_g:
                self.init_record = self._init_from_generator(cfg.init_g)
            if cfg.init_d:
                self.init_d_record = self._init_discriminator(cfg.init_d, keep_p="aug_p" in given)
            # D alone until here (G and G_ema fixed); a resumed run reads it from its state
            self.freeze_until_nimg = self.cur_nimg + int(round(cfg.freeze_g_kimg * 1000))
        self.out = Path(cfg.out)
        if self.is_main and self.write_outputs:
            self.out.mkdir(parents=True, exist_ok=True)
            if resume is not None:
                self._carry_log(Path(resume))
            for record in (self.init_record, self.init_d_record):
                if record is not None:
                    self._append_log(record)
            if self.retuned:
                self._append_log({"kind": "retune", "kimg": round(self.cur_nimg / 1000, 3),
                                  "changed": {k: {"from": a, "to": b} for k, (a, b) in self.retuned.items()}})
        if self.monitor is not None and self.monitor.state.real_distance <= 0:
            self.monitor.set_reference(to_float(self._monitor_real.to(self.device)))
        if (self.monitor is not None and self._monitor_class_real is not None
                and not self.monitor.state.class_real_distance):
            imgs, cls = self._monitor_class_real
            self.monitor.set_class_reference(to_float(imgs.to(self.device)), cls)

    # ------------------------------------------------------------------------------------------------
    # construction helpers

    def _init_from_generator(self, path: str | Path) -> dict:
        """G and G_ema <- an exported generator's weights (fp16 files are widened to fp32); the counters
        continue from its kimg and step, so snapshots, the log and EMA's ramp-up read as G's whole training.
        Returns the log record naming the source."""
        from models.stylegan2 import load_state_strict
        from training.export import exported_generator

        path = Path(path)
        if not path.is_file():
            raise InputError(f"--init-g {path}: no such file (give an exported generator, e.g. "
                             "assets/models/emoji64.safetensors or RUN/snapshots/G_ema-003400kimg.safetensors)")
        loaded, sd, progress = exported_generator(path)
        meta = loaded.config.get("metadata") or {}
        want = loaded.config.get("init_kwargs") or {}
        if int(want.get("c_dim", 0) or 0) != int(self.cfg.c_dim):
            raise InputError(f"--init-g {path.name} has {int(want.get('c_dim', 0) or 0)} classes, this run's G has "
                             f"{self.cfg.c_dim}: train with the same --cond (and --labels) as the generator")
        classes = (meta.get("classes") or {}).get("names")
        if self.cfg.c_dim and classes and list(classes) != list(self.class_names):
            raise InputError(f"--init-g {path.name} was trained on other class names than this run's labels "
                             f"({self.cfg.cond}): its class i would mean another class here")
        for net, what in ((self.G, "G"), (self.G_ema, "G_ema")):
            load_state_strict(net, sd, f"{what} from --init-g {path.name} (give this run the generator's network: "
                                       f"--cbase/--cmax/--cond as it was trained)")
        kimg = float(progress["kimg"] or 0.0)
        self.cur_nimg = int(round(kimg * 1000))
        step = progress["step"]
        self.step = int(step) if step is not None else self.cur_nimg // self.cfg.batch
        self.d_updates = self.g_updates = self.step
        self.train_seconds = float(progress["train_seconds"] or 0.0)
        self.say(f"[init] G and G_ema from {path} ({kimg:g} kimg)" + ("" if self.cfg.init_d else "; D starts fresh")
                 + (f", alone for {self.cfg.freeze_g_kimg:g} kimg" if self.cfg.freeze_g_kimg else ""))
        return {"kind": "init_g", "kimg": round(kimg, 3), "from": str(path), "sha256": loaded.sha256,
                "freeze_g_kimg": self.cfg.freeze_g_kimg}

    def _init_discriminator(self, path: str | Path, keep_p: bool = False) -> dict:
        """D <- a carried D state (checkpoint.write_d_state), ADA's p and controller with it unless --aug-p was
        given (`keep_p`). The state should come from the checkpoint whose G_ema --init-g loaded; one from another
        kimg still beats a fresh D, and the log line says how far apart they are. Returns the log record."""
        from models.stylegan2 import load_state_strict

        path = Path(path)
        meta, sd = ckpt.read_d_state(path)
        classes = (meta.get("classes") or {}).get("names")
        if self.cfg.c_dim and classes and list(classes) != list(self.class_names):
            raise InputError(f"--init-d {path.name} was trained on other class names than this run's labels "
                             f"({self.cfg.cond}): its class i would mean another class here")
        load_state_strict(self.D, sd, f"D from --init-d {path.name} (give this run the network it was trained "
                                      "with: --cbase/--cmax/--cond as for --init-g)")
        p_from = None
        if self.aug is not None and not keep_p and meta.get("aug_p") is not None:
            p_from = min(float(meta["aug_p"]), self.cfg.ada_max_p)
            self.aug.p.fill_(p_from)
            if self.ada is not None and meta.get("ada"):
                self.ada.load_state_dict(meta["ada"])
        d_kimg = meta.get("kimg")
        gap = None if d_kimg is None else round(self.cur_nimg / 1000 - float(d_kimg), 3)
        self.say(f"[init] D from {path} ({float(d_kimg or 0):g} kimg"
                 + (f", {abs(gap):g} kimg {'behind' if gap > 0 else 'ahead of'} G" if gap else ", G's kimg")
                 + (f"; ADA p {p_from:.3f}" if p_from is not None else "") + ")")
        return {"kind": "init_d", "kimg": round(self.cur_nimg / 1000, 3), "from": str(path),
                "d_kimg": d_kimg, "kimg_gap": gap, "aug_p": p_from}

    @staticmethod
    def _merge_resume_config(saved: dict, requested: TrainConfig, given: set[str] | frozenset = frozenset()
                             ) -> TrainConfig:
        """The saved config with the resumable settings the caller asked for. A setting counts as asked
        for when it is in `given` (given on the command line) or differs from the dataclass default;
        without `given`, an explicit value equal to the default (--snapshot-kimg 200) would be lost."""
        cfg = TrainConfig.from_dict(saved)
        for k in RESUME_OVERRIDABLE:
            default = getattr(TrainConfig(), k)
            v = getattr(requested, k)
            if k in given or v != default or k in ("out", "kimg", "minutes"):
                setattr(cfg, k, v)
        if not requested.data:
            cfg.data = saved["data"]
        return cfg

    @staticmethod
    def _retune(cfg: TrainConfig, retune: dict[str, Any]) -> tuple[TrainConfig, dict[str, tuple[Any, Any]]]:
        """cfg with the recipe settings in `retune` replaced; {name: (old, new)} of what changed."""
        unknown = sorted(set(retune) - set(RESUME_RETUNABLE))
        if unknown:
            raise InputError(f"--retune cannot change {', '.join(unknown)} (the networks, data and seed of a run "
                             f"are fixed); it can change {', '.join(RESUME_RETUNABLE)}")
        cfg = copy.deepcopy(cfg)
        changed = {}
        for k, v in retune.items():
            if v is not None and getattr(cfg, k) != v:
                changed[k] = (getattr(cfg, k), v)
                setattr(cfg, k, v)
        if "ada_max_p" in changed and cfg.aug_p > cfg.ada_max_p:
            # The run's initial/fixed p is above the new cap; the cap is what was asked for (the
            # restored p is clamped the same way in _load), so the saved aug_p follows it, logged.
            changed["aug_p"] = (cfg.aug_p, cfg.ada_max_p)
            cfg.aug_p = cfg.ada_max_p
        return cfg, changed

    def _optimizer_settings(self) -> tuple[tuple[float, tuple[float, float]], tuple[float, tuple[float, float]]]:
        """((lr, betas) of G, (lr, betas) of D) for this run's recipe, with the lazy-regularization adjustment
        (NVlabs: lr and betas ** (interval / (interval + 1)))."""
        cfg = self.cfg

        def lazy(lr, betas, interval):
            if not interval:
                return lr, betas
            r = interval / (interval + 1)
            return lr * r, tuple(b**r for b in betas)

        g_interval = cfg.pl_interval if cfg.pl_weight > 0 else 0
        d_interval = cfg.r1_interval if cfg.loss == "r1" else 0
        betas = (0.0, 0.99) if cfg.optimizer == "stylegan2" else (0.5, 0.9)   # else: the WGAN-GP recipe
        return lazy(cfg.lr_g, betas, g_interval), lazy(cfg.lr_d, betas, d_interval)

    def _build_optimizers(self):
        fused = self.device.type == "cuda"
        (lr_g, betas_g), (lr_d, betas_d) = self._optimizer_settings()
        if self.cfg.optimizer == "stylegan2":
            opt_G = torch.optim.Adam(self.G.parameters(), lr=lr_g, betas=betas_g, eps=1e-8, fused=fused)
        else:
            opt_G = torch.optim.RAdam(self.G.parameters(), lr=lr_g, betas=betas_g, eps=1e-8)
        opt_D = torch.optim.Adam(self.D.parameters(), lr=lr_d, betas=betas_d, eps=1e-8, fused=fused)
        return opt_G, opt_D

    def _enable_augment(self, p: float, adaptive: bool, target: float) -> None:
        self.aug = AugmentPipe(self.cfg.aug_pipe, p=p).to(self.device)
        if adaptive:
            self.ada = AdaController(self.aug, target=target, interval=self.cfg.ada_interval,
                                     speed_kimg=self.cfg.ada_kimg, batch=self.cfg.batch, device=self.device,
                                     max_p=self.cfg.ada_max_p)

    def _set_d_dropout(self, p: float) -> None:
        for m in self.D.modules():
            if hasattr(m, "dropout_p"):
                m.dropout_p = float(p)
                m.dropout = torch.nn.Dropout(p) if p > 0 else None
        self.runtime["d_dropout"] = float(p)

    def _set_mbstd_group(self, group: int) -> None:
        for m in self.D.modules():
            if type(m).__name__ == "MinibatchStdLayer":
                m.group_size = int(group)
        self.runtime["mbstd_group"] = int(group)

    def _mbstd_layer(self):
        for m in self.D.modules():
            if type(m).__name__ == "MinibatchStdLayer":
                return m
        return None

    # ------------------------------------------------------------------------------------------------
    # one iteration

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        return self.aug(x) if self.aug is not None else x

    def _augmented(self, d: Callable) -> Callable:
        """x, *c -> d(augment(x), *c): D with the augmentation in front, as one function to compile (it reads
        self.aug at each call, so a counter-measure that switches augmentation on is seen, by a recompile)."""
        def augmented_d(x, *c):
            return d(self._augment(x), *c)
        return augmented_d

    def _backward(self, loss: torch.Tensor, scaler) -> None:
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def _opt_step(self, opt, scaler) -> None:
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    def _gen_c(self, b: int) -> torch.Tensor:
        """Class labels for b generated images: one-hot rows drawn from the data's labels, or with a class balance
        from the balanced pool ([b, 0] when unconditional)."""
        if self.label_pool is None:
            return self.c_empty[:b]
        idx = torch.randint(0, self.label_pool.shape[0], (b,), device=self.device)
        return self.c_eye.index_select(0, self.label_pool.index_select(0, idx))

    def _real_c(self, labels: torch.Tensor | None, b: int) -> torch.Tensor:
        # rows of an identity matrix: a gather, where F.one_hot may check the indices on the host
        if labels is None:
            return self.c_empty[:b]
        return self.c_eye.index_select(0, labels)

    def _dc(self, c: torch.Tensor) -> tuple:
        """D's extra argument: the labels of a conditional D, nothing for an unconditional one."""
        return (c,) if self.cfg.c_dim else ()

    def _d_step(self, real: torch.Tensor, real_c: torch.Tensor) -> None:
        cfg = self.cfg
        b = real.shape[0]
        z = torch.randn(b, self.G.z_dim, device=self.device)
        gen_c = self._gen_c(b)
        with torch.no_grad(), self._autocast():
            fake = self.G_fake(z, gen_c, update_emas=True)[0]
        if self.channels_last:
            fake = fake.contiguous(memory_format=torch.channels_last)
        self.opt_D.zero_grad(set_to_none=True)
        wgan = cfg.loss == "wgan-gp"
        with dist_utils.no_sync(self.D_train):
            with self._autocast():
                fake_aug = fake if self.fused_augment else self._augment(fake)
                fake_logits = self.D_train(fake_aug, *self._dc(gen_c))
            loss_fake = losses.wgan_d_fake(fake_logits) if wgan else losses.logistic_d_fake(fake_logits)
            self._backward(loss_fake.mean(), self.scaler_D)
        sync_ctx = dist_utils.no_sync(self.D_train) if wgan else nullcontext()
        with sync_ctx:
            with self._autocast():
                real_aug = real if self.fused_augment else self._augment(real)
                real_logits = self.D_train(real_aug, *self._dc(real_c))
            loss_real = losses.wgan_d_real(real_logits, cfg.gp_drift) if wgan else losses.logistic_d_real(real_logits)
            self._backward(loss_real.mean(), self.scaler_D)
        if wgan:
            with self._autocast():
                # a conditional D scores the interpolates against the real images' labels
                gp, gp_logits = losses.gradient_penalty(lambda x: self.D_reg(x, *self._dc(real_c)), real_aug, fake_aug)
            self._backward((gp * cfg.gp_lambda + gp_logits.float().flatten() * 0).mean(), self.scaler_D)
            self.stats[8] += gp.detach().sum()
            self.stats[9] += b
        self._opt_step(self.opt_D, self.scaler_D)

        with torch.no_grad():
            self.stats[2] += (loss_fake + loss_real).detach().sum()
            self.stats[3] += b
            acc_r = (real_logits.detach() > 0).float().sum()
            acc_f = (fake_logits.detach() < 0).float().sum()
            self.stats[10] += acc_r
            self.stats[11] += acc_f
            self.stats[12] += b
            self.acc_since_monitor[0] += acc_r
            self.acc_since_monitor[1] += acc_f
            self.acc_since_monitor[2] += b       # a Python scalar: no host-to-device copy, no sync
            if self.ada is not None:
                self.ada.accumulate(real_logits)

    def _d_r1_step(self, real: torch.Tensor, real_c: torch.Tensor) -> None:
        cfg = self.cfg
        self.opt_D.zero_grad(set_to_none=True)
        real_aug = self._augment(real).detach().requires_grad_(True)
        with self._autocast():
            logits = self.D_reg(real_aug, *self._dc(real_c))
        penalty = losses.r1_penalty(real_aug, logits)
        gamma = cfg.r1_gamma_value()
        loss = penalty * (gamma / 2) * cfg.r1_interval + logits.float().flatten() * 0
        self._backward(loss.mean(), self.scaler_D)
        self._opt_step(self.opt_D, self.scaler_D)
        self.stats[4] += penalty.detach().sum()
        self.stats[5] += penalty.shape[0]

    def _twins_on(self) -> bool:
        """NoisyTwins is on from --noisy-twins-start-kimg: switch the embedding noise on the first time."""
        cfg = self.cfg
        if not cfg.noisy_twins or self.cur_nimg < cfg.noisy_twins_start_kimg * 1000:
            return False
        if not self.G_step.embed_noise:
            self.G_step.embed_noise = float(cfg.noisy_twins_sigma)
            if self.class_noise_scale is not None:
                self.G_step.class_noise = torch.from_numpy(self.class_noise_scale).float().to(self.device)
            if self.is_main:
                self.say(f"[twins] kimg {self.cur_nimg / 1000:g}: NoisyTwins on (weight {cfg.noisy_twins:g}, "
                         f"class-embedding noise {cfg.noisy_twins_sigma:g})")
        return True

    def _g_step(self, twins: bool = False) -> None:
        cfg = self.cfg
        b = self.batch_gpu
        _set_requires_grad(self.D, False)
        self.opt_G.zero_grad(set_to_none=True)
        if twins:
            # Twin pairs: rows i and h + i share z and class; their class embeddings get independent noise.
            h = b // 2
            z = torch.randn(h, self.G.z_dim, device=self.device).repeat(2, 1)
            gen_c = self._gen_c(h).repeat(2, 1)
            b = 2 * h
        else:
            z = torch.randn(b, self.G.z_dim, device=self.device)
            gen_c = self._gen_c(b)
        with self._autocast():
            img, ws = self.G_train(z, gen_c)
            if self.channels_last:
                img = img.contiguous(memory_format=torch.channels_last)
            logits = self.D_frozen(img if self.fused_augment else self._augment(img), *self._dc(gen_c))
        loss = losses.wgan_g(logits) if cfg.loss == "wgan-gp" else losses.logistic_g(logits)
        total = loss.mean()
        if twins:
            # ws[:, 0]: the mapping's own w (style mixing only replaces later ws)
            tw = losses.noisy_twins(ws[:h, 0], ws[h:, 0], cfg.noisy_twins_off_diagonal)
            total = total + cfg.noisy_twins * tw
            self.stats[13] += tw.detach()
            self.stats[14] += 1
        self._backward(total, self.scaler_G)
        self._opt_step(self.opt_G, self.scaler_G)
        _set_requires_grad(self.D, True)
        self.stats[0] += loss.detach().sum()
        self.stats[1] += b

    def _g_pl_step(self) -> None:
        cfg = self.cfg
        b = max(self.batch_gpu // cfg.pl_batch_shrink, 1)
        self.opt_G.zero_grad(set_to_none=True)
        z = torch.randn(b, self.G.z_dim, device=self.device)
        with self._autocast():
            img, ws = self.G_reg(z, self._gen_c(b))
        penalty = losses.path_length_penalty(img, ws, self.pl_mean, cfg.pl_decay)
        loss = penalty * cfg.pl_weight * cfg.pl_interval + img[:, 0, 0, 0].float() * 0
        self._backward(loss.mean(), self.scaler_G)
        self._opt_step(self.opt_G, self.scaler_G)
        self.stats[6] += penalty.detach().sum()
        self.stats[7] += b

    @torch.no_grad()
    def _update_ema(self) -> None:
        cfg = self.cfg
        ema_nimg = cfg.ema_kimg_value() * 1000
        if cfg.ema_rampup is not None:
            ema_nimg = min(ema_nimg, self.cur_nimg * cfg.ema_rampup)
        beta = 0.5 ** (cfg.batch / max(ema_nimg, 1e-8))
        ema_p = list(self.G_ema.parameters())
        torch._foreach_lerp_(ema_p, [p.detach() for p in self.G.parameters()], 1.0 - beta)
        torch._foreach_copy_(list(self.G_ema.buffers()), list(self.G.buffers()))

    @contextmanager
    def _scope(self):
        """The process-wide switches the trainer's work runs under (op formulations; on CUDA TF32 and
        cuDNN autotuning), set for one iteration or render and restored after it."""
        with ops.use_impl(**self._impl), backend_switches(self.device, self.cfg.tf32):
            yield

    def iteration(self) -> None:
        """One training iteration (d_steps D updates, one G update, EMA, ADA)."""
        with self._scope():
            self._iteration()

    def _iteration(self) -> None:
        cfg = self.cfg
        # All randomness of this iteration derives from (seed, rank, step): exact resume.
        torch.manual_seed(_mix(cfg.seed, self.dist.rank, self.step))
        g_frozen = self.cur_nimg < self.freeze_until_nimg      # --freeze-g-kimg: D catches up alone
        self.g_frozen = g_frozen
        twins = self._twins_on()      # before the D step, so that its fakes get the same embedding noise
        for _ in range(self.runtime["d_steps"]):
            real_u8, labels = self.loader.next_labeled()
            real = to_float(real_u8, self.channels_last)
            real_c = self._real_c(labels, real.shape[0])
            self._d_step(real, real_c)
            self.d_updates += 1
            if cfg.loss == "r1" and cfg.r1_interval > 0 and self.d_updates % cfg.r1_interval == 0:
                self._d_r1_step(real, real_c)
            self.cur_nimg += cfg.batch
        if not g_frozen:
            self._g_step(twins)
            self.g_updates += 1
            if cfg.pl_weight > 0 and self.g_updates % cfg.pl_interval == 0:
                self._g_pl_step()
        self.step += 1
        if not g_frozen:
            self._update_ema()
        if self.ada is not None and self.step % cfg.ada_interval == 0:
            self.ada.update(dist_utils.all_reduce_sum if self.dist.enabled else None)
        if self.sync_every_step:
            self.stats[0].item()

    # ------------------------------------------------------------------------------------------------
    # monitor and counter-measures

    @torch.no_grad()
    def render(self, n: int = 64, seed: int = GRID_SEED, psi: float = 1.0, batch: int = 64) -> torch.Tensor:
        """G_ema images [n, 3, R, R] in [-1, 1] for fixed latents (noise 'const')."""
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(n, self.G_ema.z_dim, generator=g).to(self.device)
        out = []
        with self._scope():
            for i in range(0, n, batch):
                zb = z[i:i + batch]
                out.append(self.G_ema(zb, grid_labels(self.cfg.c_dim, i, len(zb), self.device),
                                      truncation_psi=psi, noise_mode="const").float())
        return torch.cat(out)

    def render_classes(self, per_class: int, seed: int = GRID_SEED + 2, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """G_ema images of `per_class` fixed latents in every class (the same latents for each class), and their
        classes: what the monitor's class diversity measures."""
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(per_class, self.G_ema.z_dim, generator=g)
        classes = torch.arange(self.cfg.c_dim).repeat_interleave(per_class)
        zs = z.repeat(self.cfg.c_dim, 1)
        out = []
        with self._scope():
            for i in range(0, len(classes), batch):
                c = self.c_eye[classes[i:i + batch].to(self.device)]
                out.append(self.G_ema(zs[i:i + batch].to(self.device), c, truncation_psi=1.0,
                                      noise_mode="const").float())
        return torch.cat(out), classes

    def _run_monitor(self) -> dict:
        acc = self.acc_since_monitor.clone()
        if self.dist.enabled:
            dist_utils.all_reduce_sum(acc)
        a_real, a_fake, n = acc.tolist()
        self.acc_since_monitor.zero_()
        kimg = self.cur_nimg / 1000
        action = None
        record = None
        if self.is_main:
            samples = self.render(self.cfg.monitor_samples, seed=GRID_SEED + 1)
            # Reading p here costs nothing extra: acc.tolist() above already waited for the GPU.
            aug_p = float(self.aug.p) if self.aug is not None else None
            aug_ops = leak_prone_ops(self.aug.pipe) if self.aug is not None else []
            by_class = {}
            if self._monitor_class_real is not None and self.monitor.state.class_real_distance:
                cs, cc = self.render_classes(self.cfg.monitor_per_class)
                by_class = {"class_samples": cs, "sample_classes": cc}
            record = self.monitor.evaluate(samples, kimg, a_real / n if n else None, a_fake / n if n else None,
                                           aug_p=aug_p, leak_ops=aug_ops, **by_class)
            if self.cfg.auto_countermeasures:
                action = self.monitor.choose_countermeasure(record)
        action = dist_utils.broadcast_object(action, self.dist)
        if action is not None:
            detail = self._apply_countermeasure(action)
            if self.is_main:
                self.monitor.record_applied(kimg, action, detail)
                record["countermeasure"] = {"measure": action, "detail": detail}
        if record is not None:
            for w in record["warnings"]:
                self.say(f"[monitor] kimg {kimg:.1f}: WARNING {w}")
            if action is not None:
                self.say(f"[monitor] counter-measure applied: {record['countermeasure']['detail']}")
            self._append_log({"kind": "monitor", **record})
        if self.dist.enabled and self.monitor is not None:
            self.monitor.load_state_dict(dist_utils.broadcast_object(self.monitor.state_dict(), self.dist))
        return record or {}

    def _apply_countermeasure(self, measure: str) -> str:
        cfg = self.cfg
        if measure == "augment":
            if self.aug is None:
                self._enable_augment(0.0, adaptive=True, target=cfg.ada_target)
                return "augmentation switched on (ADA, target 0.6)"
            if self.ada is not None:
                self.ada.target = min(self.ada.target + 0.1, 0.8)
                return f"ADA target raised to {self.ada.target:.2f}"
            self.aug.p.fill_(min(float(self.aug.p) + 0.2, 0.8, self.cfg.ada_max_p))
            return f"fixed augmentation p raised to {float(self.aug.p):.2f}"
        if measure == "dropout":
            self._set_d_dropout(0.3)
            return "dropout 0.3 before the discriminator's last layer"
        if measure == "mbstd":
            layer = self._mbstd_layer()
            if layer is None:
                return "no minibatch-stddev layer in D (restart with mbstd_num_channels=1 to add one)"
            cur = min(layer.group_size or self.batch_gpu, self.batch_gpu)
            new = cur * 2
            if new > self.batch_gpu or self.batch_gpu % new:
                return f"minibatch-stddev group already {cur}; the per-GPU batch {self.batch_gpu} allows no larger"
            self._set_mbstd_group(new)
            return f"minibatch-stddev group size {cur} -> {new}"
        if measure == "d_steps":
            old = self.runtime["d_steps"]
            self.runtime["d_steps"] = min(old + 1, 5)
            return f"D:G update ratio {old}:1 -> {self.runtime['d_steps']}:1"
        raise InputError(f"unknown counter-measure {measure!r}")

    # ------------------------------------------------------------------------------------------------
    # logging, checkpoints

    def _append_log(self, record: dict) -> None:
        if not (self.is_main and self.write_outputs):
            return
        with open(self.out / LOG_FILE, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")

    def _carry_log(self, resume_dir: Path) -> None:
        """Keep the log up to the checkpoint (drop lines a crashed piece wrote after it)."""
        src = (resume_dir if resume_dir.is_dir() else resume_dir.parent) / LOG_FILE
        if not src.is_file():
            return
        kimg = self.cur_nimg / 1000
        kept = []
        for line in src.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if float(rec.get("kimg", 0)) <= kimg + 1e-9:
                kept.append(line)
        (self.out / LOG_FILE).write_text("".join(k + "\n" for k in kept))

    def _state(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "step": self.step, "cur_nimg": self.cur_nimg, "kimg": self.cur_nimg / 1000,
            "freeze_until_nimg": self.freeze_until_nimg,
            "d_updates": self.d_updates, "g_updates": self.g_updates,
            "train_seconds": self.train_seconds, "pieces": self.pieces,
            "sampler": self.loader.state_dict(),
            "classes": {"key": self.cfg.cond, "names": self.class_names} if self.cfg.c_dim else None,
            "pl_mean": float(self.pl_mean),
            "ada": self.ada.state_dict() if self.ada is not None else None,
            "aug_p": float(self.aug.p) if self.aug is not None else None,
            "aug_enabled": self.aug is not None,
            "acc_since_monitor": [float(v) for v in self.acc_since_monitor.tolist()],
            "runtime": dict(self.runtime),
            "monitor": self.monitor.state_dict() if self.monitor is not None else None,
            "scalers": {k: s.state_dict() for k, s in (("G", self.scaler_G), ("D", self.scaler_D)) if s is not None},
            "params": {"G": param_count(self.G), "D": param_count(self.D)},
            "dataset": {"source": self.data_info.source, "count": self.data_info.count,
                        "resolution": self.data_info.resolution},
            "env": {"torch": torch.__version__, "python": platform.python_version(),
                    "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                    "world_size": self.dist.world_size},
        }

    def save(self, folder: str | Path | None = None, grid: bool = True) -> dict[str, int]:
        """Checkpoint (rank 0 writes; every rank waits) and the sample grid."""
        folder = Path(folder) if folder is not None else self.out
        sizes = {}
        if self.is_main:
            sizes = ckpt.save_checkpoint(folder, {"G": self.G, "G_ema": self.G_ema, "D": self.D},
                                         {"opt_G": self.opt_G, "opt_D": self.opt_D}, self._state())
            if grid:
                self.save_grid(folder / GRID_FILE)
            if self.cfg.snapshot_ema:
                self.save_ema_snapshot(folder)
        dist_utils.barrier(self.dist)
        return sizes

    def save_ema_snapshot(self, folder: Path) -> Path:
        """G_ema as fp16 safetensors + JSON in folder/snapshots/ (what the studio and the metrics load)."""
        from models.stylegan import save_generator

        kimg = self.cur_nimg / 1000
        path = Path(folder) / SNAPSHOT_DIR / f"G_ema-{int(round(kimg)):06d}kimg.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        return save_generator(self.G_ema, path, self.cfg.arch, dtype="fp16",
                              metadata={"kimg": round(kimg, 3), "step": self.step, "preset": self.cfg.preset,
                                        "train_seconds": round(self.train_seconds, 1),
                                        **({"classes": {"key": self.cfg.cond, "names": self.class_names}}
                                           if self.cfg.c_dim else {})})

    def save_grid(self, path: Path, psi: float = 1.0) -> None:
        from PIL import Image

        from core.atomic import write_atomic

        imgs = to_uint8_hwc(self.render(64, psi=psi))
        grid = Image.fromarray(image_grid(imgs, 8))
        write_atomic(path, lambda tmp: grid.save(tmp, format="PNG"))   # the train view polls this file

    def _load(self, folder) -> None:
        doc, tensors = ckpt.load_checkpoint(folder)
        from models.stylegan2 import load_state_strict

        load_state_strict(self.G, tensors["G"], "generator (G) of the checkpoint")
        load_state_strict(self.G_ema, tensors["G_ema"], "generator (G_ema) of the checkpoint")
        load_state_strict(self.D, tensors["D"], "discriminator of the checkpoint")
        compact = doc.get("compact")
        if compact:
            # A compact (travel) checkpoint: 16-bit networks, no optimizer moments. Adam starts afresh
            # (training/checkpoint.py compact_checkpoint says why that is close to the full resume).
            if self.cfg.optimizer != "stylegan2":
                raise InputError(f"{folder} is a compact checkpoint (no optimizer state); only the stylegan2 "
                                 f"optimizer (Adam, beta1 = 0) resumes from one, this run uses {self.cfg.optimizer}")
            self.say(f"[resume] compact checkpoint ({compact.get('dtype')} networks): Adam's moments start afresh")
        else:
            ckpt.load_optimizer(self.opt_G, tensors["opt_G"], doc["optimizers"]["opt_G"], "G")
            ckpt.load_optimizer(self.opt_D, tensors["opt_D"], doc["optimizers"]["opt_D"], "D")
        if self.retuned:
            # The saved param_groups carry the old learning rates and betas; the retuned recipe's win.
            for opt, (lr, betas) in zip((self.opt_G, self.opt_D), self._optimizer_settings()):
                for group in opt.param_groups:
                    group["lr"], group["betas"] = lr, betas
        self.step = int(doc["step"])
        self.cur_nimg = int(doc["cur_nimg"])
        self.freeze_until_nimg = int(doc.get("freeze_until_nimg", 0))
        self.d_updates = int(doc["d_updates"])
        self.g_updates = int(doc["g_updates"])
        self.train_seconds = float(doc.get("train_seconds", 0.0))
        self.pieces = int(doc.get("pieces", 0))
        self.loader.load_state_dict(doc["sampler"], allow_batch_change="batch" in self.retuned)
        self.pl_mean.fill_(float(doc["pl_mean"]))
        if doc.get("aug_enabled") and self.aug is None:
            self._enable_augment(0.0, adaptive=doc.get("ada") is not None, target=self.cfg.ada_target)
        if self.aug is not None and doc.get("aug_p") is not None:
            self.aug.p.fill_(float(doc["aug_p"]))
        if self.ada is not None and doc.get("ada"):
            self.ada.load_state_dict(doc["ada"])
            if "ada_target" in self.retuned:
                self.ada.target = self.cfg.ada_target
        if self.aug is not None:
            # A run retuned to a lower --ada-max-p starts at the cap, not above it (a host-side fill at load).
            self.aug.p.fill_(min(float(self.aug.p), self.cfg.ada_max_p))
        self.acc_since_monitor.copy_(torch.tensor(doc["acc_since_monitor"], dtype=torch.float32))
        rt = doc.get("runtime", {})
        self.runtime["d_steps"] = int(self.cfg.d_steps if "d_steps" in self.retuned else rt.get("d_steps", self.cfg.d_steps))
        if rt.get("d_dropout"):
            self._set_d_dropout(float(rt["d_dropout"]))
        if rt.get("mbstd_group"):
            self._set_mbstd_group(int(rt["mbstd_group"]))
        if self.monitor is not None and doc.get("monitor"):
            self.monitor.load_state_dict(doc["monitor"])
        for k, s in (("G", self.scaler_G), ("D", self.scaler_D)):
            if s is not None and k in doc.get("scalers", {}):
                s.load_state_dict(doc["scalers"][k])
        self.say(f"[resume] {folder}: kimg {self.cur_nimg / 1000:.1f}, iteration {self.step}, "
                 f"aug p {float(self.aug.p) if self.aug is not None else 0:.3f}"
                 + ("; retuned " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.retuned.items())
                    if self.retuned else ""))

    # ------------------------------------------------------------------------------------------------
    # the run

    def describe(self) -> str:
        cfg = self.cfg
        sizes = checkpoint_bytes(self.G, self.D)
        mib = {k: v / 2**20 for k, v in sizes.items()}
        return (f"G {param_count(self.G) / 1e6:.2f} M params, D {param_count(self.D) / 1e6:.2f} M; checkpoint "
                + ", ".join(f"{k} {v:.1f}" for k, v in mib.items()) + f" MiB (total {sum(mib.values()):.1f} MiB); "
                f"{self.data_info.count} images {cfg.resolution}px ({self.data_info.decoder}, data on "
                f"{self.device.type if self.loader.where == 'gpu' else self.loader.where}); batch {cfg.batch} ({self.batch_gpu}/GPU x {self.dist.world_size}), "
                f"lr G {cfg.lr_g:g} D {cfg.lr_d:g}, loss {cfg.loss}, D:G {self.runtime['d_steps']}:1, "
                f"R1 gamma {cfg.r1_gamma_value():g}, EMA {cfg.ema_kimg_value():g} kimg, precision {cfg.precision}, "
                f"channels_last {self.channels_last}, compile {cfg.compile}, kernels {self.kernels_note}, "
                f"aug {cfg.aug}/{cfg.aug_pipe}"
                + (f", compile scope {cfg.compile_scope} (augmentation {'inside' if self.fused_augment else 'outside'} "
                   f"D's graphs)" if cfg.compile else "")
                + (f"; D alone until kimg {self.freeze_until_nimg / 1000:g}" if self.cur_nimg < self.freeze_until_nimg
                   else "")
                + (f"; {cfg.c_dim} classes ({cfg.cond}), {self.class_balance_note}" if self.class_balance_note else "")
                + (f"; NoisyTwins weight {cfg.noisy_twins:g}, class-embedding noise {cfg.noisy_twins_sigma:g}"
                   + (f", from kimg {cfg.noisy_twins_start_kimg:g}" if cfg.noisy_twins_start_kimg else "")
                   + (f", per class x{self.class_noise_scale[self.class_noise_scale > 0].min():.2g}"
                      f"-x{self.class_noise_scale.max():.2g} (beta {cfg.noisy_twins_beta:g})"
                      if self.class_noise_scale is not None else "")
                   if cfg.noisy_twins else ""))

    def run(self) -> dict[str, Any]:
        """Train until `kimg` or the wall-clock budget; save; return a summary."""
        cfg = self.cfg
        self.pieces += 1
        if self.is_main:
            self.say("[train] " + self.describe())
        budget = cfg.minutes * 60 if cfg.minutes else None
        total_nimg = int(cfg.kimg * 1000)
        bar = None
        if self.is_main and cfg.progress:
            try:
                from tqdm import tqdm

                bar = tqdm(total=round(cfg.kimg, 1), initial=round(self.cur_nimg / 1000, 1), unit="kimg",
                           dynamic_ncols=True, smoothing=0.1)
            except ImportError:
                bar = None

        def crossed(every_kimg: float, before: int, after: int) -> bool:
            if every_kimg <= 0:
                return False
            k = every_kimg * 1000
            return int(after // k) > int(before // k)

        # SIGTERM / Ctrl-C (e.g. the Train tab's Stop button) ends the run at the next log point
        # with a normal checkpoint, instead of losing everything since the last snapshot.
        self._stop_requested = False
        previous = {}

        def request_stop(signum, frame):
            self._stop_requested = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, request_stop)
            except ValueError:      # not the main thread: the caller handles stopping
                pass
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t_piece = time.time()
        t_last = time.time()
        nimg_last = self.cur_nimg
        last_snapshot_time = time.time()
        stop_reason = "kimg"
        interval_seconds = 0.0
        if self.is_main and self.compile_cache_loaded is not None:
            self.say("[compile] " + self._compile_cache_note())
        elif self.is_main and cfg.compile_cache:
            self.say(f"[compile] --compile-cache {cfg.compile_cache} is not used: it keeps torch.compile's work, and "
                     "this run does not compile (add --compile)")
        first_iteration_s = None           # host time of this piece's first iteration: where torch.compile works
        compile_logged = False
        step_last, first_interval = self.step, True
        while self.cur_nimg < total_nimg:
            before = self.cur_nimg
            t_it = time.time()
            self.iteration()
            if first_iteration_s is None:
                first_iteration_s = time.time() - t_it
            monitor_due = self.monitor is not None and crossed(cfg.monitor_kimg, before, self.cur_nimg)
            snapshot_due = crossed(cfg.snapshot_kimg, before, self.cur_nimg)
            if self.step % cfg.log_every == 0 or self.cur_nimg >= total_nimg:
                # The only regular host synchronisation point.
                stats = self.stats.clone()
                if self.dist.enabled:
                    dist_utils.all_reduce_sum(stats)
                vals = dict(zip(self._STATS, stats.tolist()))
                self.stats.zero_()
                now = time.time()
                interval_seconds = now - t_last
                self.train_seconds += interval_seconds
                img_s = (self.cur_nimg - nimg_last) / max(interval_seconds, 1e-9)
                record = self._log_record(vals, img_s)
                self._append_log(record)
                if cfg.compile and self.is_main and not compile_logged:
                    self._log_compile(first_iteration_s)
                    compile_logged = True        # once a piece
                if bar is not None:
                    bar.n = round(self.cur_nimg / 1000, 1)
                    bar.set_postfix_str(f"{img_s:,.0f} img/s G {record['loss_G']:.3f} D {record['loss_D']:.3f} "
                                        f"p {record['aug_p']:.3f} mem {record['mem_gib']:.1f}G", refresh=True)
                elif self.is_main:
                    self.say(f"[train] kimg {record['kimg']:.1f} it {self.step} {img_s:,.0f} img/s "
                             f"G {record['loss_G']:.4f} D {record['loss_D']:.4f} p {record['aug_p']:.3f}")
                decision = None
                if self.is_main:
                    elapsed = now - self.t_start
                    if self._stop_requested:
                        decision = "signal"
                    elif budget is not None and elapsed + next_interval_estimate(
                            interval_seconds, first_iteration_s if first_interval else None,
                            self.step - step_last) + cfg.reserve_seconds >= budget:
                        decision = "stop"
                    elif cfg.snapshot_minutes > 0 and now - last_snapshot_time >= cfg.snapshot_minutes * 60:
                        decision = "snapshot"
                t_last, nimg_last, step_last, first_interval = now, self.cur_nimg, self.step, False
                decision = dist_utils.broadcast_object(decision, self.dist)
                if decision in ("stop", "signal"):
                    stop_reason = "time budget" if decision == "stop" else "stop requested"
                    break
                if decision == "snapshot":
                    snapshot_due = True
            if monitor_due:
                self._run_monitor()
            if snapshot_due and self.write_outputs and self.cur_nimg < total_nimg:
                self._flush_stats_for_snapshot()
                self.save()
                last_snapshot_time = time.time()
        if bar is not None:
            bar.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # Make sure the saved state has no half-interval stats (they are per-log, not part of training).
        self._flush_stats_for_snapshot()
        if cfg.compile and cfg.compile_cache and self.is_main:
            from training import compile_cache

            if first_iteration_s is not None and not compile_logged:
                self._log_compile(first_iteration_s)       # the piece ended before its first log point
            else:
                compile_cache.save(cfg.compile_cache, self.device,    # anything compiled since (a recompile)
                                   self.compile_cache_loaded)
        sizes = self.save() if self.write_outputs else {}
        summary = {
            "stop_reason": stop_reason, "kimg": self.cur_nimg / 1000, "iterations": self.step,
            "piece_seconds": time.time() - t_piece, "train_seconds": self.train_seconds,
            "peak_mem_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30
                             if self.device.type == "cuda" else 0.0),
            "checkpoint_mib": {k: round(v / 2**20, 2) for k, v in sizes.items()},
            "out": str(self.out),
        }
        if self.is_main:
            self._append_log({"kind": "end", **summary})
            self.say(f"[train] stopped ({stop_reason}) at kimg {summary['kimg']:.1f} after "
                     f"{summary['piece_seconds']:.0f} s; checkpoint in {self.out}")
        return summary

    def close(self) -> None:
        """Release the DDP wrappers (and the process group they hold) before the group is destroyed.

        gloo's worker threads are joined when the last reference to its process group goes; if that
        happens during interpreter shutdown instead, the process can abort ("terminate called without
        an active exception") after a perfectly good run. Dropping the wrappers here makes the order
        deterministic: wrappers first, then dist_utils.cleanup() destroys the group."""
        import gc

        for name in ("G_train", "D_train", "G_reg", "D_reg"):
            if hasattr(self, name):
                setattr(self, name, None)
        gc.collect()

    def _compile_cache_note(self) -> str:
        got = self.compile_cache_loaded or {}
        if got.get("error"):
            return (f"compile cache: {got.get('file') or self.cfg.compile_cache} not used ({got['error']}); "
                    "compiling from scratch")
        if got.get("file"):
            return f"compile cache: loaded {got['file']} ({got['artifacts']} artifacts, {got['mib']:.1f} MiB)"
        return (f"compile cache: none for this GPU in {self.cfg.compile_cache} yet; compiling from scratch and "
                "saving it after the first log point")

    def _log_compile(self, first_iteration_s: float) -> None:
        """A `compile` record after the first log point: how long the first iteration took (the compile), the
        cache's hits and misses, and (--compile-cache) the saved file."""
        from training import compile_cache

        saved = (compile_cache.save(self.cfg.compile_cache, self.device, self.compile_cache_loaded)
                 if self.cfg.compile_cache else None)
        hits = compile_cache.counters()
        record = {"kind": "compile", "kimg": round(self.cur_nimg / 1000, 3), "step": self.step,
                  "first_iteration_s": round(first_iteration_s, 2), **hits,
                  "cache_loaded": self.compile_cache_loaded, "cache_saved": saved}
        self._append_log(record)
        self.say(f"[compile] first iteration {first_iteration_s:.1f} s; FX-graph cache {hits['fx_hit']} hits, "
                 f"{hits['fx_miss']} misses; AOT-autograd cache {hits['aot_hit']} hits, {hits['aot_miss']} misses"
                 + (f"; not saved ({saved['error']})" if saved and saved.get("error")
                    else f"; saved {saved['file']} ({saved['mib']:.1f} MiB)" if saved
                    else "; every graph came from the loaded file, so it is not saved again"
                    if compile_cache.covered(self.compile_cache_loaded) else ""))

    def _flush_stats_for_snapshot(self) -> None:
        if self.dist.enabled:
            dist_utils.barrier(self.dist)
        self.stats.zero_()

    def _log_record(self, v: dict, img_s: float) -> dict:
        def mean(s, n):
            return v[s] / v[n] if v[n] else None

        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        return {
            "kind": "train", "kimg": round(self.cur_nimg / 1000, 3), "step": self.step,
            "time": round(time.time() - self.t_start, 2), "train_seconds": round(self.train_seconds, 2),
            "img_s": round(img_s, 1), "kimg_s": round(img_s / 1000, 4),
            "loss_G": mean("g_loss", "g_n") or 0.0, "loss_D": mean("d_loss", "d_n") or 0.0,
            "r1": mean("r1", "r1_n"), "pl": mean("pl", "pl_n"), "gp": mean("gp", "gp_n"),
            "d_acc_real": mean("acc_real", "acc_n"), "d_acc_fake": mean("acc_fake", "acc_n"),
            "aug_p": float(self.aug.p) if self.aug is not None else 0.0,
            "ada_rt": float(self.ada.last_rt) if self.ada is not None else None,
            "pl_mean": float(self.pl_mean), "d_steps": self.runtime["d_steps"], "mem_gib": round(mem, 3),
            **({"twins": mean("twins", "twins_n")} if v.get("twins_n") else {}),
            **({"g_frozen": True} if self.g_frozen else {}),
        }


def train(cfg: TrainConfig, resume: str | Path | None = None, log: Callable[[str], None] = print,
          t_start: float | None = None, retune: dict[str, Any] | None = None,
          given: set[str] | frozenset = frozenset()) -> dict[str, Any]:
    """Train per `cfg` (resuming from a run folder if given, with `retune`'s recipe changes); returns the
    run summary."""
    trainer = Trainer(cfg, resume=resume, log=log, t_start=t_start, retune=retune, given=given)
    try:
        return trainer.run()
    finally:
        if trainer.dist.enabled:
            trainer.close()
            dist_utils.cleanup()
