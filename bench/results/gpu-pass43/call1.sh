#!/usr/bin/env bash
# Pass 43 call 1 (ext/gpu/README "Pass 43"). One archive, build/gpu312.tar.xz, carries three modules (xz with a
# 192 MiB dictionary packs the three ~68 MB modules into about the size of one):
#   C  build/gpu312/ds4_app/engine/<so>   main with pass 43: the step inputs packed at the step's own stride (a
#                                         decode step copies ~1 KB, not 40 x max_rows bytes) and the attn_early hook;
#   A  build/ab/main.so                   main of pass 42 (d062cfa's engine code);
#   B  build/ab/opening.so                branch pass42-opening-embed (dfa5150's engine code): the step's opening
#                                         prefetch from the embedding's launch, behind DS4_GPU_L2_OPENING=1.
# 1. engine_run.sh with C: the GPU tests (the attn_early child-process test now sees the switch), memcheck of
#    engine_check --quick, decode C = 1-8 and prefill, a C = 1 graph timeline.
# 2. bits_digest of A, then of C and of B (opening on) against A's: both must keep every bit.
# 3. The A/B/C, six processes alternating A, B with the opening, C; twice.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
so=_native.cpython-312-x86_64-linux-gnu.so
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 210 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1 --steps 3"
export PYTHONPATH=/tmp/site
A=build/ab/main.so
B=build/ab/opening.so
C=/tmp/c.so
cp build/gpu312/ds4_app/engine/$so $C
ab=/tmp/ab
mkdir -p $ab
use() { cp "$1" ds4_app/engine/$so; }
digest() {  # LABEL MODULE VAR=VALUE [--against FILE]
  local label=$1 mod=$2 var=$3
  shift 3
  use "$mod"
  echo "== bits_digest $label ($SECONDS s)"
  env "$var" timeout 90 python3 ext/gpu/bench/bits_digest.py $ab/digest_$label.json "$@" > $ab/digest_$label.log 2>&1
  echo "exit $?"
  tail -2 $ab/digest_$label.log
}
digest a $A DS4_PASS43=A
digest c $C DS4_PASS43=C --against $ab/digest_a.json
digest b $B DS4_GPU_L2_OPENING=1 --against $ab/digest_a.json
bench() {  # LABEL MODULE [VAR=VALUE ...]
  local label=$1 mod=$2
  shift 2
  use "$mod"
  echo "== bench $label ($SECONDS s)"
  env "$@" timeout 100 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 2048 --long-ctx 0 \
    --steps 30 --json $ab/bench_$label.json 2>&1 | grep -E "tok/s|roofline" | head -8
}
for r in 1 2; do
  bench main_$r $A DS4_PASS43=A
  bench opening_$r $B DS4_GPU_L2_OPENING=1
  bench packed_$r $C DS4_PASS43=C
done
tar -czf "$OUT/ab.tgz" -C /tmp ab
echo "done ($SECONDS s)"
