#!/usr/bin/env bash
# Pass 28 call 2 (prepared in the twenty-fifth session on branch pass28-half-chunks; not yet run): the grouped
# Q4_K kernel on items of 16 X units (imma_q4k_items_kernel, DS4_GPU_MV_IMMA_Q4K_HALF=0/1, read once a
# process, default 1): stages half as large (57.6 KB of shared memory against 105 KB) and 80 registers
# against 109, so three 8-warp blocks an SM instead of two. Passes 25-27 found the kernel's warps latency
# bound at 4 a scheduler (CPI ~7.7, issue 0.50) and every lever that kept two blocks an SM (or went to one)
# without a gain. Prediction (written before any run): issue 0.50 -> ~0.6 a scheduler a cycle with 6 warps,
# instructions +10-15% (twice the items, each with its barriers, waits and copies), the kernel -5-12% at
# 2048 rows, prefill +2-5%. engine_run (the GPU tests, memcheck of engine_check --quick and of the grouped
# tests, the bench, ncu of the first grouped launches, the prompt timeline), racecheck of the grouped
# tests, the grouped tests with the switch off, then the prefill bench off / on / off / on.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k or cp_async" \
  --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
echo "== racecheck (grouped tensor-core tests, items of 16 units) ($SECONDS s)"
timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and (2304 or 4352)" > $OUT/racecheck_q4k.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck_q4k.txt | tail -2
echo "== DS4_GPU_MV_IMMA_Q4K_HALF=0: grouped tests ($SECONDS s)"
DS4_GPU_MV_IMMA_Q4K_HALF=0 timeout 40 python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider \
  -k "grouped or engine_prefill or cp_async" 2>&1 | tail -1
for r in a b; do
  for s in 0 1; do
    echo "== DS4_GPU_MV_IMMA_Q4K_HALF=$s prefill, round $r ($SECONDS s)"
    DS4_GPU_MV_IMMA_Q4K_HALF=$s timeout 60 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/half$s$r.json \
      --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill"
  done
done
# call 1's memory tables, folded in (one machine start for both): ncu's memory tables and source counters of
# one launch each of the grouped Q4_K kernel (both builds), the wide Q8_0 tile and the split attention in one
# 2048-row prompt step, while the call's time allows.
for k in q4k_half1 q4k_half0 imma_q8_kernel attention_split; do
  [ $SECONDS -lt 470 ] || { echo "== tables: $k skipped (time)"; continue; }
  case $k in q4k_half*) re=imma_q4k; half=${k#q4k_half} ;; *) re=$k; half=1 ;; esac
  echo "== ncu memory tables and source counters: $k ($SECONDS s)"
  DS4_GPU_MV_IMMA_Q4K_HALF=$half timeout 90 ncu --clock-control none --profile-from-start off \
    --target-processes all -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section SourceCounters --csv --page details -k "regex:$re" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/tables_$k.csv 2> $OUT/tables_$k.err
  echo "ncu exit $?"
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call2_all.tgz E racecheck_q4k.txt half*.json tables_* && rm -rf E racecheck_q4k.txt half*.json tables_*)
echo "done ($SECONDS s)"
