#!/usr/bin/env bash
# Pass 26 call 4: the grouped Q4_K tensor-core kernel's grid as one wave of resident blocks (the parts of
# an expert run together, so its weights come from DRAM once). engine_run.sh (the GPU tests, memcheck of
# engine_check --quick, the bench in the default mode, ncu of the 2048-row step's first grouped Q4_K
# launches, the prompt timeline), then the prefill bench again in a process with the four waves of
# passes 23-25 (DS4_GPU_MV_IMMA_Q4K_WAVES=4, read once a process), then the default once more.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 330 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
for w in 4 1; do
  echo "== prefill, DS4_GPU_MV_IMMA_Q4K_WAVES=$w ($SECONDS s)"
  DS4_GPU_MV_IMMA_Q4K_WAVES=$w timeout 120 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/waves$w.json \
    --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill|exactness"
done
echo "done ($SECONDS s)"
