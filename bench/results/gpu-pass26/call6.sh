#!/usr/bin/env bash
# Pass 26 call 6: the final tree (call 3's kernels: the whole-chunk applies, four waves, 32-row blocks) on
# whichever card comes (the H200 asked for): engine_run.sh (the GPU tests, memcheck of engine_check
# --quick, the bench in the default mode: prefill at 512 and 2048 rows, decode at C = 1-8).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1"
echo "done ($SECONDS s)"
