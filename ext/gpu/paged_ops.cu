// The per-slot part of a DS4 step on the GPU (step_ops.h): compressors, the lightning indexer and
// gathered attention over the paged state. Phase B of ext/engine/engine.cpp, reorganised so that
// different slots run in parallel and no lane waits on another:
//
//   compressor_update  serial (decode steps): grid = slots in the step, 256 threads. A slot's lanes
//                      run in order inside the block through the state; channels split over
//                      threads. A finished block is pooled (per-channel softmax over its
//                      candidates), normed, rotated, QAT'd and stored as f16 into its page.
//                      Parallel (prompt steps): compressor_pool, a block per finished block (grid
//                      ceil(n / m) x slots), reads its candidates from this step's projection rows
//                      or the state as the step found it; then compressor_state, a block per
//                      residue and slot, leaves the state as the serial kernel would. The same
//                      pooling and row code: the same bits (a 2048-token prompt was one block of
//                      2048 sequential lanes). Entries are write-once, and a lane only reads
//                      entries s < (t+1)/m, so running every compressor before any attention
//                      gives each lane exactly the rows the CPU's interleaved order gives it.
//                      Bytes: 8 * width per lane (state) + 2 c per emitted row.
//   indexer_scores     grid (entry blocks of 64, lanes), 8 warps; the lane's queries and weights in
//                      shared memory, one warp per entry: the key row (2 bytes an element) in
//                      registers, per head a butterfly dot, then sum_h w_h ReLU in head order.
//                      Bytes: 2 * index_head_dim per visible entry + 4 per score.
//   indexer_topk       grid = lanes, 1024 threads: an exact radix select (4 passes of 8-bit
//                      histograms over order-preserving keys) finds the k-th best score; everything
//                      above it and the lowest-index entries equal to it are written in index order
//                      (two block scans over contiguous per-thread segments). Ties go to the lower
//                      index, as the CPU's strict order. Bytes: about 6 reads of 4 per entry.
//   attention_paged    flash-decoding style, two kernels (rowops.cuh): attention_split grid (head
//                      groups, splits, lanes), 256 threads: a lane's keys are cut into at most 8
//                      splits of at least 64 keys, by its own key count only; a block resolves its
//                      split's key rows to pointers (window rows before the slot's first lane of this
//                      step come from the ring, later ones from this step's f16 rows, so no ring row
//                      is overwritten before every lane that needs it has read it), then per head
//                      the logits, their max and exp-sum and sum e k in key order. attention_combine
//                      grid (heads, lanes), 128 threads: the splits merged in order with the sink,
//                      then the inverse tail RoPE. Bytes: the lane's keys (2 * head_dim each) per
//                      head group, from L2 after the first group; partials 4 * (head_dim + 2) per
//                      (lane, head, split), written once and read once.
//   ring_store         grid = lanes: this step's rows into the rings, after attention (the last
//                      128 positions of each slot). Bytes: 4 * head_dim per lane.
#include <algorithm>
#include <atomic>
#include <string>

#include "launch.cuh"
#include "rowops.cuh"
#include "step_ops.h"
#include "xplanes.cuh"

