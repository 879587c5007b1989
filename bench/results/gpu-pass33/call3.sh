#!/usr/bin/env bash
# Pass 33 call 3 (the same machine): graph timelines of main's defaults, decode C = 1 and 8, and one
# 2048-row prompt step.
export PYTHONPATH=/tmp/site
python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1,8 --steps 4 --json $OUT/tl_decode.json 2>&1 | tail -60
python3 ext/gpu/bench/graph_timeline.py /tmp/f.gguf --c 1 --steps 2 --prompt-rows 2048 --json $OUT/tl_p2048.json 2>&1 \
  | tail -45
