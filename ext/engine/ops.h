// Small fp32 operations of the DS4 step: f16 storage conversion, RMSNorm, tail RoPE, the QAT
// round trips (ds4_spec.md §7), mHC Sinkhorn and the scalar activations.
//
// Every function works on ONE lane's vector with a fixed summation order, so a lane's result
// never depends on what else runs in the step (batch invariance). Reductions that feed a
// normalization accumulate in double: that keeps us within a few ulps of numpy's pairwise sums.
#pragma once

#include <cmath>
#include <cstdint>

#include "../cpu/expf_exact.h"  // by path: tests/test_native_engine.py builds ops.cpp alone

namespace ds4 {

// Stack-array bounds for per-lane temporaries; the engine checks the config against them.
constexpr int kMaxRopeHalf = 256;  // rope_dim / 2
constexpr int kMaxHc = 16;         // hc_mult
constexpr int kMaxHeadDim = 4096;  // head_dim and index_head_dim

// Whether this process runs the AVX2 twins of the loops in ops.cpp, mhc.cpp and attention.cpp
// (the SIMD path of ext/cpu/dispatch.h, fixed per process). The twins give the same bits as the
// portable loops.
bool use_avx2();

// IEEE binary16 <-> binary32, round to nearest even (what numpy's astype(float16) does).
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
void f32_to_f16_row(const float* x, uint16_t* y, int64_t n);
void f16_to_f32_row(const uint16_t* x, float* y, int64_t n);
// Round a vector through f16 and back in place (a stored row as its reader sees it).
void round_f16(float* x, int64_t n);

// Σ x[i]² in double: four interleaved partial sums (i mod 4) added as (s0 + s1) + (s2 + s3),
// a fixed order that depends only on n (four chains instead of one long dependent chain).
double sum_squares(const float* x, int64_t n);

// y = x * rsqrt(mean(x^2) + eps) * w   (w may be null: unweighted). y may alias x.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);

// cos/sin of pos * inv_freq[k] for the rope_dim/2 interleaved pairs of one position.
struct RopeTable {
  int half = 0;
  float c[kMaxRopeHalf];
  float s[kMaxRopeHalf];
  // Angles in double (positions reach 1M), then rounded once to float.
  void init(const double* inv_freq, int n_half, int64_t pos);
  // Rotate the interleaved pairs (x[2i], x[2i+1]) of a rope_dim-long tail. inverse rotates by
  // the negative angle (the conjugate), used on the attention output (spec §4.3).
  void apply(float* tail, bool inverse) const;
  // The table as 2 * half floats (cosines, then sines), and back: a lane's table computed once
  // serves every layer with the same frequencies.
  void save(float* cs) const;
  void load(const float* cs, int n_half);
};

// FP8 e4m3fn round trip (spec §7 item 1) on n values (n a multiple of 64), blocks of 64:
// s = 2^ceil(log2(max(amax, 1e-4) / 448)), x = e4m3(clamp(x / s, ±448)) * s.
void fp8_round_trip(float* x, int64_t n);
// Orthonormal Walsh-Hadamard transform in natural (Sylvester) order, scaled by 1/sqrt(n);
// n a power of two.
void hadamard(float* x, int64_t n);
// FP4 e2m1 round trip (spec §7 item 2) on n values (n a multiple of 32), blocks of 32:
// s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)), x = e2m1(clamp(x / s, ±6)) * s, ties to even code.
void fp4_round_trip(float* x, int64_t n);

// mHC Sinkhorn on an n x n matrix (row-major, C[j * n + k]) in place, spec §3.1 step 5:
// row softmax, + eps, column normalize, then (iters - 1) x (row normalize, column normalize).
void sinkhorn(float* c, int n, int iters, float eps);

// exp is exp_exact (glibc's expf bits from our own code, ext/cpu/expf_exact.h), which the SIMD
// twins of the loops that use these also compute.
inline float sigmoidf(float x) { return 1.0f / (1.0f + exp_exact(-x)); }
inline float siluf(float x) { return x / (1.0f + exp_exact(-x)); }
// Stable softplus as DS4 computes it: x above 20, exp(x) below -20, log1p(exp(x)) between.
inline float softplusf(float x) {
  if (x > 20.0f) return x;
  if (x < -20.0f) return exp_exact(x);
  return std::log1p(exp_exact(x));
}

// 2^ceil(log2(r)) for r > 0, exactly (no log2 rounding near powers of two).
float pow2_ceil(float r);

}  // namespace ds4
