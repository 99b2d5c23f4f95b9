"""Two ranks on the CPU (gloo): the same script stays in sync, splits the batch and saves once."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _rendezvous_store() -> torch.distributed.TCPStore:
    """The ranks' rendezvous store, hosted here on a port bound before anyone is told it (port 0: the kernel
    picks a free one and the store keeps it open). Picking a free port, closing it and letting rank 0 bind it
    later races with every other process on the box; this is how torchrun's agent hosts the store too."""
    from datetime import timedelta

    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=300))


def _worker(rank: int, world: int, port: int, data: str, out: str, result_dir: str) -> None:
    # TORCHELASTIC_USE_AGENT_STORE: every rank joins the store as a client (none tries to bind the port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)
    from training import distributed as dist_utils
    from training.config import build_config
    from training.trainer import Trainer

    cfg = build_config("tiny", 16, data=data, out=out, kimg=0.032, device="cpu", batch=8, log_every=1,
                       monitor_kimg=0.016, monitor_samples=8)
    tr = Trainer(cfg, log=lambda s: None)
    tr.run()
    flat = torch.cat([p.detach().flatten() for p in list(tr.G.parameters()) + list(tr.D.parameters())])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"batch_gpu": tr.batch_gpu, "in_sync": all(torch.equal(g, gathered[0]) for g in gathered),
                   "step": tr.step, "nimg": tr.cur_nimg}, f)
    tr.close()                     # as training.trainer.train() does: DDP wrappers go before the group
    dist_utils.cleanup()
    # Leave without the interpreter's shutdown sequence: everything this worker reports is on disk,
    # and the harness should judge the training, not the order in which CPython frees C++ threads.
    os._exit(0)


def test_two_ranks_stay_in_sync(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "d.npy", rng.integers(0, 256, size=(24, 16, 16, 3), dtype=np.uint8))
    store = _rendezvous_store()
    try:
        mp.spawn(_worker, args=(2, store.port, str(tmp_path / "d.npy"), str(tmp_path / "run"), str(tmp_path)),
                 nprocs=2, join=True)
    finally:
        del store
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert all(x["in_sync"] for x in r)                      # DDP averaged the gradients identically
    assert r[0]["batch_gpu"] == r[1]["batch_gpu"] == 4       # the global batch of 8 is split
    assert r[0]["nimg"] == 32 and r[0]["step"] == 4          # kimg counts global images
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["env"]["world_size"] == 2 and state["step"] == 4
    assert len([x for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines() if '"monitor"' in x]) == 2
