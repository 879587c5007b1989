// Weight-reuse matrix products: Y[c][r] = sum_k W[r][k] * X[c][k] for 1..N activation columns.
//
// A weight block is read and decoded once per row and call, then applied to every column of a
// tile (up to 3 columns whose accumulators stay in registers): never once per column.
//
// Exactness: a column's result depends on the row and that column only. Nothing in its sequence
// of operations depends on ncols, on how columns are tiled, on how rows are split between threads
// or on which other products share a matmul_batch, so every column is bit-identical to a
// single-column call. The weights are decoded to fp32 (the values gguf.quants gives) and each
// column owns 32 fp32 accumulator lanes; element k of the row goes into lane k % 32, in
// increasing k, and the lanes are reduced by one fixed tree at the end of the row. Scalar path:
// acc += w * x (two roundings). AVX2 path: acc = fma(w, x, acc). The AVX2 path decodes 32-element
// chunks straight into registers (fused) when the row width is a multiple of 32, else it decodes
// groups of kGroup elements into an L1 buffer (buffered, which owns the zero-padded tail); the two
// are the same arithmetic, bit for bit. Where the CPU has AVX-512, the fused kernels run as
// 512-bit twins (two registers per column's 32 lanes, up to 8 columns a tile): the same bits
// again, 1.3-1.9x faster (see "AVX-512 twins" below). One exception to "decoded weights": the
// AVX2 path multiplies Q4_K's 4-bit quants by x and applies each sub-block's scale and min to
// the sums ("Q4_K, block-scaled" below); it too depends on nothing but the row and the column.
//
// Work per call: rows x cols weight elements read once; ncols x rows x cols multiply-adds.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
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
// Widest column tile of the AVX-512 kernels (2 accumulators a column in 32 registers). 256x256,
// 8 columns: one tile of 8 is 2-25% faster than 4 + 4 (Q8_0 7.9 -> 7.7 us, Q4_K 10.8 -> 7.5 us).
constexpr int kZTile = 8;
// A chunk of a batch worth a thread, in row_cost units (multiply-add equivalents): 16k (0.3-0.6
// us with the AVX-512 kernels), a few times the cost of handing it to a spinning worker; smaller
// batches stay on the calling thread. (8k and 16k measure alike at C1, 16k 1-3% better at C2-C6.
// Before row_cost, in plain multiply-adds, 8k-16k were alike and 32k-64k 2-4% worse at C1.)
constexpr int64_t kMatmulGrain = int64_t{1} << 14;

// The columns of one product, as MatmulJob describes them.
inline const float* col_x(const MatmulJob& j, int c) { return j.x(c); }
inline float* col_y(const MatmulJob& j, int c) { return j.y(c); }

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

DS4_AVX2 void accumulate_columns_avx2(const float* w, int64_t len, const MatmulJob& j, int64_t k0, float* acc) {
  int c = 0;
  for (; c + 3 <= j.ncols; c += 3) {
    const float* xs[3] = {col_x(j, c) + k0, col_x(j, c + 1) + k0, col_x(j, c + 2) + k0};
    float* as[3] = {acc + c * kLanes, acc + (c + 1) * kLanes, acc + (c + 2) * kLanes};
    accumulate_avx2<3>(w, len, xs, as);
  }
  if (j.ncols - c == 2) {
    const float* xs[2] = {col_x(j, c) + k0, col_x(j, c + 1) + k0};
    float* as[2] = {acc + c * kLanes, acc + (c + 1) * kLanes};
    accumulate_avx2<2>(w, len, xs, as);
  } else if (j.ncols - c == 1) {
    const float* xs[1] = {col_x(j, c) + k0};
    float* as[1] = {acc + c * kLanes};
    accumulate_avx2<1>(w, len, xs, as);
  }
}

