#!/usr/bin/env bash
# Everything one device call does for the GPU engine (ext/gpu/README.md, "Engine"):
#   OUT=dir ext/gpu/bench/engine_run.sh [--no-bench]
# 1. Python packages the image lacks, from carried wheels (.whl/, when present);
# 2. the module: the carried cp312 build (build/gpu312/...), else built here (DS4_GPU=cuda, in place);
# 3. in the background, a flash-l4 model synthesized to /tmp/f.gguf (about 70 s, 16.7 GB);
# 4. pytest tests/gpu, then engine_check.py (where GPU and CPU differ, per layer kind);
# 5. compute-sanitizer memcheck on engine_check.py --quick;
# 6. engine_bench.py on flash-l4 (decode C = 1, 2, 4, 8 and prefill, with rooflines, and a profile);
# 7. compute-sanitizer racecheck on engine_check.py --quick.
# Writes to $OUT: run.log (everything), pytest.txt, check.txt, memcheck.txt, racecheck.txt,
# bench.json, bench.profile.txt.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/ds4-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
echo "commit $(git rev-parse HEAD 2>/dev/null) ($(git status --porcelain 2>/dev/null | wc -l) changed files)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 --version
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
so=build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so
[ -f "$so" ] && cp "$so" ds4_app/engine/
if ! python3 -c "from ds4_app.engine import _native as n; assert n.gpu_available(), 'no device'" 2>"$OUT/import.txt"; then
  cat "$OUT/import.txt"
  echo "== the carried module does not load here; building (DS4_GPU=cuda, in place)"
  rm -f ds4_app/engine/_native*.so
  DS4_GPU=cuda python3 -m pip install -q --no-build-isolation --no-deps -e . -C editable.mode=inplace \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
python3 -c "from ds4_app.engine import _native as n; print('module', n.__file__, n.gpu_backend(), n.gpu_available())"

bench=1
[ "${1:-}" = "--no-bench" ] && bench=0
if [ $bench = 1 ]; then
  (python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > "$OUT/synth.log" 2>&1; \
   echo "synth exit $?" >> "$OUT/synth.log") &
  synth_pid=$!
fi

echo "== pytest tests/gpu"
timeout 300 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?"
tail -40 "$OUT/pytest.txt"
echo "== engine_check"
timeout 200 python3 ext/gpu/bench/engine_check.py > "$OUT/check.txt" 2>&1
echo "engine_check exit $?"
cat "$OUT/check.txt"
echo "== compute-sanitizer memcheck (engine_check --quick)"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py --quick \
  > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit $?"
grep -m 20 -E "ERROR SUMMARY|Invalid|quick:|Error" "$OUT/memcheck.txt"
if [ $bench = 1 ]; then
  echo "== bench flash-l4"
  wait $synth_pid
  tail -3 "$OUT/synth.log"
  ls -la /tmp/f.gguf
  timeout 240 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json "$OUT/bench.json"
  echo "bench exit $?"
fi
echo "== compute-sanitizer racecheck (engine_check --quick)"
timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 python3 ext/gpu/bench/engine_check.py --quick \
  > "$OUT/racecheck.txt" 2>&1
echo "racecheck exit $?"
grep -m 20 -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|hazard|quick:" "$OUT/racecheck.txt"
