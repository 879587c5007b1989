#!/usr/bin/env bash
# Pass 40 call 1 (pass 39's call2.sh, run at 326a556), the landed tree's module: two mHC streams a sums thread by default, the staged kernel's 256-row
# floor for whole 16-column chunks, the parts' scan by shuffles; the prefetch branch reverted. The GPU tests
# under the new defaults, memcheck, and the bench at the defaults against main's arithmetic and launches
# (hcstreams=1:stagedrows=512), twice each in one process.
# Prediction (call 1's variants): prefill +2-2.5% at 2048 rows (the two levers' +1.1-1.3% each), decode C = 2
# +2%, C = 4-8 +0.5%, C = 1 within the runs' spread; the logits within 3e-4 of main's arithmetic.
# Not run in the thirty-third session (no machine, then no device time left). For the next session's first
# call, --ncu adds the stall reasons of the C = 1 chain's stages after the products (the fused router, ~14 us a
# layer after the pre for 2 MB of weights; the attention combine; the mHC site's two kernels), and the budget
# rises to 260 s for it.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 260 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,hcstreams=1:stagedrows=512,,hcstreams=1:stagedrows=512" \
  --ncu 1 "" "router_route_kernel|attention_combine_kernel|hc_site_pre_kernel|hc_site_sums_kernel"
echo "done ($SECONDS s)"
