#!/usr/bin/env bash
# pass 21 call 1: the 16-warp grouped Q4_K tile (default) and the chunked build_parts; A/B against 8 warps
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 370 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048 --variants ," \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped" --ncu p2048 "" "imma_q4k|build_parts"
export PYTHONPATH=/tmp/site
echo "== 8-warp tile: grouped imma tests ($SECONDS s)"
DS4_GPU_IMMA_Q4K_WARPS=8 timeout 60 python3 -m pytest tests/gpu/test_gpu_imma.py -q -k grouped -p no:cacheprovider 2>&1 | tail -3
echo "== 8-warp tile: prefill ($SECONDS s)"
DS4_GPU_IMMA_Q4K_WARPS=8 timeout 120 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 512,2048 \
  --prefill-only --json $OUT/bench_w8.json 2>&1 | grep -E "prefill|loaded|exact" | tail -8
echo "done ($SECONDS s)"
