#!/usr/bin/env bash
# Pass 40 call 5: one more ask for the H200 with the final module (8522d6f's code): if an H200 comes, the issue's
# acceptance figures on it (the GPU tests, memcheck, decode C = 1-8 with rooflines, prefill); on an H100, one more
# machine's figures of main.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 220 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,"
echo "done ($SECONDS s)"
