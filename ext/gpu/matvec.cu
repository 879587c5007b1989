// Launchers of the weight-reuse matrix-vector kernels (matvec.cuh): the dense product for any
// column count (16-column chunks, each chunk one kernel specialised for its width), the
// device-side planner that groups (expert, pair) routes into parts of up to 8 pairs, and the
// expert-grouped product over those parts. With the tensor-core switch on (DS4_GPU_MMA=1,
// matvec_fused.h), the products whose weights mma_matvec_fits go to mma_matvec.cuh's kernels
// instead, at every width: one arithmetic per product whatever the column count.
//
// build_expert_parts: one block; per pair, its rank in the stable sort by expert is
// (pairs with a smaller expert) + (earlier pairs with the same expert), so the plan is the same
// on every run and needs no ordered atomics (the histogram's atomics only count).
// Bytes: 4 * n_pairs in, 4 * n_pairs + 12 * parts out; O(n_pairs^2) compares, negligible below a
// few thousand pairs.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ds4_gpu.h"
#include "imma.h"
#include "launch.cuh"
#include "matvec.cuh"
#include "matvec_fused.h"
#include "mma_matvec.cuh"
#include "routing.cuh"

namespace ds4::gpu {

static_assert(sizeof(ExpertPart) == sizeof(ExpertPartDev), "ExpertPart and ExpertPartDev must share a layout");

// Multiprocessors of the current device (0 where the runtime cannot say). Asked once.
int device_sms() {
  static const int n = [] {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return sms;
  }();
  return n;
}

bool env_switch(std::atomic<int>& state, const char* name, bool allowed) {
  int v = state.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv(name);
    v = (allowed && !(e != nullptr && std::string(e) == "0")) ? 1 : 0;
    state.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

namespace {

int64_t unit_elems(DType t) {
  switch (t) {
    case DType::F32:
    case DType::F16:
    case DType::BF16:
      return 8;
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::MXFP4:
      return 32;
    default:
      throw std::invalid_argument(std::string("GPU matvec: unsupported weight type ") + dtype_name(t));
  }
}

// The K and alignment rules of matvec.cuh's units, checked once per launch.
int64_t check_weights(const TensorView& W, const char* who) {
  const int64_t ue = unit_elems(W.type);
  const int64_t need = W.type == DType::Q4_K ? 256 : ue;
  if (W.ne[0] <= 0 || W.ne[0] % need != 0)
    throw std::invalid_argument(std::string(who) + ": row width " + std::to_string(W.ne[0]) + " of a " +
                                dtype_name(W.type) + " matrix is not a multiple of " + std::to_string(need));
  const uintptr_t align = (W.type == DType::Q8_0) ? 2 : (W.type == DType::MXFP4) ? 1 : 16;
  if (reinterpret_cast<uintptr_t>(W.data) % align != 0)
    throw std::invalid_argument(std::string(who) + ": weight data is not " + std::to_string(align) + "-byte aligned");
  return W.ne[0] / ue;
}

void check_activations(const float* X, int64_t ldx, const char* who) {
  if (reinterpret_cast<uintptr_t>(X) % 16 != 0 || ldx % 4 != 0)
    throw std::invalid_argument(std::string(who) + ": activations must be 16-byte aligned with ldx a multiple of 4");
}

// The tensor-core switch (matvec_fused.h): -1 not read from the environment yet. On only where
// the build has the tensor-core kernels (CUDA), so under HIP it stays off whatever is asked.
std::atomic<int> g_mma{-1};

bool mma_on() {
  int v = g_mma.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("DS4_GPU_MMA");
    v = (e != nullptr && *e != 0 && std::string(e) != "0") ? 1 : 0;
    g_mma.store(v, std::memory_order_relaxed);
  }
  return v == 1 && mma_matvec_supported(DType::Q8_0);
}

// Columns per mma_matvec call (its limit is 65535; a multiple of 64 keeps the wide path's padded
// width within it). A column's bits never depend on the call it is in.
constexpr int kMmaCallCols = 32768;

void mma_product(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
                 const MatvecScratch& scratch) {
  for (int c0 = 0; c0 < ncols; c0 += kMmaCallCols)
    mma_matvec(W, X + static_cast<int64_t>(c0) * ldx, std::min(kMmaCallCols, ncols - c0), ldx,
               Y + static_cast<int64_t>(c0) * ldy, ldy, stream, scratch.data, scratch.bytes);
}

// The scratch of the entries without a scratch argument (ds4_gpu.h's matvec, matvec_batched and
// matvec_grouped: the testing hooks, the harness), grown on demand and kept for the process (never
// freed: a static destructor would run after the CUDA runtime is torn down). Lent only on the
// legacy default stream outside a graph capture: that stream orders its work after every blocking
// stream's, so the buffer has one user at a time, and growing it (after a device
// synchronisation, under the lock that also covers the launch) frees nothing still in use.
// Elsewhere the call runs without scratch: the same bits through the paths that need none.
template <class F>
void with_module_scratch(size_t need, Stream stream, F&& run) {
#if defined(DS4_MMA_MATVEC)
  static std::mutex mu;
  static float* buf = nullptr;
  static size_t have = 0;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  bool free_to_use = need > 0 && stream == nullptr;
  if (free_to_use && cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st) != cudaSuccess) {
    (void)cudaGetLastError();  // a capture elsewhere in global mode: do not touch memory now
    free_to_use = false;
  }
  if (free_to_use && st == cudaStreamCaptureStatusNone) {
    std::lock_guard<std::mutex> lock(mu);
    if (have < need) {
      DS4_GPU_CHECK(cudaDeviceSynchronize());
      if (buf != nullptr) DS4_GPU_CHECK(cudaFree(buf));
      buf = nullptr;
      have = 0;
      DS4_GPU_CHECK(cudaMalloc(&buf, need));
      have = need;
    }
    run(MatvecScratch{buf, have});
    return;
  }
#else
  (void)need;
  (void)stream;
#endif
  run(MatvecScratch{});
}

// The chunked weight loads (matvec.cuh) where a matrix allows them; set_matvec_chunked(false)
// (tests, benches) or DS4_GPU_MV_CHUNKED=0 sends every product to the unit-by-unit loads, which
// give the same bits.
std::atomic<int> g_chunked{-1};  // -1: not read from the environment yet

bool chunked_on() { return env_switch(g_chunked, "DS4_GPU_MV_CHUNKED"); }

template <int T>
bool use_chunks(const TensorView& W, int64_t units) {
  return chunk_fits<T>(units, W.row_bytes()) && reinterpret_cast<uintptr_t>(W.data) % 16 == 0 && chunked_on();
}

// The integer Q8_0 and Q4_K products (xplanes.cuh); -1: not read from the environment yet.
std::atomic<int> g_int8{-1};
// Producer-built planes (matvec_fused.h planes_fused); -1: not read yet.
std::atomic<int> g_planes_fused{-1};
std::atomic<int64_t> g_prep_launches{0};  // prep kernel launches so far (tests: what the given planes save)

// The types the planes serve, and whether a product of W takes them now.
template <int T>
constexpr bool kPlanesType = T == kQ8_0 || T == kQ4_K;
bool planes_for(const TensorView& W) { return (W.type == DType::Q8_0 || W.type == DType::Q4_K) && int8_on(); }

// Types the tall variant is built for: the tall dense matrices of DS4 GGUFs (q_b, the LM head)
// are Q8_0, or F16/BF16 in unquantized files. The others never take it (instantiating it for
// them would only add compile time).
template <int T>
constexpr bool kTallType = T == kQ8_0 || T == kF16 || T == kBF16;
// The tall variant with two chunk stages (kDenseTall2): chunked types, up to 4 columns (8 rows a
// warp); DS4_GPU_MV_TALL_STAGES=2 or set_matvec_tall_stages(2) selects it (default 1).
template <int T>
constexpr bool kTall2Type = T == kQ8_0;
constexpr int kTall2MaxCols = 4;
std::atomic<int> g_tall_stages{-1};  // -1: not read from the environment yet

int tall_stages_now() {
  int v = g_tall_stages.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("DS4_GPU_MV_TALL_STAGES");
    v = (e != nullptr && std::string(e) == "2") ? 2 : 1;
    g_tall_stages.store(v, std::memory_order_relaxed);
  }
  return v;
}

