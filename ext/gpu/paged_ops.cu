// The per-slot part of a DS4 step on the GPU (step_ops.h): compressors, the lightning indexer and
// gathered attention over the paged state. Phase B of ext/engine/engine.cpp, reorganised so that
// different slots run in parallel and no lane waits on another:
//
//   compressor_update  grid = slots in the step, 256 threads. A slot's lanes run in order inside
//                      the block (the state is sequential); channels split over threads. A finished
//                      block is pooled (per-channel softmax over its candidates), normed, rotated,
//                      QAT'd and stored as f16 into its page. Entries are write-once, and a lane only
//                      reads entries s < (t+1)/m, so running every compressor before any attention
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
//   attention_paged    grid (head groups, lanes), 256 threads: the lane's key rows are resolved to
//                      pointers once (window rows before the slot's first lane of this step come
//                      from the ring, later ones from this step's f16 rows, so no ring row is
//                      overwritten before every lane that needs it has read it), then logits, the
//                      softmax with the sink, sum p k in key order, and the inverse tail RoPE.
//                      Bytes: the lane's keys (2 * head_dim each) per head group, from L2 after
//                      the first group.
//   ring_store         grid = lanes: this step's rows into the rings, after attention (the last
//                      128 positions of each slot). Bytes: 4 * head_dim per lane.
#include <algorithm>
#include <string>

#include "rowops.cuh"
#include "step_ops.h"

namespace ds4::gpu {

namespace {

cudaStream_t cs(Stream s) { return static_cast<cudaStream_t>(s); }

constexpr int kPage = 128;  // tokens per page and rows per ring

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// --- compressor --------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRowThreads) compressor_kernel(CompressorLaunch a, StepLanes L) {
  extern __shared__ float buf[];  // the pooled row [c]
  __shared__ double red[kRowWarps];
  const int g = static_cast<int>(blockIdx.x);
  const int slot = L.grp_slot[g], first = L.grp_first[g], len = L.grp_len[g];
  const int m = a.ratio, w = a.width, c = a.c;
  const bool overlap = m == 4;
  float* kv = a.states + static_cast<int64_t>(slot) * a.state_per_slot + a.kv_off;
  float* sc = kv + static_cast<int64_t>(a.rows) * w;
  const int32_t* table = L.tables + static_cast<int64_t>(g) * L.max_blocks;
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

    // Candidates of channel ch: CSA the m previous rows at column ch, then the m current rows at
    // column c + ch; HCA the m rows at column ch. Fixed order, as compressor.cpp.
    const int n_cand = overlap ? 2 * m : m;
    for (int ch = threadIdx.x; ch < c; ch += kRowThreads) {
      float mx = sc[ch];
      for (int r = 1; r < n_cand; ++r)
        mx = fmaxf(mx, sc[static_cast<int64_t>(r) * w + ((overlap && r >= m) ? c + ch : ch)]);
      float den = 0.0f, num = 0.0f;
      for (int r = 0; r < n_cand; ++r) {
        const int64_t col = static_cast<int64_t>(r) * w + ((overlap && r >= m) ? c + ch : ch);
        const float e = expf(sc[col] - mx);
        den += e;
        num += e * kv[col];
      }
      buf[ch] = num / den;
    }
    __syncthreads();
    if (overlap) {  // the current block becomes the next one's previous half
      for (int e = threadIdx.x; e < m * w; e += kRowThreads) {
        kv[e] = kv[static_cast<int64_t>(m) * w + e];
        sc[e] = sc[static_cast<int64_t>(m) * w + e];
      }
    }
    const int64_t start = t + 1 - m;  // first token of the finished block
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
    uint16_t* dst = a.pages + page * a.page_elems + a.row_off + ((start % kPage) / m) * c;
    for (int e = threadIdx.x; e < c; e += kRowThreads) dst[e] = f32_to_f16_bits(buf[e]);
    __syncthreads();
  }
}

// --- indexer scores ------------------------------------------------------------------------------

constexpr int kIdxPerWarp = 8;
constexpr int kIdxPerBlock = kIdxPerWarp * kRowWarps;