namespace ds4::gpu {

namespace {

cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }

constexpr int kPage = 128;  // tokens per page and rows per ring

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// --- compressor --------------------------------------------------------------------------------

// Candidate r of a finished block (CSA: the m previous rows at column ch, then the m current rows at
// column c + ch; HCA: the m rows at column ch), as pointers to its value and score runs of c floats.
// Both compressor paths pool through these, so they share the order of the arithmetic and the bits.
struct CompressorCands {
  const float** kv;  // [n] value runs
  const float** sc;  // [n] score runs
  int n;
};

// Column offset of candidate r inside a state or projection row (CSA's current half at c).
__device__ __forceinline__ int cand_col(int r, int m, int c) { return (m == 4 && r >= m) ? c : 0; }

// buf[ch] = softmax over the candidates' scores of channel ch, applied to their values: the max
// first, then exp-sum and weighted sum in candidate order (compressor.cpp). Ends with a barrier.
__device__ __forceinline__ void pool_candidates(const CompressorCands& cd, int c, float* buf) {
  for (int ch = threadIdx.x; ch < c; ch += kRowThreads) {
    float mx = cd.sc[0][ch];
    for (int r = 1; r < cd.n; ++r) mx = fmaxf(mx, cd.sc[r][ch]);
    float den = 0.0f, num = 0.0f;
    for (int r = 0; r < cd.n; ++r) {
      const float e = expf(cd.sc[r][ch] - mx);
      den += e;
      num += e * cd.kv[r][ch];
    }
    buf[ch] = num / den;
  }
  __syncthreads();
}

// The pooled row buf[0..c) of the block that starts at token `start`: normed, rotated, QAT'd and
// stored as f16 into its page (table: the slot's block table). Ends with a barrier.
__device__ __forceinline__ void store_compressed_row(float* buf, const CompressorLaunch& a, int64_t start,
                                                     const int32_t* table, double* red) {
  const int c = a.c;
  const float r = rms_factor(buf, c, a.eps, red);
  scale_row(buf, c, r, a.norm);
  rope_block(buf + (c - a.rope_dim), a.rope_dim / 2, start, a.inv_freq, false);
  if (a.qat == 1) {
    fp8_block(buf, c - a.rope_dim);
  } else if (a.qat == 2) {
    hadamard_block(buf, c);
    fp4_block(buf, c);
  }
  const int64_t page = table[start / kPage];
  uint16_t* dst = a.pages + page * a.page_elems + a.row_off + ((start % kPage) / a.ratio) * c;
  for (int e = threadIdx.x; e < c; e += kRowThreads) dst[e] = f32_to_f16_bits(buf[e]);
  __syncthreads();
}

// Dynamic shared memory of both compressor kernels: the candidates' pointers, then the pooled row.
size_t compressor_smem(const CompressorLaunch& a) {
  return 2 * static_cast<size_t>(a.rows) * sizeof(const float*) + static_cast<size_t>(a.c) * sizeof(float);
}

__device__ __forceinline__ CompressorCands compressor_cands(const CompressorLaunch& a, void* smem) {
  const float** p = reinterpret_cast<const float**>(smem);
  return CompressorCands{p, p + a.rows, a.ratio == 4 ? 2 * a.ratio : a.ratio};
}

__device__ __forceinline__ float* compressor_buf(const CompressorLaunch& a, void* smem) {
  return reinterpret_cast<float*>(reinterpret_cast<const float**>(smem) + 2 * a.rows);
}

// The serial path (decode steps): a block a slot, its lanes in order through the state.
__global__ void __launch_bounds__(kRowThreads) compressor_kernel(CompressorLaunch a, StepLanes L) {
  ds4_grid_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red[kRowWarps];
  const CompressorCands cd = compressor_cands(a, smem);
  float* buf = compressor_buf(a, smem);
  const int g = static_cast<int>(blockIdx.x);
  const int slot = L.grp_slot[g], first = L.grp_first[g], len = L.grp_len[g];
  const int m = a.ratio, w = a.width, c = a.c;
  const bool overlap = m == 4;
  float* kv = a.states + static_cast<int64_t>(slot) * a.state_per_slot + a.kv_off;
  float* sc = kv + static_cast<int64_t>(a.rows) * w;
  const int32_t* table = L.tables + static_cast<int64_t>(g) * L.max_blocks;
  for (int r = threadIdx.x; r < cd.n; r += kRowThreads) {  // the candidates are the state's rows
    cd.kv[r] = kv + static_cast<int64_t>(r) * w + cand_col(r, m, c);
    cd.sc[r] = sc + static_cast<int64_t>(r) * w + cand_col(r, m, c);
  }
  for (int k = 0; k < len; ++k) {
    const int i = L.order[first + k];
    const int64_t t = L.pos[i];
    const int row = (overlap ? m : 0) + static_cast<int>(t % m);
    const float* ki = a.k + static_cast<int64_t>(i) * a.ld;
    const float* zi = a.z + static_cast<int64_t>(i) * a.ld;
    for (int e = threadIdx.x; e < w; e += kRowThreads) {
      kv[static_cast<int64_t>(row) * w + e] = ki[e];
      sc[static_cast<int64_t>(row) * w + e] = zi[e];
    }
    __syncthreads();
    if ((t + 1) % m != 0) continue;  // t is the same for the whole block
    pool_candidates(cd, c, buf);
    if (overlap) {  // the current block becomes the next one's previous half
      for (int e = threadIdx.x; e < m * w; e += kRowThreads) {
        kv[e] = kv[static_cast<int64_t>(m) * w + e];
        sc[e] = sc[static_cast<int64_t>(m) * w + e];
      }
    }
    store_compressed_row(buf, a, t + 1 - m, table, red);
  }
}

// The parallel path (prompt steps), two launches. compressor_pool: grid (ceil(n / m), groups); block
// (k, g) pools group g's k-th block finished in this step, its candidates read where the serial
// kernel would find them: this step's projection rows for tokens >= t0 (the group's first
// position), else the state as the step found it (current rows for tokens of t0's block, previous
// rows before it). compressor_state then leaves the state as the serial kernel would.
__global__ void __launch_bounds__(kRowThreads) compressor_pool_kernel(CompressorLaunch a, StepLanes L) {
  ds4_grid_begin();
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red[kRowWarps];
  const int g = static_cast<int>(blockIdx.y);
  const int first = L.grp_first[g], len = L.grp_len[g];
  const int m = a.ratio, w = a.width, c = a.c;
  const bool overlap = m == 4;
  const int64_t t0 = L.pos[L.order[first]];
  const int64_t t = t0 + (m - 1 - t0 % m) + static_cast<int64_t>(blockIdx.x) * m;  // its last token
  if (t >= t0 + len) return;
  const int64_t start = t + 1 - m, b0 = t0 - t0 % m;
  const CompressorCands cd = compressor_cands(a, smem);
  float* buf = compressor_buf(a, smem);
  const float* kv = a.states + static_cast<int64_t>(L.grp_slot[g]) * a.state_per_slot + a.kv_off;
  const float* sc = kv + static_cast<int64_t>(a.rows) * w;
  for (int r = threadIdx.x; r < cd.n; r += kRowThreads) {
    const int64_t u = (overlap ? start - m : start) + r;  // candidate r's token
    const int col = cand_col(r, m, c);
    if (u >= t0) {
      const int64_t i = L.order[first + (u - t0)];
      cd.kv[r] = a.k + i * a.ld + col;
      cd.sc[r] = a.z + i * a.ld + col;
    } else {
      const int64_t row = ((u >= b0 && overlap) ? m : 0) + ((u % m) + m) % m;
      cd.kv[r] = kv + row * w + col;
      cd.sc[r] = sc + row * w + col;
    }
  }
  __syncthreads();
  pool_candidates(cd, c, buf);
  store_compressed_row(buf, a, start, L.tables + static_cast<int64_t>(g) * L.max_blocks, red);
}

// grid (m, groups): block (q, g) writes the rows of residue q of group g's state. CSA: the last
// block finished in this step (if any) becomes the previous rows; then each current row holds the
// step's last token of its residue (if any). Rows no token of the step reaches keep their bytes.
__global__ void __launch_bounds__(kRowThreads) compressor_state_kernel(CompressorLaunch a, StepLanes L) {
  ds4_grid_begin();
  const int q = static_cast<int>(blockIdx.x), g = static_cast<int>(blockIdx.y);
  const int first = L.grp_first[g], len = L.grp_len[g];
  const int m = a.ratio, w = a.width;
  const bool overlap = m == 4;
  const int64_t t0 = L.pos[L.order[first]], last = t0 + len - 1;
  float* kv = a.states + static_cast<int64_t>(L.grp_slot[g]) * a.state_per_slot + a.kv_off;
  float* sc = kv + static_cast<int64_t>(a.rows) * w;
  const int64_t cur = (overlap ? m : 0) + q;
  auto copy_row = [&](int64_t dst, int64_t u) {  // token u's row into state row dst
    const float *ks, *zs;
    if (u >= t0) {
      const int64_t i = L.order[first + (u - t0)];
      ks = a.k + i * a.ld;
      zs = a.z + i * a.ld;
    } else {  // a token of an earlier step: still in its current row
      ks = kv + cur * w;
      zs = sc + cur * w;
    }
    for (int e = threadIdx.x; e < w; e += kRowThreads) {
      kv[dst * w + e] = ks[e];
      sc[dst * w + e] = zs[e];
    }
  };
  if (overlap) {
    const int64_t end = (last + 1) / m * m;  // one past the last finished block
    if (end - 1 >= t0) copy_row(q, end - m + q);
    __syncthreads();  // the current row may have been the source
  }
  const int64_t u = last - ((last - q) % m + m) % m;  // the step's last token of residue q
  if (u >= t0) copy_row(cur, u);
}

// --- indexer scores ------------------------------------------------------------------------------

constexpr int kIdxPerWarp = 8;
constexpr int kIdxPerBlock = kIdxPerWarp * kRowWarps;

template <int PL>  // elements per lane: index_head_dim / 32
__global__ void __launch_bounds__(kRowThreads)
    indexer_scores_kernel(const float* __restrict__ Q, const float* __restrict__ W, int n_heads, StepLanes L,
                          const uint16_t* __restrict__ pages, int64_t page_elems, int64_t row_off, int top_k,
                          float* __restrict__ scores, int64_t ld) {
  ds4_grid_begin();
  constexpr int HD = PL * DS4_WARP;
  extern __shared__ float qs[];  // [n_heads][HD] queries, then [n_heads] weights
  const int i = static_cast<int>(blockIdx.y);
  const int64_t t = L.pos[i];
  const int64_t n_vis = (t + 1) / 4;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kIdxPerBlock;
  if (n_vis <= top_k || s0 >= n_vis) return;  // all entries fit: no scores needed
  float* ws = qs + n_heads * HD;
  for (int e = threadIdx.x; e < n_heads * HD; e += kRowThreads) qs[e] = Q[static_cast<int64_t>(i) * n_heads * HD + e];
  for (int h = threadIdx.x; h < n_heads; h += kRowThreads) ws[h] = W[static_cast<int64_t>(i) * n_heads + h];
  __syncthreads();
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int32_t* table = L.tables + static_cast<int64_t>(L.group[i]) * L.max_blocks;
  for (int q = 0; q < kIdxPerWarp; ++q) {
    const int64_t s = s0 + warp * kIdxPerWarp + q;
    if (s >= n_vis) break;
    const int64_t start = s * 4;
    const uint16_t* kp = pages + static_cast<int64_t>(table[start / kPage]) * page_elems + row_off +
                         ((start % kPage) / 4) * HD;
    float kf[PL];
#pragma unroll
    for (int j = 0; j < PL; ++j) kf[j] = half_bits_to_float(kp[lane + DS4_WARP * j]);
    float acc = 0.0f;
    for (int h = 0; h < n_heads; ++h) {
      float v = 0.0f;
#pragma unroll
      for (int j = 0; j < PL; ++j) v = fmaf(qs[h * HD + lane + DS4_WARP * j], kf[j], v);
      v = warp_sum(v);
      acc += ws[h] * fmaxf(v, 0.0f);
    }
    if (lane == 0) scores[static_cast<int64_t>(i) * ld + s] = acc;
  }
}

// Heads over lanes: lane l owns the PL consecutive key elements [l * PL, (l + 1) * PL) and forms
// the partial dot of every head (NV = 32 M heads, those past n_heads zero); five halving rounds
// then leave lane l the whole dots of heads M l .. M l + M - 1 (round r: the lanes whose bit
// 16 >> r is set keep the upper half of their values and add the partner's, the others the lower
// half), so an entry costs 32 M - M shuffles instead of a 5-deep butterfly per head. Then each
// lane adds w_h ReLU(dot_h) over its heads in order and one butterfly sums the lanes. Fixed order,
// lane-local: batch invariant. kIdx2PerWarp entries per warp, their key rows loaded together.
constexpr int kIdx2PerWarp = 2;
constexpr int kIdx2PerBlock = kIdx2PerWarp * kRowWarps;

template <int PL>
__device__ __forceinline__ void load_f16_run(const uint16_t* p, float f[PL]) {
  if constexpr (PL >= 8) {
#pragma unroll
    for (int v = 0; v < PL / 8; ++v) load_f16x8(p + 8 * v, f + 8 * v);
  } else if constexpr (PL == 4) {
    const uint2 w = ds4_ldg(reinterpret_cast<const uint2*>(p));
    f[0] = half_bits_to_float(w.x & 0xffffu);
    f[1] = half_bits_to_float(w.x >> 16);
    f[2] = half_bits_to_float(w.y & 0xffffu);
    f[3] = half_bits_to_float(w.y >> 16);
  } else if constexpr (PL == 2) {
    const uint32_t w = ds4_ldg(reinterpret_cast<const uint32_t*>(p));
    f[0] = half_bits_to_float(w & 0xffffu);
    f[1] = half_bits_to_float(w >> 16);
  } else {
    f[0] = half_bits_to_float(ds4_ldg(p));
  }
}

template <int PL, int M>
__global__ void __launch_bounds__(kRowThreads)
    indexer_scores_heads_kernel(const float* __restrict__ Q, const float* __restrict__ W, int n_heads, StepLanes L,
                                const uint16_t* __restrict__ pages, int64_t page_elems, int64_t row_off, int top_k,
                                float* __restrict__ scores, int64_t ld) {
  ds4_grid_begin();
  constexpr int HD = PL * DS4_WARP, NV = M * DS4_WARP;
  extern __shared__ __align__(16) float qs[];  // [NV][HD] queries (zero past n_heads), then [NV] weights
  const int i = static_cast<int>(blockIdx.y);
  const int64_t t = L.pos[i];
  const int64_t n_vis = (t + 1) / 4;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kIdx2PerBlock;
  if (n_vis <= top_k || s0 >= n_vis) return;  // all entries fit: no scores needed
  float* ws = qs + NV * HD;
  const float* qi = Q + static_cast<int64_t>(i) * n_heads * HD;
  const int nq = n_heads * HD;  // a multiple of 32
  for (int e = 4 * static_cast<int>(threadIdx.x); e < NV * HD; e += 4 * kRowThreads) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (e < nq) v = ds4_ldg(reinterpret_cast<const uint4*>(qi + e));
    *reinterpret_cast<uint4*>(qs + e) = v;
  }
  for (int h = static_cast<int>(threadIdx.x); h < NV; h += kRowThreads)
    ws[h] = h < n_heads ? W[static_cast<int64_t>(i) * n_heads + h] : 0.0f;
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int32_t* table = L.tables + static_cast<int64_t>(L.group[i]) * L.max_blocks;
  float kf[kIdx2PerWarp][PL];
#pragma unroll
  for (int q = 0; q < kIdx2PerWarp; ++q) {
    const int64_t s = s0 + warp * kIdx2PerWarp + q;
    if (s < n_vis) {
      const int64_t start = s * 4;
      const uint16_t* kp = pages + static_cast<int64_t>(table[start / kPage]) * page_elems + row_off +
                           ((start % kPage) / 4) * HD;
      load_f16_run<PL>(kp + lane * PL, kf[q]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kIdx2PerWarp; ++q) {
    const int64_t s = s0 + warp * kIdx2PerWarp + q;
    if (s >= n_vis) break;  // the same for the whole warp
    float v[NV];
#pragma unroll
    for (int h = 0; h < NV; ++h) {
      const float* qh = qs + h * HD + lane * PL;
      float acc = 0.0f;
      if constexpr (PL % 4 == 0) {
#pragma unroll
        for (int j = 0; j < PL; j += 4) {
          const float4 x = *reinterpret_cast<const float4*>(qh + j);
          acc = fmaf(x.x, kf[q][j], acc);
          acc = fmaf(x.y, kf[q][j + 1], acc);
          acc = fmaf(x.z, kf[q][j + 2], acc);
          acc = fmaf(x.w, kf[q][j + 3], acc);
        }
      } else {
#pragma unroll
        for (int j = 0; j < PL; ++j) acc = fmaf(qh[j], kf[q][j], acc);
      }
      v[h] = acc;
    }
    warp_sums<NV>(v, lane);
    float acc = 0.0f;
#pragma unroll
    for (int p = 0; p < M; ++p) acc += ws[M * lane + p] * fmaxf(v[p], 0.0f);
    acc = warp_sum(acc);
    if (lane == 0) scores[static_cast<int64_t>(i) * ld + s] = acc;
  }
}

// --- top-k ---------------------------------------------------------------------------------------

constexpr int kTopkThreads = 1024;

// Larger float, larger key (+0.0 and -0.0 equal, as the CPU's comparisons treat them).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = ds4_float_to_bits(f + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Inclusive prefix sum over the 32 lanes of a warp (Hillis-Steele by shuffles; integers, exact).
__device__ __forceinline__ int warp_inclusive_scan(int x) {
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;
#pragma unroll
  for (int off = 1; off < DS4_WARP; off <<= 1) {
    const int y = ds4_shfl(x, lane >= off ? lane - off : lane);
    if (lane >= off) x += y;
  }
  return x;
}

// Exclusive prefix sum of one int per thread (blockDim.x == kTopkThreads); a: shared scratch of
// kTopkThreads / 32 ints. A scan in each warp, then one of the 32 warp totals.
__device__ int block_exclusive_scan(int v, int* a) {
  static_assert(kTopkThreads / DS4_WARP == DS4_WARP, "the warp totals are scanned by one warp");
  const int tid = static_cast<int>(threadIdx.x), lane = tid % DS4_WARP, warp = tid / DS4_WARP;
  const int incl = warp_inclusive_scan(v);
  if (lane == DS4_WARP - 1) a[warp] = incl;
  __syncthreads();
  const int before = warp_inclusive_scan(a[lane]) - a[lane];  // every warp: the totals before warp `lane`
  const int base = ds4_shfl(before, warp);
  __syncthreads();
  return base + incl - v;
}

__global__ void __launch_bounds__(kTopkThreads)
    indexer_topk_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ pos, int top_k,
                        int32_t* __restrict__ sel, int64_t ld_sel) {
  ds4_grid_begin();
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_mask, s_rem;
  __shared__ uint32_t s_incl[256], s_wsum[256 / DS4_WARP];
  __shared__ int scan[kTopkThreads / DS4_WARP];
  const int i = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  const int64_t n_vis = (static_cast<int64_t>(pos[i]) + 1) / 4;
  const int64_t k = min64(top_k, n_vis);
  int32_t* out = sel + static_cast<int64_t>(i) * ld_sel;
  if (k == n_vis) {
    for (int64_t s = tid; s < n_vis; s += kTopkThreads) out[s] = static_cast<int32_t>(s);
    return;
  }
  const float* sc = scores + static_cast<int64_t>(i) * ld;
  uint32_t prefix = 0, mask = 0, rem = static_cast<uint32_t>(k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kTopkThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t s = tid; s < n_vis; s += kTopkThreads) {
      const uint32_t key = order_key(sc[s]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    // The bin to descend into: walking b = 255, 254, ..., 1 and stopping at the first b whose
    // suffix count S(b) = sum_{b' >= b} hist[b'] reaches rem (else b = 0), with rem - S(b + 1)
    // still to take. S is non-increasing, so that b is the one bin where the condition holds for
    // b and not for b + 1; 256 threads find it from suffix sums (a scan over bins 255..0) instead
    // of one thread walking the bins.
    if (tid < 256) {
      const int lane = tid % DS4_WARP, warp = tid / DS4_WARP;
      const int b = 255 - tid;
      const uint32_t x = static_cast<uint32_t>(warp_inclusive_scan(static_cast<int>(hist[b])));
      s_incl[tid] = x;
      if (lane == DS4_WARP - 1) s_wsum[warp] = x;
    }
    __syncthreads();
    if (tid < 256) {
      const int warp = tid / DS4_WARP;
      const int b = 255 - tid;
      uint32_t base = 0;
      for (int w = 0; w < warp; ++w) base += s_wsum[w];
      const uint32_t incl = base + s_incl[tid];  // S(b)
      const uint32_t excl = incl - hist[b];        // S(b + 1)
      const bool here = b == 0 || incl >= rem;
      const bool above = b < 255 && excl >= rem;
      if (here && !above) {
        s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
        s_mask = mask | (255u << shift);
        s_rem = rem - excl;
      }
    }
    __syncthreads();
    prefix = s_prefix;
    mask = s_mask;
    rem = s_rem;
    __syncthreads();
  }
  // prefix is now the k-th best key: take every key above it and the first rem equal to it.
  const int64_t seg = (n_vis + kTopkThreads - 1) / kTopkThreads;
  const int64_t b0 = min64(n_vis, tid * seg), b1 = min64(n_vis, b0 + seg);
  int eq = 0;
  for (int64_t s = b0; s < b1; ++s) eq += order_key(sc[s]) == prefix;
  const int eq_before = block_exclusive_scan(eq, scan);
  int cnt = 0, rank = eq_before;
  for (int64_t s = b0; s < b1; ++s) {
    const uint32_t key = order_key(sc[s]);
    if (key > prefix) {
      ++cnt;
    } else if (key == prefix) {
      cnt += static_cast<uint32_t>(rank) < rem;
      ++rank;
    }
  }
  int o = block_exclusive_scan(cnt, scan);
  rank = eq_before;
  for (int64_t s = b0; s < b1; ++s) {
    const uint32_t key = order_key(sc[s]);
    bool take = key > prefix;
    if (key == prefix) {
      take = static_cast<uint32_t>(rank) < rem;
      ++rank;
    }
    if (take) out[o++] = static_cast<int32_t>(s);
  }
}

// --- attention -----------------------------------------------------------------------------------

// A lane's keys, in the CPU's order: window positions max(0, t-127)..t, then compressed entries.
struct LaneKeys {
  int64_t t = 0, t0 = 0, win_first = 0;
  int n_win = 0, n = 0;
  bool use_sel = false;
};

__device__ __forceinline__ LaneKeys lane_keys(const AttentionLaunch& a, const StepLanes& L, int li) {
  LaneKeys k;
  k.t = L.pos[li];
  k.t0 = L.t0[li];
  k.win_first = k.t > kPage - 1 ? k.t - (kPage - 1) : 0;
  k.n_win = static_cast<int>(k.t - k.win_first + 1);
  int n_comp = 0;
  if (a.ratio == 4) {
    const int64_t n_vis = (k.t + 1) / 4;
    n_comp = static_cast<int>(min64(a.top_k, n_vis));
    k.use_sel = n_comp < n_vis;
  } else if (a.ratio == kPage) {
    n_comp = static_cast<int>((k.t + 1) / kPage);
  }
  k.n = min(k.n_win + n_comp, a.max_keys);  // the launcher's bound keeps shared memory safe
  return k;
}

// Key j of lane li: window positions before the slot's first lane of this step from the ring,
// later ones from this step's f16 rows (so no ring row is overwritten before every lane that
// needs it has read it), then the compressed rows from the pages.
__device__ __forceinline__ const uint16_t* key_row(const AttentionLaunch& a, const StepLanes& L, const LaneKeys& k,
                                                   int li, int j) {
  const int hd = a.head_dim, g = L.group[li];
  if (j < k.n_win) {
    const int64_t q = k.win_first + j;
    return q >= k.t0 ? a.kv16 + static_cast<int64_t>(L.order[L.grp_first[g] + (q - k.t0)]) * hd
                     : a.ring + (static_cast<int64_t>(L.slot[li]) * kPage + q % kPage) * hd;
  }
  const int64_t s = k.use_sel ? a.sel[static_cast<int64_t>(li) * a.ld_sel + (j - k.n_win)] : j - k.n_win;
  const int64_t start = s * a.ratio;
  const int32_t* table = L.tables + static_cast<int64_t>(g) * L.max_blocks;
  return a.pages + static_cast<int64_t>(table[start / kPage]) * a.page_elems + a.row_off +
         ((start % kPage) / a.ratio) * hd;
}

// The split kernel's dynamic shared memory: cap key-row pointers, HB x cap logits, then (q_raw) the
// group's HB query rows, 16-byte aligned.
__host__ __device__ inline size_t attn_split_smem(int cap, int hb, int head_dim, bool q_raw) {
  const size_t keys = static_cast<size_t>(cap) * (sizeof(void*) + hb * sizeof(float));
  return q_raw ? (keys + 15) / 16 * 16 + static_cast<size_t>(hb) * head_dim * sizeof(float) : keys;
}
__device__ inline float* attn_q_shared(unsigned char* smem, int cap, int hb) {
  return reinterpret_cast<float*>(smem + attn_split_smem(cap, hb, 0, true));
}

// grid (head groups, splits bound, lanes): one split of one lane for HB heads (rowops.cuh).
template <int HB>
__global__ void __launch_bounds__(kAttnThreads) attention_split_kernel(AttentionLaunch a, StepLanes L, int cap) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint16_t** kp = reinterpret_cast<const uint16_t**>(smem);   // [cap] key rows
  float* lg = reinterpret_cast<float*>(smem + sizeof(void*) * cap);  // [HB][cap]
  const int li = static_cast<int>(blockIdx.z), c = static_cast<int>(blockIdx.y);
  const int h0 = static_cast<int>(blockIdx.x) * HB, nh = min(HB, a.n_head - h0);
  // The lane's keys, and the rows of those that step inputs alone locate (the window; the compressed
  // rows where no selection picks them), before the grid wait (a.early, pass 41): their loads overlap
  // the previous kernel. A selection's rows (this step's indexer) after it.
  if (!a.early) ds4_grid_begin();
  const LaneKeys k = lane_keys(a, L, li);
  const bool live = c < attn_splits(k.n, a.split_min);
  const int chunk = attn_split_keys(k.n, a.split_min), j0 = c * chunk, nk = live ? min(chunk, k.n - j0) : 0;
  for (int j = static_cast<int>(threadIdx.x); j < nk; j += kAttnThreads)
    if (!k.use_sel || j0 + j < k.n_win) kp[j] = key_row(a, L, k, li, j0 + j);
  if (a.early) ds4_grid_begin();
  if (!live) return;  // the whole block: no barrier is skipped by part of it
  if (k.use_sel)
    for (int j = static_cast<int>(threadIdx.x); j < nk; j += kAttnThreads)
      if (j0 + j >= k.n_win) kp[j] = key_row(a, L, k, li, j0 + j);
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(a.head_dim)));
  const int64_t head = static_cast<int64_t>(li) * a.n_head + h0;
  const float* q = a.q + head * a.head_dim;
  float* part = a.part + (head * kAttnMaxSplits + c) * a.head_dim;
  float* stats = a.part_stats + (head * kAttnMaxSplits + c) * 2;
  if (!a.q_raw) {
    attn_split_block<HB>(kp, nk, lg, cap, q, a.head_dim, nh, scale, part, stats);
    return;
  }
  // q_heads_kernel's work (norm_rope_heads, the same bits) on a copy of the group's heads; then the
  // split reads q from there.
  static_assert(kAttnThreads == kRowThreads, "q_heads' reductions are written for its 256 threads");
  __shared__ double red[HB][kRowWarps];
  float* qs = attn_q_shared(smem, cap, HB);  // [HB][head_dim]
  const int hd = a.head_dim, elems = nh * hd;
  for (int e = static_cast<int>(threadIdx.x); e < elems; e += kAttnThreads) qs[e] = q[e];
  __syncthreads();
  norm_rope_heads<HB>(qs, nh, hd, a.rope_dim, a.q_eps, L.pos[li], a.inv_freq, red);
  attn_split_block<HB, true>(kp, nk, lg, cap, qs, hd, nh, scale, part, stats);
}

