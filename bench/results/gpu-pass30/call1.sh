#!/usr/bin/env bash
# Pass 30 call 1 (branch pass30-attn-mma: pass 29's branch + the split attention on the TF32 tensor cores,
# ext/gpu/attn_mma.cuh, DS4_GPU_ATTN_MMA=0/1 read once a process, default 1; MMA=0 is pass 29's SIMT block,
# its PV form switched by DS4_GPU_ATTN_PV=0/1). One call measures all three forms: the tensor cores, pass
# 29's SIMT fmaf PV (never run before) and pass 28's (main's).
# Prediction (written before the run): attention_split 14.3 ms of the 2048-row step -> ~3-4 ms on the tensor
# cores (QK and PV ~32 MMAs a key a tile of 16 heads, ~202 M MMAs a step: ~1.75 ms at 2 cycles an MMA an SM,
# plus the softmax and the partials' stores), prefill +8-9% (15.45k -> ~16.8k tok/s on an H100); pass 29's
# SIMT form -25-30% of the kernel, prefill +2.5-3%; decode +0-2%.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
prefill_ab() {  # one round of the three forms' prefill, one process each
  for f in "1 1" "0 1" "0 0"; do
    set -- $f
    echo "== DS4_GPU_ATTN_MMA=$1 DS4_GPU_ATTN_PV=$2 prefill, round $r ($SECONDS s)"
    DS4_GPU_ATTN_MMA=$1 DS4_GPU_ATTN_PV=$2 timeout 40 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf \
      --json $OUT/mma$1pv$2$r.json --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 \
      --prefill-only 2>&1 | grep -E "^prefill"
  done
}
r=a; prefill_ab
# The rest by priority, each only while the device time allows.
if [ $SECONDS -lt 170 ]; then
  echo "== racecheck (the attention tests, the tensor-core form) ($SECONDS s)"
  timeout 45 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_kernels.py -q \
    -p no:cacheprovider -k "attention_sink_matches or lane_bits" > $OUT/racecheck.txt 2>&1; echo "racecheck exit $?"
  grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck.txt | tail -2
fi
if [ $SECONDS -lt 200 ]; then r=b; prefill_ab; fi
if [ $SECONDS -lt 220 ]; then
  echo "== DS4_GPU_ATTN_MMA=0 bench (pass 29's form), decode too ($SECONDS s)"
  DS4_GPU_ATTN_MMA=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma0_all.json \
    --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
fi
if [ $SECONDS -lt 260 ]; then
  echo "== ncu, the first tensor-core attention launch of a 2048-row step ($SECONDS s)"
  timeout 40 ncu --clock-control none --profile-from-start off --target-processes all -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --csv -k "regex:attention_mma_kernel" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/ncu_attn.csv 2> $OUT/ncu_attn.err
  echo "ncu exit $?"
fi
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E racecheck.txt mma*.json ncu_attn* 2>/dev/null; rm -rf E racecheck.txt mma*.json ncu_attn*)
echo "done ($SECONDS s)"
