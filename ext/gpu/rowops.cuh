// Device building blocks of the per-lane step kernels (lane_ops.cu, paged_ops.cu): one block of
// kRowThreads threads finishing one row (a lane's vector, a head, a pooled compressor row) with
// exactly the formulas of ext/engine/ops.cpp:
//   block_sum      sum of per-thread doubles: warp butterfly, then a fixed tree over the 8 warps
//                  (the order depends on the block shape only, never on other lanes)
//   rms_factor     float(1 / sqrt(sum(x^2) / n + eps)), the sum of squares in double
//   rope_block     interleaved-pair tail RoPE, cos/sin of pos * inv_freq in double rounded once
//                  to float, then x0*c - x1*s, x0*s + x1*c (the inverse negates s)
//   fp8_block      spec §7 item 1: blocks of 64, s = 2^ceil(log2(max(amax,1e-4)/448)), e4m3 RNE
//   hadamard_block orthonormal Walsh-Hadamard in Sylvester order, the CPU's butterflies
//   fp4_block      spec §7 item 2: blocks of 32, e2m1 with ties to the even code
// Rows live in shared memory; every helper ends with __syncthreads() so the caller can chain them.
// Bytes: these touch shared memory only.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace ds4::gpu {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / DS4_WARP;
static_assert(kRowWarps == 8, "block_sum's tree is written for 8 warps");

// The fixed tree over the 8 warps' sums of a block (block_sum, rms_factors).
__device__ __forceinline__ double warps_tree(const double* v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// Sum of one double per thread (blockDim.x == kRowThreads); red: 8 shared doubles. Every thread
// gets the same bits; red is free again on return.
__device__ __forceinline__ double block_sum(double v, double* red) {
  v = warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
  if (threadIdx.x % DS4_WARP == 0) red[warp] = v;
  __syncthreads();
  const double t = warps_tree(red);
  __syncthreads();
  return t;
}

__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, ds4_shfl_xor(v, m));
  return v;
}

