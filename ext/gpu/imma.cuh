// Device pieces the integer tensor-core kernels share (imma_q8.cu, imma_q4k.cu): the mma.sync
// forms over signed bytes and the exact small-integer conversion. CUDA sm_80+ only: the files that
// include this compile their kernels under DS4_IMMA.
#pragma once

#include <cstdint>

#include "common.cuh"

#if defined(DS4_GPU_CUDA) && !(defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIP__))
#define DS4_IMMA 1  // this build has the integer tensor-core kernels
#endif

namespace ds4::gpu {

#if defined(DS4_IMMA)

// D = A B + C, A 16 x 32 and B 32 x 8 signed bytes, exact in 32-bit integers. Fragments (PTX ISA,
// m16n8k32 .s8; g = lane / 4, t = lane % 4): a[0] row g and a[1] row g + 8, k-slots 4t..4t+3; a[2],
// a[3] the same rows, k-slots 16 + 4t..; b0 k-slots 4t.., b1 16 + 4t.., column g; d[0..1] row g,
// columns 2t, 2t + 1; d[2..3] row g + 8.
__device__ __forceinline__ void mma_s8_k32(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                           const int (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
#else
  __trap();
#endif
}

// The same with 16 k-slots: a0 row g, a1 row g + 8, k-slots 4t..4t+3; b k-slots 4t.., column g.
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b, const int (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(b), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
#else
  __trap();
#endif
}

// float(v) for |v| < 2^22, exactly (what static_cast gives): 1.5 2^23 + v has v in its low bits.
__device__ __forceinline__ float small_int_to_float(int v) {
  return __fsub_rn(ds4_bits_to_float(static_cast<uint32_t>(0x4B400000 + v)), 12582912.0f);
}

// Lane 0's result of warp_sum's butterfly (xor 16, 8, 4, 2, 1) from B_w = A_w + A_(w+8), w < 8,
// A_w = a_w + a_(w+16): every lane ends with these bits (float addition is commutative).
__device__ __forceinline__ float butterfly_of_eight(const float (&b)[8]) {
  return ((b[0] + b[4]) + (b[2] + b[6])) + ((b[1] + b[5]) + (b[3] + b[7]));
}

// The k-slice tree of matvec_blocks: y_0, y_0 + y_1 or (y_0 + y_1) + (y_2 + y_3).
__device__ __forceinline__ float kslice_tree(const float (&y)[4], int ks) {
  if (ks == 2) return y[0] + y[1];
  if (ks == 4) return (y[0] + y[1]) + (y[2] + y[3]);
  return y[0];
}

// The chunks of a row in the order the kernels work them: k-slice 0's (0, KS, 2 KS, ...), then slice
// 1's, ...; the chunk after q, or -1 after the last.
__device__ __forceinline__ int64_t chunk_after(int64_t q, int ks, int64_t n_chunks) {
  if (q + ks < n_chunks) return q + ks;
  const int64_t s1 = q % ks + 1;
  return s1 < ks && s1 < n_chunks ? s1 : -1;
}

// One step of the two-stage copy stream: chunk nq's copies into the other stage (or an empty group at
// the end, which keeps the count right), then wait until the current stage's have landed and every
// thread sees them.
template <class Issue>
__device__ __forceinline__ void next_stage(int64_t nq, int stage, Issue issue) {
  if (nq >= 0) {
    issue(nq, stage ^ 1);
  } else {
    ds4_cp_async_commit();
  }
  ds4_cp_async_wait<1>();
  __syncthreads();
}

// cp.async of `pieces` runs of `vecs` 16-byte vectors, run r from src(r) to dst + r * pitch, by the
// block's THREADS threads; runs of the usual length VECS take a constant divisor (a run of a
// chunk's weights or planes: the index split is most of a copy's instructions otherwise).
template <int THREADS, int VECS, class Src>
__device__ __forceinline__ void copy_runs(uint8_t* dst, int pitch, int pieces, int vecs, Src src) {
  if (vecs == VECS) {
#pragma unroll 1
    for (int i = static_cast<int>(threadIdx.x); i < pieces * VECS; i += THREADS) {
      const int r = i / VECS, v = i % VECS;
      ds4_cp_async16(dst + r * pitch + 16 * v, src(r) + 16 * v);
    }
  } else {
#pragma unroll 1
    for (int i = static_cast<int>(threadIdx.x); i < pieces * vecs; i += THREADS) {
      const int r = i / vecs, v = i % vecs;
      ds4_cp_async16(dst + r * pitch + 16 * v, src(r) + 16 * v);
    }
  }
}

#endif  // DS4_IMMA

}  // namespace ds4::gpu
