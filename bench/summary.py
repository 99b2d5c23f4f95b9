"""One line per bench result (and the top kernels of each profiled one): the table a device call prints last.

    python3 -m bench.summary outputs/bench/bench.jsonl [more.jsonl ...]
    python3 -m bench.summary --first-image outputs/bench/bench.jsonl   # a start's time to its first image, and where it went
"""
from __future__ import annotations

import json
import sys


def num(v, nd: int = 1) -> str:
    return f"{v:.{nd}f}" if isinstance(v, (int, float)) else str(v or "-")


def main(paths: list[str]) -> None:
    rows = []
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            if r.get("type") == "result" and r.get("status"):
                rows.append(r)
    print(f"{'workload':<10} {'config':<16} {'bs':>3} {'status':<7} {'ms/img':>8} {'img/s':>8} {'e2e ms':>8} "
          f"{'PSNR':>6} {'peakGiB':>7} {'compile s':>9}")
    for r in rows:
        d = r.get("drift") or {}
        ms = r.get("ms_per_image")
        print(f"{r['workload']:<10} {r['config'][:16]:<16} {r['batch']:>3} {r['status']:<7} "
              f"{ms if ms is None else round(ms, 3)!s:>8} {round(r.get('images_per_s') or 0, 1):>8} "
              f"{round(r.get('e2e_ms_per_image') or 0, 2):>8} {num(d.get('psnr_db')):>6} "
              f"{round((r.get('peak_vram_bytes') or 0) / 2**30, 2):>7} {round(r.get('compile_s') or 0, 1):>9}"
              + (f"  {str(r.get('error') or r.get('reason') or r.get('message'))[:160]}" if r["status"] != "ok" else ""))
    for r in rows:
        prof = r.get("profile") or {}
        top = prof.get("top") or []
        if prof:
            cls = ", ".join(f"{k} {v:.2f}" for k, v in sorted((prof.get("by_class_ms") or {}).items(),
                                                               key=lambda kv: -kv[1])[:5])
            print(f"-- {r['workload']} {r['config']} bs{r['batch']}: busy {prof.get('device_busy_ms', 0):.2f} ms, "
                  f"{prof.get('kernel_launches')} launches; {cls}")
            for k in top[:4]:
                print(f"      {k.get('ms', 0):7.3f} ms {k.get('calls')}x  {str(k.get('name'))[:110]}")


def first_image(paths: list[str]) -> None:
    """Per result: prepare (load, place, optimise) + first call = the time to a first image in a new process, and
    the request graph's own account of that first call (AOT parts loaded or compiled, warm-up passes, capture)."""
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            if r.get("type") != "result" or r.get("status") != "ok":
                continue
            prep, first = r.get("prepare_s"), r.get("first_call_s")
            total = (prep or 0) + (first or 0)
            second = f"; second call {num(r['second_call_s'])} s" if r.get("second_call_s") is not None else ""
            print(f"{r['workload']} {r['config']}: first image {total:.1f} s = prepare {num(prep)} s + first call "
                  f"{num(first)} s{second}; steady call {num(r.get('call_ms'))} ms")
            if r.get("prepare_parts_s"):
                print(f"    prepare: {json.dumps(r['prepare_parts_s'])}")
            if r.get("prepare_toggles_s"):
                print(f"    toggles: {json.dumps(r['prepare_toggles_s'])}")
            rg = (r.get("optimizations") or {}).get("request_graph") or {}
            for k in ("aot", "record_s", "last_fallback", "failures"):
                if rg.get(k):
                    print(f"    {k}: {json.dumps(rg[k])[:600]}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--first-image"]:
        first_image(sys.argv[2:])
    else:
        main(sys.argv[1:])