// The buffered path: kRowBlock rows advance together, group by group, so the group's slice of
// the columns (ncols x 1 KiB) is loaded into L1 once for all of them.
void buffered_rows(SimdPath p, const MatmulJob& j, int64_t r0, int64_t r1) {
  const TensorView& W = j.W;
  const int ncols = j.ncols;
  const int64_t n = W.ne[0];
  const int64_t row_bytes = W.row_bytes();
  const int64_t group_bytes = kGroup / block_elems(W.type) * block_bytes(W.type);
  // Per-thread scratch: reused across calls so the hot path does not allocate.
  thread_local std::vector<float> acc_buf;
  acc_buf.resize(static_cast<size_t>(kRowBlock) * ncols * kLanes);
  alignas(32) float wbuf[kRowBlock][kGroup];
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
          accumulate_columns_avx2(w, len, j, k0, acc);
        } else {
          for (int c = 0; c < ncols; ++c) accumulate_scalar(w, len, col_x(j, c) + k0, acc + c * kLanes);
        }
      }
    }
    for (int i = 0; i < nr; ++i) {
      const float* acc = acc_buf.data() + static_cast<size_t>(i) * ncols * kLanes;
      for (int c = 0; c < ncols; ++c)
        col_y(j, c)[rb + i] = p == SimdPath::Avx2 ? reduce_avx2(acc + c * kLanes) : reduce_scalar(acc + c * kLanes);
    }
  }
}

// --- fused decode + FMA ---------------------------------------------------------------------------
// The 32-element chunks of a row are decoded straight into registers and applied to a tile of
// columns whose accumulators stay in registers for the whole row: no decode buffer, no
// accumulator reloads (measured: 1.4-1.8x the buffered path's speed at 4-16 columns, and a
// 1-column decode step of the tiny model went from 0.725 to 0.397 ms; docs/performance.md).

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

// The 8 lanes of one register: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1.
DS4_AVX2 inline float reduce8(__m256 a) {
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// --- Q4_K, block-scaled ----------------------------------------------------------------------
// The AVX2 path does not decode Q4_K weights: with w = dl_j q - ml_j on sub-block j (dl_j = d*sc_j
// and ml_j = dmin*m_j, the products quant.cpp forms), a row's dot product is
//   sum_j dl_j * (sum_k q_k x_k) - sum_j ml_j * (sum_k x_k),
// so each column owns 16 lanes for the first sum and 8 for the second, and per 32 elements the
// scale is applied once instead of building 32 weights. In order, per column and row:
//   P_j[l]  = fma(q[16+l], x[16+l], q[l] * x[l])          l = 0..15, q and x of sub-block j
//   acc[l]  = fma(P_j[l], dl_j, acc[l])                    sub-blocks in increasing j
//   macc[i] = fma(ml_{8b+i}, Sx_{8b+i}, macc[i])           i = 0..7, super-blocks in increasing b
//   y       = reduce16(acc) - reduce8(macc)
// where Sx_j is the sum of x over sub-block j in the order of subblock_sums (computed once per
// column and call), reduce8 is reduce8 above and reduce16(a) = reduce8(a[0..7] + a[8..15]). The
// 256- and 512-bit kernels run exactly this; the scalar path multiplies decoded weights instead
// (a distinct computation, as for every type). Error: w is never formed, so where dl q and ml
// cancel (w near 0) the roundings stay those of the separate terms: the error is bounded by
// multiples of u * sum |dl q x| and u * sum |ml x|, not of u * sum |w x| (worst case (J + 6)u and
// (B + 8)u of them for J sub-blocks and B super-blocks; under 1u of their total on random data).
// tests/test_native_kernels.py pins the arithmetic bit for bit to a numpy model and checks the
// error against float64. Speed, against decoded fma(dl, q, -ml) weights (matmul_rows_on,
// L2-resident 256x256, AVX-512): 1 column 15% faster, 2 columns 5%, 3 columns 1-2% slower, 4-8
// columns 3-10% faster; 256-bit kernels 1 column 15%, 2-8 columns 2-8% faster. Per 32 elements
// and column it takes 3 vector operations where decoded weights take 2, so it pays where the
// decode dominates: 4096x2048 from L3, 1-2 columns 17-20% faster, 6-8 columns 4-6% slower. The
// engine's Q4_K products are MoE experts, mostly 1-2 columns each. One accumulator: a second
// (odd sub-blocks) measured 12-17% slower at 6 columns; float(q) by a table lookup, no faster.

// Sx_j, the sum of x over each 32-element sub-block j of a row of n32 sub-blocks (a multiple of
// 8: Q4_K rows are whole 256s): s_i = x_i + x_{i+16}, t_i = s_i + s_{i+8} (i < 8), then
// ((t_0 + t_1) + (t_2 + t_3)) + ((t_4 + t_5) + (t_6 + t_7)), the last by horizontal adds across
// eight sub-blocks at once. One function for both kernel widths, so both read the same sums.
DS4_AVX2 void subblock_sums(const float* x, int64_t n32, float* sx) {
  for (int64_t j0 = 0; j0 < n32; j0 += 8) {
    __m256 t[8];
    for (int j = 0; j < 8; ++j) {
      const float* e = x + 32 * (j0 + j);
      t[j] = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(e), _mm256_loadu_ps(e + 16)),
                           _mm256_add_ps(_mm256_loadu_ps(e + 8), _mm256_loadu_ps(e + 24)));
    }
    // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7
    const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
    // g0 = (t_j0..3 sums for j = 0..3 | t_j4..7 sums for j = 0..3), g1 the same for j = 4..7
    const __m256 lo = _mm256_permute2f128_ps(g0, g1, 0x20), hi = _mm256_permute2f128_ps(g0, g1, 0x31);
    _mm256_storeu_ps(sx + j0, _mm256_add_ps(lo, hi));
  }
}

