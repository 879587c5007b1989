#!/usr/bin/env bash
# Pass 26 call 1: pass 25's tree (2f1c816) on whichever card comes (the H200 asked for): the GPU tests,
# including the grouped Q4_K case with four k-slices added in review and never yet run; memcheck of
# engine_check --quick and of the grouped tests; the bench (default mode) and the prompt timeline.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 330 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "done ($SECONDS s)"
