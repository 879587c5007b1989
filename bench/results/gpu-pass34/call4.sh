#!/usr/bin/env bash
# Pass 34 call 4: the landed tree (the grouped Q4_K kernel's independent MMAs by default), as a plain run
# would have it: the GPU tests, memcheck, and the bench at the defaults (decode C = 1-8, prefill 512 and
# 2048 rows), main's figures of record for this session.
# Prediction: prefill at 2048 rows ~15,800-15,900 tok/s (call 2's immaindep=2) on a like H100; decode as
# pass 33's defaults (52.5-56.6% of roofline), since no decode kernel changed.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants ,immaindep=0"
echo "done ($SECONDS s)"
