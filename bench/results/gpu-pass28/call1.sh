#!/usr/bin/env bash
# Pass 28 call 1, prepared in the twenty-fifth session (not yet run): where the 2048-row prompt step's three
# largest kernels spend their memory traffic, before another lever is built for them. Pass 27 found the
# grouped Q4_K kernel at L2 80% whether or not its planes' reads were halved, so which traffic the L2 figure
# counts is the open question. engine_run.sh (the GPU tests, memcheck of engine_check --quick, the bench:
# prefill at 512 and 2048 rows and decode C = 1-8 with rooflines, ncu's standard sections on the first
# grouped launches, the prompt timeline); then ncu's memory tables and source counters of one launch each of
# the grouped Q4_K kernel, the wide Q8_0 tile and the split attention in one 2048-row prompt step. Ask for
# the H200 first: the bench is then the final tree's figure on the machine.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 330 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --ncu p2048 "" "imma_q4k" \
  --timeline "--prompt-rows 2048 --steps 3"
export PYTHONPATH=/tmp/site
for k in imma_q4k imma_q8_kernel attention_split; do
  echo "== ncu memory tables and source counters: $k ($SECONDS s)"
  timeout 120 ncu --clock-control none --profile-from-start off --target-processes all -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section SourceCounters --csv --page details -k "regex:$k" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/tables_$k.csv 2> $OUT/tables_$k.err
  echo "ncu exit $?"
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call1_all.tgz E tables_* && rm -rf E tables_*)
echo "done ($SECONDS s)"
