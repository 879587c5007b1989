#!/usr/bin/env bash
# Pass 43 call 2: main's module (the code of 5bb7528, packed alone as build/gpu312.tar.xz) measured again, and where
# the C = 2 and C = 8 steps' time goes beyond their bytes (C = 2 is the weakest fraction of roofline, 54.5%, and no
# timeline of it was taken since pass 16): engine_run.sh's GPU tests, memcheck, decode C = 1-8 and prefill, graph
# timelines at C = 1, 2 and 8. (Cut to 663 s of device time left: no ncu.)
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 220 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1,2,8 --steps 3"
