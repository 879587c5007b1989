#!/usr/bin/env bash
# Stall reasons (ncu WarpStateStats, raw metrics) of the narrow tensor-core tile and the own grouped kernel, C=8.
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/stalls; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; tail -1 /tmp/synth.log
for c in 8 1; do
  timeout 120 ncu --clock-control none --profile-from-start off --target-processes all --section WarpStateStats \
    --section SpeedOfLight --csv --page raw -k "regex:imma_q8|grouped_own|matvec_dense|matvec_staged" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf $c > "$R/stalls_c$c.csv" 2> "$R/stalls_c$c.err"
  echo "ncu C=$c exit $?"; gzip -f "$R/stalls_c$c.csv"
done
tar -czf "$OUT/stalls.tgz" -C /tmp stalls
