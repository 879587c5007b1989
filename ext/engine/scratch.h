// The step's working memory: ONE arena, carved into per-lane buffers for up to max_rows lanes.
//
// Every buffer holds 4-byte elements (fp32 or int32) and is rounded up to 64 bytes. The list
// below, in this order, is mirrored by ds4_app/engine/memory.py (_scratch_buffers); a test
// checks that Engine.allocated_bytes()["scratch"] equals the Python formula. With
// R = max_rows, per-lane widths (0 where the model has no such layer):
//   cw    = 2*head_dim if any CSA layer, else head_dim if any HCA layer
//   icw   = 2*index_head_dim if any CSA layer
//   n_idx = max_ctx / 4 if any CSA layer            (indexer candidates of one query)
//   n_comp = max(min(index_topk, max_ctx/4) if CSA, max_ctx/128 if HCA)
//   n_keys = 128 + n_comp                            (window plus compressed keys)
#pragma once

#include <cstdint>

#include "engine.h"
#include "paged_state.h"

namespace ds4 {

struct Scratch {
  Scratch(const ModelConfig& cfg, int max_rows, int max_ctx);

  int rows = 0;  // max_rows: lanes the buffers hold
  int64_t cw = 0, icw = 0, n_idx = 0, n_comp = 0, n_keys = 0, pool_w = 0;

  float* x_hc = nullptr;      // R x hc*d   residual streams
  float* hc_mix = nullptr;    // R x (2+hc)*hc   mHC mixes (also hc_head's)
  float* hc_post = nullptr;   // R x hc
  float* hc_comb = nullptr;   // R x hc*hc
  float* u = nullptr;         // R x d   sub-layer input (after its norm)
  float* q_lat = nullptr;     // R x q_lora_rank
  float* q = nullptr;         // R x n_head*head_dim
  float* kv = nullptr;        // R x head_dim   this lane's raw row
  float* comp_kv = nullptr;   // R x cw   attention compressor value projection
  float* comp_sc = nullptr;   // R x cw   its score projection (+ ape)
  float* idx_q = nullptr;     // R x index_n_heads*index_head_dim
  float* idx_w = nullptr;     // R x index_n_heads
  float* idx_kv = nullptr;    // R x icw
  float* idx_sc = nullptr;    // R x icw
  float* ape = nullptr;       // R x max(cw, icw)   one dequantized ape row
  float* attn_out = nullptr;  // R x n_head*head_dim
  float* o_low = nullptr;     // R x o_groups*o_lora_rank
  float* y = nullptr;         // R x d   sub-layer output
  float* router = nullptr;    // R x n_expert
  float* sel_w = nullptr;     // R x n_expert_used
  int32_t* sel_id = nullptr;  // R x n_expert_used
  float* ex_in = nullptr;     // R x d   lanes gathered for one expert
  float* ex_gate = nullptr;   // R x expert_ffn
  float* ex_up = nullptr;     // R x expert_ffn
  float* ex_down = nullptr;   // R x d
  float* ex_out = nullptr;    // R x n_expert_used*d   each lane's weighted expert outputs
  float* att_logits = nullptr;   // R x n_head*n_keys
  int32_t* comp_sel = nullptr;   // R x n_comp   compressed entries a lane attends to
  float* idx_scores = nullptr;   // R x n_idx
  int32_t* idx_order = nullptr;  // R x n_idx
  float* pooled = nullptr;       // R x pool_w   a freshly pooled compressor row
  float* head_in = nullptr;      // R x d   final normed hidden of the lanes that want logits
  float* rope = nullptr;         // R x rope_dim   each lane's RoPE table (RopeTable::save) of the layer

  AlignedBuffer arena;
};

}  // namespace ds4
