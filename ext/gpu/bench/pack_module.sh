#!/usr/bin/env bash
# Packs a cp312 GPU module built here for the device tool: stripped and xz-compressed into
# build/gpu312.tar.xz (or ARCHIVE), which engine_run.sh unpacks to build/gpu312/ds4_app/engine/ on the
# device. Carry it with `carry: ["build/gpu312.tar.xz", ".whl"]`.
#   ext/gpu/bench/pack_module.sh [BUILD_DIR [ARCHIVE]]
#     BUILD_DIR (default build/gpu312): cmake -B BUILD_DIR -G Ninja -DDS4_GPU=cuda -DPython_EXECUTABLE=<a Python
#     3.12> -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_FLAGS=-no-compress, then
#     cmake --build. SASS only and an uncompressed fatbinary: xz packs that to ~8.5 MB, so a call can carry
#     several modules; the default build (PTX beside the SASS, nvcc's own compression) packs to ~33 MB.
set -euo pipefail
cd "$(dirname "$0")/../../.."
build=${1:-build/gpu312}
archive=${2:-build/gpu312.tar.xz}
name=_native.cpython-312-x86_64-linux-gnu.so
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/gpu312/ds4_app/engine"
strip -o "$stage/build/gpu312/ds4_app/engine/$name" "$build/ds4_app/engine/$name"
mkdir -p "$(dirname "$archive")"
tar -cJf "$archive" -C "$stage" "build/gpu312/ds4_app/engine/$name"
ls -la "$archive"
