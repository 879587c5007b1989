// Per-lane operations of the DS4 step (step_ops.h), each the CPU executor's operation with the
// same formulas (ext/engine/mhc.cpp, ops.cpp, moe.cpp) and a lane-local fixed order.
//
// hc_pre             grid (2, n), 1024 threads (hc_mix_kernel): both blocks of a lane compute rho
//                    over the hc*d state (double, 16 loads in flight a thread); block 0 then
//                    u = sum_j pre_j X[j] and the attn/ffn RMSNorm of u (fused: one launch fewer);
//                    block 1, at the same time, post and comb (Sinkhorn with one lane per matrix
//                    entry when hc*hc <= 32, else one thread). Bytes: the state twice per block
//                    (8 hc d, the second from L2), u out (4 d). (Before: one block of 256 threads
//                    ran rho, Sinkhorn, u in series, then a separate rms_norm: 14 + 3 us.)
// hc_post            grid (d/256, n), one element a thread; comb and post in shared. Bytes: 8 hc d +
//                    4 d. (One block a lane left it latency-bound: 22 us a call.) After the FFN
//                    (hc_post_moe) y is the MoE combine, computed in place of reading it: one
//                    launch fewer a layer.
// hc_head            grid (1, n_out), hc_mix_kernel's block 0 without Sinkhorn, output_norm fused.
// hc_site            pass 17, the fused site (GpuEngine.use_hc_fused): hc_site_sums grid (4 d/256,
//                    rows / 1 or 8), the post and the block sums of the projection and rho; then
//                    hc_site_pre grid (d/256 or 1, rows), hc_pre's work from those sums (the
//                    kernels' own comment). hc_comb grid n, a warp: the Sinkhorn, on the side branch.
//                    Bytes: as hc_post + the projection + hc_mix, X re-read from L2 by each pre block.
// q_heads            grid n * n_head, 256 threads: RMSNorm then RoPE on one head, in place.
// kv_finish          grid n: RMSNorm(kv_norm), RoPE, FP8 (qat), f16 out. Bytes: 4+2 per element.
// idx_q_finish       grid n * heads: RoPE, Hadamard + FP4 (qat) per indexer head, in place.
// add_ape            grid n: one ape row decoded and added. Bytes: 8 + 2..4 per element.
// route              grid n, one warp: the scores once into registers (E / 32 a lane), then K passes
//                    of a strict arg-max over the experts not yet taken (ties to the lower id; a bit
//                    mask a lane marks its taken ones), weights in selection order. Bytes: 4 E per
//                    lane. (Scoring every expert in every pass: 8 us a call; the scores in shared
//                    memory and each candidate checked against the chosen ones: 24 us, pass 16.)
//                    The body is routing.cuh route_lane, which the fused router (matvec.cu) runs too.
// swiglu             grid-stride over rows x width. Bytes: 12 per element.
// moe_value          (no launch of its own) the MoE output, hc_post_moe's y: the weighted expert sum
//                    in selection order, plus the shared expert.
#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "launch.cuh"
#include "matvec.cuh"  // the ggml type ids kF32, kF16, kBF16
#include "routing.cuh"
#include "rowops.cuh"
#include "step_ops.h"

namespace ds4::gpu {

namespace {

__device__ void col_normalize(float* c, int n, float eps) {
  for (int k = 0; k < n; ++k) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) sum += c[j * n + k];
    const float dd = sum + eps;
    for (int j = 0; j < n; ++j) c[j * n + k] /= dd;
  }
}

// ops.cpp sinkhorn on an n x n row-major matrix (one thread).
__device__ void sinkhorn_dev(float* c, int n, int iters, float eps) {
  for (int j = 0; j < n; ++j) {
    float* row = c + j * n;
    float mx = row[0];
    for (int k = 1; k < n; ++k) mx = fmaxf(mx, row[k]);
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) {
      row[k] = expf(row[k] - mx);
      sum += row[k];
    }
    for (int k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
  }
  col_normalize(c, n, eps);
  for (int it = 1; it < iters; ++it) {
    for (int j = 0; j < n; ++j) {
      float* row = c + j * n;
      float sum = 0.0f;
      for (int k = 0; k < n; ++k) sum += row[k];
      const float dd = sum + eps;
      for (int k = 0; k < n; ++k) row[k] /= dd;
    }
    col_normalize(c, n, eps);
  }
}

// sinkhorn_dev with one lane per entry of the n x n matrix (n * n <= 32; the whole warp calls it):
// lane l holds v = c[l / n][l % n] (lanes past n * n mirror entry 0). Each row or column sum is
// gathered by shuffles in the order the single thread adds (k = 0, 1, ...), and every lane then
// applies the same operation to its entry, so each entry sees exactly the single-thread sequence
// of roundings: the same bits, in 2 * iters short shuffle rounds instead of a serial walk.
__device__ float sinkhorn_warp(float v, int n, int iters, float eps) {
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int l = lane < n * n ? lane : 0;
  const int j = l / n, k = l % n;
  float mx = ds4_shfl(v, j * n);
  for (int t = 1; t < n; ++t) mx = fmaxf(mx, ds4_shfl(v, j * n + t));
  v = expf(v - mx);
  float sum = 0.0f;
  for (int t = 0; t < n; ++t) sum += ds4_shfl(v, j * n + t);
  v = v / sum + eps;
  auto col_norm = [&]() {
    float cs = 0.0f;
    for (int t = 0; t < n; ++t) cs += ds4_shfl(v, t * n + k);
    const float dd = cs + eps;
    v /= dd;
  };
  col_norm();
  for (int it = 1; it < iters; ++it) {
    float rs = 0.0f;
    for (int t = 0; t < n; ++t) rs += ds4_shfl(v, j * n + t);
    const float dd = rs + eps;
    v /= dd;
    col_norm();
  }
  return v;
}

