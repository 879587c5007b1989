#!/usr/bin/env bash
# Pass 31 call 2: call1.sh cut to what the session's last 259 s of device time hold (call 1 was asked for
# seven times and never ran). The same module and prediction as call1.sh: the GPU tests (the two new
# ones among them) and memcheck of engine_check --quick; decode and prefill with the rule (attnheads=-1)
# beside pass 30's launch (attnheads=16) in one process; then main's SIMT form (DS4_GPU_ATTN_MMA=0).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 120 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 20 --variants attnheads=-1,attnheads=16"
export PYTHONPATH=/tmp/site
echo "== DS4_GPU_ATTN_MMA=0 bench (main's attention) ($SECONDS s)"
DS4_GPU_ATTN_MMA=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mma0_all.json \
  --prefill-rows 2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call2_all.tgz E mma*.json 2>/dev/null; rm -rf E mma*.json)
echo "done ($SECONDS s)"
