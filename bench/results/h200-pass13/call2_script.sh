#!/usr/bin/env bash
# Pass 13, call 2: the new defaults (imma=6, narrow rows 4096): GPU suite, bench variants around them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; R=/tmp/res2; mkdir -p "$OUT" "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/carry/bins.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
(python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; echo "synth exit $?" >> /tmp/synth.log) &
synth=$!
echo "== pytest ($((SECONDS-start)) s)"
timeout 120 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$R/pytest.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|FAILED|Error" "$R/pytest.txt" | tail -8
wait $synth; tail -1 /tmp/synth.log
echo "== bench ($((SECONDS-start)) s)"
timeout 240 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$R/bench.json" --prefill-rows 6,8,12,512 \
  --long-ctx 0 --steps 20 \
  --variants ",imma=16,immarows=0,immarows=2048,imma=8,imma=5," > "$R/bench.log" 2>&1
echo "bench exit $?"; grep -E "exactness|prefill|decode C|bandwidth" "$R/bench.log"
tar -czf "$OUT/results.tgz" -C /tmp res2
echo "== end ($((SECONDS-start)) s)"