// Types the short variant is built for: the few-row matrices of DS4 GGUFs (the mHC projections,
// the router, the output mHC head) are F16, BF16 or F32.
template <int T>
constexpr bool kShortType = T == kF32 || T == kF16 || T == kBF16;

// The direct kernel's persistent grid (set_matvec_persistent / DS4_GPU_MV_PERSIST=0 turns it off):
// at most as many blocks as the device holds at once, each walking row blocks x, x + grid, ... so
// its warps' chunked weight streams run on from one row block into the next (matvec_blocks'
// issue_next) instead of every block filling its pipeline from empty. Which block computes a row
// block never changes a result.
std::atomic<int> g_persistent{-1};  // -1: not read from the environment yet

bool persistent_on() { return env_switch(g_persistent, "DS4_GPU_MV_PERSIST"); }

// Blocks of the direct kernel <T, NC, SHAPE> the whole device holds at once (0 where the runtime
// cannot say: the grid is then one block a row block). Asked once per instantiation.
template <int T, int NC, int SHAPE, bool PL>
int64_t dense_resident_blocks() {
  static const int64_t n = device_resident_blocks(reinterpret_cast<const void*>(&matvec_dense_kernel<T, NC, SHAPE, PL>),
                                                  kMatvecThreads, dense_dynamic_smem<T, NC, SHAPE>());
  return n;
}

// Blocks a direct launch of n_blocks row blocks (per batch member) gets: all of them, or with the
// persistent grid the fewest that take `rounds` row blocks each, rounds = ceil(n_blocks / what the
// device holds for one member), so the last round is as full as the others.
int64_t dense_grid(int64_t n_blocks, int64_t resident, int n_batch) {
  const int64_t per_member = resident / std::max(n_batch, 1);
  if (!persistent_on() || per_member <= 0 || n_blocks <= per_member) return n_blocks;
  const int64_t rounds = (n_blocks + per_member - 1) / per_member;
  return (n_blocks + rounds - 1) / rounds;
}

// PL: X is a planes buffer (Q8_0's integer products; ldx and batch.x in bytes).
template <int T, int NC, bool PL>
void launch_dense_shape(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y, int64_t ldy,
                        bool tall, int n_batch, const MatvecBatch& batch, cudaStream_t s) {
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  const bool chunks = use_chunks<T>(W, units) && batch.w_bytes % 16 == 0;
  // One shape's launch: br rows a block, then the (persistent) grid.
  auto run = [&](auto kernel, int64_t br, int64_t resident, size_t smem = 0) {
    const int64_t n_blocks = dense_grid((rows + br - 1) / br, resident, n_batch);
    const dim3 grid(static_cast<unsigned>(n_blocks), static_cast<unsigned>(n_batch));
    launch(kernel, grid, kMatvecThreads, smem, s, W.data, W.row_bytes(), rows, units, ks, X, ldx, Y, ldy, chunks,
           batch);
  };
  if constexpr (kTall2Type<T> && NC <= kTall2MaxCols) {
    if (tall && tall_takes(rows, W.ne[0]) && chunks && tall_stages_now() == 2) {
      matvec_prepare();  // the dynamic shared memory limit (the engine prepared before any capture)
      run(matvec_dense_kernel<T, NC, kDenseTall2, PL>, 2 * matvec_block_rows(NC, ks),
          dense_resident_blocks<T, NC, kDenseTall2, PL>(), dense_dynamic_smem<T, NC, kDenseTall2>());
      return;
    }
  }
  if constexpr (kTallType<T>) {
    if (tall && tall_takes(rows, W.ne[0])) {
      run(matvec_dense_kernel<T, NC, kDenseTall, PL>, 2 * matvec_block_rows(NC, ks),
          dense_resident_blocks<T, NC, kDenseTall, PL>());
      return;
    }
  }
  const int64_t br = matvec_block_rows(NC, ks);
  if constexpr (kShortType<T>) {
    // Fewer row blocks (all members together) than SMs: one row a warp, up to R times the blocks.
    if ((rows + br - 1) / br * n_batch < device_sms()) {
      run(matvec_dense_kernel<T, NC, kDenseShort, PL>, static_cast<int64_t>(kMatvecWarps / ks),
          dense_resident_blocks<T, NC, kDenseShort, PL>());
      return;
    }
  }
  run(matvec_dense_kernel<T, NC, kDenseRows, PL>, br, dense_resident_blocks<T, NC, kDenseRows, PL>());
}

template <int T, int NC>
void launch_dense_nc(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y, int64_t ldy,
                     bool tall, int n_batch, const MatvecBatch& batch, cudaStream_t s, bool planes) {
  if constexpr (kPlanesType<T>) {
    if (planes) {
      launch_dense_shape<T, NC, true>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s);
      return;
    }
  }
  launch_dense_shape<T, NC, false>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s);
}

template <int T>
void launch_dense(const TensorView& W, int64_t units, const float* X, int nc, int64_t ldx, float* Y, int64_t ldy,
                  bool tall, int n_batch, const MatvecBatch& batch, cudaStream_t s, bool planes) {
  switch (nc) {
    case 1: launch_dense_nc<T, 1>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 2: launch_dense_nc<T, 2>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 3: launch_dense_nc<T, 3>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 4: launch_dense_nc<T, 4>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 5: launch_dense_nc<T, 5>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 6: launch_dense_nc<T, 6>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 7: launch_dense_nc<T, 7>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 8: launch_dense_nc<T, 8>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 9: launch_dense_nc<T, 9>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 10: launch_dense_nc<T, 10>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 11: launch_dense_nc<T, 11>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 12: launch_dense_nc<T, 12>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 13: launch_dense_nc<T, 13>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 14: launch_dense_nc<T, 14>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 15: launch_dense_nc<T, 15>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    case 16: launch_dense_nc<T, 16>(W, units, X, ldx, Y, ldy, tall, n_batch, batch, s, planes); break;
    default: throw std::invalid_argument("GPU matvec: a chunk has 1..16 columns");
  }
}

// --- the staged kernel (matvec.cuh): launch limits, read once from the device ----------------
//
// matvec_prepare() raises every staged instantiation's dynamic shared memory limit to the device's
// opt-in limit (less its static part; 48 KB less that where raising fails) and records its
// registers, so a launch sizes its persistent grid (SMs x resident blocks) with no API call: the
// engine prepares at construction, never inside a graph capture.
struct StagedFn {
  int regs = 0;
  size_t stat = 0, dyn_max = 0;
};
struct StagedDevice {
  int sms = 1, smem_per_sm = 0, regs_per_sm = 0, threads_per_sm = 0;
  size_t dyn_limit = 0;  // the smallest dyn_max over the instantiations
  std::map<const void*, StagedFn> fns;
};
StagedDevice g_staged;
std::once_flag g_staged_once;

template <int T, int NC, bool PL>
const void* staged_fn_ptr() {
  return reinterpret_cast<const void*>(&matvec_staged_kernel<T, NC, PL>);
}

template <int T, int NC, bool PL>
void prepare_staged_one(size_t optin) {
  const void* fn = staged_fn_ptr<T, NC, PL>();
  cudaFuncAttributes attr;
  DS4_GPU_CHECK(cudaFuncGetAttributes(&attr, fn));
  StagedFn f;
  f.regs = attr.numRegs;
  f.stat = attr.sharedSizeBytes;
  f.dyn_max = optin > f.stat ? optin - f.stat : 0;
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(f.dyn_max)) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    f.dyn_max = 48 * 1024 > f.stat ? 48 * 1024 - f.stat : 0;
  }
  g_staged.fns[fn] = f;
  g_staged.dyn_limit = std::min(g_staged.dyn_limit, f.dyn_max);
}

template <int T, int... I>
void prepare_staged_type(size_t optin, std::integer_sequence<int, I...>) {
  (prepare_staged_one<T, I + 1, false>(optin), ...);
  if constexpr (kPlanesType<T>) (prepare_staged_one<T, I + 1, true>(optin), ...);
}

// The staged kernel takes these types (F32 matrices in DS4 are the 24-row mHC projections).
template <int T>
constexpr bool kStagedType = T != kF32;

