#!/usr/bin/env bash
# Pass 23 call 1: the coalesced-store tree (8725130; pass 22's final tree, whose call-3 raw files were lost
# with the machine): digests against pass 22 call 2's (kept), the GPU tests, memcheck, prefill and decode,
# the 2048-row profile; ncu raw metrics of imma_q4k at 2048 rows and of the own grouped kernel at C = 1.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
echo "== digest ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/digest.json \
  --against bench/results/h200-pass22/call2_digest_new.json; echo "digest exit $?"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 420 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped"
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis"
echo "== ncu p2048 imma_q4k ($SECONDS s)"
timeout 100 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 2 \
  -k "regex:imma_q4k" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/ncu_q4k.csv 2> $OUT/ncu_q4k.err; echo "ncu exit $?"
echo "== ncu C=1 own ($SECONDS s)"
timeout 100 ncu --clock-control none --profile-from-start off $secs --page raw --csv \
  -k "regex:grouped_own" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 \
  > $OUT/ncu_own_c1.csv 2> $OUT/ncu_own_c1.err; echo "ncu exit $?"
gzip $OUT/ncu_q4k.csv $OUT/ncu_own_c1.csv
echo "done ($SECONDS s)"
