#!/usr/bin/env bash
# Everything one device call does for the GPU engine (ext/gpu/README.md, "Engine"):
#   OUT=dir ext/gpu/bench/engine_run.sh [--no-bench] [--budget SECONDS] [--harness BINARY]
#                                       [--harness-bench --bench-chunked|--bench-staged|--bench-grouped|--bench]
# 1. Python packages the image lacks, from carried wheels (.whl/, when present);
# 2. the module: the carried cp312 build (build/gpu312/...), else built here (DS4_GPU=cuda, in place);
# 3. in the background, a flash-l4 model synthesized to /tmp/f.gguf (about 60 s, 16.7 GB);
# 4. pytest tests/gpu (engine_check.py's per-variant diagnosis only when it fails);
#    with --harness (a harness built by build.sh, carried): its --check, then its bench
#    (--harness-bench: --bench-chunked by default, the unit-by-unit and the chunked weight loads
#    side by side; --bench-grouped: the grouped Q4_K kernel's pass-5 and pass-6 variants, compared
#    bit for bit) into harness.json; --harness-bench without --harness takes the first carried
#    build/gpu-harness/*/harness;
# 5. compute-sanitizer memcheck on engine_check.py --quick (eager, then graphs + tall matvec);
# 6. engine_bench.py on flash-l4: exactness of graphs and tall matvec bit for bit, prefill and
#    decode C = 1, 2, 4, 8 in each mode with rooflines, a kernel profile;
# 7. compute-sanitizer racecheck on engine_check.py --quick, with whatever the budget leaves.
# The budget (default 330 s) bounds the whole script: each part's timeout is the smaller of its
# own and what is left, so the call returns its logs before the device tool's limit.
# Writes to $OUT (8 files at most): run.log (everything, the harness check too), pytest.txt,
# check.txt (only on a failure), memcheck.txt, racecheck.txt, bench.json, bench.profile.txt,
# harness.json.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/ds4-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
bench=1
budget=330
harness=
harness_bench=--bench-chunked
harness_bench_set=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --budget) budget=$2; shift ;;
    --harness) harness=$2; shift ;;
    --harness-bench) harness_bench=$2; harness_bench_set=1; shift ;;
  esac
  shift
done
if [ -z "$harness" ] && [ $harness_bench_set = 1 ]; then
  harness=$(ls build/gpu-harness/*/harness 2>/dev/null | head -1)
  [ -n "$harness" ] || echo "--harness-bench $harness_bench: no carried build/gpu-harness/*/harness"
fi
start=$SECONDS
# The timeout for a part: its own limit, or what is left of the budget less a margin.
left() {
  local l=$((budget - (SECONDS - start) - 10))
  [ "$l" -lt 5 ] && l=5
  [ "$1" -lt "$l" ] && l=$1
  echo "$l"
}
echo "commit $(git rev-parse HEAD 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 --version
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
if [ $bench = 1 ]; then
  (python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; \
   echo "synth exit $?" >> /tmp/synth.log) &
  synth_pid=$!
fi
so=build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so
[ -f "$so" ] && cp "$so" ds4_app/engine/
if ! python3 -c "from ds4_app.engine import _native as n; assert n.gpu_available(), 'no device'" 2>/tmp/import.txt; then
  cat /tmp/import.txt
  echo "== the carried module does not load here; building (DS4_GPU=cuda, in place)"
  rm -f ds4_app/engine/_native*.so
  DS4_GPU=cuda python3 -m pip install -q --no-build-isolation --no-deps -e . -C editable.mode=inplace \
    > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
fi
python3 -c "from ds4_app.engine import _native as n; print('module', n.__file__, n.gpu_backend(), n.gpu_available())"

echo "== pytest tests/gpu ($((SECONDS - start)) s)"
timeout "$(left 150)" python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider --durations=8 \
  > "$OUT/pytest.txt" 2>&1
rc=$?
echo "pytest exit $rc"
tail -45 "$OUT/pytest.txt"
if [ $rc != 0 ]; then
  echo "== engine_check ($((SECONDS - start)) s)"
  timeout "$(left 60)" python3 ext/gpu/bench/engine_check.py > "$OUT/check.txt" 2>&1
  echo "engine_check exit $?"
  cat "$OUT/check.txt"
fi
if [ -n "$harness" ]; then
  echo "== harness --check ($((SECONDS - start)) s)"
  timeout "$(left 90)" "$harness" --check
  echo "harness check exit $?"
  echo "== harness $harness_bench ($((SECONDS - start)) s)"
  timeout "$(left 90)" "$harness" "$harness_bench" --json "$OUT/harness.json"
  echo "harness bench exit $?"
fi
echo "== compute-sanitizer memcheck (engine_check --quick) ($((SECONDS - start)) s)"
timeout "$(left 90)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py --quick \
  > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit $?"
grep -m 20 -E "ERROR SUMMARY|Invalid|quick:|Error" "$OUT/memcheck.txt"
if [ $bench = 1 ]; then
  echo "== bench flash-l4 ($((SECONDS - start)) s)"
  wait $synth_pid
  tail -3 /tmp/synth.log
  ls -la /tmp/f.gguf
  timeout "$(left 200)" python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$OUT/bench.json"
  echo "bench exit $?"
fi
echo "== compute-sanitizer racecheck (engine_check --quick) ($((SECONDS - start)) s)"
timeout "$(left 120)" compute-sanitizer --tool racecheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py --quick \
  > "$OUT/racecheck.txt" 2>&1
echo "racecheck exit $?"
grep -m 20 -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|hazard|quick:" "$OUT/racecheck.txt"
echo "== done in $((SECONDS - start)) s"
