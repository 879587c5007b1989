#!/usr/bin/env bash
# Pass 24 call 2 (the H200; call 1's tree + warp sums by halving rounds): engine_run.sh (the GPU tests,
# memcheck of engine_check --quick and of the parallel-compressor test, the bench with the parallel
# compressor on and off in one process, the 2048-row profile, ncu of q_heads and hc_site_sums in a 2048-row
# prompt step, prompt timelines on and off, racecheck).
set -uo pipefail
mkdir -p $OUT/B
OUT=$OUT/B ext/gpu/bench/engine_run.sh --budget 560 \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048 --variants ,comppar=0" \
  --memcheck-tests tests/gpu/test_gpu_engine.py --memcheck-k "parallel_compressor or packing_width" \
  --ncu p2048 "" "q_heads|hc_site_sums" \
  --timeline "--prompt-rows 2048 --steps 3 --variants ,comppar=0"
echo "done ($SECONDS s)"
