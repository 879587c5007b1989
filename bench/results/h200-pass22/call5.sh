#!/usr/bin/env bash
# Pass 22 call 5: call 3's code (the coalesced stores) again, on another machine: prefill and the 2048-row profile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
ls -la /tmp/f.gguf || python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf
timeout 300 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 512,2048 --long-ctx 0 --steps 20 \
  --profile-rows 2048 --json $OUT/bench.json 2>&1 | grep -vE "^ {4}[0-9.]+ us .*(hc_|attention|x_planes|dense|multi|own)" | tail -40
