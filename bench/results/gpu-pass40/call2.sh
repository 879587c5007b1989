#!/usr/bin/env bash
# Pass 40 call 2: the router's last block shorter (the chosen experts' weights from registers, the arg-max by two
# warp reductions, the parts from the ids in shared memory with match.any for the warp's earlier lanes); the same
# bytes, so no setting: the GPU tests, memcheck (engine_check --quick, and the router's tests), the bench at the
# defaults twice (against call 1's defaults on the same kind of machine), the ncu of the fused router at C = 1
# (call 1: 10,016 ns; predicted 8.5-9.0 us) and a C = 1 graph timeline (pass 39: the router ends 13.6 us after
# the pre a layer), and the ncu of the prompt step's build_parts_kernel at 2048 rows (worked out in pass 39 as
# ~143 us a launch; not measured before).
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --memcheck-tests tests/gpu/test_gpu_launch_fusions.py --memcheck-k "router or parts" \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ," \
  --ncu 1 "" "router_route_kernel" --ncu p2048 "" "build_parts_kernel" \
  --timeline "--c 1 --steps 3"
echo "done ($SECONDS s)"
