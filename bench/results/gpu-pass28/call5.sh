#!/usr/bin/env bash
# Pass 28 call 5 (main with the slice sums column by column as its only layout: branch pass28-sums-final's
# kernels, no switch): the module main would ship, checked on a GPU. engine_run (the GPU tests, memcheck of
# engine_check --quick and of the imma tests, the whole bench), then a second prefill-only bench in its own
# process. Expected: every test and check passes, every bench mode bit-identical, prefill and decode within
# the runs' spread of call 3's SUMS=1 figures (15442-15473 tok/s at 2048 rows on an H100).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 140 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k or every_width"
export PYTHONPATH=/tmp/site
echo "== prefill, a second process ($SECONDS s)"
timeout 40 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/prefill_b.json \
  --prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "^prefill"
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call5_all.tgz E prefill_b.json && rm -rf E prefill_b.json)
echo "done ($SECONDS s)"
