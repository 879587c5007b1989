#!/usr/bin/env bash
# Everything one device call does (ext/gpu/README.md): use the carried harness builds if they
# start on this machine, else rebuild them here; check; memcheck a quick check; time each build.
#   OUT=dir ext/gpu/bench/run.sh VARIANT...
# VARIANT is a folder under build/gpu-harness made by build.sh; the first one is checked.
# Writes to $OUT: run.log (everything), check.txt, memcheck.txt, bench_VARIANT.json.
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/ds4-gpu-out}
mkdir -p "$OUT"
B=build/gpu-harness
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(default)
exec > >(tee -a "$OUT/run.log") 2>&1
echo "commit $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain ext/gpu 2>/dev/null | wc -l) changed ext/gpu files"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
for v in "${variants[@]}"; do
  "$B/$v/harness" --usage >/dev/null 2>&1
  if [ $? -ne 2 ]; then
    echo "== $v: the carried binary does not start here; rebuilding"
    read -r -a flags < "$B/$v/flags" || flags=()
    ext/gpu/bench/build.sh "$B/$v" "${flags[@]}" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  fi
done
main=${variants[0]}
echo "== check ($main)"
"$B/$main/harness" --decode --check > "$OUT/check.txt" 2>&1
check_rc=$?
cat "$OUT/check.txt"
echo "== compute-sanitizer memcheck, quick check ($main)"
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/$main/harness" --quick --seed 7 > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit $?"
tail -4 "$OUT/memcheck.txt"
for v in "${variants[@]}"; do
  echo "== bench $v ($(cat "$B/$v/flags"))"
  "$B/$v/harness" --bench --json "$OUT/bench_$v.json"
done
exit $check_rc