// subblock_sums of columns xs[0..T) into per-thread scratch (reused across calls): column t's at
// [t * n32, (t + 1) * n32).
const float* tile_subblock_sums(const float* const* xs, int T, int64_t n32) {
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(T) * n32);
  for (int t = 0; t < T; ++t) subblock_sums(xs[t], n32, buf.data() + t * n32);
  return buf.data();
}

// The scales and mins of one Q4_K block: dl[j] = d*sc_j stored, ml_j = dmin*m_j returned.
DS4_AVX2 inline __m256 q4k_scales(const uint8_t* blk, float dl[8]) {
  // The 8 6-bit scales and mins unpacked together, as ggml's AVX2 dot product does.
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, blk + 4, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t m_lo = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = m_lo;
  u[0] &= kmask1;  // bytes 0-7 of u: the 8 scales; bytes 8-15: the 8 mins
  const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 d = _mm256_set1_ps(half_scalar(load_u16(blk)));
  const __m256 dmin = _mm256_set1_ps(half_scalar(load_u16(blk + 2)));
  _mm256_storeu_ps(dl, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
  return _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

// The block-scaled Q4_K product for columns xs[0..T), 256-bit: acc[l] as two registers (lanes
// 0-7, 8-15). Nibble bytes 32c .. 32c + 31 hold sub-block 2c (low nibbles) and 2c + 1 (high).
template <int T>
DS4_AVX2 void q4k_rows_t(const TensorView& W, const float* const* xs, float* const* ys, int64_t r0, int64_t r1) {
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  const float* sx = tile_subblock_sums(xs, T, n32);
  const __m256i low4 = _mm256_set1_epi32(0x0f);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m256 acc[T][2], macc[T];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = macc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n32 / 8; ++b) {
      const uint8_t* blk = row + 144 * b;
      alignas(32) float dl[8];
      const __m256 ml = q4k_scales(blk, dl);
      for (int t = 0; t < T; ++t) macc[t] = _mm256_fmadd_ps(ml, _mm256_loadu_ps(sx + t * n32 + 8 * b), macc[t]);
      const uint8_t* qs = blk + 16;
      for (int c = 0; c < 4; ++c) {
        __m256i v[4];  // bytes 8i .. 8i + 7 of the 32
        for (int i = 0; i < 4; ++i)
          v[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 32 * c + 8 * i)));
        for (int h = 0; h < 2; ++h) {  // sub-block 2c + h
          __m256 q[4];
          for (int i = 0; i < 4; ++i)
            q[i] = _mm256_cvtepi32_ps(h ? _mm256_srli_epi32(v[i], 4) : _mm256_and_si256(v[i], low4));
          const __m256 dlj = _mm256_broadcast_ss(dl + 2 * c + h);
          for (int t = 0; t < T; ++t) {
            const float* x = xs[t] + 256 * b + 64 * c + 32 * h;
            const __m256 p0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
            const __m256 p1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(q[1], _mm256_loadu_ps(x + 8)));
            acc[t][0] = _mm256_fmadd_ps(p0, dlj, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(p1, dlj, acc[t][1]);
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) ys[t][r] = reduce8(_mm256_add_ps(acc[t][0], acc[t][1])) - reduce8(macc[t]);
  }
}

// Columns xs[0..T), outputs ys[t][r]: the buffered path's arithmetic, decoding in registers.
template <DType DT, int T>
DS4_AVX2 void fused_rows_t(const TensorView& W, const float* const* xs, float* const* ys, int64_t r0, int64_t r1) {
  static_assert(DT != DType::Q4_K, "Q4_K runs q4k_rows_t");
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m256 acc[T][4];
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_setzero_ps();
    for (int64_t s = 0; s < n32; ++s) {
      __m256 w[4];
      decode32<DT>(row, s, w);
      for (int t = 0; t < T; ++t) {
        const float* x = xs[t] + 32 * s;
        for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(x + 8 * q), acc[t][q]);
      }
    }
    for (int t = 0; t < T; ++t) ys[t][r] = reduce_regs(acc[t]);
  }
}

