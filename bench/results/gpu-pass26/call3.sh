#!/usr/bin/env bash
# Pass 26 call 3: the grouped Q4_K tensor-core kernel's four applies of a whole chunk in one basic
# block (the scheduler interleaves their chains; 109 registers, still two blocks an SM), and grouped
# products at four k-slices on the tensor cores (matvec_grouped makes X's planes for them too).
# engine_run.sh: the GPU tests, memcheck of engine_check --quick and of the grouped tensor-core tests,
# the bench (default mode), ncu of the 2048-row step's first grouped Q4_K launches, the prompt timeline;
# then racecheck of the grouped tests with a partial chunk and with four k-slices.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 400 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k" \
  --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "== racecheck (grouped tensor-core tests) ($SECONDS s)"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and (2304 or 4352)" > $OUT/racecheck_q4k.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed|failed" $OUT/racecheck_q4k.txt | tail -4
echo "done ($SECONDS s)"
