// Small fp32 operations of the DS4 step (see ops.h for the numerics contract).
//
// The hot per-lane loops have an AVX2 twin (function-level target attributes, picked by the
// process's SIMD path, ext/cpu/dispatch.h) that performs the very same IEEE operations in the same
// order, only several elements at a time: the same bits either way. The engine's files are built
// for baseline x86-64 (the module must load on any CPU), so without a twin these run on SSE2.
#include "ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define DS4_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ds4 {

bool use_avx2() {
  // The rule of ext/cpu's SIMD path (dispatch.h), restated so that this file builds on its own
  // (tests/test_native_engine.py compiles it alone): DS4_SIMD=scalar, or a CPU without
  // AVX2+FMA+F16C, keeps every loop portable.
  static const bool avx2 = [] {
    const char* env = std::getenv("DS4_SIMD");
    if (env && std::string(env) == "scalar") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return avx2;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  // 65520 = halfway between 65504 (largest half) and 65536: ties to even go up, to infinity.
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    // Below 2^-14 the half is subnormal with unit 2^-24; scaling by 2^24 is exact in float and
    // nearbyint rounds half to even in the default rounding mode. 1024 carries into the
    // smallest normal, which is the right encoding.
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t e = (ax >> 23) - 127 + 15;
  const uint32_t mant = ax & 0x7fffffu;
  uint32_t h = (e << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

static float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // exact: m < 2^10
    return sign ? -v : v;
  }
  if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e - 15 + 127) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// All 65536 halves decoded once: attention reads every key row through this.
static const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = f16_bits_to_f32(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

float f16_to_f32(uint16_t h) { return f16_table()[h]; }

namespace {

// vcvtps2ph with round-to-nearest-even gives f32_to_f16's bits for every input but NaN, whose
// payload it keeps where f32_to_f16 sets one quiet bit: a group of 8 holding a NaN goes the
// scalar way.
DS4_AVX2 void f32_to_f16_row_avx2(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (int k = 0; k < 8; ++k) y[i + k] = f32_to_f16(x[i + k]);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  for (; i < n; ++i) y[i] = f32_to_f16(x[i]);
}

}  // namespace

void f32_to_f16_row(const float* x, uint16_t* y, int64_t n) {
  if (use_avx2()) return f32_to_f16_row_avx2(x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_f16(x[i]);
}

void f16_to_f32_row(const uint16_t* x, float* y, int64_t n) {
  const float* t = f16_table();
  for (int64_t i = 0; i < n; ++i) y[i] = t[x[i]];
}

void round_f16(float* x, int64_t n) {
  const float* t = f16_table();
  for (int64_t i = 0; i < n; ++i) x[i] = t[f32_to_f16(x[i])];
}

namespace {

// The four chains of sum_squares as the four double lanes of one register.
DS4_AVX2 double sum_squares_avx2(const float* x, int64_t n) {
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    acc = _mm256_add_pd(acc, _mm256_mul_pd(v, v));
  }
  alignas(32) double s[4];
  _mm256_store_pd(s, acc);
  for (; i < n; ++i) s[i & 3] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// y = (x * r) * w, 8 at a time.
DS4_AVX2 void scale_avx2(const float* x, float r, const float* w, float* y, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  if (w) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) y[i] = x[i] * r * w[i];
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), rv));
    for (; i < n; ++i) y[i] = x[i] * r;
  }
}

}  // namespace

double sum_squares(const float* x, int64_t n) {
  if (use_avx2()) return sum_squares_avx2(x, n);
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (; i < n; ++i) s[i & 3] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  const double ss = sum_squares(x, n);
  const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  if (use_avx2()) {
    scale_avx2(x, r, w, y, n);
  } else if (w) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r;
  }
}

void RopeTable::init(const double* inv_freq, int n_half, int64_t pos) {
  half = n_half;
  for (int k = 0; k < n_half; ++k) {
    const double a = static_cast<double>(pos) * inv_freq[k];
    c[k] = static_cast<float>(std::cos(a));
    s[k] = static_cast<float>(std::sin(a));
  }
}

void RopeTable::save(float* cs) const {
  std::memcpy(cs, c, sizeof(float) * half);
  std::memcpy(cs + half, s, sizeof(float) * half);
}

void RopeTable::load(const float* cs, int n_half) {
  half = n_half;
  std::memcpy(c, cs, sizeof(float) * half);
  std::memcpy(s, cs + half, sizeof(float) * half);
}

void RopeTable::apply(float* tail, bool inverse) const {
  for (int k = 0; k < half; ++k) {
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    const float sn = inverse ? -s[k] : s[k];
    tail[2 * k] = x0 * c[k] - x1 * sn;
    tail[2 * k + 1] = x0 * sn + x1 * c[k];
  }
}

