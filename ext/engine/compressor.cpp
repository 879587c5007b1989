// KV compressor update and emission (spec §4.4).
#include "compressor.h"

#include <algorithm>
#include <cstring>

#include "ops.h"

namespace ds4 {

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
  for (int ch = 0; ch < c; ++ch) {
    auto col = [&](int r) { return static_cast<int64_t>(r) * w + ((overlap && r >= m) ? c + ch : ch); };
    float mx = st.score[col(0)];
    for (int r = 1; r < n_cand; ++r) mx = std::max(mx, st.score[col(r)]);
    float den = 0.0f, num = 0.0f;
    for (int r = 0; r < n_cand; ++r) {
      const float e = std::exp(st.score[col(r)] - mx);  // exp(-inf) = 0: absent candidates
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
