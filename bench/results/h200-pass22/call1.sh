#!/usr/bin/env bash
# Pass 22 call 1 (the tree before the I2F change): bit digests of the old build, and ncu raw metrics
# (warp stalls, pipe use, instruction mix) of the prompt step's tensor-core kernels and decode C=8's
# grouped SIMT kernels.
set -uo pipefail
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
(python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; echo "synth exit $?" >> /tmp/synth.log) &
synth=$!
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
echo "== digest ($((SECONDS - start)) s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/digest_old.json; echo "digest exit $?"
wait $synth; cat /tmp/synth.log | tail -2
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight"
echo "== ncu p2048 ($((SECONDS - start)) s)"
timeout 200 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 4 \
  -k "regex:imma_q4k|imma_q8_kernel" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/ncu_p2048.csv 2> $OUT/ncu_p2048.err; echo "ncu exit $?"
echo "== ncu c8 ($((SECONDS - start)) s)"
timeout 150 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 3 \
  -k "regex:grouped" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 8 \
  > $OUT/ncu_c8.csv 2> $OUT/ncu_c8.err; echo "ncu exit $?"
gzip $OUT/*.csv
echo "done ($((SECONDS - start)) s)"
