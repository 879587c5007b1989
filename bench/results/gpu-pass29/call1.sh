#!/usr/bin/env bash
# Pass 29 call 1 (branch pass29-attn-pv: main 6b41d2f + attn_split_block's PV form, DS4_GPU_ATTN_PV=0/1 read
# once a process, default 1). Also the first GPU run of main's own kernels since the slice sums landed (the
# module has them; pass 28's call5.sh never got a machine).
# The change: a key's HB attention weights side by side in shared memory (one vector load a key, where PV
# had loaded each head's) and PV's sums by fmaf (one rounding) where it had added the rounded product. The
# order of keys is the same; the bits differ from PV=0 (tests/gpu/test_gpu_kernels.py checks both forms
# against float64 and their batch invariance). Prediction (written before the run): PV's issue slots a
# multiply-add ~2.9 -> ~1.5 (a key: a global load, two conversions, four shared loads, eight multiplies and
# eight adds -> a global load, two conversions, one shared load, eight fmaf), the kernel's ~2.2 -> ~1.5,
# attention_split 14.3 -> ~10-11 ms in the 2048-row step (on the critical path), prefill +2.5-3%; decode
# +0-1% (its attention is a small part of a step).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
for r in a b; do
  for s in 0 1; do
    echo "== DS4_GPU_ATTN_PV=$s prefill, round $r ($SECONDS s)"
    DS4_GPU_ATTN_PV=$s timeout 40 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/pv$s$r.json \
      --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "^prefill"
  done
done
echo "== DS4_GPU_ATTN_PV=0 bench, decode too ($SECONDS s)"
DS4_GPU_ATTN_PV=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/pv0_all.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E pv*.json && rm -rf E pv*.json)
echo "done ($SECONDS s)"
