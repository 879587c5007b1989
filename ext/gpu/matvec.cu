// Launchers of the weight-reuse matrix-vector kernels (matvec.cuh): the dense product for any
// column count (16-column chunks, each chunk one kernel specialised for its width), the
// device-side planner that groups (expert, pair) routes into parts of up to 8 pairs, and the
// expert-grouped product over those parts.
//
// build_expert_parts: one block; per pair, its rank in the stable sort by expert is
// (pairs with a smaller expert) + (earlier pairs with the same expert), so the plan is the same
// on every run and needs no ordered atomics (the histogram's atomics only count).
// Bytes: 4 * n_pairs in, 4 * n_pairs + 12 * parts out; O(n_pairs^2) compares, negligible below a
// few thousand pairs.
#include <algorithm>
#include <string>

#include "ds4_gpu.h"
#include "matvec.cuh"

namespace ds4::gpu {

static_assert(sizeof(ExpertPart) == sizeof(ExpertPartDev), "ExpertPart and ExpertPartDev must share a layout");

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

// Types the tall variant is built for: the tall dense matrices of DS4 GGUFs (q_b, the LM head)
// are Q8_0, or F16/BF16 in unquantized files. The others never take it (instantiating it for
// them would only add compile time).
template <int T>
constexpr bool kTallType = T == kQ8_0 || T == kF16 || T == kBF16;

template <int T, int NC>
void launch_dense_nc(const TensorView& W, int64_t units, const float* X, int64_t ldx, float* Y, int64_t ldy,
                     bool tall, cudaStream_t s) {
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  if constexpr (kTallType<T>) {
    if (tall && rows >= kTallRows) {
      const int64_t br = 2 * matvec_block_rows(NC, ks);
      matvec_dense_kernel<T, NC, true><<<static_cast<unsigned>((rows + br - 1) / br), kMatvecThreads, 0, s>>>(
          W.data, W.row_bytes(), rows, units, ks, X, ldx, Y, ldy);
      return;
    }
  }
  const int64_t br = matvec_block_rows(NC, ks);
  matvec_dense_kernel<T, NC, false><<<static_cast<unsigned>((rows + br - 1) / br), kMatvecThreads, 0, s>>>(
      W.data, W.row_bytes(), rows, units, ks, X, ldx, Y, ldy);
}

template <int T>
void launch_dense(const TensorView& W, int64_t units, const float* X, int nc, int64_t ldx, float* Y, int64_t ldy,
                  bool tall, cudaStream_t s) {
  switch (nc) {
    case 1: launch_dense_nc<T, 1>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 2: launch_dense_nc<T, 2>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 3: launch_dense_nc<T, 3>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 4: launch_dense_nc<T, 4>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 5: launch_dense_nc<T, 5>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 6: launch_dense_nc<T, 6>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 7: launch_dense_nc<T, 7>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 8: launch_dense_nc<T, 8>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 9: launch_dense_nc<T, 9>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 10: launch_dense_nc<T, 10>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 11: launch_dense_nc<T, 11>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 12: launch_dense_nc<T, 12>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 13: launch_dense_nc<T, 13>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 14: launch_dense_nc<T, 14>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 15: launch_dense_nc<T, 15>(W, units, X, ldx, Y, ldy, tall, s); break;
    case 16: launch_dense_nc<T, 16>(W, units, X, ldx, Y, ldy, tall, s); break;
    default: throw std::invalid_argument("GPU matvec: a chunk has 1..16 columns");
  }
}

template <int T>
void launch_grouped(const TensorView& W, int64_t units, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, cudaStream_t s) {
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  // Sized for the narrowest block (most blocks); wider parts leave their extra blocks idle.
  const int64_t block_rows = std::min(matvec_block_rows(1, ks), matvec_block_rows(kMaxPartCols, ks));
  const dim3 grid(static_cast<unsigned>((rows + block_rows - 1) / block_rows), static_cast<unsigned>(max_parts));
  matvec_grouped_kernel<T><<<grid, kMatvecThreads, 0, s>>>(
      W.data, W.row_bytes() * rows, W.row_bytes(), rows, units, ks, reinterpret_cast<const ExpertPartDev*>(parts),
      n_parts, sorted_pairs, x_row, X, ldx, Y, ldy);
}

__global__ void build_parts_kernel(const int32_t* __restrict__ pair_expert, int n_pairs, int n_expert, int max_part,
                                   int32_t* __restrict__ sorted, ExpertPartDev* __restrict__ parts,
                                   int32_t* __restrict__ n_parts) {
  extern __shared__ int32_t sm[];
  int32_t* cnt = sm;                  // [n_expert] pairs per expert
  int32_t* less = sm + n_expert;      // [n_expert] pairs with a smaller expert
  int32_t* pbefore = less + n_expert;  // [n_expert] parts of smaller experts
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
    const int e = pair_expert[p];
    if (e >= 0 && e < n_expert) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t below = 0, pb = 0;
    for (int e = 0; e < n_expert; ++e) {
      less[e] = below;
      pbefore[e] = pb;
      below += cnt[e];
      pb += (cnt[e] + max_part - 1) / max_part;
    }
    *n_parts = pb;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
    const int e = pair_expert[p];
    if (e < 0 || e >= n_expert) continue;  // an invalid route is left out of every part
    int before = 0;
    for (int q = 0; q < p; ++q) before += pair_expert[q] == e;
    const int rank = less[e] + before;
    sorted[rank] = p;
    if (before % max_part == 0) {
      ExpertPartDev pt;
      pt.expert = e;
      pt.first = rank;
      pt.count = min(max_part, cnt[e] - before);
      parts[pbefore[e] + before / max_part] = pt;
    }
  }
}

}  // namespace

