"""Training runs as child processes: start, follow, stop, list and export them (the studio's Train tab).

A run is `python -m training.cli ... --out RUNS/NAME` in a process group of its own, so
that training never shares the studio's interpreter (a crash, an out-of-memory kill or a
long checkpoint write cannot take the studio down) and Stop reaches every process the run
started. The manager adds three files to the run folder the trainer writes:

    run.json     what was asked (the request, the command line, pid, start time)
    stdout.log   the trainer's own lines ("[train] ...", "[monitor] ... WARNING ...")
    stderr.log   errors and tracebacks; the last lines become a failed run's message

Everything else is read from the trainer's files: `log.jsonl` (one record per log point,
kinds `train`, `monitor`, `end`), `samples.png` (the latest grid) and `state.json` (the
checkpoint). Because the state lives on disk, a studio restarted while a run goes on finds
it again (run.json's pid, checked against /proc), and runs started from the command line
are listed as well.

Stop sends SIGTERM to the group: the trainer finishes the iteration, writes a checkpoint
and exits (training/trainer.py); if it has not exited after `grace_s`, SIGKILL follows.
Nothing here imports torch: the studio imports this module at start-up.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from core.errors import InputError, ResourceError
from training.config import AUG_MODES, AUG_PIPES, LOSSES, PRESETS, build_config, finalize

ROOT = Path(__file__).resolve().parent.parent
RUN_FILE = "run.json"
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
LOG_FILE = "log.jsonl"          # written by training/trainer.py (same names there)
GRID_FILE = "samples.png"
STATE_FILE = "state.json"

RUNNING, STOPPING, FINISHED, STOPPED, FAILED, INTERRUPTED, NEW = (
    "running", "stopping", "finished", "stopped", "failed", "interrupted", "new")
ACTIVE_STATES = (RUNNING, STOPPING)
DATA_SUFFIXES = (".zip", ".npy", ".npz")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
ERROR_LINES = 12                # stderr lines kept as a failed run's message


def resolve_data(data: str) -> Path:
    """A path as the trainer will find it (relative paths: the working folder, then the repository)."""
    p = Path(data).expanduser()
    if not p.exists() and not p.is_absolute() and (ROOT / p).exists():
        p = ROOT / p
    return p.resolve() if p.exists() else p


def generator_info(path: str | Path) -> dict[str, Any]:
    """What an exported generator's .json says, without reading its weights: arch, init_kwargs, and from its
    metadata the kimg it was trained for, its preset and its class key (None where the file does not say).
    A G_ema snapshot has these at the top of its metadata, an exported model under "training"."""
    from models.catalogue import SIDE_FORMAT

    side = Path(path).with_suffix(".json")
    try:
        doc = json.loads(side.read_text())
    except FileNotFoundError:
        raise InputError(f"{Path(path).name} has no {side.name} beside it: an exported generator is the "
                         ".safetensors and its .json (Export to studio and --snapshot-ema write both)") from None
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != SIDE_FORMAT:
        raise InputError(f"{side.name} is not the config of an exported StyleGAN generator "
                         f"(format {SIDE_FORMAT!r})")
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    nested = meta.get("training") if isinstance(meta.get("training"), dict) else {}
    classes = meta.get("classes") if isinstance(meta.get("classes"), dict) else {}
    kimg = meta.get("kimg", nested.get("kimg"))
    return {"arch": doc.get("arch"), "init_kwargs": doc.get("init_kwargs") or {},
            "kimg": float(kimg) if isinstance(kimg, (int, float)) else None,
            "preset": meta.get("preset", nested.get("preset")), "class_key": classes.get("key")}


def generator_files(folders: Iterable[str | Path]) -> dict[str, Path]:
    """The exported generators in `folders` a run can start from (init_g), by the name the Train tab lists:
    the file's stem, or 'stem (folder)' when an earlier folder has one of that name. Only the studio's own
    .safetensors with their .json (what --init-g loads): no NVlabs pickles, no run folders."""
    from models.catalogue import scan_stylegan

    found: dict[str, Path] = {}
    for folder in folders:
        for e in scan_stylegan(Path(folder), "local"):
            p = Path(e.path or "")
            if p.suffix != ".safetensors" or not p.is_file() or p.resolve() in {q.resolve() for q in found.values()}:
                continue
            found.setdefault(p.stem if p.stem not in found else f"{p.stem} ({p.parent.name})", p)
    return found


@dataclass(frozen=True)
class TrainRequest:
    """What the Train tab (or an API client) asks for. 0 / None = the preset's default."""

    data: str = ""                      # folder of images, .zip, .npy/.npz/.npy.xz
    preset: str = "stylegan2"
    resolution: int = 0                 # 0 = the data's own
    kimg: float = 0.0                   # length in thousand real images (0 = the preset's)
    minutes: float = 0.0                # or a wall-clock budget
    batch: int = 0
    loss: str = "r1"
    d_steps: int = 0                    # D:G ratio; 0 = the loss's default (r1 1:1, wgan-gp 5:1)
    aug: str = "ada"
    aug_p: float = 0.0                  # initial (ada) or fixed probability
    aug_pipe: str = ""                  # blit, geom, color, bg, bgc, bgcc or upright; "" = the preset's
    ada_max_p: float = 0.0              # cap on ADA's p, in (0, 1]; 0 = the preset's (1.0 = none; emoji64 0.6)
    auto_countermeasures: bool = False
    monitor_kimg: float = 0.0           # mode-collapse monitor every N kimg; 0 = the preset's
    log_every: int = 0                  # iterations between log records; 0 = the preset's
    name: str = ""                      # run folder name under the runs folder ("" = preset-date-time)
    resume: bool = False                # continue the run of that name from its checkpoint
    retune: bool = False                # with resume: take this request's batch, d_steps, aug, aug_pipe, ada_max_p
    device: str | None = None           # cuda, cuda:N, cpu; None = the best available
    seed: int | None = None
    extra_args: tuple[str, ...] = ()    # more `app.py train` options, passed as given
    cond: str = ""                      # class-conditional on the class indices under this key ("" = unconditional)
    labels: str = ""                    # the labels JSON ("" = the preset's, or the data set's own dataset.json)
    init_g: str = ""                    # a new run's G and G_ema start from this exported generator (.safetensors)
    freeze_g_kimg: float = 0.0          # the run's first N kimg train D alone (a fresh D catches up with G)
    cbase: int = 0                      # channel base / most channels of G and D; 0 = the preset's (with init_g:
    cmax: int = 0                       # the generator's, when they differ from the preset's)
    class_balance: float = 0.0          # with cond: 0 = classes as often as the data has them, 0.5 = square root,
                                        # 1 = every class equally often (docs/training.md, "Class balance")
    noisy_twins: float = 0.0            # with cond: NoisyTwins weight against class-wise mode collapse (0 = off;
                                        # the paper's 0.001-0.01; docs/training.md, "NoisyTwins")
    noisy_twins_sigma: float = 0.0      # std of its class-embedding noise; 0 = the trainer's (0.25)

    def checked(self) -> "TrainRequest":
        """The same request with defaults filled in; raises InputError on what the trainer would refuse."""
        if self.preset not in PRESETS:
            raise InputError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.loss not in LOSSES:
            raise InputError(f"the loss must be one of {', '.join(LOSSES)}; got {self.loss!r}")
        if self.aug not in AUG_MODES:
            raise InputError(f"augmentation must be one of {', '.join(AUG_MODES)}; got {self.aug!r}")
        res = int(self.resolution or 0)
        if res and (res < 8 or res & (res - 1)):
            raise InputError(f"the resolution must be a power of two of at least 8 (8, 16, … 256, 512, 1024) "
                             f"or 0 for the data's own size; got {res}")
        data = (self.data or "").strip()
        if not data and self.preset != "emoji64" and not self.resume:
            raise InputError("give the training data: a folder of images, a .zip, or an .npy/.npz/.npy.xz array")
        if data:
            p = resolve_data(data)
            if not p.exists():
                raise InputError(f"training data not found: {data}; give a folder of images, a .zip, "
                                 "or an .npy/.npz/.npy.xz array that exists on the studio's machine")
            if p.is_file() and not (p.suffix.lower() in DATA_SUFFIXES or p.name.endswith(".npy.xz")):
                raise InputError(f"{p.name} is not training data: give a folder of images, a .zip, "
                                 "or an .npy/.npz/.npy.xz array")
            data = str(p)
        kimg, minutes = float(self.kimg or 0), float(self.minutes or 0)
        if kimg < 0 or minutes < 0:
            raise InputError("kimg and minutes must be positive (or 0 for the preset's length)")
        if self.batch and (self.batch < 2 or self.batch % 2):
            raise InputError(f"the batch must be an even number of at least 2 (or 0 for the preset's); got {self.batch}")
        if self.d_steps and not 1 <= self.d_steps <= 10:
            raise InputError(f"the D:G ratio must be 1..10 D steps per G step (or 0 for the loss's default); "
                             f"got {self.d_steps}")
        if not 0.0 <= float(self.aug_p or 0) <= 1.0:
            raise InputError(f"the augmentation probability must be in [0, 1]; got {self.aug_p}")
        pipe = (self.aug_pipe or "").strip()
        if pipe and pipe not in AUG_PIPES:
            raise InputError(f"the augmentation pipe must be one of {', '.join(AUG_PIPES)} (upright: no flips or "
                             f"rotations, for emoji, text and logos), or empty for the preset's; got {pipe!r}")
        max_p = float(self.ada_max_p or 0)
        if not 0.0 <= max_p <= 1.0:
            raise InputError(f"the cap on ADA's p (Max p) must be in (0, 1], or 0 for the preset's "
                             f"(1.0 = no cap; emoji64: 0.6); got {self.ada_max_p}")
        if self.retune and not self.resume:
            raise InputError("Retune changes the recipe of a run being resumed: tick Resume it as well (the run "
                             "name is the run to continue), or untick Retune to start a new run")
        cond, labels = (self.cond or "").strip(), (self.labels or "").strip()
        if labels and not cond:
            raise InputError("a labels file is read only for class-conditional training: give the class key "
                             "(e.g. group for emoji64, any name for NVlabs' dataset.json), or clear the labels file")
        if cond and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", cond):
            raise InputError(f"the class key {cond!r}: use letters, digits, '.', '_' and '-' (the key of the "
                             "per-image class indices in the labels file)")
        if labels:
            lp = resolve_data(labels)
            if not lp.is_file():
                raise InputError(f"labels file not found: {labels}; give a JSON file on the studio's machine")
            labels = str(lp)
        balance = float(self.class_balance or 0)
        if not 0.0 <= balance <= 1.0:        # (NaN too)
            raise InputError(f"the class balance must be between 0 and 1 (0 = classes as often as your images have "
                             f"them, 0.5 = square-root: small classes more often, 1 = every class equally often); "
                             f"got {self.class_balance}")
        twins, twins_sigma = float(self.noisy_twins or 0), float(self.noisy_twins_sigma or 0)
        if not (twins >= 0 and math.isfinite(twins)):        # (NaN too)
            raise InputError(f"the NoisyTwins weight must be a number of 0 or more (0 = off; the paper used 0.001 to "
                             f"0.05); got {self.noisy_twins}")
        if not (twins_sigma >= 0 and math.isfinite(twins_sigma)):
            raise InputError(f"the twins noise must be a number of 0 or more (0 = the trainer's 0.25; the paper used "
                             f"0.1 to 0.75); got {self.noisy_twins_sigma}")
        if int(self.cbase or 0) < 0 or int(self.cmax or 0) < 0:
            raise InputError(f"the channel base and most channels must be positive (or 0 for the preset's); "
                             f"got {self.cbase}, {self.cmax}")
        init_g, freeze = (self.init_g or "").strip(), float(self.freeze_g_kimg or 0)
        if not freeze >= 0:        # (NaN too)
            raise InputError(f"'Train D alone first' must be 0 or more kimg (0 = G trains from the start); "
                             f"got {self.freeze_g_kimg}")
        if init_g and self.resume:
            raise InputError("Resume continues the run's own checkpoint (its G, D and counters), and a generator "
                             "starts a new run: untick Resume to start a new run from the generator, or clear the "
                             "generator to continue the run")
        if freeze and self.resume:
            # the boundary is in the checkpoint (training/trainer.py): a resumed run would drop this without a word
            raise InputError("a resumed run keeps the D-alone boundary of its checkpoint; set 'Train D alone first' "
                             "to 0 to resume, or start a new run")
        name = (self.name or "").strip()
        if name and not NAME_RE.match(name):
            raise InputError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (at most 64), "
                             "starting with a letter or digit")
        name = name or f"{self.preset}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        req = TrainRequest(**{**asdict(self), "data": data, "resolution": res, "kimg": kimg, "minutes": minutes,
                              "aug_pipe": pipe, "ada_max_p": max_p, "name": name, "cond": cond, "labels": labels,
                              "init_g": init_g, "freeze_g_kimg": freeze, "class_balance": balance,
                              "noisy_twins": twins, "noisy_twins_sigma": twins_sigma,
                              "extra_args": tuple(self.extra_args)})
        if init_g:
            req = req._from_generator()
        if balance and not req.cond and not self.resume:
            # (a conditional generator gave its class key above; a resumed run's classes are in its checkpoint,
            # checked where the run folder is known: TrainingRunManager.start)
            raise InputError(_UNCONDITIONAL_BALANCE.format(balance=balance, run="this run"))
        if twins and not req.cond and not self.resume:
            raise InputError(_UNCONDITIONAL_TWINS.format(weight=twins, run="this run"))
        # the trainer's own validation of the options that do not depend on the data
        cfg = build_config(self.preset, req.resolution, **req.overrides())
        if init_g:
            start = generator_info(req.init_g)["kimg"]
            if start is not None and cfg.kimg <= start:
                then = f"{freeze:g} kimg of D alone, then 1000 more" if freeze else "1000 more"
                raise InputError(f"{Path(req.init_g).name} is at {start:g} kimg and the run's counters continue "
                                 f"from there, so its length {cfg.kimg:g} kimg would train nothing: set Length "
                                 f"above {start:g} (e.g. {start + freeze + 1000:g}: {then})")
        if twins and 0 < cfg.batch < 4 and (req.batch or not self.resume):
            # the G step's batch is half latents and their twins (training/trainer.py): the trainer would refuse
            # it only after the studio started it (a resumed run without a Batch here keeps its own)
            raise InputError(f"NoisyTwins pairs up each batch (every latent twice, with different noise): it needs a "
                             f"batch of at least 4; set Batch to 4 or more (or 0 for the preset's), or NoisyTwins "
                             f"weight to 0; got {cfg.batch}")
        if cfg.cond and not cfg.labels and cfg.data and not self.resume:
            from training.dataset import nvlabs_labels_source

            if nvlabs_labels_source(resolve_data(cfg.data)) is None:
                raise InputError(f"class key {cfg.cond!r} needs labels: a labels file (per-image class indices under "
                                 f"{cfg.cond!r}), or NVlabs' dataset.json inside the data folder or .zip")
        if not self.resume and cfg.aug != "none" and cfg.aug_p > cfg.ada_max_p:
            # (a resumed run keeps its own p; a retune to a lower cap lowers it, training/trainer.py)
            whose = "" if max_p else f" (the {self.preset} preset's)"
            raise InputError(f"the augmentation p {cfg.aug_p:g} is above the cap on ADA's p (Max p) "
                             f"{cfg.ada_max_p:g}{whose}; lower the augmentation p, or raise Max p to {cfg.aug_p:g}")
        return req

    def _from_generator(self) -> "TrainRequest":
        """The request with the network of its init_g generator: the file must be an exported generator of
        this preset, and the run builds its size, width and classes (the trainer loads it strictly)."""
        p = resolve_data(self.init_g)
        if not p.exists():
            raise InputError(f"generator file not found: {self.init_g}; give an exported generator (.safetensors "
                             "with its .json) on the studio's machine")
        if not p.is_file() or p.suffix.lower() != ".safetensors":
            raise InputError(f"{p.name} is not an exported generator: give the .safetensors file (its .json beside "
                             "it) that Export to studio or a run's snapshots/ holds; NVlabs pickles: convert first")
        info = generator_info(p)
        name, kw = p.name, info["init_kwargs"]
        if info["preset"] and info["preset"] != self.preset:
            raise InputError(f"{name} was trained with the {info['preset']} preset, whose network this run must "
                             f"build to load it: choose the {info['preset']} preset")
        res, gen_res = self.resolution, int(kw.get("img_resolution") or 0)
        if res and gen_res and res != gen_res:
            raise InputError(f"{name} makes {gen_res}x{gen_res} images: set Resolution to {gen_res} (or 0: the "
                             "generator's), the data is resized to it")
        cond, classes = self.cond, int(kw.get("c_dim") or 0)
        if classes and not cond:
            cond = info["class_key"] or ""
            if not cond:
                raise InputError(f"{name} is class-conditional ({classes} classes): give the class key it was "
                                 "trained on under Classes (conditional)")
        if cond and not classes:
            raise InputError(f"{name} is unconditional: clear the class key to train from it")
        if cond and info["class_key"] and cond != info["class_key"]:
            raise InputError(f"{name} was trained on the classes under {info['class_key']!r} ({classes}): use that "
                             "class key (its class i must mean the same class in this run)")
        cbase, cmax = self.cbase, self.cmax
        if not (cbase or cmax) and gen_res and kw.get("channel_base") and kw.get("channel_max"):
            # G's width is not the preset's: the run it came from had --cbase/--cmax, which apply to G and D
            preset_g = finalize(build_config(self.preset, gen_res, batch=self.batch or None), gen_res).g_kwargs
            width = (kw["channel_base"], kw["channel_max"])
            if (preset_g.get("channel_base"), preset_g.get("channel_max")) != width:
                cbase, cmax = int(width[0]), int(width[1])
        return TrainRequest(**{**asdict(self), "init_g": str(p), "resolution": res or gen_res, "cond": cond,
                               "cbase": cbase, "cmax": cmax})

    def overrides(self) -> dict[str, Any]:
        """`build_config` overrides of a checked request (None = the preset's value)."""
        return {"data": self.data or None, "kimg": self.kimg or None, "minutes": self.minutes or None,
                "batch": self.batch or None, "loss": self.loss, "d_steps": self.d_steps or None, "aug": self.aug,
                "aug_p": float(self.aug_p) if self.aug_p else None,
                "aug_pipe": self.aug_pipe or None, "ada_max_p": float(self.ada_max_p) if self.ada_max_p else None,
                "auto_countermeasures": bool(self.auto_countermeasures) or None,
                "monitor_kimg": float(self.monitor_kimg) if self.monitor_kimg else None,
                "log_every": int(self.log_every) if self.log_every else None, "seed": self.seed,
                "cond": self.cond or None, "labels": self.labels or None, "init_g": self.init_g or None,
                "freeze_g_kimg": float(self.freeze_g_kimg) if self.freeze_g_kimg else None,
                "cbase": int(self.cbase) if self.cbase else None, "cmax": int(self.cmax) if self.cmax else None,
                "class_balance": float(self.class_balance) if self.class_balance else None,
                "noisy_twins": float(self.noisy_twins) if self.noisy_twins else None,
                "noisy_twins_sigma": float(self.noisy_twins_sigma) if self.noisy_twins_sigma else None}

    def cli_args(self, out: Path) -> list[str]:
        """`training.cli` arguments for a checked request writing to `out`."""
        a = ["--config", self.preset, "--out", str(out), "--no-progress"]
        if self.resume:
            a += ["--resume", str(out)]
        if self.retune:
            a.append("--retune")
        if self.data:
            a += ["--data", self.data]
        if self.resolution:
            a += ["--resolution", str(self.resolution)]
        for flag, value in (("--kimg", self.kimg), ("--minutes", self.minutes), ("--batch", self.batch),
                            ("--d-steps", self.d_steps), ("--aug-p", self.aug_p), ("--ada-max-p", self.ada_max_p),
                            ("--monitor-kimg", self.monitor_kimg), ("--log-every", self.log_every),
                            ("--freeze-g-kimg", self.freeze_g_kimg), ("--cbase", self.cbase),
                            ("--cmax", self.cmax)):
            if value:
                a += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        a += ["--loss", self.loss, "--aug", self.aug]
        if self.aug_pipe:
            a += ["--aug-pipe", self.aug_pipe]
        if self.auto_countermeasures:
            a.append("--auto-countermeasures")
        if self.cond:
            a += ["--cond", self.cond]
        if self.labels:
            a += ["--labels", self.labels]
        if self.class_balance:             # 0 passes nothing: the trainer's default, the command as before
            a += ["--class-balance", f"{float(self.class_balance):g}"]
        if self.noisy_twins:               # likewise: 0 = off, and 0 noise = the trainer's 0.25
            a += ["--noisy-twins", _exact(float(self.noisy_twins))]
        if self.noisy_twins_sigma:
            a += ["--noisy-twins-sigma", _exact(float(self.noisy_twins_sigma))]
        if self.init_g:
            a += ["--init-g", self.init_g]
        if self.seed is not None:
            a += ["--seed", str(int(self.seed))]
        if self.device:
            a += ["--device", self.device]
        return a + list(self.extra_args)