template <int PL>  // elements per lane: index_head_dim / 32
__global__ void __launch_bounds__(kRowThreads)
    indexer_scores_kernel(const float* __restrict__ Q, const float* __restrict__ W, int n_heads, StepLanes L,
                          const uint16_t* __restrict__ pages, int64_t page_elems, int64_t row_off, int top_k,
                          float* __restrict__ scores, int64_t ld) {
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

// --- top-k ---------------------------------------------------------------------------------------

constexpr int kTopkThreads = 1024;

// Larger float, larger key (+0.0 and -0.0 equal, as the CPU's comparisons treat them).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = ds4_float_to_bits(f + 0.0f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum of one int per thread (blockDim.x == kTopkThreads); a: shared scratch.
__device__ int block_exclusive_scan(int v, int* a) {
  const int tid = static_cast<int>(threadIdx.x);
  a[tid] = v;
  __syncthreads();
  for (int off = 1; off < kTopkThreads; off <<= 1) {
    const int x = tid >= off ? a[tid - off] : 0;
    __syncthreads();
    a[tid] += x;
    __syncthreads();
  }
  const int incl = a[tid];
  __syncthreads();
  return incl - v;
}

__global__ void __launch_bounds__(kTopkThreads)
    indexer_topk_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ pos, int top_k,
                        int32_t* __restrict__ sel, int64_t ld_sel) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_mask, s_rem;
  __shared__ int scan[kTopkThreads];
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
    if (tid == 0) {
      uint32_t cum = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (cum + hist[b] >= rem) break;
        cum += hist[b];
      }
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
      s_mask = mask | (255u << shift);
      s_rem = rem - cum;
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

constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / DS4_WARP;
constexpr int kAttnMaxDim = 512;
constexpr int kMaxRopeHalf = 256;

__device__ __forceinline__ void load_f16x8(const uint16_t* p, float f[8]) {
  const uint4 v = ds4_ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = half_bits_to_float(w[i] & 0xffffu);
    f[2 * i + 1] = half_bits_to_float(w[i] >> 16);
  }
}

template <int HB>
__global__ void __launch_bounds__(kAttnThreads) attention_paged_kernel(AttentionLaunch a, StepLanes L) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint16_t** kp = reinterpret_cast<const uint16_t**>(smem);         // [max_keys] key rows
  float* lg = reinterpret_cast<float*>(smem + sizeof(void*) * a.max_keys);  // [HB][max_keys]
  __shared__ float rc[kMaxRopeHalf], rs[kMaxRopeHalf];
  constexpr int CH = kAttnMaxDim / 8 / DS4_WARP;
  const int hd = a.head_dim, max_keys = a.max_keys;
  const int li = static_cast<int>(blockIdx.y), h0 = static_cast<int>(blockIdx.x) * HB;
  const int nh = min(HB, a.n_head - h0);
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;

  // The lane's keys, in the CPU's order: window positions ascending, then compressed entries.
  const int64_t t = L.pos[li], t0 = L.t0[li];
  const int g = L.group[li], slot = L.slot[li], gfirst = L.grp_first[g];
  const int64_t win_first = t > kPage - 1 ? t - (kPage - 1) : 0;
  const int n_win = static_cast<int>(t - win_first + 1);
  int n_comp = 0;
  bool use_sel = false;
  if (a.ratio == 4) {
    const int64_t n_vis = (t + 1) / 4;
    n_comp = static_cast<int>(min64(a.top_k, n_vis));
    use_sel = n_comp < n_vis;
  } else if (a.ratio == kPage) {
    n_comp = static_cast<int>((t + 1) / kPage);
  }
  const int n = min(n_win + n_comp, max_keys);  // the launcher's bound keeps shared memory safe
  const int32_t* table = L.tables + static_cast<int64_t>(g) * L.max_blocks;
  for (int j = threadIdx.x; j < n; j += kAttnThreads) {
    const uint16_t* p;
    if (j < n_win) {
      const int64_t q = win_first + j;
      p = q >= t0 ? a.kv16 + static_cast<int64_t>(L.order[gfirst + (q - t0)]) * hd
                  : a.ring + (static_cast<int64_t>(slot) * kPage + q % kPage) * hd;
    } else {
      const int64_t s = use_sel ? a.sel[static_cast<int64_t>(li) * a.ld_sel + (j - n_win)] : j - n_win;
      const int64_t start = s * a.ratio;
      p = a.pages + static_cast<int64_t>(table[start / kPage]) * a.page_elems + a.row_off +
          ((start % kPage) / a.ratio) * hd;
    }
    kp[j] = p;
  }
  const int half = a.rope_dim / 2;
  for (int k = threadIdx.x; k < half; k += kAttnThreads) {
    double s, c;
    sincos(static_cast<double>(t) * a.inv_freq[k], &s, &c);
    rc[k] = static_cast<float>(c);
    rs[k] = -static_cast<float>(s);  // the inverse rotation
  }

  // Phase 1: logits. Lane l holds chunks l and l + 32 of each head's query.
  const int chunks = hd / 8;
  float qr[HB][CH][8];
