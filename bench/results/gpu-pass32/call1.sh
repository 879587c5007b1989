#!/usr/bin/env bash
# Pass 32 call 1 (branch pass32-attn-chain; prepared in the thirtieth session before any device run).
# Pass 31 call 4 (ncu, C = 1): a tensor-core attention block's chain is its 16-row tile's whatever its
# heads (3,507 instructions a warp, 32.1 us, against the SIMT block's 1,676, 13.7 us). This branch
# (1) sizes q's norm (norm_rope_heads) by the block's heads and writes the zero rows' queries without
# splitting them (the same bits), and (2) adds a measurement setting for the attention's fewest keys a
# split (set_attn_split_min, engine_bench splitmin=N; 64 by default; changes bits, both forms).
# Prediction (written before the run): the GPU tests (two new), memcheck clean; at C = 1 the tensor-core
# form's default (splitmin=-1) +2-3% over pass 31's 980 tok/s on a like H100 (the norm's 12 idle heads
# were ~800 instructions a warp); splitmin=32 a further +5-7% at C = 1-2 (the lane's ~128 keys a layer in
# 4 splits instead of 2: 64 blocks, each half the keys), splitmin=16 +1-2% more; with both, C = 1 within
# 3-5% of the SIMT form at 64. The SIMT form (second process): splitmin=32 +1.5-2.5% at C = 1, C = 4-8
# +0-1%. Prefill at 2048 rows: tensor cores -0.5 to -1.5% at 32 and 16 (more blocks, each staging 16
# rows of queries, more partials), SIMT +-0.5%. ncu of the C = 1 step (as pass 31 call 4): the
# tensor-core block ~2,700 instructions a warp at the default (3,507 in pass 31), ~1,700 at splitmin=32.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 20 --variants splitmin=-1,splitmin=32,splitmin=16" \
  --memcheck-tests tests/gpu/test_gpu_kernels.py --memcheck-k "attention" \
  --ncu 1 "" "attention_mma" --ncu 1 "splitmin=32" "attention_mma"
export PYTHONPATH=/tmp/site
echo "== DS4_GPU_ATTN_MMA=0 (main's SIMT form), the same variants ($SECONDS s)"
DS4_GPU_ATTN_MMA=0 timeout 90 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma0.json \
  --prefill-rows 2048 --long-ctx 0 --steps 20 --variants splitmin=-1,splitmin=32,splitmin=16 2>&1 \
  | grep -E "^prefill|^decode|^exactness"
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E mma0*.json 2>/dev/null; rm -rf E mma0*.json)
echo "done ($SECONDS s)"