// grid (heads, lanes): the splits of one (lane, head) merged with the sink, then the inverse tail RoPE.
__global__ void __launch_bounds__(kAttnCombineThreads) attention_combine_kernel(AttentionLaunch a, StepLanes L) {
  __shared__ float rc[kAttnMaxRopeHalf], rs[kAttnMaxRopeHalf];
  const int h = static_cast<int>(blockIdx.x), li = static_cast<int>(blockIdx.y);
  // The lane's keys and the inverse RoPE's table (step inputs and constants) before the grid wait
  // (a.early, pass 41): the position's load and the double sincos overlap the split kernel.
  if (!a.early) ds4_grid_begin();
  const LaneKeys k = lane_keys(a, L, li);
  const int half = a.rope_dim / 2;
  for (int j = static_cast<int>(threadIdx.x); j < half; j += kAttnCombineThreads) {
    double s, c;
    sincos(static_cast<double>(k.t) * a.inv_freq[j], &s, &c);
    rc[j] = static_cast<float>(c);
    rs[j] = -static_cast<float>(s);  // the inverse rotation
  }
  if (a.early) ds4_grid_begin();
  __syncthreads();
  const int64_t head = static_cast<int64_t>(li) * a.n_head + h;
  attn_combine_head(a.part + head * kAttnMaxSplits * a.head_dim, a.part_stats + head * kAttnMaxSplits * 2,
                    attn_splits(k.n, a.split_min), a.sinks[h], a.head_dim, (a.head_dim - a.rope_dim) / 2, rc, rs,
                    a.out + head * a.head_dim);
  if (a.planes != nullptr) {  // the head's piece of its member's column
    __syncthreads();
    const int member = h / a.heads_per_member, piece = h % a.heads_per_member;
    uint8_t* P = a.planes + (static_cast<int64_t>(member) * gridDim.y + li) * a.planes_ld +
                 static_cast<int64_t>(piece) * (a.head_dim / 32) * kPlaneBytes;
    unit_planes_of_row(a.out + head * a.head_dim, a.head_dim, P);
  }
}