class LogTail:
    """Reads a growing JSON-lines file incrementally.

    Each `read()` parses only what was appended since the last one; a last line without its
    newline (the trainer is writing it) waits for the next read. A file that shrank or was
    replaced (a resumed run rewrites the log up to its checkpoint) is read again from the start.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: list[dict] = []
        self._offset = 0
        self._pending = b""
        self._inode: int | None = None
        self.version = 0                  # bumped whenever `records` changes

    def read(self) -> list[dict]:
        """The records appended since the previous call (all of them after a reset)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self.records:
                self._reset()
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._reset()
            self._inode = st.st_ino
        if st.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        self._offset += len(chunk)
        data = self._pending + chunk
        *lines, self._pending = data.split(b"\n")
        new = []
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:    # a torn line from a killed writer: skip it, keep reading
                continue
            if isinstance(rec, dict):
                new.append(rec)
        if new:
            self.records.extend(new)
            self.version += 1
        return new

    def _reset(self) -> None:
        self.records, self._offset, self._pending, self._inode = [], 0, b"", None
        self.version += 1


@dataclass
class RunStatus:
    """One run as the Train tab shows it."""

    name: str
    folder: Path
    state: str                              # running | stopping | finished | stopped | failed | interrupted | new
    message: str = ""                       # one line for people; a failed run's last stderr lines
    pid: int | None = None
    returncode: int | None = None
    kimg: float = 0.0
    total_kimg: float | None = None
    minutes: float | None = None
    img_s: float | None = None
    eta_s: float | None = None
    elapsed_s: float | None = None
    started: float | None = None            # unix time
    last_train: dict = field(default_factory=dict)
    last_monitor: dict = field(default_factory=dict)
    warnings: list[dict] = field(default_factory=list)        # [{"kimg", "text"}], newest last
    countermeasures: list[dict] = field(default_factory=list)  # [{"kimg", "measure", "detail"}]
    checkpoint: bool = False
    samples: Path | None = None
    request: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["folder"] = str(self.folder)
        d["samples"] = str(self.samples) if self.samples else None
        d["active"] = self.active
        return d


