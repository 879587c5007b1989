#!/usr/bin/env bash
# Pass 39 call 1, the module of pass 39's tree: main, the parts' scan by shuffles (same bytes), the staged kernel's
# row floor and the mHC site's streams a sums thread as measurement settings, the L2 prefetch (off by default) on a
# branch of its own. The GPU tests (the launch-switch test's stagedrows case: equal
# bits at a 64-row floor; the bit-setting test's hcstreams case; the site tests under 1 and 2 streams a thread),
# memcheck, and the bench at the defaults against stagedrows=256, hcstreams=2 and l2=1, each twice in one process.
# Predictions:
# - stagedrows=256 (pass 36 call 3's ncu: the router's 256-row F16 product on the direct kernel is L2-bound in
#   prompt steps, 558-564 us a launch, 4 a step): ~240 us a launch on the staged kernel, prefill at 2048 rows
#   +1%; decode moves only where the router's product already has the staged kernel's fewest columns (C = 5-8),
#   within +-1%.
# - hcstreams=2 (the sums kernel instruction-bound at 77-80% issue, 405 / 463 / 857 us for the first three
#   launches of a 2048-row step): the instructions an output ~2.5x fewer (X's row and the post input y once for
#   two streams, the 24 warp sums in 24 shuffles instead of 31 for two outputs) at half the warps (127
#   registers), the kernel ~4.9 -> ~2.5 ms a step: prefill +1.5-2%; decode C = 1 within +-1% (32 blocks a row
#   instead of 64, the pre kernel adding 32 block sums instead of 64).
# - l2=1, the L2 prefetch windows on a branch off the chain (pass 9 measured them in line: -2.4% at C = 1 on the
#   H200, the launches costing more than the L2 hits saved): decode C = 1 +3-5%, C = 8 +1-2%, prefill within +-0.5%.
# - the parts' scan (no switch): the bench profile's fused router at C = 1 ~19.5-20.5 us a call eager, against
#   21.75 on pass 36 call 2's profile (another H100).
# Then the C = 1 graph timelines at the defaults, l2=1 and hcstreams=2.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 420 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,stagedrows=256,hcstreams=2,l2=1,,stagedrows=256,hcstreams=2,l2=1" \
  --timeline "--c 1 --steps 3 --variants ,l2=1,hcstreams=2"
echo "done ($SECONDS s)"
