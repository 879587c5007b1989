#!/usr/bin/env bash
# Pass 33 calls 4 and 5 (the same machine): ncu of a 2048-row prompt step's heavy kernels with the warp
# stall reasons and the pipes (--print-details all): call 4 the first 4 launches matching
# imma_q4k|imma_q8|attention_split (they are imma_q8 and attention_split), call 5 (REGEX=imma_q4k, -c 2)
# the grouped Q4_K kernel. Call 4 ran without --section MemoryWorkloadAnalysis; call 5 with it.
export PYTHONPATH=/tmp/site
REGEX=${REGEX:-"imma_q4k|imma_q8|attention_split"} COUNT=${COUNT:-4}
timeout 200 ncu --clock-control none --profile-from-start off --target-processes all --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --print-details all --csv --page details -k "regex:$REGEX" -c "$COUNT" \
  python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 --variant "" > $OUT/ncu.csv 2> $OUT/ncu.err
echo "ncu exit $?"
gzip $OUT/ncu.csv