void prepare_staged() {
  int dev = 0, sms = 1, optin = 0, smem_sm = 0, regs_sm = 0, thr_sm = 0;
  DS4_GPU_CHECK(cudaGetDevice(&dev));
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || optin <= 0) {
    (void)cudaGetLastError();
    optin = 48 * 1024;
  }
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&regs_sm, cudaDevAttrMaxRegistersPerMultiprocessor, dev));
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&thr_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev));
  g_staged.sms = std::max(sms, 1);
  g_staged.smem_per_sm = smem_sm;
  g_staged.regs_per_sm = regs_sm;
  g_staged.threads_per_sm = thr_sm;
  g_staged.dyn_limit = static_cast<size_t>(optin);
  const auto nc = std::make_integer_sequence<int, kMaxCols>{};
  prepare_staged_type<kF16>(optin, nc);
  prepare_staged_type<kBF16>(optin, nc);
  prepare_staged_type<kQ8_0>(optin, nc);
  prepare_staged_type<kQ4_K>(optin, nc);
  prepare_staged_type<kMXFP4>(optin, nc);
}

// Resident blocks per SM for a staged instantiation with `dyn` bytes of dynamic shared memory:
// the smallest of the thread, register and shared-memory limits (registers in 256-register
// units per warp; 1 KB of shared memory reserved per block). An overestimate only queues blocks.
int staged_blocks_per_sm(const StagedFn& f, size_t dyn) {
  const int by_threads = std::max(1, g_staged.threads_per_sm / kStagedThreads);
  int by_regs = by_threads;
  if (f.regs > 0 && g_staged.regs_per_sm > 0) {
    const int per_warp = ((f.regs * DS4_WARP + 255) / 256) * 256;
    by_regs = (g_staged.regs_per_sm / per_warp) / kStagedWarps;
  }
  int by_smem = by_threads;
  if (g_staged.smem_per_sm > 0) by_smem = static_cast<int>(g_staged.smem_per_sm / (dyn + f.stat + 1024));
  return std::max(1, std::min({by_threads, by_regs, by_smem}));
}

template <int T, int NC, bool PL>
void launch_staged_shape(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y, int64_t ldy,
                         int n_batch, const MatvecBatch& batch, cudaStream_t s) {
  const int64_t rows = W.ne[1], K = W.ne[0];
  const int ks = matvec_kslices(rows, units);
  const size_t cols = PL ? static_cast<size_t>(NC) * static_cast<size_t>(units) * kPlaneBytes
                         : static_cast<size_t>(NC) * static_cast<size_t>(staged_col4(K)) * 16;
  const size_t dyn = cols + staged_wbuf_bytes<T>();
  const StagedFn& f = g_staged.fns.at(staged_fn_ptr<T, NC, PL>());
  const int64_t br = static_cast<int64_t>(kStagedRows) * (kStagedWarps / ks);
  const int64_t n_blocks = (rows + br - 1) / br;
  // A persistent grid over the members' row blocks: each member gets its share of the GPU.
  const int64_t resident = static_cast<int64_t>(g_staged.sms) * staged_blocks_per_sm(f, dyn);
  const int64_t grid = std::min<int64_t>(n_blocks, std::max<int64_t>(1, resident / n_batch));
  const bool chunks = use_chunks<T>(W, units) && batch.w_bytes % 16 == 0;
  launch(matvec_staged_kernel<T, NC, PL>, dim3(static_cast<unsigned>(grid), static_cast<unsigned>(n_batch)),
         kStagedThreads, dyn, s, W.data, W.row_bytes(), rows, units, ks, K, X, ldx, Y, ldy, chunks, batch);
}

template <int T, int NC>
void launch_staged_nc(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y, int64_t ldy,
                      int n_batch, const MatvecBatch& batch, cudaStream_t s, bool planes) {
  if constexpr (kPlanesType<T>) {
    if (planes) {
      launch_staged_shape<T, NC, true>(W, units, X, ldx, Y, ldy, n_batch, batch, s);
      return;
    }
  }
  launch_staged_shape<T, NC, false>(W, units, X, ldx, Y, ldy, n_batch, batch, s);
}

template <int T>
void launch_staged(const TensorView& W, int64_t units, const float* X, int nc, int64_t ldx, float* Y, int64_t ldy,
                   int n_batch, const MatvecBatch& batch, cudaStream_t s, bool planes) {
  if constexpr (kStagedType<T>) {
    switch (nc) {
      case 1: launch_staged_nc<T, 1>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 2: launch_staged_nc<T, 2>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 3: launch_staged_nc<T, 3>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 4: launch_staged_nc<T, 4>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 5: launch_staged_nc<T, 5>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 6: launch_staged_nc<T, 6>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 7: launch_staged_nc<T, 7>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 8: launch_staged_nc<T, 8>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 9: launch_staged_nc<T, 9>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 10: launch_staged_nc<T, 10>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 11: launch_staged_nc<T, 11>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 12: launch_staged_nc<T, 12>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 13: launch_staged_nc<T, 13>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 14: launch_staged_nc<T, 14>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 15: launch_staged_nc<T, 15>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      case 16: launch_staged_nc<T, 16>(W, units, X, ldx, Y, ldy, n_batch, batch, s, planes); break;
      default: throw std::invalid_argument("GPU matvec: a staged piece has 1..16 columns");
    }
  } else {
    throw std::logic_error("GPU matvec: the staged kernel does not take this type");
  }
}

// Into how many pieces the staged kernel cuts an nc-column chunk (each piece's columns must fit
// shared memory; each piece reads the weights again, so more than kMaxStagedPieces is left to the
// direct kernel); 0: this product stays on the direct kernel.
constexpr int kMaxStagedPieces = 4;
size_t staged_wbuf_bytes_of(DType t) {
  switch (t) {
    case DType::Q8_0: return staged_wbuf_bytes<kQ8_0>();
    case DType::Q4_K: return staged_wbuf_bytes<kQ4_K>();
    default: return 0;
  }
}
// The fewest rows an nc-column chunk's matrix needs for the staged kernel: the setting, or the rule
// (matvec.cuh kStagedMinRows, kStagedMinRowsFull).
int64_t staged_min_rows_for(int nc) {
  const int64_t set = matvec_staged_min_rows();
  return set > 0 ? set : nc >= kMaxCols ? kStagedMinRowsFull : kStagedMinRows;
}

int staged_pieces(const TensorView& W, int nc, int staged_min) {
  if (nc < std::max(staged_min, 1) || W.type == DType::F32 || W.ne[1] < staged_min_rows_for(nc)) return 0;
  matvec_prepare();
  const size_t per_col = static_cast<size_t>(staged_col4(W.ne[0])) * 16;
  const size_t wbuf = staged_wbuf_bytes_of(W.type);
  if (g_staged.dyn_limit <= wbuf) return 0;
  const size_t fit = (g_staged.dyn_limit - wbuf) / per_col;
  if (fit == 0) return 0;
  const int pieces = static_cast<int>((static_cast<size_t>(nc) + fit - 1) / fit);
  return pieces <= kMaxStagedPieces ? pieces : 0;
}

// Which grouped kernel Q4_K products take (matvec.cuh, pass 6): kGroupedPass5, kGroupedOwn (the
// default: on flash-l4 the engine decodes 11-38% faster than with pass 5 at C = 1-8 and prefills
// 21% faster, and it matches or beats kGroupedOwnFast; ext/gpu/README.md "Pass 6: outcome") or
// kGroupedOwnFast, all the same bits; DS4_GPU_MV_GROUPED=0|1|2 sets it,
// DS4_GPU_MV_GROUPED_STAGES=2..4 the own kernel's copy stages (default 3) and
// DS4_GPU_MV_GROUPED_WIDTH=1|2|4|8 its widest sub-part (default 1 since pass 14: the 1-column body
// has 99 registers against 227 for the 4-column one, so 4 blocks an SM instead of 2; a part of
// several columns then runs column by column, its rows re-read from L2: C = 2-8 +9-22%, prompt
// steps of 8-64 rows +23-25%, ext/gpu/README.md "Pass 14").
std::atomic<int> g_grouped{-1}, g_grouped_stages{-1}, g_grouped_width{-1};  // -1: not read yet

int env_int(const char* name, int lo, int hi, int fallback) {
  const char* e = std::getenv(name);
  if (e == nullptr || *e == 0) return fallback;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  return (end != nullptr && *end == 0 && v >= lo && v <= hi) ? static_cast<int>(v) : fallback;
}

