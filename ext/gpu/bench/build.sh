#!/usr/bin/env bash
# Build the device harness with nvcc: ext/gpu/bench/build.sh [OUT_DIR [extra nvcc flags...]]
# The kernels (ext/gpu/*.cu), the CPU kernels they are checked against (ext/cpu/*.cpp) and the CPU
# engine sources the GPU engine links against (ext/engine/*.cpp) are compiled side by side
# (OUT_DIR/obj), one process per file, then linked into OUT_DIR/harness; OUT_DIR/flags records the
# extra flags.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-build/gpu-harness/default}
shift || true
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-sm_90}
mkdir -p "$out/obj"
echo "$*" > "$out/flags"  # run.sh rebuilds a variant from these if its binary cannot start
nvflags=(-std=c++17 -O3 -arch="$ARCH" -fmad=false -DDS4_GPU_CUDA=1 -Iext/include -Iext/gpu -Iext/cpu
         -Xcompiler -ffp-contract=off "$@")
pids=()
for f in ext/gpu/*.cu ext/gpu/bench/harness.cu; do
  "$NVCC" "${nvflags[@]}" -c "$f" -o "$out/obj/$(basename "$f" .cu).o" & pids+=($!)
done
for f in ext/cpu/*.cpp; do
  g++ -std=c++17 -O3 -ffp-contract=off -Iext/include -Iext/cpu -c "$f" -o "$out/obj/cpu_$(basename "$f" .cpp).o" & pids+=($!)
done
# The CPU step executor's weight binding and state layout, which the GPU engine reuses.
for f in ext/engine/*.cpp; do
  g++ -std=c++17 -O3 -ffp-contract=off -Iext/include -Iext/engine -Iext/cpu -c "$f" -o "$out/obj/engine_$(basename "$f" .cpp).o" & pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
[ "$fail" = 0 ] || { echo "build failed" >&2; exit 1; }
"$NVCC" -arch="$ARCH" "$out"/obj/*.o -o "$out/harness" -lpthread
echo "built $out/harness"
