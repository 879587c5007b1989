#!/usr/bin/env bash
# Pass 42 call 2 (ext/gpu/README "Pass 42"): the step's opening prefetch moved into the embedding's launch
# (call 1's prefetch kernel of its own, a second root of the graph, ran at the step's end instead).
# 1. engine_run.sh: the GPU tests (the opening test among them), memcheck of engine_check --quick, decode C = 1-8
#    and prefill, a C = 1 graph timeline; memcheck of engine_check --quick with DS4_GPU_L2_OPENING=1.
# 2. The A/B, four processes alternating DS4_GPU_L2_OPENING=1 and the default; a C = 1 timeline with the opening.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1 --steps 3"
export PYTHONPATH=/tmp/site
ab=/tmp/ab
mkdir -p $ab
echo "== memcheck engine_check --quick, DS4_GPU_L2_OPENING=1 ($SECONDS s)"
DS4_GPU_L2_OPENING=1 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py \
  --quick > $ab/memcheck_opening.txt 2>&1
echo "memcheck exit $?"
grep -m 3 -E "ERROR SUMMARY|Invalid" $ab/memcheck_opening.txt
bench() {  # LABEL VAR=VALUE
  echo "== bench $1 ($SECONDS s)"
  env "$2" timeout 100 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 --long-ctx 0 \
    --steps 30 --json $ab/bench_$1.json 2>&1 | grep -E "chunked=1" | head -8
}
for r in 1 2; do
  bench opening_$r DS4_GPU_L2_OPENING=1
  bench main_$r DS4_GPU_L2_OPENING=0
done
echo "== C = 1 timeline with the opening ($SECONDS s)"
DS4_GPU_L2_OPENING=1 timeout 60 python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 3 \
  --json $ab/timeline_opening.json | grep -E "span"
tar -czf "$OUT/ab.tgz" -C /tmp ab
echo "done ($SECONDS s)"