// Thread t's part of a sum of squares over x[0..n) with nt threads: x[t], x[t + nt], ... added in
// that order in double. The loads go out B at a time before any is added (a latency chain of
// n / (nt * B) loads instead of n / nt); the order of the additions, hence the bits, is that of the
// plain strided loop whatever B. Rows of a few elements a thread take a small B: a batch's
// predicated-off loads and adds still issue (pass 24: kSsBatch's were most of q_heads' instructions).
constexpr int kSsBatch = 16;
template <int B = kSsBatch>
__device__ __forceinline__ double strided_sumsq(const float* x, int64_t n, int t, int nt) {
  double ss = 0.0;
  for (int64_t b = t; b < n; b += static_cast<int64_t>(B) * nt) {
    float v[B];
#pragma unroll
    for (int j = 0; j < B; ++j) {
      const int64_t i = b + static_cast<int64_t>(j) * nt;
      v[j] = i < n ? x[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < B; ++j)
      if (b + static_cast<int64_t>(j) * nt < n) ss += static_cast<double>(v[j]) * v[j];
  }
  return ss;
}

// One halving round over the first N values of v: the lanes with bit MASK set keep the upper half
// (moved down to [0, H), H = ceil(N / 2)), the others the lower half, each adding its partner's copy.
// An odd N pads its upper half with a zero, a slot no value reaches (warp_sums_slot).
template <int N, int MASK>
__device__ __forceinline__ void halve(float* v, int lane) {
  constexpr int H = (N + 1) / 2;
  const bool up = (lane & MASK) != 0;
#pragma unroll
  for (int k = 0; k < H; ++k) {
    const float hi = k + H < N ? v[k + H] : 0.0f;
    const float send = up ? v[k] : hi;
    const float keep = up ? hi : v[k];
    v[k] = keep + ds4_shfl_xor(send, MASK);
  }
}

// The warp sums of N values a lane: halving rounds at masks 16, 8, 4, 2, 1 while a lane holds two
// or more values, warp_sum's butterfly steps after that. Each sum adds the same operands in the same
// order as warp_sum of that value (v + the partner's v, masks 16 down to 1): the same bits, in about
// N - 1 shuffles for N <= 32 where N butterflies take 5 N (24 values: 24 shuffles, where padding
// them to 32 took 31). Then for N <= 32 lane l holds the sum of value warp_sums_slot<N>(l) in v[0]
// (for a power of two, l / (32 / N)); for N a power of two >= 32, the sums of values
// (N / 32) l .. (N / 32) (l + 1) - 1 in v[0..N/32).
template <int N, int MASK = 16>
__device__ __forceinline__ void warp_sums(float* v, int lane) {
  static_assert(N <= DS4_WARP || (N & (N - 1)) == 0, "warp_sums: up to 32 values, or a power of two");
  if constexpr (MASK >= 1) {
    if constexpr (N >= 2) {
      halve<N, MASK>(v, lane);
    } else {
      v[0] += ds4_shfl_xor(v[0], MASK);
    }
    warp_sums<(N >= 2 ? (N + 1) / 2 : 1), MASK / 2>(v, lane);
  }
}

// Which of warp_sums<N>'s N <= 32 values lane l holds the sum of at the end; -1: a padding slot.
template <int N>
__host__ __device__ constexpr int warp_sums_slot(int lane) {
  static_assert(N >= 1 && N <= DS4_WARP, "warp_sums_slot: 1 to 32 values");
  // Every lane holds `slots` slots (the same count in every lane), values first .. first + real - 1
  // in the first `real` of them, padding after.
  int first = 0, real = N, slots = N;
  for (int mask = DS4_WARP / 2; mask >= 1 && slots >= 2; mask >>= 1) {
    const int h = (slots + 1) / 2;
    if (lane & mask) {
      first += h;
      real = real > h ? real - h : 0;
    } else {
      real = real < h ? real : h;
    }
    slots = h;
  }
  return real == 1 ? first : -1;
}

// rms_factor's r from the row's sum of squares t over n elements.
__device__ __forceinline__ float rms_of_sumsq(double t, int64_t n, float eps) {
  return static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(eps)));
}

// r = rsqrt(mean(x^2) + eps) as the CPU rounds it (ops.cpp rms_norm), over x[0..n) (any memory).
__device__ __forceinline__ float rms_factor(const float* x, int64_t n, float eps, double* red) {
  const double ss = strided_sumsq(x, n, static_cast<int>(threadIdx.x), kRowThreads);
  return rms_of_sumsq(block_sum(ss, red), n, eps);
}

// rms_factor of H rows at once (rows h < nh of x, n apart): each row's strided parts, butterfly and
// block_sum's tree, so each r has rms_factor's bits, with one barrier for all the rows. red: H x 8
// shared doubles. B: strided_sumsq's batch.
template <int H, int B = kSsBatch>
__device__ __forceinline__ void rms_factors(const float* x, int64_t n, int nh, float eps, double (*red)[kRowWarps],
                                            float (&r)[H]) {
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
  double ss[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    ss[h] = h < nh ? strided_sumsq<B>(x + h * n, n, static_cast<int>(threadIdx.x), kRowThreads) : 0.0;
    ss[h] = warp_sum(ss[h]);
  }
  if (threadIdx.x % DS4_WARP == 0)
#pragma unroll
    for (int h = 0; h < H; ++h) red[h][warp] = ss[h];
  __syncthreads();
#pragma unroll
  for (int h = 0; h < H; ++h) r[h] = rms_of_sumsq(warps_tree(red[h]), n, eps);
}