// The device's opt-in shared memory per block, read once.
int smem_optin_limit() {
  static const int limit = [] {
    int dev = 0, bytes = 0;
    DS4_GPU_CHECK(cudaGetDevice(&dev));
    DS4_GPU_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return bytes;
  }();
  return limit;
}

template <int HB>
void launch_attention(const AttentionLaunch& a, const StepLanes& L, int n, int cap, int splits, size_t smem,
                      cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((a.n_head + HB - 1) / HB), static_cast<unsigned>(splits),
                  static_cast<unsigned>(n));
  launch(attention_split_kernel<HB>, grid, kAttnThreads, smem, s, a, L, cap);
}

// --- ring store ----------------------------------------------------------------------------------

__global__ void __launch_bounds__(128)
    ring_store_kernel(uint16_t* __restrict__ ring, const uint16_t* __restrict__ kv16, int head_dim, StepLanes L) {
  ds4_grid_begin();
  const int i = static_cast<int>(blockIdx.x);
  const int64_t t = L.pos[i];
  const int64_t last = static_cast<int64_t>(L.t0[i]) + L.grp_len[L.group[i]] - 1;
  if (t + kPage <= last) return;  // a later lane of the slot owns this ring row
  uint16_t* dst = ring + (static_cast<int64_t>(L.slot[i]) * kPage + t % kPage) * head_dim;
  const uint16_t* src = kv16 + static_cast<int64_t>(i) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) dst[e] = src[e];
}

}  // namespace

