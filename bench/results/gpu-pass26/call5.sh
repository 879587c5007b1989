#!/usr/bin/env bash
# Pass 26 call 5: the grouped Q4_K tensor-core kernel in 64-row blocks of 16 warps again (call 2's
# GqShape), now with call 3's whole-chunk applies, as DS4_GPU_MV_IMMA_Q4K_ROWS=64 (read once a process)
# against the default 32. engine_run.sh (the GPU tests, memcheck of engine_check --quick, the prefill
# bench), then in processes with 64: the grouped and engine tensor-core tests, the prefill bench, ncu
# of the 2048-row step's first grouped launches, racecheck of a grouped test; then the default again.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only"
export PYTHONPATH=/tmp/site
export DS4_GPU_MV_IMMA_Q4K_ROWS=64
echo "== pytest (64-row blocks) ($SECONDS s)"
timeout 60 python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider -k "grouped or engine_prefill" 2>&1 | tail -2
echo "== prefill, 64-row blocks ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/rows64.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill|exactness"
echo "== ncu, 64-row blocks ($SECONDS s)"
timeout 60 ncu --clock-control none --profile-from-start off --target-processes all --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats --csv -k "regex:imma_q4k" -c 2 \
  python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/ncu_q4k64.csv 2> $OUT/ncu.err; echo "ncu exit $?"
gzip -f $OUT/ncu_q4k64.csv
echo "== racecheck, 64-row blocks ($SECONDS s)"
timeout 60 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and 2304" > $OUT/racecheck_q4k64.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck_q4k64.txt | tail -2
unset DS4_GPU_MV_IMMA_Q4K_ROWS
echo "== prefill, 32-row blocks again ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/rows32.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill"
echo "done ($SECONDS s)"
