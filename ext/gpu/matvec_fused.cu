// Launchers of the fused weight products (matvec_fused.h): matvec_multi, several products of one
// activation block in one grid (matvec.cuh's matvec_multi_kernel), and matvec_grouped_pair, the
// routed experts' gate and up products in one grid of the own grouped body with a paired store,
// optionally applying the SwiGLU as it stores (swiglu.cuh). Plus their host-buffer testing entry
// points and the fusion switch (DS4_GPU_MV_FUSE).
//
// Exactness: a fused launch computes each output with the arithmetic of the launch it replaces (the
// same matvec_blocks call for a product's row block; the same own-body slot arithmetic for a gate or
// up row), so the bits are those of the separate launches; only which block runs what changes.
// Bytes: as the launches they replace (every weight once); one launch's ramp and tail instead of
// several. With the tensor-core switch on, the products it takes leave the fused grids (matvec_multi
// runs them one by one on mma_matvec, matvec_grouped_pair declines them); the SIMT products fuse as
// before.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ds4_gpu.h"
#include "imma.h"
#include "launch.cuh"
#include "matvec.cuh"
#include "matvec_fused.h"
#include "step_ops.h"
#include "swiglu.cuh"

namespace ds4::gpu {

namespace {

std::atomic<int> g_fuse{-1};  // -1: not read from the environment yet

bool fuse_on() { return env_switch(g_fuse, "DS4_GPU_MV_FUSE"); }

int type_id(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::Q8_0: return kQ8_0;
    case DType::Q4_K: return kQ4_K;
    case DType::MXFP4: return kMXFP4;
    default: throw std::invalid_argument(std::string("GPU matvec_multi: unsupported weight type ") + dtype_name(t));
  }
}

// matvec's use_chunks for a type known at run time.
bool chunks_for(const TensorView& W, int64_t units) {
  if (!detail::matvec_chunked_on() || reinterpret_cast<uintptr_t>(W.data) % 16 != 0) return false;
  switch (W.type) {
    case DType::Q8_0: return chunk_fits<kQ8_0>(units, W.row_bytes());
    case DType::Q4_K: return chunk_fits<kQ4_K>(units, W.row_bytes());
    default: return false;
  }
}

// The types matvec's tall variant is built for (matvec.cu's kTallType).
constexpr bool tall_type(int t) { return t == kQ8_0 || t == kF16 || t == kBF16; }

// --- matvec_multi --------------------------------------------------------------------------------

template <int TA, int TB, bool TALL, int NC>
void launch_multi_nc(const MultiArgs& a, int64_t blocks, const float* X, int64_t ldx, cudaStream_t s) {
  launch(matvec_multi_kernel<TA, TB, NC, TALL>, static_cast<unsigned>(blocks), kMatvecThreads, 0, s, a, X, ldx);
}

template <int TA, int TB, bool TALL>
void launch_multi_w(int nc, const MultiArgs& a, int64_t blocks, const float* X, int64_t ldx, cudaStream_t s) {
  switch (nc) {
    case 1: launch_multi_nc<TA, TB, TALL, 1>(a, blocks, X, ldx, s); break;
    case 2: launch_multi_nc<TA, TB, TALL, 2>(a, blocks, X, ldx, s); break;
    case 3: launch_multi_nc<TA, TB, TALL, 3>(a, blocks, X, ldx, s); break;
    case 4: launch_multi_nc<TA, TB, TALL, 4>(a, blocks, X, ldx, s); break;
    case 5: launch_multi_nc<TA, TB, TALL, 5>(a, blocks, X, ldx, s); break;
    case 6: launch_multi_nc<TA, TB, TALL, 6>(a, blocks, X, ldx, s); break;
    case 7: launch_multi_nc<TA, TB, TALL, 7>(a, blocks, X, ldx, s); break;
    case 8: launch_multi_nc<TA, TB, TALL, 8>(a, blocks, X, ldx, s); break;
    default: throw std::logic_error("GPU matvec_multi: a fused launch has 1..8 columns");
  }
  static_assert(kMultiMaxCols == 8, "the switch above covers 1..kMultiMaxCols columns");
}

template <int TA, int TB>
void launch_multi_t(bool tall, int nc, const MultiArgs& a, int64_t blocks, const float* X, int64_t ldx,
                    cudaStream_t s) {
  if constexpr (tall_type(TA) && tall_type(TB)) {
    if (tall) {
      launch_multi_w<TA, TB, true>(nc, a, blocks, X, ldx, s);
      return;
    }
  }
  launch_multi_w<TA, TB, false>(nc, a, blocks, X, ldx, s);
}

// The instantiations: each type alone, and Q8_0 with F16 or BF16 (DS4's attention projections
// beside its compressor and indexer ones).
void launch_multi(int ta, int tb, bool tall, int nc, const MultiArgs& a, int64_t blocks, const float* X, int64_t ldx,
                  cudaStream_t s) {
  if (ta == tb) {
    switch (ta) {
      case kF32: launch_multi_t<kF32, kF32>(tall, nc, a, blocks, X, ldx, s); return;
      case kF16: launch_multi_t<kF16, kF16>(tall, nc, a, blocks, X, ldx, s); return;
      case kBF16: launch_multi_t<kBF16, kBF16>(tall, nc, a, blocks, X, ldx, s); return;
      case kQ8_0: launch_multi_t<kQ8_0, kQ8_0>(tall, nc, a, blocks, X, ldx, s); return;
      case kQ4_K: launch_multi_t<kQ4_K, kQ4_K>(tall, nc, a, blocks, X, ldx, s); return;
      case kMXFP4: launch_multi_t<kMXFP4, kMXFP4>(tall, nc, a, blocks, X, ldx, s); return;
      default: break;
    }
  } else if (ta == kQ8_0 && tb == kF16) {
    launch_multi_t<kQ8_0, kF16>(tall, nc, a, blocks, X, ldx, s);
    return;
  } else if (ta == kQ8_0 && tb == kBF16) {
    launch_multi_t<kQ8_0, kBF16>(tall, nc, a, blocks, X, ldx, s);
    return;
  }
  throw std::logic_error("GPU matvec_multi: no kernel for this type pair");
}

// Launches matvec makes for one product (its 16-column chunks, each direct or in staged pieces).
int matvec_launches(const TensorView& W, int ncols, int staged_min) {
  if (ncols <= 0 || W.ne[1] == 0) return 0;
  // matvec_simt: from 32 columns the whole 16-column chunks are one launch (a launch a piece).
  int n = 0, c0 = 0;
  if (ncols >= 2 * kMaxCols) {
    n += std::max(1, detail::matvec_staged_pieces(W, kMaxCols, staged_min));
    c0 = ncols / kMaxCols * kMaxCols;
  }
  for (; c0 < ncols; c0 += kMaxCols)
    n += std::max(1, detail::matvec_staged_pieces(W, std::min(kMaxCols, ncols - c0), staged_min));
  return n;
}

// Whether a product's sizes fit MultiProduct's 32-bit fields (every DS4 matrix does; 64-bit
// fields cost the kernel spills).
bool fits_descriptor(const MatvecProduct& p) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  return p.W.ne[1] <= kMax && p.W.row_bytes() <= kMax && p.ldy >= 0 && p.ldy <= kMax;
}

