// The small per-lane operations of a DS4 step on the GPU, each the CPU operation of
// ext/engine/ops.cpp / attention.cpp with a fixed, lane-local order of arithmetic (a lane's
// result never depends on the other lanes of the launch).
//
// rms_norm        one block (256 threads) per row; sum of squares in double (strided per thread,
//                 16 loads in flight, then the butterfly and a fixed 8-warp tree); y = (x * r) * w
//                 as the CPU rounds it. Bytes: 8 per element (read x, write y) + 4 for w.
// embed_rows      one block (128 threads) per token: the row is decoded with matvec.cuh's units,
//                 so every value equals the CPU dequantizer's. Bytes: one row in, 4 * K out a copy.
// rope_tail       one block (128 threads) per row: cos/sin of pos * inv_freq in double, rounded
//                 once to float (as RopeTable::init), then x0*c - x1*s, x0*s + x1*c per pair.
//                 Bytes: 8 per rotated element.
// attention_sink  the engine's split attention (rowops.cuh) over gathered rows: a split kernel,
//                 grid (head groups of 4 or 2, splits, lanes) x 256 threads, then a combine kernel,
//                 grid (heads, lanes) x 128 threads. Each lane's keys are cut by its own count only
//                 (at most 8 splits of at least 64 keys). Bytes: the lane's key rows per head group
//                 (from L2 after the first), partials 4 * (head_dim + 2) per (lane, head, split).
//                 Allocates the partials for the call and synchronizes (a testing entry point).
// argmax_rows     two launches: grid (splits, rows) x 256 threads, each block the best (value, index)
//                 of its split of the row into the work area (argmax_split_kernel), then a warp a row
//                 picks the best of the row's splits (argmax_final_kernel). First index on ties, NaN
//                 largest (numpy's argmax); the order is total, so the splits change no result.
//                 (Pass 16: one 1024-thread block a row took 22 us for the LM head's 129280 logits,
//                 on every greedy decode step's critical path.) Bytes: 4 per element, 8 a split.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "ds4_gpu.h"
#include "launch.cuh"
#include "matvec.cuh"
#include "rowops.cuh"
#include "step_ops.h"

namespace ds4::gpu {

namespace {

// --- RMSNorm ----------------------------------------------------------------------------------

constexpr int kNormThreads = 256;

__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(const float* __restrict__ X, int64_t ldx, const float* __restrict__ w, float* __restrict__ Y,
                    int64_t ldy, int64_t n, float eps, uint8_t* __restrict__ planes, int64_t ldp) {
  ds4_grid_begin();
  __shared__ double part[kNormThreads / DS4_WARP];
  __shared__ float r_shared;
  const float* x = X + static_cast<int64_t>(blockIdx.x) * ldx;
  float* y = Y + static_cast<int64_t>(blockIdx.x) * ldy;
  double ss = strided_sumsq(x, n, static_cast<int>(threadIdx.x), kNormThreads);  // loads batched, same order
  ss = warp_sum(ss);
  if (threadIdx.x % DS4_WARP == 0) part[threadIdx.x / DS4_WARP] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    const double t = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    r_shared = static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(eps)));
  }
  __syncthreads();
  const float r = r_shared;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) y[i] = w ? (x[i] * r) * w[i] : x[i] * r;
  if (planes != nullptr) {  // the integer products' planes of the row (xplanes.cuh)
    __syncthreads();
    unit_planes_of_row(y, n, planes + static_cast<int64_t>(blockIdx.x) * ldp);
  }
}
static_assert(kNormThreads / DS4_WARP == 8, "rms_norm's final tree is written for 8 warps");

// --- embedding --------------------------------------------------------------------------------

