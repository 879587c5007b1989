// Weight types: block geometry and dequantizers (scalar and AVX2), bit-identical to
// gguf.quants.dequantize.
//
// Layouts (little endian, as ggml stores them):
//   F32  4 B/elem; F16 IEEE half; BF16 the top 16 bits of an f32.
//   Q8_0 34 B / 32 elems: f16 d, int8 q[32];                  y = q * d
//   Q4_K 144 B / 256 elems: f16 d, f16 dmin, 12 B of 6-bit (scale, min) pairs for 8 sub-blocks of
//        32, qs[128]: bytes 32c..32c+31 hold sub-block 2c in the low nibbles and 2c+1 in the high
//        nibbles;                                              y = (d*sc)*q - (dmin*m)
//   MXFP4 17 B / 32 elems: E8M0 byte e, qs[16]: elements 0-15 in the low nibbles, 16-31 in the
//        high nibbles; y = half(e) * kvalues[q], kvalues = doubled E2M1 levels and half(e) =
//        2^(e-128) (ggml_e8m0_to_fp32_half).
// Every product and difference is rounded exactly as numpy does it (no FMA contraction: the
// build uses -ffp-contract=off), which is what makes the results bit-identical.
#include <immintrin.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "dispatch.h"

#define DS4_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ds4 {

int64_t block_elems(DType t) {
  switch (t) {
    case DType::Q8_0:
    case DType::MXFP4:
      return 32;
    case DType::Q4_K:
      return 256;
    case DType::F32:
    case DType::F16:
    case DType::BF16:
    case DType::I32:
      return 1;
  }
  throw std::invalid_argument("unknown ggml type " + std::to_string(static_cast<int>(t)));
}

int64_t block_bytes(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::Q8_0:
      return 34;
    case DType::Q4_K:
      return 144;
    case DType::MXFP4:
      return 17;
  }
  throw std::invalid_argument("unknown ggml type " + std::to_string(static_cast<int>(t)));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::Q8_0: return "Q8_0";
    case DType::Q4_K: return "Q4_K";
    case DType::I32: return "I32";
    case DType::BF16: return "BF16";
    case DType::MXFP4: return "MXFP4";
  }
  return "unknown";
}

bool dtype_supported(int32_t ggml_type) {
  switch (ggml_type) {
    case 0: case 1: case 8: case 12: case 26: case 30: case 39:
      return true;
    default:
      return false;
  }
}

TensorView TensorView::expert(int64_t e) const {
  if (e < 0 || e >= ne[2]) throw std::out_of_range("expert index out of range");
  TensorView v;
  v.type = type;
  v.ne[0] = ne[0];
  v.ne[1] = ne[1];
  v.data = data + e * row_bytes() * ne[1];
  return v;
}

void dequantize_row(DType t, const uint8_t* src, float* dst, int64_t n) {
  cpu::decode(cpu::active_path(), t, src, dst, n);
}

namespace cpu {
namespace {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

// Half to float, exact for every half (NaN payloads included), as numpy converts: move the
// exponent and mantissa into place and rebias; subnormals come out exactly as
// (2^-14 + m*2^-24) - 2^-14. Branch-light so the scalar loops stay fast.
// Written with masks, not branches, so that the compiler vectorizes the scalar loops over it.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t o = (static_cast<uint32_t>(h & 0x7fffu) << 13) + ((127u - 15u) << 23);
  const uint32_t exp = static_cast<uint32_t>(h & 0x7c00u);
  const uint32_t infnan = o + ((128u - 16u) << 23);  // inf and NaN keep an all-ones exponent
  const uint32_t sub = float_to_bits(bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23));
  const uint32_t m_infnan = 0u - static_cast<uint32_t>(exp == 0x7c00u);
  const uint32_t m_sub = 0u - static_cast<uint32_t>(exp == 0);
  const uint32_t r = (infnan & m_infnan) | (sub & m_sub) | (o & ~(m_infnan | m_sub));
  return bits_to_float(r | sign);
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2.
inline float e8m0_half(uint8_t e) {
  return bits_to_float(e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23));
}

