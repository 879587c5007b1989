// Launchers of the DS4 step kernels the GPU engine (engine_gpu.cu) chains: the per-lane
// operations (lane_ops.cu) and the per-slot paged-state operations (paged_ops.cu). Internal to
// ext/gpu: device pointers in, asynchronous on a stream, every launch checked.
//
// Each kernel reproduces the CPU executor's operation (ext/engine/*.cpp) with a fixed, lane-local
// order of arithmetic, so a lane's result never depends on the other lanes of the step (batch
// invariance), and every run is deterministic.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "ds4_gpu.h"

namespace ds4::gpu {

constexpr int kMaxHcDev = 16;       // hc_mult bound (the CPU's kMaxHc)
constexpr int kMaxExpertUsed = 32;  // n_expert_used bound of the router kernel

// The step's lane and slot structure on the device (all arrays have max_rows entries unless said).
// Lanes of one slot are a "group"; order[grp_first[g] + k] is the group's k-th lane (chronological).
struct StepLanes {
  const int32_t* slot = nullptr;
  const int32_t* token = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* group = nullptr;  // lane -> group
  const int32_t* t0 = nullptr;     // lane -> position of its group's first lane
  const int32_t* order = nullptr;
  const int32_t* grp_first = nullptr;
  const int32_t* grp_len = nullptr;
  const int32_t* grp_slot = nullptr;
  const int32_t* tables = nullptr;  // [group][max_blocks] physical page per logical page, -1 unassigned
  int max_blocks = 0;
};

// --- lane_ops.cu -------------------------------------------------------------------------------

// mHC pre (spec §3.1) from mix = fn . x̂ (unnormalized): u = sum_j pre_j X[i][j], post, comb; then,
// when norm_w is given, the RMSNorm that follows it (eps norm_eps): U[i] = (u * r) * norm_w, else
// U[i] = u. d <= 12288. planes given (d % 32 == 0): also U[i]'s planes for the integer products
// (xplanes.cuh) at planes + i * ldp, the prep kernel's bytes. The same for hc_head and swiglu.
void hc_pre(const float* X, int n, int hc, int64_t d, const float* mix, int64_t mix_ld, const float* scale,
            const float* base, int iters, float hc_eps, float norm_eps, const float* norm_w, float* U, float* post,
            float* comb, Stream s, uint8_t* planes = nullptr, int64_t ldp = 0);

// mHC post (spec §3.2) in place: X[k] = post_k y + sum_j comb[j][k] X[j].
void hc_post(float* X, int n, int hc, int64_t d, const float* Y, const float* post, const float* comb, Stream s);

// hc_post after the FFN with y the MoE output, computed in the same kernel: y[i] = sum_k w[i][k] *
// D[i*K + k] (in selection order, each product rounded) + SH[i] (SH may be null).
void hc_post_moe(float* X, int n, int hc, int64_t d, const float* D, const float* w, const float* SH, int k,
                 const float* post, const float* comb, Stream s);

// One mHC site in two launches (pass 17, lane_ops.cu hc_site_sums_kernel and hc_site_pre_kernel,
// instead of hc_post, the projection's matvec and hc_mix): the post of the sublayer that
// ends at the site (has_post: hc_post with Y's rows, or hc_post_moe with the MoE sum D, w, SH, k;
// post and comb are the previous site's) from X into X_out (not in place: the streams' blocks read
// each other's inputs), then the site's projection mix = fn . x̂, rho, and
// hc_pre with its RMSNorm and planes: post replaced by the site's, comb by its logits, which
// hc_comb then takes through the Sinkhorn (a launch of its own, for the step's side branch). hc = 4
// streams, d % 32 == 0 and at most 8192, fn F16/BF16/F32 (hc_site_takes; the engine runs the three
// launches otherwise). The projection and rho add in an order of their own,
// so the bits differ from mv + hc_pre's (within fp32 rounding); still fixed by d alone, lane-local.
// scratch: hc_site_scratch_bytes(scratch_rows, d) bytes, 8-byte aligned (the block sums);
// scratch_rows >= n.
// head: hc_head's site (fn of hc rows; no post and comb out): row j of the call runs lane lanes[j]
// (null: lane j), its U row j the head's input (norm_w: the output norm).
constexpr int kHcSiteStreams = 4;
constexpr int kHcSiteMix = (2 + kHcSiteStreams) * kHcSiteStreams;  // the projection's rows at a site
// The streams a thread of the site's sums kernel takes (lane_ops.cu hc_site_sums_kernel): 2 (pass 39:
// prefill +0.8-1.1%, decode C = 2 +2.0%, C = 4-8 +0.4-0.6%) or 1, a process-wide measurement setting
// (testing::set_hc_site_streams, ds4_gpu.h). It changes the bits, the same way in decode and prompt
// steps, so each contract holds within one setting; the engine keys its graphs by it.
constexpr int kHcSiteStreamsAThread = 2;
int hc_site_streams();
struct HcSite {
  bool head = false;
  const int32_t* lanes = nullptr;
  float* X = nullptr;
  float* X_out = nullptr;  // has_post: the streams after the post (a buffer apart from X)
  int n = 0, hc = 0;
  int64_t d = 0;
  bool has_post = false;
  const float* Y = nullptr;
  const float *D = nullptr, *w = nullptr, *SH = nullptr;
  int k = 0;
  float *post = nullptr, *comb = nullptr;
  const uint8_t* fn = nullptr;
  int fn_type = 0;
  int64_t fn_row_bytes = 0;
  const float *scale = nullptr, *base = nullptr;
  float hc_eps = 0.0f, norm_eps = 0.0f;
  const float* norm_w = nullptr;
  float* U = nullptr;
  uint8_t* planes = nullptr;
  int64_t ldp = 0;
  uint8_t* scratch = nullptr;
  int scratch_rows = 0;
};
bool hc_site_takes(int hc, int64_t d, int fn_type);
uint64_t hc_site_scratch_bytes(int rows, int64_t d);
void hc_site(const HcSite& s, Stream st);
// comb [n][4][4] = Sinkhorn(comb) in place (hc_pre's), after hc_site wrote the logits.
void hc_comb(float* comb, int n, int iters, float hc_eps, Stream st);

// hc_head (spec §3.3) for the lanes lanes[0..n_out): out[j] = sum_i w_i X[lanes[j]][i], then (norm_w
// given) the output RMSNorm in place as in hc_pre.
void hc_head(const float* X, const int32_t* lanes, int n_out, int hc, int64_t d, const float* mix, int64_t mix_ld,
             const float* scale, const float* base, float hc_eps, float norm_eps, const float* norm_w, float* out,
             Stream s, uint8_t* planes = nullptr, int64_t ldp = 0);

// Per head of every lane: unweighted RMSNorm over head_dim, then the tail RoPE at pos (in place).
void q_heads(float* Q, int n, int n_head, int head_dim, int rope_dim, float eps, const int32_t* pos,
             const double* inv_freq, Stream s);

// The raw KV row of every lane: weighted RMSNorm, tail RoPE at pos, the FP8 round trip on the
// non-RoPE part when qat, then f16 into KV16[i] (the row the ring will hold).
void kv_finish(float* KV, int n, int head_dim, int rope_dim, const float* norm, float eps, const int32_t* pos,
               const double* inv_freq, bool qat, uint16_t* KV16, Stream s);

// Indexer queries: per head the tail RoPE at pos, then Hadamard + FP4 when qat; W[i][h] *= w_scale.
void idx_q_finish(float* Q, float* W, int n, int n_heads, int head_dim, int rope_dim, const int32_t* pos,
                  const double* inv_freq, bool qat, float w_scale, Stream s);

// Z[i][k] += ape[pos[i] % ratio][k] for k < width (ape: an F32/F16/BF16 matrix [width, ratio]).
void add_ape(float* Z, int64_t ldz, int n, int64_t width, const TensorView& ape, int ratio, const int32_t* pos,
             Stream s);

// MoE routing (spec §5.1) per lane: ids (selection order) and weights. hash: tid2eid[token];
// else the top-k of sqrt(softplus(logit)) + bias, ties to the lower expert id.
void route(const float* logits, int n, int n_expert, int k, bool hash, const int32_t* tid2eid, const int32_t* tokens,
           const float* bias, bool norm, float scale, int32_t* ids, float* weights, Stream s);

// G[r] = silu(min(G[r], L)) * clamp(U[r], -L, L) (no clamp when limit <= 0), rows x width.
void swiglu(float* G, const float* U, int64_t rows, int64_t width, float limit, Stream s, uint8_t* planes = nullptr,
            int64_t ldp = 0);


// --- paged_ops.cu ------------------------------------------------------------------------------

// One compressor of one layer (spec §4.4) over the step's lanes, each slot's lanes in order.
struct CompressorLaunch {
  float* states = nullptr;        // every slot's state floats
  int64_t state_per_slot = 0;     // floats per slot
  int64_t kv_off = 0;             // this compressor's value state inside a slot (score follows it)
  int rows = 0, width = 0;        // state rows and width (CSA 8 x 2c, HCA 128 x c)
  int ratio = 0, c = 0, rope_dim = 0;
  const float* k = nullptr;       // value projections [lane][ld]
  const float* z = nullptr;       // score projections (+ ape) [lane][ld]
  int64_t ld = 0;
  const float* norm = nullptr;
  float eps = 1e-6f;
  const double* inv_freq = nullptr;
  int qat = 0;                    // 0 none, 1 FP8 on [0, c - rope_dim), 2 Hadamard + FP4
  uint16_t* pages = nullptr;
  int64_t page_elems = 0;         // f16 elements per page
  int64_t row_off = 0;            // element offset of this layer's rows inside a page
};
// n lanes in n_groups slots; parallel: the prompt path (a block per finished block, then the state
// in a second launch) instead of a block per slot running its lanes in order. The same bits.
void compressor_update(const CompressorLaunch& a, const StepLanes& L, int n, int n_groups, bool parallel,
                       Stream s);

// Indexer scores I(t, s) = sum_h w_h ReLU(q_h . K_s) for s < (t+1)/4 of every lane that has more
// visible entries than top_k (others need none). scores: [lane][ld_scores].
void indexer_scores(const float* Q, const float* W, int n, int n_heads, int head_dim, const StepLanes& L,
                    const uint16_t* pages, int64_t page_elems, int64_t row_off, int top_k, int max_vis,
                    float* scores, int64_t ld_scores, Stream s);

// Per lane: the min(top_k, n_vis) best entries by (score desc, index asc), ascending, into
// sel[lane][..] (all entries when they fit).
void indexer_topk(const float* scores, int64_t ld_scores, int n, const int32_t* pos, int top_k, int32_t* sel,
                  int64_t ld_sel, Stream s);

// Gathered attention with the sink column (spec §4.6-4.7) over each lane's chronological
// history: the window positions max(0, t-127)..t (those before the lane's group start from the
// slot's ring, the others from this step's KV16 rows), then the compressed entries (HCA: all
// s < (t+1)/128; CSA: sel, or all when they fit), then the inverse tail RoPE of the output.
struct AttentionLaunch {
  const float* q = nullptr;       // [lane][n_head][head_dim]
  float* out = nullptr;           // same shape
  const uint16_t* kv16 = nullptr; // this step's raw rows [lane][head_dim]
  const uint16_t* ring = nullptr; // this layer's rings [slot][128][head_dim]
  const uint16_t* pages = nullptr;
  int64_t page_elems = 0, row_off = 0;
  int ratio = 0, top_k = 0;
  const int32_t* sel = nullptr;   // CSA selections [lane][ld_sel]
  int64_t ld_sel = 0;
  const float* sinks = nullptr;
  int n_head = 0, head_dim = 0, rope_dim = 0;
  const double* inv_freq = nullptr;
  int max_keys = 0;               // bound on any lane's key count this step (sizes shared memory and the grid)
  float* part = nullptr;          // split scratch, attention_part_floats(n, n_head, head_dim) floats
  float* part_stats = nullptr;    // set by attention_paged (inside part)
  // Planes of out for the grouped output projection's integer products (xplanes.cuh; null: none):
  // head h of lane i is a piece of member h / heads_per_member's column i, the columns of all lanes
  // member by member, planes_ld bytes apart (matvec_batched's layout). head_dim % 32 == 0.
  uint8_t* planes = nullptr;
  int64_t planes_ld = 0;
  int heads_per_member = 0;
  // q_raw: q holds q_b's rows as they are, and each split block first applies q_heads' per-head
  // RMSNorm (eps q_eps) and tail RoPE (at the lane's position) to its heads in shared memory: the
  // bits q_heads would give them, one launch fewer (pass 18). q itself is left as it is.
  bool q_raw = false;
  float q_eps = 0.0f;
  int split_min = 0;  // the fewest keys a split (rowops.cuh attn_split_keys): set by attention_paged
  bool early = true;  // set by attention_paged from attn_early()
};
// Each lane's keys are split over up to 8 blocks per head group (the split depends on the lane's own
// key count only), then a second kernel merges the splits per (lane, head) in a fixed order.
void attention_paged(const AttentionLaunch& a, const StepLanes& L, int n, Stream s);
// Measurement settings of the attention's launch (process-wide: testing::set_attn_heads and
// set_attn_split_min, ds4_gpu.h; the engine keys its graphs by both).
// - Heads a split block: 0 the rule (two for one or two lanes, else four), else 1, 2 or 4. The same bits.
// - The fewest keys a split: kAttnSplitKeys (64) by default, 8..256 in steps of 8. It changes the
//   bits, the same way in decode and prompt steps, so each contract holds within one setting.
// - Step-input work before the grid wait (pass 41; DS4_GPU_ATTN_EARLY=0 puts it after, read once a
//   process, for measurement): the split kernel's key rows and the combine's RoPE table. The same bits.
bool attn_early();
int attn_heads_setting();
int attn_heads_a_block(int n_lanes);  // what a launch of n_lanes lanes asks for
int attn_split_min();
// The heads a split block a launch takes: the largest of 4, 2 and 1 that it asks for
// (attn_heads_a_block), that n_head allows and whose shared memory fits(hb); 0 where none fits.
template <class Fits>
int attn_heads_that_fit(int n_lanes, int n_head, Fits fits) {
  const int want = attn_heads_a_block(n_lanes);
  for (int hb : {4, 2})
    if (want >= hb && n_head >= hb && fits(hb)) return hb;
  return fits(1) ? 1 : 0;
}
// Floats of AttentionLaunch::part for n_lanes lanes (the split partials and their max / sum).
int64_t attention_part_floats(int n_lanes, int n_head, int head_dim);
// Before attention_paged (engines call it at construction): lets its kernels use the device's
// opt-in shared memory (a function attribute, to be set outside any graph capture).
void attention_prepare();

// The ring rows of this step's lanes (after attention): ring[slot][t % 128] = KV16[i], for the
// last 128 positions of each slot in the step.
void ring_store(uint16_t* ring, const uint16_t* kv16, int n, int head_dim, const StepLanes& L, Stream s);

}  // namespace ds4::gpu
