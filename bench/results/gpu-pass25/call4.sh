#!/usr/bin/env bash
# Pass 25 call 4: the final tree again (call 3's module), asked of an H200 for the issue's figures: lean
# engine_run.sh (the GPU tests, memcheck of engine_check --quick, the bench in the default mode only, the
# prompt timeline; no racecheck: calls 1-2 ran it on the tensor-core tests of the changed kernels).
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 330 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "done ($SECONDS s)"