void compressor_update(const CompressorLaunch& a, const StepLanes& L, int n, int n_groups, bool parallel,
                       Stream s) {
  if (n_groups <= 0) return;
  const size_t smem = compressor_smem(a);
  if (smem > 48 * 1024) throw std::invalid_argument("GPU compressor: a pooled row and its candidates above 48 KB of shared memory");
  if (!parallel) {
    launch(compressor_kernel, n_groups, kRowThreads, smem, cs(s), a, L);
    DS4_GPU_CHECK_LAUNCH("compressor_kernel");
    return;
  }
  const unsigned groups = static_cast<unsigned>(n_groups);
  launch(compressor_pool_kernel, dim3(static_cast<unsigned>((n + a.ratio - 1) / a.ratio), groups), kRowThreads, smem,
         cs(s), a, L);
  DS4_GPU_CHECK_LAUNCH("compressor_pool_kernel");
  launch(compressor_state_kernel, dim3(static_cast<unsigned>(a.ratio), groups), kRowThreads, 0, cs(s), a, L);
  DS4_GPU_CHECK_LAUNCH("compressor_state_kernel");
}

void indexer_scores(const float* Q, const float* W, int n, int n_heads, int head_dim, const StepLanes& L,
                    const uint16_t* pages, int64_t page_elems, int64_t row_off, int top_k, int max_vis,
                    float* scores, int64_t ld_scores, Stream s) {
  if (n <= 0 || max_vis <= top_k) return;
  const size_t smem = (static_cast<size_t>(n_heads) * head_dim + n_heads) * sizeof(float);
  if (smem > 48 * 1024) throw std::invalid_argument("GPU indexer: index heads x head_dim above 12000 values");
  const dim3 grid(static_cast<unsigned>((max_vis + kIdxPerBlock - 1) / kIdxPerBlock), static_cast<unsigned>(n));
  const cudaStream_t st = cs(s);
  auto run = [&](auto kernel) {
    ds4::gpu::launch(kernel, grid, kRowThreads, smem, st, Q, W, n_heads, L, pages, page_elems, row_off, top_k, scores, ld_scores);
  };
  const int m = n_heads <= 32 ? 1 : n_heads <= 64 ? 2 : 0;
  const size_t smem2 = (static_cast<size_t>(m) * DS4_WARP * head_dim + m * DS4_WARP) * sizeof(float);
  if (m > 0 && smem2 <= 48 * 1024) {  // heads over lanes (most shapes; DS4: 64 heads of 128)
    const dim3 grid2(static_cast<unsigned>((max_vis + kIdx2PerBlock - 1) / kIdx2PerBlock), static_cast<unsigned>(n));
    auto run2 = [&](auto kernel) {
      ds4::gpu::launch(kernel, grid2, kRowThreads, smem2, st, Q, W, n_heads, L, pages, page_elems, row_off, top_k, scores,
             ld_scores);
    };
    switch (head_dim * 4 + m) {
      case 32 * 4 + 1: run2(indexer_scores_heads_kernel<1, 1>); break;
      case 32 * 4 + 2: run2(indexer_scores_heads_kernel<1, 2>); break;
      case 64 * 4 + 1: run2(indexer_scores_heads_kernel<2, 1>); break;
      case 64 * 4 + 2: run2(indexer_scores_heads_kernel<2, 2>); break;
      case 128 * 4 + 1: run2(indexer_scores_heads_kernel<4, 1>); break;
      case 128 * 4 + 2: run2(indexer_scores_heads_kernel<4, 2>); break;
      case 256 * 4 + 1: run2(indexer_scores_heads_kernel<8, 1>); break;
      case 256 * 4 + 2: run2(indexer_scores_heads_kernel<8, 2>); break;
      case 512 * 4 + 1: run2(indexer_scores_heads_kernel<16, 1>); break;
      default: throw std::invalid_argument("GPU indexer: index_head_dim must be 32, 64, 128, 256 or 512");
    }
    DS4_GPU_CHECK_LAUNCH("indexer_scores_heads_kernel");
    return;
  }
  switch (head_dim) {
    case 32: run(indexer_scores_kernel<1>); break;
    case 64: run(indexer_scores_kernel<2>); break;
    case 128: run(indexer_scores_kernel<4>); break;
    case 256: run(indexer_scores_kernel<8>); break;
    case 512: run(indexer_scores_kernel<16>); break;
    default: throw std::invalid_argument("GPU indexer: index_head_dim must be 32, 64, 128, 256 or 512");
  }
  DS4_GPU_CHECK_LAUNCH("indexer_scores_kernel");
}

