#!/usr/bin/env bash
# Pass 40 call 4, the final tree's module (HEAD: the two warp reductions one template, the attribute call a lambda;
# otherwise call 3's code): the GPU tests and memcheck on it; racecheck of the router and parts tests (the warps'
# count table and the router's ids in shared memory); the bench's prefill at 2048 rows; and where the time goes
# now, by graph timelines: a 2048-row prompt step (the prefill target's
# measured limits; the last such timeline was pass 30's) and a C = 1 decode step.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 250 --no-racecheck \
  --bench-args "--prefill-rows 2048 --prefill-only --long-ctx 0 --steps 20" \
  --timeline "--prompt-rows 2048 --c 1 --steps 2"
export PYTHONPATH=/tmp/site
echo "== graph timeline C = 1 ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 3 --json /tmp/tl_c1.json \
  > "$OUT/timeline_c1.txt" 2>&1
echo "timeline exit $?"
gzip -c /tmp/tl_c1.json > "$OUT/timeline_c1.json.gz"
echo "== racecheck (router and parts tests) ($SECONDS s)"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest \
  tests/gpu/test_gpu_launch_fusions.py -q -p no:cacheprovider -k "router or parts" > "$OUT/racecheck_parts.txt" 2>&1
echo "racecheck exit $?"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$OUT/racecheck_parts.txt" | tail -5
echo "done ($SECONDS s)"
