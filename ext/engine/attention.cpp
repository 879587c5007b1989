// Gathered attention with the sink column and the lightning indexer's selection.
//
// Two implementations of one arithmetic: a portable one and an AVX2+F16C one, picked by the
// process's SIMD path (ops.h: use_avx2). The AVX2 one converts key rows with F16C (exact, as
// the table is) and runs the dot products' 8 partial sums as the 8 lanes of one register, with
// the same multiply, add and final tree as the portable code, so both give the same bits. For
// head_dim a multiple of 16 it also works on 4 heads at a time (attend_heads_grouped), still
// with each element's operations in the portable order.
#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "dispatch.h"
#include "expf_exact.h"

#define DS4_AVX2 __attribute__((target("avx2,fma,f16c")))

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

// dot() with its 8 partial sums in one register: the same products and sums in the same order.
DS4_AVX2 float dot_avx2(const float* a, const float* b, int n) {
  __m256 v = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  alignas(32) float acc[8];
  _mm256_store_ps(acc, v);
  for (; i < n; ++i) acc[i & 7] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

DS4_AVX2 void f16_row_avx2(const uint16_t* x, float* y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  for (; i < n; ++i) y[i] = f16_to_f32(x[i]);
}

// o[e] += p * k[e]: one rounding for the product and one for the sum, as the portable loop.
DS4_AVX2 void axpy_avx2(float p, const float* k, float* o, int n) {
  const __m256 pv = _mm256_set1_ps(p);
  int e = 0;
  for (; e + 8 <= n; e += 8)
    _mm256_storeu_ps(o + e, _mm256_add_ps(_mm256_loadu_ps(o + e), _mm256_mul_ps(pv, _mm256_loadu_ps(k + e))));
  for (; e < n; ++e) o[e] += p * k[e];
}

struct Portable {
  static float dot(const float* a, const float* b, int n) { return ds4::dot(a, b, n); }
  static void f16_row(const uint16_t* x, float* y, int n) { f16_to_f32_row(x, y, n); }
  static void axpy(float p, const float* k, float* o, int n) {
    for (int e = 0; e < n; ++e) o[e] += p * k[e];
  }
  static void exp_minus(float* l, int n, float mx) { ds4::exp_minus(l, n, mx); }
};

struct Avx2 {
  static float dot(const float* a, const float* b, int n) { return dot_avx2(a, b, n); }
  static void f16_row(const uint16_t* x, float* y, int n) { f16_row_avx2(x, y, n); }
  static void axpy(float p, const float* k, float* o, int n) { axpy_avx2(p, k, o, n); }
  static void exp_minus(float* l, int n, float mx) {
    if (cpu::avx512_enabled())
      exp_minus_avx512(l, n, mx);
    else
      exp_minus_avx2(l, n, mx);
  }
};

template <class K>
void attend_heads_impl(const LaneKeys& keys, const float* q, const float* sinks, int head_dim, int rope_dim,
                       const RopeTable& rope_t, float* logits, int64_t stride, float* out, int h0, int h1) {
  const int n = keys.count();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  float kb[kMaxHeadDim];
  for (int i = 0; i < n; ++i) {
    K::f16_row(keys.key(i), kb, head_dim);
    for (int h = h0; h < h1; ++h) logits[h * stride + i] = K::dot(q + static_cast<int64_t>(h) * head_dim, kb, head_dim) * scale;
  }
  for (int h = h0; h < h1; ++h) {
    float* l = logits + h * stride;
    float mx = sinks[h];
    for (int i = 0; i < n; ++i) mx = std::max(mx, l[i]);
    // The exps vectorized (glibc's expf bits, expf_exact.h), then den summed in key order.
    float den = exp_exact(sinks[h] - mx);
    K::exp_minus(l, n, mx);
    for (int i = 0; i < n; ++i) den += l[i];
    const float inv = 1.0f / den;
    for (int i = 0; i < n; ++i) l[i] *= inv;
    float* o = out + static_cast<int64_t>(h) * head_dim;
    for (int e = 0; e < head_dim; ++e) o[e] = 0.0f;
  }
  for (int i = 0; i < n; ++i) {
    K::f16_row(keys.key(i), kb, head_dim);
    for (int h = h0; h < h1; ++h) K::axpy(logits[h * stride + i], kb, out + static_cast<int64_t>(h) * head_dim, head_dim);
  }
  for (int h = h0; h < h1; ++h) rope_t.apply(out + static_cast<int64_t>(h) * head_dim + (head_dim - rope_dim), true);
}

DS4_AVX2 inline __m256 half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// attend_heads_impl<Avx2> with the loops turned around, for head_dim a multiple of 16: each key
// row is converted once per group of 4 heads instead of once per head, the 4 dot products run
// side by side (each in its own register, as dot_avx2 runs one), and the output sums keep 4 heads
// x 16 elements in registers across all keys instead of loading and storing them once per key.
// Per element the operations and their order are dot_avx2's and axpy_avx2's: the same bits.
// Logits of H heads (H <= 4) starting at head hg, for all n keys.
template <int H>
DS4_AVX2 void group_logits(const uint16_t* const* rows, int n, const float* q, int hg, int head_dim, float scale,
                           float* logits, int64_t stride) {
  const float* qh[H];
  for (int h = 0; h < H; ++h) qh[h] = q + static_cast<int64_t>(hg + h) * head_dim;
  for (int i = 0; i < n; ++i) {
    const uint16_t* k = rows[i];
    __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int e = 0; e < head_dim; e += 8) {
      const __m256 kv = half8(k + e);
      for (int h = 0; h < H; ++h) v[h] = _mm256_add_ps(v[h], _mm256_mul_ps(_mm256_loadu_ps(qh[h] + e), kv));
    }
    // dot_avx2's tree ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)) for the heads at once (lane h).
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    alignas(16) float r[4];
    _mm_store_ps(r, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), _mm_set1_ps(scale)));
    for (int h = 0; h < H; ++h) logits[(hg + h) * stride + i] = r[h];
  }
}

