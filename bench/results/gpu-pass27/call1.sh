#!/usr/bin/env bash
# Pass 27 call 1 (prepared in session 24, branch pass27-part-stream; not yet run): the grouped Q4_K
# tensor-core kernel's copy stream across parts. engine_run.sh (the GPU tests, memcheck of engine_check
# --quick and of the grouped tensor-core tests, the bench in the default mode with the stream on, ncu of
# the 2048-row step's first grouped launches, the prompt timeline), then racecheck of the grouped tests,
# then the grouped tests with DS4_GPU_MV_IMMA_Q4K_STREAM=0 (pass 26's behaviour) and =1, then the
# prefill bench off, on, off, on (one process each).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k" \
  --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
echo "== racecheck (grouped tensor-core tests) ($SECONDS s)"
timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and (2304 or 4352)" > $OUT/racecheck_q4k.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck_q4k.txt | tail -2
for s in 0 1; do
  echo "== DS4_GPU_MV_IMMA_Q4K_STREAM=$s: grouped tests ($SECONDS s)"
  DS4_GPU_MV_IMMA_Q4K_STREAM=$s timeout 60 python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider \
    -k "grouped or engine_prefill" 2>&1 | tail -1
done
# A/B/A/B of the prefill bench in separate processes (the switch is read once a process).
for r in a b; do
  for s in 0 1; do
    echo "== DS4_GPU_MV_IMMA_Q4K_STREAM=$s prefill, round $r ($SECONDS s)"
    DS4_GPU_MV_IMMA_Q4K_STREAM=$s timeout 90 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/stream$s$r.json \
      --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill"
  done
done
# The tool returns at most 8 files: everything but the run log goes back in one archive.
cp $OUT/E/*run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E racecheck_q4k.txt stream*.json && rm -rf E racecheck_q4k.txt stream*.json)
echo "done ($SECONDS s)"