// --- AVX-512 twins of fused_rows_t / wide_rows_t ---------------------------------------------
// Where the CPU has AVX-512 (F, BW, VL, DQ), the AVX2 path runs these: the same 32 lanes per
// column as two 16-lane registers (lanes 0-15, 16-31), each element decoded to the same fp32
// value and FMA'd into the same lane in the same order, and the same reduction tree ((lanes
// 0-7 + 16-23) + (8-15 + 24-31), then the 128-bit halves ...): bit-identical to the 256-bit
// kernels, only half the instructions. 32 registers hold up to 6 columns' accumulators in one
// tile. DS4_AVX512=0 keeps the 256-bit kernels (the tests compare the two). Measured on the
// Zen 5 development machine (256x256, L2-resident, ns a call, 256-bit -> 512-bit): 1 column Q8_0
// 2647 -> 1647, Q4_K 3291 -> 2554, MXFP4 3659 -> 2404, F16 1923 -> 1254; 6 columns Q8_0 9134 ->
// 5872, Q4_K 11199 -> 6728, MXFP4 10259 -> 6173, BF16 7931 -> 4153 (Q4_K then decoded weights;
// its block-scaled kernels have the twin q4k_rows_z). (docs/performance.md records an earlier
// AVX-512 twin that gained only 2-5% a step; this one takes 21% off a C6 step.)
#define DS4_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
// GCC 12's AVX-512 intrinsics leave an unused merge operand undefined on purpose, which
// -Wmaybe-uninitialized reports at every use; nothing here is uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

}  // namespace

bool avx512_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("DS4_AVX512");
    if (env && std::string(env) == "0") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return on;
}

namespace {

// Elements [32 s, 32 s + 32) of a row as two registers (elements 0-15, 16-31), decode32's values.
template <DType DT>
DS4_AVX512 inline void decode32_z(const uint8_t* row, int64_t s, __m512 w[2]) {
  if constexpr (DT == DType::F32) {
    const float* f = reinterpret_cast<const float*>(row) + 32 * s;
    w[0] = _mm512_loadu_ps(f);
    w[1] = _mm512_loadu_ps(f + 16);
  } else if constexpr (DT == DType::F16) {
    const uint8_t* h = row + 64 * s;
    for (int i = 0; i < 2; ++i) w[i] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32 * i)));
  } else if constexpr (DT == DType::BF16) {
    const uint8_t* h = row + 64 * s;
    for (int i = 0; i < 2; ++i) {
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32 * i)));
      w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
  } else if constexpr (DT == DType::Q8_0) {
    const uint8_t* b = row + 34 * s;
    // half_scalar's value, broadcast as 16 bits and then converted (vpbroadcastw + vcvtph2ps,
    // two instructions where set1_ps(half_scalar()) takes three): 256x256, 5-8% faster at 1-8
    // columns. (The same in the 256-bit decode32 measured 2-6% slower; unrolling two blocks an
    // iteration, no faster.)
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(load_u16(b))));
    for (int i = 0; i < 2; ++i)
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * i)))), d);
  } else if constexpr (DT == DType::MXFP4) {
    // The block's 16 possible weights float(value) * d in one register, looked up by code
    // (vpermps reads only an index's low 4 bits, so the low nibbles need no mask): the products
    // the decoder forms, 4 instructions for 32 weights instead of 10. (The same lookup for Q4_K
    // weights, fmaf(dl, q, -ml) for q = 0..15, measured no faster at 1 column and slower at 4,
    // when Q4_K still decoded weights.)
    const uint8_t* b = row + 17 * s;
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))));
    const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(e8m0_half(b[0])));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)));
    w[0] = _mm512_permutexvar_ps(v, table);                         // elements 0-15: low nibbles
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);  // 16-31: high nibbles
  }
}

