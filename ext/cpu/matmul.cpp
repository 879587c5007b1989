// Weight-reuse matrix products: Y[c][r] = sum_k W[r][k] * X[c][k] for 1..N activation columns.
//
// Per row, the weights are decoded one group of kGroup (256) elements at a time into an L1
// buffer, and that group is applied to every column before the next group is decoded: a weight
// block is read and dequantized once per step, not once per column.
//
// Exactness: each column owns 32 fp32 accumulator lanes; element k of the row is accumulated
// into lane k % 32, in increasing k, and the lanes are reduced by one fixed tree at the end of
// the row. Nothing in that sequence depends on ncols, on how columns are tiled, or on how rows
// are split between threads, so every column is bit-identical to a single-column call.
// Scalar path: acc += w * x (two roundings). AVX2 path: acc = fma(w, x, acc) (one rounding).
//
// Work per call: rows x cols weight elements read once; ncols x rows x cols multiply-adds.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dispatch.h"

#define DS4_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ds4 {
namespace cpu {

bool path_supported(SimdPath p) {
  if (p == SimdPath::Scalar) return true;
  __builtin_cpu_init();
  // libgcc only reports AVX features when the OS saves the YMM state (XGETBV), so this is enough.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

const char* path_name(SimdPath p) { return p == SimdPath::Avx2 ? "avx2" : "scalar"; }

namespace {

SimdPath choose_path() {
  const char* env = std::getenv("DS4_SIMD");
  std::string want = env ? env : "auto";
  if (want == "scalar") return SimdPath::Scalar;
  if (want != "auto" && want != "avx2" && !want.empty())
    throw std::invalid_argument("DS4_SIMD=" + want + ": expected scalar, avx2 or auto");
  return path_supported(SimdPath::Avx2) ? SimdPath::Avx2 : SimdPath::Scalar;
}

constexpr int kLanes = 32;
constexpr int kRowBlock = 4;

// The fixed reduction tree over one column's 32 lanes; the AVX2 reduce below mirrors it exactly.
float reduce_scalar(const float* a) {
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = a[i] + a[i + 16];
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = s[i] + s[i + 8];
  float u[4];
  for (int i = 0; i < 4; ++i) u[i] = t[i] + t[i + 4];
  const float v0 = u[0] + u[2], v1 = u[1] + u[3];
  return v0 + v1;
}

DS4_AVX2 float reduce_avx2(const float* a) {
  // lanes i + (i+16), then + (i+8): same pairing as reduce_scalar.
  const __m256 s0 = _mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 16));
  const __m256 s1 = _mm256_add_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(a + 24));
  const __m256 t = _mm256_add_ps(s0, s1);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// Accumulate len (<= kGroup) decoded weights w into the lanes of one column.
void accumulate_scalar(const float* w, int64_t len, const float* x, float* acc) {
  int64_t k = 0;
  for (; k + kLanes <= len; k += kLanes)
    for (int i = 0; i < kLanes; ++i) acc[i] += w[k + i] * x[k + i];
  for (int i = 0; k + i < len; ++i) acc[i] += w[k + i] * x[k + i];
}

// T columns at once so their accumulators stay in registers (4 x T ymm + 1 weight ymm <= 16).
// Lanes past the end of a partial group get fma(0, 0, acc): w is zero-padded and x is
// mask-loaded, so the sequence is the same whatever T is.
template <int T>
DS4_AVX2 void accumulate_avx2(const float* w, int64_t len, const float* const* xs, float* const* accs) {
  __m256 a[T][4];
  for (int t = 0; t < T; ++t)
    for (int q = 0; q < 4; ++q) a[t][q] = _mm256_loadu_ps(accs[t] + 8 * q);
  int64_t k = 0;
  for (; k + kLanes <= len; k += kLanes) {
    for (int q = 0; q < 4; ++q) {
      const __m256 wq = _mm256_loadu_ps(w + k + 8 * q);
      for (int t = 0; t < T; ++t) a[t][q] = _mm256_fmadd_ps(wq, _mm256_loadu_ps(xs[t] + k + 8 * q), a[t][q]);
    }
  }
  if (k < len) {
    const int64_t rem = len - k;
    for (int q = 0; q < 4 && 8 * q < rem; ++q) {
      const int64_t m = std::min<int64_t>(8, rem - 8 * q);
      alignas(32) int32_t mask_bits[8];
      for (int i = 0; i < 8; ++i) mask_bits[i] = i < m ? -1 : 0;
      const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_bits));
      const __m256 wq = _mm256_maskload_ps(w + k + 8 * q, mask);
      for (int t = 0; t < T; ++t)
        a[t][q] = _mm256_fmadd_ps(wq, _mm256_maskload_ps(xs[t] + k + 8 * q, mask), a[t][q]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(accs[t] + 8 * q, a[t][q]);
}

DS4_AVX2 void accumulate_columns_avx2(const float* w, int64_t len, const float* X, int ncols, int64_t ldx,
                                      int64_t k0, float* acc) {
  int c = 0;
  for (; c + 3 <= ncols; c += 3) {
    const float* xs[3] = {X + c * ldx + k0, X + (c + 1) * ldx + k0, X + (c + 2) * ldx + k0};
    float* as[3] = {acc + c * kLanes, acc + (c + 1) * kLanes, acc + (c + 2) * kLanes};
    accumulate_avx2<3>(w, len, xs, as);
  }
  if (ncols - c == 2) {
    const float* xs[2] = {X + c * ldx + k0, X + (c + 1) * ldx + k0};
    float* as[2] = {acc + c * kLanes, acc + (c + 1) * kLanes};
    accumulate_avx2<2>(w, len, xs, as);
  } else if (ncols - c == 1) {
    const float* xs[1] = {X + c * ldx + k0};
    float* as[1] = {acc + c * kLanes};
    accumulate_avx2<1>(w, len, xs, as);
  }
}

void check_view(const TensorView& W, int ncols) {
  if (W.type == DType::I32) throw std::invalid_argument("matmul: I32 tensors are not weights");
  if (W.ne[0] % block_elems(W.type) != 0)
    throw std::invalid_argument(std::string("matmul: row width ") + std::to_string(W.ne[0]) + " is not a multiple of the " +
                                dtype_name(W.type) + " block");
  if (ncols < 0) throw std::invalid_argument("matmul: negative column count");
}

}  // namespace

SimdPath active_path() {
  static const SimdPath path = choose_path();
  return path;
}

void matmul_rows_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y,
                    int64_t ldy, int64_t r0, int64_t r1) {
  check_view(W, ncols);
  if (ncols == 0 || r0 >= r1) return;
  const int64_t n = W.ne[0];
  const int64_t row_bytes = W.row_bytes();
  const int64_t group_bytes = kGroup / block_elems(W.type) * block_bytes(W.type);
  // Per-thread scratch: reused across calls so the hot path does not allocate.
  thread_local std::vector<float> acc_buf;
  acc_buf.resize(static_cast<size_t>(kRowBlock) * ncols * kLanes);
  alignas(32) float wbuf[kRowBlock][kGroup];

  // kRowBlock rows advance together, group by group, so the group's slice of X (ncols x 1 KiB)
  // is loaded into L1 once for all of them instead of streaming X from L2 once per row.
  for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowBlock, r1 - rb));
    std::fill(acc_buf.begin(), acc_buf.begin() + static_cast<size_t>(nr) * ncols * kLanes, 0.0f);
    for (int64_t k0 = 0; k0 < n; k0 += kGroup) {
      const int64_t len = std::min<int64_t>(kGroup, n - k0);
      for (int i = 0; i < nr; ++i) {
        const uint8_t* src = W.data + (rb + i) * row_bytes + k0 / kGroup * group_bytes;
        const float* w = wbuf[i];
        if (W.type == DType::F32 && len == kGroup) {
          w = reinterpret_cast<const float*>(src);  // already fp32: no copy
        } else {
          decode(p, W.type, src, wbuf[i], len);
          std::fill(wbuf[i] + len, wbuf[i] + kGroup, 0.0f);
        }
        float* acc = acc_buf.data() + static_cast<size_t>(i) * ncols * kLanes;
        if (p == SimdPath::Avx2) {
          accumulate_columns_avx2(w, len, X, ncols, ldx, k0, acc);
        } else {
          for (int c = 0; c < ncols; ++c) accumulate_scalar(w, len, X + c * ldx + k0, acc + c * kLanes);
        }
      }
    }
    for (int i = 0; i < nr; ++i) {
      const float* acc = acc_buf.data() + static_cast<size_t>(i) * ncols * kLanes;
      for (int c = 0; c < ncols; ++c)
        Y[c * ldy + rb + i] = p == SimdPath::Avx2 ? reduce_avx2(acc + c * kLanes) : reduce_scalar(acc + c * kLanes);
    }
  }
}

void matmul_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
               ThreadPool& pool) {
  check_view(W, ncols);
  const int64_t rows = W.ne[1];
  if (ncols == 0 || rows == 0) return;
  // A chunk worth a thread: about 64k multiply-adds, so tiny matrices stay on one thread.
  const int64_t work_per_row = std::max<int64_t>(1, W.ne[0] * ncols);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work_per_row);
  pool.parallel_for(rows, grain, [&](int64_t r0, int64_t r1) { matmul_rows_on(p, W, X, ncols, ldx, Y, ldy, r0, r1); });
}

}  // namespace cpu

void matmul_rows(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, int64_t r0,
                 int64_t r1) {
  cpu::matmul_rows_on(cpu::active_path(), W, X, ncols, ldx, Y, ldy, r0, r1);
}

void matmul(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, ThreadPool& pool) {
  cpu::matmul_on(cpu::active_path(), W, X, ncols, ldx, Y, ldy, pool);
}

}  // namespace ds4