// Sum of one double per thread over a block of kWideThreads (1024) threads: the butterfly in each
// warp, then warp 0 reduces the 32 warp sums by the same butterfly. Every thread gets the same
// bits; red (32 shared doubles) is free again on return.
constexpr int kWideThreads = 1024;
constexpr int kWideWarps = kWideThreads / DS4_WARP;
__device__ __forceinline__ double block_sum_wide(double v, double* red) {
  v = warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double t = warp_sum(red[lane]);  // every warp reduces the same 32 values the same way
  __syncthreads();
  return t;
}

// x = (x * r) * w (w null: x * r), in place on a shared or global row.
__device__ __forceinline__ void scale_row(float* x, int64_t n, float r, const float* w) {
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) x[i] = w ? (x[i] * r) * w[i] : x[i] * r;
  __syncthreads();
}

// Rotate interleaved pair k of tail by pos * inv_freq[k] (inverse: the conjugate).
__device__ __forceinline__ void rope_pair(float* tail, int k, int64_t pos, const double* inv_freq, bool inverse) {
  double s, c;
  sincos(static_cast<double>(pos) * inv_freq[k], &s, &c);
  const float cf = static_cast<float>(c);
  const float sf = inverse ? -static_cast<float>(s) : static_cast<float>(s);
  const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
  tail[2 * k] = x0 * cf - x1 * sf;
  tail[2 * k + 1] = x0 * sf + x1 * cf;
}

// Rotate the rope_dim/2 interleaved pairs of tail by pos * inv_freq[k] (inverse: the conjugate).
__device__ __forceinline__ void rope_block(float* tail, int half, int64_t pos, const double* inv_freq, bool inverse) {
  for (int k = threadIdx.x; k < half; k += kRowThreads) rope_pair(tail, k, pos, inv_freq, inverse);
  __syncthreads();
}

// q_heads' work on nh <= H heads of hd floats at x (shared or global memory the block owns): each
// head's unweighted RMSNorm (rms_factors: rms_factor's bits; scale_row's product) with one barrier for
// all of them, then the tail RoPE at pos (rope_block's pairs). Ends with a barrier.
template <int H>
__device__ __forceinline__ void norm_rope_heads(float* x, int nh, int hd, int rope_dim, float eps, int64_t pos,
                                                const double* inv_freq, double (*red)[kRowWarps]) {
  float r[H];
  rms_factors<H, 2>(x, hd, nh, eps, red, r);  // a head is a few elements a thread (DS4: 512 over 256)
#pragma unroll
  for (int h = 0; h < H; ++h)
    if (h < nh)
      for (int e = static_cast<int>(threadIdx.x); e < hd; e += kRowThreads) x[h * hd + e] = x[h * hd + e] * r[h];
  __syncthreads();
  const int half = rope_dim / 2;
  for (int e = static_cast<int>(threadIdx.x); e < nh * half; e += kRowThreads)
    rope_pair(x + (e / half) * hd + (hd - rope_dim), e % half, pos, inv_freq, false);
  __syncthreads();
}