// mHC pre and hc_head, with the RMSNorm that follows each fused in. grid (parts, rows) x 1024
// threads; row j reads lane lanes[j] (lanes null: lane j). Both parts first compute rho over the
// lane's hc * d state (double, strided threads with 16 loads in flight, then the 32-warp tree).
// Part 0: pre_k = sigmoid(scale0 * rho * mix_k + base_k) + hc_eps, u = sum_k pre_k X[k] (k in
// order), then, when norm_w is given, U = (u * r) * norm_w with r from u's sum of squares (the
// RMSNorm formula). Part 1 (hc_pre only): post and comb (Sinkhorn, one lane per matrix entry when
// hc * hc <= 32, else one thread), in parallel with part 0 instead of after it.
// HC > 0: hc known at compile time (the streams' loads batched); 0: run time.
template <int HC>
__global__ void __launch_bounds__(kWideThreads)
    hc_mix_kernel(const float* __restrict__ X, const int32_t* __restrict__ lanes, int hc_rt, int64_t d,
                  const float* __restrict__ mix, int64_t mix_ld, const float* __restrict__ scale,
                  const float* __restrict__ base, int iters, float hc_eps, float norm_eps,
                  const float* __restrict__ norm_w, float* __restrict__ U, float* __restrict__ post,
                  float* __restrict__ comb, uint8_t* __restrict__ planes, int64_t ldp) {
  ds4_grid_begin();
  const int hc = HC > 0 ? HC : hc_rt;
  extern __shared__ float u_s[];  // [d]: u before its norm (part 0 with norm_w)
  __shared__ double red[kWideWarps];
  __shared__ float pre_s[kMaxHcDev];
  __shared__ float c_s[kMaxHcDev * kMaxHcDev];
  const int row = static_cast<int>(blockIdx.y);
  const int i = lanes ? lanes[row] : row;
  const int tid = static_cast<int>(threadIdx.x);
  const float* x = X + static_cast<int64_t>(i) * hc * d;
  const int64_t hd_total = static_cast<int64_t>(hc) * d;
  const double ss = block_sum_wide(strided_sumsq(x, hd_total, tid, kWideThreads), red);
  const float rho = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(hd_total) + static_cast<double>(norm_eps)));
  const float* raw = mix + static_cast<int64_t>(i) * mix_ld;

  if (blockIdx.x == 1) {  // post and comb; the block's other warps are done
    if (tid < DS4_WARP) {
      const int lane = tid;
      for (int k = lane; k < hc; k += DS4_WARP)
        post[i * hc + k] = 2.0f * sigmoid_dev(scale[1] * (rho * raw[hc + k]) + base[hc + k]);
      if (hc * hc <= DS4_WARP) {
        float v = 0.0f;
        if (lane < hc * hc) v = scale[2] * (rho * raw[2 * hc + lane]) + base[2 * hc + lane];
        v = sinkhorn_warp(v, hc, iters, hc_eps);
        if (lane < hc * hc) comb[i * hc * hc + lane] = v;
      } else if (lane == 0) {
        for (int k = 0; k < hc * hc; ++k) c_s[k] = scale[2] * (rho * raw[2 * hc + k]) + base[2 * hc + k];
        sinkhorn_dev(c_s, hc, iters, hc_eps);
        for (int k = 0; k < hc * hc; ++k) comb[i * hc * hc + k] = c_s[k];
      }
    }
    return;
  }

  if (tid < hc) pre_s[tid] = sigmoid_dev(scale[0] * (rho * raw[tid]) + base[tid]) + hc_eps;
  __syncthreads();
  float pre[HC > 0 ? HC : 1];
  if constexpr (HC > 0) {
#pragma unroll
    for (int s = 0; s < HC; ++s) pre[s] = pre_s[s];
  }
  float* u = U + static_cast<int64_t>(row) * d;
  double uss = 0.0;
#pragma unroll 4
  for (int64_t k = tid; k < d; k += kWideThreads) {
    float acc = 0.0f;
    if constexpr (HC > 0) {
#pragma unroll
      for (int s = 0; s < HC; ++s) acc += pre[s] * x[s * d + k];
    } else {
      for (int s = 0; s < hc; ++s) acc += pre_s[s] * x[s * d + k];
    }
    if (norm_w) {
      u_s[k] = acc;
      uss += static_cast<double>(acc) * acc;
    } else {
      u[k] = acc;
    }
  }
  if (norm_w) {  // the same for the whole block
    const double ut = block_sum_wide(uss, red);
    const float r = static_cast<float>(1.0 / sqrt(ut / static_cast<double>(d) + static_cast<double>(norm_eps)));
    for (int64_t k = tid; k < d; k += kWideThreads) u[k] = (u_s[k] * r) * norm_w[k];
  }
  if (planes != nullptr) {  // the integer products' planes of the row (xplanes.cuh)
    __syncthreads();
    unit_planes_of_row(u, d, planes + static_cast<int64_t>(row) * ldp);
  }
}

// The MoE output of lane i's element x (spec §5): the routed experts' outputs D (k_used rows of d a
// lane) weighted by w and summed in selection order, each weighted output rounded as the CPU stores
// it, plus the shared expert's SH (null: none).
struct MoeSum {
  const float* D = nullptr;
  const float* w = nullptr;
  const float* SH = nullptr;
  int k_used = 0;
};

__device__ __forceinline__ float moe_value(const MoeSum& m, int64_t d, int i, int64_t x) {
  const float* wi = m.w + static_cast<int64_t>(i) * m.k_used;
  const float* di = m.D + static_cast<int64_t>(i) * m.k_used * d;
  float acc = wi[0] * di[x];
  for (int k = 1; k < m.k_used; ++k) {
    const float t = wi[k] * di[k * d + x];
    acc += t;
  }
  return m.SH ? acc + m.SH[static_cast<int64_t>(i) * d + x] : acc;
}

// Element e of the mHC post on a lane's streams x (in place): x[k][e] = post_k y + sum_j
// comb[j][k] x[j][e], j in order; hc_post_one is stream k's (hc_post_kernel and hc_site_kernel: the
// same bits).
// HC > 0: hc_mult known at compile time (the streams stay in registers); 0: hc is a run-time value.
template <int HC>
__device__ __forceinline__ float hc_post_one(const float (&old)[HC > 0 ? HC : kMaxHcDev], int hc, int k, float ye,
                                             const float* post_s, const float* c_s) {
  float acc = post_s[k] * ye;
#pragma unroll
  for (int j = 0; j < (HC > 0 ? HC : kMaxHcDev); ++j)
    if (j < hc) acc += c_s[j * hc + k] * old[j];
  return acc;
}

