#!/usr/bin/env bash
# Pass 40 call 3: build_parts by the warps' count table (the prompt steps' build_parts_kernel up to ~1,000 experts;
# the count loop's loads batched, the next chunk's pair loaded ahead); the same bytes, so no setting. The GPU tests
# (the parts tests now also at 1,500 and 4,096 experts), memcheck of engine_check --quick and of the parts and
# router tests, the ncu of build_parts_kernel in a 2048-row prompt step (call 2: 110.6-111.4 us; predicted
# 20-35 us), the fused router's at C = 1 again (call 2: 9.5-9.6 us; it keeps the walk, so unchanged but for the
# loads), and the bench at the defaults twice (predicted prefill +0.2-0.3%, decode unchanged).
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 270 --no-racecheck \
  --memcheck-tests tests/gpu/test_gpu_launch_fusions.py --memcheck-k "router or parts" \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ," \
  --ncu p2048 "" "build_parts_kernel" --ncu 1 "" "router_route_kernel"
echo "done ($SECONDS s)"