// 2^ceil(log2(r)) for r > 0, exactly (ops.cpp pow2_ceil).
__device__ __forceinline__ float pow2_ceil_dev(float r) {
  int e;
  const float m = frexpf(r, &e);
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

// Nearest e4m3fn value of a (|a| <= 448), ties to even mantissa (ops.cpp e4m3_round).
__device__ __forceinline__ float e4m3_round_dev(float a) {
  const float mag = fabsf(a);
  if (mag == 0.0f) return a;
  int e;
  frexpf(mag, &e);
  const int ex = max(e - 1, -6);
  const float step = ldexpf(1.0f, ex - 3);
  return copysignf(rintf(mag / step) * step, a);
}

// Nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} (|a| <= 6), ties to the even code (ops.cpp e2m1_round).
__device__ __forceinline__ float e2m1_round_dev(float a) {
  const float mag = fabsf(a);
  float q;
  if (mag < 2.0f) {
    q = rintf(mag * 2.0f) * 0.5f;
  } else if (mag < 4.0f) {
    q = rintf(mag);
  } else {
    q = rintf(mag * 0.5f) * 2.0f;
  }
  return copysignf(q, a);
}

// FP8 round trip on x[0..n), n a multiple of 64: one warp per block of 64, two values per lane.
__device__ __forceinline__ void fp8_block(float* x, int n) {
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  for (int b = warp * 64; b < n; b += kRowWarps * 64) {
    const float a0 = x[b + lane], a1 = x[b + 32 + lane];
    const float amax = warp_max_f(fmaxf(fabsf(a0), fabsf(a1)));
    const float s = pow2_ceil_dev(fmaxf(amax, 1e-4f) / 448.0f);
    x[b + lane] = e4m3_round_dev(fminf(fmaxf(a0 / s, -448.0f), 448.0f)) * s;
    x[b + 32 + lane] = e4m3_round_dev(fminf(fmaxf(a1 / s, -448.0f), 448.0f)) * s;
  }
  __syncthreads();
}

// Orthonormal Walsh-Hadamard transform of x[0..n) (n a power of two), the CPU's butterflies.
__device__ __forceinline__ void hadamard_block(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += kRowThreads) {
      const int j = (p / len) * 2 * len + p % len;
      const float a = x[j], b = x[j + len];
      x[j] = a + b;
      x[j + len] = a - b;
    }
    __syncthreads();
  }
  const float scale = static_cast<float>(1.0 / sqrt(static_cast<double>(n)));
  for (int i = threadIdx.x; i < n; i += kRowThreads) x[i] *= scale;
  __syncthreads();
}

// FP4 round trip on x[0..n), n a multiple of 32: one warp per block of 32.
__device__ __forceinline__ void fp4_block(float* x, int n) {
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const float floor_amax = 6.0f * 1.1754943508222875e-38f;  // 6 * 2^-126
  for (int b = warp * 32; b < n; b += kRowWarps * 32) {
    const float a = x[b + lane];
    const float amax = warp_max_f(fabsf(a));
    const float s = pow2_ceil_dev(fmaxf(amax, floor_amax) / 6.0f);
    x[b + lane] = e2m1_round_dev(fminf(fmaxf(a / s, -6.0f), 6.0f)) * s;
  }
  __syncthreads();
}

// IEEE f32 -> f16 bits, round to nearest even (what the CPU's f32_to_f16 does, infinities and
// subnormals included).
__device__ __forceinline__ uint16_t f32_to_f16_bits(float f) {
  return static_cast<uint16_t>(__half_as_ushort(__float2half_rn(f)));
}