// One fused launch over products idx[0..m) (types ta, tb); a lone product is matvec's own launch.
// planes: X's planes for the Q8_0 products (integer products on), else null.
int launch_group(const MatvecProduct* ps, const int64_t* units, const int* idx, int m, int ta, int tb,
                 const float* X, int nc, int64_t ldx, cudaStream_t s, bool tall, int staged_min,
                 const PlanesLease& planes, const MatvecScratch& scratch) {
  if (m == 1) {
    const MatvecProduct& p = ps[idx[0]];
    detail::matvec_with_planes(p.W, X, planes.data, planes.ldp, nc, ldx, p.Y, p.ldy, s, tall, staged_min, scratch);
    return 1;
  }
  // The tall variant where matvec would give it to one of them (R never changes a result).
  bool use_tall = false;
  if (tall && tall_type(ta) && tall_type(tb))
    for (int j = 0; j < m; ++j) use_tall = use_tall || tall_takes(ps[idx[j]].W.ne[1], ps[idx[j]].W.ne[0]);
  const int R = (use_tall ? 2 : 1) * rows_per_warp(nc);
  MultiArgs a{};
  a.K = ps[idx[0]].W.ne[0];
  a.planes = planes.data;
  a.ldp = planes.ldp;
  a.n = m;
  int64_t first = 0;
  for (int j = 0; j < m; ++j) {
    const MatvecProduct& p = ps[idx[j]];
    const int64_t rows = p.W.ne[1], u = units[idx[j]];
    const int ks = matvec_kslices(rows, u);
    const int64_t br = static_cast<int64_t>(R) * (kMatvecWarps / ks);
    MultiProduct& d = a.p[j];
    d.W = p.W.data;
    d.Y = p.Y;
    d.row_bytes = static_cast<int32_t>(p.W.row_bytes());  // fits_descriptor checked these
    d.rows = static_cast<int32_t>(rows);
    d.ldy = static_cast<int32_t>(p.ldy);
    d.first_block = static_cast<int32_t>(first);
    d.ks = ks;
    d.type = type_id(p.W.type);
    d.chunked = chunks_for(p.W, u) ? 1 : 0;
    first += (rows + br - 1) / br;
    if (first > std::numeric_limits<int32_t>::max())
      throw std::invalid_argument("GPU matvec_multi: more than 2^31 row blocks in one launch");
  }
  launch_multi(ta, tb, use_tall, nc, a, first, X, ldx, s);
  DS4_GPU_CHECK_LAUNCH("matvec_multi_kernel");
  return 1;
}