template <int HC>
__device__ __forceinline__ void hc_post_element(float* x, int hc_rt, int64_t d, int64_t e, float ye,
                                                const float* post_s, const float* c_s) {
  const int hc = HC > 0 ? HC : hc_rt;
  float old[HC > 0 ? HC : kMaxHcDev];
#pragma unroll
  for (int j = 0; j < (HC > 0 ? HC : kMaxHcDev); ++j)
    if (j < hc) old[j] = x[j * d + e];
#pragma unroll
  for (int k = 0; k < (HC > 0 ? HC : kMaxHcDev); ++k)
    if (k < hc) x[k * d + e] = hc_post_one<HC>(old, hc, k, ye, post_s, c_s);
}

// moe.D given: y is moe_value (after the FFN), else Y's row (after the attention).
template <int HC>
__global__ void __launch_bounds__(kRowThreads)
    hc_post_kernel(float* __restrict__ X, int hc_rt, int64_t d, const float* __restrict__ Y,
                   const float* __restrict__ post, const float* __restrict__ comb, const MoeSum moe) {
  ds4_grid_begin();
  const int hc = HC > 0 ? HC : hc_rt;
  __shared__ float post_s[kMaxHcDev];
  __shared__ float c_s[kMaxHcDev * kMaxHcDev];
  const int i = static_cast<int>(blockIdx.y);
  if (threadIdx.x < hc) post_s[threadIdx.x] = post[i * hc + threadIdx.x];
  for (int k = threadIdx.x; k < hc * hc; k += kRowThreads) c_s[k] = comb[i * hc * hc + k];
  __syncthreads();
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (e >= d) return;
  float* x = X + static_cast<int64_t>(i) * hc * d;
  const float ye = moe.D != nullptr ? moe_value(moe, d, i, e) : Y[static_cast<int64_t>(i) * d + e];
  hc_post_element<HC>(x, hc, d, e, ye, post_s, c_s);
}

// A weight of the mHC projection (hc.fn: F16, BF16 or F32 rows).
template <int WT>
__device__ __forceinline__ float fn_weight(const uint8_t* __restrict__ row, int64_t j) {
  if constexpr (WT == kF32) return ds4_ldg(reinterpret_cast<const float*>(row) + j);
  const uint32_t h = ds4_ldg(reinterpret_cast<const uint16_t*>(row) + j);
  if constexpr (WT == kF16) return half_bits_to_float(h);
  return bf16_bits_to_float(h);
}

// One mHC site in two launches (pass 17; step_ops.h hc_site), instead of hc_post, the projection's
// matvec and hc_mix. HC = 4 streams, 256 threads a block; row j of the call runs lane lanes[j] (or j).
//
// hc_site_sums_kernel, grid (nb = (HC / SP) ceil(d / 256), rows / R; R = 8 rows a block from kHcSitePromptRows
// rows, each applying the block's weights, loaded once, else 1), SP streams a thread (hc_site_streams(): 1 or 2):
// block b takes streams k = SP (b / (nb SP / HC)) .. k + SP - 1 and elements e = 256 (b % (nb SP / HC)) + t: for
// each, x = X[i][k][e] after the post of the sublayer that ends here (has_post: hc_post_one, the hc_post kernel's
// bits, written to Xout: the other streams' blocks still read X), then the block's part of rho's sum of squares
// (double; a thread's SP squares in stream order) and of the projection, sum fn[r][k d + e] x for each of the MIX
// rows (a thread's SP products in stream order, then warp_sums's butterfly bits, then block_sum's tree), into
// part_ss / part_mix [j][b]. Two streams a thread read the lane's X row and its post input y once for both and
// halve the block sums; the bits differ from one stream a thread's (pass 39).
//
// hc_site_pre_kernel, grid (ceil(d / 256), rows), or (1, rows) from kHcSitePromptRows rows (whole_row: a block a
// row, X read once a row, every element's same arithmetic): every block adds the row's nb block sums in block order
// (the same bits in every block), then does hc_mix's work for its 256 elements: pre, u = sum_s pre_s X[s] over the
// whole row for the norm's sum of squares (each block the same, in the same order), and its slice of U = (u r) w
// and of U's planes. Block 0 writes post and comb's logits, which hc_comb takes through the Sinkhorn (a launch of
// its own, off the critical path).
// HEAD: hc_head's site (MIX = HC rows; U's row j is the head's input; no post or comb out).
// Every sum's order is fixed by d alone and a row reads only its own lane: batch invariant. The
// projection and rho add in another order than mv + hc_pre (the hc_fused switch's bits differ).
// Bytes: the post's (HC + 1 + MoE) d reads and HC d writes a lane, fn (MIX x HC d weights) a lane
// (from L2 after the first), X from L2 once a pre block (16 d bytes), U and its planes out.
struct HcSiteLaunch {
  HcSite site;  // as the caller gave it (step_ops.h)
  MoeSum moe;   // site's D, w, SH, k
  int nb;       // sum blocks a row
  double* part_ss;  // [rows][nb], in site.scratch
  float* part_mix;  // [rows][nb][MIX], after them
};

