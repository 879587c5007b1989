// L2 prefetch (l2_prefetch.h): bring byte ranges of weights into the L2 cache ahead of the kernels
// that read them, so a weight kernel that follows a latency-bound stretch of the step (attention,
// the FFN prologue, the mHC head) reads part of its matrix from L2 instead of HBM.
//
// What: for every range, `cp.async.bulk.prefetch.L2.global [addr], size` over consecutive pieces
// of kL2PrefetchPiece bytes (the last one shorter). A bulk prefetch is handed to the SM's TMA
// unit, which fetches the bytes into L2 on its own: the instruction has no destination and no
// completion to wait for, so the issuing thread exits at once and the kernel's duration is its
// launch plus one pass of a few instructions. The alternative, `prefetch.global.L2::evict_last`
// per 128-byte line, needs one instruction per line (205k for a 25 MiB window) issued through the
// load/store units of a grid that lives until they are accepted, so it would hold the stream about
// as long as reading the bytes; and its evict_last priority would outlive the window (nothing
// here demotes the lines again), crowding L2 for the rest of the step. The bulk form keeps normal
// priority: the engine orders its windows so that no large read comes between a window and the
// kernel it serves (engine_gpu.cu).
//
// Layout: up to kL2PrefetchMaxRanges ranges in the kernel parameters, each trimmed inward to
// 16-byte boundaries on the host (the instruction wants a 16-byte aligned address and a size that
// is a multiple of 16; GGUF tensor data is 32-byte aligned, so a weight tensor loses nothing).
// Pieces are numbered range after range; first[r] is range r's first piece.
//
// Launch shape: blocks of 32 threads, as many blocks as pieces up to the SM count, piece i issued
// by thread i / grid of block i % grid, so consecutive pieces go to different SMs and every TMA
// unit works on a share (a 25 MiB window is 800 pieces: at most 7 a block on an H200's 132 SMs).
// Each block first lets the stream's next kernel be scheduled (griddepcontrol.launch_dependents:
// this kernel writes nothing, so a kernel launched with programmatic dependent launch may start
// at once; a no-op for one launched without it).
//
// Bytes: the kernel itself moves none; the memory system reads the ranges' bytes from HBM into L2
// after it has returned, alongside whatever the stream runs next.
//
// CUDA compute capability 9.0+ only (the instruction is sm_90's). Under HIP, and on older devices,
// l2_prefetch_supported() is false and l2_prefetch launches nothing; the kernel body is empty there.
#include "l2_prefetch.h"
#include "launch.cuh"

#include <algorithm>

#include "common.cuh"

namespace ds4::gpu {

namespace {

constexpr uint32_t kL2PrefetchPiece = 32u << 10;  // bytes one instruction asks for
constexpr int kL2PrefetchThreads = 32;

struct L2PrefetchArgs {
  const uint8_t* base[kL2PrefetchMaxRanges];
  uint64_t bytes[kL2PrefetchMaxRanges];       // multiples of 16
  uint64_t first[kL2PrefetchMaxRanges + 1];   // first piece of each range; first[n] = pieces
  uint64_t pieces;                            // all ranges' pieces
  int n;
};

__global__ void __launch_bounds__(kL2PrefetchThreads) l2_prefetch_kernel(const L2PrefetchArgs a) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x + static_cast<uint64_t>(threadIdx.x) * gridDim.x; i < a.pieces; i += stride) {
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
#endif
}

}  // namespace

bool l2_prefetch_supported() { return cuda_sm90(); }

uint64_t l2_cache_bytes() {
#if defined(DS4_CUDA)
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return static_cast<uint64_t>(std::max(v, 0));
#else
  return 0;
#endif
}

uint64_t l2_prefetch(const L2Range* ranges, int n, Stream stream) {
  if (n < 0 || n > kL2PrefetchMaxRanges)
    throw std::invalid_argument("l2_prefetch: " + std::to_string(n) + " ranges; at most " +
                                std::to_string(kL2PrefetchMaxRanges));
  if (!l2_prefetch_supported()) return 0;
  L2PrefetchArgs a{};
  uint64_t pieces = 0, asked = 0;
  for (int i = 0; i < n; ++i) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ranges[i].data);
    if (begin == 0 || ranges[i].bytes == 0) continue;
    const uintptr_t lo = (begin + 15) & ~uintptr_t{15}, hi = (begin + ranges[i].bytes) & ~uintptr_t{15};
    if (hi <= lo) continue;
    a.base[a.n] = reinterpret_cast<const uint8_t*>(lo);
    a.bytes[a.n] = hi - lo;
    a.first[a.n] = pieces;
    pieces += (a.bytes[a.n] + kL2PrefetchPiece - 1) / kL2PrefetchPiece;
    asked += a.bytes[a.n];
    ++a.n;
  }
  a.first[a.n] = pieces;
  a.pieces = pieces;
  if (pieces == 0) return 0;
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(pieces, static_cast<uint64_t>(std::max(device_sms(), 1))));
  l2_prefetch_kernel<<<grid, kL2PrefetchThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  DS4_GPU_CHECK_LAUNCH("l2_prefetch");
  return asked;
}

}  // namespace ds4::gpu
