#!/usr/bin/env bash
# Pass 41 call 2: one more ask for the H200 with call 1's module (a0fb6b0's code; the tests of 4f03ef7): if an H200
# comes, the acceptance figures on it (the GPU tests, memcheck, decode C = 1-8 with rooflines, prefill); on
# an H100, a second machine's figures of the landed code. Also ncu of the C = 1 chain's short kernels (the split
# attention and its combine, the mHC sums and pre, the embedding) for the next pass.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 220 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ," \
  --ncu 1 "" "attention_split|attention_combine|hc_site|embed_kernel"
echo "done ($SECONDS s)"
