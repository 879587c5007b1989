#!/usr/bin/env bash
# Pass 28 call 3 (branch pass28-sums-layout): the tensor-core kernels' slice sums column by column in shared
# memory (imma.cuh SumsLayout, DS4_GPU_MV_IMMA_SUMS=0/1 read once a process, default 1). Call 2's ncu of the
# wide Q8_0 tile (q_a, the step's first launch) counted 16.7 M shared-store wavefronts for 4.2 M stores (the
# row-by-row sums: 4-way bank conflicts), more than its A-fragment loads' 11.5 M, all between two block
# barriers. Prediction (written before the run): those stores 4-way -> conflict-free, the wide tile -6-9% in
# the 2048-row step (48.5 -> ~45 ms; q_a, kv, q_b, wo_a and the shared down have one chunk a slice, so
# -10-13% each), prefill +2-3.5%; the grouped Q4_K kernel's 2-way stores ~-1%; decode C = 6-8 (the narrow
# tile) 0-1%. engine_run (the GPU tests, memcheck of engine_check --quick and of the imma tests, the bench,
# the prompt timeline), racecheck of the imma tests, the prefill bench SUMS off / on / off / on, the whole
# bench (decode too) with SUMS off, and ncu's memory tables of the first wide launch with SUMS on. Trimmed
# to ~200 s after seven asks found no machine (the device time left: 431 s).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k or cp_async or every_width" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
echo "== racecheck (the imma tests: wide and narrow tiles at three shapes, grouped) ($SECONDS s)"
timeout 45 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and (2304 or 4352) or every_width and (1536x300 or 4352x500 or 256x100)" > $OUT/racecheck.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck.txt | tail -2
for r in a b; do
  for s in 0 1; do
    echo "== DS4_GPU_MV_IMMA_SUMS=$s prefill, round $r ($SECONDS s)"
    DS4_GPU_MV_IMMA_SUMS=$s timeout 40 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/sums$s$r.json \
      --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "^prefill"
  done
done
echo "== DS4_GPU_MV_IMMA_SUMS=0 bench, decode too ($SECONDS s)"
DS4_GPU_MV_IMMA_SUMS=0 timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/sums0_all.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 2>&1 | grep -E "^prefill|^decode"
for s in 1; do
  [ $SECONDS -lt 230 ] || { echo "== tables SUMS=$s skipped (time)"; continue; }
  echo "== ncu memory tables, the first wide launch, SUMS=$s ($SECONDS s)"
  DS4_GPU_MV_IMMA_SUMS=$s timeout 45 ncu --clock-control none --profile-from-start off --target-processes all -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section WarpStateStats --print-details all --csv --page details -k "regex:imma_q8_kernel" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/tables$s.csv 2> $OUT/tables$s.err
  echo "ncu exit $?"
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call3_all.tgz E racecheck.txt sums*.json tables* && rm -rf E racecheck.txt sums*.json tables*)
echo "done ($SECONDS s)"
