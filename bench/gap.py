"""Where a profiled bench row's time goes, set against the hardware: each kernel class's device time, the FLOPs it
did, the rate it reached against the rates the same run measured (`rates` in the run line), and what the row would
take if every compute class ran at that rate while the memory-bound classes kept their time. It answers "what
limits the remaining gap to a target" from the run file alone.

    python3 -m bench.gap docs/benchmarks/runs/RUN.jsonl [--sdpa SDPA.json] [--config best] [--target 850] [--json]

FLOPs per class come from the workload line's `flops_by_stage` (`conv_flops`, `attention_flops` and `linear_flops`,
counted by torch's flop counter on the fp32 reference run; runs before 2026-12-06 have only `linear_flops`). For
such older runs `--sdpa` (a `python3 -m bench.sdpa` table of the same workload) supplies the attention FLOPs from
the shapes the workload really calls, and the convolutions are the rest. Kernel classes (`bench.measure`'s
profile): cuBLAS GEMMs and cuDNN's implicit-GEMM convolutions are both named GEMMs and land in "matmul", so
"matmul" and "convolution" are set against the matrix-product and convolution FLOPs together.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

COMPUTE = {"matmul+conv": ("matmul", "convolution"), "attention": ("attention",)}
MEMORY = ("normalization/reduction", "elementwise (fused)", "elementwise", "copy/layout")


class GapError(ValueError):
    pass


@dataclass
class ClassLine:
    name: str
    ms: float
    tflop: float | None = None           # per image
    tflops: float | None = None          # reached
    peak_tflops: float | None = None     # the run's measured rate for this class's precision
    at_peak_ms: float | None = None
    compute: bool = False                # a GEMM/convolution/attention class (else memory-bound)

    @property
    def of_peak(self) -> float | None:
        return self.tflops / self.peak_tflops if self.tflops and self.peak_tflops else None


@dataclass
class Gap:
    workload: str
    config: str
    batch: int
    gpu: str
    ms_per_image: float
    busy_ms: float
    wall_ms: float
    lines: list[ClassLine] = field(default_factory=list)
    other_ms: float = 0.0                # classes neither compute nor known memory-bound
    flops_source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def memory_ms(self) -> float:
        return sum(c.ms for c in self.lines if not c.compute)

    @property
    def compute_floor_ms(self) -> float | None:
        """Every compute class at the run's measured rate, the memory-bound classes and the rest as they ran,
        no host gaps: what faster GEMM/attention kernels alone could reach."""
        comp = [c for c in self.lines if c.compute]
        if not comp or any(c.at_peak_ms is None for c in comp):
            return None
        return sum(c.at_peak_ms for c in comp) + self.memory_ms + self.other_ms

    def to_dict(self) -> dict:
        return {"workload": self.workload, "config": self.config, "batch": self.batch, "gpu": self.gpu,
                "ms_per_image": self.ms_per_image, "device_busy_ms": self.busy_ms, "profile_wall_ms": self.wall_ms,
                "host_gaps_ms": max(self.wall_ms - self.busy_ms, 0.0), "memory_bound_ms": self.memory_ms,
                "other_ms": self.other_ms, "compute_floor_ms": self.compute_floor_ms, "flops_source": self.flops_source,
                "classes": [{"class": c.name, "ms": c.ms, "tflop_per_image": c.tflop, "tflops": c.tflops,
                             "peak_tflops": c.peak_tflops, "of_peak": c.of_peak, "at_peak_ms": c.at_peak_ms}
                            for c in self.lines], "notes": self.notes}


def attention_flops_from_sdpa(table: dict, workload: str) -> int:
    """FLOPs of one image's attention from a bench.sdpa table: 4·B·H·Lq·Lk·D per call (QKᵀ and PV), times the
    calls per image, every attention call of the workload (the causal text encoders' masked ones included)."""
    for w in table.get("workloads", []):
        if w.get("workload") == workload:
            total = 0
            for s in w["shapes"]:
                total += 2 * s["batch"] * s["heads"] * s["q_len"] * s["k_len"] * (s["head_dim"] + s["v_dim"]) \
                    * int(s["calls_per_image"])
            return total
    raise GapError(f"the sdpa table has no workload {workload!r} "
                   f"(it has: {', '.join(w.get('workload', '?') for w in table.get('workloads', []))})")


def _flops_split(workload_line: dict, sdpa: dict | None) -> tuple[float, float, float, str]:
    """(linear, conv, attention) FLOPs per image and where they came from."""
    stages = workload_line.get("flops_by_stage") or {}
    total = float(workload_line.get("flops_per_image") or 0)
    if not total:
        raise GapError(f"{workload_line.get('workload')}: the run has no FLOP count (no fp32 reference in it)")
    linear = float(sum(v.get("linear_flops", 0) for v in stages.values()))
    if stages and all("attention_flops" in v and "conv_flops" in v for v in stages.values()):
        conv = float(sum(v["conv_flops"] for v in stages.values()))
        attn = float(sum(v["attention_flops"] for v in stages.values()))
        return linear, conv, attn, "the run's flop counter (linear, conv and attention FLOPs)"
    if sdpa is None:
        raise GapError(f"{workload_line.get('workload')}: this run predates the attention/convolution FLOP split "
                       "(2026-12-06); pass --sdpa with a `python3 -m bench.sdpa` table of the same workload")
    attn = float(attention_flops_from_sdpa(sdpa, workload_line["workload"]))
    return linear, max(total - linear - attn, 0.0), attn, \
        "linear FLOPs from the run, attention from the sdpa table's shapes, convolutions the rest"


def analyse(path: str, sdpa: dict | None = None, config: str | None = None) -> list[Gap]:
    """One Gap per profiled result row of a bench JSON-lines file (rows of `config` only when given)."""
    rates: dict = {}
    gpu = "?"
    workloads: dict[str, dict] = {}
    gaps: list[Gap] = []
    seen_profile = False
    try:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise GapError(f"cannot read {path} as bench JSON lines: {exc}") from exc
    for r in lines:
        kind = r.get("type")
        if kind == "run":
            rates, gpu = r.get("rates") or {}, r.get("gpu") or r.get("device") or "?"
        elif kind == "workload":
            workloads[r["workload"]] = r
        elif kind == "result" and r.get("status") == "ok" and r.get("profile"):
            seen_profile = True
            if config and r["config"] != config:
                continue
            gaps.append(gap_of_row(r, workloads.get(r["workload"]), rates, gpu, sdpa))
    if not gaps:
        what = f"no profiled result of config {config!r}" if config and seen_profile else "no profiled result row"
        raise GapError(f"{path}: {what} (bench rows get a kernel profile with --profile CONFIG on a GPU)")
    return gaps


def gap_of_row(r: dict, wl: dict | None, rates: dict, gpu: str, sdpa: dict | None = None) -> Gap:
    """The Gap of one profiled result row, given its workload line and its run's measured rates."""
    prof = r["profile"]
    batch = int(r.get("batch") or 1)
    by_class = {k: float(v) / batch for k, v in (prof.get("by_class_ms") or {}).items()}
    g = Gap(r["workload"], r["config"], batch, gpu, float(r.get("ms_per_image") or 0),
            float(prof.get("device_busy_ms") or 0) / batch, float(prof.get("wall_ms") or 0) / batch)
    bf16 = rates.get("bf16_tflops")
    fp8 = max((rates.get(k) or 0) for k in ("fp8_tflops", "fp8_fast_accum_tflops")) or None
    uses_fp8 = bool((r.get("flags") or {}).get("fp8"))
    split = None
    if wl is None:
        g.notes.append("no workload line in this file: FLOPs unknown, times only")
    else:
        try:
            split = _flops_split(wl, sdpa)
            g.flops_source = split[3]
        except GapError as exc:
            g.notes.append(str(exc))
    if not bf16:
        g.notes.append("the run line has no measured bf16 rate: no peak to set the classes against")
    if (r.get("flags") or {}).get("precision") == "fp32":
        g.notes.append("an fp32 row: the bf16 rate is not its peak")
    for name, members in COMPUTE.items():
        ms = sum(by_class.pop(m, 0.0) for m in members)
        line = ClassLine(name, ms, compute=True)
        if split is not None:
            linear, conv, attn, _ = split
            flops = attn if name == "attention" else linear + conv
            line.tflop = flops / 1e12
            line.tflops = line.tflop / (ms / 1e3) if ms > 0 else None
            if bf16:
                if name != "attention" and uses_fp8 and fp8:
                    # the FP8 row's plain matrix products may all run in FP8: the lowest time they could take
                    at_peak = (linear / (fp8 * 1e12) + conv / (bf16 * 1e12)) * 1e3
                    line.peak_tflops = flops / 1e12 / (at_peak / 1e3)
                else:
                    line.peak_tflops = bf16
                line.at_peak_ms = line.tflop / line.peak_tflops * 1e3
        g.lines.append(line)
    for name in MEMORY:
        if name in by_class:
            g.lines.append(ClassLine(name, by_class.pop(name)))
    g.other_ms = sum(by_class.values())
    return g


def render(g: Gap, target: float | None = None) -> str:
    out = [f"{g.workload} {g.config} bs{g.batch} on {g.gpu}: {g.ms_per_image:.1f} ms per image; profiled call "
           f"{g.wall_ms:.1f} ms, device busy {g.busy_ms:.1f} ms ({g.busy_ms / g.wall_ms:.0%}), host gaps "
           f"{max(g.wall_ms - g.busy_ms, 0):.1f} ms" if g.wall_ms else f"{g.workload} {g.config}: empty profile"]
    out.append(f"  {'class':<24} {'ms/img':>8} {'share':>6} {'TFLOP':>7} {'TFLOP/s':>8} {'of peak':>8} {'at peak':>8}")
    for c in g.lines:
        share = c.ms / g.busy_ms if g.busy_ms else 0
        if not c.compute:
            out.append(f"  {c.name:<24} {c.ms:8.1f} {share:6.1%} {'memory-bound: its time goes only by fusion':>34}")
        else:
            cells = [f"{c.tflop:7.1f}" if c.tflop is not None else f"{'-':>7}",
                     f"{c.tflops:8.0f}" if c.tflops else f"{'-':>8}",
                     f"{c.of_peak:8.0%}" if c.of_peak else f"{'-':>8}",
                     f"{c.at_peak_ms:8.1f}" if c.at_peak_ms is not None else f"{'-':>8}"]
            out.append(f"  {c.name:<24} {c.ms:8.1f} {share:6.1%} " + " ".join(cells))
    if g.other_ms:
        out.append(f"  {'other':<24} {g.other_ms:8.1f}")
    floor = g.compute_floor_ms
    if floor is not None:
        out.append(f"  every GEMM, convolution and attention kernel at the measured peak, the rest as it ran, no host "
                   f"gaps: {floor:.1f} ms per image (the memory-bound classes: {g.memory_ms:.1f} ms)")
    if target is not None:
        need = g.ms_per_image - target
        if need <= 0:
            out.append(f"  target < {target:g} ms: met ({-need:.1f} ms to spare)")
        else:
            line = f"  target < {target:g} ms: {need:.1f} ms to go"
            if floor is not None:
                line += (f"; compute kernels at peak would reach {floor:.1f} ms"
                         + (" (not enough alone: the memory-bound classes must shrink, i.e. be fused)"
                            if floor >= target else ""))
            out.append(line)
    if g.flops_source:
        out.append(f"  FLOPs: {g.flops_source}")
    out += [f"  note: {n}" for n in g.notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.gap", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench JSON-lines files with profiled rows")
    ap.add_argument("--sdpa", help="a bench.sdpa JSON table (attention FLOPs for runs before the FLOP split)")
    ap.add_argument("--config", help="only rows of this configuration")
    ap.add_argument("--target", type=float, help="ms per image to reach: say how far the row is and what could close it")
    ap.add_argument("--json", action="store_true", help="JSON instead of the table")
    a = ap.parse_args(argv)
    sdpa = None
    if a.sdpa:
        try:
            sdpa = json.load(open(a.sdpa))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read the sdpa table {a.sdpa}: {exc}", file=sys.stderr)
            return 2
    results = []
    try:
        for p in a.runs:
            results += analyse(p, sdpa, a.config)
    except GapError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps([g.to_dict() for g in results], indent=1))
    else:
        print("\n\n".join(render(g, a.target) for g in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
