"""StyleGAN2/3 generation: seeds -> z -> images, truncation, classes, noise modes,
style mixing and latent interpolation.

Truncation pulls w towards a centre: a class-conditional model's own class mean w by default
(`truncation_centre="class"`, models/class_centres.py), or the model's running mean w_avg ("global",
NVlabs' truncation and what an unconditional model always uses).

Seeds map to z exactly as NVlabs' gen_images.py does
(`np.random.RandomState(seed).randn(1, z_dim)`), so seeds match published galleries.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from core.device import peak_memory_bytes, reset_peak_memory
from core.errors import Cancelled, InputError
from core.types import GenerationRequest, GenerationResult, Job, OptimizationFlags, StyleGANParams
from models import kernels as _kernels
from models.common import resolve_class, seed_class_labels, seed_classes
from optim.report import applied, ordered
from pipelines import switches
from pipelines.base import image_grid, module_bytes, to_uint8_array, to_uint8_images, uint8_to_images
import optim


def seed_to_z(seed: int, z_dim: int) -> np.ndarray:
    return np.random.RandomState(seed).randn(1, z_dim).astype(np.float32)


class StyleGANPipeline:
    backend = "stylegan"

    def __init__(self, loaded, flags: OptimizationFlags, device: torch.device, cache_dir=None):
        self.loaded = loaded                      # models.stylegan.LoadedGenerator
        self.model_id = str(loaded.source)
        self.device = device
        self.flags = flags
        G = loaded.G.to(device).eval().requires_grad_(False)
        # Op implementations first: a bad spec is the user's error, before any slow preparation.
        self.kernels, kernels_note = _kernels.resolve(flags.kernels, device, compiled=flags.compile != "off",
                                                        precision=flags.precision)
        self.G, report = optim.prepare(G, flags, device, kind="stylegan", cache_dir=cache_dir,
                                       weights_hash=loaded.sha256)
        self.optimizations = ordered({**report, "kernels": applied(kernels_note, ops=dict(self.kernels))})

    def _running(self):
        """Context for every generator call: the precision runtime and the chosen op implementations, inside a
        scope that puts every process-wide switch back after the call (pipelines/switches.py)."""
        return switches.request_scope(self.flags, self.device, ops_impl=dict(self.kernels))

    # -- shape/range checks before any device work ---------------------------------
    def check_inputs(self, p: StyleGANParams) -> StyleGANParams:
        """Check `p` against the model and return it with its class resolved to an index (a class may be given
        by name: models.common.resolve_class)."""
        G = self.loaded.G
        # A conditional model without a class: seed s draws class s % c_dim (recorded per image), so every seed
        # gives one reproducible picture and a seed range walks through the classes.
        k = resolve_class(p.class_index, int(G.c_dim), self.class_names())
        if k != p.class_index:
            p = replace(p, class_index=k)
        if p.truncation_cutoff is not None and int(p.truncation_cutoff) > G.num_ws:
            raise InputError(f"truncation cutoff {p.truncation_cutoff} exceeds the model's {G.num_ws} style layers")
        return p

    def memory_bytes(self) -> int:
        return module_bytes(self.G) if isinstance(self.G, torch.nn.Module) else module_bytes(self.loaded.G)

    def class_names(self) -> list[str]:
        """The class names a conditional model's file records (metadata.classes.names), or []."""
        classes = ((getattr(self.loaded, "config", None) or {}).get("metadata") or {}).get("classes") or {}
        names = classes.get("names") if isinstance(classes, dict) else None
        return [str(n) for n in names] if isinstance(names, list) else []

    def classes_for(self, class_index: int | None, seeds: list[int]) -> list[int | None]:
        """The class each seed is drawn with: the chosen one, or seed % c_dim for a conditional model without
        one; None for an unconditional model."""
        c_dim = self.loaded.G.c_dim
        if c_dim == 0:
            return [None] * len(seeds)
        return [int(class_index)] * len(seeds) if class_index is not None else seed_classes(c_dim, seeds)

    def _label(self, class_index: int | None, n: int, seeds: list[int] | None = None) -> torch.Tensor:
        c = torch.zeros([n, self.loaded.G.c_dim], device=self.device)
        if self.loaded.G.c_dim > 0:
            if class_index is not None:
                c[:, int(class_index)] = 1
            elif seeds is not None:
                c = seed_class_labels(self.loaded.G.c_dim, seeds, self.device)
        return c

    def _noise_mode(self, mode: str) -> str:
        return mode

    # -- truncation centre: the class's own mean w, or the global w_avg ---------------------
    def truncation_centre(self, p: StyleGANParams) -> str:
        """The centre `p`'s truncation uses with this model (what an image's metadata records): 'class' or
        'global' as asked for a conditional model, always 'global' for an unconditional one."""
        return p.truncation_centre if self.loaded.G.c_dim > 0 else "global"

    def _centre_kw(self, p: StyleGANParams, classes: list[int | None] | None, c: torch.Tensor | None = None) -> dict:
        """Extra keyword for the generator / mapping call: each image's class centre ([N, w_dim]) when `p` asks
        for class-centred truncation of a conditional model at psi != 1; else nothing, so the call is exactly the
        w_avg one. `classes`: each image's class (None: read from the one-hot labels `c`). Computed outside the
        precision runtime: the centres are float32 whatever the flags."""
        if self.truncation_centre(p) != "class" or float(p.truncation_psi) == 1:
            return {}
        if classes is None:
            classes = c.argmax(dim=1).tolist()
        return {"truncation_centre": self.loaded.class_centres()([int(k) for k in classes])}

    def _synthesize(self, z: torch.Tensor, c: torch.Tensor, p: StyleGANParams,
                    classes: list[int | None] | None = None) -> torch.Tensor:
        centre = self._centre_kw(p, classes, c)
        with self._running():
            img = self.G(z, c, truncation_psi=float(p.truncation_psi), truncation_cutoff=p.truncation_cutoff,
                         noise_mode=p.noise_mode, **centre)
        return img.float()

    # -- the main entry point --------------------------------------------------------
    def generate(self, request: GenerationRequest, job: Job) -> GenerationResult:
        p = request.params
        assert isinstance(p, StyleGANParams)
        # 1. check inputs
        p = self.check_inputs(p)
        G = self.loaded.G
        reset_peak_memory(self.device)
        optim.set_status_callback(self.G, job.status)   # "compiling (first run for this size)"
        # 2. seeds -> latents (on the CPU, so a seed means the same image on every device)
        with job.stage("latents"):
            zs = np.concatenate([seed_to_z(s, G.z_dim) for s in p.seeds])
        # 3. synthesis in batches, one progress step per batch
        # Pixels are made on the device (only uint8 crosses to the host for the images), and the
        # finiteness check stays there too: one host sync per batch, at the copy.
        # Stop keeps what is finished: a cancel at the step after batch k returns the k finished batches as
        # a cancelled result (as A1111/ComfyUI keep the images of an interrupted batch); a cancel before the
        # first batch raises Cancelled, as there is nothing to keep.
        outs, pixels, finite = [], [], []
        n_batches = math.ceil(len(p.seeds) / p.batch_size)
        stopped = False
        job.check_cancelled()
        with job.stage("synthesis"):
            for b in range(n_batches):
                zb = torch.from_numpy(zs[b * p.batch_size:(b + 1) * p.batch_size]).to(self.device, non_blocking=True)
                seeds_b = list(p.seeds[b * p.batch_size:(b + 1) * p.batch_size])
                img = self._synthesize(zb, self._label(p.class_index, len(zb), seeds_b), p,
                                       self.classes_for(p.class_index, seeds_b))
                finite.append(torch.isfinite(img).all())
                pixels.append(to_uint8_array(img))
                outs.append(img.cpu())
                try:
                    job.step(b + 1, n_batches)
                except Cancelled:
                    stopped = b + 1 < n_batches   # a Stop during the last batch is too late: the job is done
                    break
        raw = torch.cat(outs).numpy()
        seeds = p.seeds[:raw.shape[0]]
        # 4. postprocess
        with job.stage("postprocess"):
            images = uint8_to_images(np.concatenate(pixels))
        if not bool(torch.stack(finite).all()):
            raise InputError("the generator produced non-finite values (NaN/Inf) with these settings; "
                             "try fp32 precision or a smaller truncation ψ")
        total_ms = sum(job.timings_ms.values())
        names = self.class_names()
        meta_common = {
            "backend": "stylegan", "model": self.model_id, "model_hash": self.loaded.sha256[:10],
            "arch": self.loaded.arch, "truncation_psi": float(p.truncation_psi),
            "truncation_centre": self.truncation_centre(p),
            "truncation_cutoff": p.truncation_cutoff, "noise_mode": p.noise_mode, "class_index": p.class_index,
            "width": int(raw.shape[-1]), "height": int(raw.shape[-2]),
            "flags": request.flags.to_dict(), "latency_ms": round(total_ms, 3),
            "peak_vram_bytes": peak_memory_bytes(self.device), "device": str(self.device),
        }
        return GenerationResult(
            images=images, raw=raw, timings_ms=dict(job.timings_ms), peak_memory_bytes=peak_memory_bytes(self.device),
            device=str(self.device), dtype=self.optimizations.get("precision", {}).get("mode", "fp32"),
            optimizations=self.optimizations,
            metadata=[{**meta_common, "seed": s, "class_index": k,
                       **({"class_name": names[k]} if k is not None and k < len(names) else {})}
                      for s, k in zip(seeds, self.classes_for(p.class_index, seeds))],
            notes=[f"stopped after {len(seeds)} of {len(p.seeds)} images"] if stopped else [], cancelled=stopped,
        )

    # -- style mixing: rows take coarse styles from row seeds, columns the rest ---------
    def style_mix(self, row_seeds: list[int], col_seeds: list[int], layers: tuple[int, int], p: StyleGANParams,
                  job: Job | None = None):
        """Grid with the row seeds' styles on layers [lo, hi) mixed into the column seeds' styles.
        Returns (grid image, raw tensor [rows+1, cols+1, C, H, W] with the plain rows/columns included)."""
        p = self.check_inputs(p)
        G = self.loaded.G
        lo, hi = int(layers[0]), int(layers[1])
        if not (0 <= lo < hi <= G.num_ws):
            raise InputError(f"style-mixing layers must satisfy 0 ≤ from < to ≤ {G.num_ws}; got {lo}..{hi}")
        if not row_seeds or not col_seeds:
            raise InputError("style mixing needs at least one row seed and one column seed")
        seeds = list(dict.fromkeys(list(row_seeds) + list(col_seeds)))
        z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in seeds])).to(self.device)
        c = self._label(p.class_index, len(seeds), seeds)
        centre = self._centre_kw(p, self.classes_for(p.class_index, seeds))
        with torch.no_grad(), self._running():
            ws = self.G.mapping(z, c, truncation_psi=float(p.truncation_psi), truncation_cutoff=p.truncation_cutoff,
                                **centre)
            w_of = {s: ws[i] for i, s in enumerate(seeds)}
            pairs = [(r, cc) for r in row_seeds for cc in col_seeds]
            mixed = torch.stack([w_of[cc].clone() for r, cc in pairs])
            for i, (r, cc) in enumerate(pairs):
                mixed[i, lo:hi] = w_of[r][lo:hi]
            plain = self.G.synthesis(ws, noise_mode=p.noise_mode).float().cpu()
            mix_imgs = self.G.synthesis(mixed, noise_mode=p.noise_mode).float().cpu()
        img_of = {s: plain[i] for i, s in enumerate(seeds)}
        blank = torch.full_like(plain[0], 1.0)
        cells = [blank] + [img_of[cc] for cc in col_seeds]
        for ri, r in enumerate(row_seeds):
            cells.append(img_of[r])
            cells.extend(mix_imgs[ri * len(col_seeds):(ri + 1) * len(col_seeds)])
        raw = torch.stack(cells)
        grid = image_grid(to_uint8_images(raw), cols=len(col_seeds) + 1)
        if job is not None:
            job.step(1, 1)
        return grid, raw.numpy()

    # -- interpolation: slerp in z, lerp in w --------------------------------------------
    def interpolate(self, seeds: list[int], frames_per_seed: int, p: StyleGANParams, space: str = "w",
                    job: Job | None = None) -> list:
        """Frames moving through `seeds` in order (looping back to the first)."""
        p = self.check_inputs(p)
        if len(seeds) < 2:
            raise InputError("interpolation needs at least two seeds")
        if not (2 <= frames_per_seed <= 240):
            raise InputError("frames per seed must be between 2 and 240")
        G = self.loaded.G
        z = torch.from_numpy(np.concatenate([seed_to_z(s, G.z_dim) for s in seeds])).to(self.device)
        c = self._label(p.class_index, len(seeds), seeds)
        centre = self._centre_kw(p, self.classes_for(p.class_index, seeds))
        # a Z-space frame maps with the first seed's label (c[:1]), so it truncates towards that class's centre
        centre_z = {k: v[:1] for k, v in centre.items()}
        frames = []
        total = len(seeds) * frames_per_seed
        with torch.no_grad(), self._running():
            ws = self.G.mapping(z, c, truncation_psi=float(p.truncation_psi), truncation_cutoff=p.truncation_cutoff,
                                **centre)
            k = 0
            for i in range(len(seeds)):
                j = (i + 1) % len(seeds)
                for f in range(frames_per_seed):
                    t = f / frames_per_seed
                    if space == "z":
                        zt = _slerp(z[i:i + 1], z[j:j + 1], t)
                        w = self.G.mapping(zt, c[:1], truncation_psi=float(p.truncation_psi),
                                           truncation_cutoff=p.truncation_cutoff, **centre_z)
                    else:
                        w = torch.lerp(ws[i:i + 1], ws[j:j + 1], t)
                    img = self.G.synthesis(w, noise_mode="const" if p.noise_mode == "random" else p.noise_mode)
                    frames.append(to_uint8_images(img.float().cpu())[0])
                    k += 1
                    if job is not None:
                        job.step(k, total)
        return frames


def _slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    an, bn = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    omega = torch.acos((an * bn).sum(-1, keepdim=True).clamp(-1, 1))
    so = torch.sin(omega)
    if float(so.abs().min()) < 1e-6:
        return torch.lerp(a, b, t)
    return (torch.sin((1 - t) * omega) / so) * a + (torch.sin(t * omega) / so) * b


def write_animation(frames: list, path: str | Path, fps: int = 24) -> Path:
    """GIF always; MP4 when imageio-ffmpeg is installed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".gif":
        from core.atomic import write_atomic

        # a temporary name, then moved into place: a kill mid-write leaves no truncated GIF in the gallery
        return write_atomic(path, lambda tmp: frames[0].save(tmp, format="GIF", save_all=True,
                                                             append_images=frames[1:], duration=int(1000 / fps),
                                                             loop=0))
    if path.suffix.lower() == ".mp4":
        try:
            import imageio.v2 as imageio
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            raise InputError("writing MP4 needs imageio-ffmpeg (pip install imageio-ffmpeg); write a .gif instead") from None
        with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=1) as w:
            for fr in frames:
                w.append_data(np.asarray(fr.convert("RGB")))
        return path
    raise InputError(f"animation must be written as .gif or .mp4, not {path.suffix!r}")
