// MoE FFN with grouped experts (spec §5).
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops.h"

namespace ds4 {

void route_lane(const ModelConfig& cfg, const LayerWeights& L, bool hash, int32_t token, const float* logits,
                int32_t* ids, float* weights) {
  const int E = cfg.n_expert, K = cfg.n_expert_used;
  auto score = [&](int e) { return std::sqrt(softplusf(logits[e])); };
  if (hash) {
    const int32_t* row = L.tid2eid + static_cast<int64_t>(token) * K;
    for (int k = 0; k < K; ++k) ids[k] = row[k];  // range-checked when the weights were bound
  } else {
    // K passes of a strict arg-max: '>' keeps the lower id on ties, already-taken experts skipped.
    for (int k = 0; k < K; ++k) {
      int best = -1;
      float best_v = 0.0f;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int j = 0; j < k; ++j) taken = taken || ids[j] == e;
        if (taken) continue;
        const float v = score(e) + L.exp_bias[e];
        if (best < 0 || v > best_v) {
          best = e;
          best_v = v;
        }
      }
      ids[k] = best;
    }
  }
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    weights[k] = score(ids[k]);
    sum += weights[k];
  }
  const float den = cfg.expert_weights_norm ? std::max(sum, 6.103515625e-5f) : 1.0f;
  for (int k = 0; k < K; ++k) weights[k] = weights[k] / den * cfg.expert_weights_scale;
}

void swiglu(float* g, const float* u, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i) {
    float gv = g[i], uv = u[i];
    if (limit > 0.0f) {
      gv = std::min(gv, limit);
      uv = std::min(std::max(uv, -limit), limit);
    }
    g[i] = siluf(gv) * uv;
  }
}

void moe_forward(const ModelConfig& cfg, const LayerWeights& L, int layer, int n, const int32_t* tokens, Scratch& sc,
                 ThreadPool& pool) {
  const int64_t d = cfg.n_embd, F = cfg.expert_ffn;
  const int E = cfg.n_expert, K = cfg.n_expert_used;
  matmul(L.gate_inp, sc.u, n, d, sc.router, E, pool);
  const bool hash = layer < cfg.n_hash_layers;
  for (int i = 0; i < n; ++i)
    route_lane(cfg, L, hash, tokens[i], sc.router + static_cast<int64_t>(i) * E, sc.sel_id + static_cast<int64_t>(i) * K,
               sc.sel_w + static_cast<int64_t>(i) * K);

  const float lim_exp = cfg.swiglu_clamp_exp[layer], lim_sh = cfg.swiglu_clamp_shexp[layer];
  // Per expert, its (lane, selection index) pairs in lane order, run in chunks of at most
  // kChunk columns (a hash table may name an expert twice for one token, so an expert can have
  // more pairs than lanes). Chunking cannot change a column's arithmetic.
  constexpr int kChunk = 64;
  const int chunk = std::min(kChunk, sc.rows);
  int32_t lane_of[kChunk], slot_of[kChunk];
  const int64_t n_pairs = static_cast<int64_t>(n) * K;
  for (int e = 0; e < E; ++e) {
    int64_t next = 0;
    while (next < n_pairs) {
      int cnt = 0;
      for (; next < n_pairs && cnt < chunk; ++next) {
        if (sc.sel_id[next] != e) continue;
        lane_of[cnt] = static_cast<int32_t>(next / K);
        slot_of[cnt] = static_cast<int32_t>(next % K);
        ++cnt;
      }
      if (cnt == 0) break;
      for (int c = 0; c < cnt; ++c) std::memcpy(sc.ex_in + c * d, sc.u + lane_of[c] * d, sizeof(float) * d);
      matmul(L.gate_exps.expert(e), sc.ex_in, cnt, d, sc.ex_gate, F, pool);
      matmul(L.up_exps.expert(e), sc.ex_in, cnt, d, sc.ex_up, F, pool);
      for (int c = 0; c < cnt; ++c) swiglu(sc.ex_gate + c * F, sc.ex_up + c * F, F, lim_exp);
      matmul(L.down_exps.expert(e), sc.ex_gate, cnt, F, sc.ex_down, d, pool);
      for (int c = 0; c < cnt; ++c) {
        // The router weight scales the expert's output, after the down projection.
        const int64_t i = lane_of[c], k = slot_of[c];
        const float wk = sc.sel_w[i * K + k];
        float* dst = sc.ex_out + (i * K + k) * d;
        const float* src = sc.ex_down + c * d;
        for (int64_t x = 0; x < d; ++x) dst[x] = wk * src[x];
      }
    }
  }

  const bool shared = cfg.n_expert_shared == 1;
  if (shared) {
    matmul(L.gate_sh, sc.u, n, d, sc.ex_gate, F, pool);
    matmul(L.up_sh, sc.u, n, d, sc.ex_up, F, pool);
    for (int i = 0; i < n; ++i) swiglu(sc.ex_gate + i * F, sc.ex_up + i * F, F, lim_sh);
    matmul(L.down_sh, sc.ex_gate, n, F, sc.ex_down, d, pool);
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