std::atomic<int> g_tall_min_k{-1};  // -1: not read from the environment yet
std::atomic<int64_t> g_staged_min_rows{0};  // the staged kernel's fewest rows (a measurement setting; 0: the rule)

// The tall variant's least row width: 2048 by default (pass 16's timeline of a C=1 step: q_b's 1024
// elements a row on the tall kernel, one chunk a row block and two row blocks a block, the second
// copied only once the first is done, finished 4-5 us later a layer than on the direct kernel's
// double-buffered stream; the LM head's 4096 stay tall).
int tall_min_k_now() {
  int v = g_tall_min_k.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_int("DS4_GPU_MV_TALL_MIN_K", 0, 1 << 30, 2048);
    g_tall_min_k.store(v, std::memory_order_relaxed);
  }
  return v;
}

int grouped_variant_now() {
  int v = g_grouped.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_int("DS4_GPU_MV_GROUPED", kGroupedPass5, kGroupedOwnFast, kGroupedOwn);
    g_grouped.store(v, std::memory_order_relaxed);
  }
  return v;
}

int grouped_stages_now() {
  int v = g_grouped_stages.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_int("DS4_GPU_MV_GROUPED_STAGES", 2, kGroupedMaxStages, 3);
    g_grouped_stages.store(v, std::memory_order_relaxed);
  }
  return v;
}

// The own kernel's row groups a warp streams (matvec.cuh set_matvec_grouped_groups): the setter's
// value, else DS4_GPU_MV_GROUPED_GROUPS=N, else 0: chosen per launch (grouped_own_groups).
std::atomic<int> g_grouped_groups{-1};  // -1: the environment or the default

int grouped_groups_now() {
  const int v = g_grouped_groups.load(std::memory_order_relaxed);
  if (v >= 0) return v;
  static const int env = env_int("DS4_GPU_MV_GROUPED_GROUPS", 1, kGroupedMaxGroups, 0);
  return env;
}

int grouped_width_now() {
  int v = g_grouped_width.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_int("DS4_GPU_MV_GROUPED_WIDTH", 1, 8, 1);
    v = v >= 8 ? 8 : v >= 4 ? 4 : v >= 2 ? 2 : 1;
    g_grouped_width.store(v, std::memory_order_relaxed);
  }
  return v;
}

// X's planes for the own kernel's integer products (null: the float path, or, with the switch on,
// no planes made: the own kernel declines and matvec_grouped_kernel builds them lane by lane).
struct GroupedPlanes {
  const uint8_t* data = nullptr;
  int64_t ldp = 0;
};

template <int MAXC, int KS>
void launch_grouped_own_ks(bool fast, const TensorView& W, int64_t units, const ExpertPart* parts,
                           const int32_t* n_parts, int max_parts, const int32_t* sorted_pairs, const int32_t* x_row,
                           const float* X, int64_t ldx, float* Y, int64_t ldy, cudaStream_t s, GroupedPlanes gp) {
  const int64_t rows = W.ne[1];
  const int stages = grouped_stages_now();
  const size_t smem = static_cast<size_t>(grouped_own_smem(MAXC, stages));
  const auto* pd = reinterpret_cast<const ExpertPartDev*>(parts);
  auto go = [&](auto kernel) {
    // Every sub-part width covers a block's rows (grouped_own_nc), so no block is idle.
    const int groups =
        grouped_own_groups(rows, grouped_own_block_rows(MAXC, false), max_parts,
                           device_resident_blocks(reinterpret_cast<const void*>(kernel), kMatvecThreads, smem));
    const int64_t block_rows = grouped_own_block_rows(MAXC, false) * static_cast<int64_t>(groups);
    const dim3 grid(static_cast<unsigned>((rows + block_rows - 1) / block_rows), static_cast<unsigned>(max_parts));
    launch(kernel, grid, kMatvecThreads, smem, s, W.data, nullptr, W.row_bytes() * rows, W.row_bytes(),
           static_cast<int>(rows), static_cast<int>(units), pd, n_parts, sorted_pairs, x_row, X, ldx, GroupedStore{Y},
           ldy, stages, groups, gp.data, gp.ldp);
  };
  if (gp.data != nullptr) go(matvec_grouped_own_kernel<MAXC, KS, false, GroupedStore, true>);
  else if (fast) go(matvec_grouped_own_kernel<MAXC, KS, true, GroupedStore>);
  else go(matvec_grouped_own_kernel<MAXC, KS, false, GroupedStore>);
}

// Whether the own kernel takes a product of W (Q4_K with chunked loads, KS <= 2, an expert below
// 2^31 bytes, the variant not pass 5), before the planes question.
bool own_takes(const TensorView& W, int64_t units) {
  const int64_t rows = W.ne[1];
  return W.type == DType::Q4_K && grouped_variant_now() != kGroupedPass5 && use_chunks<kQ4_K>(W, units) &&
         rows * W.row_bytes() < (int64_t{1} << 31) && matvec_kslices(rows, units) <= 2;
}

// The own kernel, where it takes the product; false: the caller launches matvec_grouped_kernel.
template <int T, int MAXC>
bool launch_grouped_own_maxc(const TensorView& W, int64_t units, const ExpertPart* parts, const int32_t* n_parts,
                        int max_parts, const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx,
                        float* Y, int64_t ldy, cudaStream_t s, GroupedPlanes gp) {
  if constexpr (T == kQ4_K) {
    if (!own_takes(W, units) || (planes_for(W) && gp.data == nullptr)) return false;
    const bool fast = grouped_variant_now() == kGroupedOwnFast;
    if (matvec_kslices(W.ne[1], units) == 1)
      launch_grouped_own_ks<MAXC, 1>(fast, W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s,
                                     gp);
    else
      launch_grouped_own_ks<MAXC, 2>(fast, W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s,
                                     gp);
    return true;
  } else {
    return false;
  }
}

template <int T, int MAXC>
void launch_grouped_maxc(const TensorView& W, int64_t units, const ExpertPart* parts, const int32_t* n_parts,
                         int max_parts, const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx,
                         float* Y, int64_t ldy, cudaStream_t s, GroupedPlanes gp) {
  // The own kernel (pass 6) where it is switched on and takes the matrix, sized for min(MAXC, width).
  if constexpr (T == kQ4_K) {
    const int w = std::min(MAXC, grouped_width_now());
    auto own_w = [&](auto maxc) {
      return launch_grouped_own_maxc<T, decltype(maxc)::value>(W, units, parts, n_parts, max_parts, sorted_pairs,
                                                                x_row, X, ldx, Y, ldy, s, gp);
    };
    const bool own = w >= 8   ? own_w(std::integral_constant<int, (MAXC < 8 ? MAXC : 8)>{})
                     : w >= 4 ? own_w(std::integral_constant<int, (MAXC < 4 ? MAXC : 4)>{})
                     : w >= 2 ? own_w(std::integral_constant<int, (MAXC < 2 ? MAXC : 2)>{})
                              : own_w(std::integral_constant<int, 1>{});
    if (own) return;
  }
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  // Sized for the narrowest block (most blocks); wider parts leave their extra blocks idle.
  const int64_t block_rows = std::min(matvec_block_rows(1, ks), matvec_block_rows(MAXC, ks));
  const dim3 grid(static_cast<unsigned>((rows + block_rows - 1) / block_rows), static_cast<unsigned>(max_parts));
  launch(matvec_grouped_kernel<T, MAXC>, grid, kMatvecThreads, 0, s,
      W.data, W.row_bytes() * rows, W.row_bytes(), rows, units, ks, reinterpret_cast<const ExpertPartDev*>(parts),
      n_parts, sorted_pairs, x_row, X, ldx, Y, ldy, use_chunks<T>(W, units), kPlanesType<T> && int8_on());
}

template <int T>
void launch_grouped(const TensorView& W, int64_t units, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    int max_cols, const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx,
                    float* Y, int64_t ldy, cudaStream_t s, GroupedPlanes gp) {
  if (max_cols <= 1)
    launch_grouped_maxc<T, 1>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp);
  else if (max_cols <= 2)
    launch_grouped_maxc<T, 2>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp);
  else if (max_cols <= 4)
    launch_grouped_maxc<T, 4>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp);
  else
    launch_grouped_maxc<T, kMaxPartCols>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s,
                                         gp);
}

constexpr int kPartsThreads = 256;