void indexer_topk(const float* scores, int64_t ld_scores, int n, const int32_t* pos, int top_k, int32_t* sel,
                  int64_t ld_sel, Stream s) {
  if (n <= 0) return;
  launch(indexer_topk_kernel, n, kTopkThreads, 0, cs(s), scores, ld_scores, pos, top_k, sel, ld_sel);
  DS4_GPU_CHECK_LAUNCH("indexer_topk_kernel");
}

// The dynamic shared memory each head-group size may ask for: the device's opt-in limit less the
// kernel's static shared memory (their sum is what the attribute bounds), raised once, outside any
// graph capture; 48 KB less the static part where raising it fails.
static size_t attn_dyn_limit[5] = {0, 0, 0, 0, 0};  // indexed by HB (1, 2, 4)

template <int HB>
static void prepare_attention_kernel() {
  const void* fn = reinterpret_cast<const void*>(&attention_split_kernel<HB>);
  cudaFuncAttributes attr;
  DS4_GPU_CHECK(cudaFuncGetAttributes(&attr, fn));
  const size_t stat = attr.sharedSizeBytes;
  const size_t optin = static_cast<size_t>(smem_optin_limit());
  size_t dyn = optin > stat ? optin - stat : 0;
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)) != cudaSuccess) {
    (void)cudaGetLastError();
    dyn = 48 * 1024 > stat ? 48 * 1024 - stat : 0;
  }
  attn_dyn_limit[HB] = dyn;
}

