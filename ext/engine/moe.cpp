// MoE FFN with grouped experts (spec §5).
#include "moe.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dispatch.h"
#include "expf_exact.h"
#include "ops.h"

namespace ds4 {

namespace {
constexpr int kMaxBatchJobs = 64;  // matmul_batch's limit
}  // namespace

void route_lane(const ModelConfig& cfg, const LayerWeights& L, bool hash, int32_t token, float* logits,
                int32_t* ids, float* weights) {
  const int E = cfg.n_expert, K = cfg.n_expert_used;
  auto score = [](float logit) { return std::sqrt(softplusf(logit)); };
  if (hash) {
    const int32_t* row = L.tid2eid + static_cast<int64_t>(token) * K;
    for (int k = 0; k < K; ++k) ids[k] = row[k];  // range-checked when the weights were bound
    for (int k = 0; k < K; ++k) weights[k] = score(logits[ids[k]]);
  } else {
    float* s = logits;
    for (int e = 0; e < E; ++e) s[e] = score(logits[e]);
    // K passes of a strict arg-max: '>' keeps the lower id on ties, already-taken experts skipped.
    for (int k = 0; k < K; ++k) {
      int best = -1;
      float best_v = 0.0f;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int j = 0; j < k; ++j) taken = taken || ids[j] == e;
        if (taken) continue;
        const float v = s[e] + L.exp_bias[e];
        if (best < 0 || v > best_v) {
          best = e;
          best_v = v;
        }
      }
      ids[k] = best;
    }
    for (int k = 0; k < K; ++k) weights[k] = s[ids[k]];
  }
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) sum += weights[k];
  const float den = cfg.expert_weights_norm ? std::max(sum, 6.103515625e-5f) : 1.0f;
  for (int k = 0; k < K; ++k) weights[k] = weights[k] / den * cfg.expert_weights_scale;
}

// swiglu's AVX2 and AVX-512 twins, 8 or 16 elements at a time: per element the scalar loop's
// clamps (min/max with its operand order, so NaNs and signed zeros come out alike), exp (glibc's
// bits, expf_exact.h), 1 + e, division and product; the same bits. They return the elements done.
DS4_EXPF_AVX2 static int64_t swiglu_avx2(float* g, const float* u, int64_t n, float limit) {
  const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
    if (limit > 0.0f) {
      gv = _mm256_min_ps(lim, gv);  // lim < gv ? lim : gv, std::min(gv, limit)
      uv = _mm256_min_ps(lim, _mm256_max_ps(nlim, uv));
    }
    const __m256 e = exp_exact_avx2(_mm256_xor_ps(gv, sign));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
  }
  return i;
}

DS4_EXPF_AVX512 static int64_t swiglu_avx512(float* g, const float* u, int64_t n, float limit) {
  const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(limit), nlim = _mm512_set1_ps(-limit);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
    if (limit > 0.0f) {
      gv = _mm512_min_ps(lim, gv);
      uv = _mm512_min_ps(lim, _mm512_max_ps(nlim, uv));
    }
    const __m512 e = exp_exact_avx512(_mm512_xor_ps(gv, sign));
    _mm512_mask_storeu_ps(g + i, k, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
  }
  return n;
}

// swiglu on an explicit path (0 portable, 1 AVX2, 2 AVX-512; the caller checks the CPU). Not in
// moe.h: only swiglu and the tests (ext/python/_native.pyx, _t_swiglu) call it.
void swiglu_on(int path, float* g, const float* u, int64_t n, float limit) {
  int64_t i = path == 2 ? swiglu_avx512(g, u, n, limit) : path == 1 ? swiglu_avx2(g, u, n, limit) : 0;
  for (; i < n; ++i) {
    float gv = g[i], uv = u[i];
    if (limit > 0.0f) {
      gv = std::min(gv, limit);
      uv = std::min(std::max(uv, -limit), limit);
    }
    g[i] = siluf(gv) * uv;
  }
}

void swiglu(float* g, const float* u, int64_t n, float limit) {
  swiglu_on(use_avx2() ? (cpu::avx512_enabled() ? 2 : 1) : 0, g, u, n, limit);
}

MoeLists::MoeLists(const ModelConfig& cfg, int max_rows)
    : pair_lane(static_cast<size_t>(cfg.n_expert_used) * max_rows),
      pair_slot(static_cast<size_t>(cfg.n_expert_used) * max_rows),
      expert_first(cfg.n_expert + 1),
      x_cols(max_rows),
      y_cols(max_rows) {
  jobs.reserve(kMaxBatchJobs);
}

