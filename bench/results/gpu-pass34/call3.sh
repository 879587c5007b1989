#!/usr/bin/env bash
# Pass 34 call 3: the same machine as call 2, still held (its /tmp/f.gguf and module): every mask of the
# setting at 2048 rows, twice each in one process.
export PYTHONPATH=/tmp/site
python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/masks.json --prefill-rows 2048 --long-ctx 0 --steps 20 \
  --prefill-only --variants ,immaindep=2,immaindep=3,immaindep=1,,immaindep=2,immaindep=3,immaindep=1 2>&1 \
  | grep -E "^prefill|^exactness" | sed -e 's/graphs=1 tall=1 staged=1 chunked=1 //'