namespace {
std::atomic<int> g_attn_heads{0};                  // 0: the rule
std::atomic<int> g_attn_split_min{kAttnSplitKeys};
std::atomic<int> g_attn_early{-1};  // the split and combine kernels' step-input work before the wait (-1: environment)
}  // namespace

int attn_heads_setting() { return g_attn_heads.load(std::memory_order_relaxed); }
int attn_split_min() { return g_attn_split_min.load(std::memory_order_relaxed); }

int attn_heads_a_block(int n_lanes) {
  // The head group size only changes how many heads share a block, never a head's arithmetic. The
  // rule: two heads a block when the step has one or two lanes (twice the blocks), else four (each key
  // row read by a quarter of the blocks).
  const int hb = attn_heads_setting();
  return hb > 0 ? hb : n_lanes <= 2 ? 2 : 4;
}

namespace testing {

int set_attn_heads(int heads) {
  if (heads != -1 && heads != 1 && heads != 2 && heads != 4)
    throw std::invalid_argument("attention heads a block: 1, 2 or 4 (-1: the rule), not " + std::to_string(heads));
  g_attn_heads.store(heads < 0 ? 0 : heads, std::memory_order_relaxed);
  return attn_heads_setting();
}

int set_attn_split_min(int keys) {
  if (keys != -1 && (keys < 8 || keys > 256 || keys % 8 != 0))
    throw std::invalid_argument("attention keys a split: 8 to 256 in steps of 8 (-1: the default), not " +
                                std::to_string(keys));
  g_attn_split_min.store(keys < 0 ? kAttnSplitKeys : keys, std::memory_order_relaxed);
  return attn_split_min();
}

bool attn_early() { return ds4::gpu::attn_early(); }

}  // namespace testing