// A block a token: its row into `copies` consecutive rows of Y's row (the mHC streams: the step's first
// kernel writes all of them, where a second launch had copied stream 0 to the others).
template <int T>
__global__ void __launch_bounds__(128)
    embed_kernel(const uint8_t* __restrict__ E, int64_t row_bytes, int64_t units, int64_t n_vocab,
                 const int32_t* __restrict__ tokens, float* __restrict__ Y, int64_t ldy, int copies) {
  ds4_grid_begin();
  using U = Unit<T>;
  const int32_t tok = tokens[blockIdx.x];
  const int64_t K = units * U::kElems;
  float* y = Y + static_cast<int64_t>(blockIdx.x) * ldy;
  if (tok < 0 || tok >= n_vocab) {  // a bad id never reads outside the table: the row becomes NaN
    for (int64_t i = threadIdx.x; i < copies * K; i += blockDim.x) y[i] = __int_as_float(0x7fc00000);
    return;
  }
  const uint8_t* row = E + static_cast<int64_t>(tok) * row_bytes;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    typename U::Raw raw;
    U::load(raw, row, u);
#pragma unroll
    for (int g = 0; g < U::kGroups; ++g) {
      float w[4];
      U::decode(raw, g, w);
      const int64_t k = U::k_of(u, g);
      for (int c = 0; c < copies; ++c) {
        float* yc = y + c * K + k;
        yc[0] = w[0];
        yc[1] = w[1];
        yc[2] = w[2];
        yc[3] = w[3];
      }
    }
  }
}

// --- tail RoPE --------------------------------------------------------------------------------

constexpr int kMaxRopeHalf = 256;

__global__ void __launch_bounds__(128)
    rope_tail_kernel(float* __restrict__ X, int n_heads, int64_t row_stride, int head_dim, int rope_dim,
                     const int32_t* __restrict__ pos, const double* __restrict__ inv_freq, int inverse) {
  ds4_grid_begin();
  __shared__ float cs[kMaxRopeHalf], sn[kMaxRopeHalf];
  const int half = rope_dim / 2;
  const double p = static_cast<double>(pos[blockIdx.x]);
  for (int k = threadIdx.x; k < half; k += blockDim.x) {
    double s, c;
    sincos(p * inv_freq[k], &s, &c);
    cs[k] = static_cast<float>(c);
    sn[k] = inverse ? -static_cast<float>(s) : static_cast<float>(s);
  }
  __syncthreads();
  float* row = X + static_cast<int64_t>(blockIdx.x) * row_stride + (head_dim - rope_dim);
  for (int i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
    const int h = i / half, k = i % half;
    float* t = row + static_cast<int64_t>(h) * head_dim + 2 * k;
    const float x0 = t[0], x1 = t[1];
    t[0] = x0 * cs[k] - x1 * sn[k];
    t[1] = x0 * sn[k] + x1 * cs[k];
  }
}

// --- attention with the sink column -------------------------------------------------------------

// grid (head groups, splits bound, lanes): one split of one lane's gathered keys for HB heads,
// the same block arithmetic as the engine's paged attention (rowops.cuh).
template <int HB>
__global__ void __launch_bounds__(kAttnThreads)
    attention_sink_split_kernel(const float* __restrict__ q, const uint16_t* __restrict__ kv,
                                const int32_t* __restrict__ key_rows, const int32_t* __restrict__ key_off, int n_head,
                                int head_dim, float scale, int max_keys, int cap, int lo, float* __restrict__ po,
                                float* __restrict__ pst) {
  ds4_grid_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  const uint16_t** kp = reinterpret_cast<const uint16_t**>(smem);
  float* lg = reinterpret_cast<float*>(smem + sizeof(void*) * cap);
  const int li = static_cast<int>(blockIdx.z), c = static_cast<int>(blockIdx.y);
  const int h0 = static_cast<int>(blockIdx.x) * HB, nh = min(HB, n_head - h0);
  const int j0 = key_off[li];
  const int n = min(key_off[li + 1] - j0, max_keys);  // the launcher's bound keeps shared memory safe
  if (c >= attn_splits(n, lo)) return;
  const int chunk = attn_split_keys(n, lo), first = j0 + c * chunk, nk = min(chunk, n - c * chunk);
  for (int j = static_cast<int>(threadIdx.x); j < nk; j += kAttnThreads)
    kp[j] = kv + static_cast<int64_t>(key_rows[first + j]) * head_dim;
  const int64_t head = static_cast<int64_t>(li) * n_head + h0;
  attn_split_block<HB>(kp, nk, lg, cap, q + head * head_dim, head_dim, nh, scale,
                       po + (head * kAttnMaxSplits + c) * head_dim, pst + (head * kAttnMaxSplits + c) * 2);
}

