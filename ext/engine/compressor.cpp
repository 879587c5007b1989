// KV compressor update and emission (spec §4.4).
#include "compressor.h"

#include <algorithm>
#include <cstring>

#include <immintrin.h>

#include "dispatch.h"
#include "ops.h"

namespace ds4 {

namespace {

// The pooling loop of compressor_push for channels [0, returned), 8 or 16 channels a register:
// per channel the same max (std::max's rule: (v > m) ? v : m, as max_ps with v first), exps,
// sums in candidate order (product, then add) and division: the same bits as the scalar loop.
// Candidate r of channel ch lives at column ch of its state row (CSA's current half: c + ch), so
// consecutive channels are consecutive floats.
#define DS4_POOL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DS4_POOL_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

inline const float* cand_row(const float* base, int r, int m, int w, int c, bool overlap) {
  return base + static_cast<int64_t>(r) * w + ((overlap && r >= m) ? c : 0);
}

DS4_POOL_AVX2 int pool_channels_avx2(const CompressorState& st, int m, int c, int n_cand, bool overlap, float* out) {
  auto score = [&](int r, int ch) DS4_POOL_AVX2 {
    return _mm256_loadu_ps(cand_row(st.score, r, m, st.width, c, overlap) + ch);
  };
  auto kv = [&](int r, int ch) DS4_POOL_AVX2 {
    return _mm256_loadu_ps(cand_row(st.kv, r, m, st.width, c, overlap) + ch);
  };
  int ch = 0;
  for (; ch + 8 <= c; ch += 8) {
    __m256 mx = score(0, ch);
    for (int r = 1; r < n_cand; ++r) mx = _mm256_max_ps(score(r, ch), mx);
    __m256 den = _mm256_setzero_ps(), num = _mm256_setzero_ps();
    for (int r = 0; r < n_cand; ++r) {
      const __m256 e = exp_exact_avx2(_mm256_sub_ps(score(r, ch), mx));
      den = _mm256_add_ps(den, e);
      num = _mm256_add_ps(num, _mm256_mul_ps(e, kv(r, ch)));
    }
    _mm256_storeu_ps(out + ch, _mm256_div_ps(num, den));
  }
  return ch;
}

DS4_POOL_AVX512 int pool_channels_avx512(const CompressorState& st, int m, int c, int n_cand, bool overlap,
                                         float* out) {
  auto score = [&](int r, int ch) DS4_POOL_AVX512 {
    return _mm512_loadu_ps(cand_row(st.score, r, m, st.width, c, overlap) + ch);
  };
  auto kv = [&](int r, int ch) DS4_POOL_AVX512 {
    return _mm512_loadu_ps(cand_row(st.kv, r, m, st.width, c, overlap) + ch);
  };
  int ch = 0;
  for (; ch + 16 <= c; ch += 16) {
    __m512 mx = score(0, ch);
    for (int r = 1; r < n_cand; ++r) mx = _mm512_max_ps(score(r, ch), mx);
    __m512 den = _mm512_setzero_ps(), num = _mm512_setzero_ps();
    for (int r = 0; r < n_cand; ++r) {
      const __m512 e = exp_exact_avx512(_mm512_sub_ps(score(r, ch), mx));
      den = _mm512_add_ps(den, e);
      num = _mm512_add_ps(num, _mm512_mul_ps(e, kv(r, ch)));
    }
    _mm512_storeu_ps(out + ch, _mm512_div_ps(num, den));
  }
  return ch;
}

}  // namespace

bool compressor_push(const CompressorState& st, int ratio, int c, const float* k, const float* z, int64_t t,
                     float* out) {
  const int m = ratio;
  const int w = st.width;
  const bool overlap = (ratio == 4);
  const int row = (overlap ? m : 0) + static_cast<int>(t % m);
  std::memcpy(st.kv + static_cast<int64_t>(row) * w, k, sizeof(float) * w);
  std::memcpy(st.score + static_cast<int64_t>(row) * w, z, sizeof(float) * w);
  if ((t + 1) % m != 0) return false;

  // Candidates per channel: (state row, column). CSA: m previous rows at column ch, then m
  // current rows at column c + ch; HCA: the m rows at column ch. Fixed order, so the pooled row
  // is a function of this slot's tokens only.
  const int n_cand = overlap ? 2 * m : m;
  int ch = 0;
  if (cpu::avx512_enabled()) {
    ch = pool_channels_avx512(st, m, c, n_cand, overlap, out);
  } else if (use_avx2()) {
    ch = pool_channels_avx2(st, m, c, n_cand, overlap, out);
  }
  for (; ch < c; ++ch) {
    auto col = [&](int r) { return static_cast<int64_t>(r) * w + ((overlap && r >= m) ? c + ch : ch); };
    float mx = st.score[col(0)];
    for (int r = 1; r < n_cand; ++r) mx = std::max(mx, st.score[col(r)]);
    float den = 0.0f, num = 0.0f;
    for (int r = 0; r < n_cand; ++r) {
      const float e = exp_exact(st.score[col(r)] - mx);  // exp(-inf) = 0: absent candidates
      den += e;
      num += e * st.kv[col(r)];
    }
    out[ch] = num / den;
  }
  if (overlap) {
    // The current block becomes the next block's previous half.
    std::memcpy(st.kv, st.kv + static_cast<int64_t>(m) * w, sizeof(float) * m * w);
    std::memcpy(st.score, st.score + static_cast<int64_t>(m) * w, sizeof(float) * m * w);
  }
  return true;
}

void finish_compressed_row(float* row, int c, const float* norm, float eps, const double* inv_freq, int rope_dim,
                           int64_t pos, RowQat qat, uint16_t* dst) {
  rms_norm(row, norm, row, c, eps);
  RopeTable rope;
  rope.init(inv_freq, rope_dim / 2, pos);
  rope.apply(row + (c - rope_dim), false);
  if (qat == RowQat::Fp8) {
    fp8_round_trip(row, c - rope_dim);
  } else if (qat == RowQat::HadamardFp4) {
    hadamard(row, c);
    fp4_round_trip(row, c);
  }
  f32_to_f16_row(row, dst, c);
}

}  // namespace ds4
