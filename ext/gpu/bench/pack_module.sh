#!/usr/bin/env bash
# Packs a cp312 GPU module built here for the device tool: stripped and xz-compressed into
# build/gpu312.tar.xz (about 32 MB instead of the module's size), which engine_run.sh unpacks to
# build/gpu312/ds4_app/engine/ on the device. Carry it with `carry: ["build/gpu312.tar.xz", ".whl"]`.
#   ext/gpu/bench/pack_module.sh [BUILD_DIR]   (default build/gpu312: cmake -B BUILD_DIR -DDS4_GPU=cuda
#                                               -DPython_EXECUTABLE=<a Python 3.12>, then cmake --build)
set -euo pipefail
cd "$(dirname "$0")/../../.."
build=${1:-build/gpu312}
name=_native.cpython-312-x86_64-linux-gnu.so
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/gpu312/ds4_app/engine"
strip -o "$stage/build/gpu312/ds4_app/engine/$name" "$build/ds4_app/engine/$name"
mkdir -p build
tar -cJf build/gpu312.tar.xz -C "$stage" "build/gpu312/ds4_app/engine/$name"
ls -la build/gpu312.tar.xz
