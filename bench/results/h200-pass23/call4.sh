#!/usr/bin/env bash
# Pass 23 call 4: call 3's module, the fixed cp.async-vs-bulk test (its parent had read the Q8_0 shape for the grouped call).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider 2>&1 | tail -3
compute-sanitizer --tool memcheck python3 -m pytest tests/gpu/test_gpu_imma.py -q -p no:cacheprovider -k bulk 2>&1 | grep -E "ERROR SUMMARY|passed|failed"
