// Config and step-plan checks shared by the CPU and GPU engines (plan_check.h).
#include "plan_check.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "ops.h"
#include "paged_state.h"

namespace ds4 {

namespace {

void need(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument("step plan: " + msg); }

}  // namespace

void check_config_layers(const ModelConfig& c) {
  need(c.n_layer >= 1 && static_cast<int>(c.compress_ratios.size()) == c.n_layer,
       "compress_ratios needs one entry per layer");
  need(static_cast<int>(c.rope_inv_freqs.size()) == c.n_layer, "rope_inv_freqs needs one table per layer");
  for (const auto& t : c.rope_inv_freqs)
    need(static_cast<int>(t.size()) == c.rope_dim / 2, "each rope_inv_freqs table needs rope_dim/2 entries");
  need(static_cast<int>(c.swiglu_clamp_exp.size()) == c.n_layer &&
           static_cast<int>(c.swiglu_clamp_shexp.size()) == c.n_layer,
       "swiglu clamps need one value per layer");
  for (int r : c.compress_ratios) need(r == 0 || r == 4 || r == 128, "compress ratios must be 0, 4 or 128");
  need(c.sliding_window == kRingRows, "the paged engine needs sliding_window = 128");
  need(c.rope_dim % 2 == 0 && c.rope_dim > 0 && c.rope_dim / 2 <= kMaxRopeHalf && c.rope_dim <= c.head_dim,
       "rope_dim must be even, positive, at most head_dim and 512");
}

void check_config_shapes(const ModelConfig& c, const EngineOptions& o) {
  need(c.n_head >= 1 && c.o_groups >= 1 && c.n_head % c.o_groups == 0, "n_head must be a multiple of o_groups");
  need(c.n_expert >= 1 && c.n_expert_used >= 1 && c.n_expert_used <= c.n_expert, "bad expert counts");
  need(c.n_expert_shared == 0 || c.n_expert_shared == 1, "n_expert_shared must be 0 or 1");
  const bool csa = std::count(c.compress_ratios.begin(), c.compress_ratios.end(), 4) > 0;
  if (csa) {
    need(c.index_head_dim >= c.rope_dim && (c.index_head_dim & (c.index_head_dim - 1)) == 0,
         "index_head_dim must be a power of two >= rope_dim");
    need(c.index_n_heads >= 1 && c.index_topk >= 1, "the indexer needs heads and a top-k");
  }
  if (c.qat_numerics) {
    need((c.head_dim - c.rope_dim) % 64 == 0, "qat_numerics needs head_dim - rope_dim to be a multiple of 64");
    need(!csa || c.index_head_dim % 32 == 0, "qat_numerics needs index_head_dim to be a multiple of 32");
  }
  need(o.max_slots >= 1 && o.max_ctx >= 1 && o.n_pages >= 0 && o.max_rows >= 1, "bad engine options");
}

void check_step_plan(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                     int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks,
                     const EngineOptions& o, int n_vocab, int stride, int32_t* page_owner) {
  if (n_lanes > o.max_rows) fail(std::to_string(n_lanes) + " lanes exceed max_rows " + std::to_string(o.max_rows));
  if (n_tables < 0 || max_blocks < 0) fail("negative table dimensions");
  for (int k = 0; k < n_tables; ++k) {
    const int s = table_slot[k];
    if (s < 0 || s >= o.max_slots) fail("table slot " + std::to_string(s) + " out of range");
    for (int j = 0; j < k; ++j)
      if (table_slot[j] == s) fail("slot " + std::to_string(s) + " has two block-table rows");
    const int32_t* row = block_table + static_cast<int64_t>(k) * max_blocks;
    for (int b = 0; b < max_blocks; ++b) {
      if (row[b] < -1 || row[b] >= o.n_pages)
        fail("slot " + std::to_string(s) + " names page " + std::to_string(row[b]) + " outside the pool of " +
             std::to_string(o.n_pages));
      if (b >= stride && row[b] != -1)
        fail("slot " + std::to_string(s) + " has a page beyond max_ctx " + std::to_string(o.max_ctx));
    }
  }
  for (int i = 0; i < n_lanes; ++i) {
    const int s = lane_slot[i];
    bool has_table = false;
    for (int k = 0; k < n_tables; ++k) has_table = has_table || table_slot[k] == s;
    if (!has_table) fail("lane " + std::to_string(i) + " slot " + std::to_string(s) + " has no block-table row");
    if (lane_token[i] < 0 || lane_token[i] >= n_vocab)
      fail("lane " + std::to_string(i) + " token " + std::to_string(lane_token[i]) + " outside the vocabulary");
    if (lane_pos[i] < 0 || lane_pos[i] >= o.max_ctx)
      fail("lane " + std::to_string(i) + " position " + std::to_string(lane_pos[i]) + " outside 0.." +
           std::to_string(o.max_ctx - 1));
  }
  // Slots attend in parallel, so two slots of one step must never share a physical page.
  std::fill(page_owner, page_owner + o.n_pages, -1);
  for (int k = 0; k < n_tables; ++k) {
    const int32_t* row = block_table + static_cast<int64_t>(k) * max_blocks;
    for (int b = 0; b < max_blocks; ++b) {
      if (row[b] < 0) continue;
      if (page_owner[row[b]] >= 0)
        fail("page " + std::to_string(row[b]) + " appears twice in the block tables (slots " +
             std::to_string(page_owner[row[b]]) + " and " + std::to_string(table_slot[k]) + ")");
      page_owner[row[b]] = table_slot[k];
    }
  }
}

int group_lanes(int n_lanes, const int32_t* lane_slot, const int32_t* lane_pos, int32_t* order, int32_t* group_first,
                int32_t* group_len, int32_t* group_slot, int32_t* lane_group, int32_t* lane_t0) {
  int n_groups = 0;
  int filled = 0;
  for (int i = 0; i < n_lanes; ++i) {
    bool first = true;
    for (int j = 0; j < i; ++j) first = first && lane_slot[j] != lane_slot[i];
    if (!first) continue;
    group_first[n_groups] = filled;
    group_slot[n_groups] = lane_slot[i];
    int prev = -1;
    for (int j = i; j < n_lanes; ++j) {
      if (lane_slot[j] != lane_slot[i]) continue;
      if (prev >= 0 && lane_pos[j] != lane_pos[prev] + 1)
        fail("slot " + std::to_string(lane_slot[i]) + " lanes are not consecutive positions (" +
             std::to_string(lane_pos[prev]) + " then " + std::to_string(lane_pos[j]) + ")");
      order[filled++] = j;
      if (lane_group) lane_group[j] = n_groups;
      if (lane_t0) lane_t0[j] = lane_pos[i];
      prev = j;
    }
    group_len[n_groups] = filled - group_first[n_groups];
    ++n_groups;
  }
  return n_groups;
}

void copy_block_tables(int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks,
                       int32_t* tables, int stride) {
  for (int k = 0; k < n_tables; ++k) {
    int32_t* dst = tables + static_cast<int64_t>(table_slot[k]) * stride;
    const int32_t* row = block_table + static_cast<int64_t>(k) * max_blocks;
    for (int b = 0; b < stride; ++b) dst[b] = b < max_blocks ? row[b] : -1;
  }
}

void check_pages(int n_lanes, const int32_t* lane_slot, const int32_t* lane_pos, bool csa, bool hca,
                 const int32_t* tables, int stride) {
  for (int i = 0; i < n_lanes; ++i) {
    const int64_t t = lane_pos[i];
    int64_t last_page = -1;  // highest logical page holding an entry visible at t
    if (csa && (t + 1) / 4 > 0) last_page = std::max(last_page, ((t + 1) / 4 - 1) * 4 / kPageTokens);
    if (hca && (t + 1) / 128 > 0) last_page = std::max(last_page, (t + 1) / 128 - 1);
    const int32_t* table = tables + static_cast<int64_t>(lane_slot[i]) * stride;
    for (int64_t lp = 0; lp <= last_page; ++lp) {
      if (table[lp] < 0)
        throw std::invalid_argument("step plan: slot " + std::to_string(lane_slot[i]) + " at position " +
                                    std::to_string(t) + " needs logical page " + std::to_string(lp) +
                                    ", which its block table leaves unassigned");
    }
  }
}

}  // namespace ds4
