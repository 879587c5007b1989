#!/usr/bin/env bash
# Pass 13, call 3: the narrow tile's persistent grid: imma tests, GPU suite, memcheck, bench variants.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; R=/tmp/res3; mkdir -p "$OUT" "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/carry/bins.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
(python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; echo "synth exit $?" >> /tmp/synth.log) &
synth=$!
echo "== pytest ($((SECONDS-start)) s)"
timeout 100 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$R/pytest.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|FAILED|Error" "$R/pytest.txt" | tail -8
echo "== memcheck ($((SECONDS-start)) s)"
timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q -x \
  -k "1024x9000 or 2048x8200 or narrow" -p no:cacheprovider > "$R/memcheck_imma.txt" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck_imma.txt" | tail -3
wait $synth; tail -1 /tmp/synth.log
echo "== bench ($((SECONDS-start)) s)"
timeout 110 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$R/bench.json" --prefill-rows 8,512 \
  --long-ctx 0 --steps 20 --variants ",immapersist=0,immaahead=0,imma=16," > "$R/bench.log" 2>&1
echo "bench exit $?"; grep -E "exactness|prefill|decode C|bandwidth" "$R/bench.log"
tar -czf "$OUT/results.tgz" -C /tmp res3
echo "== end ($((SECONDS-start)) s)"
