// exp on floats with the bits of glibc's expf, in scalar, AVX2 (8 lanes) and AVX-512 (16 lanes).
//
// Why: the engine's softmaxes, SwiGLU and sigmoids called std::exp(float), i.e. glibc's expf, one
// element at a time (1.4-1.9 ns each here). Results are compared bit for bit (tests, output hashes),
// so a faster exp must give glibc's bits exactly. This is glibc 2.36's expf
// (sysdeps/ieee754/flt-32/e_expf.c, from ARM's optimized-routines) as its x86_64 FMA build
// computes it: __expf_fma, the variant glibc's ifunc picks on CPUs with FMA and AVX2. Having our
// own copy also makes the engine's exps independent of the glibc installed.
//
// The algorithm (N = 32): k = round(x·N/ln2), r = x·N/ln2 − k, exp(x) = 2^(k/N) · p(r) with
// 2^(k/N) = T[k mod N] with k/N's integer part added into the exponent, and p a cubic, all in
// double, rounded once to float at the end. What the FMA build fuses (read from the disassembly
// of __expf_fma in /lib/x86_64-linux-gnu/libm.so.6, Debian glibc 2.36-9+deb12u14):
//   kd = fma(InvLn2N, xd, SHIFT)       z = InvLn2N·xd is never rounded on its own:
//   r  = fma(InvLn2N, xd, -(kd-SHIFT))   both uses of it are fused
//   z  = fma(r, C0, C1); r2 = r·r; y = fma(r, C2, 1); y = fma(z, r2, y); result (float)(y·s)
// |x| >= 88 (top 12 bits >= 0x42b) or NaN goes through glibc's checks first: -inf -> 0;
// inf/NaN -> x + x; x > 0x1.62e42ep6 -> +inf; x < -0x1.9fe368p6 -> 0; x < -0x1.9d1d9ep6 ->
// 0x1p-149 (this build has WANT_ERRNO_UFLOW: __math_may_uflowf returns 0x1.4p-75f², which rounds
// to the least subnormal); other x in that region take the main path. errno is not set here.
//
// Proof: ext/cpu/tools/expf_exhaustive.cpp compares every variant below with libm's expf on all
// 2^32 float bit patterns. Result (Debian glibc 2.36-9+deb12u14, AMD EPYC Zen 5, 44 s for all):
//   exp_exact_fma, exp_exact_soft, exp_exact_avx2, exp_exact_avx512: 4294967296 inputs each,
//   4294967296 with identical bits (NaNs included), 0 mismatches.
// (Variants with the cubic unfused (all 2^32 inputs) or with x·N/ln2 rounded before its two uses
// (every 16th input) matched as well: the final rounding to float hides the fusion choices. We
// mirror __expf_fma anyway. A deliberately wrong table entry or underflow answer fails at once.)
// Speed here (ns/element, exp of an array in L1): glibc 1.85, exp_exact 1.4, AVX2 0.58 (the table
// as a 64-bit gather), AVX-512 0.26.
//
// The vector forms and the array helpers carry their own target attributes; call them only where
// the CPU has the features (ext/cpu/dispatch.h). exp_exact picks hardware FMA or fma() per call.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define DS4_EXPF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define DS4_EXPF_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

// GCC 12's AVX-512 intrinsics leave an unused merge operand undefined on purpose, which
// -W(maybe-)uninitialized reports wherever they are inlined; nothing here is uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace ds4 {