template <int WT, bool HEAD, int SP>
__global__ void __launch_bounds__(kRowThreads, SP == 1 ? 0 : 2)
    hc_site_sums_kernel(const HcSiteLaunch a, int rows, int rows_per_block) {
  constexpr int HC = kHcSiteStreams, MIX = HEAD ? HC : kHcSiteMix;
  static_assert(HC % SP == 0 && MIX <= DS4_WARP, "whole stream groups; a lane holds one sum at the end");
  __shared__ double red[kRowWarps];
  __shared__ float red_mix[kRowWarps][MIX];
  const int b = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  const int warp = tid / DS4_WARP, lane = tid % DS4_WARP;
  const int64_t d = a.site.d;
  const int slices = a.nb / (HC / SP), k0 = (b / slices) * SP;
  const int64_t e = static_cast<int64_t>(b % slices) * kRowThreads + tid;
  const int slot = warp_sums_slot<MIX>(lane);  // the projection row whose warp sum this lane ends with
  // The block's weights before the grid wait (constant data), so their latency hides behind the
  // previous kernel's tail; then applied to each of the block's rows in turn (every row the same
  // arithmetic, whichever block and however many rows a block: the same bits).
  float wt[SP][MIX];
#pragma unroll
  for (int s = 0; s < SP; ++s)
#pragma unroll
    for (int r = 0; r < MIX; ++r)
      wt[s][r] = e < d ? fn_weight<WT>(a.site.fn + r * a.site.fn_row_bytes, (k0 + s) * d + e) : 0.0f;
  ds4_grid_begin();
  const int row0 = static_cast<int>(blockIdx.y) * rows_per_block;
  for (int row = row0; row < row0 + rows_per_block && row < rows; ++row) {
    const int i = a.site.lanes != nullptr ? a.site.lanes[row] : row;
    const float* x = a.site.X + static_cast<int64_t>(i) * HC * d;
    float v[SP];
#pragma unroll
    for (int s = 0; s < SP; ++s) v[s] = 0.0f;
    if (e < d) {
      if (a.site.has_post) {  // post and comb of the lane: the same few values for every thread (L1)
        const float ye = a.moe.D != nullptr ? moe_value(a.moe, d, i, e) : a.site.Y[static_cast<int64_t>(i) * d + e];
        float old[HC];
#pragma unroll
        for (int j = 0; j < HC; ++j) old[j] = x[j * d + e];
#pragma unroll
        for (int s = 0; s < SP; ++s) {
          v[s] = hc_post_one<HC>(old, HC, k0 + s, ye, a.site.post + i * HC, a.site.comb + i * HC * HC);
          a.site.X_out[static_cast<int64_t>(i) * HC * d + (k0 + s) * d + e] = v[s];
        }
      } else {
#pragma unroll
        for (int s = 0; s < SP; ++s) v[s] = x[(k0 + s) * d + e];
      }
    }
    // The MIX warp sums by halving rounds (warp_sums: warp_sum's bits in about MIX shuffles, where 5 MIX
    // butterfly shuffles a row bounded the prompt step's sums kernel, pass 24).
    float acc[MIX];
#pragma unroll
    for (int r = 0; r < MIX; ++r) {
      acc[r] = wt[0][r] * v[0];
#pragma unroll
      for (int s = 1; s < SP; ++s) acc[r] = fmaf(wt[s][r], v[s], acc[r]);
    }
    warp_sums<MIX>(acc, lane);
    if (slot >= 0) red_mix[warp][slot] = acc[0];
    double sq = static_cast<double>(v[0]) * v[0];
#pragma unroll
    for (int s = 1; s < SP; ++s) sq = fma(static_cast<double>(v[s]), static_cast<double>(v[s]), sq);
    const double ss = block_sum(sq, red);  // its barrier also publishes red_mix
    const int64_t part = static_cast<int64_t>(row) * a.nb + b;
    if (tid == 0) a.part_ss[part] = ss;
    if (tid < MIX) {
      const float* m = &red_mix[0][tid];
      a.part_mix[part * MIX + tid] = ((m[0] + m[MIX]) + (m[2 * MIX] + m[3 * MIX])) +
                                     ((m[4 * MIX] + m[5 * MIX]) + (m[6 * MIX] + m[7 * MIX]));
    }
    __syncthreads();  // every thread is done with red_mix before the next row rewrites it
  }
}

// X's float4s a pre thread loads beside the block sums (d <= 4096 in one go; more in a loop after).
constexpr int kHcPreHeld = 4;

template <bool HEAD>
__global__ void __launch_bounds__(kRowThreads) hc_site_pre_kernel(const HcSiteLaunch a, bool whole_row) {
  constexpr int HC = kHcSiteStreams, MIX = HEAD ? HC : kHcSiteMix;
  // First the row's block sums (nb doubles, then nb x MIX floats), then u ([d / 4]).
  extern __shared__ float4 site_u[];
  __shared__ double red[kRowWarps];
  __shared__ float mix_s[MIX];
  __shared__ double ss_s;
  const int row = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
  const int64_t d = a.site.d, q4 = d / 4;
  // This block's 256 elements (64 float4s): thread t's norm weights before the grid wait (constant
  // data); a whole-row block loads the row's as it writes U.
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * (kRowThreads / 4);
  const bool early_w = !whole_row && a.site.norm_w && tid < kRowThreads / 4 && q0 + tid < q4;
  const float4 nw = early_w ? ds4_ldg(reinterpret_cast<const float4*>(a.site.norm_w) + q0 + tid)
                            : make_float4(1.f, 1.f, 1.f, 1.f);
  ds4_grid_begin();
  const int i = a.site.lanes != nullptr ? a.site.lanes[row] : row;
  const float* xi = (a.site.has_post ? a.site.X_out : a.site.X) + static_cast<int64_t>(i) * HC * d;
  const float4* x4 = reinterpret_cast<const float4*>(xi);
  float4 held[kHcPreHeld][HC];  // X's first float4s of the thread, loaded beside the block sums
#pragma unroll
  for (int c = 0; c < kHcPreHeld; ++c) {
    const int64_t q = tid + static_cast<int64_t>(c) * kRowThreads;
#pragma unroll
    for (int s = 0; s < HC; ++s) held[c][s] = q < q4 ? x4[s * q4 + q] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The block sums into shared memory at once (their loads all in flight), then added in block order.
  const int64_t p0 = static_cast<int64_t>(row) * a.nb;
  double* parts_ss = reinterpret_cast<double*>(site_u);
  float* parts_s = reinterpret_cast<float*>(parts_ss + a.nb);
  for (int j = tid; j < a.nb * MIX; j += kRowThreads) parts_s[j] = a.part_mix[p0 * MIX + j];
  for (int j = tid; j < a.nb; j += kRowThreads) parts_ss[j] = a.part_ss[p0 + j];
  __syncthreads();
  if (tid < MIX) {
    float m = parts_s[tid];
#pragma unroll 8
    for (int j = 1; j < a.nb; ++j) m += parts_s[j * MIX + tid];
    mix_s[tid] = m;
  } else if (tid == MIX) {
    double t = parts_ss[0];
#pragma unroll 8
    for (int j = 1; j < a.nb; ++j) t += parts_ss[j];
    ss_s = t;
  }
  __syncthreads();
  const float rho =
      static_cast<float>(1.0 / sqrt(ss_s / static_cast<double>(HC * d) + static_cast<double>(a.site.norm_eps)));
  if constexpr (!HEAD) {  // post, and comb's logits (hc_mix_kernel's part 1 before its Sinkhorn)
    if (blockIdx.x == 0) {
      if (tid < HC)
        a.site.post[i * HC + tid] =
            2.0f * sigmoid_dev(a.site.scale[1] * (rho * mix_s[HC + tid]) + a.site.base[HC + tid]);
      else if (tid >= DS4_WARP && tid < DS4_WARP + HC * HC)
        a.site.comb[i * HC * HC + tid - DS4_WARP] =
            a.site.scale[2] * (rho * mix_s[2 * HC + tid - DS4_WARP]) + a.site.base[2 * HC + tid - DS4_WARP];
    }
  }
  float pre[HC];  // (the barrier above ends the block sums' use of site_u)
#pragma unroll
  for (int s = 0; s < HC; ++s)
    pre[s] = sigmoid_dev(a.site.scale[0] * (rho * mix_s[s]) + a.site.base[s]) + a.site.hc_eps;
  // u = sum_s pre_s X[s] (s in order, as hc_mix_kernel) over the whole row, four elements a thread
  // at a time; its sum of squares in the same order in every block.
  double uss = 0.0;
  auto add = [&](int64_t q, const float4 (&xv)[HC]) {
    float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int s = 0; s < HC; ++s) {
      t.x += pre[s] * xv[s].x;
      t.y += pre[s] * xv[s].y;
      t.z += pre[s] * xv[s].z;
      t.w += pre[s] * xv[s].w;
    }
    site_u[q] = t;
    uss += static_cast<double>(t.x) * t.x;
    uss += static_cast<double>(t.y) * t.y;
    uss += static_cast<double>(t.z) * t.z;
    uss += static_cast<double>(t.w) * t.w;
  };
#pragma unroll
  for (int c = 0; c < kHcPreHeld; ++c)
    if (tid + static_cast<int64_t>(c) * kRowThreads < q4) add(tid + static_cast<int64_t>(c) * kRowThreads, held[c]);
  for (int64_t q = tid + static_cast<int64_t>(kHcPreHeld) * kRowThreads; q < q4; q += kRowThreads) {
    float4 xv[HC];
#pragma unroll
    for (int s = 0; s < HC; ++s) xv[s] = x4[s * q4 + q];
    add(q, xv);
  }
  float r = 1.0f;
  if (a.site.norm_w) {
    const double ut = block_sum(uss, red);  // its barrier also publishes site_u
    r = static_cast<float>(1.0 / sqrt(ut / static_cast<double>(d) + static_cast<double>(a.site.norm_eps)));
  } else {
    __syncthreads();
  }
  // The block's float4s [qb, qe) (its 64, or the row's in a whole-row block: every element's same
  // arithmetic): U, and its planes from the shared copy (unit_planes_of_row's records).
  const int64_t qb = whole_row ? 0 : q0;
  const int64_t qe = whole_row || q0 + kRowThreads / 4 > q4 ? q4 : q0 + kRowThreads / 4;
  float4* u4 = reinterpret_cast<float4*>(a.site.U + static_cast<int64_t>(row) * d);
  for (int64_t q = qb + tid; q < qe; q += kRowThreads) {
    const float4 t = site_u[q];
    float4 o = t;
    if (a.site.norm_w) {
      const float4 w = whole_row ? ds4_ldg(reinterpret_cast<const float4*>(a.site.norm_w) + q) : nw;
      o = make_float4((t.x * r) * w.x, (t.y * r) * w.y, (t.z * r) * w.z, (t.w * r) * w.w);
    }
    u4[q] = o;
    site_u[q] = o;
  }
  if (a.site.planes != nullptr) {
    __syncthreads();
    unit_planes_of_row(reinterpret_cast<const float*>(site_u + qb), 4 * (qe - qb),
                       a.site.planes + static_cast<int64_t>(row) * a.site.ldp + kPlaneBytes * (qb / 8));
  }
}