// --- matvec_grouped_pair -------------------------------------------------------------------------

// The paired store of the gate/up launch: both sums of an output element, then G and U, or the
// SwiGLU of the two into G.
struct GatedStore {
  static constexpr bool kPair = true;
  float* G;
  float* U;  // null: G = swiglu(g, u)
  float limit;
  __device__ __forceinline__ void operator()(int64_t off, float g, float u) const {
    if (U != nullptr) {
      G[off] = g;
      U[off] = u;
    } else {
      G[off] = swiglu_value(g, u, limit);
    }
  }
};

template <int MAXC>
bool launch_pair_maxc(const TensorView& Wg, const TensorView& Wu, int64_t units, int ks, const ExpertPart* parts,
                      const int32_t* n_parts, int max_parts, const int32_t* sorted_pairs, const int32_t* x_row,
                      const float* X, int64_t ldx, const GatedStore& store, int64_t ldy, cudaStream_t s,
                      const PlanesLease& planes) {
  const int64_t rows = Wg.ne[1];
  const int stages = matvec_grouped_stages();
  const size_t smem = static_cast<size_t>(grouped_own_smem(MAXC, stages));
  const auto* pd = reinterpret_cast<const ExpertPartDev*>(parts);
  const int64_t expert_bytes = Wg.row_bytes() * rows;
  auto go = [&](auto kernel) {
    const int groups =
        grouped_own_groups(rows, grouped_own_block_rows(MAXC, true), max_parts,
                           device_resident_blocks(reinterpret_cast<const void*>(kernel), kMatvecThreads, smem));
    const int64_t block_rows = grouped_own_block_rows(MAXC, true) * static_cast<int64_t>(groups);
    const dim3 grid(static_cast<unsigned>((rows + block_rows - 1) / block_rows), static_cast<unsigned>(max_parts));
    launch(kernel, grid, kMatvecThreads, smem, s, Wg.data, Wu.data, expert_bytes, Wg.row_bytes(),
           static_cast<int>(rows), static_cast<int>(units), pd, n_parts, sorted_pairs, x_row, X, ldx, store, ldy,
           stages, groups, planes.data, planes.ldp);
  };
  const bool pl = planes.data != nullptr;
  if (ks == 1) {
    if (pl) go(matvec_grouped_own_kernel<MAXC, 1, false, GatedStore, true>);
    else go(matvec_grouped_own_kernel<MAXC, 1, false, GatedStore>);
  } else {
    if (pl) go(matvec_grouped_own_kernel<MAXC, 2, false, GatedStore, true>);
    else go(matvec_grouped_own_kernel<MAXC, 2, false, GatedStore>);
  }
  DS4_GPU_CHECK_LAUNCH("matvec_grouped_own_kernel (gate/up pair)");
  return true;
}

}  // namespace