__global__ void __launch_bounds__(kPartsThreads)
    build_parts_kernel(const int32_t* __restrict__ pair_expert, int n_pairs, int n_expert, int max_part,
                       int32_t* __restrict__ sorted, ExpertPartDev* __restrict__ parts, int32_t* __restrict__ n_parts,
                       bool warp_counts) {
  ds4_grid_begin();
  extern __shared__ int32_t parts_sm[];
  build_parts_block<kPartsThreads>(pair_expert, n_pairs, n_expert, max_part, sorted, parts, n_parts, parts_sm,
                                   warp_counts);
}

// --- the fused router (pass 18) -----------------------------------------------------------------
//
// Why: at one lane the route ended ~8 us after the router's product and the parts ~3 us after that
// (pass 17's timeline), each mostly its launch, grid wait and first loads. Here the product's blocks
// are matvec_dense_kernel's one-row-a-warp blocks (the same matvec_blocks call, so the logits' bits),
// then each block fences its logits and counts itself done; the last one (the counter's final
// value) routes every lane, a warp a lane (route_lane, reading the logits from L2), and builds the
// parts with all its threads (build_parts_block, from the ids route_lane also left in shared
// memory): the bytes route_kernel and build_parts_kernel write. It resets the counter for the next
// launch.
constexpr int kRouterMaxCols = 8;
constexpr int kRouterMaxExperts = 8 * DS4_WARP;  // route_lane<8>

template <int T, int NC>
__global__ void __launch_bounds__(kMatvecThreads)
    router_route_kernel(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                        const float* __restrict__ X, int64_t ldx, float* Y, bool chunked, const RouteArgs ra, int n,
                        int max_part, int32_t* __restrict__ sorted, ExpertPartDev* __restrict__ parts,
                        int32_t* __restrict__ n_parts, uint32_t* __restrict__ done) {
  constexpr int R = 1, S = chunk_stages<T>(R, kMatvecWarps);
  __shared__ float part[kMatvecWarps * R * NC];
  __shared__ __align__(16) uint8_t wbuf[chunk_buffer_bytes<T>(R, kMatvecWarps, S)];
  __shared__ RouteShared rsh[kMatvecWarps];
  __shared__ int32_t ids_s[kRouterMaxCols * kMaxExpertUsed];  // the ids again, for the parts
  __shared__ bool last;
  extern __shared__ int32_t router_parts_sm[];
  const int64_t br = kMatvecWarps / ks;
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
  // A hash layer's experts before the product, by every block (step inputs and a weight): the last
  // block's route then does not wait on their two dependent loads (pass 41).
  if (ra.hash)
    for (int i = warp; i < n; i += kMatvecWarps) route_hash_ids(ra, i, ids_s + i * ra.k_used);
  matvec_blocks<T, NC, R, S>(W, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, (rows + br - 1) / br,
                             GlobalX<DenseOff>{X, DenseOff{ldx}}, Y, DenseOff{rows}, part, chunked, wbuf);
  __threadfence();  // this block's logits, before it counts itself done
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's logits, after their count
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  for (int i = warp; i < n; i += kMatvecWarps) {
    ds4_syncwarp();  // the warp's last lane is done with rsh (route_lane's outputs)
    if (ra.hash)
      for (int k = lane; k < ra.k_used; k += DS4_WARP) rsh[warp].chosen[k] = ids_s[i * ra.k_used + k];
    route_lane<8>(ra, i, Y + static_cast<int64_t>(i) * rows, rsh[warp], ids_s);
  }
  __syncthreads();  // the ids, for every thread's parts (from shared memory, not back from L2)
  build_parts_block<kMatvecThreads>(ids_s, n * ra.k_used, ra.n_expert, max_part, sorted, parts, n_parts,
                                    router_parts_sm);
  if (threadIdx.x == 0) *done = 0u;
}

template <int T, int NC>
void launch_router_route(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y,
                         const RouteArgs& ra, int n, int max_part, int32_t* sorted, ExpertPartDev* parts,
                         int32_t* n_parts, uint32_t* done, cudaStream_t s) {
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  const int64_t br = kMatvecWarps / ks;
  const unsigned grid = static_cast<unsigned>((rows + br - 1) / br);
  const size_t smem = static_cast<size_t>(build_parts_smem(ra.n_expert, kMatvecThreads));
  launch(router_route_kernel<T, NC>, grid, kMatvecThreads, smem, s, W.data, W.row_bytes(), rows, units, ks, X, ldx, Y,
         use_chunks<T>(W, units), ra, n, max_part, sorted, parts, n_parts, done);
}