// reduce_regs on lanes held as two 16-lane registers.
DS4_AVX512 inline float reduce_z(__m512 a0, __m512 a1) {
  const __m512 s = _mm512_add_ps(a0, a1);  // lanes i + (i+16)
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

template <DType DT, int T>
DS4_AVX512 void z_rows_t(const TensorView& W, const float* const* xs, float* const* ys, int64_t r0, int64_t r1) {
  static_assert(DT != DType::Q4_K, "Q4_K runs q4k_rows_z");
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m512 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n32; ++s) {
      __m512 w[2];
      decode32_z<DT>(row, s, w);
      for (int t = 0; t < T; ++t) {
        const float* x = xs[t] + 32 * s;
        acc[t][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + 16), acc[t][1]);
      }
    }
    for (int t = 0; t < T; ++t) ys[t][r] = reduce_z(acc[t][0], acc[t][1]);
  }
}

// q4k_rows_t with acc[l] in one 16-lane register: 16 nibble bytes at a time, bytes 32c .. 32c + 15
// hold elements 0-15 of sub-blocks 2c (low nibbles) and 2c + 1 (high), bytes 32c + 16 .. + 31
// elements 16-31. reduce16 is reduce8 of the register's two halves added, as in q4k_rows_t.
template <int T>
DS4_AVX512 void q4k_rows_z(const TensorView& W, const float* const* xs, float* const* ys, int64_t r0, int64_t r1) {
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  const float* sx = tile_subblock_sums(xs, T, n32);
  const __m512i low4 = _mm512_set1_epi32(0x0f);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m512 acc[T];
    __m256 macc[T];
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < n32 / 8; ++b) {
      const uint8_t* blk = row + 144 * b;
      alignas(32) float dl[8];
      const __m256 ml = q4k_scales(blk, dl);
      for (int t = 0; t < T; ++t) macc[t] = _mm256_fmadd_ps(ml, _mm256_loadu_ps(sx + t * n32 + 8 * b), macc[t]);
      const uint8_t* qs = blk + 16;
      for (int c = 0; c < 4; ++c) {
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c)));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * c + 16)));
        const __m512 lo0 = _mm512_cvtepi32_ps(_mm512_and_si512(v0, low4));
        const __m512 lo1 = _mm512_cvtepi32_ps(_mm512_and_si512(v1, low4));
        const __m512 hi0 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4));
        const __m512 hi1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4));
        const __m512 dl0 = _mm512_set1_ps(dl[2 * c]), dl1 = _mm512_set1_ps(dl[2 * c + 1]);
        for (int t = 0; t < T; ++t) {
          const float* x = xs[t] + 256 * b + 64 * c;
          const __m512 plo = _mm512_fmadd_ps(lo1, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo0, _mm512_loadu_ps(x)));
          const __m512 phi = _mm512_fmadd_ps(hi1, _mm512_loadu_ps(x + 48), _mm512_mul_ps(hi0, _mm512_loadu_ps(x + 32)));
          acc[t] = _mm512_fmadd_ps(plo, dl0, acc[t]);
          acc[t] = _mm512_fmadd_ps(phi, dl1, acc[t]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1));
      ys[t][r] = reduce8(a) - reduce8(macc[t]);
    }
  }
}

#pragma GCC diagnostic pop

// f(integral_constant<T>, c) for tiles [c, c + T) covering ncols columns: as few tiles as kMax
// allows, their widths differing by at most one (6 columns at kMax 4: 3 + 3, not 4 + 2). Columns
// of a tile share one decode of each block; the width never changes a column's arithmetic.
template <int N, class F>
void tile_of_width(int width, int c, F& f) {
  if constexpr (N >= 1) {
    if (width == N)
      f(std::integral_constant<int, N>{}, c);
    else
      tile_of_width<N - 1>(width, c, f);
  }
}