namespace expf_detail {

// __exp2f_data.tab: the bits of 2^(i/32) (correctly rounded double) minus i << 47, so that adding
// ki << 47 (ki's low 5 bits are i) puts k/32's integer part into the exponent.
alignas(64) inline constexpr uint64_t kTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
inline constexpr double kInvLn2N = 0x1.71547652b82fep+0 * 32;
inline constexpr double kShift = 0x1.8p+52;  // z + SHIFT rounds z to an integer in the low bits
// __exp2f_data.poly_scaled: the cubic's coefficients divided by N^3, N^2, N.
inline constexpr double kC0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32;
inline constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / 32 / 32;
inline constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / 32;
inline constexpr uint32_t kAbsBig = 0x42b00000u;  // |x| bits at or above this: top12(88.0f) region
inline constexpr float kOverflow = 0x1.62e42ep6f;      // above: +inf
inline constexpr float kUnderflow = -0x1.9fe368p6f;    // below: 0
inline constexpr float kMayUnderflow = -0x1.9d1d9ep6f; // below (and not under kUnderflow): 0x1p-149

// The whole of __expf_fma. __builtin_fma is one vfmadd where the function it lands in targets
// FMA (exp_exact_fma), else a call to libm's fma(): exact either way.
__attribute__((always_inline)) inline float exp_core(float x) {
  uint32_t ix;
  std::memcpy(&ix, &x, 4);
  if (__builtin_expect((ix & 0x7fffffffu) >= kAbsBig, 0)) {
    if (ix == 0xff800000u) return 0.0f;
    if ((ix & 0x7fffffffu) >= 0x7f800000u) return x + x;
    if (x > kOverflow) return __builtin_inff();
    if (x < kUnderflow) return 0.0f;
    if (x < kMayUnderflow) return 0x1p-149f;
  }
  const double xd = x;
  double kd = __builtin_fma(kInvLn2N, xd, kShift);
  uint64_t ki;
  std::memcpy(&ki, &kd, 8);
  kd -= kShift;
  const double r = __builtin_fma(kInvLn2N, xd, -kd);
  const uint64_t t = kTab[ki % 32] + (ki << 47);
  double s;
  std::memcpy(&s, &t, 8);
  const double z = __builtin_fma(r, kC0, kC1);
  const double r2 = r * r;
  double y = __builtin_fma(r, kC2, 1.0);
  y = __builtin_fma(z, r2, y);
  return static_cast<float>(y * s);
}

// exp of 4 floats widened to double, before the final rounding to float (main path only).
DS4_EXPF_AVX2 inline __m256d exp4_pd(__m128 x) {
  const __m256d xd = _mm256_cvtps_pd(x);
  const __m256d inv = _mm256_set1_pd(kInvLn2N), shift = _mm256_set1_pd(kShift);
  __m256d kd = _mm256_fmadd_pd(inv, xd, shift);
  const __m256i ki = _mm256_castpd_si256(kd);
  kd = _mm256_sub_pd(kd, shift);
  const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
  const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
  const __m256i tab = _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kTab), idx, 8);
  const __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(tab, _mm256_slli_epi64(ki, 47)));
  const __m256d z = _mm256_fmadd_pd(r, _mm256_set1_pd(kC0), _mm256_set1_pd(kC1));
  const __m256d r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(kC2), _mm256_set1_pd(1.0));
  y = _mm256_fmadd_pd(z, r2, y);
  return _mm256_mul_pd(y, s);
}

// exp_core's |x| >= 88 / NaN answers over the main path's y, lane by lane.
DS4_EXPF_AVX2 inline __m256 special8(__m256 x, __m256 y) {
  y = _mm256_blendv_ps(y, _mm256_set1_ps(0x1p-149f), _mm256_cmp_ps(x, _mm256_set1_ps(kMayUnderflow), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kUnderflow), _CMP_LT_OQ));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, _mm256_set1_ps(kOverflow), _CMP_GT_OQ));
  return _mm256_blendv_ps(y, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// exp of 8 floats widened to double: two 512-bit table lookups (entries 0-15, 16-31; vpermt2pd
// reads the index's low 4 bits) and bit 4 of ki picks between them.
DS4_EXPF_AVX512 inline __m512d exp8_pd(__m256 x, __m512d t0, __m512d t1, __m512d t2, __m512d t3) {
  const __m512d xd = _mm512_cvtps_pd(x);
  const __m512d inv = _mm512_set1_pd(kInvLn2N), shift = _mm512_set1_pd(kShift);
  __m512d kd = _mm512_fmadd_pd(inv, xd, shift);
  const __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  const __m512d r = _mm512_fmsub_pd(inv, xd, kd);
  const __m512d lo = _mm512_permutex2var_pd(t0, ki, t1), hi = _mm512_permutex2var_pd(t2, ki, t3);
  const __m512i tab = _mm512_castpd_si512(_mm512_mask_blend_pd(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), lo, hi));
  const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(tab, _mm512_slli_epi64(ki, 47)));
  const __m512d z = _mm512_fmadd_pd(r, _mm512_set1_pd(kC0), _mm512_set1_pd(kC1));
  const __m512d r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(kC2), _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  return _mm512_mul_pd(y, s);
}

