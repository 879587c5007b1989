#!/usr/bin/env bash
# Pass 27 call 4 (call 3 could not start a machine; the budget left is short, so leaner) (branch pass27-multicast): the grouped Q4_K tensor-core kernel in clusters of two row
# blocks that share each chunk's plane copies (multicast bulk copies; DS4_GPU_MV_IMMA_Q4K_MC=0/1, read once
# a process, default 1). Call 1's ncu found the kernel at L2 80% with the same duration whatever its
# instruction count and CPI; the planes are ~60% of its L2 reads. Lean (the session's device time is
# short): engine_run (the GPU tests, memcheck of engine_check --quick and of the grouped tests, the
# prefill bench, ncu of the 2048-row step's first grouped launches), racecheck of the grouped tests, the
# grouped tests with MC off, then the prefill bench off / on in two processes. Prediction (written before
# the run): L2 reads of the kernel -31% (planes 1.6x the weights, halved), the kernel -8-15% at 2048 rows
# (a cluster barrier a chunk costs back some), prefill +3-6%.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p $OUT/E
OUT=$OUT/E ext/gpu/bench/engine_run.sh --budget 130 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped_q4k" \
  --ncu p2048 "" "imma_q4k"
export PYTHONPATH=/tmp/site
echo "== racecheck (grouped tensor-core tests, MC on) ($SECONDS s)"
timeout 25 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q \
  -p no:cacheprovider -k "grouped_q4k and (2304 or 4352)" > $OUT/racecheck_q4k.txt 2>&1; echo "racecheck exit $?"
grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck_q4k.txt | tail -2
echo "== DS4_GPU_MV_IMMA_Q4K_MC=0: grouped tests ($SECONDS s)"
DS4_GPU_MV_IMMA_Q4K_MC=0 timeout 25 python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider \
  -k "grouped or engine_prefill or cp_async" 2>&1 | tail -1
for s in 0 1; do
  echo "== DS4_GPU_MV_IMMA_Q4K_MC=$s prefill ($SECONDS s)"
  DS4_GPU_MV_IMMA_Q4K_MC=$s timeout 35 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/mc$s.json \
    --prefill-rows 2048 --long-ctx 0 --steps 20 --variants comppar=1 --prefill-only 2>&1 | grep -E "prefill"
done
cp $OUT/E/run.log $OUT/ 2>/dev/null
(cd $OUT && tar -czf call4_all.tgz E racecheck_q4k.txt mc*.json && rm -rf E racecheck_q4k.txt mc*.json)
echo "done ($SECONDS s)"