void set_matvec_fuse(bool on) { g_fuse.store(on ? 1 : 0, std::memory_order_relaxed); }
bool matvec_fuse() { return fuse_on(); }

int matvec_multi(const MatvecProduct* products_in, int n_in, const float* X, int ncols, int64_t ldx,
                 Stream stream, bool tall, int staged_min, const MatvecScratch& scratch) {
  if (n_in < 0 || n_in > kMatvecMultiMax)
    throw std::invalid_argument("GPU matvec_multi: 0.." + std::to_string(kMatvecMultiMax) + " products");
  if (ncols < 0) throw std::invalid_argument("GPU matvec_multi: negative column count");
  if (n_in == 0) return 0;
  const int64_t K = products_in[0].W.ne[0];
  int64_t units_in[kMatvecMultiMax];
  for (int i = 0; i < n_in; ++i) {
    if (products_in[i].W.ne[0] != K)
      throw std::invalid_argument("GPU matvec_multi: product " + std::to_string(i) + " has rows of " +
                                  std::to_string(products_in[i].W.ne[0]) + " elements, product 0 of " +
                                  std::to_string(K) + " (one X serves them all)");
    units_in[i] = detail::matvec_check_weights(products_in[i].W, "GPU matvec_multi");
  }
  detail::matvec_check_activations(X, ldx, "GPU matvec_multi");
  if (ncols == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int launches = 0;
  // The tensor-core products first, one call each (their own arithmetic at every width; fusing
  // them is a later step); the rest, the SIMT products, fused below as before.
  MatvecProduct products[kMatvecMultiMax];
  int64_t units[kMatvecMultiMax];
  int n_products = 0;
  for (int i = 0; i < n_in; ++i) {
    const MatvecProduct& p = products_in[i];
    if (matvec_uses_mma(p.W)) {
      matvec(p.W, X, ncols, ldx, p.Y, p.ldy, stream, tall, staged_min, scratch);
      launches += p.W.ne[1] > 0 ? 1 : 0;
    } else {
      units[n_products] = units_in[i];
      products[n_products++] = p;
    }
  }
  // One set of planes of X serves every Q8_0 and Q4_K product (the integer products, xplanes.cuh).
  PlanesLease planes;
  bool any_planes = false;
  for (int i = 0; i < n_products; ++i) {
    const DType t = products[i].W.type;
    any_planes = any_planes || ((t == DType::Q8_0 || t == DType::Q4_K) && products[i].W.ne[1] > 0);
  }
  if (any_planes && int8_on()) planes = prepare_planes(X, ldx, 0, ncols, 1, K, scratch, s);
  if (!fuse_on() || ncols > kMultiMaxCols) {
    for (int i = 0; i < n_products; ++i) {
      const MatvecProduct& p = products[i];
      detail::matvec_with_planes(p.W, X, planes.data, planes.ldp, ncols, ldx, p.Y, p.ldy, stream, tall, staged_min,
                                 scratch);
      launches += matvec_launches(p.W, ncols, staged_min);
    }
    return launches;
  }
  // The products matvec would run on its direct kernel, by type (in order of first appearance);
  // the staged ones (and any too large for the descriptor) keep their launches.
  int types[kMatvecMultiMax], count[kMatvecMultiMax], members[kMatvecMultiMax][kMatvecMultiMax];
  int n_types = 0;
  for (int i = 0; i < n_products; ++i) {
    const MatvecProduct& p = products[i];
    if (p.W.ne[1] == 0) continue;
    const int pieces = detail::matvec_staged_pieces(p.W, ncols, staged_min);
    if (pieces > 0 || !fits_descriptor(p)) {
      detail::matvec_with_planes(p.W, X, planes.data, planes.ldp, ncols, ldx, p.Y, p.ldy, stream, tall, staged_min,
                                 scratch);
      launches += std::max(pieces, 1);
      continue;
    }
    const int t = type_id(p.W.type);
    int k = 0;
    while (k < n_types && types[k] != t) ++k;
    if (k == n_types) {
      types[n_types] = t;
      count[n_types++] = 0;
    }
    members[k][count[k]++] = i;
  }
  auto slot_of = [&](int t) {
    for (int k = 0; k < n_types; ++k)
      if (types[k] == t) return k;
    return -1;
  };
  // Q8_0 shares its launch with F16, else with BF16.
  const int kq = slot_of(kQ8_0);
  int kp = kq >= 0 ? slot_of(kF16) : -1;
  if (kq >= 0 && kp < 0) kp = slot_of(kBF16);
  if (kp >= 0) {
    int idx[kMatvecMultiMax];
    int m = 0;
    for (int j = 0; j < count[kq]; ++j) idx[m++] = members[kq][j];
    for (int j = 0; j < count[kp]; ++j) idx[m++] = members[kp][j];
    launches += launch_group(products, units, idx, m, kQ8_0, types[kp], X, ncols, ldx, s, tall, staged_min, planes,
                             scratch);
  }
  for (int k = 0; k < n_types; ++k) {
    if (kp >= 0 && (k == kq || k == kp)) continue;
    launches += launch_group(products, units, members[k], count[k], types[k], types[k], X, ncols, ldx, s, tall,
                             staged_min, planes, scratch);
  }
  return launches;
}

bool matvec_grouped_pair(const TensorView& Wg, const TensorView& Wu, const ExpertPart* parts, const int32_t* n_parts,
                         int max_parts, const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx,
                         float* G, float* U, int64_t ldy, float swiglu_limit, Stream stream, int max_cols,
                         int64_t x_rows, const MatvecScratch& scratch) {
  // Where matvec_grouped would run the own body (matvec.cu's launch_grouped_own_maxc): the default
  // variant, Q4_K with the chunked loads, an expert below 2^31 bytes, KS <= 2; and parts run at
  // most 4 columns wide (the pair is not built for the 8-wide own body).
  if (!fuse_on() || matvec_grouped_variant() != kGroupedOwn) return false;
  if (Wg.type != DType::Q4_K || Wu.type != DType::Q4_K) return false;
  if (matvec_uses_mma(Wg) || matvec_uses_mma(Wu)) return false;  // the tensor-core grouped product serves them
  for (int d = 0; d < 4; ++d)
    if (Wg.ne[d] != Wu.ne[d]) return false;
  const int64_t units = detail::matvec_check_weights(Wg, "GPU grouped gate/up");
  detail::matvec_check_weights(Wu, "GPU grouped gate/up");
  detail::matvec_check_activations(X, ldx, "GPU grouped gate/up");
  if (max_parts < 0 || max_parts > 65535) throw std::invalid_argument("GPU grouped gate/up: max_parts must be 0..65535");
  const int64_t rows = Wg.ne[1];
  if (max_parts == 0 || rows == 0) return false;  // nothing to fuse: the separate calls do what they do
  if (!chunks_for(Wg, units) || !chunks_for(Wu, units) || rows * Wg.row_bytes() >= (int64_t{1} << 31)) return false;
  const int ks = matvec_kslices(rows, units);
  if (ks > 2) return false;
  if (max_cols > 4 && matvec_grouped_width() >= 8) return false;
  // Steps of many rows: the gate and up products on the integer tensor cores (imma_q4k.cu), then the
  // SwiGLU kernel (the same bits as the fused store).
  if (imma_q4k_takes(Wg, max_parts)) return false;
  const GatedStore store{G, U, swiglu_limit};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The integer products read X's planes (its x_rows rows); without x_rows, decline (matvec_grouped
  // then builds them lane by lane).
  PlanesLease planes;
  if (matvec_int8()) {
    if (x_rows <= 0) return false;
    planes = prepare_planes(X, ldx, 0, static_cast<int>(x_rows), 1, Wg.ne[0], scratch, s);
  }
  max_cols = std::min(max_cols, matvec_grouped_width());  // wider parts run in pieces
  if (max_cols <= 1)
    return launch_pair_maxc<1>(Wg, Wu, units, ks, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, store, ldy, s,
                               planes);
  if (max_cols <= 2)
    return launch_pair_maxc<2>(Wg, Wu, units, ks, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, store, ldy, s,
                               planes);
  return launch_pair_maxc<4>(Wg, Wu, units, ks, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, store, ldy, s,
                             planes);
}

// --- testing: host buffers -------------------------------------------------------------------------

namespace testing {
namespace {

// A device allocation that frees itself (runtime.cu has the same for its entry points).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void download(void* host) const {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Weight views of the stack's bytes (ne[2] matrices) in device memory.
TensorView on_device(const TensorView& W, const DeviceBuffer& b) {
  TensorView d = W;
  d.data = b.as<uint8_t>();
  return d;
}

}  // namespace

int matvec_multi(const TensorView* W, int n, const float* X, int ncols, float* const* Y, bool tall, int staged_min) {
  if (n < 0 || n > kMatvecMultiMax) throw std::invalid_argument("GPU matvec_multi: 0..8 products");
  if (n == 0 || ncols <= 0) return 0;
  const int64_t K = W[0].ne[0];  // a multiple of 8 (matvec_multi checks): the columns stay 16-byte aligned
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  MatvecProduct ps[kMatvecMultiMax];
  for (int i = 0; i < n; ++i) {
    keep.push_back(std::make_unique<DeviceBuffer>(W[i].data, static_cast<size_t>(W[i].nbytes())));
    ps[i].W = on_device(W[i], *keep.back());
    keep.push_back(std::make_unique<DeviceBuffer>(static_cast<size_t>(ncols) * W[i].ne[1] * sizeof(float)));
    ps[i].Y = keep.back()->as<float>();
    ps[i].ldy = W[i].ne[1];
  }
  DeviceBuffer x(X, static_cast<size_t>(ncols) * K * sizeof(float));
  // Scratch for the tensor-core products, as the engine sizes it: the largest any of them wants.
  size_t scratch_bytes = 0;
  for (int i = 0; i < n; ++i) scratch_bytes = std::max(scratch_bytes, matvec_scratch_bytes(ps[i].W, ncols));
  DeviceBuffer scratch(scratch_bytes);
  const int launches = ds4::gpu::matvec_multi(ps, n, x.as<float>(), ncols, K, nullptr, tall, staged_min,
                                              MatvecScratch{scratch.as<float>(), scratch_bytes});
  DS4_GPU_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < n; ++i)
    keep[2 * i + 1]->download(Y[i]);
  return launches;
}

bool matvec_grouped_pair(const TensorView& Wg, const TensorView& Wu, const float* X, int64_t x_rows,
                         const int32_t* pair_expert, const int32_t* x_row, int n_pairs, int max_part, float* G,
                         float* U, bool swiglu, float swiglu_limit, int max_cols) {
  if (n_pairs <= 0) return false;
  const int64_t K = Wg.ne[0], rows = Wg.ne[1], n_expert = Wg.ne[2];
  if (Wu.ne[0] != K || Wu.ne[1] != rows || Wu.ne[2] != n_expert || Wu.type != Wg.type)
    throw std::invalid_argument("GPU grouped gate/up: the two stacks differ in type or shape");
  for (int p = 0; p < n_pairs; ++p) {
    if (pair_expert[p] < 0 || pair_expert[p] >= n_expert)
      throw std::invalid_argument("GPU grouped gate/up: pair " + std::to_string(p) + " names expert " +
                                  std::to_string(pair_expert[p]) + " of " + std::to_string(n_expert));
    if (x_row[p] < 0 || x_row[p] >= x_rows)
      throw std::invalid_argument("GPU grouped gate/up: pair " + std::to_string(p) + " reads activation row " +
                                  std::to_string(x_row[p]) + " of " + std::to_string(x_rows));
  }
  DeviceBuffer wg(Wg.data, static_cast<size_t>(Wg.nbytes())), wu(Wu.data, static_cast<size_t>(Wu.nbytes()));
  DeviceBuffer x(X, static_cast<size_t>(x_rows) * K * sizeof(float));
  DeviceBuffer pe(pair_expert, n_pairs * sizeof(int32_t)), xr(x_row, n_pairs * sizeof(int32_t));
  DeviceBuffer sorted(n_pairs * sizeof(int32_t)), parts(n_pairs * sizeof(ExpertPart)), n_parts(sizeof(int32_t));
  const size_t out_bytes = static_cast<size_t>(n_pairs) * rows * sizeof(float);
  DeviceBuffer g(out_bytes), u(out_bytes);
  const TensorView dg = on_device(Wg, wg), du = on_device(Wu, wu);
  build_expert_parts(pe.as<int32_t>(), n_pairs, static_cast<int>(n_expert), max_part, sorted.as<int32_t>(),
                     parts.as<ExpertPart>(), n_parts.as<int32_t>(), nullptr);
  const bool fused = ds4::gpu::matvec_grouped_pair(dg, du, parts.as<ExpertPart>(), n_parts.as<int32_t>(), n_pairs,
                                                   sorted.as<int32_t>(), xr.as<int32_t>(), x.as<float>(), K,
                                                   g.as<float>(), swiglu ? nullptr : u.as<float>(), rows,
                                                   swiglu_limit, nullptr, max_cols, x_rows);
  if (!fused) {  // the engine's separate launches
    ds4::gpu::matvec_grouped(dg, parts.as<ExpertPart>(), n_parts.as<int32_t>(), n_pairs, sorted.as<int32_t>(),
                             xr.as<int32_t>(), x.as<float>(), K, g.as<float>(), rows, nullptr, max_cols, x_rows);
    ds4::gpu::matvec_grouped(du, parts.as<ExpertPart>(), n_parts.as<int32_t>(), n_pairs, sorted.as<int32_t>(),
                             xr.as<int32_t>(), x.as<float>(), K, u.as<float>(), rows, nullptr, max_cols, x_rows);
    if (swiglu) ds4::gpu::swiglu(g.as<float>(), u.as<float>(), n_pairs, rows, swiglu_limit, nullptr);
  }
  DS4_GPU_CHECK(cudaDeviceSynchronize());
  g.download(G);
  if (!swiglu) u.download(U);
  return fused;
}

void swiglu(float* G, const float* U, int rows, int64_t width, float limit) {
  if (rows <= 0 || width <= 0) return;
  const size_t bytes = static_cast<size_t>(rows) * width * sizeof(float);
  DeviceBuffer g(G, bytes), u(U, bytes);
  ds4::gpu::swiglu(g.as<float>(), u.as<float>(), rows, width, limit, nullptr);
  DS4_GPU_CHECK(cudaDeviceSynchronize());
  g.download(G);
}

void set_matvec_fuse(bool on) { ds4::gpu::set_matvec_fuse(on); }

bool set_matvec_mma(bool on) {
  ds4::gpu::set_matvec_mma(on);
  return ds4::gpu::matvec_mma();
}

bool set_pdl(bool on) {
  ds4::gpu::set_pdl(on);
  return ds4::gpu::pdl_on();
}

bool set_matvec_int8(bool on) {
  ds4::gpu::set_matvec_int8(on);
  return ds4::gpu::matvec_int8();
}
bool set_planes_fused(bool on) {
  ds4::gpu::set_planes_fused(on);
  return ds4::gpu::planes_fused();
}

}  // namespace testing
}  // namespace ds4::gpu
