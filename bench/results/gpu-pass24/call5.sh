#!/usr/bin/env bash
# Pass 24 call 5 (the final tree: call 2's code + strided_sumsq without predicated batches), lean for the
# session's last device minutes: engine_run.sh (the GPU tests, memcheck of engine_check --quick and of the
# parallel-compressor and packing tests, the bench with the parallel compressor on and off in one process,
# the 2048-row profile, the prompt timeline; no racecheck: no shared-memory change since call 3's clean run).
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048 --variants ,comppar=0" \
  --memcheck-tests tests/gpu/test_gpu_engine.py --memcheck-k "parallel_compressor or packing_width" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "done ($SECONDS s)"
