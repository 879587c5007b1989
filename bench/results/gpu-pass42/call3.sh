#!/usr/bin/env bash
# Pass 42 call 3: call2.sh cut to what 287 s of device time holds (three asks for call 2 found no machine).
# engine_run.sh: the GPU tests (the opening test and the run_fresh refactor among them), memcheck of engine_check
# --quick, decode C = 1-8 and prefill, a C = 1 timeline; then one bench process and a C = 1 timeline with
# DS4_GPU_L2_OPENING=1 (the prefetch from the embedding's launch).
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 120 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1 --steps 3"
export PYTHONPATH=/tmp/site
ab=/tmp/ab
mkdir -p $ab
echo "== bench, DS4_GPU_L2_OPENING=1 ($SECONDS s)"
DS4_GPU_L2_OPENING=1 timeout 40 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 --long-ctx 0 \
  --steps 30 --json $ab/bench_opening.json 2>&1 | grep -E "chunked=1" | head -8
echo "== C = 1 timeline with the opening ($SECONDS s)"
DS4_GPU_L2_OPENING=1 timeout 30 python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 3 \
  --json $ab/timeline_opening.json | grep -E "span"
tar -czf "$OUT/ab.tgz" -C /tmp ab
echo "done ($SECONDS s)"