// grid (heads, lanes): the splits merged with the sink (no RoPE here).
__global__ void __launch_bounds__(kAttnCombineThreads)
    attention_sink_combine_kernel(const int32_t* __restrict__ key_off, int n_head, int head_dim,
                                  const float* __restrict__ sinks, int max_keys, int lo, const float* __restrict__ po,
                                  const float* __restrict__ pst, float* __restrict__ out) {
  ds4_grid_begin();
  const int h = static_cast<int>(blockIdx.x), li = static_cast<int>(blockIdx.y);
  const int n = min(key_off[li + 1] - key_off[li], max_keys);
  const int64_t head = static_cast<int64_t>(li) * n_head + h;
  attn_combine_head(po + head * kAttnMaxSplits * head_dim, pst + head * kAttnMaxSplits * 2, attn_splits(n, lo),
                    sinks[h], head_dim, head_dim / 2, nullptr, nullptr, out + head * head_dim);
}

// --- argmax -------------------------------------------------------------------------------------

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxSplitElems = 2048;  // the least elements a split (unless kArgmaxMaxSplits splits)

// Whether (a, ia) comes before (b, ib): larger value, NaN largest, then the smaller index.
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
  const bool an = isnan(a), bn = isnan(b);
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}

// The warp's best (value, index) by the butterfly, in every lane (the order is total: any pairing
// gives the same result).
__device__ __forceinline__ void warp_best(float& v, int& idx) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    const float ov = ds4_shfl_xor(v, m);
    const int oi = ds4_shfl_xor(idx, m);
    if (better(ov, oi, v, idx)) {
      v = ov;
      idx = oi;
    }
  }
}

// The best (value, index) of x[i] for i in [i0, i1): thread t takes i0 + t, i0 + t + blockDim.x, ...
// (four loads in flight), then the warps' butterflies and warp 0 over their results.
__device__ __forceinline__ void argmax_block(const float* __restrict__ x, int64_t i0, int64_t i1, float* v_out,
                                             int* i_out) {
  __shared__ float bv[kArgmaxThreads / DS4_WARP];
  __shared__ int bi[kArgmaxThreads / DS4_WARP];
  float v = -INFINITY;
  int idx = 0x7fffffff;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += 4 * kArgmaxThreads) {
    float xs[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) xs[q] = i + q * kArgmaxThreads < i1 ? x[i + q * kArgmaxThreads] : -INFINITY;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t j = i + q * kArgmaxThreads;
      if (j < i1 && better(xs[q], static_cast<int>(j), v, idx)) {
        v = xs[q];
        idx = static_cast<int>(j);
      }
    }
  }
  warp_best(v, idx);
  if (threadIdx.x % DS4_WARP == 0) {
    bv[threadIdx.x / DS4_WARP] = v;
    bi[threadIdx.x / DS4_WARP] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / DS4_WARP; ++w)
      if (better(bv[w], bi[w], v, idx)) {
        v = bv[w];
        idx = bi[w];
      }
    *v_out = v;
    *i_out = idx;
  }
}

// Block (s, r): the best of split s of row r into the work area (values, then indices, splits apart).
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_split_kernel(const float* __restrict__ X, int64_t ldx, int64_t n, int64_t split, float* __restrict__ wv,
                        int* __restrict__ wi) {
  ds4_grid_begin();
  const int64_t s = blockIdx.x, r = blockIdx.y;
  const int64_t i0 = s * split, i1 = i0 + split < n ? i0 + split : n;
  argmax_block(X + r * ldx, i0, i1, wv + r * gridDim.x + s, wi + r * gridDim.x + s);
}

// Warp r: the best of row r's splits (lane l holds splits l, l + 32, ...), into out[r].
__global__ void __launch_bounds__(DS4_WARP)
    argmax_final_kernel(const float* __restrict__ wv, const int* __restrict__ wi, int splits,
                        int32_t* __restrict__ out) {
  ds4_grid_begin();
  const int64_t r = blockIdx.x;
  float v = -INFINITY;
  int idx = 0x7fffffff;
  for (int s = static_cast<int>(threadIdx.x); s < splits; s += DS4_WARP)
    if (better(wv[r * splits + s], wi[r * splits + s], v, idx)) {
      v = wv[r * splits + s];
      idx = wi[r * splits + s];
    }
  warp_best(v, idx);
  if (threadIdx.x == 0) out[r] = idx;
}