// Outputs of H heads starting at head hg: o_h = sum over keys of p_h,i * k_i, 16 elements of the
// H heads held in registers over all keys.
template <int H>
DS4_AVX2 void group_outputs(const uint16_t* const* rows, int n, const float* logits, int64_t stride, int hg,
                            int head_dim, float* out) {
  const float* ph[H];
  for (int h = 0; h < H; ++h) ph[h] = logits + (hg + h) * stride;
  for (int e = 0; e < head_dim; e += 16) {
    __m256 o[H][2];
    for (int h = 0; h < H; ++h) o[h][0] = o[h][1] = _mm256_setzero_ps();
    for (int i = 0; i < n; ++i) {
      const __m256 k0 = half8(rows[i] + e), k1 = half8(rows[i] + e + 8);
      for (int h = 0; h < H; ++h) {
        const __m256 pv = _mm256_broadcast_ss(ph[h] + i);
        o[h][0] = _mm256_add_ps(o[h][0], _mm256_mul_ps(pv, k0));
        o[h][1] = _mm256_add_ps(o[h][1], _mm256_mul_ps(pv, k1));
      }
    }
    for (int h = 0; h < H; ++h) {
      float* oh = out + static_cast<int64_t>(hg + h) * head_dim + e;
      _mm256_storeu_ps(oh, o[h][0]);
      _mm256_storeu_ps(oh + 8, o[h][1]);
    }
  }
}

// --- AVX-512 twins (ext/cpu/dispatch.h: avx512_enabled), the same bits -------------------------
// group_logits on two keys at a time: key i in lanes 0-7 and key i+1 in lanes 8-15 of each head's
// register, the query chunk broadcast to both halves; each half then takes the 256-bit tree.
// group_outputs on 32 elements of up to 4 heads a pass, 16 per register.
#define DS4_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers (see matmul.cpp)

DS4_AVX512 inline __m512 half16_pair(const uint16_t* a, const uint16_t* b) {
  const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(h);
}

// The 4 heads' 8-lane sums of one key (registers v[0..3]) through dot_avx2's tree, times scale.
DS4_AVX512 inline void store_key_logits(const __m256 v[4], int H, float scale, float* logits, int64_t stride,
                                        int hg, int i) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  alignas(16) float r[4];
  _mm_store_ps(r, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), _mm_set1_ps(scale)));
  for (int h = 0; h < H; ++h) logits[(hg + h) * stride + i] = r[h];
}

template <int H>
DS4_AVX512 void group_logits_z(const uint16_t* const* rows, int n, const float* q, int hg, int head_dim, float scale,
                               float* logits, int64_t stride) {
  const float* qh[H];
  for (int h = 0; h < H; ++h) qh[h] = q + static_cast<int64_t>(hg + h) * head_dim;
  int i = 0;
  for (; i + 2 <= n; i += 2) {
    __m512 v[H];
    for (int h = 0; h < H; ++h) v[h] = _mm512_setzero_ps();
    for (int e = 0; e < head_dim; e += 8) {
      const __m512 kv = half16_pair(rows[i] + e, rows[i + 1] + e);
      for (int h = 0; h < H; ++h)
        v[h] = _mm512_add_ps(v[h], _mm512_mul_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(qh[h] + e)), kv));
    }
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 b[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < H; ++h) {
      a[h] = _mm512_castps512_ps256(v[h]);
      b[h] = _mm512_extractf32x8_ps(v[h], 1);
    }
    store_key_logits(a, H, scale, logits, stride, hg, i);
    store_key_logits(b, H, scale, logits, stride, hg, i + 1);
  }
  if (i < n) {  // an odd last key: one key in 256-bit registers
    __m256 v[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int e = 0; e < head_dim; e += 8) {
      const __m256 kv = half8(rows[i] + e);
      for (int h = 0; h < H; ++h) v[h] = _mm256_add_ps(v[h], _mm256_mul_ps(_mm256_loadu_ps(qh[h] + e), kv));
    }
    store_key_logits(v, H, scale, logits, stride, hg, i);
  }
}