__device__ __forceinline__ float sigmoid_dev(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_dev(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_dev(float x) {
  if (x > 20.0f) return x;
  if (x < -20.0f) return expf(x);
  return log1pf(expf(x));
}

// --- split attention (flash-decoding style), shared by paged_ops.cu and ops.cu -------------------
// A lane's n keys are cut into attn_splits(n, lo) splits of attn_split_keys(n, lo) keys (the last
// one shorter): at least lo keys a split (kAttnSplitKeys unless the measurement setting
// set_attn_split_min says otherwise: step_ops.h), at most kAttnMaxSplits splits; both depend on n and
// lo only, never on the other lanes or the launch, and decode and prompt steps take the same lo.
// A block (head group, split, lane) runs attn_split_block: for each of its heads the split's logits
// q.k * scale, their max m, l = sum exp(logit - m) and O = sum exp(logit - m) k, each sum in a fixed
// order (O: key order). A block per (head, lane) then runs attn_combine_head: M = max(sink, m_c),
// w_c = exp(m_c - M), den = exp(sink - M) + sum_c l_c w_c and out = (sum_c w_c O_c) * (1 / den), splits in order.
// So a lane's result is the same bits alone or beside any others, whatever the head group size,
// and differs from a one-pass softmax only in rounding (the CPU's order is not this one either).
// Partials: O [lane][head][kAttnMaxSplits][head_dim], then stats [lane][head][kAttnMaxSplits][2].

constexpr int kAttnThreads = 256;
constexpr int kAttnWarps = kAttnThreads / DS4_WARP;
constexpr int kAttnMaxDim = 512;  // head_dim limit: 2 chunks of 8 per lane, 1 element pair per thread
constexpr int kAttnSplitKeys = 64;  // the fewest keys a split by default
constexpr int kAttnMaxSplits = 8;
constexpr int kAttnCombineThreads = 128;
constexpr int kAttnMaxRopeHalf = 256;

// Keys per split of a lane with n keys (n >= 1) and at least lo keys a split, and its number of
// splits (0 for no keys).
DS4_HD int attn_split_keys(int n, int lo) {
  const int c = (n + kAttnMaxSplits - 1) / kAttnMaxSplits;
  return c > lo ? c : lo;
}
DS4_HD int attn_splits(int n, int lo) {
  return n <= 0 ? 0 : (n + attn_split_keys(n, lo) - 1) / attn_split_keys(n, lo);
}

__device__ __forceinline__ void load_f16x8(const uint16_t* p, float f[8]) {
  const uint4 v = ds4_ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = half_bits_to_float(w[i] & 0xffffu);
    f[2 * i + 1] = half_bits_to_float(w[i] >> 16);
  }
}

// One split of one lane for heads h < nh of a group of HB (blockDim.x == kAttnThreads). kp: the
// split's nk >= 1 key rows (shared; the caller fills it and this function's first barrier
// publishes it); lg: HB x cap shared floats (cap >= nk); q: the group's first query row (head h at
// q + h * hd, 16-byte aligned; Q_SHARED: in shared memory, else global); o, st: the group's first
// head's partials of this split (head h at o + h * kAttnMaxSplits * hd, st + h * kAttnMaxSplits * 2).
// Phase 1: warps take keys in turn, lane l holds 8-element chunks l and l + 32 of each query,
// a butterfly per head. Phase 2: a warp per head: max, exp, sum (strided lanes, then the
// butterfly). Phase 3: thread t owns element pair t and sums e_j * k_j in key order.
template <int HB, bool Q_SHARED = false>
__device__ __forceinline__ void attn_split_block(const uint16_t* const* kp, int nk, float* lg, int cap,
                                                 const float* __restrict__ q, int hd, int nh, float scale,
                                                 float* __restrict__ o, float* __restrict__ st) {
  constexpr int CH = kAttnMaxDim / 8 / DS4_WARP;
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int chunks = hd / 8;
  float qr[HB][CH][8];
#pragma unroll
  for (int h = 0; h < HB; ++h)
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int c = lane + DS4_WARP * j;
      if (h < nh && c < chunks) {
        const uint4* src = reinterpret_cast<const uint4*>(q + static_cast<int64_t>(h) * hd + 8 * c);
        const uint4 a = Q_SHARED ? src[0] : ds4_ldg(src), b = Q_SHARED ? src[1] : ds4_ldg(src + 1);
        const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) qr[h][j][e] = ds4_bits_to_float(w[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) qr[h][j][e] = 0.0f;
      }
    }
  __syncthreads();

#pragma unroll 4
  for (int i = warp; i < nk; i += kAttnWarps) {
    const uint16_t* row = kp[i];
    float kf[CH][8];
#pragma unroll
    for (int j = 0; j < CH; ++j)
      if (lane + DS4_WARP * j < chunks) load_f16x8(row + 8 * (lane + DS4_WARP * j), kf[j]);
    float s[HB];
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      s[h] = 0.0f;
#pragma unroll
      for (int j = 0; j < CH; ++j)
        if (lane + DS4_WARP * j < chunks) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s[h] = fmaf(qr[h][j][e], kf[j][e], s[h]);
        }
    }
    // The HB dots' warp sums by halving rounds: warp_sum's bits in fewer shuffles (pass 24); lane l
    // holds head l / (32 / HB)'s.
    warp_sums<HB>(s, lane);
    constexpr int per = DS4_WARP / HB;
    if (lane % per == 0 && lane / per < nh) lg[(lane / per) * cap + i] = s[0] * scale;
  }
  __syncthreads();

  if (warp < nh) {
    float* l = lg + warp * cap;
    float mx = -INFINITY;
    for (int i = lane; i < nk; i += DS4_WARP) mx = fmaxf(mx, l[i]);
    mx = warp_max_f(mx);
    float part = 0.0f;
    for (int i = lane; i < nk; i += DS4_WARP) {
      const float e = expf(l[i] - mx);
      l[i] = e;
      part += e;
    }
    const float sum = warp_sum(part);
    if (lane == 0) {
      st[warp * kAttnMaxSplits * 2] = mx;
      st[warp * kAttnMaxSplits * 2 + 1] = sum;
    }
  }
  __syncthreads();

  const int pairs = hd / 2;
  for (int e2 = static_cast<int>(threadIdx.x); e2 < pairs; e2 += kAttnThreads) {
    float acc[HB][2];
#pragma unroll
    for (int h = 0; h < HB; ++h) acc[h][0] = acc[h][1] = 0.0f;
#pragma unroll 16  // independent loads in flight; the sums still run in key order
    for (int i = 0; i < nk; ++i) {
      const uint32_t kk = ds4_ldg(reinterpret_cast<const uint32_t*>(kp[i]) + e2);
      const float k0 = half_bits_to_float(kk & 0xffffu), k1 = half_bits_to_float(kk >> 16);
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float p = lg[h * cap + i];
        acc[h][0] += p * k0;
        acc[h][1] += p * k1;
      }
    }
