#!/usr/bin/env bash
# Pass 41 call 1 (ext/gpu/README "Pass 41"): the module of the pass's code (pass 40's review mends, never run on a
# device: build_parts_kernel's shared-memory attribute in matvec_prepare, the count table's clear only where the
# table is used; the router's loads in flight together; the attention's step-input work before its grid wait).
# 1. engine_run.sh: the GPU tests, memcheck of engine_check --quick and of the router and parts tests, decode
#    C = 1-8 with rooflines and prefill, ncu of the C = 1 step's router launches (pass 40: 9.5-10.1 us
#    hash-routed, 16.3-17.4 us top-k), a C = 1 graph timeline.
# 2. The attention switch A/B in separate processes on this machine: DS4_GPU_ATTN_EARLY=0 (the split and combine
#    kernels' step-input work after their grid wait, as before) and the default, twice each, alternating.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --memcheck-tests tests/gpu/test_gpu_launch_fusions.py --memcheck-k "router or parts" \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" \
  --ncu 1 "" "router_route" --timeline "--c 1 --steps 3"
export PYTHONPATH=/tmp/site
for run in early0_a early1_a early0_b early1_b; do
  e=${run:5:1}
  echo "== DS4_GPU_ATTN_EARLY=$e bench ($run, $SECONDS s)"
  DS4_GPU_ATTN_EARLY=$e timeout 100 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 \
    --long-ctx 0 --steps 30 --json /tmp/ab_$run.json 2>&1 | grep -E "tok/s|roofline" | head -8
done
tar -czf $OUT/ab.tgz -C /tmp ab_early0_a.json ab_early1_a.json ab_early0_b.json ab_early1_b.json
echo "done ($SECONDS s)"
