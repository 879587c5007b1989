#!/usr/bin/env bash
# Pass 14, call 3: the final defaults (width 1, the 1-column body's register cap): GPU suite, memcheck, bench, ncu.
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
timeout 120 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$R/pytest.txt" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|FAILED|Error" "$R/pytest.txt" | tail -8
echo "== memcheck ($((SECONDS-start)) s)"
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/gpu/test_gpu_fused.py -q -x \
  -k "(row_groups_keep and (tiny or partial)) or (same_with_row_groups and eager)" -p no:cacheprovider > "$R/memcheck_groups.txt" 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" "$R/memcheck_groups.txt" | tail -3
wait $synth; tail -1 /tmp/synth.log
echo "== bench ($((SECONDS-start)) s)"
timeout 170 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$R/bench.json" --prefill-rows 8,64,512 \
  --long-ctx 0 --steps 20 --variants ",owncap=0,ownwidth=4,owngroups=1:ownwidth=4:owncap=0,immag=1," \
  > "$R/bench.log" 2>&1
echo "bench exit $?"; grep -E "exactness|prefill|decode C|bandwidth" "$R/bench.log"
for cv in "8 owncap=1 grouped_own" "1 owncap=1 grouped_own"; do
  set -- $cv
  echo "== ncu C=$1 $2 ($((SECONDS-start)) s)"
  timeout 60 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --csv --page details \
    -k "regex:$3" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf $1 --variant $2 > "$R/ncu_c$1_$2.csv" 2> "$R/ncu_c$1_$2.err"
  echo "ncu exit $?"; gzip -f "$R/ncu_c$1_$2.csv"
done
tar -czf "$OUT/results.tgz" -C /tmp res3
echo "== end ($((SECONDS-start)) s)"
