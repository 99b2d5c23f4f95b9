"""A resumable training state from a newer G_ema snapshot and an older full state (a warm start).

    python3 scripts/warm_start_state.py --state training_state/emoji64 \\
        --g-ema G_ema-003400kimg.safetensors --log log.jsonl --out training_state/emoji64-warm

When a run's machine is lost before its checkpoint comes home, what is left is its G_ema snapshots and
its log, and an older checkpoint of the same run. This builds a state the trainer resumes from:

- G and G_ema: the snapshot's weights (fp16 in the file; G_ema is what the run would have continued
  from, and G starts equal to it, as in a transfer-learning start from a pickle's G_ema);
- D, both optimizers' moments, the sampler, the monitor's history and the path-length mean: the older
  state's (D is behind G at first and catches up: its learning rate is the same as G's);
- the recipe: the older state's with the log's retunes before the snapshot's kimg applied;
- the counters (kimg, iteration, training time) from the snapshot, ADA p from the log's last record
  before it; the log up to the snapshot plus a `warm_start` record naming both sources.

Everything is written by the trainer's own save, so the result is a normal checkpoint (sizes and
SHA-256 in state.json). `FROM=OUT bash scripts/pack_training_state.sh` packs it for a device call.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def warm_start(state: str | Path, g_ema: str | Path, out: str | Path, log: str | Path | None = None,
               device: str = "cpu") -> dict:
    from core.errors import InputError
    from models.stylegan2 import load_state_strict
    from training import checkpoint as ckpt
    from training.config import TrainConfig
    from training.export import exported_generator, snapshot_doc
    from training.runs import LogTail
    from training.trainer import RESUME_RETUNABLE, Trainer

    state, g_ema, out = Path(state), Path(g_ema), Path(out)
    old = ckpt.read_state(state)
    log = Path(log) if log is not None else state / "log.jsonl"
    if not log.is_file():
        raise InputError(f"no log at {log}: give --log, the log.jsonl of the run the snapshot came from")
    if out.resolve() == state.resolve():
        raise InputError("--out must be a new folder: the older state is read while the new one is written")
    loaded, sd, progress = exported_generator(g_ema)
    meta = {**(loaded.config.get("metadata") or {}), **{k: v for k, v in progress.items() if v is not None}}
    if meta.get("kimg") is None:
        raise InputError(f"{g_ema.name} has no kimg in its metadata: use a G_ema snapshot a run wrote "
                         "(RUN/snapshots/G_ema-*kimg.safetensors) or a model exported from one")
    kimg = float(meta["kimg"])
    if kimg <= float(old["kimg"]):
        raise InputError(f"the snapshot ({kimg:g} kimg) is not newer than the state ({old['kimg']:g} kimg): "
                         "resume the state itself")
    with tempfile.TemporaryDirectory() as tmp:
        # the older state with the newer run's log beside it, so the recipe is read at the snapshot's kimg
        view = Path(tmp) / "run"
        view.mkdir()
        for f in state.iterdir():
            if f.is_file() and f.name != "log.jsonl":
                (view / f.name).symlink_to(f.resolve())
        shutil.copy(log, view / "log.jsonl")
        records = LogTail(view / "log.jsonl").read()
        doc = snapshot_doc(view, meta)
        retune = {k: doc["config"][k] for k in RESUME_RETUNABLE
                  if k in doc["config"] and doc["config"][k] != old["config"].get(k)}
        cfg = TrainConfig.from_dict({**old["config"], "out": str(out), "device": device, "compile": False,
                                     "progress": False})
        tr = Trainer(cfg, resume=view, retune=retune or None, given={"out", "device", "compile", "progress"},
                     log=print)
        for net, what in ((tr.G, "G"), (tr.G_ema, "G_ema")):
            load_state_strict(net, sd, f"{what} from {g_ema.name} (the state's network must match the snapshot's)")
        steps = meta.get("step")
        if steps is None:
            # from the log: the last train record before the snapshot, then whole batches to it
            before = [r for r in records if r.get("kind") == "train" and r.get("kimg", 0) <= kimg + 1e-6]
            last_step, last_nimg = ((int(before[-1]["step"]), round(before[-1]["kimg"] * 1000)) if before
                                    else (tr.step, tr.cur_nimg))
            steps = last_step + round((kimg * 1000 - last_nimg) / tr.cfg.batch)
        steps = int(steps)
        # D:G updates go on at the state's own ratio over the iterations the snapshot is ahead
        tr.d_updates += (steps - tr.step) * int(tr.runtime["d_steps"])
        tr.g_updates += steps - tr.step
        tr.step, tr.cur_nimg = steps, int(round(kimg * 1000))
        tr.train_seconds = float(meta.get("train_seconds", tr.train_seconds))
        tr.pieces = int(doc.get("pieces", tr.pieces))
        if tr.aug is not None and doc.get("aug_p") is not None:
            tr.aug.p.fill_(min(float(doc["aug_p"]), tr.cfg.ada_max_p))
        # what this CPU job needed is not the run's: a resume keeps a saved device (the next piece would run
        # on the CPU) unless the command line names one
        for k in ("device", "compile", "progress"):
            setattr(tr.cfg, k, old["config"].get(k))
        tr.save(out)
    # the log of the run the snapshot came from, up to it, and what was joined
    kept = [json.dumps(r) for r in records if float(r.get("kimg", 0)) <= kimg + 1e-6]
    record = {"kind": "warm_start", "kimg": round(kimg, 3), "g_from": g_ema.name, "g_sha256": loaded.sha256,
              "d_from_kimg": round(float(old["kimg"]), 3), "retuned": sorted(retune)}
    (out / "log.jsonl").write_text("".join(k + "\n" for k in kept) + json.dumps(record) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", required=True, help="the older resumable run folder (state.json + weights)")
    ap.add_argument("--g-ema", required=True, help="the newer G_ema snapshot of the same run")
    ap.add_argument("--log", default=None, help="log.jsonl of the run the snapshot came from (default: --state's)")
    ap.add_argument("--out", required=True, help="new folder for the joined state")
    args = ap.parse_args(argv)
    from core.errors import AtelierError

    try:
        print(json.dumps(warm_start(args.state, args.g_ema, args.out, args.log)))
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