@dataclass
class _Child:
    proc: subprocess.Popen
    out: Any
    err: Any
    stop_requested: float | None = None     # time Stop was pressed
    killed: bool = False


class TrainingRunManager:
    """Starts `python -m training.cli` runs under `runs_dir`, one at a time, and reports on them."""

    def __init__(self, runs_dir: str | Path, *, python: str | None = None, cwd: str | Path = ROOT,
                 device: str | None = None, grace_s: float = 120.0, env: dict[str, str] | None = None):
        self.runs_dir = Path(runs_dir)
        self.python = python or sys.executable
        self.cwd = Path(cwd)
        self.device = device
        self.grace_s = float(grace_s)
        self.env = env
        self._children: dict[str, _Child] = {}
        self._tails: dict[str, LogTail] = {}
        self._lock = threading.RLock()

    # -- listing ------------------------------------------------------------------------------
    def runs(self) -> list[str]:
        """Run folders (ours or the command line's), newest first."""
        if not self.runs_dir.is_dir():
            return []
        found = []
        for d in self.runs_dir.iterdir():
            if d.is_dir() and any((d / f).exists() for f in (RUN_FILE, LOG_FILE, STATE_FILE)):
                marks = [(d / f).stat().st_mtime for f in (RUN_FILE, LOG_FILE, STATE_FILE) if (d / f).exists()]
                found.append((max(marks), d.name))
        return [name for _, name in sorted(found, reverse=True)]

    def folder(self, name: str) -> Path:
        if not name or not NAME_RE.match(name):
            raise InputError(f"no run named {name!r}")
        return self.runs_dir / name

    def active(self) -> str | None:
        """The run that is going on now (started here, or found alive through its run.json), if any."""
        with self._lock:
            for name, child in self._children.items():
                if child.proc.poll() is None:
                    return name
        for name in self.runs():
            if self._foreign_pid(self.runs_dir / name) is not None:
                return name
        return None

    # -- start / stop ---------------------------------------------------------------------------
    def start(self, request: TrainRequest) -> RunStatus:
        """Check the request, then start the run; returns its first status (state running)."""
        req = request.checked()
        if req.device is None and self.device:
            req = TrainRequest(**{**asdict(req), "device": self.device})
        with self._lock:
            busy = self.active()
            if busy is not None:
                raise ResourceError(f"the run {busy!r} is still training; stop it first (one run at a time: "
                                    "training takes the whole GPU)")
            out = self.folder(req.name)
            if req.resume:
                if not (out / STATE_FILE).is_file():
                    raise InputError(f"there is no checkpoint to resume in {out}; untick Resume to start "
                                     f"a new run named {req.name!r}")
                if req.class_balance or req.noisy_twins:
                    _refuse_class_settings_without_classes(req, out)
                if not req.retune:
                    _refuse_dropped_recipe(req, out)
            elif out.exists() and any(out.iterdir()):
                raise InputError(f"a run named {req.name!r} already exists in {self.runs_dir}; pick another "
                                 "name, or tick Resume to continue it")
            out.mkdir(parents=True, exist_ok=True)
            argv = [self.python, "-u", "-m", "training.cli", *req.cli_args(out)]
            env = dict(os.environ if self.env is None else self.env)
            env.setdefault("PYTHONUNBUFFERED", "1")
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            mode = "ab" if req.resume else "wb"
            fout, ferr = open(out / STDOUT_FILE, mode), open(out / STDERR_FILE, mode)
            try:
                proc = subprocess.Popen(argv, cwd=self.cwd, stdout=fout, stderr=ferr, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)   # its own process group: Stop reaches all of it
            except OSError as exc:
                fout.close()
                ferr.close()
                raise ResourceError(f"could not start the trainer ({self.python}): {exc}") from None
            doc = {"name": req.name, "request": asdict(req), "argv": argv, "pid": proc.pid, "started": time.time(),
                   "cwd": str(self.cwd)}
            (out / RUN_FILE).write_text(json.dumps(doc, indent=1))
            self._children[req.name] = _Child(proc, fout, ferr)
            self._tails.pop(req.name, None)
        return self.status(req.name)

    def stop(self, name: str | None = None, *, wait: bool = False, grace_s: float | None = None) -> RunStatus:
        """Ask the run to stop (SIGTERM: checkpoint at the next log point); SIGKILL after `grace_s`.
        With `wait`, return once it has exited."""
        grace = self.grace_s if grace_s is None else float(grace_s)
        name = name or self.active()
        if name is None:
            raise InputError("no training run is going on")
        with self._lock:
            child = self._children.get(name)
        if child is not None:
            if child.proc.poll() is None:
                if child.stop_requested is None:
                    child.stop_requested = time.time()
                    _signal_group(child.proc.pid, signal.SIGTERM)
                    threading.Thread(target=self._escalate, args=(child, grace), daemon=True,
                                     name=f"atelier-train-stop-{name}").start()
                if wait:
                    try:
                        child.proc.wait(grace + 10)
                    except subprocess.TimeoutExpired:
                        pass
            return self.status(name)
        pid = self._foreign_pid(self.folder(name))
        if pid is None:
            return self.status(name)
        _signal_group(pid, signal.SIGTERM)      # started by an earlier studio: no handle, signal the group
        deadline = time.time() + grace
        if wait:
            while time.time() < deadline and self._foreign_pid(self.folder(name)) is not None:
                time.sleep(0.2)
        else:
            threading.Thread(target=self._escalate_foreign, args=(name, pid, deadline), daemon=True).start()
        return self.status(name)

    def _escalate(self, child: _Child, grace: float) -> None:
        try:
            child.proc.wait(grace)
        except subprocess.TimeoutExpired:
            child.killed = True
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()

    def _escalate_foreign(self, name: str, pid: int, deadline: float) -> None:
        while time.time() < deadline:
            if self._foreign_pid(self.folder(name)) is None:
                return
            time.sleep(0.5)
        if self._foreign_pid(self.folder(name)) == pid:
            _signal_group(pid, signal.SIGKILL)

    def stop_all(self, wait: bool = True, grace_s: float | None = None) -> None:
        """Stop every run this manager started (for shutdown and tests)."""
        with self._lock:
            names = [n for n, c in self._children.items() if c.proc.poll() is None]
        for n in names:
            self.stop(n, wait=wait, grace_s=grace_s)

    # -- reading ----------------------------------------------------------------------------------
    def records(self, name: str) -> list[dict]:
        """Every log.jsonl record of the run so far (read incrementally between calls)."""
        with self._lock:
            tail = self._tails.get(name)
            if tail is None:
                tail = self._tails[name] = LogTail(self.folder(name) / LOG_FILE)
            tail.read()
            return tail.records

    def log_version(self, name: str) -> int:
        """Changes whenever the run's records change (the UI redraws its plots only then)."""
        self.records(name)
        return self._tails[name].version

    def status(self, name: str | None = None) -> RunStatus:
        """The state of run `name` (default: the active run, else the newest)."""
        if name is None:
            name = self.active() or next(iter(self.runs()), None)
            if name is None:
                raise InputError(f"there are no training runs in {self.runs_dir} yet")
        folder = self.folder(name)
        if not folder.is_dir():
            raise InputError(f"no run named {name!r} in {self.runs_dir}")
        doc = _read_json(folder / RUN_FILE) or {}
        req = doc.get("request") or {}
        state_doc = _read_json(folder / STATE_FILE) or {}
        cfg = state_doc.get("config") or {}
        records = self.records(name)
        trains = [r for r in records if r.get("kind") == "train"]
        monitors = [r for r in records if r.get("kind") == "monitor"]
        end = next((r for r in reversed(records) if r.get("kind") == "end"), None)
        st = RunStatus(name=name, folder=folder, state=NEW, pid=doc.get("pid"), started=doc.get("started"),
                       request=req)
        st.total_kimg = float(req.get("kimg") or 0) or (float(cfg["kimg"]) if cfg.get("kimg") else None)
        st.minutes = float(req.get("minutes") or 0) or (float(cfg["minutes"]) if cfg.get("minutes") else None)
        if st.total_kimg is None and req.get("preset"):   # the preset's own length
            try:
                st.total_kimg = build_config(req["preset"]).kimg
            except InputError:
                pass
        st.last_train = trains[-1] if trains else {}
        st.last_monitor = monitors[-1] if monitors else {}
        latest = next((r for r in reversed(records) if r.get("kind") in ("train", "end")), None)
        st.kimg = float((latest or {}).get("kimg", state_doc.get("kimg", 0.0)) or 0.0)
        st.img_s = _recent_img_s(trains)
        for m in monitors:
            st.warnings += [{"kimg": m.get("kimg"), "text": w} for w in m.get("warnings") or []]
            if m.get("countermeasure"):
                st.countermeasures.append({"kimg": m.get("kimg"), **m["countermeasure"]})
        st.checkpoint = (folder / STATE_FILE).is_file()
        st.samples = folder / GRID_FILE if (folder / GRID_FILE).is_file() else None

        with self._lock:
            child = self._children.get(name)
        if child is not None:
            rc = child.proc.poll()
            st.pid = child.proc.pid
            if rc is None:
                st.state = STOPPING if child.stop_requested else RUNNING
            else:
                st.returncode = rc
                _close(child)
                if child.stop_requested is not None and (rc == 0 or child.killed or rc < 0):
                    st.state = STOPPED
                elif rc == 0:
                    st.state = STOPPED if end and end.get("stop_reason") == "stop requested" else FINISHED
                else:
                    st.state = FAILED
        elif self._foreign_pid(folder) is not None:
            st.state = RUNNING
        elif end is not None:
            st.state = STOPPED if end.get("stop_reason") == "stop requested" else FINISHED
        elif doc:
            err = _last_lines(folder / STDERR_FILE)
            st.state = FAILED if _looks_failed(err) else INTERRUPTED
        elif st.checkpoint or records:
            st.state = INTERRUPTED

        now = time.time()
        if st.started:
            last_write = (folder / LOG_FILE).stat().st_mtime if (folder / LOG_FILE).is_file() else st.started
            st.elapsed_s = (now if st.active else last_write) - st.started
        if st.active:
            st.eta_s = _eta(st, now)
        st.message = self._message(st, child, end)
        return st

    def _message(self, st: RunStatus, child: _Child | None, end: dict | None) -> str:
        if st.state == FAILED:
            lines = _last_lines(st.folder / STDERR_FILE)
            errors = [ln for ln in lines if ln.startswith("error:")]
            if errors:   # the CLI's own message for bad input says it all
                return errors[-1][len("error:"):].strip()
            return "\n".join(lines) or f"the trainer exited with status {st.returncode} and no error output"
        if st.state == STOPPED:
            how = " (killed: it did not stop within the grace period)" if child is not None and child.killed else ""
            ck = "; checkpoint saved" if st.checkpoint and not how else ""
            return f"stopped at {st.kimg:g} kimg{ck}{how}"
        if st.state == FINISHED:
            why = (end or {}).get("stop_reason", "")
            return f"finished at {st.kimg:g} kimg" + (" (time budget)" if why == "time budget" else "")
        if st.state == STOPPING:
            return f"stopping: the trainer saves a checkpoint at its next log point ({st.kimg:g} kimg so far)"
        if st.state == RUNNING:
            if not st.last_train:
                return "starting: loading the data and building the networks"
            return f"training: {st.kimg:g} kimg"
        if st.state == INTERRUPTED:
            return f"interrupted at {st.kimg:g} kimg (the process is gone without a final record)"
        return ""

    def _foreign_pid(self, folder: Path) -> int | None:
        """The pid in run.json when that process is alive and is this run's trainer (pids get reused)."""
        doc = _read_json(folder / RUN_FILE)
        pid = (doc or {}).get("pid")
        if not pid:
            return None
        with self._lock:
            child = self._children.get(folder.name)
        if child is not None:      # ours: the Popen handle knows better
            return None
        try:
            cmd = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        text = [c.decode(errors="replace") for c in cmd]
        if "training.cli" in text and str(folder) in text:
            stat = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[-1].split()
            return None if stat and stat[0] == "Z" else int(pid)
        return None

    # -- export ----------------------------------------------------------------------------------------
    def export(self, name: str, models_dir: str | Path, stem: str | None = None) -> dict[str, Path]:
        """Write the run's G_ema as models_dir/STEM.safetensors + .json + model card (the studio loads it)."""
        st = self.status(name)
        if not st.checkpoint:
            raise InputError(f"the run {name!r} has no checkpoint yet; it writes one when it stops or at a "
                             "snapshot (every --snapshot-kimg)")
        stem = stem or name
        if not NAME_RE.match(stem):
            raise InputError(f"model name {stem!r}: use letters, digits, '.', '_' and '-'")
        to = Path(models_dir) / stem
        to.parent.mkdir(parents=True, exist_ok=True)
        return export_for_studio(st.folder, to)


