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

// --- fused decode + FMA ---------------------------------------------------------------------------
// The 32-element chunks of a row are decoded straight into registers and applied to a tile of up
// to 3 columns whose accumulators stay in registers for the whole row: no decode buffer, no
// accumulator reloads. A chunk is decoded once per tile, which costs less than storing it and
// loading it back once per column (measured: 1.4-1.8x the buffered path's speed at 4-16 columns,
// and a 1-column decode step of the tiny model went from 0.725 to 0.397 ms; docs/performance.md). The arithmetic is the buffered path's exactly (the same decoded
// values, element k into lane k % 32 in increasing k, the same reduction), so the two paths are
// interchangeable bit for bit; rows whose width is not a multiple of 32 take the buffered path,
// which owns the zero-padded tail.

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

DS4_AVX2 inline float half_scalar(uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }

DS4_AVX2 inline __m256 i8x8_to_ps(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// ggml's get_scale_min_k4 (see quant.cpp).
inline void q4k_scale_min(const uint8_t* q, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ggml_e8m0_to_fp32_half (see quant.cpp).
inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Elements [32 s, 32 s + 32) of a row, as quant.cpp's decode_avx2 computes them.
template <DType DT>
DS4_AVX2 inline void decode32(const uint8_t* row, int64_t s, __m256 w[4]) {
  if constexpr (DT == DType::F32) {
    const float* f = reinterpret_cast<const float*>(row) + 32 * s;
    for (int q = 0; q < 4; ++q) w[q] = _mm256_loadu_ps(f + 8 * q);
  } else if constexpr (DT == DType::F16) {
    const uint8_t* h = row + 64 * s;
    for (int q = 0; q < 4; ++q) w[q] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * q)));
  } else if constexpr (DT == DType::BF16) {
    const uint8_t* h = row + 64 * s;
    for (int q = 0; q < 4; ++q) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * q)));
      w[q] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
  } else if constexpr (DT == DType::Q8_0) {
    const uint8_t* b = row + 34 * s;
    const __m256 d = _mm256_set1_ps(half_scalar(load_u16(b)));
    for (int q = 0; q < 4; ++q)
      w[q] = _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * q))), d);
  } else if constexpr (DT == DType::Q4_K) {
    const uint8_t* b = row + 144 * (s / 8);
    const int j = static_cast<int>(s % 8);  // sub-block of 32 within the 256-element block
    int sc, m;
    q4k_scale_min(b + 4, j, &sc, &m);
    const __m256 dl = _mm256_set1_ps(half_scalar(load_u16(b)) * static_cast<float>(sc));
    const __m256 ml = _mm256_set1_ps(half_scalar(load_u16(b + 2)) * static_cast<float>(m));
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int q = 0; q < 4; ++q) {
      __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * q));
      if (j & 1) raw = _mm_srli_epi16(raw, 4);
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, low4)));
      w[q] = _mm256_sub_ps(_mm256_mul_ps(dl, v), ml);
    }
  } else if constexpr (DT == DType::MXFP4) {
    const uint8_t* b = row + 17 * s;
    const __m256 d = _mm256_set1_ps(e8m0_half(b[0]));
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    w[0] = _mm256_mul_ps(i8x8_to_ps(lo), d);
    w[1] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), d);
    w[2] = _mm256_mul_ps(i8x8_to_ps(hi), d);
    w[3] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), d);
  }
}

