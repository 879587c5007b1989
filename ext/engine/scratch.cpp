// Carving the step arena (the order and sizes are the Python formula's; see scratch.h).
#include "scratch.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace ds4 {

Scratch::Scratch(const ModelConfig& cfg, int max_rows, int max_ctx) {
  const bool csa = std::count(cfg.compress_ratios.begin(), cfg.compress_ratios.end(), 4) > 0;
  const bool hca = std::count(cfg.compress_ratios.begin(), cfg.compress_ratios.end(), 128) > 0;
  rows = max_rows;
  const int64_t R = max_rows, d = cfg.n_embd, hc = cfg.hc_mult, hd = cfg.head_dim;
  const int64_t ihd = cfg.index_head_dim, nh = cfg.n_head, K = cfg.n_expert_used;
  cw = csa ? 2 * hd : (hca ? hd : 0);
  icw = csa ? 2 * ihd : 0;
  n_idx = csa ? max_ctx / 4 : 0;
  n_comp = std::max<int64_t>(csa ? std::min<int64_t>(cfg.index_topk, max_ctx / 4) : 0, hca ? max_ctx / 128 : 0);
  n_keys = kRingRows + n_comp;
  pool_w = std::max<int64_t>((csa || hca) ? hd : 0, csa ? ihd : 0);

  std::vector<std::pair<void**, int64_t>> parts = {
      {reinterpret_cast<void**>(&x_hc), R * hc * d},
      {reinterpret_cast<void**>(&hc_mix), R * (2 + hc) * hc},
      {reinterpret_cast<void**>(&hc_post), R * hc},
      {reinterpret_cast<void**>(&hc_comb), R * hc * hc},
      {reinterpret_cast<void**>(&u), R * d},
      {reinterpret_cast<void**>(&q_lat), R * cfg.q_lora_rank},
      {reinterpret_cast<void**>(&q), R * nh * hd},
      {reinterpret_cast<void**>(&kv), R * hd},
      {reinterpret_cast<void**>(&comp_kv), R * cw},
      {reinterpret_cast<void**>(&comp_sc), R * cw},
      {reinterpret_cast<void**>(&idx_q), csa ? R * cfg.index_n_heads * ihd : 0},
      {reinterpret_cast<void**>(&idx_w), csa ? R * cfg.index_n_heads : 0},
      {reinterpret_cast<void**>(&idx_kv), R * icw},
      {reinterpret_cast<void**>(&idx_sc), R * icw},
      {reinterpret_cast<void**>(&ape), R * std::max(cw, icw)},
      {reinterpret_cast<void**>(&attn_out), R * nh * hd},
      {reinterpret_cast<void**>(&o_low), R * cfg.o_groups * cfg.o_lora_rank},
      {reinterpret_cast<void**>(&y), R * d},
      {reinterpret_cast<void**>(&router), R * cfg.n_expert},
      {reinterpret_cast<void**>(&sel_w), R * K},
      {reinterpret_cast<void**>(&sel_id), R * K},
      {reinterpret_cast<void**>(&ex_in), R * d},
      {reinterpret_cast<void**>(&ex_gate), R * cfg.expert_ffn},
      {reinterpret_cast<void**>(&ex_up), R * cfg.expert_ffn},
      {reinterpret_cast<void**>(&ex_down), R * d},
      {reinterpret_cast<void**>(&ex_out), R * K * d},
      {reinterpret_cast<void**>(&att_logits), R * nh * n_keys},
      {reinterpret_cast<void**>(&comp_sel), R * n_comp},
      {reinterpret_cast<void**>(&idx_scores), R * n_idx},
      {reinterpret_cast<void**>(&idx_order), R * n_idx},
      {reinterpret_cast<void**>(&pooled), R * pool_w},
      {reinterpret_cast<void**>(&head_in), R * d},
      {reinterpret_cast<void**>(&rope), R * cfg.rope_dim},
  };
  auto padded = [](int64_t elems) { return static_cast<uint64_t>((elems * 4 + 63) / 64 * 64); };
  uint64_t total = 0;
  for (const auto& p : parts) total += padded(p.second);
  arena = AlignedBuffer(total);
  uint64_t off = 0;
  for (const auto& p : parts) {
    *p.first = arena.data() + off;
    off += padded(p.second);
  }
}

}  // namespace ds4