template <int H>
DS4_AVX512 void group_outputs_z(const uint16_t* const* rows, int n, const float* logits, int64_t stride, int hg,
                                int head_dim, float* out) {
  const float* ph[H];
  for (int h = 0; h < H; ++h) ph[h] = logits + (hg + h) * stride;
  // E registers of 16 elements per head a pass over the keys: 16 accumulators whatever H, so a
  // few heads still keep 16 add chains in flight (each chain, one output element's sum over the
  // keys, is the same sequence of adds).
  constexpr int E = 16 / H;
  int e = 0;
  for (; e + 16 * E <= head_dim; e += 16 * E) {
    __m512 o[H][E];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < E; ++r) o[h][r] = _mm512_setzero_ps();
    for (int i = 0; i < n; ++i) {
      __m512 k[E];
      for (int r = 0; r < E; ++r)
        k[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + e + 16 * r)));
      for (int h = 0; h < H; ++h) {
        const __m512 pv = _mm512_set1_ps(ph[h][i]);
        for (int r = 0; r < E; ++r) o[h][r] = _mm512_add_ps(o[h][r], _mm512_mul_ps(pv, k[r]));
      }
    }
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < E; ++r) _mm512_storeu_ps(out + static_cast<int64_t>(hg + h) * head_dim + e + 16 * r, o[h][r]);
  }
  for (; e < head_dim; e += 16) {  // what is left in single registers (head_dim is a multiple of 32)
    __m512 o[H];
    for (int h = 0; h < H; ++h) o[h] = _mm512_setzero_ps();
    for (int i = 0; i < n; ++i) {
      const __m512 k0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + e)));
      for (int h = 0; h < H; ++h) o[h] = _mm512_add_ps(o[h], _mm512_mul_ps(_mm512_set1_ps(ph[h][i]), k0));
    }
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(out + static_cast<int64_t>(hg + h) * head_dim + e, o[h]);
  }
}

#pragma GCC diagnostic pop

// The sink softmax of heads [h0, h1) over n logits each, in place: the bits of the per-head loop
// in attend_heads_impl (max from the sink, exps, den summed from the sink's exp in key order, one
// reciprocal), with the heads' den chains side by side and the max taken 8 lanes at a time (a max
// does not depend on order; lanes keep std::max's rule that a NaN logit is skipped and a NaN
// sink sticks, and the sign of a zero max cannot change l - max's exp).
DS4_AVX2 void softmax_heads(float* logits, int64_t stride, const float* sinks, int n, int h0, int h1) {
  for (int hb = h0; hb < h1; hb += 4) {
    const int H = std::min(4, h1 - hb);
    float den[4];
    for (int h = 0; h < H; ++h) {
      float* l = logits + (hb + h) * stride;
      __m256 m8 = _mm256_set1_ps(sinks[hb + h]);
      int i = 0;
      for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(l + i), m8);  // (l > m) ? l : m
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m8);
      float mx = lanes[0];
      for (int k = 1; k < 8; ++k) mx = std::max(mx, lanes[k]);
      for (; i < n; ++i) mx = std::max(mx, l[i]);
      den[h] = exp_exact(sinks[hb + h] - mx);
      Avx2::exp_minus(l, n, mx);
    }
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < H; ++h) den[h] += logits[(hb + h) * stride + i];
    for (int h = 0; h < H; ++h) {
      float* l = logits + (hb + h) * stride;
      const __m256 inv = _mm256_set1_ps(1.0f / den[h]);
      int i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(l + i, _mm256_mul_ps(_mm256_loadu_ps(l + i), inv));
      for (; i < n; ++i) l[i] *= 1.0f / den[h];
    }
  }
}

