#!/usr/bin/env bash
# pass 21 call 2: the final tree (12ab79b: the 8-warp grouped block only): tests, memcheck, prefill
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 230 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --prefill-only --long-ctx 0" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped or bulk"
