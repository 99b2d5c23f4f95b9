#!/usr/bin/env bash
# Issue 11's H200 runs, one part or several per device call: bash scripts/h200_stylegan.sh PART...
#   check   the Triton kernels against the reference ops, and op timings (scripts/fir_kernels_check.py)
#   fused   only the fused filtered_lrelu A/B: fused vs 1-D passes vs nc1 on every SG3-T-1024 call, sm_90 build
#           (slow: it ran its whole 300 s on 2026-12-02 and printed nothing; prefer sweep)
#   sweep   the fused kernel's tiles x dot precisions on every SG3-T-1024 call, bf16 (~80 s; scripts/flrelu_sweep.py)
#   sg3ab   bench sg3t-1024 at batch 1: fused filtered_lrelu (fir:triton) against the 1-D passes (fir:triton-1d)
#   sg2ab   bench sg2-1024 at batch 1: best against modulated activations at batch 1 (modconv:activations),
#           each with and without inductor freezing (ATELIER_INDUCTOR_FREEZING=1), ~4 min
#   tests   tests/test_kernels.py + tests/test_filtered_lrelu_kernel.py on CUDA, then every gpu-marked StyleGAN
#           test (generators, ops, bench, precision, compile, pruning, FP8/TensorRT refusals); log under $OUT
#   b1      bench sg2-1024 + sg3t-1024 at batch 1
#   tp      bench sg2-1024 throughput batches 32/64/128 (+ sg3t-1024 at 16)
#   prof    kernel tables (torch.profiler) of the configurations named in PROF_CONFIGS
# Carry [".whl", ".device_shared"] (docs/gpu-runbook.md).
source "$(dirname "$0")/h200_env.sh"
B1_CONFIGS=${B1_CONFIGS:-baseline,fp32,tf32,fp16,bf16,bf16-cl,best,refops-bf16@precision=bf16+kernels=reference}
TP_CONFIGS=${TP_CONFIGS:-baseline,bf16,bf16-cl,best}
SG2AB_CONFIGS=${SG2AB_CONFIGS:-best,best-act@precision=bf16+channels_last=1+compile=reduce-overhead+kernels=fir:triton/up:subpixel-fused/modconv:activations}
SG3AB_CONFIGS=${SG3AB_CONFIGS:-fp32,fp32-1d@precision=fp32+kernels=fir:triton-1d/modconv:auto,bf16,bf16-1d@precision=bf16+kernels=fir:triton-1d/up:subpixel-fused/modconv:auto,best}
for part in "$@"; do
  echo "=== $part $(date +%T)"
  case $part in
    check) timeout ${CHECK_TIMEOUT:-420} python3 scripts/fir_kernels_check.py --out "$OUT/fir.json" 2>&1 \
             | grep -v "^W1\|^  warn" | tee "$OUT/check.log" | tail -30 ;;
    fused) timeout ${FUSED_TIMEOUT:-300} python3 scripts/fir_kernels_check.py --fused-only --out "$OUT/fused.json" 2>&1 \
             | grep -v "^W1\|^  warn" | tee "$OUT/fused.log" | tail -40 ;;
    sweep) timeout ${SWEEP_TIMEOUT:-190} python3 scripts/flrelu_sweep.py --dtypes bfloat16 \
             --precisions ${SWEEP_PRECISIONS:-bfloat16:tf32/fp16/bf16} --out "$OUT/sweep.json" 2>&1 | tail -50 ;;
    sg2ab) timeout ${SG2AB_TIMEOUT:-150} python3 app.py bench --workload sg2-1024 --batches 1 --configs "$SG2AB_CONFIGS" \
             --out "$OUT/sg2ab" --no-report --quiet --profile all
           ATELIER_INDUCTOR_FREEZING=1 timeout ${SG2AB_TIMEOUT:-150} python3 app.py bench --workload sg2-1024 --batches 1 \
             --configs "$(echo "$SG2AB_CONFIGS" | sed 's/best-act@/frozen-act@/; s/^best,/frozen@precision=bf16+channels_last=1+compile=reduce-overhead,/')" \
             --out "$OUT/sg2ab-frozen" --no-report --quiet --profile all ;;
    sg3ab) timeout ${SG3AB_TIMEOUT:-380} python3 app.py bench --workload sg3t-1024 --batches 1 --configs "$SG3AB_CONFIGS" \
             --out "$OUT/sg3ab" --no-report --quiet --profile ${SG3AB_PROFILE:-all} ;;
    tests) { timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rs --durations=8 -p no:cacheprovider tests/test_kernels.py \
               tests/test_filtered_lrelu_kernel.py
             timeout ${GPU_TESTS_TIMEOUT:-${TESTS_TIMEOUT:-300}} python3 -m pytest -q -rs -m gpu --durations=8 -p no:cacheprovider \
               tests/test_stylegan2.py tests/test_stylegan3.py tests/test_ops_variants.py tests/test_bench_gpu.py \
               tests/test_optim_precision.py tests/test_optim_compile.py tests/test_optim_prune.py tests/test_optim_fp8.py \
               tests/test_optim_tensorrt.py \
               -k "not diffusion and not matrix_rates and not unet and not sdxl and not mlp and not all_zero and not composes"
           } 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" ;;
    b1) timeout ${B1_TIMEOUT:-380} python3 app.py bench --workload sg2-1024,sg3t-1024 --batches 1 --configs "$B1_CONFIGS" \
          --out "$OUT/b1" --no-report --quiet --profile ${B1_PROFILE:-all} ;;
    tp) timeout ${TP_TIMEOUT:-400} python3 app.py bench --workload sg2-1024 --batches ${TP_BATCHES:-32,64,128} --configs "$TP_CONFIGS" \
          --out "$OUT/tp" --no-report --quiet ;;
    *) echo "unknown part $part" ;;
  esac
done
python3 -m bench.summary "$OUT"/*/bench.jsonl 2>/dev/null || true
