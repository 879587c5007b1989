// Gathered attention with the sink column and the lightning indexer's selection.
#include "attention.h"

#include <algorithm>
#include <cmath>

namespace ds4 {

namespace {

// A fixed-order dot product: 8 interleaved partial sums combined in a fixed tree. The order
// depends only on n, so every lane gets the same arithmetic.
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

}  // namespace

void attend_heads(const LaneKeys& keys, const float* q, const float* sinks, int head_dim, int rope_dim,
                  const RopeTable& rope_t, float* logits, int64_t stride, float* out, int h0, int h1) {
  const int n = keys.count();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  float kb[kMaxHeadDim];
  for (int i = 0; i < n; ++i) {
    f16_to_f32_row(keys.key(i), kb, head_dim);
    for (int h = h0; h < h1; ++h) logits[h * stride + i] = dot(q + static_cast<int64_t>(h) * head_dim, kb, head_dim) * scale;
  }
  for (int h = h0; h < h1; ++h) {
    float* l = logits + h * stride;
    float mx = sinks[h];
    for (int i = 0; i < n; ++i) mx = std::max(mx, l[i]);
    float den = std::exp(sinks[h] - mx);
    for (int i = 0; i < n; ++i) {
      l[i] = std::exp(l[i] - mx);
      den += l[i];
    }
    const float inv = 1.0f / den;
    for (int i = 0; i < n; ++i) l[i] *= inv;
    float* o = out + static_cast<int64_t>(h) * head_dim;
    for (int e = 0; e < head_dim; ++e) o[e] = 0.0f;
  }
  for (int i = 0; i < n; ++i) {
    f16_to_f32_row(keys.key(i), kb, head_dim);
    for (int h = h0; h < h1; ++h) {
      const float p = logits[h * stride + i];
      float* o = out + static_cast<int64_t>(h) * head_dim;
      for (int e = 0; e < head_dim; ++e) o[e] += p * kb[e];
    }
  }
  for (int h = h0; h < h1; ++h) rope_t.apply(out + static_cast<int64_t>(h) * head_dim + (head_dim - rope_dim), true);
}

void indexer_scores(const PagedState& state, int layer, int slot, const float* q, const float* w, int n_heads,
                    int head_dim, int64_t s0, int64_t s1, float* scores) {
  float kb[kMaxHeadDim];
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t start = s * 4;
    f16_to_f32_row(state.index_row(layer, state.page_of(slot, start / kPageTokens),
                                   static_cast<int>((start % kPageTokens) / 4)),
                   kb, head_dim);
    float acc = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      const float v = dot(q + static_cast<int64_t>(h) * head_dim, kb, head_dim);
      acc += w[h] * std::max(v, 0.0f);
    }
    scores[s] = acc;
  }
}

void indexer_topk(const float* scores, int64_t n, int64_t k, int32_t* order, int32_t* sel) {
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
  // A strict total order (score desc, then index asc): the selected set is unique.
  std::partial_sort(order, order + k, order + n, [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::copy(order, order + k, sel);
  std::sort(sel, sel + k);
}

}  // namespace ds4
