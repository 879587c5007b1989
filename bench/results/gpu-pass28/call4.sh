#!/usr/bin/env bash
# Pass 28 call 4 (branch pass28-sums-layout, on the machine call 3 had left warm, /tmp/f.gguf still there):
# ncu's tables and source counters of the first grouped Q4_K launch of a 2048-row step with the slice sums
# column by column (SUMS=1) and row by row (SUMS=0). Run as one command line; written here as it was sent.
export PYTHONPATH=/tmp/site; ls -la /tmp/f.gguf | head -1
for s in 1 0; do
  DS4_GPU_MV_IMMA_SUMS=$s timeout 60 ncu --clock-control none --profile-from-start off --target-processes all -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section SourceCounters --print-details all \
    --csv --page details -k "regex:imma_q4k_grouped" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
    > $OUT/q4k_tables$s.csv 2> $OUT/q4k_tables$s.err
  echo "ncu $s exit $?"
done
gzip $OUT/*.csv
