#!/usr/bin/env bash
# Pass 26 call 2: taller prompt tiles, each against the default in one process: the wide Q8_0 tile as
# 64 x 16 (immawide=64) and the grouped Q4_K kernel in 64-row blocks of 16 warps (q4krows=64), both
# reading each chunk's planes once for twice the rows. engine_run.sh (the GPU tests, which run both
# tiles of each; memcheck of engine_check --quick and of the grouped and wide tensor-core tests; the
# bench under the four settings; ncu of the new tiles' first 2048-row launches; the prompt timeline
# under the default and both), then racecheck of the grouped tests (both block heights).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 450 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants ,immawide=64,q4krows=64,immawide=64:q4krows=64" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "(grouped_q4k and (2304 or 4352)) or (every_width and 4352x500)" \
  --ncu p2048 "q4krows=64" "imma_q4k" --ncu p2048 "immawide=64" "imma_q8" \
  --timeline "--prompt-rows 2048 --steps 3 --variants ,immawide=64:q4krows=64"
echo "== racecheck (grouped tensor-core tests) ($SECONDS s)"
timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and 2304" > $OUT/racecheck_q4k.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed|failed" $OUT/racecheck_q4k.txt | tail -4
echo "done ($SECONDS s)"
