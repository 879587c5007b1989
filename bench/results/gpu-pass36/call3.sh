#!/usr/bin/env bash
# Pass 36 call 3, main's tree (module of 364ad3c), asked as nvidia-h200 once more. On an H200: the GPU
# tests, memcheck and the bench at the defaults (decode C = 1-8, prefill 512 and 2048 rows), the acceptance
# item's figures, unmeasured since pass 23. On an H100: the tests and memcheck, prefill alone, and ncu with
# stall reasons of a 2048-row prompt step's mHC sums kernel and its F16 SIMT products (the README's "worked
# out, not measured" notes: the sums kernel waits rather than computes; the F16 products re-read their
# weights from L2 once per 8-column piece).
# Prediction (H100): the sums kernel's issue slots mostly idle (under 0.3 instructions a cycle a scheduler),
# barrier and short-scoreboard stalls leading; the F16 products with L2 throughput above 60% of peak.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
if [[ $name == *H200* ]]; then
  OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
    --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,"
else
  OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
    --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 5 --prefill-only" \
    --ncu p2048 "" "hc_site_sums" --ncu p2048 "" "matvec_staged_kernel|matvec_dense_kernel"
fi
echo "done ($SECONDS s)"
