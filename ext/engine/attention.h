// Attention of one lane over its slot's history (spec §4.5-4.7), after its own row was stored.
//
// Keys (K = V) are f16 rows read back to fp32: first the raw window positions
// max(0, t-127) .. t from the slot's ring, then the compressed entries the lane sees, in
// ascending entry order (HCA: all s < (t+1)/128; CSA: the indexer's top-k among s < (t+1)/4).
// Each head's computation depends only on the lane's query and these rows, so splitting heads
// between threads (or running other lanes beside it) cannot change a bit of the result.
#pragma once

#include <cstdint>

#include "ops.h"
#include "paged_state.h"

namespace ds4 {

// The key rows one lane attends to.
struct LaneKeys {
  const PagedState* state = nullptr;
  int layer = 0, slot = 0, ratio = 0;
  int64_t win_first = 0;  // first window position
  int n_win = 0;
  const int32_t* comp = nullptr;  // compressed entry ids, ascending
  int n_comp = 0;

  int count() const { return n_win + n_comp; }
  const uint16_t* key(int i) const {
    if (i < n_win) return state->ring_row(layer, slot, win_first + i);
    const int64_t start = static_cast<int64_t>(comp[i - n_win]) * ratio;  // first token of the entry
    return state->comp_row(layer, state->page_of(slot, start / kPageTokens),
                           static_cast<int>((start % kPageTokens) / ratio));
  }
};

// Heads [h0, h1) of one lane: logits q_h·k/sqrt(head_dim), softmax with the sink column (sink
// only in the denominator), output Σ p·k, then the inverse RoPE of the output tail at the query
// position. logits is the lane's [n_head][stride] buffer, out its [n_head][head_dim] output.
void attend_heads(const LaneKeys& keys, const float* q, const float* sinks, int head_dim, int rope_dim,
                  const RopeTable& rope_t, float* logits, int64_t stride, float* out, int h0, int h1);

// Indexer scores I(t, s) = Σ_h w_h·ReLU(q_h·K_s) for entries s in [s0, s1) of a CSA layer.
// q: [n_heads][head_dim] (rotated, QAT'd); w: head weights already scaled.
void indexer_scores(const PagedState& state, int layer, int slot, const float* q, const float* w, int n_heads,
                    int head_dim, int64_t s0, int64_t s1, float* scores);

// The k best entries among n by (score descending, index ascending), written ascending to sel.
// order: scratch of n entries (used when k > kSmallTopk).
constexpr int64_t kSmallTopk = 16;
void indexer_topk(const float* scores, int64_t n, int64_t k, int32_t* order, int32_t* sel);

}  // namespace ds4
