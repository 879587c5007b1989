#!/usr/bin/env bash
# Pass 43's call for the next session (ext/gpu/README "Pass 43"): call2.sh's measurements and the A/B of branch
# pass44-copy-in-graph. One archive, build/gpu312.tar.xz (a copy of build/gpu312-pass43-call3.tar.xz):
#   M  build/gpu312/ds4_app/engine/<so>   main (the code of pass 43's last commit: the host's phases, the stride test);
#   G  build/ab/copy.so                   branch pass44-copy-in-graph: the inputs' host-to-device copy is the
#                                         step's first operation, so a graph holds it as a node and a replay
#                                         needs no copy call of its own.
# 1. engine_run.sh with M: the GPU tests, memcheck of engine_check --quick, decode C = 1-8 with the host's phases
#    and prefill, graph timelines at C = 1, 2 and 8.
# 2. bits_digest of M, then of G against M's (the same bits).
# 3. pytest of the graph and engine tests on G; four bench processes alternating M, G, M, G.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
so=_native.cpython-312-x86_64-linux-gnu.so
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 200 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1,2,8 --steps 3"
export PYTHONPATH=/tmp/site
M=/tmp/m.so
G=build/ab/copy.so
cp build/gpu312/ds4_app/engine/$so $M
ab=/tmp/ab
mkdir -p $ab
use() { cp "$1" ds4_app/engine/$so; }
use $M
echo "== bits_digest M ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/bits_digest.py $ab/digest_m.json > $ab/digest_m.log 2>&1
echo "exit $?"
use $G
echo "== bits_digest G against M ($SECONDS s)"
timeout 90 python3 ext/gpu/bench/bits_digest.py $ab/digest_g.json --against $ab/digest_m.json > $ab/digest_g.log 2>&1
echo "exit $?"
tail -2 $ab/digest_g.log
echo "== pytest test_gpu_engine.py, test_gpu_launch_switches.py on G ($SECONDS s)"
timeout 120 python3 -m pytest tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_launch_switches.py -q -rfE --tb=short \
  -p no:cacheprovider > $ab/pytest_g.txt 2>&1
echo "pytest exit $?"
tail -2 $ab/pytest_g.txt
bench() {  # LABEL MODULE
  use "$2"
  echo "== bench $1 ($SECONDS s)"
  DS4_PASS=$1 timeout 100 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 --long-ctx 0 \
    --steps 30 --json $ab/bench_$1.json 2>&1 | grep -E "chunked=1" | grep -E "decode" | head -5
}
for r in 1 2; do
  bench main_$r $M
  bench copy_$r $G
done
tar -czf "$OUT/ab.tgz" -C /tmp ab
echo "done ($SECONDS s)"