#pragma unroll
  for (int h = 0; h < HB; ++h)
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int c = lane + DS4_WARP * j;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        qr[h][j][e] = (h < nh && c < chunks) ? a.q[(static_cast<int64_t>(li) * a.n_head + h0 + h) * hd + 8 * c + e]
                                             : 0.0f;
    }
  __syncthreads();
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(hd)));
#pragma unroll 2
  for (int i = warp; i < n; i += kAttnWarps) {
    const uint16_t* row = kp[i];
    float kf[CH][8];
#pragma unroll
    for (int j = 0; j < CH; ++j)
      if (lane + DS4_WARP * j < chunks) load_f16x8(row + 8 * (lane + DS4_WARP * j), kf[j]);
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < CH; ++j)
        if (lane + DS4_WARP * j < chunks) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(qr[h][j][e], kf[j][e], s);
        }
      s = warp_sum(s);
      if (lane == 0 && h < nh) lg[h * max_keys + i] = s * scale;
    }
  }
  __syncthreads();

  // Phase 2: softmax with the sink in the denominator only, one warp per head.
  if (warp < nh) {
    float* l = lg + warp * max_keys;
    const float sink = a.sinks[h0 + warp];
    float mx = sink;
    for (int i = lane; i < n; i += DS4_WARP) mx = fmaxf(mx, l[i]);
    mx = warp_max_f(mx);
    float part = 0.0f;
    for (int i = lane; i < n; i += DS4_WARP) {
      const float e = expf(l[i] - mx);
      l[i] = e;
      part += e;
    }
    const float den = expf(sink - mx) + warp_sum(part);
    const float inv = 1.0f / den;
    for (int i = lane; i < n; i += DS4_WARP) l[i] *= inv;
  }
  __syncthreads();

  // Phase 3: out = sum_j p_j k_j in key order, then the inverse RoPE of the tail pairs.
  const int pairs = hd / 2, tail0 = (hd - a.rope_dim) / 2;
  for (int e2 = static_cast<int>(threadIdx.x); e2 < pairs; e2 += kAttnThreads) {
    float o[HB][2];
#pragma unroll
    for (int h = 0; h < HB; ++h) o[h][0] = o[h][1] = 0.0f;
#pragma unroll 16  // independent loads in flight (the loop waits on them); the sums still run in key order
    for (int i = 0; i < n; ++i) {
      const uint32_t kk = ds4_ldg(reinterpret_cast<const uint32_t*>(kp[i]) + e2);
      const float k0 = half_bits_to_float(kk & 0xffffu), k1 = half_bits_to_float(kk >> 16);
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float p = lg[h * max_keys + i];
        o[h][0] += p * k0;
        o[h][1] += p * k1;
      }
    }
#pragma unroll
    for (int h = 0; h < HB; ++h)
      if (h < nh) {
        float x0 = o[h][0], x1 = o[h][1];
        if (e2 >= tail0) {
          const int k = e2 - tail0;
          const float c = rc[k], sn = rs[k];
          const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
          x0 = y0;
          x1 = y1;
        }
        float* dst = a.out + (static_cast<int64_t>(li) * a.n_head + h0 + h) * hd + 2 * e2;
        dst[0] = x0;
        dst[1] = x1;
      }
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
void launch_attention(const AttentionLaunch& a, const StepLanes& L, int n, size_t smem, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((a.n_head + HB - 1) / HB), static_cast<unsigned>(n));
  attention_paged_kernel<HB><<<grid, kAttnThreads, smem, s>>>(a, L);
}

// --- ring store ----------------------------------------------------------------------------------

__global__ void __launch_bounds__(128)
    ring_store_kernel(uint16_t* __restrict__ ring, const uint16_t* __restrict__ kv16, int head_dim, StepLanes L) {
  const int i = static_cast<int>(blockIdx.x);
  const int64_t t = L.pos[i];
  const int64_t last = static_cast<int64_t>(L.t0[i]) + L.grp_len[L.group[i]] - 1;
  if (t + kPage <= last) return;  // a later lane of the slot owns this ring row
  uint16_t* dst = ring + (static_cast<int64_t>(L.slot[i]) * kPage + t % kPage) * head_dim;
  const uint16_t* src = kv16 + static_cast<int64_t>(i) * head_dim;
  for (int e = threadIdx.x; e < head_dim; e += blockDim.x) dst[e] = src[e];
}

}  // namespace

void compressor_update(const CompressorLaunch& a, const StepLanes& L, int n_groups, Stream s) {
  if (n_groups <= 0) return;
  if (a.c > 12 * 1024) throw std::invalid_argument("GPU compressor: row width above 12288");
  compressor_kernel<<<n_groups, kRowThreads, static_cast<size_t>(a.c) * sizeof(float), cs(s)>>>(a, L);
  DS4_GPU_CHECK_LAUNCH("compressor_kernel");
}