int smem_optin_limit() {
  int dev = 0, bytes = 0;
  DS4_GPU_CHECK(cudaGetDevice(&dev));
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return bytes;
}

template <int HB>
void launch_attention(const float* q, const uint16_t* kv, const int32_t* key_rows, const int32_t* key_off, int n_lanes,
                      int n_head, int head_dim, int max_keys, int cap, int lo, int splits, float* po, float* pst,
                      size_t smem, cudaStream_t s) {
  if (smem > 48 * 1024)
    DS4_GPU_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&attention_sink_split_kernel<HB>),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const dim3 grid(static_cast<unsigned>((n_head + HB - 1) / HB), static_cast<unsigned>(splits),
                  static_cast<unsigned>(n_lanes));
  launch(attention_sink_split_kernel<HB>, grid, kAttnThreads, smem, s, q, kv, key_rows, key_off, n_head, head_dim, scale,
                                                                   max_keys, cap, lo, po, pst);
}

}  // namespace

void rms_norm(const float* X, int64_t ldx, const float* w, float* Y, int64_t ldy, int n_rows, int64_t n, float eps,
              Stream stream, uint8_t* planes, int64_t ldp) {
  if (n_rows < 0 || n <= 0) throw std::invalid_argument("GPU rms_norm: need n_rows >= 0 and n > 0");
  if (planes != nullptr && n % 32 != 0) throw std::invalid_argument("GPU rms_norm: planes need n % 32 == 0");
  if (n_rows == 0) return;
  launch(rms_norm_kernel, n_rows, kNormThreads, 0, static_cast<cudaStream_t>(stream), X, ldx, w, Y, ldy, n, eps,
         planes, ldp);
  DS4_GPU_CHECK_LAUNCH("rms_norm_kernel");
}