// comb = Sinkhorn(comb's logits) in place, a warp a lane (hc_site's comb; hc_mix_kernel's part 1).
template <int HC>
__global__ void __launch_bounds__(DS4_WARP) hc_comb_kernel(float* __restrict__ comb, int iters, float hc_eps) {
  ds4_grid_begin();
  const int i = static_cast<int>(blockIdx.x), lane = static_cast<int>(threadIdx.x);
  float v = 0.0f;
  if (lane < HC * HC) v = comb[i * HC * HC + lane];
  v = sinkhorn_warp(v, HC, iters, hc_eps);
  if (lane < HC * HC) comb[i * HC * HC + lane] = v;
}

// H heads a block (n_head % H == 0), in place.
template <int H>
__global__ void __launch_bounds__(kRowThreads)
    q_heads_kernel(float* __restrict__ Q, int n_head, int head_dim, int rope_dim, float eps,
                   const int32_t* __restrict__ pos, const double* __restrict__ inv_freq) {
  ds4_grid_begin();
  __shared__ double red[H][kRowWarps];
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * H;  // over lanes x heads
  norm_rope_heads<H>(Q + h0 * head_dim, H, head_dim, rope_dim, eps, pos[h0 / n_head], inv_freq, red);
}

__global__ void __launch_bounds__(kRowThreads)
    kv_finish_kernel(float* __restrict__ KV, int head_dim, int rope_dim, const float* __restrict__ norm, float eps,
                     const int32_t* __restrict__ pos, const double* __restrict__ inv_freq, int qat,
                     uint16_t* __restrict__ KV16) {
  ds4_grid_begin();
  __shared__ double red[kRowWarps];
  const int i = static_cast<int>(blockIdx.x);
  float* row = KV + static_cast<int64_t>(i) * head_dim;
  const float r = rms_factor(row, head_dim, eps, red);
  scale_row(row, head_dim, r, norm);
  rope_block(row + (head_dim - rope_dim), rope_dim / 2, pos[i], inv_freq, false);
  if (qat) fp8_block(row, head_dim - rope_dim);
  uint16_t* dst = KV16 + static_cast<int64_t>(i) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += kRowThreads) dst[e] = f32_to_f16_bits(row[e]);
}

__global__ void __launch_bounds__(kRowThreads)
    idx_q_kernel(float* __restrict__ Q, float* __restrict__ W, int head_dim, int rope_dim,
                 const int32_t* __restrict__ pos, const double* __restrict__ inv_freq, int n_heads, int qat,
                 float w_scale) {
  ds4_grid_begin();
  const int i = static_cast<int>(blockIdx.x) / n_heads;
  float* row = Q + static_cast<int64_t>(blockIdx.x) * head_dim;
  rope_block(row + (head_dim - rope_dim), rope_dim / 2, pos[i], inv_freq, false);
  if (qat) {
    hadamard_block(row, head_dim);
    fp4_block(row, head_dim);
  }
  if (threadIdx.x == 0) W[blockIdx.x] *= w_scale;
}

