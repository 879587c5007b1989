// mHC, one lane at a time (spec §3): the control path after the batched fn matmul.
//
// The batched part (fn · x̂ for all lanes) is a matmul in the caller; these functions finish one
// lane each with fixed summation orders, so a lane never depends on its neighbours.
#pragma once

#include <cstdint>

#include "weights.h"

namespace ds4 {

struct HcShape {
  int hc = 4;          // streams
  int64_t d = 0;       // width of one stream
  int iters = 20;      // Sinkhorn iterations (the first pass counts)
  float hc_eps = 1e-6f, norm_eps = 1e-6f;
};

// hc_pre (spec §3.1) from raw = fn · x̂ (unnormalized): u = Σ_i pre_i·X[i], post, and comb's
// logits (row-major [j][k]), which hc_comb_lane turns into hc_post's matrix. ss: the state's sum
// of squares as hc_post_lane returned it, or nullptr to sum it here (the same value either way).
void hc_pre_lane(const HcShape& s, const HcWeights& w, const float* x, const double* ss, const float* raw, float* u,
                 float* post, float* comb);

// hc_pre's Sinkhorn on comb in place (spec §3.1 step 5). Apart from hc_pre_lane because only
// hc_post needs it: the engine runs it beside the sub-layer's first products.
void hc_comb_lane(const HcShape& s, float* comb);

// hc_post (spec §3.2) in place: X[k] ← post_k·y + Σ_j comb[j][k]·X[j] (column k of comb).
// Returns the new state's sum of squares (sum_squares over hc·d, the same bits).
double hc_post_lane(const HcShape& s, float* x, const float* y, const float* post, const float* comb);

// hc_head (spec §3.3) from raw = hc_head_fn · x̂: h = Σ_i (σ(scale·ρ·raw_i + base_i) + eps)·X[i].
void hc_head_lane(const HcShape& s, const HcWeights& w, const float* x, const double* ss, const float* raw, float* h);

}  // namespace ds4
