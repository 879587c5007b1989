#!/usr/bin/env bash
# Pass 22 call 2 (the min term's column scale sM in the planes record): digests against call 1's build,
# the GPU tests, memcheck, prefill and decode, a 2048-row profile, and ncu raw metrics of imma_q4k.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
echo "== digest ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/digest_new.json --against digest_old.json; echo "digest exit $?"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 400 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped"
echo "== ncu p2048 imma_q4k ($SECONDS s)"
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight"
timeout 120 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 2 \
  -k "regex:imma_q4k" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/ncu_q4k.csv 2> $OUT/ncu_q4k.err; echo "ncu exit $?"
gzip $OUT/ncu_q4k.csv
echo "done ($SECONDS s)"