// reduce_avx2 on lanes held in registers (a[q] = lanes 8q .. 8q+7).
DS4_AVX2 inline float reduce_regs(const __m256 a[4]) {
  const __m256 t = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

template <DType DT, int T>
DS4_AVX2 void fused_rows(const TensorView& W, const float* X, int64_t ldx, float* Y, int64_t ldy, int64_t r0,
                         int64_t r1) {
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m256 acc[T][4];
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_setzero_ps();
    auto apply = [&](const __m256 w[4], int64_t s) DS4_AVX2 {
      for (int t = 0; t < T; ++t) {
        const float* x = X + t * ldx + 32 * s;
        for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x + 8 * q), acc[t][q]);
      }
    };
    if constexpr (DT == DType::Q4_K) {
      // Per 256-element block, per 32 bytes of nibbles: sub-block 2c from the low nibbles, then
      // 2c + 1 from the high ones, their scales and mins computed together (no per-chunk branch
      // on the nibble half; measured 11.6 -> 13.2 elements/ns on a 1-column 256x256 matvec).
      const __m128i low4 = _mm_set1_epi8(0x0f);
      for (int64_t b = 0; b < n32 / 8; ++b) {
        const uint8_t* blk = row + 144 * b;
        const float d = half_scalar(load_u16(blk)), dmin = half_scalar(load_u16(blk + 2));
        for (int c = 0; c < 4; ++c) {
          int sc0, m0, sc1, m1;
          q4k_scale_min(blk + 4, 2 * c, &sc0, &m0);
          q4k_scale_min(blk + 4, 2 * c + 1, &sc1, &m1);
          const __m256 dl0 = _mm256_set1_ps(d * static_cast<float>(sc0)), ml0 = _mm256_set1_ps(dmin * static_cast<float>(m0));
          const __m256 dl1 = _mm256_set1_ps(d * static_cast<float>(sc1)), ml1 = _mm256_set1_ps(dmin * static_cast<float>(m1));
          const uint8_t* qs = blk + 16 + 32 * c;
          __m256 w[4];
          for (int q = 0; q < 4; ++q) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * q));
            w[q] = _mm256_sub_ps(_mm256_mul_ps(dl0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(raw, low4)))), ml0);
          }
          apply(w, 8 * b + 2 * c);
          for (int q = 0; q < 4; ++q) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * q));
            w[q] = _mm256_sub_ps(_mm256_mul_ps(dl1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)))), ml1);
          }
          apply(w, 8 * b + 2 * c + 1);
        }
      }
    } else {
      for (int64_t s = 0; s < n32; ++s) {
        __m256 w[4];
        decode32<DT>(row, s, w);
        apply(w, s);
      }
    }
    for (int t = 0; t < T; ++t) Y[t * ldy + r] = reduce_regs(acc[t]);
  }
}

template <DType DT>
DS4_AVX2 void fused_dispatch_cols(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
                                  int64_t r0, int64_t r1) {
  // Tiles of 3 columns (the most whose accumulators fit the 16 ymm registers), then 1 or 2.
  int c = 0;
  for (; ncols - c >= 3; c += 3) fused_rows<DT, 3>(W, X + c * ldx, ldx, Y + c * ldy, ldy, r0, r1);
  if (ncols - c == 2) fused_rows<DT, 2>(W, X + c * ldx, ldx, Y + c * ldy, ldy, r0, r1);
  if (ncols - c == 1) fused_rows<DT, 1>(W, X + c * ldx, ldx, Y + c * ldy, ldy, r0, r1);
}

// Runs the fused path when it applies (AVX2 caller, rows of whole 32s); false otherwise.
bool fused_matmul_rows(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
                       int64_t r0, int64_t r1) {
  if (W.ne[0] % 32 != 0) return false;
  switch (W.type) {
    case DType::F32: fused_dispatch_cols<DType::F32>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    case DType::F16: fused_dispatch_cols<DType::F16>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    case DType::BF16: fused_dispatch_cols<DType::BF16>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    case DType::Q8_0: fused_dispatch_cols<DType::Q8_0>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    case DType::Q4_K: fused_dispatch_cols<DType::Q4_K>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    case DType::MXFP4: fused_dispatch_cols<DType::MXFP4>(W, X, ncols, ldx, Y, ldy, r0, r1); return true;
    default: return false;
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
  if (p == SimdPath::Avx2 && fused_matmul_rows(W, X, ncols, ldx, Y, ldy, r0, r1)) return;
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
  // A chunk worth a thread: 8k multiply-adds (0.4-1 us), a few times the cost of handing it to a
  // spinning worker; smaller matrices stay on the calling thread.
  const int64_t work_per_row = std::max<int64_t>(1, W.ne[0] * ncols);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 13) / work_per_row);
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
