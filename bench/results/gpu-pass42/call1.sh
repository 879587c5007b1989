#!/usr/bin/env bash
# Pass 42 call 1 (ext/gpu/README "Pass 42"): two modules carried, built SASS-only and uncompressed so both fit:
#   A  build/gpu312.tar.xz        main (the opening window behind DS4_GPU_L2_OPENING=1, off by default);
#   B  build/gpu312-early.tar.xz  the same code built with -DDS4_GPU_PDL_EARLY (branch pass42-pdl-early):
#      every kernel releases its dependents before its grid wait.
# 1. engine_run.sh with A: the GPU tests, memcheck of engine_check --quick, decode C = 1-8 and prefill, a C = 1
#    graph timeline.
# 2. B: the GPU tests, and bits_digest against A's (the same bits by the PDL contract).
# 3. The A/B, eight processes alternating: B, A with the opening, A, B with the opening; twice.
# 4. C = 1 graph timelines of B and of A with the opening.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
so=_native.cpython-312-x86_64-linux-gnu.so
A=build/gpu312/ds4_app/engine/$so
B=/tmp/early/build/gpu312/ds4_app/engine/$so
python3 -c "import tarfile; tarfile.open('build/gpu312-early.tar.xz').extractall('/tmp/early')"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1 --steps 3"
export PYTHONPATH=/tmp/site
ab=/tmp/ab
mkdir -p $ab
use() { cp "$1" ds4_app/engine/$so; }
echo "== bits_digest, A ($SECONDS s)"
use $A
timeout 90 python3 ext/gpu/bench/bits_digest.py $ab/digest_a.json > $ab/digest_a.log 2>&1
echo "exit $?"
echo "== pytest tests/gpu, B ($SECONDS s)"
use $B
timeout 150 python3 -m pytest tests/gpu -q -rfE --tb=short -p no:cacheprovider > "$OUT/pytest_early.txt" 2>&1
echo "pytest exit $?"
tail -4 "$OUT/pytest_early.txt"
echo "== bits_digest, B against A ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/bits_digest.py $ab/digest_b.json --against $ab/digest_a.json > $ab/digest_b.log 2>&1
echo "exit $?"
tail -4 $ab/digest_b.log
bench() {  # LABEL MODULE [VAR=VALUE ...]
  local label=$1 mod=$2
  shift 2
  use "$mod"
  echo "== bench $label ($SECONDS s)"
  env "$@" timeout 100 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 --long-ctx 0 \
    --steps 30 --json $ab/bench_$label.json 2>&1 | grep -E "tok/s|roofline" | head -8
}
for r in 1 2; do
  bench early_$r $B DS4_PASS42=B
  bench opening_$r $A DS4_GPU_L2_OPENING=1
  bench main_$r $A DS4_PASS42=A
  bench both_$r $B DS4_GPU_L2_OPENING=1
done
echo "== C = 1 timelines: B, A with the opening ($SECONDS s)"
use $B
timeout 60 python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 3 --json $ab/timeline_early.json \
  | grep -E "span"
use $A
DS4_GPU_L2_OPENING=1 timeout 60 python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 3 \
  --json $ab/timeline_opening.json | grep -E "span"
tar -czf "$OUT/ab.tgz" -C /tmp ab
echo "done ($SECONDS s)"