def export_for_studio(run: str | Path, to: str | Path) -> dict[str, Path]:
    """G_ema of a run folder -> TO.safetensors (fp16) + TO.json + TO.md, the studio's StyleGAN format.

    Unlike `training.export.export_run` (which also checks the 16 MiB budget of models bundled in
    the repository), any size is fine here: the file stays on the studio's machine.
    """
    from models.stylegan import save_generator
    from models.stylegan2 import load_state_strict
    from training import checkpoint as ckpt
    from training.config import TrainConfig
    from training.export import model_card
    from training.trainer import build_networks

    run, to = Path(run), Path(to)
    if to.suffix not in (".safetensors", ".json"):   # 'ux-probe-0.5' is a name, not 'ux-probe-0' + a '.5' suffix
        to = to.with_name(to.name + ".safetensors")
    doc, tensors = ckpt.load_checkpoint(run)
    cfg = TrainConfig.from_dict(doc["config"])
    G, _ = build_networks(cfg)
    load_state_strict(G, tensors["G_ema"], "G_ema of the checkpoint")
    G.eval().requires_grad_(False)
    hist = (doc.get("monitor") or {}).get("history") or []
    last = hist[-1] if hist else {}
    monitor = {"kimg": last["kimg"], "diversity_vs_data": last["diversity"], "duplicate_rate": last["duplicate_rate"],
               **({"class_diversity_vs_data": last["class_diversity"]} if last.get("class_diversity") is not None
                  else {}),
               "d_acc": last.get("d_acc"), "warnings_total": sum(len(h.get("warnings", [])) for h in hist),
               "countermeasures": (doc.get("monitor") or {}).get("applied", [])} if last else {}
    count = (doc.get("dataset") or {}).get("count", "?")
    meta = {
        "description": f"{cfg.arch} trained in the Atelier studio on {cfg.data} ({count} images, {cfg.resolution}px), "
                       f"{doc['kimg']:g} kimg (run {run.name})",
        "license": "same as the training images",
        "training": {"kimg": doc["kimg"], "train_seconds": round(doc.get("train_seconds", 0.0), 1),
                     "pieces": doc.get("pieces"), "batch": cfg.batch, "loss": cfg.loss,
                     "r1_gamma": cfg.r1_gamma_value(), "aug_p": doc.get("aug_p"), "preset": cfg.preset,
                     "device": (doc.get("env") or {}).get("device"), "params_G": (doc.get("params") or {}).get("G"),
                     "run": str(run)},
        "monitor": monitor,
        "recommended_truncation": 0.7,
    }
    if doc.get("classes"):
        meta["classes"] = doc["classes"]
    if cfg.class_balance:
        meta["training"]["class_balance"] = cfg.class_balance
    if cfg.noisy_twins:                # as training/export.py writes it
        meta["training"]["noisy_twins"] = {"weight": cfg.noisy_twins, "sigma": cfg.noisy_twins_sigma,
                                           "start_kimg": cfg.noisy_twins_start_kimg, "beta": cfg.noisy_twins_beta}
    weights = save_generator(G, to, cfg.arch, metadata=meta, dtype="fp16")
    card = weights.with_suffix(".md")
    card.write_text(model_card(cfg, doc, meta, {}, weights.stat().st_size, None, name=weights.stem))
    return {"weights": weights, "config": weights.with_suffix(".json"), "card": card}


