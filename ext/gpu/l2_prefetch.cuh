// The L2 prefetch's arguments and its issuing loop (l2_prefetch.cu says what and why), shared by the
// prefetch kernel and by the kernels that issue a prefetch in blocks of their own grid (the step's
// opening: ops.cu's embedding kernel, README "Pass 42").
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "l2_prefetch.h"
#include "vendor.h"

namespace ds4::gpu {

constexpr uint32_t kL2PrefetchPiece = 32u << 10;  // bytes one instruction asks for

// Up to kL2PrefetchMaxRanges ranges, trimmed inward to 16-byte boundaries; pieces numbered range
// after range, first[r] range r's first piece. Passed by value as a kernel parameter.
struct L2PrefetchArgs {
  const uint8_t* base[kL2PrefetchMaxRanges];
  uint64_t bytes[kL2PrefetchMaxRanges];       // multiples of 16
  uint64_t first[kL2PrefetchMaxRanges + 1];   // first piece of each range; first[n] = pieces
  uint64_t pieces;                            // all ranges' pieces
  int n;
};

// The arguments for ranges[0..n) (empty ranges and ranges under 16 bytes skipped); *asked gets the
// bytes they name.
inline L2PrefetchArgs l2_prefetch_args(const L2Range* ranges, int n, uint64_t* asked) {
  if (n < 0 || n > kL2PrefetchMaxRanges)
    throw std::invalid_argument("l2_prefetch: " + std::to_string(n) + " ranges; at most " +
                                std::to_string(kL2PrefetchMaxRanges));
  L2PrefetchArgs a{};
  uint64_t pieces = 0;
  *asked = 0;
  for (int i = 0; i < n; ++i) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ranges[i].data);
    if (begin == 0 || ranges[i].bytes == 0) continue;
    const uintptr_t lo = (begin + 15) & ~uintptr_t{15}, hi = (begin + ranges[i].bytes) & ~uintptr_t{15};
    if (hi <= lo) continue;
    a.base[a.n] = reinterpret_cast<const uint8_t*>(lo);
    a.bytes[a.n] = hi - lo;
    a.first[a.n] = pieces;
    pieces += (a.bytes[a.n] + kL2PrefetchPiece - 1) / kL2PrefetchPiece;
    *asked += a.bytes[a.n];
    ++a.n;
  }
  a.first[a.n] = pieces;
  a.pieces = pieces;
  return a;
}

// Issues pieces i = lane, lane + lanes, ... (the caller numbers its threads so that consecutive
// pieces go to different SMs: every SM's TMA unit then takes a share). CUDA sm_90+ only; elsewhere
// nothing (l2_prefetch_supported() is false there, so no launcher asks for pieces).
__device__ __forceinline__ void l2_prefetch_issue(const L2PrefetchArgs& a, uint64_t lane, uint64_t lanes) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (uint64_t i = lane; i < a.pieces; i += lanes) {
    // The range holding piece i, by a scan with constant indices (a dynamic index into the
    // parameters would copy them to local memory).
#pragma unroll
    for (int r = 0; r < kL2PrefetchMaxRanges; ++r) {
      if (r < a.n && i >= a.first[r] && i < a.first[r + 1]) {
        const uint64_t off = (i - a.first[r]) * kL2PrefetchPiece;
        const uint64_t left = a.bytes[r] - off;
        const uint32_t size = left < kL2PrefetchPiece ? static_cast<uint32_t>(left) : kL2PrefetchPiece;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a.base[r] + off), "r"(size) : "memory");
      }
    }
  }
#else
  (void)a;
  (void)lane;
  (void)lanes;
#endif
}

}  // namespace ds4::gpu