__global__ void __launch_bounds__(kRowThreads)
    add_ape_kernel(float* __restrict__ Z, int64_t ldz, int64_t width, const uint8_t* __restrict__ ape,
                   int64_t row_bytes, int type, int ratio, const int32_t* __restrict__ pos) {
  ds4_grid_begin();
  const int i = static_cast<int>(blockIdx.x);
  const uint8_t* row = ape + static_cast<int64_t>(pos[i] % ratio) * row_bytes;
  float* z = Z + static_cast<int64_t>(i) * ldz;
  for (int64_t k = threadIdx.x; k < width; k += kRowThreads) {
    float v;
    if (type == kF32) {
      v = reinterpret_cast<const float*>(row)[k];
    } else if (type == kF16) {
      v = half_bits_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
    } else {
      v = bf16_bits_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
    }
    z[k] += v;
  }
}

// One warp a lane (routing.cuh route_lane); a hash layer reads its experts before the grid wait.
template <int R>
__global__ void __launch_bounds__(DS4_WARP) route_kernel(const float* __restrict__ logits, const RouteArgs a) {
  __shared__ RouteShared sh;
  const int i = static_cast<int>(blockIdx.x);
  if (a.hash) route_hash_ids(a, i, sh.chosen);
  ds4_grid_begin();
  route_lane<R>(a, i, logits + static_cast<int64_t>(i) * a.n_expert, sh);
}

__device__ __forceinline__ float swiglu_one(float gv, float uv, float limit) {
  if (limit > 0.0f) {
    gv = fminf(gv, limit);
    uv = fminf(fmaxf(uv, -limit), limit);
  }
  return silu_dev(gv) * uv;
}

__global__ void swiglu_kernel(float* __restrict__ G, const float* __restrict__ U, int64_t total, float limit) {
  ds4_grid_begin();
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x)
    G[idx] = swiglu_one(G[idx], U[idx], limit);
}

// swiglu_kernel's values, four a thread, and the planes of each output row (xplanes.cuh) beside
// them: row r's at P + r * ldp. width % 32 == 0, so a unit's 8 threads are in one row and one step
// of the loop (its bound is a multiple of 8 threads).
__global__ void swiglu_planes_kernel(float* __restrict__ G, const float* __restrict__ U, int64_t width,
                                     int64_t total4, float limit, uint8_t* __restrict__ P, int64_t ldp) {
  ds4_grid_begin();
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x; t0 < total4;
       t0 += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool live = t < total4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (live) {
      const float4 g = reinterpret_cast<const float4*>(G)[t], u = reinterpret_cast<const float4*>(U)[t];
      v = make_float4(swiglu_one(g.x, u.x, limit), swiglu_one(g.y, u.y, limit), swiglu_one(g.z, u.z, limit),
                      swiglu_one(g.w, u.w, limit));
      reinterpret_cast<float4*>(G)[t] = v;
    }
    const int64_t e = 4 * t, row = e / width;
    unit_planes_part(v, static_cast<int>(t % kPlaneThreads), live, P + row * ldp + kPlaneBytes * ((e % width) / 32));
  }
}

__global__ void __launch_bounds__(kRowThreads) qat_rows_kernel(float* __restrict__ X, int n, int kind) {
  ds4_grid_begin();
  extern __shared__ float row[];
  float* x = X + static_cast<int64_t>(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += kRowThreads) row[i] = x[i];
  __syncthreads();
  if (kind == 0) {
    fp8_block(row, n);
  } else if (kind == 1) {
    fp4_block(row, n);
  } else if (kind == 2) {
    hadamard_block(row, n);
  } else {
    for (int i = threadIdx.x; i < n; i += kRowThreads) row[i] = half_bits_to_float(f32_to_f16_bits(row[i]));
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += kRowThreads) x[i] = row[i];
}

cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }

}  // namespace

namespace testing {

void qat_rows(int kind, float* X, int n_rows, int n) {
  if (kind < 0 || kind > 3 || n <= 0 || n > 4096) throw std::invalid_argument("qat_rows: kind 0..3, n 1..4096");
  if ((kind == 0 && n % 64) || (kind == 1 && n % 32) || (kind == 2 && (n & (n - 1))))
    throw std::invalid_argument("qat_rows: FP8 needs n % 64 == 0, FP4 n % 32 == 0, Hadamard a power of two");
  if (n_rows <= 0) return;
  const size_t bytes = static_cast<size_t>(n_rows) * n * sizeof(float);
  float* d = nullptr;
  DS4_GPU_CHECK(cudaMalloc(&d, bytes));
  cudaError_t err = cudaMemcpy(d, X, bytes, cudaMemcpyHostToDevice);
  if (err == cudaSuccess) {
    qat_rows_kernel<<<n_rows, kRowThreads, n * sizeof(float)>>>(d, n, kind);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaMemcpy(X, d, bytes, cudaMemcpyDeviceToHost);
  (void)cudaFree(d);
  check(err, "qat_rows");
}

}  // namespace testing

// The fused mHC kernels keep u in shared memory for its norm (d floats, at most 48 KB).
static void launch_hc_mix(int parts, const float* X, const int32_t* lanes, int rows, int hc, int64_t d,
                          const float* mix, int64_t mix_ld, const float* scale, const float* base, int iters,
                          float hc_eps, float norm_eps, const float* norm_w, float* U, float* post, float* comb,
                          uint8_t* planes, int64_t ldp, cudaStream_t st) {
  if (d <= 0 || d > 12 * 1024) throw std::invalid_argument("GPU mHC: n_embd must be 1..12288");
  if (planes != nullptr && d % 32 != 0) throw std::invalid_argument("GPU mHC: planes need n_embd % 32 == 0");
  const size_t smem = norm_w ? static_cast<size_t>(d) * sizeof(float) : 0;
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(rows));
  if (hc == 4)
    launch(hc_mix_kernel<4>, grid, kWideThreads, smem, st, X, lanes, hc, d, mix, mix_ld, scale, base, iters, hc_eps,
                                                       norm_eps, norm_w, U, post, comb, planes, ldp);
  else
    launch(hc_mix_kernel<0>, grid, kWideThreads, smem, st, X, lanes, hc, d, mix, mix_ld, scale, base, iters, hc_eps,
                                                       norm_eps, norm_w, U, post, comb, planes, ldp);
}

