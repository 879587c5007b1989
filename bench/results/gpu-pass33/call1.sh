#!/usr/bin/env bash
# Pass 33 call 1 (thirty-first session; prepared before any device run). Main's tree plus two
# measurement settings of the SIMT split attention: `attnheads=N` heads a split block (1, 2, 4; -1 the
# rule: two at one or two lanes, four beyond; the same bits) and `splitmin=N` its fewest keys a split
# (8..256 in steps of 8; 64 by default; changes bits, alike in decode and prompts). Both are part of the
# engine's graph key.
# Prediction (written before the run; H100 figures against this call's own defaults):
# - attnheads=1: C = 1 +2% (64 -> 128 blocks, each half the heads: the attention ~13.7 -> ~8-9 us a
#   layer), C = 2 +1-1.5%, C = 4-8 within +-1.5% (4x the blocks of the rule's 4 heads, each key row read
#   by 4x the blocks); prefill within +-1%.
# - splitmin=32: C = 1 +1.5-2.5% (~128 keys a lane a layer: 2 -> 4 splits), C = 2 +1%, C = 4-8 +-1%;
#   prefill within +-1%.
# - both: C = 1 +3-4% (256 blocks of one head and 32 keys). splitmin=16: at most +0.5% more than 32.
# - ncu of the eager C = 1 step's attention_split launches: ~13.7 us a launch at the defaults (pass 31),
#   ~6-7 us with attnheads=1:splitmin=32.
# - On an H200 (none since pass 23): the defaults' decode 43-46% of roofline at C = 1-8.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 400 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 20 --variants ,attnheads=1,splitmin=32,attnheads=1:splitmin=32,splitmin=16" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention" \
  --ncu 1 "" "attention_split" --ncu 1 "attnheads=1:splitmin=32" "attention_split"
echo "done ($SECONDS s)"
