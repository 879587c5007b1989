#!/usr/bin/env bash
# Pass 36 call 2: the landed tree (passes 36-37 reverted, pass 38's embedding kept), as a plain run would
# have it: the GPU tests, memcheck, and the bench at the defaults twice in one process (decode C = 1-8,
# prefill 512 and 2048 rows): main's figures of record for this session.
# Prediction: call 1's both-off figures on a like H100 (54-56% of roofline; prefill ~15.5-15.7k at 2048 rows);
# on an H200 (if one comes) ~42-45% at C = 1 (pass 23's 43.0% less nothing the latency chain lost since).
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 300 --no-racecheck \
  --bench-args "--prefill-rows 512,2048 --long-ctx 0 --steps 30 --variants ,"
echo "done ($SECONDS s)"
