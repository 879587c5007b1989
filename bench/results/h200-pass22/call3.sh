#!/usr/bin/env bash
# Pass 22 call 3 (coalesced Y stores of the tensor-core tiles): digests against call 2 (every bit the same),
# the GPU tests, memcheck, prefill and decode, a 2048-row profile, and ncu raw metrics of imma_q4k.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
echo "== digest ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/digest_new.json --against digest_sm.json; echo "digest exit $?"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 400 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 20 --profile-rows 2048" \
  --memcheck-tests tests/gpu/test_gpu_imma.py --memcheck-k "grouped or every_width"
echo "done ($SECONDS s)"
