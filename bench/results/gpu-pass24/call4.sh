#!/usr/bin/env bash
# Pass 24 call 4 (call 3's module): what q_heads, hc_site_sums and the attention's split kernel issue in a
# 2048-row prompt step of flash-l4 (ncu's instruction mix per SASS opcode), for the next pass.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python3 -c "import tarfile; tarfile.open('build/gpu312.tar.xz').extractall('.')"
cp build/gpu312/ds4_app/engine/_native.cpython-312-x86_64-linux-gnu.so ds4_app/engine/
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; tail -1 /tmp/synth.log
for k in q_heads hc_site_sums attention_split; do
  echo "== $k ($SECONDS s)"
  timeout 120 ncu --clock-control none --profile-from-start off --section InstructionStats --section SpeedOfLight \
    --page raw --csv --print-metric-instances values -c 1 -k "regex:$k" \
    python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 > $OUT/ncu_mix_$k.csv 2> $OUT/ncu_mix_$k.err
  echo "ncu exit $?"; tail -2 $OUT/ncu_mix_$k.err
  python3 - "$OUT/ncu_mix_$k.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if len(rows) < 3:
    sys.exit("no rows")
hdr, vals = rows[0], rows[2]
for h, v in zip(hdr, vals):
    if "opcode" in h or h in ("gpu__time_duration.sum", "smsp__inst_executed.sum", "Kernel Name"):
        print(h, "=", v[:600])
PY
done
gzip $OUT/*.csv
echo "done ($SECONDS s)"