template <int T>
void launch_router_route_nc(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y,
                            const RouteArgs& ra, int n, int max_part, int32_t* sorted, ExpertPartDev* parts,
                            int32_t* n_parts, uint32_t* done, cudaStream_t s) {
  auto go = [&](auto nc) {
    launch_router_route<T, decltype(nc)::value>(W, units, X, ldx, Y, ra, n, max_part, sorted, parts, n_parts, done,
                                                 s);
  };
  switch (n) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    case 3: go(std::integral_constant<int, 3>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 5: go(std::integral_constant<int, 5>{}); break;
    case 6: go(std::integral_constant<int, 6>{}); break;
    case 7: go(std::integral_constant<int, 7>{}); break;
    default: go(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace

template <int NC>
void prepare_tall2_one() {
  // Above 48 KB of dynamic shared memory a kernel must ask first; failing that, the launch fails
  // with the usual one-line error. Both arithmetics (PL: the integer products).
  (void)cudaFuncSetAttribute(reinterpret_cast<const void*>(&matvec_dense_kernel<kQ8_0, NC, kDenseTall2>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, dense_dynamic_smem<kQ8_0, NC, kDenseTall2>());
  (void)cudaFuncSetAttribute(reinterpret_cast<const void*>(&matvec_dense_kernel<kQ8_0, NC, kDenseTall2, true>),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, dense_dynamic_smem<kQ8_0, NC, kDenseTall2>());
  (void)cudaGetLastError();
}

void matvec_prepare() {
  std::call_once(g_staged_once, [] {
    prepare_staged();
    // build_parts_kernel's walk at its most experts (build_expert_parts: 4096, 51 KB).
    (void)cudaFuncSetAttribute(reinterpret_cast<const void*>(&build_parts_kernel),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, build_parts_smem(4096, kPartsThreads));
    prepare_tall2_one<1>();
    prepare_tall2_one<2>();
    prepare_tall2_one<3>();
    prepare_tall2_one<4>();
    (void)imma_prepare();
  });
}

void set_matvec_tall_stages(int stages) {
  if (stages != 1 && stages != 2) throw std::invalid_argument("set_matvec_tall_stages: stages must be 1 or 2");
  g_tall_stages.store(stages, std::memory_order_relaxed);
}

void set_matvec_mma(bool on) { g_mma.store(on ? 1 : 0, std::memory_order_relaxed); }
bool matvec_mma() { return mma_on(); }
bool matvec_uses_mma(const TensorView& W) { return mma_on() && mma_matvec_fits(W); }

size_t matvec_scratch_bytes(const TensorView& W, int ncols) {
  return matvec_uses_mma(W) && ncols > 0 ? mma_matvec_scratch_bytes(W, std::min(ncols, kMmaCallCols)) : 0;
}

size_t matvec_grouped_scratch_bytes(const TensorView& W, int max_parts) {
  return matvec_uses_mma(W) && max_parts > 0 ? mma_grouped_scratch_bytes(W, max_parts) : 0;
}

void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
            bool tall, int staged_min) {
  matvec_batched(W, 1, 0, X, 0, ncols, ldx, Y, 0, ldy, stream, tall, staged_min);
}

void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
            bool tall, int staged_min, const MatvecScratch& scratch) {
  matvec_batched(W, 1, 0, X, 0, ncols, ldx, Y, 0, ldy, stream, tall, staged_min, scratch);
}

void matvec_batched(const TensorView& W, int n_batch, int64_t w_stride_bytes, const float* X, int64_t x_stride,
                    int ncols, int64_t ldx, float* Y, int64_t y_stride, int64_t ldy, Stream stream, bool tall,
                    int staged_min) {
  if (!matvec_uses_mma(W)) {
    matvec_batched(W, n_batch, w_stride_bytes, X, x_stride, ncols, ldx, Y, y_stride, ldy, stream, tall, staged_min,
                   MatvecScratch{});
    return;
  }
  with_module_scratch(matvec_scratch_bytes(W, ncols), stream, [&](const MatvecScratch& scratch) {
    matvec_batched(W, n_batch, w_stride_bytes, X, x_stride, ncols, ldx, Y, y_stride, ldy, stream, tall, staged_min,
                   scratch);
  });
}

namespace {

// matvec_batched's SIMT products, with the X planes already made (`ready`, Q8_0 with the integer
// products on) or made here.
void matvec_simt(const TensorView& W, int64_t units, int n_batch, int64_t w_stride_bytes, const float* X,
                 int64_t x_stride, int ncols, int64_t ldx, float* Y, int64_t y_stride, int64_t ldy, cudaStream_t s,
                 bool tall, int staged_min, const MatvecScratch& scratch, const uint8_t* ready, int64_t ready_ldp) {
  const bool planes = planes_for(W);
  PlanesLease lease;
  if (planes && ready == nullptr)
    lease = prepare_planes(X, ldx, x_stride, ncols, n_batch, W.ne[0], scratch, s);
  const uint8_t* P = ready != nullptr ? ready : lease.data;
  const int64_t ldp = ready != nullptr ? ready_ldp : lease.ldp;
  // Wide Q8_0 calls on the integer tensor cores where they serve: the same bits (imma_q8.cu).
  if (planes && W.type == DType::Q8_0 &&
      imma_q8_matvec(W, units, n_batch, w_stride_bytes, P, ldp, ncols, Y, y_stride, ldy, s))
    return;
  // Planes: member i's column c at P + (i * ncols + c) * ldp, passed where X goes (ldx, batch.x in bytes).
  const MatvecBatch batch{w_stride_bytes, planes ? static_cast<int64_t>(ncols) * ldp : x_stride, y_stride};
  auto x_at = [&](int c) {
    return planes ? reinterpret_cast<const float*>(P + static_cast<int64_t>(c) * ldp)
                  : X + static_cast<int64_t>(c) * ldx;
  };
  const int64_t lx = planes ? ldp : ldx;
  // Columns [c0, c0 + nc) of every member, nb members `bt` apart: one launch (the staged kernel: a
  // launch a piece).
  auto run = [&](int c0, int nc, int nb, const MatvecBatch& bt) {
    float* Yc = Y + static_cast<int64_t>(c0) * ldy;
    const int pieces = staged_pieces(W, nc, staged_min);
    if (pieces > 0) {
      // Near-equal pieces, each one staged launch.
      for (int p = 0, p0 = 0; p < pieces; ++p) {
        const int w = nc / pieces + (p < nc % pieces ? 1 : 0);
        const float* Xp = x_at(c0 + p0);
        float* Yp = Yc + static_cast<int64_t>(p0) * ldy;
        switch (W.type) {
          case DType::F16: launch_staged<kF16>(W, units, Xp, w, lx, Yp, ldy, nb, bt, s, planes); break;
          case DType::BF16: launch_staged<kBF16>(W, units, Xp, w, lx, Yp, ldy, nb, bt, s, planes); break;
          case DType::Q8_0: launch_staged<kQ8_0>(W, units, Xp, w, lx, Yp, ldy, nb, bt, s, planes); break;
          case DType::Q4_K: launch_staged<kQ4_K>(W, units, Xp, w, lx, Yp, ldy, nb, bt, s, planes); break;
          case DType::MXFP4: launch_staged<kMXFP4>(W, units, Xp, w, lx, Yp, ldy, nb, bt, s, planes); break;
          default: throw std::invalid_argument("GPU matvec: unsupported weight type");
        }
        DS4_GPU_CHECK_LAUNCH("matvec_staged_kernel");
        p0 += w;
      }
      return;
    }
    const float* Xc = x_at(c0);
    switch (W.type) {
      case DType::F32: launch_dense<kF32>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      case DType::F16: launch_dense<kF16>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      case DType::BF16: launch_dense<kBF16>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      case DType::Q8_0: launch_dense<kQ8_0>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      case DType::Q4_K: launch_dense<kQ4_K>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      case DType::MXFP4: launch_dense<kMXFP4>(W, units, Xc, nc, lx, Yc, ldy, tall, nb, bt, s, planes); break;
      default: throw std::invalid_argument("GPU matvec: unsupported weight type");
    }
    DS4_GPU_CHECK_LAUNCH("matvec_dense_kernel");
  };
  // Wider products run as 16-column chunks: each column is still single-column arithmetic. A
  // one-member call's whole chunks are the members of one launch (the weights shared, 16 columns
  // apart): the same kernels, so the same bits, with every chunk's blocks in one grid.
  int c0 = 0;
  if (n_batch == 1 && ncols >= 2 * kMaxCols) {
    const int chunks = std::min(ncols / kMaxCols, 65535);
    run(0, kMaxCols, chunks, MatvecBatch{0, kMaxCols * (planes ? ldp : ldx), kMaxCols * ldy});
    c0 = chunks * kMaxCols;
  }
  for (; c0 < ncols; c0 += kMaxCols) run(c0, std::min(kMaxCols, ncols - c0), n_batch, batch);
}

}  // namespace

void matvec_batched(const TensorView& W, int n_batch, int64_t w_stride_bytes, const float* X, int64_t x_stride,
                    int ncols, int64_t ldx, float* Y, int64_t y_stride, int64_t ldy, Stream stream, bool tall,
                    int staged_min, const MatvecScratch& scratch) {
  if (ncols < 0) throw std::invalid_argument("GPU matvec: negative column count");
  if (n_batch < 1 || n_batch > 65535) throw std::invalid_argument("GPU matvec: a batch has 1..65535 members");
  if (x_stride % 4 != 0 || w_stride_bytes < 0)
    throw std::invalid_argument("GPU matvec: batch strides must keep the activations 16-byte aligned");
  const int64_t units = check_weights(W, "GPU matvec");
  check_activations(X, ldx, "GPU matvec");
  if (ncols == 0 || W.ne[1] == 0) return;
  // Tensor-core products: member by member (one scratch serves them in stream order). The stride
  // test keeps every member 16-byte aligned; it depends on the call site, never on the width.
  if (matvec_uses_mma(W) && w_stride_bytes % 16 == 0) {
    for (int i = 0; i < n_batch; ++i) {
      TensorView Wi = W;
      Wi.data = W.data + static_cast<int64_t>(i) * w_stride_bytes;
      mma_product(Wi, X + static_cast<int64_t>(i) * x_stride, ncols, ldx, Y + static_cast<int64_t>(i) * y_stride, ldy,
                  stream, scratch);
    }
    return;
  }
  matvec_simt(W, units, n_batch, w_stride_bytes, X, x_stride, ncols, ldx, Y, y_stride, ldy,
              static_cast<cudaStream_t>(stream), tall, staged_min, scratch, nullptr, 0);
}

namespace detail {
void matvec_with_planes(const TensorView& W, const float* X, const uint8_t* planes, int64_t ldp, int ncols,
                        int64_t ldx, float* Y, int64_t ldy, Stream stream, bool tall, int staged_min,
                        const MatvecScratch& scratch) {
  if (planes == nullptr || matvec_uses_mma(W) || !planes_for(W)) {
    matvec(W, X, ncols, ldx, Y, ldy, stream, tall, staged_min, scratch);
    return;
  }
  const int64_t units = check_weights(W, "GPU matvec");
  check_activations(X, ldx, "GPU matvec");
  if (ncols <= 0 || W.ne[1] == 0) return;
  matvec_simt(W, units, 1, 0, X, 0, ncols, ldx, Y, 0, ldy, static_cast<cudaStream_t>(stream), tall, staged_min,
              scratch, planes, ldp);
}
}  // namespace detail

// --- planes (xplanes.cuh) ------------------------------------------------------------------------


namespace {

// xplanes.cuh "the prep kernel".
__global__ void __launch_bounds__(kPlanesPrepThreads)
    x_planes_kernel(const float* __restrict__ X, int64_t ldx, int64_t x_member, int ncols, int64_t units,
                    uint8_t* __restrict__ P, int64_t ldp, int64_t j0) {
  ds4_grid_begin();
  const int64_t j = j0 + blockIdx.y;
  const float* x = X + static_cast<int64_t>(j / ncols) * x_member + static_cast<int64_t>(j % ncols) * ldx;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kPlanesPrepThreads + threadIdx.x;
  const int64_t u = t / kPlaneThreads;
  const int w = static_cast<int>(t % kPlaneThreads);
  const bool live = u < units;  // every lane takes part in the shuffles
  const float4 v = live ? ds4_ldg(reinterpret_cast<const float4*>(x + 32 * u) + w) : make_float4(0.f, 0.f, 0.f, 0.f);
  unit_planes_part(v, w, live, P + static_cast<int64_t>(j) * ldp + kPlaneBytes * u);
}

}  // namespace

bool int8_on() { return env_switch(g_int8, "DS4_GPU_MV_INT8"); }
void set_matvec_int8(bool on) { g_int8.store(on ? 1 : 0, std::memory_order_relaxed); }
bool matvec_int8() { return int8_on(); }
void set_planes_fused(bool on) { g_planes_fused.store(on ? 1 : 0, std::memory_order_relaxed); }
bool planes_fused() { return env_switch(g_planes_fused, "DS4_GPU_PLANES_FUSED"); }
namespace testing {
int64_t planes_prep_launches() { return g_prep_launches.load(std::memory_order_relaxed); }
}  // namespace testing

PlanesLease& PlanesLease::operator=(PlanesLease&& o) noexcept {
  if (this != &o) {
    if (owned != nullptr) (void)cudaFreeAsync(owned, stream);
    data = o.data;
    ldp = o.ldp;
    owned = o.owned;
    stream = o.stream;
    o.owned = nullptr;
    o.data = nullptr;
  }
  return *this;
}

PlanesLease::~PlanesLease() {
  if (owned != nullptr) (void)cudaFreeAsync(owned, stream);
}

PlanesLease prepare_planes(const float* X, int64_t ldx, int64_t x_member, int ncols, int n_batch, int64_t K,
                           const MatvecScratch& scratch, cudaStream_t stream) {
  PlanesLease lease;
  lease.stream = stream;
  for (const GivenPlanes& g : scratch.given) {
    const bool shape = n_batch == 1 ? g.n_batch == 1 && ncols <= g.cols
                                    : g.n_batch == n_batch && g.x_member == x_member && ncols == g.cols;
    if (g.x != nullptr && g.x == X && g.ldx == ldx && g.k == K && shape) {
      lease.data = g.data;
      lease.ldp = g.ldp;
      return lease;
    }
  }
  const int64_t units = K / 32;
  const int64_t cols = static_cast<int64_t>(ncols) * n_batch;
  const size_t need = matvec_planes_bytes(K, cols);
  lease.ldp = units * kPlaneBytes;
  if (scratch.planes != nullptr && need <= scratch.planes_bytes) {
    lease.data = scratch.planes;
  } else {
    DS4_GPU_CHECK(cudaMallocAsync(&lease.owned, need, stream));
    lease.data = static_cast<const uint8_t*>(lease.owned);
  }
  const int64_t threads = units * kPlaneThreads;
  for (int64_t j0 = 0; j0 < cols; j0 += 65535) {
    const dim3 grid(static_cast<unsigned>((threads + kPlanesPrepThreads - 1) / kPlanesPrepThreads),
                    static_cast<unsigned>(std::min<int64_t>(65535, cols - j0)));
    launch(x_planes_kernel, grid, kPlanesPrepThreads, 0, stream, X, ldx, x_member, ncols, units,
           const_cast<uint8_t*>(lease.data), lease.ldp, j0);
    DS4_GPU_CHECK_LAUNCH("x_planes_kernel");
    g_prep_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return lease;
}

void build_expert_parts(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part, int32_t* sorted_pairs,
                        ExpertPart* parts, int32_t* n_parts, Stream stream) {
  if (max_part < 1 || max_part > kMaxPartCols) throw std::invalid_argument("build_expert_parts: max_part must be 1..8");
  if (n_pairs < 0 || n_expert < 1 || n_expert > 4096)
    throw std::invalid_argument("build_expert_parts: need n_pairs >= 0 and 1..4096 experts");
  // The warps' count table where it keeps the block within the 48 KB every device gives without
  // asking (up to ~1,000 experts); above that the walk (matvec_prepare raised the limit for 4096
  // experts' 51 KB).
  matvec_prepare();
  const bool warp_counts = build_parts_smem(n_expert, kPartsThreads, true) <= 48 * 1024;
  const size_t smem = static_cast<size_t>(build_parts_smem(n_expert, kPartsThreads, warp_counts));
  launch(build_parts_kernel, 1, kPartsThreads, smem, static_cast<cudaStream_t>(stream),
      pair_expert, n_pairs, n_expert, max_part, sorted_pairs, reinterpret_cast<ExpertPartDev*>(parts), n_parts,
      warp_counts);
  DS4_GPU_CHECK_LAUNCH("build_parts_kernel");
}

bool router_route(const TensorView& W, const float* X, int n, int64_t ldx, float* logits, bool hash,
                  const int32_t* tid2eid, const int32_t* tokens, const float* bias, int k, bool norm, float scale,
                  int32_t* ids, float* weights, int max_part, int32_t* sorted_pairs, ExpertPart* parts,
                  int32_t* n_parts, uint32_t* done, Stream stream) {
  const int64_t rows = W.ne[1];
  if (n < 1 || n > kRouterMaxCols || rows < 1 || rows > kRouterMaxExperts) return false;
  if (W.type != DType::F16 && W.type != DType::BF16 && W.type != DType::F32) return false;
  if (max_part < 1 || max_part > kMaxPartCols) throw std::invalid_argument("router_route: max_part must be 1..8");
  const int64_t units = check_weights(W, "GPU router");
  check_activations(X, ldx, "GPU router");
  const RouteArgs ra = route_args(static_cast<int>(rows), k, hash, tid2eid, tokens, bias, norm, scale, ids, weights);
  auto* pd = reinterpret_cast<ExpertPartDev*>(parts);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (W.type) {
    case DType::F16:
      launch_router_route_nc<kF16>(W, units, X, ldx, logits, ra, n, max_part, sorted_pairs, pd, n_parts, done, s);
      break;
    case DType::BF16:
      launch_router_route_nc<kBF16>(W, units, X, ldx, logits, ra, n, max_part, sorted_pairs, pd, n_parts, done, s);
      break;
    default:
      launch_router_route_nc<kF32>(W, units, X, ldx, logits, ra, n, max_part, sorted_pairs, pd, n_parts, done, s);
      break;
  }
  DS4_GPU_CHECK_LAUNCH("router_route_kernel");
  return true;
}

void set_matvec_chunked(bool on) { g_chunked.store(on ? 1 : 0, std::memory_order_relaxed); }

void set_matvec_persistent(bool on) { g_persistent.store(on ? 1 : 0, std::memory_order_relaxed); }

bool tall_takes(int64_t rows, int64_t k) { return rows >= kTallRows && k >= tall_min_k_now(); }

void set_matvec_tall_min_k(int64_t k) {
  g_tall_min_k.store(k >= 0 ? static_cast<int>(std::min<int64_t>(k, 1 << 30)) : -1, std::memory_order_relaxed);
}

int64_t matvec_tall_min_k() { return tall_min_k_now(); }

void set_matvec_staged_min_rows(int64_t rows) {
  if (rows != -1 && rows < 1)
    throw std::invalid_argument("staged kernel's fewest rows: 1 or more (-1: the rule, 512 or 256 for 16 columns)");
  g_staged_min_rows.store(rows < 0 ? 0 : rows, std::memory_order_relaxed);
}

int64_t matvec_staged_min_rows() { return g_staged_min_rows.load(std::memory_order_relaxed); }

void set_matvec_grouped(int variant, int stages, int width) {
  if (variant < kGroupedPass5 || variant > kGroupedOwnFast)
    throw std::invalid_argument("set_matvec_grouped: variant must be 0 (pass 5), 1 (own body) or 2 (own body, one-fma decode)");
  if (stages != 0 && stages != -1 && (stages < 2 || stages > kGroupedMaxStages))
    throw std::invalid_argument("set_matvec_grouped: stages must be 2.." + std::to_string(kGroupedMaxStages) +
                                " (0: keep, -1: the default)");
  if (width != 0 && width != -1 && width != 1 && width != 2 && width != 4 && width != 8)
    throw std::invalid_argument("set_matvec_grouped: width must be 1, 2, 4 or 8 (0: keep, -1: the default)");
  g_grouped.store(variant, std::memory_order_relaxed);
  if (stages != 0) g_grouped_stages.store(stages, std::memory_order_relaxed);
  if (width != 0) g_grouped_width.store(width, std::memory_order_relaxed);
}

bool cuda_sm90() {
#if defined(DS4_CUDA)
  static const bool ok = [] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  return ok;
#else
  return false;
#endif
}

namespace {

// Programmatic dependent launch (launch.cuh): on where the device has it (cuda_sm90), unless
// DS4_GPU_PDL=0 or set_pdl(false). -1: not decided yet.
std::atomic<int> g_pdl{-1};

}  // namespace

bool pdl_on() { return env_switch(g_pdl, "DS4_GPU_PDL", cuda_sm90()); }

void set_pdl(bool on) { g_pdl.store(on && cuda_sm90() ? 1 : 0, std::memory_order_relaxed); }

int matvec_settings_key() {
  // bits 0 chunked, 1-2 variant, 3-5 stages (2..4), 6-9 width (4 or 8), 10 fusion (matvec_fused.h),
  // 11 tensor cores; with them on, their launch choices (mma_matvec.cuh's MmaConfig, the same bits
  // but a different speed, so an A/B under graphs measures what it names): 12-13 slices, 14 wide,
  // 15 wide passes of 8 n-tiles, 16 K-slice partials added in the kernel (else by a fold launch);
  // 17 programmatic dependent launch (launch.cuh: graph edges, the same bits); 18 the direct
  // kernel's persistent grid; 19-28 the tensor cores' stage shapes (below); 29 the tall kernel's two
  // chunk stages; 30 the integer Q8_0 products (xplanes.cuh).
  int key = (chunked_on() ? 1 : 0) | grouped_variant_now() << 1 | grouped_stages_now() << 3 |
            grouped_width_now() << 6 | (matvec_fuse() ? 1 : 0) << 10 | (pdl_on() ? 1 : 0) << 17 |
            (persistent_on() ? 1 : 0) << 18 | (tall_stages_now() == 2 ? 1 : 0) << 29 | (int8_on() ? 1 : 0) << 30;
  if (mma_on()) {
    // Phase 5's stage shapes (MMA.md): stream and stream_cols take 0, 1, 2, 4 or 8 (3 bits as
    // their log2 + 1), stream_blocks 0..3, group_tiles 0..2.
    const MmaConfig c = mma_config();
    auto code = [](int v) { return v <= 0 ? 0 : v == 1 ? 1 : v == 2 ? 2 : v == 4 ? 3 : 4; };
    key |= 1 << 11 | (c.slices & 3) << 12 | (c.wide ? 1 : 0) << 14 | (c.wide_nt >= 8 ? 1 : 0) << 15 |
           (c.fold_inline ? 1 : 0) << 16 | code(c.stream) << 19 | (c.stream_blocks & 3) << 22 |
           code(c.stream_cols) << 24 | (c.group_tiles & 3) << 27;
  }
  return key;
}

namespace detail {
int64_t matvec_check_weights(const TensorView& W, const char* who) { return check_weights(W, who); }
void matvec_check_activations(const float* X, int64_t ldx, const char* who) { check_activations(X, ldx, who); }
bool matvec_chunked_on() { return chunked_on(); }
int matvec_staged_pieces(const TensorView& W, int nc, int staged_min) { return staged_pieces(W, nc, staged_min); }
}  // namespace detail

int matvec_grouped_variant() { return grouped_variant_now(); }
int matvec_grouped_stages() { return grouped_stages_now(); }
int matvec_grouped_width() { return grouped_width_now(); }
int matvec_grouped_groups() { return grouped_groups_now(); }

void set_matvec_grouped_groups(int groups) {
  if (groups < -1 || groups > kGroupedMaxGroups)
    throw std::invalid_argument("set_matvec_grouped_groups: groups must be 1.." + std::to_string(kGroupedMaxGroups) +
                                " (0: chosen per launch; -1: DS4_GPU_MV_GROUPED_GROUPS or 0)");
  g_grouped_groups.store(groups, std::memory_order_relaxed);
}

int64_t device_resident_blocks(const void* fn, int threads, size_t smem) {
  static std::mutex m;
  static std::map<std::tuple<const void*, int, size_t>, int64_t> known;
  const std::lock_guard<std::mutex> lock(m);
  const auto key = std::make_tuple(fn, threads, smem);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = 0;
  }
  return known[key] = static_cast<int64_t>(per_sm) * std::max(device_sms(), 1);
}

int grouped_own_groups(int64_t rows, int64_t block_rows, int max_parts, int64_t resident) {
  const int set = grouped_groups_now();
  if (set > 0) return set;
  // Chosen per launch. First, the fewest row groups (up to 4) whose grid fits in one wave of
  // resident blocks: every warp starts at once and no second, partial wave trails the first (pass
  // 18, flash-l4 at C=1, 6 parts: 3 groups, 516 blocks of the 660 that fit, against 2 groups' 768
  // blocks in 1.16 waves: +2.6%).
  for (int g = 1; g <= 4 && resident > 0; ++g)
    if ((rows + g * block_rows - 1) / (g * block_rows) * max_parts <= resident) return g;
  // Else 4 row groups a warp, halved while the launch would have fewer than 4 blocks an SM (pass
  // 14, flash-l4 on the H200, 4-column body: 4 gave C = 2-8 +4-10%).
  const int64_t blocks = (rows + block_rows - 1) / block_rows * max_parts;
  const int64_t least = 4 * static_cast<int64_t>(std::max(device_sms(), 1));
  int g = 4;
  while (g > 1 && (blocks + g - 1) / g < least) g /= 2;
  return g;
}

void matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, Stream stream, int max_cols, int64_t x_rows) {
  if (!matvec_uses_mma(W)) {
    matvec_grouped(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, stream, max_cols,
                   MatvecScratch{}, x_rows);
    return;
  }
  with_module_scratch(matvec_grouped_scratch_bytes(W, max_parts), stream, [&](const MatvecScratch& scratch) {
    matvec_grouped(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, stream, max_cols, scratch,
                   x_rows);
  });
}

void matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, Stream stream, int max_cols, const MatvecScratch& scratch, int64_t x_rows) {
  const int64_t units = check_weights(W, "GPU grouped matvec");
  check_activations(X, ldx, "GPU grouped matvec");
  if (max_parts < 0 || max_parts > 65535) throw std::invalid_argument("GPU grouped matvec: max_parts must be 0..65535");
  if (max_parts == 0 || W.ne[1] == 0) return;
  if (matvec_uses_mma(W)) {  // every pair bit-identical to mma_matvec of its expert on its column alone
    mma_matvec_grouped(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, stream, max_cols,
                       scratch.data, scratch.bytes);
    return;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The own kernel's and the tensor cores' integer products read X's planes, made here for the x_rows
  // rows of X (unknown x_rows: matvec_grouped_kernel builds them lane by lane, the same bytes).
  PlanesLease lease;
  GroupedPlanes gp;
  const bool own = own_takes(W, units);
  if (planes_for(W) && x_rows > 0 && (own || imma_q4k_takes(W, max_parts))) {
    lease = prepare_planes(X, ldx, 0, static_cast<int>(x_rows), 1, W.ne[0], scratch, s);
    // Steps of many rows on the integer tensor cores where they serve, at any k-slice count: the same
    // bits (imma_q4k.cu).
    if (imma_q4k_grouped(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, lease.data, lease.ldp, Y, ldy, s))
      return;
    if (own) gp = GroupedPlanes{lease.data, lease.ldp};
  }
  switch (W.type) {
    case DType::F32: launch_grouped<kF32>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    case DType::F16: launch_grouped<kF16>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    case DType::BF16: launch_grouped<kBF16>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    case DType::Q8_0: launch_grouped<kQ8_0>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    case DType::Q4_K: launch_grouped<kQ4_K>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    case DType::MXFP4: launch_grouped<kMXFP4>(W, units, parts, n_parts, max_parts, max_cols, sorted_pairs, x_row, X, ldx, Y, ldy, s, gp); break;
    default: throw std::invalid_argument("GPU grouped matvec: unsupported weight type");
  }
  DS4_GPU_CHECK_LAUNCH("matvec_grouped_kernel");
}

}  // namespace ds4::gpu
