#!/usr/bin/env bash
# Issue 10's H200 runs, one part or several per device call: bash scripts/h200_diffusion.sh PART...
#   turbo   bench sd-turbo-512 at batch 1: fp32 (drift reference), baseline, best
#   sd15    bench sd15-512 at batch 1: fp32, baseline, best
#   warm-W  (W a workload name: warm-sd15-512, warm-sd-turbo-512) bench workload W's best again, in a new process on the compile cache the part before filled:
#           its prepare_s + first_call_s is the time to a first image on a second start (WARM_CONFIGS: others;
#           with ATELIER_REQUEST_GRAPH_AOT=1 exported for both parts, a request graph's parts are AOTInductor
#           packages, loaded without tracing on the second start)
#   warm0-W the same with the other setting of cuDNN's algorithm benchmark while the request is recorded
#           (ATELIER_RECORD_CUDNN_BENCHMARK=1; off by default since 2026-12-04)
#   save-W  write workload W's random weights to WEIGHTS=FOLDER (safetensors); with WEIGHTS set, every bench part
#           loads that folder (--weights), so a second start reads its weights from disk as a real model's
#   sdxl    bench sdxl-1024 at batch 1: baseline, best, best-fp8 (the fp32 reference runs once by itself)
#   fp8     bench sd15-512 best-fp8 at FP8 size filters 1024 / 640 / 320 (ATELIER_FP8_MIN_FEATURES)
#   tests   the gpu-marked diffusion tests but the AOT one (`aottest`; log under $OUT/gpu-tests.log)
#   rgtests the request-graph GPU tests but the AOT one (log under $OUT/rg-tests.log; ~2 min)
#   tuning  TUNING_WORKLOAD's (default sdxl-1024) best with inductor's kernel tuning, ATELIER_INDUCTOR_TUNING=TUNING
#           (coordinate | max-autotune; default coordinate), as config tuned-TUNING: A/B it against the same
#           call's `best` row (e.g. `SDXL_CONFIGS=best ... sdxl tuning`)
#   sdpa    python3 -m bench.sdpa: every SDPA backend on each attention shape the workloads call (SDPA_WORKLOADS,
#           default sd15-512,sdxl-1024,sd-turbo-512; $OUT/sdpa.json; ~2 min)
#   envab   AB_WORKLOAD's (default sdxl-1024) best under environment settings AB_ENV="VAR=VALUE ..." (A/B switches
#           such as ATELIER_SDPA_ROUTE=cross=efficient or ATELIER_INDUCTOR_TUNING=coordinate), as config AB_NAME
#           (default envab): compare with the call's `best`; AB_ENV=ATELIER_SDPA_ROUTE=suggested takes the route an
#           `sdpa` part earlier in the call suggests; AB_EXTRA=fuse_qkv=1 adds flags to best's (a stacked row)
#   imports where a new process's import of the diffusion stack goes (the second start's largest part): the
#           stack imported lean and not (ATELIER_LEAN_IMPORTS=1/0, alternating, untraced), then one
#           python -X importtime trace, $OUT/importtime-lean.txt
#   prune-ab one UNet step from a CUDA graph, full against structurally pruned (scripts/unet_prune_ab.py;
#           PRUNEAB_MODEL sd15|sdxl|..., PRUNEAB_AMOUNTS, PRUNEAB_DTYPE fp16|bf16; ~40 s a model), $OUT/prune-ab-*.json
#   pytest  the gpu-marked tests PYTEST_ARGS names (files or node ids), log in $OUT/pytest.log
#   aottest the AOT-parts GPU test alone (log under $OUT/rg-aot-test.log; give it >= 300 s: it builds three
#           AOTInductor packages, then loads them in a second start)
# Carry [".whl", ".device_shared"] (docs/gpu-runbook.md).
source "$(dirname "$0")/h200_env.sh"
flags_of_best() {   # precision=fp16+channels_last=1+... of a workload's best
  python3 -c "
import sys; from bench.specs import get_workload
b = get_workload(sys.argv[1]).best
print('+'.join(f'{k}={int(v) if isinstance(v, bool) else v}' for k, v in b.items()))" "$1"
}
share_ref() {   # the fp32 reference an earlier part of this call made for workload $1, into folder $2
  mkdir -p "$2/reference" && cp -n "$OUT"/*/reference/"$1"-* "$2/reference/" 2>/dev/null || true
}
# Preflight, before any GPU work: every part is known, every workload and configuration resolves (a typo
# such as `warm-sd15` once cost a device call). PREFLIGHT_ONLY=1 stops after it (a check on any machine).
python3 - "$@" <<'PY' || exit 2
import os, sys
from bench.specs import get_workload, parse_list, resolve_configs
env, errors = os.environ, []
def configs(workload, var, default):
    resolve_configs(get_workload(workload), parse_list(env.get(var) or default))
for p in sys.argv[1:]:
    try:
        if p == "turbo": configs("sd-turbo-512", "TURBO_CONFIGS", "fp32,baseline,best")
        elif p == "sd15": configs("sd15-512", "SD15_CONFIGS", "fp32,baseline,best")
        elif p == "sdxl": configs("sdxl-1024", "SDXL_CONFIGS", "baseline,best,best-fp8")
        elif p.startswith(("warm-", "warm0-")): configs(p.split("-", 1)[1], "WARM_CONFIGS", "best")
        elif p.startswith("save-"):
            if get_workload(p[5:]).kind != "diffusion":
                raise ValueError("not a diffusion workload")
            if not env.get("WEIGHTS"):
                raise ValueError("needs WEIGHTS=FOLDER (outside $OUT)")
        elif p == "tuning":
            from optim.compile import TUNINGS
            if env.get("TUNING", "coordinate") not in TUNINGS[1:]:
                raise ValueError(f"TUNING must be one of {', '.join(TUNINGS[1:])}")
            configs(env.get("TUNING_WORKLOAD", "sdxl-1024"), "NO_SUCH_VAR", "best")
        elif p == "envab":
            assigns = env.get("AB_ENV", "").split()
            if not assigns:
                raise ValueError("needs AB_ENV=ATELIER_...=VALUE (e.g. AB_ENV=ATELIER_SDPA_ROUTE=cross=efficient)")
            for a in assigns:
                var, eq, value = a.partition("=")
                if not eq or not var.startswith("ATELIER_"):
                    raise ValueError(f"AB_ENV holds ATELIER_...=VALUE settings separated by spaces; got {a!r}")
                if var == "ATELIER_FP8_CONV":
                    from optim.fp8 import conv_mode
                    conv_mode({var: value})
                if var == "ATELIER_INDUCTOR_TUNING":
                    from optim.compile import TUNINGS
                    if value not in TUNINGS:
                        raise ValueError(f"ATELIER_INDUCTOR_TUNING must be one of {', '.join(TUNINGS)}")
                if value == "suggested":
                    args = sys.argv[1:]
                    if var != "ATELIER_SDPA_ROUTE" or "sdpa" not in args[:args.index("envab")]:
                        raise ValueError("AB_ENV=ATELIER_SDPA_ROUTE=suggested takes the route of an `sdpa` part run "
                                         "before envab in the same call")
            w = get_workload(env.get("AB_WORKLOAD", "sdxl-1024"))
            best = "+".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in w.best.items())
            extra = env.get("AB_EXTRA", "")
            resolve_configs(w, [f"{env.get('AB_NAME', 'envab')}@{best}{'+' + extra if extra else ''}"])
        elif p == "sdpa":
            for w in parse_list(env.get("SDPA_WORKLOADS") or "sd15-512,sdxl-1024,sd-turbo-512"):
                if get_workload(w).kind != "diffusion":
                    raise ValueError(f"{w} is not a diffusion workload")
        elif p == "pytest":
            if not env.get("PYTEST_ARGS", "").strip():
                raise ValueError("needs PYTEST_ARGS (test files or node ids, e.g. tests/test_optim_fp8_conv.py)")
        elif p == "prune-ab":
            from pathlib import Path
            model = env.get("PRUNEAB_MODEL", "sd15")
            if not (Path("assets/diffusion_configs") / model / "unet" / "config.json").is_file():
                raise ValueError(f"PRUNEAB_MODEL={model}: no assets/diffusion_configs/{model}/unet/config.json")
            if env.get("PRUNEAB_DTYPE", "fp16") not in ("fp16", "bf16"):
                raise ValueError("PRUNEAB_DTYPE must be fp16 or bf16")
            [float(a) for a in env.get("PRUNEAB_AMOUNTS", "0.25,0.5").split(",") if a]
        elif p not in ("fp8", "tests", "rgtests", "aottest", "imports"):
            raise ValueError("unknown part (turbo, sd15, sdxl, save-W, warm-W, warm0-W, fp8, tuning, envab, sdpa, "
                             "tests, rgtests, aottest, imports, pytest, prune-ab)")
    except Exception as exc:
        errors.append(f"{p}: {exc}")
if errors:
    print("preflight failed, nothing ran:", *errors, sep="\n  ")
    sys.exit(2)
print("preflight ok:", " ".join(sys.argv[1:]))
PY
[ -n "${PREFLIGHT_ONLY:-}" ] && exit 0
# WEIGHTS=FOLDER: every bench part loads that diffusers folder (from `save-W`) instead of drawing random weights
BENCH="python3 app.py bench --batches 1 --no-report --quiet --isolate compiled ${WEIGHTS:+--weights $WEIGHTS}"
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    turbo) timeout ${TURBO_TIMEOUT:-420} $BENCH --workload sd-turbo-512 \
             --configs "${TURBO_CONFIGS:-fp32,baseline,best}" --profile "${TURBO_PROFILE:-best}" --out "$OUT/turbo" ;;
    sd15) timeout ${SD15_TIMEOUT:-540} $BENCH --workload sd15-512 \
            --configs "${SD15_CONFIGS:-fp32,baseline,best}" --profile "${SD15_PROFILE:-best}" --out "$OUT/sd15" ;;
    save-*) w=${part#save-}   # the workload's random weights as a diffusers folder: loaded from disk like a real model
            timeout ${SAVE_TIMEOUT:-120} python3 app.py bench save-random --workload $w \
              --out "${WEIGHTS:?save-W writes to WEIGHTS=FOLDER (outside \$OUT: a GB is too much to bring back)}" ;;
    warm-*) w=${part#warm-}   # best again in a new process, on the compile cache the run before filled
            share_ref $w "$OUT/warm-$w"
            timeout ${WARM_TIMEOUT:-200} $BENCH --workload $w --configs "${WARM_CONFIGS:-best}" --profile none --out "$OUT/warm-$w"
            python3 -m bench.summary --first-image "$OUT/warm-$w/bench.jsonl" ;;
    warm0-*) w=${part#warm0-}   # the same, cuDNN's benchmark on while recording (off by default)
            share_ref $w "$OUT/warm0-$w"
            ATELIER_RECORD_CUDNN_BENCHMARK=1 timeout ${WARM_TIMEOUT:-200} $BENCH --workload $w --configs "${WARM_CONFIGS:-best}" \
              --profile none --out "$OUT/warm0-$w"
            python3 -m bench.summary --first-image "$OUT/warm0-$w/bench.jsonl" ;;
    sdxl) timeout ${SDXL_TIMEOUT:-560} $BENCH --workload sdxl-1024 --repeats ${SDXL_REPEATS:-3} \
            --configs "${SDXL_CONFIGS:-baseline,best,best-fp8}" --profile "${SDXL_PROFILE:-best}" --out "$OUT/sdxl" ;;
    tuning) w=${TUNING_WORKLOAD:-sdxl-1024}; t=${TUNING:-coordinate}
            share_ref $w "$OUT/tuning"
            ATELIER_INDUCTOR_TUNING=$t timeout ${TUNING_TIMEOUT:-540} $BENCH --workload $w --repeats ${SDXL_REPEATS:-2} \
              --configs "tuned-$t@$(flags_of_best $w)" --profile "tuned-$t" --out "$OUT/tuning" ;;
    envab) w=${AB_WORKLOAD:-sdxl-1024}; n=${AB_NAME:-envab}; abs=()
           for ab in $AB_ENV; do   # one or more VAR=VALUE settings, all applied to the one configuration
             if [ "$ab" = "ATELIER_SDPA_ROUTE=suggested" ]; then   # the route the sdpa part just measured here
               route=$(python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(next((w.get('route') or {}).get('value', '') for w in d['workloads'] if w['workload'] == sys.argv[2]))" \
                 "$OUT/sdpa.json" "$w" 2>/dev/null)
               if [ -z "$route" ]; then echo "envab: bench.sdpa suggests no route for $w; left out"; continue; fi
               ab="ATELIER_SDPA_ROUTE=$route"; echo "envab: $ab (suggested by bench.sdpa)"
             fi
             abs+=("$ab")
           done
           if [ ${#abs[@]} -eq 0 ]; then echo "envab: no setting left to A/B; skipped"; continue; fi
           share_ref $w "$OUT/envab"
           # AB_EXTRA: flags added to best's (e.g. fuse_qkv=1), to stack the setting on another lever
           env "${abs[@]}" timeout ${AB_TIMEOUT:-540} $BENCH --workload $w --repeats ${SDXL_REPEATS:-2} \
             --configs "$n@$(flags_of_best $w)${AB_EXTRA:++$AB_EXTRA}" --profile "$n" --out "$OUT/envab" ;;
    sdpa) timeout ${SDPA_TIMEOUT:-240} python3 -m bench.sdpa --workloads "${SDPA_WORKLOADS:-sd15-512,sdxl-1024,sd-turbo-512}" \
            --out "$OUT/sdpa.json" 2>&1 | grep -v "kept in float32" ;;
    fp8) share_ref sd15-512 "$OUT/fp8"
         for f in ${FP8_FILTERS:-640 320}; do
           ATELIER_FP8_MIN_FEATURES=$f timeout ${FP8_TIMEOUT:-200} $BENCH --workload sd15-512 --profile none \
             --configs "best-fp8-$f@$(flags_of_best sd15-512)+fp8=1" --out "$OUT/fp8"
         done ;;
    tests) timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -q -rs -m gpu --durations=8 -p no:cacheprovider \
             tests/test_diffusion_overlap.py tests/test_optim_precision.py tests/test_optim_fp8.py \
             tests/test_optim_compile.py tests/test_diffusion.py tests/test_bench_gpu.py tests/test_request_graph.py \
             tests/test_optim_fused_qkv.py tests/test_bench_sdpa.py tests/test_optim_memory.py tests/test_optim_prune.py \
             tests/test_optim_attention.py tests/test_optim_tensorrt.py tests/test_optim_fp8_conv.py \
             -k "not stylegan and not test_gpu_aot_parts" 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" ;;
    prune-ab) timeout ${PRUNEAB_TIMEOUT:-200} python3 scripts/unet_prune_ab.py --model ${PRUNEAB_MODEL:-sd15} \
                --amounts ${PRUNEAB_AMOUNTS:-0.25,0.5} --dtype ${PRUNEAB_DTYPE:-fp16} --out "$OUT/prune-ab-${PRUNEAB_MODEL:-sd15}.json" ;;
    pytest) timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -rs -m gpu -p no:cacheprovider --durations=5 $PYTEST_ARGS \
              2>&1 | tee "$OUT/pytest.log" | tail -30 ;;
    rgtests) timeout ${RGTESTS_TIMEOUT:-200} python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_request_graph.py \
               -k "not test_gpu_aot_parts" --durations=5 2>&1 | tee "$OUT/rg-tests.log" | tail -40 ;;
    aottest) timeout ${AOTTEST_TIMEOUT:-330} python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_request_graph.py \
               -k test_gpu_aot_parts --durations=5 2>&1 | tee "$OUT/rg-aot-test.log" | tail -40 ;;
    imports) lscpu | grep -E "^(Model name|CPU\(s\))"
             # A/B, alternating, untraced: the stack imported lean (torchao / sklearn left out, the default since
             # 2026-12-06) and as the libraries would (ATELIER_LEAN_IMPORTS=0); then one -X importtime trace, lean
             for lean in 1 0 1 0; do
               ATELIER_LEAN_IMPORTS=$lean python3 -c "import sys, time; t = time.perf_counter(); import torch; t1 = time.perf_counter()
from pipelines.diffusion import _pipeline_class; _pipeline_class('sd'); t2 = time.perf_counter()
print(f'import (lean=$lean): torch {t1 - t:.2f} s, the diffusion stack {t2 - t1:.2f} s; torchao loaded: {\"torchao\" in sys.modules}, sklearn: {\"sklearn\" in sys.modules}')"
             done
             python3 -X importtime -c "import torch
from pipelines.diffusion import _pipeline_class; _pipeline_class('sd')" 2> "$OUT/importtime-lean.txt"
             grep '^import time:' "$OUT/importtime-lean.txt" | sort -t'|' -k2 -n -r | head -30 ;;
    *) echo "unknown part $part" ;;
  esac
done
python3 -m bench.summary "$OUT"/*/bench.jsonl 2>/dev/null || true
# each profiled row's kernel classes against their FLOPs and the run's measured rates (runs recorded with the FLOP split)
# (older runs: the attention FLOPs from this call's sdpa table, when it made one)
SDPA_ARG=(); [ -f "$OUT/sdpa.json" ] && SDPA_ARG=(--sdpa "$OUT/sdpa.json")
for f in "$OUT"/*/bench.jsonl; do [ -f "$f" ] && python3 -m bench.gap "$f" "${SDPA_ARG[@]}" 2>/dev/null; done || true
