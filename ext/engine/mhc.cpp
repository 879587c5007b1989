// mHC per lane (spec §3).
#include "mhc.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"

#define DS4_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ds4 {

namespace {

// ρ = rsqrt(mean(x̂²) + eps) over the flattened hc·d state (the model's norm_eps, not hc_eps),
// from the state's sum of squares when hc_post left it (ss), else summed here.
float state_rsqrt(const HcShape& s, const float* x, const double* ss) {
  const int64_t n = s.hc * s.d;
  const double sum = ss ? *ss : sum_squares(x, n);
  return static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + s.norm_eps));
}

constexpr int kChunk = 16;  // elements of a stream done together (vectorizable inner loops)

// mix_streams and hc_post_lane below, 8 elements at a time: per element the same products and
// sums in the same order (mul then add, never fused), so the same bits (ops.h: use_avx2).
DS4_AVX2 int64_t mix_streams_avx2(int hc, int64_t d, const float* wt, const float* x, float* u) {
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < hc; ++i) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(wt[i]), _mm256_loadu_ps(x + i * d + k)));
    _mm256_storeu_ps(u + k, acc);
  }
  return k;
}

// For d a multiple of 8, stream by stream from a copy of the old state, so that the new state's
// sum of squares (sum_squares' order: four double lanes over the flat index, squares then adds)
// runs along with the products instead of as a chain of its own in the next hc_pre.
DS4_AVX2 double hc_post_avx2(int hc, int64_t d, float* x, const float* y, const float* post, const float* comb,
                             float* old) {
  std::memcpy(old, x, sizeof(float) * hc * d);
  __m256d ss = _mm256_setzero_pd();
  for (int k = 0; k < hc; ++k) {
    __m256 ck[kMaxHc];
    for (int j = 0; j < hc; ++j) ck[j] = _mm256_set1_ps(comb[j * hc + k]);
    const __m256 pk = _mm256_set1_ps(post[k]);
    for (int64_t e = 0; e < d; e += 8) {
      __m256 acc = _mm256_mul_ps(pk, _mm256_loadu_ps(y + e));
      for (int j = 0; j < hc; ++j) acc = _mm256_add_ps(acc, _mm256_mul_ps(ck[j], _mm256_loadu_ps(old + j * d + e)));
      _mm256_storeu_ps(x + k * d + e, acc);
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(acc)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1));
      ss = _mm256_add_pd(ss, _mm256_mul_pd(lo, lo));
      ss = _mm256_add_pd(ss, _mm256_mul_pd(hi, hi));
    }
  }
  alignas(32) double s[4];
  _mm256_store_pd(s, ss);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// u[k] = Σ_i wt[i]·X[i][k], summed from 0.0f in stream order for each k.
void mix_streams(int hc, int64_t d, const float* wt, const float* x, float* u) {
  int64_t done = 0;
  if (use_avx2()) done = mix_streams_avx2(hc, d, wt, x, u);
  if (done == d) return;
  x += done;
  u += done;
  const int64_t stride = d;
  d -= done;
  for (int64_t k0 = 0; k0 < d; k0 += kChunk) {
    const int m = static_cast<int>(std::min<int64_t>(kChunk, d - k0));
    float acc[kChunk] = {};
    for (int i = 0; i < hc; ++i) {
      const float* xi = x + i * stride + k0;
      for (int k = 0; k < m; ++k) acc[k] += wt[i] * xi[k];
    }
    for (int k = 0; k < m; ++k) u[k0 + k] = acc[k];
  }
}

}  // namespace

void hc_pre_lane(const HcShape& s, const HcWeights& w, const float* x, const double* ss, const float* raw, float* u,
                 float* post, float* comb) {
  const int hc = s.hc;
  const float rho = state_rsqrt(s, x, ss);
  float pre[kMaxHc];
  for (int i = 0; i < hc; ++i) pre[i] = sigmoidf(w.scale[0] * (rho * raw[i]) + w.base[i]) + s.hc_eps;
  for (int i = 0; i < hc; ++i) post[i] = 2.0f * sigmoidf(w.scale[1] * (rho * raw[hc + i]) + w.base[hc + i]);
  for (int i = 0; i < hc * hc; ++i) comb[i] = w.scale[2] * (rho * raw[2 * hc + i]) + w.base[2 * hc + i];
  mix_streams(hc, s.d, pre, x, u);
}

void hc_comb_lane(const HcShape& s, float* comb) { sinkhorn(comb, s.hc, s.iters, s.hc_eps); }

double hc_post_lane(const HcShape& s, float* x, const float* y, const float* post, const float* comb) {
  const int hc = s.hc;
  const int64_t d = s.d;
  if (use_avx2() && d % 8 == 0) {
    thread_local std::vector<float> old;  // the state before the update (a few KB a thread)
    old.resize(static_cast<size_t>(hc * d));
    return hc_post_avx2(hc, d, x, y, post, comb, old.data());
  }
  // Per element e: X[k][e] = post_k·y[e], then + comb[j][k]·X_old[j][e] for j in order. Done
  // kChunk elements at a time (old values copied first, since X is updated in place).
  float old[kMaxHc][kChunk];
  for (int64_t e0 = 0; e0 < d; e0 += kChunk) {
    const int m = static_cast<int>(std::min<int64_t>(kChunk, d - e0));
    for (int j = 0; j < hc; ++j)
      for (int e = 0; e < m; ++e) old[j][e] = x[j * d + e0 + e];
    for (int k = 0; k < hc; ++k) {
      float acc[kChunk];
      for (int e = 0; e < m; ++e) acc[e] = post[k] * y[e0 + e];
      for (int j = 0; j < hc; ++j) {
        const float c = comb[j * hc + k];
        for (int e = 0; e < m; ++e) acc[e] += c * old[j][e];
      }
      for (int e = 0; e < m; ++e) x[k * d + e0 + e] = acc[e];
    }
  }
  return sum_squares(x, hc * d);
}

void hc_head_lane(const HcShape& s, const HcWeights& w, const float* x, const double* ss, const float* raw, float* h) {
  const int hc = s.hc;
  const float rho = state_rsqrt(s, x, ss);
  float wt[kMaxHc];
  for (int i = 0; i < hc; ++i) wt[i] = sigmoidf(w.scale[0] * (rho * raw[i]) + w.base[i]) + s.hc_eps;
  mix_streams(hc, s.d, wt, x, h);
}

}  // namespace ds4
