#!/usr/bin/env bash
# Pass 35 call 1 (thirty-first session; prepared before the run). The narrow Q8_0 tensor-core tile
# (imma_q8_kernel<4, 1>: decode products of 6-8 columns and 4096+ rows, the LM head among them) with a
# unit's three MMAs independent of each other: `immaindep=6` (the default mask 2 plus 4, the narrow
# tile). The same bits; graph key. Pass 14's ncu had this tile waiting mostly on fixed-latency
# dependences (1.7-1.8 cycles an instruction: each unit's MMA results feed its float steps at once).
# nvcc: 121 / 114 / 127 / 120 registers (chained 121 / 113 / 126 / 118), no spills.
# Prediction (written before the run; one process, against the defaults): C = 6 and 8 +1-3% (the tile
# is ~30% of those steps; pass 34's grouped kernel took 7.6 -> 7.05 cycles an instruction at +5.6%
# instructions, ~2% net); C = 1-4 unchanged (within the runs' spread; the tile does not run there).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30 --variants ,immaindep=6,,immaindep=6" \
  --ncu 8 "" "imma_q8" --ncu 8 "immaindep=6" "imma_q8"
echo "done ($SECONDS s)"
