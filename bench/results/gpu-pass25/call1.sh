#!/usr/bin/env bash
# Pass 25 call 1: the final tree of pass 24 (first H200 figures of it) and the grouped Q4_K kernel in
# blocks of 16 warps (q4kwarps=16) against 8, one process: engine_run.sh (the GPU tests, memcheck of
# engine_check --quick and of the grouped tensor-core tests, the bench, ncu of the 2048-row step's first
# tensor-core launches of each kind, the prompt timeline under both), then racecheck of the grouped tests
# (both block shapes: the test sets each).
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 420 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048 --variants ,q4kwarps=16" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k and 2304" \
  --ncu p2048 "" "imma_q4k" --ncu p2048 "q4kwarps=16" "imma_q4k" --ncu p2048 "" "imma_q8" \
  --timeline "--prompt-rows 2048 --steps 3 --variants ,q4kwarps=16"
echo "== racecheck (grouped tensor-core tests) ($SECONDS s)"
timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and 2304" > $OUT/racecheck_q4k.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed|failed" $OUT/racecheck_q4k.txt | tail -4
echo "done ($SECONDS s)"
