#!/usr/bin/env bash
# Pass 25 call 5: one block barrier a chunk in the grouped Q4_K kernel (measured against calls 2-3, the same
# kernel with two): lean engine_run.sh (the GPU tests, memcheck of engine_check --quick and of the grouped
# and cp.async tensor-core tests, the bench in the default mode, the prompt timeline), racecheck of those
# tests (the cp.async one runs the kernel's cp.async path in a child).
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 230 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k or cp_async or engine_prefill" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "== racecheck (grouped and cp.async tests) ($SECONDS s)"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "(grouped_q4k and 2304) or cp_async" > $OUT/racecheck_q4k.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed|failed" $OUT/racecheck_q4k.txt | tail -4
echo "done ($SECONDS s)"