DS4_EXPF_AVX512 inline __m512 special16(__m512 x, __m512 y) {
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kMayUnderflow), _CMP_LT_OQ), y, _mm512_set1_ps(0x1p-149f));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kUnderflow), _CMP_LT_OQ), y, _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kOverflow), _CMP_GT_OQ), y, _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, _mm512_add_ps(x, x));
}

}  // namespace expf_detail

// exp_exact on a CPU with FMA (one instruction per fma).
__attribute__((target("fma"))) inline float exp_exact_fma(float x) { return expf_detail::exp_core(x); }
// exp_exact with libm's fma() (exact on any CPU; slow where fma() is emulated).
inline float exp_exact_soft(float x) { return expf_detail::exp_core(x); }

// expf(x) with glibc 2.36's bits (x86_64 FMA build), for every float x.
inline float exp_exact(float x) {
  return __builtin_cpu_supports("fma") ? exp_exact_fma(x) : exp_exact_soft(x);
}

// exp_exact on 8 lanes (CPUs with AVX2 and FMA).
DS4_EXPF_AVX2 inline __m256 exp_exact_avx2(__m256 x) {
  using namespace expf_detail;
  const __m128 lo = _mm256_cvtpd_ps(exp4_pd(_mm256_castps256_ps128(x)));
  const __m128 hi = _mm256_cvtpd_ps(exp4_pd(_mm256_extractf128_ps(x, 1)));
  const __m256 y = _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
  const __m256i ax = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
  const __m256i big = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(static_cast<int>(kAbsBig - 1)));
  return _mm256_testz_si256(big, big) ? y : special8(x, y);
}

// exp_exact on 16 lanes (CPUs with AVX-512 F/BW/DQ/VL).
DS4_EXPF_AVX512 inline __m512 exp_exact_avx512(__m512 x) {
  using namespace expf_detail;
  const __m512d t0 = _mm512_load_pd(reinterpret_cast<const double*>(kTab));
  const __m512d t1 = _mm512_load_pd(reinterpret_cast<const double*>(kTab) + 8);
  const __m512d t2 = _mm512_load_pd(reinterpret_cast<const double*>(kTab) + 16);
  const __m512d t3 = _mm512_load_pd(reinterpret_cast<const double*>(kTab) + 24);
  const __m256 lo = _mm512_cvtpd_ps(exp8_pd(_mm512_castps512_ps256(x), t0, t1, t2, t3));
  const __m256 hi = _mm512_cvtpd_ps(exp8_pd(_mm512_extractf32x8_ps(x, 1), t0, t1, t2, t3));
  const __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  const __m512i ax = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  const __mmask16 big = _mm512_cmpgt_epi32_mask(ax, _mm512_set1_epi32(static_cast<int>(kAbsBig - 1)));
  return big == 0 ? y : special16(x, y);
}

// x[i] = exp(x[i] - m) for i < n: the subtraction in float, then exp_exact. The three forms give
// the same bits; the caller picks one its CPU runs.
inline void exp_minus(float* x, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_exact(x[i] - m);
}

DS4_EXPF_AVX2 inline void exp_minus_avx2(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_exact_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
  for (; i < n; ++i) x[i] = exp_exact_fma(x[i] - m);
}

DS4_EXPF_AVX512 inline void exp_minus_avx512(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_exact_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  if (i < n) {  // the tail as masked lanes (masked-off lanes compute exp(0 - m) and are dropped)
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, k, exp_exact_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
  }
}

}  // namespace ds4

#pragma GCC diagnostic pop
