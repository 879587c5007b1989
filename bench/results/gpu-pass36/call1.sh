#!/usr/bin/env bash
# Pass 36 call 1 (passes 36-38 in one module, 3f2f021): launches fewer in the latency chain of a step,
# each the same bits (tests/gpu/test_gpu_launch_fusions.py); the first two are engine switches in the
# graph key:
# - pass 36, use_attn_combine_fused (engine_bench attncomb=0 off): the attention's last split block of
#   a lane's head group merges the group's heads (AttentionLaunch::done), no combine launch;
# - pass 37, use_hc_pre_fused (hcprefused=0 off): an mHC site's last sums block of a row group runs the
#   pre for the group's rows (HcSite::done), no pre launch;
# - pass 38 (no switch): the embedding writes all four mHC streams, no replicate launch (the timelines
#   show the step without it).
# The GPU tests, memcheck (engine_check --quick, and the fusion tests at 8 keys a split and of the
# fused pre), the bench of both on, both off and each alone, twice each in one process (decode C = 1-8,
# prefill 512 and 2048 rows), graph timelines of C = 1 and 8 with both on and both off.
# Prediction: C = 1 +1-3% each (the combine launch added ~7 us a layer on pass 33's timeline, the pre
# launch ~5-6 us a site; the last block's work costs ~2-4 us of each back), so +2-5% together; C = 8
# +1-2% together; prefill at 2048 rows within +-1% (the combine ran 2.5 ms and the pre 1.0 ms of the
# ~128 ms step). Pass 38: the C = 1 step's span 5-12 us shorter (the replicate kernel and the gap before
# it, pass 33's timeline), against pass 33 call 3's 879 us.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 500 --no-racecheck \
  --memcheck-tests tests/gpu/test_gpu_launch_fusions.py --memcheck-k "many_splits or hc_pre" \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,attncomb=0:hcprefused=0,attncomb=0,hcprefused=0,,attncomb=0:hcprefused=0,attncomb=0,hcprefused=0" \
  --timeline "--c 1,8 --steps 3 --variants ,attncomb=0:hcprefused=0"
echo "done ($SECONDS s)"
