#!/usr/bin/env bash
# Pass 40 call 6, after the review's mends (build_parts_kernel's attribute raised in matvec_prepare; the count
# table's clear only where the table is used): the GPU tests (the parts tests at 1,500 and 4,096 experts among
# them) and memcheck of engine_check --quick and of the router and parts tests. No bench: the kernels' work is
# unchanged.
set -uo pipefail
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck --no-bench \
  --memcheck-tests tests/gpu/test_gpu_launch_fusions.py --memcheck-k "router or parts"
echo "done ($SECONDS s)"