DS4_AVX2 void attend_heads_grouped(const LaneKeys& keys, const float* q, const float* sinks, int head_dim,
                                   int rope_dim, const RopeTable& rope_t, float* logits, int64_t stride, float* out,
                                   int h0, int h1) {
  const int n = keys.count();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  thread_local std::vector<const uint16_t*> row_buf;
  row_buf.resize(static_cast<size_t>(n));
  const uint16_t** rows = row_buf.data();  // a plain pointer: no TLS lookup inside the loops
  for (int i = 0; i < n; ++i) rows[i] = keys.key(i);
  const bool z = cpu::avx512_enabled() && head_dim % 32 == 0;
  for (int hg = h0; hg < h1; hg += 4) {
    switch (std::min(4, h1 - hg) + (z ? 4 : 0)) {
      case 8: group_logits_z<4>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 7: group_logits_z<3>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 6: group_logits_z<2>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 5: group_logits_z<1>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 4: group_logits<4>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 3: group_logits<3>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      case 2: group_logits<2>(rows, n, q, hg, head_dim, scale, logits, stride); break;
      default: group_logits<1>(rows, n, q, hg, head_dim, scale, logits, stride); break;
    }
  }
  softmax_heads(logits, stride, sinks, n, h0, h1);
  for (int hg = h0; hg < h1; hg += 4) {
    switch (std::min(4, h1 - hg) + (z ? 4 : 0)) {
      case 8: group_outputs_z<4>(rows, n, logits, stride, hg, head_dim, out); break;
      case 7: group_outputs_z<3>(rows, n, logits, stride, hg, head_dim, out); break;
      case 6: group_outputs_z<2>(rows, n, logits, stride, hg, head_dim, out); break;
      case 5: group_outputs_z<1>(rows, n, logits, stride, hg, head_dim, out); break;
      case 4: group_outputs<4>(rows, n, logits, stride, hg, head_dim, out); break;
      case 3: group_outputs<3>(rows, n, logits, stride, hg, head_dim, out); break;
      case 2: group_outputs<2>(rows, n, logits, stride, hg, head_dim, out); break;
      default: group_outputs<1>(rows, n, logits, stride, hg, head_dim, out); break;
    }
  }
  for (int h = h0; h < h1; ++h) rope_t.apply(out + static_cast<int64_t>(h) * head_dim + (head_dim - rope_dim), true);
}

template <class K>
void indexer_scores_impl(const PagedState& state, int layer, int slot, const float* q, const float* w, int n_heads,
                         int head_dim, int64_t s0, int64_t s1, float* scores) {
  float kb[kMaxHeadDim];
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t start = s * 4;
    K::f16_row(state.index_row(layer, state.page_of(slot, start / kPageTokens),
                               static_cast<int>((start % kPageTokens) / 4)),
               kb, head_dim);
    float acc = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      const float v = K::dot(q + static_cast<int64_t>(h) * head_dim, kb, head_dim);
      acc += w[h] * std::max(v, 0.0f);
    }
    scores[s] = acc;
  }
}

}  // namespace

void attend_heads(const LaneKeys& keys, const float* q, const float* sinks, int head_dim, int rope_dim,
                  const RopeTable& rope_t, float* logits, int64_t stride, float* out, int h0, int h1) {
  if (use_avx2() && head_dim % 16 == 0)
    attend_heads_grouped(keys, q, sinks, head_dim, rope_dim, rope_t, logits, stride, out, h0, h1);
  else if (use_avx2())
    attend_heads_impl<Avx2>(keys, q, sinks, head_dim, rope_dim, rope_t, logits, stride, out, h0, h1);
  else
    attend_heads_impl<Portable>(keys, q, sinks, head_dim, rope_dim, rope_t, logits, stride, out, h0, h1);
}

void indexer_scores(const PagedState& state, int layer, int slot, const float* q, const float* w, int n_heads,
                    int head_dim, int64_t s0, int64_t s1, float* scores) {
  if (use_avx2())
    indexer_scores_impl<Avx2>(state, layer, slot, q, w, n_heads, head_dim, s0, s1, scores);
  else
    indexer_scores_impl<Portable>(state, layer, slot, q, w, n_heads, head_dim, s0, s1, scores);
}

void indexer_topk(const float* scores, int64_t n, int64_t k, int32_t* order, int32_t* sel) {
  // A strict total order (score desc, then index asc): the selected set is unique, so the two
  // ways below pick the same entries.
  auto better = [scores](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  if (k <= kSmallTopk) {
    // Few to keep (the decode case of small models): one pass, the best k so far kept sorted in
    // sel; an entry enters only when it beats the current k-th (ties: the lower index, met first,
    // stays ahead).
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = static_cast<int32_t>(i);
      if (m == k && !better(e, sel[k - 1])) continue;
      int64_t j = m < k ? m++ : k - 1;
      for (; j > 0 && better(e, sel[j - 1]); --j) sel[j] = sel[j - 1];
      sel[j] = e;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) order[i] = static_cast<int32_t>(i);
    std::nth_element(order, order + (k - 1), order + n, better);
    std::copy(order, order + k, sel);
  }
  std::sort(sel, sel + k);
}

}  // namespace ds4
