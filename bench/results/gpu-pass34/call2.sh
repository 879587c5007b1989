#!/usr/bin/env bash
# Pass 34 call 2 (after call 1, before this run): the setting is now a mask (1 the wide Q8_0 tile, 2 the
# grouped Q4_K kernel). Call 1 measured both on together: prefill -0.4% at 2048 rows, because ncu had the
# grouped kernel -2.2% a layer (its three launches 13.34 -> 13.05 ms: CPI 7.63 -> 7.05, instructions
# +5.6%) and the wide tile +4-6% (more spills).
# Prediction: `immaindep=2` (the grouped kernel only) prefill +0.7-1.0% at 2048 rows (~1.2 ms of ~131 ms a
# step), +0.5-1% at 512; every variant bit-identical.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --prefill-only --variants ,immaindep=2,,immaindep=2,,immaindep=2" \
  --ncu p2048 "immaindep=2" "imma_q4k"
echo "done ($SECONDS s)"
