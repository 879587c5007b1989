#!/usr/bin/env bash
# Pass 25 call 3: the final tree (pass 24's + the grouped Q4_K kernel's per-chunk cuts; the losing switches
# removed): engine_run.sh (the GPU tests, memcheck of engine_check --quick and of the tensor-core width and
# grouped tests, the bench, the prompt timeline, racecheck of engine_check --quick), then the stall
# reasons (ncu WarpStateStats, raw metrics) of the 2048-row step's first tensor-core launches.
set -uo pipefail
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 400 \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "(every_width and 4352x500) or (grouped_q4k and 2304)" \
  --timeline "--prompt-rows 2048 --steps 3"
echo "== ncu stall reasons, 2048-row prompt step ($SECONDS s)"
export PYTHONPATH=/tmp/site
for k in imma_q8 imma_q4k; do
  timeout 90 ncu --clock-control none --profile-from-start off --target-processes all --section WarpStateStats \
    --section SpeedOfLight --csv --page raw -k "regex:$k" -c 3 \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/stalls_$k.csv 2> $OUT/stalls_$k.err
  echo "ncu $k exit $?"
  gzip -f $OUT/stalls_$k.csv
done
echo "done ($SECONDS s)"
