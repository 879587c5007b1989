// The MoE routing's device bodies (spec §5.1), shared by their own launches and the fused router
// (matvec.cu router_route_kernel, pass 18):
//   route_lane         one warp routes one lane: its expert ids in selection order and weights;
//   build_parts_block  one block sorts the step's (lane, selection) pairs by expert into parts of at
//                      most max_part pairs (the grouped expert products' work list).
// Both are integer or per-lane float arithmetic in a fixed order: whichever launch runs them, and
// with however many threads, they write the same bytes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "matvec.cuh"  // ExpertPartDev
#include "rowops.cuh"  // softplus_dev
#include "step_ops.h"  // kMaxExpertUsed

namespace ds4::gpu {

// What route_lane needs besides the lane: the spec's routing inputs and where it writes.
struct RouteArgs {
  int n_expert = 0, k_used = 0, hash = 0, norm = 0;
  float wscale = 1.0f;
  const int32_t* tid2eid = nullptr;  // hash layers: [n_vocab, k_used]
  const int32_t* tokens = nullptr;   // the lanes' tokens
  const float* bias = nullptr;       // [n_expert]
  int32_t* ids = nullptr;            // [lanes, k_used]
  float* weights = nullptr;          // [lanes, k_used]
};

// The routing inputs as route_lane takes them; throws on counts its kernels do not take.
inline RouteArgs route_args(int n_expert, int k, bool hash, const int32_t* tid2eid, const int32_t* tokens,
                            const float* bias, bool norm, float scale, int32_t* ids, float* weights) {
  if (k < 1 || k > kMaxExpertUsed)
    throw std::invalid_argument("GPU route: n_expert_used must be 1.." + std::to_string(kMaxExpertUsed));
  if (n_expert < 1 || n_expert > 4096) throw std::invalid_argument("GPU route: n_expert must be 1..4096");
  RouteArgs a;
  a.n_expert = n_expert;
  a.k_used = k;
  a.hash = hash ? 1 : 0;
  a.norm = norm ? 1 : 0;
  a.wscale = scale;
  a.tid2eid = tid2eid;
  a.tokens = tokens;
  a.bias = bias;
  a.ids = ids;
  a.weights = weights;
  return a;
}

// One warp's shared scratch for route_lane.
struct RouteShared {
  int32_t chosen[kMaxExpertUsed];
  float w[kMaxExpertUsed];
  float den;
};

// A score as an unsigned key in the same order (-0 as +0, so the two tie as the float compare
// has them).
__device__ __forceinline__ uint32_t route_key(float v) {
  const uint32_t b = ds4_float_to_bits(v + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The warp's best of the lanes' candidates (bv, be; be < 0: none): the largest score, then the
// lower expert id (the CPU's '>' scan), -1 if no lane has one. Every lane gets it: the largest
// key over the warp, then the smallest id among the lanes that hold it (pass 40: two warp
// reductions, one instruction each on CUDA, where a butterfly of value-and-id pairs took ten
// dependent shuffles).
__device__ __forceinline__ int route_best(float bv, int be) {
  const uint32_t key = be >= 0 ? route_key(bv) : 0u;
  const uint32_t top = ds4_warp_reduce_u32<true>(key);
  const uint32_t id = ds4_warp_reduce_u32<false>(be >= 0 && key == top ? static_cast<uint32_t>(be) : 0xffffffffu);
  return id == 0xffffffffu ? -1 : static_cast<int>(id);
}

// A hash layer's experts of lane i into chosen[k_used] by the calling warp (tid2eid is a weight and
// the tokens are step inputs, so a launch may read them before its grid wait).
__device__ __forceinline__ void route_hash_ids(const RouteArgs& a, int i, int32_t* chosen) {
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  for (int k = lane; k < a.k_used; k += DS4_WARP)
    chosen[k] = a.tid2eid[static_cast<int64_t>(a.tokens[i]) * a.k_used + k];
}

// Lane i's route by the calling warp from its router logits lg[n_expert] (read from L2: in the
// fused router they were written during the same launch), after route_hash_ids on a hash layer.
// Each expert's weight sqrt(softplus(logit)) and score (the weight + bias) are computed once, into
// registers: warp lane l holds experts l, l + 32, ... (R of them, R * 32 >= n_expert). Then K arg-max
// passes: each lane takes the best of its experts not yet chosen (in increasing id order, a strict
// '>' keeping the earlier), route_best picks the warp's best (ties to the lower id), and the lane
// owning it marks it taken in its bit mask and gives its weight. Lane 0 sums the weights in
// selection order. A hash layer's weights are read for its given experts. ids_copy (or null): a
// second place for the ids (the fused router's shared memory, which its parts read).
// (Until pass 16 the scores sat in shared memory and each pass checked every candidate against
// the experts chosen so far: the same comparisons in the same order, but 24 us of a C=1 step's
// critical path for 256 experts against 4 us for a hash-routed layer. Until pass 40 the chosen
// experts' logits were read again from L2 for their weights: the same bits, one more round trip.)
template <int R>
__device__ __forceinline__ void route_lane(const RouteArgs& a, int i, const float* lg, RouteShared& sh,
                                           int32_t* ids_copy = nullptr) {
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  if (!a.hash) {
    // The R logits and biases first, every load in flight at once (an expert past n_expert loads
    // expert 0's and drops it), then the arithmetic. With each load inside its expert's branch
    // (softplus's ranges, e < n_expert) ptxas issued it after the previous expert's arithmetic: 2 R
    // dependent round trips to L2, ~7 us of a C = 1 step's non-hash router (pass 41).
    float score[R], weight[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int e = lane + DS4_WARP * j < a.n_expert ? lane + DS4_WARP * j : 0;
      weight[j] = ds4_ldcg(lg + e);
      score[j] = a.bias[e];
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool in = lane + DS4_WARP * j < a.n_expert;
      weight[j] = in ? sqrtf(softplus_dev(weight[j])) : 0.0f;
      score[j] = in ? weight[j] + score[j] : 0.0f;
    }
    uint32_t taken[(R + 31) / 32] = {};  // bit j % 32 of word j / 32: expert lane + 32 j is chosen
    for (int k = 0; k < a.k_used; ++k) {
      float bv = 0.0f;
      int be = -1;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const int e = lane + DS4_WARP * j;
        if (e < a.n_expert && !((taken[j / 32] >> (j % 32)) & 1u) && (be < 0 || score[j] > bv)) {
          bv = score[j];
          be = e;
        }
      }
      be = route_best(bv, be);
      if (be >= 0 && be % DS4_WARP == lane) {
        const int jb = be / DS4_WARP;
        float wb = weight[0];
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (jb == j) taken[j / 32] |= 1u << (j % 32);
          wb = jb == j ? weight[j] : wb;
        }
        sh.w[k] = wb;
      }
      if (lane == 0) {
        sh.chosen[k] = be;
        if (be < 0) sh.w[k] = 0.0f;  // fewer experts than k_used: the pass found none
      }
    }
  } else {
    ds4_syncwarp();  // route_hash_ids' ids
    for (int k = lane; k < a.k_used; k += DS4_WARP) sh.w[k] = sqrtf(softplus_dev(ds4_ldcg(lg + sh.chosen[k])));
  }
  ds4_syncwarp();
  if (lane == 0) {
    float sum = 0.0f;
    for (int k = 0; k < a.k_used; ++k) sum += sh.w[k];
    sh.den = a.norm ? fmaxf(sum, 6.103515625e-5f) : 1.0f;
  }
  ds4_syncwarp();
  for (int k = lane; k < a.k_used; k += DS4_WARP) {
    a.ids[i * a.k_used + k] = sh.chosen[k];
    a.weights[i * a.k_used + k] = sh.w[k] / sh.den * a.wscale;
    if (ids_copy != nullptr) ids_copy[i * a.k_used + k] = sh.chosen[k];
  }
}

// Shared memory build_parts_block takes: three ints an expert and one, then two a thread; with
// warp_counts, a table of an int an expert a warp after them.
__host__ __device__ constexpr int build_parts_smem(int n_expert, int threads, bool warp_counts = false) {
  return 4 * (3 * n_expert + 1 + 2 * threads + (warp_counts ? threads / DS4_WARP * n_expert : 0));
}

// Sort the pairs by expert (stably) into parts of at most max_part pairs, with the block's THREADS
// threads (smem: build_parts_smem(n_expert, THREADS, warp_counts) bytes). pair_expert was written by
// an earlier launch or by this block before a block barrier. Integer counts, scans and ranks: the
// same bytes whatever THREADS is, with or without warp_counts.
//
// A pair's rank among its expert's pairs (`before`) is the count of the earlier pairs with the same
// expert. Until pass 21 each thread counted them by walking every earlier pair, O(n_pairs^2): 10.7 ms
// of a 2048-row prompt step (12,288 pairs). Now the block takes the pairs THREADS at a time in
// order: a pair's earlier pairs are those of the chunks before (a running count per expert, `seen`),
// those of the earlier warps in its chunk and those of the earlier lanes of its warp (the match
// mask's lanes below it). The earlier warps' pairs: with warp_counts, each warp's count of each of
// its experts in a table (written by the expert's first lane in the warp, read by the later warps,
// cleared by its writer after the chunk: a read a warp); else a walk of the chunk's experts in
// shared memory (up to THREADS - 32 reads a thread: 111 us a 2048-row launch at 256 threads, pass
// 40 call 2). The same integer either way, so the same bytes.
template <int THREADS>
__device__ __forceinline__ void build_parts_block(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part,
                                                  int32_t* __restrict__ sorted, ExpertPartDev* __restrict__ parts,
                                                  int32_t* __restrict__ n_parts, int32_t* sm,
                                                  bool warp_counts = false) {
  static_assert(THREADS % DS4_WARP == 0, "build_parts_block: whole warps");
  int32_t* cnt = sm;                        // [n_expert] pairs per expert; then `seen`
  int32_t* less = sm + n_expert;            // [n_expert + 1] pairs with a smaller expert
  int32_t* pbefore = less + n_expert + 1;   // [n_expert] parts of smaller experts
  int32_t* run_pairs = pbefore + n_expert;  // [THREADS]; then a chunk's experts
  int32_t* run_parts = run_pairs + THREADS;  // [THREADS]
  int32_t* wcnt = run_parts + THREADS;       // with warp_counts: [THREADS / 32][n_expert], zero between chunks
  const int t = static_cast<int>(threadIdx.x);
  for (int e = t; e < n_expert; e += THREADS) cnt[e] = 0;
  if (warp_counts)
    for (int j = t; j < THREADS / DS4_WARP * n_expert; j += THREADS) wcnt[j] = 0;
  __syncthreads();
  // pair_expert may be in shared memory (the fused router's), so the compiler cannot move a load
  // past an atomic: 4 loads first, then their 4 counts.
  constexpr int kCountBatch = 4;
  for (int p0 = t; p0 < n_pairs; p0 += kCountBatch * THREADS) {
    int eb[kCountBatch];
#pragma unroll
    for (int j = 0; j < kCountBatch; ++j) eb[j] = p0 + j * THREADS < n_pairs ? pair_expert[p0 + j * THREADS] : -1;
#pragma unroll
    for (int j = 0; j < kCountBatch; ++j)
      if (eb[j] >= 0 && eb[j] < n_expert) atomicAdd(&cnt[eb[j]], 1);
  }
  __syncthreads();
  // Exclusive prefix sums of the pair and part counts over the experts: each thread sums its own
  // run of experts, a scan over the threads' totals (integers: exact in any order) gives each run's
  // start, and the thread walks its run again writing the starts. The scan: within each warp by
  // shuffles, then each thread adds the totals of the warps before its own (one barrier, where a
  // scan through shared memory took two a round: 16 at 256 threads, on the fused router's C = 1 chain).
  const int per = (n_expert + THREADS - 1) / THREADS;
  const int e0 = t * per, e1 = min(n_expert, e0 + per);
  const int lane = t % DS4_WARP, wbase = t - lane;
  int32_t my_pairs = 0, my_parts = 0;
  for (int e = e0; e < e1; ++e) {
    my_pairs += cnt[e];
    my_parts += (cnt[e] + max_part - 1) / max_part;
  }
  int32_t in_pairs = my_pairs, in_parts = my_parts;  // inclusive sums over the warp's threads up to t
  for (int off = 1; off < DS4_WARP; off <<= 1) {
    const int src = lane >= off ? lane - off : lane;
    const int32_t a = ds4_shfl(in_pairs, src), b = ds4_shfl(in_parts, src);
    if (lane >= off) {
      in_pairs += a;
      in_parts += b;
    }
  }
  if (lane == DS4_WARP - 1) {
    run_pairs[t / DS4_WARP] = in_pairs;  // the warp's totals
    run_parts[t / DS4_WARP] = in_parts;
  }
  __syncthreads();
  for (int w = 0; w < t / DS4_WARP; ++w) {
    in_pairs += run_pairs[w];
    in_parts += run_parts[w];
  }
  int32_t below = in_pairs - my_pairs, pb = in_parts - my_parts;
  for (int e = e0; e < e1; ++e) {
    less[e] = below;
    pbefore[e] = pb;
    below += cnt[e];
    pb += (cnt[e] + max_part - 1) / max_part;
  }
  if (t == THREADS - 1) {
    *n_parts = in_parts;
    less[n_expert] = in_pairs;
  }
  __syncthreads();  // cnt and run_pairs are free: every thread read them before this barrier
  int32_t* seen = cnt;         // [n_expert] pairs of each expert in the chunks before
  int32_t* chunk = run_pairs;  // [THREADS] the chunk's experts (-1: no valid pair)
  for (int e = t; e < n_expert; e += THREADS) seen[e] = 0;
  const int warp = t / DS4_WARP;
  int pe_next = t < n_pairs ? pair_expert[t] : -1;  // each chunk loads the next one's expert
  for (int c0 = 0; c0 < n_pairs; c0 += THREADS) {
    const int p = c0 + t;
    const int pe = pe_next;
    pe_next = p + THREADS < n_pairs ? pair_expert[p + THREADS] : -1;
    const int e = pe >= 0 && pe < n_expert ? pe : -1;  // an invalid route is left out of every part
    const uint32_t mates = ds4_match_mask(e);          // this warp's lanes with the same expert
    const int below = __popc(mates & ((1u << lane) - 1u));
    if (!warp_counts) chunk[t] = e;
    else if (e >= 0 && below == 0) wcnt[warp * n_expert + e] = __popc(mates);
    __syncthreads();  // the chunk's experts or the warps' counts; the chunks before counted into seen
    // The earlier warps' pairs of this chunk (past the last pair every chunk entry is -1: no match
    // for a valid e, and an invalid e's count is not used), then the earlier lanes' of this warp.
    int same = below;
    if (warp_counts) {
      if (e >= 0)
        for (int w = 0; w < warp; ++w) same += wcnt[w * n_expert + e];
    } else {
      const int qn = min(wbase, n_pairs - c0);
      for (int q = 0; q < qn; ++q) same += chunk[q] == e;
    }
    const int before = e >= 0 ? seen[e] + same : 0;
    __syncthreads();  // every thread read chunk (or the counts) and seen
    if (warp_counts) {
      if (e >= 0 && below == 0) wcnt[warp * n_expert + e] = 0;
      ds4_syncwarp();  // the clears before this warp's next counts
    }
    if (e < 0) continue;
    atomicAdd(&seen[e], 1);
    const int rank = less[e] + before;
    sorted[rank] = p;
    if (before % max_part == 0) {
      ExpertPartDev pt;
      pt.expert = e;
      pt.first = rank;
      pt.count = min(max_part, less[e + 1] - less[e] - before);
      parts[pbefore[e] + before / max_part] = pt;
    }
  }
}

}  // namespace ds4::gpu