template <int kMax, class F>
void for_tiles(int ncols, F&& f) {
  const int tiles = (ncols + kMax - 1) / kMax;
  for (int i = 0, c = 0; i < tiles; ++i) {
    const int width = ncols / tiles + (i < ncols % tiles ? 1 : 0);
    tile_of_width<kMax>(width, c, f);
    c += width;
  }
}

// Groups 2*half and 2*half + 1 (elements 16*half .. 16*half + 15) of chunk s of a row, decoded
// as decode32 decodes them (types other than Q4_K).
template <DType DT>
DS4_AVX2 inline void decode_half(const uint8_t* row, int64_t s, int half, __m256 w[2]) {
  if constexpr (DT == DType::F32) {
    const float* f = reinterpret_cast<const float*>(row) + 32 * s + 16 * half;
    for (int i = 0; i < 2; ++i) w[i] = _mm256_loadu_ps(f + 8 * i);
  } else if constexpr (DT == DType::F16) {
    const uint8_t* h = row + 64 * s + 32 * half;
    for (int i = 0; i < 2; ++i) w[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * i)));
  } else if constexpr (DT == DType::BF16) {
    const uint8_t* h = row + 64 * s + 32 * half;
    for (int i = 0; i < 2; ++i) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16 * i)));
      w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
  } else if constexpr (DT == DType::Q8_0) {
    const uint8_t* b = row + 34 * s;
    const __m256 d = _mm256_set1_ps(half_scalar(load_u16(b)));
    for (int i = 0; i < 2; ++i)
      w[i] = _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 16 * half + 8 * i))), d);
  } else if constexpr (DT == DType::MXFP4) {
    const uint8_t* b = row + 17 * s;
    const __m256 d = _mm256_set1_ps(e8m0_half(b[0]));
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
    if (half) raw = _mm_srli_epi16(raw, 4);  // elements 16-31: the high nibbles
    const __m128i v = _mm_shuffle_epi8(table, _mm_and_si128(raw, low4));
    w[0] = _mm256_mul_ps(i8x8_to_ps(v), d);
    w[1] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(v, 8)), d);
  }
}