void indexer_scores(const float* Q, const float* W, int n, int n_heads, int head_dim, const StepLanes& L,
                    const uint16_t* pages, int64_t page_elems, int64_t row_off, int top_k, int max_vis,
                    float* scores, int64_t ld_scores, Stream s) {
  if (n <= 0 || max_vis <= top_k) return;
  const size_t smem = (static_cast<size_t>(n_heads) * head_dim + n_heads) * sizeof(float);
  if (smem > 48 * 1024) throw std::invalid_argument("GPU indexer: index heads x head_dim above 12000 values");
  const dim3 grid(static_cast<unsigned>((max_vis + kIdxPerBlock - 1) / kIdxPerBlock), static_cast<unsigned>(n));
  const cudaStream_t st = cs(s);
  auto launch = [&](auto kernel) {
    kernel<<<grid, kRowThreads, smem, st>>>(Q, W, n_heads, L, pages, page_elems, row_off, top_k, scores, ld_scores);
  };
  switch (head_dim) {
    case 32: launch(indexer_scores_kernel<1>); break;
    case 64: launch(indexer_scores_kernel<2>); break;
    case 128: launch(indexer_scores_kernel<4>); break;
    case 256: launch(indexer_scores_kernel<8>); break;
    case 512: launch(indexer_scores_kernel<16>); break;
    default: throw std::invalid_argument("GPU indexer: index_head_dim must be 32, 64, 128, 256 or 512");
  }
  DS4_GPU_CHECK_LAUNCH("indexer_scores_kernel");
}

void indexer_topk(const float* scores, int64_t ld_scores, int n, const int32_t* pos, int top_k, int32_t* sel,
                  int64_t ld_sel, Stream s) {
  if (n <= 0) return;
  indexer_topk_kernel<<<n, kTopkThreads, 0, cs(s)>>>(scores, ld_scores, pos, top_k, sel, ld_sel);
  DS4_GPU_CHECK_LAUNCH("indexer_topk_kernel");
}

// The dynamic shared memory each head-group size may ask for: the device's opt-in limit less the
// kernel's static shared memory (their sum is what the attribute bounds), raised once, outside any
// graph capture; 48 KB less the static part where raising it fails.
static size_t attn_dyn_limit[5] = {0, 0, 0, 0, 0};  // indexed by HB (1, 2, 4)

template <int HB>
static void prepare_attention_kernel() {
  const void* fn = reinterpret_cast<const void*>(&attention_paged_kernel<HB>);
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

void attention_prepare() {
  prepare_attention_kernel<4>();
  prepare_attention_kernel<2>();
  prepare_attention_kernel<1>();
}

void attention_paged(const AttentionLaunch& a, const StepLanes& L, int n, Stream s) {
  if (n <= 0) return;
  if (a.head_dim <= 0 || a.head_dim % 8 != 0 || a.head_dim > kAttnMaxDim)
    throw std::invalid_argument("GPU attention: head_dim must be a multiple of 8, at most 512");
  if (a.rope_dim / 2 > kMaxRopeHalf) throw std::invalid_argument("GPU attention: rope_dim above 512");
  if (attn_dyn_limit[1] == 0) attention_prepare();  // outside a capture: engines prepare at construction
  const size_t keys = static_cast<size_t>(std::max(a.max_keys, 1));
  auto need = [&](int hb) { return keys * (sizeof(void*) + hb * sizeof(float)); };
  const cudaStream_t st = cs(s);
  // The head group size only changes how many heads share a block, never a head's arithmetic.
  if (a.n_head >= 4 && need(4) <= attn_dyn_limit[4])
    launch_attention<4>(a, L, n, need(4), st);
  else if (a.n_head >= 2 && need(2) <= attn_dyn_limit[2])
    launch_attention<2>(a, L, n, need(2), st);
  else if (need(1) <= attn_dyn_limit[1])
    launch_attention<1>(a, L, n, need(1), st);
  else
    throw std::invalid_argument("GPU attention: " + std::to_string(a.max_keys) +
                                " keys per lane do not fit this device's shared memory");
  DS4_GPU_CHECK_LAUNCH("attention_paged_kernel");
}

void ring_store(uint16_t* ring, const uint16_t* kv16, int n, int head_dim, const StepLanes& L, Stream s) {
  if (n <= 0) return;
  ring_store_kernel<<<n, 128, 0, cs(s)>>>(ring, kv16, head_dim, L);
  DS4_GPU_CHECK_LAUNCH("ring_store_kernel");
}

}  // namespace ds4::gpu
