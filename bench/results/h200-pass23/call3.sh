#!/usr/bin/env bash
# Pass 23 call 3 (module C: the grouped Q4_K kernel's weights and planes by bulk copies, on call 2's
# sub-block sums): engine_run.sh (the GPU tests, memcheck with the imma grouped and bulk tests, prefill,
# decode, the 2048-row profile); then the bench again with DS4_GPU_MV_IMMA_BULK=0 (every tensor-core
# kernel by cp.async: the q4k kernel's line is call 2's code); ncu of imma_q4k at 2048 rows.
set -uo pipefail
mkdir -p $OUT/C
OUT=$OUT/C ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped or bulk"
export PYTHONPATH=/tmp/site
echo "== bulk=0 bench ($SECONDS s)"
DS4_GPU_MV_IMMA_BULK=0 timeout 150 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 512,2048 \
  --long-ctx 0 --steps 20 --profile-rows 2048 --json $OUT/bulk0.json 2>&1 | grep -E "chunked=1" | head -12
grep -A3 "== prefill" $OUT/bulk0.profile.txt
echo "== ncu p2048 imma_q4k ($SECONDS s)"
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy"
timeout 90 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 2 \
  -k "regex:imma_q4k" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/C_ncu_q4k.csv 2> /tmp/ncu.err; echo "ncu exit $?"; tail -3 /tmp/ncu.err
gzip $OUT/C_ncu_q4k.csv
echo "done ($SECONDS s)"