void moe_forward(const ModelConfig& cfg, const LayerWeights& L, int layer, int n, const int32_t* tokens, Scratch& sc,
                 MoeLists& lists, ThreadPool& pool) {
  const int64_t d = cfg.n_embd, F = cfg.expert_ffn;
  const int E = cfg.n_expert, K = cfg.n_expert_used;
  const bool hash = layer < cfg.n_hash_layers;
  for (int i = 0; i < n; ++i)
    route_lane(cfg, L, hash, tokens[i], sc.router + static_cast<int64_t>(i) * E, sc.sel_id + static_cast<int64_t>(i) * K,
               sc.sel_w + static_cast<int64_t>(i) * K);

  // The (lane, selection index) pairs of each expert, in lane order (a hash table may name an
  // expert twice for one token, so an expert can have more pairs than lanes).
  const int n_pairs = n * K;
  int32_t* pair_lane = lists.pair_lane.data();
  int32_t* pair_slot = lists.pair_slot.data();
  int32_t* first = lists.expert_first.data();
  for (int e = 0, m = 0; e < E; ++e) {
    first[e] = m;
    for (int p = 0; p < n_pairs; ++p) {
      if (sc.sel_id[p] != e) continue;
      pair_lane[m] = p / K;
      pair_slot[m] = p % K;
      ++m;
    }
  }
  first[E] = n_pairs;

  const float lim_exp = cfg.swiglu_clamp_exp[layer], lim_sh = cfg.swiglu_clamp_shexp[layer];
  const bool shared = cfg.n_expert_shared == 1;
  // Buffers: routed pair j of a round has its gate and up rows at ex_gate/ex_up + j*F (at most
  // sc.rows pairs a round, so there may be several rounds). The shared expert's rows: ex_in (gate)
  // and ex_down (up, then its down output) when F <= d, which leaves it in the first round;
  // otherwise it takes a round of its own in ex_gate/ex_up.
  const bool shared_aside = shared && F <= d;
  std::vector<MatmulJob>& jobs = lists.jobs;
  // Gate and up of the same lanes as one paired product, SwiGLU'd into the gate rows chunk by
  // chunk on the thread that computed them (ctx: the clamp limit).
  auto add_glu = [&](const TensorView& Wg, const TensorView& Wu, int ncols, const float* X, int64_t ldx,
                     const float* const* xc, float* gate, float* up, const float* limit) {
    MatmulJob j = MatmulJob::product(Wg, ncols, X, ldx, gate, F, xc);
    j.W2 = Wu;
    j.Y2 = up;
    j.ctx = limit;
    j.after = [](const MatmulJob& jb, int64_t r0, int64_t r1) {
      const float lim = *static_cast<const float*>(jb.ctx);
      for (int c = 0; c < jb.ncols; ++c) swiglu(jb.y(c) + r0, jb.y2(c) + r0, r1 - r0, lim);
    };
    jobs.push_back(j);
  };

  int next = 0;  // first pair of the next round
  bool shared_done = !shared;
  while (next < n_pairs || !shared_done) {
    const bool shared_now = !shared_done && (shared_aside || next >= n_pairs);
    const int round_first = next;
    const int cap = sc.rows;
    int count = 0;
    // Gate/up products: each expert's pairs of this round as one paired product (at most 63
    // experts a round, so that with the shared expert a batch holds at most 64 products).
    jobs.clear();
    int experts = 0;
    if (!(shared_now && !shared_aside)) {
      for (int e = 0; e < E && count < cap; ++e) {
        const int b = std::max(first[e], round_first), end = std::min(first[e + 1], round_first + cap);
        if (b >= end) continue;
        if (experts == kMaxBatchJobs - 1) break;
        ++experts;
        for (int m = b; m < end; ++m) lists.x_cols[m - round_first] = sc.u + static_cast<int64_t>(pair_lane[m]) * d;
        const int64_t row0 = b - round_first;
        add_glu(L.gate_exps.expert(e), L.up_exps.expert(e), end - b, nullptr, 0, &lists.x_cols[row0],
                sc.ex_gate + row0 * F, sc.ex_up + row0 * F, &lim_exp);
        count += end - b;
        next = end;
      }
    }
    float* sh_gate = shared_aside ? sc.ex_in : sc.ex_gate;
    float* sh_up = shared_aside ? sc.ex_down : sc.ex_up;
    if (shared_now) add_glu(L.gate_sh, L.up_sh, n, sc.u, d, nullptr, sh_gate, sh_up, &lim_sh);
    matmul_batch(jobs.data(), static_cast<int>(jobs.size()), pool);

    // Down products, straight into each pair's row of ex_out; the router weight scales the
    // expert's output after the down projection, in place.
    jobs.clear();
    for (int e = 0; e < E; ++e) {
      const int b = std::max(first[e], round_first), end = std::min(first[e + 1], round_first + count);
      if (b >= end) continue;
      for (int m = b; m < end; ++m)
        lists.y_cols[m - round_first] = sc.ex_out + (static_cast<int64_t>(pair_lane[m]) * K + pair_slot[m]) * d;
      const int64_t row0 = b - round_first;
      jobs.push_back(MatmulJob::product(L.down_exps.expert(e), end - b, sc.ex_gate + row0 * F, F, nullptr, 0, nullptr, &lists.y_cols[row0]));
    }
    if (shared_now) jobs.push_back(MatmulJob::product(L.down_sh, n, sh_gate, F, sc.ex_down, d));
    matmul_batch(jobs.data(), static_cast<int>(jobs.size()), pool);
    for (int m = round_first; m < round_first + count; ++m) {
      const int64_t i = pair_lane[m], k = pair_slot[m];
      const float wk = sc.sel_w[i * K + k];
      float* dst = sc.ex_out + (i * K + k) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = wk * dst[x];
    }
    if (shared_now) shared_done = true;
  }

  for (int64_t i = 0; i < n; ++i) {
    float* y = sc.y + i * d;
    const float* ex = sc.ex_out + i * K * d;
    for (int64_t x = 0; x < d; ++x) {
      float acc = ex[x];
      for (int k = 1; k < K; ++k) acc += ex[k * d + x];
      y[x] = shared ? acc + sc.ex_down[i * d + x] : acc;
    }
  }
}

}  // namespace ds4