// fused_rows_t for 4-6 columns, whose 4 accumulators each would not fit the 16 registers: the row
// is run twice, first for lanes 0-15 of every column, then for lanes 16-31. Each element still
// goes into lane k % 32 in increasing k and is decoded once, the same reduction follows: the same
// bits as any narrower tile, with one decode for up to 6 columns instead of one per 3.
template <DType DT, int T>
DS4_AVX2 void wide_rows_t(const TensorView& W, const float* const* xs, float* const* ys, int64_t r0, int64_t r1) {
  static_assert(DT != DType::Q4_K, "Q4_K has no decode_half");
  const int64_t n32 = W.ne[0] / 32;
  const int64_t row_bytes = W.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W.data + r * row_bytes;
    __m256 acc[2][T][2];  // [half][column][group]: lanes 16*half + 8*group .. + 7
    for (int half = 0; half < 2; ++half) {
      for (int t = 0; t < T; ++t) acc[half][t][0] = acc[half][t][1] = _mm256_setzero_ps();
      for (int64_t s = 0; s < n32; ++s) {
        __m256 w[2];
        decode_half<DT>(row, s, half, w);
        for (int t = 0; t < T; ++t) {
          const float* x = xs[t] + 32 * s + 16 * half;
          acc[half][t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc[half][t][0]);
          acc[half][t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), acc[half][t][1]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256 a[4] = {acc[0][t][0], acc[0][t][1], acc[1][t][0], acc[1][t][1]};
      ys[t][r] = reduce_regs(a);
    }
  }
}

// The same with the AVX-512 kernels, tiles of up to kZTile columns.
template <DType DT>
void run_tiles_z(const MatmulJob& j, int64_t r0, int64_t r1) {
  for_tiles<kZTile>(j.ncols, [&](auto tile, int c) {
    constexpr int T = decltype(tile)::value;
    const float* xs[T];
    float* ys[T];
    for (int t = 0; t < T; ++t) {
      xs[t] = col_x(j, c + t);
      ys[t] = col_y(j, c + t);
    }
    if constexpr (DT == DType::Q4_K)
      q4k_rows_z<T>(j.W, xs, ys, r0, r1);
    else
      z_rows_t<DT, T>(j.W, xs, ys, r0, r1);
  });
}

// The product's columns in tiles of up to kMax: 1-3 columns through fused_rows_t, 4-6 through
// wide_rows_t; or all through the AVX-512 kernels.
template <DType DT, int kMax>
void run_tiles(const MatmulJob& j, int64_t r0, int64_t r1) {
  if (avx512_enabled()) {
    run_tiles_z<DT>(j, r0, r1);
    return;
  }
  for_tiles<kMax>(j.ncols, [&](auto tile, int c) {
    constexpr int T = decltype(tile)::value;
    const float* xs[T];
    float* ys[T];
    for (int t = 0; t < T; ++t) {
      xs[t] = col_x(j, c + t);
      ys[t] = col_y(j, c + t);
    }
    if constexpr (DT == DType::Q4_K)
      q4k_rows_t<T>(j.W, xs, ys, r0, r1);
    else if constexpr (T <= 3)
      fused_rows_t<DT, T>(j.W, xs, ys, r0, r1);
    else
      wide_rows_t<DT, T>(j.W, xs, ys, r0, r1);
  });
}

// Runs the fused path when it applies (AVX2 caller, rows of whole 32s); false otherwise.
bool fused_rows(const MatmulJob& j, int64_t r0, int64_t r1) {
  if (j.W.ne[0] % 32 != 0) return false;
  switch (j.W.type) {
    // Tiles of up to 6 columns (wide_rows_t) pay for MXFP4, whose decode is the dearest: 256x256,
    // 4 columns 9.3 -> 7.4 us, 6 columns 11.7 -> 10.1 us. Not for the others: Q8_0 6 columns
    // 9.0 -> 9.5 us, F16 and BF16 4-6 columns 4-7% slower (the columns' FMAs, not the decode,
    // bound those).
    case DType::F32: run_tiles<DType::F32, 3>(j, r0, r1); return true;
    case DType::F16: run_tiles<DType::F16, 3>(j, r0, r1); return true;
    case DType::BF16: run_tiles<DType::BF16, 3>(j, r0, r1); return true;
    case DType::Q8_0: run_tiles<DType::Q8_0, 3>(j, r0, r1); return true;
    case DType::Q4_K: run_tiles<DType::Q4_K, 3>(j, r0, r1); return true;
    case DType::MXFP4: run_tiles<DType::MXFP4, 6>(j, r0, r1); return true;
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

// Rows [r0, r1) of one product (W only), on path p.
void product_rows(SimdPath p, const MatmulJob& j, int64_t r0, int64_t r1) {
  if (p == SimdPath::Avx2 && fused_rows(j, r0, r1)) return;
  buffered_rows(p, j, r0, r1);
}

// Rows [r0, r1) of a job: W, then W2 if any, then its after().
void job_rows(SimdPath p, const MatmulJob& j, int64_t r0, int64_t r1) {
  if (j.is_task()) {
    if (r0 < r1) j.after(j, r0, r1);
    return;
  }
  if (j.ncols == 0 || r0 >= r1) return;
  product_rows(p, j, r0, r1);
  if (j.W2.data) {
    MatmulJob second = j;
    second.W = j.W2;
    second.Y = j.Y2;
    second.y_cols = j.y2_cols;
    product_rows(p, second, r0, r1);
  }
  if (j.after) j.after(j, r0, r1);
}

}  // namespace

SimdPath active_path() {
  static const SimdPath path = choose_path();
  return path;
}

void matmul_rows_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y,
                    int64_t ldy, int64_t r0, int64_t r1) {
  check_view(W, ncols);
  job_rows(p, MatmulJob::product(W, ncols, X, ldx, Y, ldy), r0, r1);
}

namespace {

// The cost of one row of a product, in multiply-add equivalents, for splitting a batch evenly: a
// row costs about cols * (decode + ncols), the decode of a weight weighing 1.5 (Q8_0) to 2.5
// (MXFP4) multiply-adds. Measured, 256x256, 1-6 columns: each column adds ~650 ns a call whatever
// the type, the decode ~1000 ns for Q8_0, ~1700 for MXFP4, ~700 for F16/BF16 (AVX-512 kernels;
// the 256-bit ones have similar ratios). Q4_K weighed 3 (~1900 ns) while it decoded weights; the
// block-scaled kernels cut its fixed part from ~2.2 to ~1.2 columns' worth (1-2 columns, the
// two kernels A/B on a shared 2-core machine), so 2 now. Weighing rows by multiply-adds alone
// gave the thread holding the Q4_K experts of a 1-lane MoE batch ~30% more time than the other.
int64_t row_cost(DType t, int64_t cols, int ncols) {
  int64_t decode4;  // decode cost in quarter multiply-adds per element
  switch (t) {
    case DType::Q4_K: decode4 = 8; break;
    case DType::MXFP4: decode4 = 10; break;
    case DType::Q8_0: decode4 = 6; break;
    default: decode4 = 4; break;
  }
  return cols * (decode4 + 4 * ncols) / 4;
}

}  // namespace

void matmul_batch_on(SimdPath p, const MatmulJob* jobs, int n_jobs, ThreadPool& pool) {
  // One hand-off for all the products: the pool splits their rows, laid end to end and weighted
  // by row_cost, into chunks of about equal work (a row is never split).
  constexpr int kMaxJobs = 64;
  if (n_jobs > kMaxJobs) throw std::invalid_argument("matmul_batch: more than 64 products");
  int64_t start[kMaxJobs + 1];  // job i's work is [start[i], start[i + 1])
  int64_t per_row[kMaxJobs];
  start[0] = 0;
  for (int i = 0; i < n_jobs; ++i) {
    if (jobs[i].is_task()) {
      if (!jobs[i].after || jobs[i].task_rows < 0) throw std::invalid_argument("matmul_batch: a task needs a function");
      per_row[i] = std::max<int64_t>(1, jobs[i].task_cost);
      start[i + 1] = start[i] + jobs[i].task_rows * per_row[i];
      continue;
    }
    check_view(jobs[i].W, jobs[i].ncols);
    const bool two = jobs[i].W2.data != nullptr;
    if (two) {
      check_view(jobs[i].W2, jobs[i].ncols);
      if (jobs[i].W2.ne[0] != jobs[i].W.ne[0] || jobs[i].W2.ne[1] != jobs[i].W.ne[1])
        throw std::invalid_argument("matmul_batch: W2 must have W's shape");
    }
    per_row[i] = std::max<int64_t>(1, row_cost(jobs[i].W.type, jobs[i].W.ne[0], jobs[i].ncols) * (two ? 2 : 1));
    start[i + 1] = start[i] + (jobs[i].ncols > 0 ? jobs[i].W.ne[1] * per_row[i] : 0);
  }
  const int64_t total = start[n_jobs];
  if (total == 0) return;
  pool.parallel_for(total, kMatmulGrain, [&](int64_t b, int64_t e) {
    // Row r of job i belongs to the chunk holding the first unit of its work.
    for (int i = 0; i < n_jobs; ++i) {
      if (start[i + 1] <= b || start[i] >= e) continue;
      const int64_t rows = jobs[i].is_task() ? jobs[i].task_rows : jobs[i].W.ne[1];
      const int64_t r0 = std::clamp<int64_t>((b - start[i] + per_row[i] - 1) / per_row[i], 0, rows);
      const int64_t r1 = std::clamp<int64_t>((e - start[i] + per_row[i] - 1) / per_row[i], 0, rows);
      job_rows(p, jobs[i], r0, r1);
    }
  });
}

void matmul_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
               ThreadPool& pool) {
  const MatmulJob j = MatmulJob::product(W, ncols, X, ldx, Y, ldy);
  matmul_batch_on(p, &j, 1, pool);
}

}  // namespace cpu

void matmul_rows(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, int64_t r0,
                 int64_t r1) {
  cpu::matmul_rows_on(cpu::active_path(), W, X, ncols, ldx, Y, ldy, r0, r1);
}

void matmul(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, ThreadPool& pool) {
  cpu::matmul_on(cpu::active_path(), W, X, ncols, ldx, Y, ldy, pool);
}

void matmul_batch(const MatmulJob* jobs, int n_jobs, ThreadPool& pool) {
  cpu::matmul_batch_on(cpu::active_path(), jobs, n_jobs, pool);
}

}  // namespace ds4
