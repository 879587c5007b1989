#!/usr/bin/env bash
# Pass 30 call 2 (branch pass30-attn-mma, the kernel revised after call 1). Call 1 measured the tensor-core
# attention at +5.0% prefill (2048 rows: 16,222 against 15,450 tok/s for main's form; attention 14.3 -> 7.85
# ms) but decode C = 1 -11% and C = 2 -9%: at 64-key splits only 2 of the 8 warps had QK work (ncu: 5.6 of
# 12.65 cycles an instruction waiting at the barrier), and a block's QK waited on 16 memory round trips (one
# a k-block), its PV on 4. The revision: QK's dimensions in 4 parts over the warps (all 8 busy, 2 n-tiles a
# warp a round, its key words loaded before its MMAs: one round trip a round, the parts' sums added in part
# order), PV's loads 4 k-steps ahead, no spills (call 1's had 1.18 M local requests a launch).
# Prediction (written before the run): attention 7.85 -> ~5 ms in the 2048-row step, prefill +1.5-2.5%
# over call 1's tensor-core form; decode C = 1-2 back to main's (~55% of this H100's roofline) or better.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 120 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
echo "== racecheck (the attention tests, the tensor-core form) ($SECONDS s)"
timeout 30 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_kernels.py -q \
  -p no:cacheprovider -k "attention_sink_matches or lane_bits" > $OUT/racecheck.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck.txt | tail -2
for r in a b; do
  for m in 0 1; do
    [ $SECONDS -lt 190 ] || break
    echo "== DS4_GPU_ATTN_MMA=$m (PV=0: main's form when off) prefill, round $r ($SECONDS s)"
    DS4_GPU_ATTN_MMA=$m DS4_GPU_ATTN_PV=0 timeout 30 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf \
      --json $OUT/mma$m$r.json --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 \
      --prefill-only 2>&1 | grep -E "^prefill"
  done
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call2_all.tgz E racecheck.txt mma*.json 2>/dev/null; rm -rf E racecheck.txt mma*.json)
echo "done ($SECONDS s)"
