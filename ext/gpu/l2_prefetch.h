// Host interface of the L2 prefetch (l2_prefetch.cu), plain C++: the engine includes it.
//
// l2_prefetch asks the memory system to bring byte ranges of device memory (weights the next
// weight kernels will read) into the L2 cache and returns at once: one small kernel whose threads
// issue Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2.global`) and exit without waiting.
// It reads and writes nothing a kernel computes with, so no result can change; it only changes
// what the L2 holds when the next kernels run. The engine (engine_gpu.cu) launches it before the
// latency-bound stretches of a decode step, naming the weights that follow them (ext/gpu/README.md,
// "Pass 9: L2 prefetch").
//
// CUDA on compute capability 9.0+ only: elsewhere (HIP, older devices) l2_prefetch_supported() is
// false and l2_prefetch launches nothing.
//
// Built without a GPU backend the header still compiles (the engine is then a stub anyway).
#pragma once

#include <cstdint>

#include "ds4_gpu.h"

namespace ds4::gpu {

constexpr int kL2PrefetchMaxRanges = 16;  // ranges one launch takes

// One byte range of device memory: [data, data + bytes).
struct L2Range {
  const void* data = nullptr;
  uint64_t bytes = 0;
};

#if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP) || defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

// Whether this build and the current device can prefetch into L2 (CUDA, compute capability 9.0+).
bool l2_prefetch_supported();
// The current device's L2 size in bytes (cudaDevAttrL2CacheSize); 0 where unknown or under HIP.
uint64_t l2_cache_bytes();
// One launch on `stream` that asks L2 for every range (at most kL2PrefetchMaxRanges). Each range
// is trimmed inward to 16-byte boundaries (the instruction's alignment rule), so nothing outside
// a range is ever named; empty ranges are skipped. Nothing is launched where
// l2_prefetch_supported() is false or nothing is left to ask for. Returns the bytes asked for.
// No allocation and no host synchronisation (graph capture safe).
uint64_t l2_prefetch(const L2Range* ranges, int n, Stream stream);
// The same for one range.
inline uint64_t l2_prefetch(const void* data, uint64_t bytes, Stream stream) {
  const L2Range r{data, bytes};
  return l2_prefetch(&r, 1, stream);
}

#endif

}  // namespace ds4::gpu