float pow2_ceil(float r) {
  int e;
  const float m = std::frexp(r, &e);  // r = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

// Nearest e4m3fn value of a (|a| <= 448), ties to even mantissa: 3 mantissa bits, exponent
// floor 2^-6 below which the grid is the subnormal step 2^-9.
static float e4m3_round(float a) {
  const float mag = std::fabs(a);
  if (mag == 0.0f) return a;
  int e;
  std::frexp(mag, &e);
  const int ex = std::max(e - 1, -6);
  const float step = std::ldexp(1.0f, ex - 3);
  return std::copysign(std::nearbyint(mag / step) * step, a);
}

void fp8_round_trip(float* x, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) {
    float amax = 0.0f;
    for (int i = 0; i < 64; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    const float s = pow2_ceil(std::max(amax, 1e-4f) / 448.0f);
    for (int i = 0; i < 64; ++i) {
      const float q = std::min(std::max(x[b + i] / s, -448.0f), 448.0f);
      x[b + i] = e4m3_round(q) * s;
    }
  }
}

void hadamard(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t i = 0; i < n; i += 2 * len) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// Nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6} (|a| <= 6), ties to the even code: this is e2m1 with
// round-half-even on its mantissa, i.e. grid steps 0.5 below 2, 1 in [2, 4), 2 in [4, 6].
static float e2m1_round(float a) {
  const float mag = std::fabs(a);
  float q;
  if (mag < 2.0f) {
    q = std::nearbyint(mag * 2.0f) * 0.5f;
  } else if (mag < 4.0f) {
    q = std::nearbyint(mag);
  } else {
    q = std::nearbyint(mag * 0.5f) * 2.0f;
  }
  return std::copysign(q, a);
}

void fp4_round_trip(float* x, int64_t n) {
  const float floor_amax = 6.0f * std::ldexp(1.0f, -126);
  for (int64_t b = 0; b < n; b += 32) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    const float s = pow2_ceil(std::max(amax, floor_amax) / 6.0f);
    for (int i = 0; i < 32; ++i) {
      const float q = std::min(std::max(x[b + i] / s, -6.0f), 6.0f);
      x[b + i] = e2m1_round(q) * s;
    }
  }
}

namespace {

// The 4 x 4 Sinkhorn normalizations (hc_mult = 4, DS4's) on rows held in SSE registers, after the
// row softmax: each sum is still ((0 + a) + b) + c) + d in the scalar loops' order, each
// quotient the same division. Column sums add the rows; row sums add the columns of the
// transposed matrix, where the row division is done too.
DS4_AVX2 void sinkhorn4_avx2(float* c, int iters, float eps) {
  __m128 r0 = _mm_loadu_ps(c), r1 = _mm_loadu_ps(c + 4), r2 = _mm_loadu_ps(c + 8), r3 = _mm_loadu_ps(c + 12);
  const __m128 e = _mm_set1_ps(eps), zero = _mm_setzero_ps();
  auto col_normalize = [&]() DS4_AVX2 {
    const __m128 d = _mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(zero, r0), r1), r2), r3), e);
    r0 = _mm_div_ps(r0, d);
    r1 = _mm_div_ps(r1, d);
    r2 = _mm_div_ps(r2, d);
    r3 = _mm_div_ps(r3, d);
  };
  col_normalize();
  for (int it = 1; it < iters; ++it) {
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // r_k = column k: lane j holds row j's element k
    const __m128 d = _mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(_mm_add_ps(zero, r0), r1), r2), r3), e);
    r0 = _mm_div_ps(r0, d);
    r1 = _mm_div_ps(r1, d);
    r2 = _mm_div_ps(r2, d);
    r3 = _mm_div_ps(r3, d);
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    col_normalize();
  }
  _mm_storeu_ps(c, r0);
  _mm_storeu_ps(c + 4, r1);
  _mm_storeu_ps(c + 8, r2);
  _mm_storeu_ps(c + 12, r3);
}

}  // namespace

void sinkhorn(float* c, int n, int iters, float eps) {
  auto col_normalize = [&] {
    for (int k = 0; k < n; ++k) {
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += c[j * n + k];
      const float d = sum + eps;
      for (int j = 0; j < n; ++j) c[j * n + k] /= d;
    }
  };
  // Row softmax: each row minus its max, then the exps of the whole matrix at once (n = 4: two
  // AVX2 registers; x - 0 is x, so the exps are those of row[k] - mx), then the row sums in order.
  for (int j = 0; j < n; ++j) {
    float* row = c + j * n;
    float mx = row[0];
    for (int k = 1; k < n; ++k) mx = std::max(mx, row[k]);
    for (int k = 0; k < n; ++k) row[k] -= mx;
  }
  if (use_avx2())
    exp_minus_avx2(c, static_cast<int64_t>(n) * n, 0.0f);
  else
    exp_minus(c, static_cast<int64_t>(n) * n, 0.0f);
  for (int j = 0; j < n; ++j) {
    float* row = c + j * n;
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) sum += row[k];
    for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
  }
  if (n == 4 && iters >= 1 && use_avx2()) {
    sinkhorn4_avx2(c, iters, eps);
    return;
  }
  col_normalize();
  for (int it = 1; it < iters; ++it) {
    for (int j = 0; j < n; ++j) {
      float* row = c + j * n;
      float sum = 0.0f;
      for (int k = 0; k < n; ++k) sum += row[k];
      const float d = sum + eps;
      for (int k = 0; k < n; ++k) row[k] /= d;
    }
    col_normalize();
  }
}

}  // namespace ds4
