#!/usr/bin/env bash
# Pass 32 call 0 (thirtieth session, the last 245 s of its device time: too few for call1.sh's bench):
# the branch's GPU tests (the two new ones among them) and memcheck, no bench.
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --no-bench --no-racecheck --budget 120 \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "split_min or heads_a_block or lane_bits"
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call0_all.tgz E 2>/dev/null; rm -rf E)
echo "done ($SECONDS s)"
