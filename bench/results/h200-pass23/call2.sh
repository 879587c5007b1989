#!/usr/bin/env bash
# Pass 23 call 2 (module B, right after call 1 on the same machine): the Q4_K sub-block sums (one float
# step a sub-block): digests against call 1's A (the Q8_0 ones must stay equal, the Q4_K integer ones
# change), engine_run.sh (the GPU tests, memcheck, prefill, decode, the 2048-row profile), ncu raw
# metrics of imma_q4k at 2048 rows.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
so=_native.cpython-312-x86_64-linux-gnu.so
use() { python3 -c "import tarfile; tarfile.open('$1').extractall('/tmp/mod_$2')"; cp /tmp/mod_$2/build/gpu312/ds4_app/engine/$so ds4_app/engine/; }
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy"
use build/gpu312.tar.xz B
echo "== B digest ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/B_digest.json --against A_digest.json 2>&1 | tail -80
echo "B digest exit ${PIPESTATUS[0]}"
mkdir -p $OUT/B
OUT=$OUT/B ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped"
echo "== B ncu p2048 imma_q4k ($SECONDS s)"
timeout 90 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 2 \
  -k "regex:imma_q4k" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/B_ncu_q4k.csv 2> /tmp/ncu.err; echo "ncu exit $?"; tail -5 /tmp/ncu.err
gzip $OUT/B_ncu_q4k.csv
echo "done ($SECONDS s)"