bool attn_early() { return env_switch(g_attn_early, "DS4_GPU_ATTN_EARLY"); }

void attention_prepare() {
  prepare_attention_kernel<4>();
  prepare_attention_kernel<2>();
  prepare_attention_kernel<1>();
}

int64_t attention_part_floats(int n_lanes, int n_head, int head_dim) {
  return static_cast<int64_t>(n_lanes) * n_head * kAttnMaxSplits * (head_dim + 2);
}

void attention_paged(const AttentionLaunch& a_in, const StepLanes& L, int n, Stream s) {
  if (n <= 0) return;
  if (a_in.head_dim <= 0 || a_in.head_dim % 8 != 0 || a_in.head_dim > kAttnMaxDim)
    throw std::invalid_argument("GPU attention: head_dim must be a multiple of 8, at most 512");
  if (a_in.rope_dim / 2 > kAttnMaxRopeHalf) throw std::invalid_argument("GPU attention: rope_dim above 512");
  if (a_in.part == nullptr) throw std::invalid_argument("GPU attention: no split scratch (AttentionLaunch::part)");
  if (a_in.planes != nullptr &&
      (a_in.head_dim % 32 != 0 || a_in.heads_per_member < 1 || a_in.n_head % a_in.heads_per_member != 0))
    throw std::invalid_argument("GPU attention: planes need head_dim % 32 == 0 and whole heads a member");
  if (attn_dyn_limit[1] == 0) attention_prepare();  // outside a capture: engines prepare at construction
  AttentionLaunch a = a_in;
  a.early = attn_early();
  a.part_stats = a.part + static_cast<int64_t>(n) * a.n_head * kAttnMaxSplits * a.head_dim;
  const int bound = std::max(a.max_keys, 1);
  a.split_min = attn_split_min();
  const int cap = attn_split_keys(bound, a.split_min), splits = attn_splits(bound, a.split_min);
  auto need = [&](int hb) { return attn_split_smem(cap, hb, a.head_dim, a.q_raw); };
  const cudaStream_t st = cs(s);
  switch (attn_heads_that_fit(n, a.n_head, [&](int hb) { return need(hb) <= attn_dyn_limit[hb]; })) {
    case 4: launch_attention<4>(a, L, n, cap, splits, need(4), st); break;
    case 2: launch_attention<2>(a, L, n, cap, splits, need(2), st); break;
    case 1: launch_attention<1>(a, L, n, cap, splits, need(1), st); break;
    default:
      throw std::invalid_argument("GPU attention: " + std::to_string(a.max_keys) +
                                  " keys per lane do not fit this device's shared memory");
  }
  DS4_GPU_CHECK_LAUNCH("attention_split_kernel");
  const dim3 grid(static_cast<unsigned>(a.n_head), static_cast<unsigned>(n));
  launch(attention_combine_kernel, grid, kAttnCombineThreads, 0, st, a, L);
  DS4_GPU_CHECK_LAUNCH("attention_combine_kernel");
}

void ring_store(uint16_t* ring, const uint16_t* kv16, int n, int head_dim, const StepLanes& L, Stream s) {
  if (n <= 0) return;
  launch(ring_store_kernel, n, 128, 0, cs(s), ring, kv16, head_dim, L);
  DS4_GPU_CHECK_LAUNCH("ring_store_kernel");
}

}  // namespace ds4::gpu
