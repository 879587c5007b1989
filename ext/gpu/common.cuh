// Device helpers shared by the kernels: error checks, exact scalar decoders of the weight types,
// and the fixed warp reduction.
//
// The decoders produce exactly the values of ext/cpu/quant.cpp (and gguf.quants.dequantize):
// every dequantized weight here is an exact product (a <= 24-bit significand), so the one
// rounding the CPU applies is reproduced bit for bit:
//   F16   IEEE half -> float (exact)                BF16  bits << 16 (exact)
//   Q8_0  q * d                 (8 x 11 bits: exact)
//   Q4_K  (d*sc)*q - dmin*m     d*sc (17 bits) and its product by q (21 bits) are exact, so
//                               fmaf(dl, q, -ml) rounds once, exactly where the CPU does
//   MXFP4 kvalue * 2^(e-128)    exact (a power of two times a 2-bit integer)
// Small integers become floats through the exponent field (2^23 + b has ulp 1), which is exact
// and avoids the quarter-rate integer-to-float converter.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "vendor.h"

namespace ds4::gpu {

// Throw std::runtime_error naming the failed call: used by every host launcher after a launch.
inline void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  // Reset the runtime's last error, so the next launch check does not report this one again (a
  // sticky error, such as an illegal address, stays whatever we do).
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("GPU: ") + what + ": " + cudaGetErrorString(err));
}
#define DS4_GPU_CHECK(call) ::ds4::gpu::check((call), #call)
#define DS4_GPU_CHECK_LAUNCH(name) ::ds4::gpu::check(cudaGetLastError(), name)

// --- scalar decoders -------------------------------------------------------------------------

DS4_HD float half_bits_to_float(uint32_t h) {
  __half_raw r;
  r.x = static_cast<unsigned short>(h);
  return __half2float(__half(r));
}

DS4_HD float bf16_bits_to_float(uint32_t b) { return ds4_bits_to_float(b << 16); }

// ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2.
DS4_HD float e8m0_half(uint32_t e) {
  return ds4_bits_to_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
}

// ggml's get_scale_min_k4 on the 12 scale bytes of a Q4_K block, given as three words. j may
// be a run-time value: bytes are picked with selects, never by indexing a register array
// (which would spill it to local memory).
DS4_HD uint32_t q4k_scale_byte(uint32_t s0, uint32_t s1, uint32_t s2, int i) {
  const uint32_t w = i < 4 ? s0 : i < 8 ? s1 : s2;
  return (w >> (8 * (i & 3))) & 0xffu;
}

DS4_HD void q4k_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int j, float* sc, float* m) {
  uint32_t a, b;
  if (j < 4) {
    a = q4k_scale_byte(s0, s1, s2, j) & 63u;
    b = q4k_scale_byte(s0, s1, s2, j + 4) & 63u;
  } else {
    const uint32_t hi = q4k_scale_byte(s0, s1, s2, j + 4);
    a = (hi & 0x0fu) | ((q4k_scale_byte(s0, s1, s2, j - 4) >> 6) << 4);
    b = (hi >> 4) | ((q4k_scale_byte(s0, s1, s2, j) >> 6) << 4);
  }
  *sc = static_cast<float>(a);
  *m = static_cast<float>(b);
}

// Byte i (0..3) of w as a float: 2^23 + byte, minus 2^23 (exact).
template <int I>
DS4_HD float byte_to_float(uint32_t w) {
  return ds4_bits_to_float(ds4_byte_perm(w, 0x4b000000u, 0x7540u | I)) - 8388608.0f;
}

// Signed int8 byte i of w (already XORed with 0x80808080, so unsigned b = q + 128) times d,
// exactly: with f = 2^23 + 256 b, (d/256) f - 32896 d = d (b - 128) = d q; the addend
// 32896 d = 2^7 * 257 * d has 20 significant bits (exact), so the fma rounds once, to d*q,
// which is itself representable.
template <int I>
DS4_HD float q8_times(uint32_t wb, float d_256, float neg_32896_d) {
  return fmaf(d_256, ds4_bits_to_float(ds4_byte_perm(wb, 0x4b000000u, 0x7504u | (I << 4))), neg_32896_d);
}

// MXFP4 code c (4 bits: sign, e2m1) as a float scaled by 2^-127: the code's three magnitude
// bits go to the bottom of the exponent and the top of the mantissa, so the value is
// kvalue(c) * 2^-127 exactly (codes 0 and 1 land on the subnormals 0 and 2^-127).
DS4_HD float mxfp4_scaled(uint32_t c) {
  return ds4_bits_to_float(((c & 7u) << 22) | ((c & 8u) << 28));
}

// --- the fixed reduction ---------------------------------------------------------------------

// Butterfly sum over a 32-lane group: partners 16, 8, 4, 2, 1. Every lane ends with the same
// bits (a+b == b+a), and the tree never depends on how many values a lane reduces.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += ds4_shfl_xor(v, m);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += ds4_shfl_xor(v, m);
  return v;
}

}  // namespace ds4::gpu