#pragma unroll
    for (int h = 0; h < HB; ++h)
      if (h < nh) {
        float* dst = o + static_cast<int64_t>(h) * kAttnMaxSplits * hd + 2 * e2;
        dst[0] = acc[h][0];
        dst[1] = acc[h][1];
      }
  }
}

// One (lane, head): merge its ns splits (o: [kAttnMaxSplits][hd], st: [kAttnMaxSplits][2]) with the
// sink, then turn the pairs from tail0 on by (rc[k], rs[k]), k = pair - tail0 (tail0 >= hd / 2:
// none), into dst[hd]. Any block size; every thread derives the same weights.
__device__ __forceinline__ void attn_combine_head(const float* __restrict__ o, const float* __restrict__ st, int ns,
                                                  float sink, int hd, int tail0, const float* rc, const float* rs,
                                                  float* __restrict__ dst) {
  float mx = sink;
  for (int c = 0; c < ns; ++c) mx = fmaxf(mx, st[2 * c]);
  float w[kAttnMaxSplits];
  float den = expf(sink - mx);
#pragma unroll
  for (int c = 0; c < kAttnMaxSplits; ++c) {
    w[c] = 0.0f;
    if (c < ns) {
      w[c] = expf(st[2 * c] - mx);
      den += st[2 * c + 1] * w[c];
    }
  }
  const float inv = 1.0f / den;
  for (int e2 = static_cast<int>(threadIdx.x); e2 < hd / 2; e2 += static_cast<int>(blockDim.x)) {
    float x0 = 0.0f, x1 = 0.0f;
#pragma unroll
    for (int c = 0; c < kAttnMaxSplits; ++c)
      if (c < ns) {
        const float* oc = o + static_cast<int64_t>(c) * hd + 2 * e2;
        x0 += w[c] * oc[0];
        x1 += w[c] * oc[1];
      }
    x0 *= inv;
    x1 *= inv;
    if (e2 >= tail0) {
      const int k = e2 - tail0;
      const float c = rc[k], sn = rs[k];
      const float y0 = x0 * c - x1 * sn, y1 = x0 * sn + x1 * c;
      x0 = y0;
      x1 = y1;
    }
    dst[2 * e2] = x0;
    dst[2 * e2 + 1] = x1;
  }
}

}  // namespace ds4::gpu
