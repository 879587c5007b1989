#!/usr/bin/env bash
# Pass 34 call 1 (thirty-first session; prepared before any device run). Main's tree plus a measurement
# setting for the prompt tiles (the wide Q8_0 tile imma_q8_kernel<2, 4> and the grouped Q4_K kernel):
# `immaindep=1` takes a unit's three integer MMAs independent of each other (imma.cuh plane_sums: A p1,
# A p0, A p2 from zero, then tt = 256 s1 + t0) where the default chains the second on the first (C = 256
# s1). The same integers, so the same bits; part of the graph key.
# Why (pass 33 calls 4-5, ncu of the 2048-row prompt step): the grouped Q4_K kernel's largest stall is
# fixed-latency dependences (1.91 of 7.62 cycles an instruction), the wide tile's 1.44 of 8.01; the
# chained form puts one MMA's latency, an IMUL and a second MMA's latency in series before each unit's
# float steps.
# Prediction (written before the run; against this call's own defaults, one process):
# - the grouped Q4_K kernel 2-5% faster (of ~59 ms a 2048-row step); nvcc: 111 registers (109), no spills.
# - the wide Q8_0 tile -3% to +3%: its independent form spills more (88 bytes of stores against ~8-24).
# - prefill at 2048 rows +0.5-2.5%; decode unchanged (at C <= 8 neither kernel runs), so not measured.
# - ncu: the grouped kernel's cycles an instruction 7.6 -> ~7.2-7.4, the same instruction count +-1%.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 330 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --prefill-only --variants ,immaindep=1,,immaindep=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k or every_width" \
  --ncu p2048 "" "imma_q4k" --ncu p2048 "immaindep=1" "imma_q4k" \
  --ncu p2048 "" "imma_q8" --ncu p2048 "immaindep=1" "imma_q8"
echo "done ($SECONDS s)"