const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K block.
inline void q4k_scale_min(const uint8_t* q, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// --- scalar -------------------------------------------------------------------------------------

void decode_scalar(DType t, const uint8_t* src, float* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(load_u16(src + 2 * i));
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(load_u16(src + 2 * i)) << 16);
      return;
    case DType::Q8_0:
      for (int64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
        const float d = half_to_float(load_u16(src));
        const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
        for (int i = 0; i < 32; ++i) dst[i] = static_cast<float>(q[i]) * d;
      }
      return;
    case DType::Q4_K:
      for (int64_t b = 0; b < n / 256; ++b, src += 144, dst += 256) {
        const float d = half_to_float(load_u16(src));
        const float dmin = half_to_float(load_u16(src + 2));
        const uint8_t* scales = src + 4;
        const uint8_t* qs = src + 16;
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          q4k_scale_min(scales, j, &sc, &m);
          const float dl = d * static_cast<float>(sc);
          const float ml = dmin * static_cast<float>(m);
          const uint8_t* q = qs + 32 * (j / 2);
          const int shift = (j % 2) * 4;
          for (int i = 0; i < 32; ++i) dst[32 * j + i] = dl * static_cast<float>((q[i] >> shift) & 0x0f) - ml;
        }
      }
      return;
    case DType::MXFP4:
      for (int64_t b = 0; b < n / 32; ++b, src += 17, dst += 32) {
        const float d = e8m0_half(src[0]);
        const uint8_t* qs = src + 1;
        for (int i = 0; i < 16; ++i) {
          dst[i] = d * static_cast<float>(kMxfp4Values[qs[i] & 0x0f]);
          dst[i + 16] = d * static_cast<float>(kMxfp4Values[qs[i] >> 4]);
        }
      }
      return;
    case DType::I32:
      break;
  }
  throw std::invalid_argument(std::string("cannot dequantize type ") + dtype_name(t));
}

// --- AVX2 ---------------------------------------------------------------------------------------
// The same roundings as the scalar path (mul then sub, never fused), so these are exact too.

DS4_AVX2 inline void store_i8x8(const __m128i bytes8_i8, __m256 scale, float* dst) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8_i8)), scale));
}

DS4_AVX2 void decode_avx2(DType t, const uint8_t* src, float* dst, int64_t n) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::F16: {
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
      for (; i < n; ++i) dst[i] = half_to_float(load_u16(src + 2 * i));
      return;
    }
    case DType::BF16: {
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
      for (; i < n; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(load_u16(src + 2 * i)) << 16);
      return;
    }
    case DType::Q8_0:
      for (int64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
        const __m256 d = _mm256_set1_ps(half_to_float(load_u16(src)));
        for (int k = 0; k < 4; ++k)
          store_i8x8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * k)), d, dst + 8 * k);
      }
      return;
    case DType::Q4_K: {
      const __m128i low4 = _mm_set1_epi8(0x0f);
      for (int64_t b = 0; b < n / 256; ++b, src += 144, dst += 256) {
        const float d = half_to_float(load_u16(src));
        const float dmin = half_to_float(load_u16(src + 2));
        const uint8_t* scales = src + 4;
        const uint8_t* qs = src + 16;
        for (int c = 0; c < 4; ++c) {
          int sc0, m0, sc1, m1;
          q4k_scale_min(scales, 2 * c, &sc0, &m0);
          q4k_scale_min(scales, 2 * c + 1, &sc1, &m1);
          const __m256 dl0 = _mm256_set1_ps(d * static_cast<float>(sc0));
          const __m256 ml0 = _mm256_set1_ps(dmin * static_cast<float>(m0));
          const __m256 dl1 = _mm256_set1_ps(d * static_cast<float>(sc1));
          const __m256 ml1 = _mm256_set1_ps(dmin * static_cast<float>(m1));
          float* out = dst + 64 * c;
          for (int k = 0; k < 4; ++k) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 32 * c + 8 * k));
            const __m128i lo = _mm_and_si128(raw, low4);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
            const __m256 qlo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            const __m256 qhi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            _mm256_storeu_ps(out + 8 * k, _mm256_sub_ps(_mm256_mul_ps(dl0, qlo), ml0));
            _mm256_storeu_ps(out + 32 + 8 * k, _mm256_sub_ps(_mm256_mul_ps(dl1, qhi), ml1));
          }
        }
      }
      return;
    }
    case DType::MXFP4: {
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
      const __m128i low4 = _mm_set1_epi8(0x0f);
      for (int64_t b = 0; b < n / 32; ++b, src += 17, dst += 32) {
        const __m256 d = _mm256_set1_ps(e8m0_half(src[0]));
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, low4));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        store_i8x8(lo, d, dst);
        store_i8x8(_mm_srli_si128(lo, 8), d, dst + 8);
        store_i8x8(hi, d, dst + 16);
        store_i8x8(_mm_srli_si128(hi, 8), d, dst + 24);
      }
      return;
    }
    case DType::I32:
      break;
  }
  throw std::invalid_argument(std::string("cannot dequantize type ") + dtype_name(t));
}

}  // namespace

void decode(SimdPath p, DType t, const uint8_t* src, float* dst, int64_t n) {
  if (n % block_elems(t) != 0)
    throw std::invalid_argument(std::string("dequantize: ") + std::to_string(n) + " elements is not a whole number of " +
                                dtype_name(t) + " blocks");
  if (p == SimdPath::Avx2)
    decode_avx2(t, src, dst, n);
  else
    decode_scalar(t, src, dst, n);
}

}  // namespace cpu
}  // namespace ds4
