#!/usr/bin/env bash
# Pass 31 call 1 (branch pass30-attn-mma; prepared in the twenty-ninth session before any device run).
# The tensor-core attention takes ht heads a block (attn_mma.cuh attn_mma_heads: 4 for one or two lanes,
# 8 up to 8, else 16) instead of always a tile of 16: each head is its own row of the MMA tile, so the
# bits do not change (the tests below check it). Pass 30's calls 1-2 measured decode C = 1-2 ~10% below
# main's SIMT form, and the eager C = 1 profile 38-47 us a call for attention_mma_kernel against 16 for
# attention_split: a one-lane step of flash-l4's 64 heads made 4 blocks a split.
# Prediction (written before the run): the GPU tests, memcheck and racecheck clean; every variant
# bit-identical; decode C = 1-2 with the rule (attnheads=-1) within 2% of main's form (the MMA=0 bench)
# and ~10% above attnheads=16 (call 2's launch); C = 4-8 +0-2% over attnheads=16; prefill as call 2
# (+6% over main's form at 2048 rows: a prompt step of 2048 rows takes 16 heads a block, as before).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants attnheads=-1,attnheads=16,attnheads=2,attnq=0" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention"
export PYTHONPATH=/tmp/site
echo "== racecheck (the attention tests, the tensor-core form) ($SECONDS s)"
timeout 40 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_kernels.py -q \
  -p no:cacheprovider -k "attention_sink_matches or lane_bits or heads_a_block" > $OUT/racecheck.txt 2>&1
echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck.txt | tail -2
echo "== DS4_GPU_ATTN_MMA=0 bench (main's attention), decode too ($SECONDS s)"
DS4_GPU_ATTN_MMA=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma0_all.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
for m in 1 0; do
  [ $SECONDS -lt 180 ] || break
  echo "== DS4_GPU_ATTN_MMA=$m prefill ($SECONDS s)"
  DS4_GPU_ATTN_MMA=$m timeout 30 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma$m.json \
    --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "^prefill"
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E racecheck.txt mma*.json 2>/dev/null; rm -rf E racecheck.txt mma*.json)
echo "done ($SECONDS s)"