void hc_pre(const float* X, int n, int hc, int64_t d, const float* mix, int64_t mix_ld, const float* scale,
            const float* base, int iters, float hc_eps, float norm_eps, const float* norm_w, float* U, float* post,
            float* comb, Stream s, uint8_t* planes, int64_t ldp) {
  if (n <= 0) return;
  launch_hc_mix(2, X, nullptr, n, hc, d, mix, mix_ld, scale, base, iters, hc_eps, norm_eps, norm_w, U, post, comb,
                planes, ldp, cs(s));
  DS4_GPU_CHECK_LAUNCH("hc_mix_kernel (pre)");
}

static void launch_hc_post(float* X, int n, int hc, int64_t d, const float* Y, const float* post, const float* comb,
                           const MoeSum& moe, Stream s) {
  if (n <= 0) return;
  const dim3 grid(static_cast<unsigned>((d + kRowThreads - 1) / kRowThreads), static_cast<unsigned>(n));
  if (hc == 4)
    launch(hc_post_kernel<4>, grid, kRowThreads, 0, cs(s), X, hc, d, Y, post, comb, moe);
  else
    launch(hc_post_kernel<0>, grid, kRowThreads, 0, cs(s), X, hc, d, Y, post, comb, moe);
  DS4_GPU_CHECK_LAUNCH("hc_post_kernel");
}

void hc_post(float* X, int n, int hc, int64_t d, const float* Y, const float* post, const float* comb, Stream s) {
  launch_hc_post(X, n, hc, d, Y, post, comb, MoeSum{}, s);
}

void hc_post_moe(float* X, int n, int hc, int64_t d, const float* D, const float* w, const float* SH, int k,
                 const float* post, const float* comb, Stream s) {
  if (k < 1) throw std::invalid_argument("GPU hc_post_moe: need n_expert_used >= 1");
  launch_hc_post(X, n, hc, d, nullptr, post, comb, MoeSum{D, w, SH, k}, s);
}

// From this many rows a call runs as a prompt step: the sums kernel 8 rows a block, the pre kernel a
// block a row (each the same arithmetic a row: the same bits at any row count).
constexpr int kHcSitePromptRows = 64;

namespace {
std::atomic<int> g_hc_site_streams{kHcSiteStreamsAThread};
}  // namespace

int hc_site_streams() { return g_hc_site_streams.load(std::memory_order_relaxed); }

namespace testing {
int set_hc_site_streams(int streams) {
  if (streams != -1 && streams != 1 && streams != 2)
    throw std::invalid_argument("mHC site streams a sums thread: 1 or 2 (-1: the default), not " +
                                std::to_string(streams));
  g_hc_site_streams.store(streams < 0 ? kHcSiteStreamsAThread : streams, std::memory_order_relaxed);
  return hc_site_streams();
}
}  // namespace testing

// The sums kernel's blocks a row with sp streams a thread.
int64_t hc_site_blocks(int64_t d, int sp) { return kHcSiteStreams / sp * ((d + kRowThreads - 1) / kRowThreads); }

uint64_t hc_site_scratch_bytes(int rows, int64_t d) {
  const int64_t parts = static_cast<int64_t>(rows) * hc_site_blocks(d, 1);  // the most blocks of any setting
  return static_cast<uint64_t>(8 * parts + 4 * parts * kHcSiteMix);
}

// d <= 8192: the pre kernel's u (4 d bytes of dynamic shared memory) and its static arrays stay within
// the 48 KB a block has without opting in; wider rows take the three launches.
bool hc_site_takes(int hc, int64_t d, int fn_type) {
  return hc == kHcSiteStreams && d > 0 && d <= 8 * 1024 && d % 32 == 0 &&
         (fn_type == kF16 || fn_type == kBF16 || fn_type == kF32);
}

void hc_site(const HcSite& s, Stream st) {
  if (s.n <= 0) return;
  if (!hc_site_takes(s.hc, s.d, s.fn_type))
    throw std::invalid_argument("GPU hc_site: needs hc 4, d % 32 == 0, d <= 8192 and an F16/BF16/F32 fn");
  if (s.has_post && s.D != nullptr && s.k < 1) throw std::invalid_argument("GPU hc_site: need n_expert_used >= 1");
  if (s.has_post && (s.X_out == nullptr || s.X_out == s.X))
    throw std::invalid_argument("GPU hc_site: the post writes X_out, a buffer apart from X");
  if (s.scratch_rows < s.n) throw std::invalid_argument("GPU hc_site: scratch for fewer rows than the call's");
  HcSiteLaunch a{};
  a.site = s;
  a.moe = MoeSum{s.D, s.w, s.SH, s.k};
  const int sp = hc_site_streams();
  a.nb = static_cast<int>(hc_site_blocks(s.d, sp));
  // The scratch (hc_site_scratch_bytes of scratch_rows >= n): the doubles, then the floats.
  const int64_t parts = static_cast<int64_t>(s.scratch_rows) * a.nb;
  a.part_ss = reinterpret_cast<double*>(s.scratch);
  a.part_mix = reinterpret_cast<float*>(s.scratch + 8 * parts);
  const cudaStream_t stream = cs(st);
  // Prompt steps: several rows a block, so each block's weights serve them all (the same bits).
  const int per_block = s.n >= kHcSitePromptRows ? 8 : 1;
  const unsigned row_blocks = static_cast<unsigned>((s.n + per_block - 1) / per_block);
  auto sums = [&](auto kernel) {
    launch(kernel, dim3(static_cast<unsigned>(a.nb), row_blocks), kRowThreads, 0, stream, a, s.n, per_block);
  };
  // The kernel for fn's type, the head's site or not, and sp streams a thread.
  auto sums_for = [&](auto head, auto streams) {
    constexpr bool HEAD = decltype(head)::value;
    constexpr int SP = decltype(streams)::value;
    if (s.fn_type == kF16) sums(hc_site_sums_kernel<kF16, HEAD, SP>);
    else if (s.fn_type == kBF16) sums(hc_site_sums_kernel<kBF16, HEAD, SP>);
    else sums(hc_site_sums_kernel<kF32, HEAD, SP>);
  };
  auto sums_of = [&](auto streams) {
    if (s.head) sums_for(std::true_type{}, streams);
    else sums_for(std::false_type{}, streams);
  };
  if (sp == 2) sums_of(std::integral_constant<int, 2>{});
  else sums_of(std::integral_constant<int, 1>{});
  DS4_GPU_CHECK_LAUNCH("hc_site_sums_kernel");
  const size_t smem = std::max<size_t>(static_cast<size_t>(s.d) * sizeof(float),
                                       static_cast<size_t>(a.nb) * (sizeof(double) + kHcSiteMix * sizeof(float)));
  // Prompt steps: a block a row (X read once a row); decode: a block per 256 elements (the same bits).
  const bool whole_row = s.n >= kHcSitePromptRows;
  const dim3 grid(whole_row ? 1u : static_cast<unsigned>((s.d + kRowThreads - 1) / kRowThreads),
                  static_cast<unsigned>(s.n));
  if (s.head) launch(hc_site_pre_kernel<true>, grid, kRowThreads, smem, stream, a, whole_row);
  else launch(hc_site_pre_kernel<false>, grid, kRowThreads, smem, stream, a, whole_row);
  DS4_GPU_CHECK_LAUNCH("hc_site_pre_kernel");
}

