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
#include "l2_prefetch.cuh"
#include "launch.cuh"

#include <algorithm>

#include "common.cuh"

namespace ds4::gpu {

namespace {

constexpr int kL2PrefetchThreads = 32;

__global__ void __launch_bounds__(kL2PrefetchThreads) l2_prefetch_kernel(const L2PrefetchArgs a) {
  ds4_grid_release();
  l2_prefetch_issue(a, blockIdx.x + static_cast<uint64_t>(threadIdx.x) * gridDim.x,
                    static_cast<uint64_t>(gridDim.x) * blockDim.x);
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
  uint64_t asked = 0;
  const L2PrefetchArgs a = l2_prefetch_args(ranges, n, &asked);
  if (!l2_prefetch_supported()) return 0;
  const uint64_t pieces = a.pieces;
  if (pieces == 0) return 0;
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(pieces, static_cast<uint64_t>(std::max(device_sms(), 1))));
  l2_prefetch_kernel<<<grid, kL2PrefetchThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  DS4_GPU_CHECK_LAUNCH("l2_prefetch");
  return asked;
}

}  // namespace ds4::gpu
