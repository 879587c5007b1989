#!/usr/bin/env bash
# Pass 27 call 2: main's tree (d41401c's kernels, the cross-part stream not taken), asked for the H200 to
# give the final tree's figures on the machine: the GPU tests, memcheck of engine_check --quick,
# the bench (prefill at 512 and 2048 rows, decode C = 1-8 with rooflines), the 2048-row prompt timeline.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 280 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --timeline "--prompt-rows 2048 --steps 3"
