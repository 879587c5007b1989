#!/usr/bin/env bash
# Pass 25 call 2 (module 1a86f9d: the grouped Q4_K kernel's per-chunk cuts too, measured against call 1): the wide Q8_0 tile's shapes (immawide=0/1/2: 32 x 32 as before, 32 x 16 and 64 x 8 with
# the B operands a chunk ahead), one process: engine_run.sh (the GPU tests, memcheck of engine_check
# --quick and of the tensor-core width test with a partial chunk, the bench under the three shapes, ncu of
# the 2048-row step's first Q8_0 tensor-core launches under shape 1, the prompt timeline under 0 and 1),
# then racecheck of that width test (every shape: the test sets each).
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 420 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048 --variants ,immawide=1,immawide=2" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "(every_width and 4352x500) or (grouped_q4k and 2304)" \
  --ncu p2048 "immawide=1" "imma_q8" --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3 --variants ,immawide=1"
echo "== racecheck (the width test at 4352 x 500, the grouped test at 2304) ($SECONDS s)"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "(every_width and 4352x500) or (grouped_q4k and 2304)" > $OUT/racecheck_imma.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed|failed" $OUT/racecheck_imma.txt | tail -4
echo "done ($SECONDS s)"