void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
            bool tall) {
  if (ncols < 0) throw std::invalid_argument("GPU matvec: negative column count");
  const int64_t units = check_weights(W, "GPU matvec");
  check_activations(X, ldx, "GPU matvec");
  if (ncols == 0 || W.ne[1] == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Wider products run as 16-column chunks: each column is still single-column arithmetic.
  for (int c0 = 0; c0 < ncols; c0 += kMaxCols) {
    const int nc = std::min(kMaxCols, ncols - c0);
    const float* Xc = X + static_cast<int64_t>(c0) * ldx;
    float* Yc = Y + static_cast<int64_t>(c0) * ldy;
    switch (W.type) {
      case DType::F32: launch_dense<kF32>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      case DType::F16: launch_dense<kF16>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      case DType::BF16: launch_dense<kBF16>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      case DType::Q8_0: launch_dense<kQ8_0>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      case DType::Q4_K: launch_dense<kQ4_K>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      case DType::MXFP4: launch_dense<kMXFP4>(W, units, Xc, nc, ldx, Yc, ldy, tall, s); break;
      default: throw std::invalid_argument("GPU matvec: unsupported weight type");
    }
    DS4_GPU_CHECK_LAUNCH("matvec_dense_kernel");
  }
}

void build_expert_parts(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part, int32_t* sorted_pairs,
                        ExpertPart* parts, int32_t* n_parts, Stream stream) {
  if (max_part < 1 || max_part > kMaxPartCols) throw std::invalid_argument("build_expert_parts: max_part must be 1..8");
  if (n_pairs < 0 || n_expert < 1 || n_expert > 4096)
    throw std::invalid_argument("build_expert_parts: need n_pairs >= 0 and 1..4096 experts");
  const size_t smem = 3 * static_cast<size_t>(n_expert) * sizeof(int32_t);
  build_parts_kernel<<<1, 256, smem, static_cast<cudaStream_t>(stream)>>>(
      pair_expert, n_pairs, n_expert, max_part, sorted_pairs, reinterpret_cast<ExpertPartDev*>(parts), n_parts);
  DS4_GPU_CHECK_LAUNCH("build_parts_kernel");
}

void matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, Stream stream) {
  const int64_t units = check_weights(W, "GPU grouped matvec");
  check_activations(X, ldx, "GPU grouped matvec");
  if (max_parts < 0 || max_parts > 65535) throw std::invalid_argument("GPU grouped matvec: max_parts must be 0..65535");
  if (max_parts == 0 || W.ne[1] == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (W.type) {
    case DType::F32: launch_grouped<kF32>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    case DType::F16: launch_grouped<kF16>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    case DType::BF16: launch_grouped<kBF16>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    case DType::Q8_0: launch_grouped<kQ8_0>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    case DType::Q4_K: launch_grouped<kQ4_K>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    case DType::MXFP4: launch_grouped<kMXFP4>(W, units, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s); break;
    default: throw std::invalid_argument("GPU grouped matvec: unsupported weight type");
  }
  DS4_GPU_CHECK_LAUNCH("matvec_grouped_kernel");
}

}  // namespace ds4::gpu