void embed_rows(const TensorView& E, const int32_t* tokens, int n, float* Y, int64_t ldy, Stream stream, int copies) {
  if (n < 0) throw std::invalid_argument("GPU embed_rows: negative token count");
  const int64_t K = E.ne[0];
  if (copies < 1 || copies * K > ldy)
    throw std::invalid_argument("GPU embed_rows: " + std::to_string(copies) + " copies of a " + std::to_string(K) +
                                "-wide row do not fit rows " + std::to_string(ldy) + " apart");
  const int64_t need = E.type == DType::Q4_K ? 256 : (E.type == DType::Q8_0 || E.type == DType::MXFP4) ? 32 : 8;
  if (K % need != 0)
    throw std::invalid_argument("GPU embed_rows: row width " + std::to_string(K) + " of a " + dtype_name(E.type) +
                                " table is not a multiple of " + std::to_string(need));
  if (n == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t rb = E.row_bytes(), rows = E.ne[1];
  auto go = [&](auto kernel, int64_t units) {
    launch(kernel, n, 128, 0, s, E.data, rb, units, rows, tokens, Y, ldy, copies);
  };
  switch (E.type) {
    case DType::F32: go(embed_kernel<kF32>, K / 8); break;
    case DType::F16: go(embed_kernel<kF16>, K / 8); break;
    case DType::BF16: go(embed_kernel<kBF16>, K / 8); break;
    case DType::Q8_0: go(embed_kernel<kQ8_0>, K / 32); break;
    case DType::Q4_K: go(embed_kernel<kQ4_K>, K / 32); break;
    case DType::MXFP4: go(embed_kernel<kMXFP4>, K / 32); break;
    default: throw std::invalid_argument(std::string("GPU embed_rows: unsupported table type ") + dtype_name(E.type));
  }
  DS4_GPU_CHECK_LAUNCH("embed_kernel");
}

void rope_tail(float* X, int n_rows, int n_heads, int64_t row_stride, int head_dim, int rope_dim, const int32_t* pos,
               const double* inv_freq, bool inverse, Stream stream) {
  if (rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > head_dim || rope_dim / 2 > kMaxRopeHalf)
    throw std::invalid_argument("GPU rope_tail: rope_dim must be even, positive, at most head_dim and 512");
  if (n_rows <= 0 || n_heads <= 0) return;
  launch(rope_tail_kernel, n_rows, 128, 0, static_cast<cudaStream_t>(stream), X, n_heads, row_stride, head_dim, rope_dim,
                                                                          pos, inv_freq, inverse ? 1 : 0);
  DS4_GPU_CHECK_LAUNCH("rope_tail_kernel");
}

void attention_sink(const float* q, const uint16_t* kv, const int32_t* key_rows, const int32_t* key_off, int n_lanes,
                    int n_head, int head_dim, const float* sinks, int max_keys, float* out, Stream stream) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kAttnMaxDim)
    throw std::invalid_argument("GPU attention: head_dim must be a multiple of 8, at most 512");
  if (max_keys < 0 || n_head <= 0) throw std::invalid_argument("GPU attention: bad max_keys or n_head");
  if (n_lanes <= 0) return;
  const int limit = smem_optin_limit();
  const int bound = std::max(max_keys, 1);
  const int lo = attn_split_min();  // the engine's settings (step_ops.h), so tests see its rules
  const int cap = attn_split_keys(bound, lo), splits = attn_splits(bound, lo);
  auto need = [&](int hb) { return static_cast<size_t>(cap) * (sizeof(void*) + hb * sizeof(float)); };
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The split partials live for this call only (the engine's paged attention has them in its scratch).
  const size_t o_floats = static_cast<size_t>(n_lanes) * n_head * kAttnMaxSplits * head_dim;
  const size_t part_bytes = (o_floats + static_cast<size_t>(n_lanes) * n_head * kAttnMaxSplits * 2) * sizeof(float);
  float* part = nullptr;
  DS4_GPU_CHECK(cudaMalloc(&part, part_bytes));
  float* pst = part + o_floats;
  cudaError_t err = cudaSuccess;
  try {
    auto run = [&](auto heads) {
      constexpr int HB = decltype(heads)::value;
      launch_attention<HB>(q, kv, key_rows, key_off, n_lanes, n_head, head_dim, max_keys, cap, lo, splits, part, pst,
                           need(HB), s);
    };
    switch (attn_heads_that_fit(n_lanes, n_head, [&](int hb) { return need(hb) <= static_cast<size_t>(limit); })) {
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 1: run(std::integral_constant<int, 1>{}); break;
      default:
        throw std::invalid_argument("GPU attention: " + std::to_string(max_keys) +
                                    " keys per lane do not fit this device's shared memory");
    }
    DS4_GPU_CHECK_LAUNCH("attention_sink_split_kernel");
    const dim3 grid(static_cast<unsigned>(n_head), static_cast<unsigned>(n_lanes));
    launch(attention_sink_combine_kernel, grid, kAttnCombineThreads, 0, s, key_off, n_head, head_dim, sinks, max_keys,
           lo, part, pst, out);
    DS4_GPU_CHECK_LAUNCH("attention_sink_combine_kernel");
    err = cudaStreamSynchronize(s);
  } catch (...) {
    (void)cudaStreamSynchronize(s);
    (void)cudaFree(part);
    throw;
  }
  (void)cudaFree(part);
  check(err, "attention_sink");
}

void argmax_rows(const float* X, int64_t ldx, int n_rows, int64_t n, int32_t* out, void* work, Stream stream) {
  if (n <= 0 || n > 0x7fffffff) throw std::invalid_argument("GPU argmax: need 0 < n < 2^31");
  if (n_rows <= 0) return;
  if (n_rows > 65535) throw std::invalid_argument("GPU argmax: at most 65535 rows a call");
  const int64_t splits = std::min<int64_t>(kArgmaxMaxSplits, (n + kArgmaxSplitElems - 1) / kArgmaxSplitElems);
  const int64_t split = (n + splits - 1) / splits;
  float* wv = static_cast<float*>(work);
  int* wi = reinterpret_cast<int*>(wv + static_cast<int64_t>(n_rows) * splits);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(n_rows));
  launch(argmax_split_kernel, grid, kArgmaxThreads, 0, s, X, ldx, n, split, wv, wi);
  DS4_GPU_CHECK_LAUNCH("argmax_split_kernel");
  launch(argmax_final_kernel, n_rows, DS4_WARP, 0, s, wv, wi, static_cast<int>(splits), out);
  DS4_GPU_CHECK_LAUNCH("argmax_final_kernel");
}

}  // namespace ds4::gpu
