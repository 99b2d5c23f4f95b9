"""Multi-GPU through torch.distributed, launched by torchrun or `accelerate launch`.

Both launchers start one process per GPU and set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; the trainer reads them here, so the same command
line works on one GPU (plain `python`) or many:

    python app.py train --data D --kimg 1000 --out runs/x                       # one GPU
    torchrun --standalone --nproc_per_node 2 app.py train --data D ...           # 2 GPUs, one host
    accelerate launch --num_processes 2 app.py train --data D ...                # the same through accelerate
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 \
             --rdzv_backend c10d --rdzv_endpoint HOST:29500 app.py train ...     # 2 hosts x 8 GPUs

Gradients are averaged by DistributedDataParallel (NCCL on GPUs, gloo on CPU). The
global batch (--batch) is split evenly over the ranks, and learning rates are set
for the global batch, so a run means the same thing on 1 or N GPUs.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.errors import ResourceError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: str | None = None) -> DistInfo:
    """Join the process group when launched by torchrun/accelerate; otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        use_cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
        if use_cuda:
            if local >= torch.cuda.device_count():
                raise ResourceError(f"rank {rank} wants GPU {local} but only {torch.cuda.device_count()} are "
                                    "visible; start as many processes per node as there are GPUs")
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        else:
            dev = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                    device_id=dev if use_cuda else None)
        return DistInfo(rank, world, local, dev)
    from core.device import pick_device

    dev = pick_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return DistInfo(0, 1, 0, dev)


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wrap(module: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """DDP around `module` when distributed; the module itself otherwise.

    broadcast_buffers=False: running means (w_avg, magnitude EMAs) are per rank, as in
    NVlabs' trainer; rank 0's are the ones saved."""
    if not info.enabled:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    import warnings

    ids = [info.device.index] if info.device.type == "cuda" else None
    with warnings.catch_warnings():
        # torch 2.13 deprecates broadcast_buffers in favour of forward_sync_buffers, whose False still
        # syncs at init; rank-local buffers want exactly broadcast_buffers=False, as its own warning says.
        warnings.simplefilter("ignore", FutureWarning)
        return DDP(module, device_ids=ids, broadcast_buffers=False, find_unused_parameters=False)


def no_sync(module: torch.nn.Module):
    """Accumulate gradients locally (no all-reduce) for the backward passes inside."""
    return module.no_sync() if hasattr(module, "no_sync") else nullcontext()
