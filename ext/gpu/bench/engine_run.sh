#!/usr/bin/env bash
# Everything one device call does for the GPU engine (ext/gpu/README.md, "Engine"):
#   OUT=dir ext/gpu/bench/engine_run.sh [--no-bench] [--budget SECONDS] [--harness BINARY]
#                                       [--harness-bench --bench-chunked|--bench-staged|--bench-grouped|--bench]
#                                       [--bench-args "ENGINE_BENCH ARGS"] [--memcheck-tests FILE
#                                       --memcheck-k EXPR] [--ncu C VARIANT REGEX]... [--no-racecheck]
#                                       [--timeline "GRAPH_TIMELINE ARGS"]
# 1. Python packages the image lacks, from carried wheels (.whl/, when present);
# 2. the module: the carried cp312 build (build/gpu312/..., or packed by pack_module.sh into
#    build/gpu312.tar.xz), else built here (DS4_GPU=cuda, in place);
# 3. in the background, a flash-l4 model synthesized to /tmp/f.gguf (about 60 s, 16.7 GB);
# 4. pytest tests/gpu (engine_check.py's per-variant diagnosis only when it fails);
#    with --harness (a harness built by build.sh, carried): its --check, then its bench
#    (--harness-bench: --bench-chunked by default, the unit-by-unit and the chunked weight loads
#    side by side; --bench-grouped: the grouped Q4_K kernel's pass-5 and pass-6 variants, compared
#    bit for bit) into harness.json; --harness-bench without --harness takes the first carried
#    build/gpu-harness/*/harness;
# 5. compute-sanitizer memcheck on engine_check.py --quick (eager, then graphs + tall matvec), and
#    with --memcheck-tests on those pytest tests (-k --memcheck-k);
# 6. engine_bench.py on flash-l4 (--bench-args: its options, e.g. --variants): exactness of graphs
#    and tall matvec bit for bit, prefill and decode C = 1, 2, 4, 6, 8 in each mode (or variant)
#    with rooflines, a kernel profile; then each --ncu: ncu (SpeedOfLight, Occupancy,
#    WarpStateStats, LaunchStats) of the kernels matching REGEX in one eager decode step of C lanes
#    under an engine_bench variant (ncu_step.py; "" for the defaults; C = pN profiles the first 3
#    such launches of a prompt step of N rows instead, with the memory, scheduler, compute and
#    instruction sections too);
#    then, with --timeline, graph_timeline.py on flash-l4 with those options (its JSON in extra.tgz);
# 7. compute-sanitizer racecheck on engine_check.py --quick, with whatever the budget leaves
#    (--no-racecheck: not run).
# The budget (default 330 s) bounds the whole script: each part's timeout is the smaller of its
# own and what is left, so the call returns its logs before the device tool's limit.
# Writes to $OUT (8 files at most): run.log (everything, the harness check too), pytest.txt,
# check.txt (only on a failure), memcheck.txt, racecheck.txt, bench.json, harness.json, and
# extra.tgz: the bench's profiles (bench.profile*.txt), the --memcheck-tests log, the ncu CSVs.
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
bench_args=
memcheck_tests=
memcheck_k=
racecheck=1
timeline=0
ncu_runs=()  # C, variant, regex, C, variant, regex, ...
timeline_args=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-bench) bench=0 ;;
    --budget) budget=$2; shift ;;
    --harness) harness=$2; shift ;;
    --harness-bench) harness_bench=$2; harness_bench_set=1; shift ;;
    --bench-args) bench_args=$2; shift ;;
    --memcheck-tests) memcheck_tests=$2; shift ;;
    --memcheck-k) memcheck_k=$2; shift ;;
    --ncu) ncu_runs+=("$2" "$3" "$4"); shift 3 ;;
    --no-racecheck) racecheck=0 ;;
    --timeline) timeline_args=$2; timeline=1; shift ;;
    *) echo "engine_run.sh: unknown option $1"; exit 2 ;;
  esac
  shift
done
extra=/tmp/ds4-run-extra  # what goes back in extra.tgz
rm -rf "$extra"
mkdir -p "$extra"
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
[ -f build/gpu312.tar.xz ] && python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
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
if [ -n "$memcheck_tests" ]; then
  echo "== compute-sanitizer memcheck ($memcheck_tests -k '$memcheck_k') ($((SECONDS - start)) s)"
  timeout "$(left 90)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest "$memcheck_tests" -q \
    -p no:cacheprovider ${memcheck_k:+-k "$memcheck_k"} > "$extra/memcheck_tests.txt" 2>&1
  echo "memcheck exit $?"
  grep -E "ERROR SUMMARY|passed|failed" "$extra/memcheck_tests.txt" | tail -3
fi
if [ $bench = 1 ]; then
  echo "== bench flash-l4 ($((SECONDS - start)) s)"
  wait $synth_pid
  tail -3 /tmp/synth.log
  ls -la /tmp/f.gguf
  # shellcheck disable=SC2086  # --bench-args is a list of options
  timeout "$(left 200)" python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$extra/bench.json" $bench_args
  echo "bench exit $?"
  cp "$extra/bench.json" "$OUT/" 2>/dev/null
  for ((i = 0; i < ${#ncu_runs[@]}; i += 3)); do
    c=${ncu_runs[i]} variant=${ncu_runs[i + 1]} regex=${ncu_runs[i + 2]}
    echo "== ncu C=$c [$variant] $regex ($((SECONDS - start)) s)"
    # C = pN: one prompt step of N rows (the first 3 matching launches, with the sections below too)
    step_args=("$c") sections=()
    if [[ $c == p* ]]; then
      step_args=(1 --prompt-rows "${c#p}")
      sections=(--section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis
                --section InstructionStats -c 3)
    fi
    timeout "$(left 90)" ncu --clock-control none --profile-from-start off --target-processes all \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats "${sections[@]}" \
      --csv --page details -k "regex:$regex" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf "${step_args[@]}" \
      --variant "$variant" > "$extra/ncu_$((i / 3))_c$c.csv" 2> "$extra/ncu_$((i / 3))_c$c.err"
    echo "ncu exit $?"
    gzip -f "$extra/ncu_$((i / 3))_c$c.csv"
  done
  if [ $timeline = 1 ]; then
    echo "== graph timeline [$timeline_args] ($((SECONDS - start)) s)"
    # shellcheck disable=SC2086  # --timeline is a list of options
    timeout "$(left 150)" python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --json "$extra/timeline.json" $timeline_args
    echo "timeline exit $?"
  fi
fi
if [ $racecheck = 1 ]; then
  echo "== compute-sanitizer racecheck (engine_check --quick) ($((SECONDS - start)) s)"
  timeout "$(left 120)" compute-sanitizer --tool racecheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py \
    --quick > "$OUT/racecheck.txt" 2>&1
  echo "racecheck exit $?"
  grep -m 20 -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|hazard|quick:" "$OUT/racecheck.txt"
fi
rm -f "$extra/bench.json"
[ -n "$(ls -A "$extra")" ] && tar -czf "$OUT/extra.tgz" -C "$extra" .
echo "== done in $((SECONDS - start)) s"