void hc_comb(float* comb, int n, int iters, float hc_eps, Stream st) {
  if (n <= 0) return;
  launch(hc_comb_kernel<kHcSiteStreams>, n, DS4_WARP, 0, cs(st), comb, iters, hc_eps);
  DS4_GPU_CHECK_LAUNCH("hc_comb_kernel");
}

void hc_head(const float* X, const int32_t* lanes, int n_out, int hc, int64_t d, const float* mix, int64_t mix_ld,
             const float* scale, const float* base, float hc_eps, float norm_eps, const float* norm_w, float* out,
             Stream s, uint8_t* planes, int64_t ldp) {
  if (n_out <= 0) return;
  launch_hc_mix(1, X, lanes, n_out, hc, d, mix, mix_ld, scale, base, 0, hc_eps, norm_eps, norm_w, out, nullptr,
                nullptr, planes, ldp, cs(s));
  DS4_GPU_CHECK_LAUNCH("hc_mix_kernel (head)");
}

// From this many lanes q_heads runs 4 heads a block (decode steps keep a head a block).
constexpr int kQHeadsPromptLanes = 16;

void q_heads(float* Q, int n, int n_head, int head_dim, int rope_dim, float eps, const int32_t* pos,
             const double* inv_freq, Stream s) {
  if (n <= 0) return;
  // Prompt steps 4 heads a block (pass 24: 3.7 -> 3.1 ms a 2048-row step of flash-l4; ncu found it
  // issue bound, not latency bound, and 16 heads a block lost on its registers). The same bits.
  if (n >= kQHeadsPromptLanes && n_head % 4 == 0)
    launch(q_heads_kernel<4>, n * n_head / 4, kRowThreads, 0, cs(s), Q, n_head, head_dim, rope_dim, eps, pos, inv_freq);
  else
    launch(q_heads_kernel<1>, n * n_head, kRowThreads, 0, cs(s), Q, n_head, head_dim, rope_dim, eps, pos, inv_freq);
  DS4_GPU_CHECK_LAUNCH("q_heads_kernel");
}

void kv_finish(float* KV, int n, int head_dim, int rope_dim, const float* norm, float eps, const int32_t* pos,
               const double* inv_freq, bool qat, uint16_t* KV16, Stream s) {
  if (n <= 0) return;
  launch(kv_finish_kernel, n, kRowThreads, 0, cs(s), KV, head_dim, rope_dim, norm, eps, pos, inv_freq, qat ? 1 : 0, KV16);
  DS4_GPU_CHECK_LAUNCH("kv_finish_kernel");
}

void idx_q_finish(float* Q, float* W, int n, int n_heads, int head_dim, int rope_dim, const int32_t* pos,
                  const double* inv_freq, bool qat, float w_scale, Stream s) {
  if (n <= 0) return;
  launch(idx_q_kernel, n * n_heads, kRowThreads, 0, cs(s), Q, W, head_dim, rope_dim, pos, inv_freq, n_heads, qat ? 1 : 0,
                                                       w_scale);
  DS4_GPU_CHECK_LAUNCH("idx_q_kernel");
}

void add_ape(float* Z, int64_t ldz, int n, int64_t width, const TensorView& ape, int ratio, const int32_t* pos,
             Stream s) {
  if (n <= 0) return;
  const int type = static_cast<int>(ape.type);
  if (type != kF32 && type != kF16 && type != kBF16)
    throw std::invalid_argument(std::string("GPU add_ape: ape must be F32, F16 or BF16, not ") + dtype_name(ape.type));
  launch(add_ape_kernel, n, kRowThreads, 0, cs(s), Z, ldz, width, ape.data, ape.row_bytes(), type, ratio, pos);
  DS4_GPU_CHECK_LAUNCH("add_ape_kernel");
}

void route(const float* logits, int n, int n_expert, int k, bool hash, const int32_t* tid2eid, const int32_t* tokens,
           const float* bias, bool norm, float scale, int32_t* ids, float* weights, Stream s) {
  if (n <= 0) return;
  const RouteArgs a = route_args(n_expert, k, hash, tid2eid, tokens, bias, norm, scale, ids, weights);
  auto go = [&](auto kernel) { launch(kernel, n, DS4_WARP, 0, cs(s), logits, a); };
  if (n_expert <= 8 * DS4_WARP) go(route_kernel<8>);  // DS4's 256 experts: 8 a lane
  else if (n_expert <= 32 * DS4_WARP) go(route_kernel<32>);
  else go(route_kernel<128>);
  DS4_GPU_CHECK_LAUNCH("route_kernel");
}

void swiglu(float* G, const float* U, int64_t rows, int64_t width, float limit, Stream s, uint8_t* planes,
            int64_t ldp) {
  const int64_t total = rows * width;
  if (total <= 0) return;
  if (planes != nullptr) {
    if (width % 32 != 0) throw std::invalid_argument("GPU swiglu: planes need width % 32 == 0");
    const int64_t blocks = std::min<int64_t>((total / 4 + 255) / 256, 4096);
    launch(swiglu_planes_kernel, static_cast<unsigned>(blocks), 256, 0, cs(s), G, U, width, total / 4, limit, planes,
           ldp);
    DS4_GPU_CHECK_LAUNCH("swiglu_planes_kernel");
    return;
  }
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4096);
  launch(swiglu_kernel, static_cast<unsigned>(blocks), 256, 0, cs(s), G, U, total, limit);
  DS4_GPU_CHECK_LAUNCH("swiglu_kernel");
}

}  // namespace ds4::gpu
