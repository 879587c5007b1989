#!/usr/bin/env bash
# Pass 33 call 2: the same machine as call 1, still held (its /tmp/f.gguf and module): the defaults,
# splitmin=32 and attnheads=1:splitmin=32 twice each in one process, 40 decode steps a figure.
export PYTHONPATH=/tmp/site
python3 ext/gpu/bench/engine_bench.py /tmp/f.gguf --json $OUT/rep.json --prefill-rows 2048 --long-ctx 0 --steps 40 \
  --variants ,splitmin=32,attnheads=1:splitmin=32,,splitmin=32,attnheads=1:splitmin=32 2>&1 \
  | grep -E "^prefill|^decode|^exactness" | sed -e 's/graphs=1 tall=1 staged=1 chunked=1 //'
