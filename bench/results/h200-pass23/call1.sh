#!/usr/bin/env bash
# Pass 23 call 1 (call 2 runs module B on the same warm machine right after: both modules do not fit one call).
#   A (build/gpu312_base.tar.xz, packed from 8725130): 8725130, pass 22's final tree (the coalesced Y stores), whose call-3
#     raw files were lost with that machine: digests against pass 22 call 2's (kept), then prefill,
#     decode and the 2048-row profile.
#     Then ncu raw metrics of imma_q4k at 2048 rows.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
so=_native.cpython-312-x86_64-linux-gnu.so
use() { python3 -c "import tarfile; tarfile.open('$1').extractall('/tmp/mod_$2')"; cp /tmp/mod_$2/build/gpu312/ds4_app/engine/$so ds4_app/engine/; }
(python3 -m ds4_app model synth --preset flash-l4 --seed 0 --out /tmp/f.gguf > /tmp/synth.log 2>&1; echo "synth exit $?" >> /tmp/synth.log) &
synth=$!
use build/gpu312_base.tar.xz A
echo "== A digest ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/bits_digest.py $OUT/A_digest.json \
  --against digest_call2.json; echo "A digest exit $?"
wait $synth; cat /tmp/synth.log | tail -2
echo "== A bench ($SECONDS s)"
timeout 150 python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --prefill-rows 512,2048 --long-ctx 0 --steps 20 \
  --profile-rows 2048 --json $OUT/A_bench.json > $OUT/A_bench.log 2>&1; echo "A bench exit $?"
grep -E "tok/s|roofline|prefill|C=" $OUT/A_bench.log | head -30
echo "== A ncu p2048 imma_q4k ($SECONDS s)"
secs="--section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy"
timeout 90 ncu --clock-control none --profile-from-start off $secs --page raw --csv -c 2 \
  -k "regex:imma_q4k" python3 ext/gpu/bench/ncu_step.py /tmp/f.gguf 1 --prompt-rows 2048 \
  > $OUT/A_ncu_q4k.csv 2> $OUT/A_ncu_q4k.err; echo "ncu exit $?"
gzip $OUT/A_ncu_q4k.csv
echo "done ($SECONDS s)"
