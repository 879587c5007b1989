#!/usr/bin/env bash
# Pass 43 call 2: main's module (packed alone as build/gpu312.tar.xz: the code of call 1's C with the host's phases
# of a step recorded, GpuEngine.host_phases, and two new tests) measured again, and where the C = 2 and C = 8
# steps' time goes beyond their bytes (C = 2 is the weakest fraction of roofline, 54.5%; the last C = 2 timeline
# was pass 16's): engine_run.sh's GPU tests (the step-stride bits test, the host-phases test), memcheck, decode
# C = 1-8 with the host's phases and prefill, graph timelines at C = 1, 2 and 8. Cut to the device time left.
set -uo pipefail
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT ext/gpu/bench/engine_run.sh --budget 150 --no-racecheck \
  --bench-args "--prefill-rows 2048 --long-ctx 0 --steps 30" --timeline "--c 1,2,8 --steps 3"
