#!/usr/bin/env bash
# Pass 34 call 5: why the replayed 2048-row step gained ~3 ms (+2.3-2.6%) where ncu had the grouped Q4_K
# kernel only ~1.2 ms faster alone: graph timelines of one prompt step with the landed default (mask 2)
# and with immaindep=0, in one process. Module of d84bbdb (the landed code; pass 35's bit 4 is off by
# default).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 240 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 5 --prefill-only --variants ,immaindep=0" \
  --timeline "--c 1 --steps 2 --prompt-rows 2048 --variants ,immaindep=0"
echo "done ($SECONDS s)"
