// The MoE FFN (spec §5) over all lanes of a step: router, grouped routed experts, shared expert.
//
// Grouping: all lanes routed to expert e run e's gate/up/down as one product over those lanes
// (weight reuse), and the products of all experts (and the shared expert) go to the thread pool
// together: one hand-off for every gate and up projection, one for every down projection. matmul
// computes each column with single-column arithmetic, and every lane then sums ITS expert
// outputs in its own selection order, so a lane's result does not depend on which other lanes
// share its experts.
#pragma once

#include <cstdint>
#include <vector>

#include "ds4/kernels.h"
#include "engine.h"
#include "scratch.h"
#include "weights.h"

namespace ds4 {

// Routing of one lane from its router logits: expert ids in selection order and their weights
// s / max(Σs, 2^-14) × expert_weights_scale (s = sqrt(softplus(logit)); the bias only selects).
// Hash layers take tid2eid[token]; others the top-k of s + bias, ties to the lower expert id.
// logits (n_expert) is overwritten by the scores s of a non-hash layer (each computed once).
void route_lane(const ModelConfig& cfg, const LayerWeights& L, bool hash, int32_t token, float* logits,
                int32_t* ids, float* weights);

// SwiGLU with the DS4 clamps (limit > 0): g ← min(g, L), u ← clamp(u, -L, L), g ← silu(g)·u.
void swiglu(float* g, const float* u, int64_t n, float limit);

// The MoE's bookkeeping for one step, sized once for max_rows lanes (not counted as scratch):
// the (lane, selection) pairs grouped by expert, and the column pointers of the batched products.
struct MoeLists {
  explicit MoeLists(const ModelConfig& cfg, int max_rows);
  std::vector<int32_t> pair_lane, pair_slot;  // n_expert_used * max_rows pairs, expert by expert
  std::vector<int32_t> expert_first;          // n_expert + 1: expert e's pairs are [first[e], first[e+1])
  std::vector<const float*> x_cols;           // max_rows: the lanes' inputs, one round's pairs in order
  std::vector<float*> y_cols;                 // max_rows: where their down projections go
  std::vector<MatmulJob> jobs;
};

// y[lane] = Σ_k w_k·expert_k(u[lane]) + shared(u[lane]) for lanes [0, n): reads sc.u and the
// router logits sc.router (gate_inp · u, which the caller batches with its own work), writes sc.y.
void moe_forward(const ModelConfig& cfg, const LayerWeights& L, int layer, int n, const int32_t* tokens, Scratch& sc,
                 MoeLists& lists, ThreadPool& pool);

}  // namespace ds4
