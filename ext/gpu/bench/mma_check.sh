#!/usr/bin/env bash
# Build the tensor-core matvec check (ext/gpu/bench/mma_check.cu) and run it: checks, then benches.
#   ext/gpu/bench/mma_check.sh [OUT_DIR] [mma_check arguments...]
# OUT_DIR defaults to $OUT (else /tmp/mma-check-out); it gets mma_check.log (everything printed),
# mma_bench.jsonl (one JSON line per measurement), nvidia_smi.txt and build.log.
# Build: ext/gpu/bench/build.sh compiles every ext/gpu/*.cu (mma_matvec.cu, and matvec.cu with what
# it links against: the baseline), ext/cpu and ext/engine into build/mma-check/full/obj (nvcc
# -std=c++17 -O3 -arch=sm_90 -fmad=false -DDS4_GPU_CUDA=1 -Iext/include -Iext/gpu -Iext/cpu
# -Xcompiler -ffp-contract=off); mma_check.cu is compiled beside it with the same flags and linked
# with those objects (not the harness's main) into build/mma-check/mma_check. That folder is ignored
# and a device call can carry it: the binary is reused when it starts and was built from the same
# sources (build/mma-check/sources.sha), else rebuilt. BUILD_ONLY=1: build, then stop.
# Exit status: mma_check's (0 passed, 1 exactness failure, 2 accuracy failure only, 3 no GPU).
set -euo pipefail
export LC_ALL=C  # the same glob order (and so the same source hash) on every machine
cd "$(dirname "$0")/../../.."
out=${1:-${OUT:-/tmp/mma-check-out}}
[ $# -gt 0 ] && shift
bdir=${MMA_CHECK_BUILD:-build/mma-check}
NVCC=${NVCC:-nvcc}
export ARCH=${ARCH:-sm_90}
bin="$bdir/mma_check"
mkdir -p "$out" "$bdir"

want=$(cat ext/gpu/*.cu ext/gpu/*.cuh ext/gpu/*.h ext/gpu/bench/mma_check.cu ext/gpu/bench/build.sh ext/include/ds4/*.h \
           ext/cpu/*.cpp ext/cpu/*.h ext/engine/*.cpp ext/engine/*.h 2>/dev/null | sha256sum | cut -d' ' -f1)-$ARCH

build() {
  local nvflags=(-std=c++17 -O3 -arch="$ARCH" -fmad=false -DDS4_GPU_CUDA=1 -Iext/include -Iext/gpu -Iext/cpu
                 -Xcompiler -ffp-contract=off)
  rm -f "$bin" "$bdir/sources.sha"
  "$NVCC" "${nvflags[@]}" -c ext/gpu/bench/mma_check.cu -o "$bdir/mma_check.o" &
  local pid=$!
  ext/gpu/bench/build.sh "$bdir/full" || { wait "$pid" || true; return 1; }
  wait "$pid" || return 1
  local objs=()
  for o in "$bdir"/full/obj/*.o; do
    [ "$(basename "$o")" = harness.o ] || objs+=("$o")
  done
  "$NVCC" -arch="$ARCH" "${objs[@]}" "$bdir/mma_check.o" -o "$bin" -lpthread || return 1
  echo "$want" > "$bdir/sources.sha"
  echo "built $bin"
}

have=$(cat "$bdir/sources.sha" 2>/dev/null || true)
rc=0
[ -x "$bin" ] && { "$bin" --usage >/dev/null 2>&1 || rc=$?; }
if [ ! -x "$bin" ] || [ "$rc" != 64 ] || [ "$have" != "$want" ]; then
  echo "building $bin ($(nproc) cores)"
  start=$SECONDS
  build > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s"
fi
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$out/nvidia_smi.txt" 2>&1 || true
set +e
"$bin" --out "$out" "$@" 2>&1 | tee "$out/mma_check.log"
status=${PIPESTATUS[0]}
echo "mma_check exit $status" | tee -a "$out/mma_check.log"
exit "$status"
