#!/usr/bin/env bash
# Pass 13, call 1: the narrow IMMA tile with its planes a chunk ahead, and its row threshold: the
# imma tests first, the GPU suite, memcheck over the imma tests, bench variants, ncu of a C=8 step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; R=/tmp/res1; mkdir -p "$OUT" "$R"
exec > >(tee -a "$OUT/run.log") 2>&1
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/carry/bins.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
(python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; echo "synth exit $?" >> /tmp/synth.log) &
synth=$!
echo "== pytest imma ($((SECONDS-start)) s)"
timeout 60 python3 -m pytest tests/gpu/test_gpu_imma.py -q -x -rfE --tb=short -p no:cacheprovider > "$R/pytest_imma.txt" 2>&1
echo "pytest imma exit $?"; grep -E "passed|failed|FAILED|Error" "$R/pytest_imma.txt" | tail -8
echo "== pytest ($((SECONDS-start)) s)"
timeout 120 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$R/pytest.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|FAILED|Error" "$R/pytest.txt" | tail -8
echo "== memcheck ($((SECONDS-start)) s)"
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_imma.py -q -x \
  -k "every_width or narrow" -p no:cacheprovider > "$R/memcheck_imma.txt" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck_imma.txt" | tail -3
wait $synth; tail -1 /tmp/synth.log
echo "== bench ($((SECONDS-start)) s)"
timeout 200 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$R/bench.json" --prefill-rows 512 \
  --long-ctx 0 --steps 20 \
  --variants ",imma=8,imma=8:immaahead=0,imma=4,imma=4:immarows=16384,imma=2:immarows=16384," > "$R/bench.log" 2>&1
echo "bench exit $?"; grep -E "exactness|prefill|decode C|bandwidth" "$R/bench.log"
tar -czf "$OUT/results.tgz" -C /tmp res1
for v in 16 8; do
  echo "== ncu C=8 imma=$v ($((SECONDS-start)) s)"
  DS4_GPU_MV_IMMA=$v timeout 80 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --csv --page details -k "regex:imma|staged|dense|multi" \
    python3 build/carry/ncu_c1.py /tmp/f.gguf 8 > "$R/ncu_c8_imma$v.csv" 2> "$R/ncu_c8_imma$v.err"
  echo "ncu exit $?"; gzip -f "$R/ncu_c8_imma$v.csv"
done
tar -czf "$OUT/results.tgz" -C /tmp res1
echo "== end ($((SECONDS-start)) s)"
