#!/usr/bin/env bash
# Pass 30 call 3 (branch pass30-attn-mma after call 2; prepared in the twenty-eighth session, not yet run).
# Call 2's revision (QK's dimensions over all 8 warps) measured prefill +6.0% over main's form (2048 rows:
# 16,482 against 15,538 tok/s; the attention 14.3 -> 6.52 ms), but decode C = 1-2 stayed ~10% below main's,
# and a guarded null key-row load in the 256-dim kernel was speculated (memcheck: reads of 0x0; the tests
# after it failed on the broken context). Since then: no load from an address that is not a row (key 0's
# row, zeroed after the load), the staged queries' copies 16 bytes wide and several in flight (the one- and
# two-lane steps run q_heads' work inside the block for 16 heads, 32 serial scalar copies a thread before),
# pass 29's SIMT PV form removed (it measured no gain: call 1), so DS4_GPU_ATTN_MMA=0 is main's attention.
# Prediction (written before the run): the GPU tests, memcheck and racecheck clean; prefill as call 2
# (+6%); decode C = 1-2 within 2% of main's form (the copies were the C <= 2 difference: C >= 4, which
# stage from global without q_heads' work, already matched). If not, the run with DS4_GPU_ATTN_Q_FUSED=0
# (q_heads as its own launch, the same bits) shows whether the fused rotation is what is left.
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
echo "== DS4_GPU_ATTN_MMA=0 bench (main's attention), decode too ($SECONDS s)"
DS4_GPU_ATTN_MMA=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma0_all.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
echo "== DS4_GPU_ATTN_Q_FUSED=0 bench (the tensor cores, q_heads as its own launch at C = 1-2 as at C >= 4), decode too ($SECONDS s)"
DS4_GPU_ATTN_Q_FUSED=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/qfused0_all.json \
  --prefill-rows 512 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^decode"
for r in a b; do
  for m in 0 1; do
    [ $SECONDS -lt 200 ] || break
    echo "== DS4_GPU_ATTN_MMA=$m prefill, round $r ($SECONDS s)"
    DS4_GPU_ATTN_MMA=$m timeout 30 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma$m$r.json \
      --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "^prefill"
  done
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call3_all.tgz E racecheck.txt mma*.json qfused0* 2>/dev/null; rm -rf E racecheck.txt mma*.json qfused0*)
echo "done ($SECONDS s)"