# -- helpers ------------------------------------------------------------------------------------------
# The recipe settings of a request that a plain resume would drop (the trainer keeps the run's own;
# training/trainer.py RESUME_RETUNABLE), with the words the Train tab uses for them.
_RECIPE_WORDS = {"batch": "batch", "d_steps": "D:G ratio", "aug_pipe": "augmentation pipe", "ada_max_p": "Max p",
                 "class_balance": "class balance", "noisy_twins": "NoisyTwins weight",
                 "noisy_twins_sigma": "twins noise"}
# what a config saved before a setting existed trained with (TrainConfig's defaults then)
_RECIPE_SAVED_DEFAULTS = {"class_balance": 0.0, "noisy_twins": 0.0, "noisy_twins_sigma": 0.25}
_UNCONDITIONAL_BALANCE = ("a class balance ({balance:g}) evens out how often each class is trained, and {run} is "
                          "unconditional (no classes): give the class key under Classes (conditional), or set "
                          "Class balance to 0")
_UNCONDITIONAL_TWINS = ("NoisyTwins (weight {weight:g}) keeps the pictures within each class varied, and {run} is "
                        "unconditional (no classes): give the class key under Classes (conditional), or set "
                        "NoisyTwins weight to 0")


def _refuse_dropped_recipe(req: TrainRequest, out: Path) -> None:
    """A plain resume keeps the run's recipe; a setting asked for that differs from it would be dropped
    without a word, so it is refused with the two ways out (Retune, or clear the setting)."""
    saved = ((_read_json(out / STATE_FILE) or {}).get("config")) or {}
    differ = []
    for key, words in _RECIPE_WORDS.items():
        asked, theirs = getattr(req, key), saved.get(key, _RECIPE_SAVED_DEFAULTS.get(key) if saved else None)
        if asked and theirs is not None and asked != theirs:
            differ.append(f"{words} {_show(asked)} (the run's: {_show(theirs)})")
    if differ:
        raise InputError(f"a plain resume keeps the run's recipe, so {', '.join(differ)} would be ignored; "
                         "tick Retune to change it, or clear those settings to continue as it was")


