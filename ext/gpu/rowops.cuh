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

#include <cstdint>

#include "common.cuh"

namespace ds4::gpu {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / DS4_WARP;
static_assert(kRowWarps == 8, "block_sum's tree is written for 8 warps");

// Sum of one double per thread (blockDim.x == kRowThreads); red: 8 shared doubles. Every thread
// gets the same bits; red is free again on return.
__device__ __forceinline__ double block_sum(double v, double* red) {
  v = warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
  if (threadIdx.x % DS4_WARP == 0) red[warp] = v;
  __syncthreads();
  const double t = ((red[0] + red[1]) + (red[2] + red[3])) + ((red[4] + red[5]) + (red[6] + red[7]));
  __syncthreads();
  return t;
}

__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, ds4_shfl_xor(v, m));
  return v;
}

// r = rsqrt(mean(x^2) + eps) as the CPU rounds it (ops.cpp rms_norm), over x[0..n) (any memory).
__device__ __forceinline__ float rms_factor(const float* x, int64_t n, float eps, double* red) {
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) ss += static_cast<double>(x[i]) * x[i];
  const double t = block_sum(ss, red);
  return static_cast<float>(1.0 / sqrt(t / static_cast<double>(n) + static_cast<double>(eps)));
}

// x = (x * r) * w (w null: x * r), in place on a shared or global row.
__device__ __forceinline__ void scale_row(float* x, int64_t n, float r, const float* w) {
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) x[i] = w ? (x[i] * r) * w[i] : x[i] * r;
  __syncthreads();
}

// Rotate the rope_dim/2 interleaved pairs of tail by pos * inv_freq[k] (inverse: the conjugate).
__device__ __forceinline__ void rope_block(float* tail, int half, int64_t pos, const double* inv_freq, bool inverse) {
  for (int k = threadIdx.x; k < half; k += kRowThreads) {
    double s, c;
    sincos(static_cast<double>(pos) * inv_freq[k], &s, &c);
    const float cf = static_cast<float>(c);
    const float sf = inverse ? -static_cast<float>(s) : static_cast<float>(s);
    const float x0 = tail[2 * k], x1 = tail[2 * k + 1];
    tail[2 * k] = x0 * cf - x1 * sf;
    tail[2 * k + 1] = x0 * sf + x1 * cf;
  }
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

}  // namespace ds4::gpu