def _refuse_class_settings_without_classes(req: TrainRequest, out: Path) -> None:
    """A resumed run trains the classes of its checkpoint: a class balance or NoisyTwins for an unconditional
    one is refused here rather than by the trainer after the studio has started it."""
    saved = ((_read_json(out / STATE_FILE) or {}).get("config")) or {}
    if saved and not saved.get("cond"):        # (its own cond: a resumed run keeps it, whatever the form says)
        run = f"the run {req.name!r}"
        if req.class_balance:
            raise InputError(_UNCONDITIONAL_BALANCE.format(balance=req.class_balance, run=run))
        raise InputError(_UNCONDITIONAL_TWINS.format(weight=req.noisy_twins, run=run))


def _exact(value: float) -> str:
    """A float for the command line as the trainer will save it: %g where that is exact, else every digit (a
    weight typed as 0.0012345678 must not reach the run as 0.00123457, or a plain resume with the same form
    would find it differs from the run's)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)        # started with start_new_session: the group id is the pid
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _close(child: _Child) -> None:
    for f in (child.out, child.err):
        try:
            f.close()
        except OSError:
            pass


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _last_lines(path: Path, n: int = ERROR_LINES, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    # tqdm or warnings noise is not the error; a traceback's last lines are
    return lines[-n:]


def _looks_failed(lines: list[str]) -> bool:
    return any(ln.startswith(("error:", "Traceback")) or "Error" in ln for ln in lines)


def _recent_img_s(trains: list[dict], window: int = 5) -> float | None:
    """img/s over the last few log points (one interval's figure is noisy)."""
    if not trains:
        return None
    recent = trains[-window:]
    if len(recent) >= 2:
        dk = float(recent[-1].get("kimg", 0)) - float(recent[0].get("kimg", 0))
        dt = float(recent[-1].get("train_seconds", 0)) - float(recent[0].get("train_seconds", 0))
        if dk > 0 and dt > 0:
            return dk * 1000 / dt
    v = recent[-1].get("img_s")
    return float(v) if v is not None else None


def _eta(st: RunStatus, now: float) -> float | None:
    """Seconds left: the kimg still to go at the recent speed, or the time budget, whichever ends first."""
    left = []
    if st.total_kimg and st.img_s:
        left.append(max(st.total_kimg - st.kimg, 0.0) * 1000 / st.img_s)
    if st.minutes and st.started:
        left.append(max(st.minutes * 60 - (now - st.started), 0.0))
    return min(left) if left else None


def format_duration(seconds: float | None) -> str:
    """'1 h 05 min', '4 min 10 s', '12 s'; '–' when unknown."""
    if seconds is None:
        return "–"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"
