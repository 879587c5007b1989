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

// Where one warp's slice sum of output (row, col) of an R x C block tile lives among the warp's
// kFloats floats of shared memory, between a slice's mma work and its butterfly. A warp stores its
// mma fragments (lane 4g + t: rows g (+8, +16 ...), columns 2t, 2t + 1 (+8 ...)) and then reads 32
// consecutive rows of one column a lane each. Column by column, R + 4 floats a column, both patterns
// meet 32 different banks (a store's lane: bank 8t + g + its constant). Row by row (C + 1 floats a
// row, before pass 28) the stores had met 2-way (C = 8) or 4-way (C = 32) bank conflicts: 16.8 M
// shared-store wavefronts for 4.2 M stores in a wide Q8_0 launch. (Outside DS4_IMMA: the launchers
// size shared memory by it in every build.)
template <int R, int C>
struct SumsLayout {
  static_assert(R % 32 == 0, "a column's pitch is 4 mod 32 words");
  static constexpr int kPitch = R + 4;
  static constexpr int kFloats = C * kPitch;
  __device__ __forceinline__ static int at(int row, int col) { return col * kPitch + row; }
};

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

// A unit's integer sums against its planes (xplanes.cuh), from the A fragments a and each plane's B
// operands b[pl][0..1]: tt = 2^8 (A p1) + A p0 and s2 = A p2, exact in 32 bits (|tt| < 2^28). INDEP
// false: the second MMA takes the first's result, scaled, as its C (an MMA waits on an MMA); true: three
// MMAs from zero, then one integer multiply-add (pass 34). The same integers either way.
template <bool INDEP>
__device__ __forceinline__ void plane_sums(int (&tt)[4], int (&s2)[4], const uint32_t (&a)[4],
                                           const uint32_t (&b)[3][2]) {
  const int zero4[4] = {0, 0, 0, 0};
  int s1[4];
  mma_s8_k32(s1, a, b[1][0], b[1][1], zero4);
  if constexpr (INDEP) {
    int t0[4];
    mma_s8_k32(t0, a, b[0][0], b[0][1], zero4);
    mma_s8_k32(s2, a, b[2][0], b[2][1], zero4);
#pragma unroll
    for (int e = 0; e < 4; ++e) tt[e] = s1[e] * 256 + t0[e];
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) s1[e] *= 256;
    mma_s8_k32(tt, a, b[0][0], b[0][1], s1);
    mma_s8_k32(s2, a, b[2][0], b[2][1], zero4);
  }
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

// The k-slice of chunk q: q % ks for ks = 1, 2 or 4 (matvec_kslices), as a mask (a % by the runtime
// ks had compiled to a division sequence a chunk, and a 64-bit division call at a slice's end).
__device__ __forceinline__ int slice_of(int64_t q, int ks) { return static_cast<int>(q & (ks - 1)); }

// The chunks of a row in the order the kernels work them: k-slice 0's (0, KS, 2 KS, ...), then slice
// 1's, ...; the chunk after q, or -1 after the last.
__device__ __forceinline__ int64_t chunk_after(int64_t q, int ks, int64_t n_chunks) {
  if (q + ks < n_chunks) return q + ks;
  const int64_t s1 = slice_of(q, ks) + 1;
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
// block's THREADS threads, thread t taking vectors i = t, t + THREADS, ... of the runs laid end to
// end (vector v of run r is i = r * vecs + v). Runs of the usual length VECS (a run of a chunk's
// weights or planes) step (r, v) by THREADS with a constant split and no division, converting the
// shared address once: the index split and address arithmetic were most of a copy's instructions.
template <int THREADS, int VECS, class Src>
__device__ __forceinline__ void copy_runs(uint8_t* dst, int pitch, int pieces, int vecs, Src src) {
  if (vecs == VECS) {
    constexpr int kRunStep = THREADS / VECS, kVecStep = THREADS % VECS;
    int r = static_cast<int>(threadIdx.x) / VECS, v = static_cast<int>(threadIdx.x) % VECS;
    const ds4_smem_addr base = ds4_smem_of(dst);
#pragma unroll 1
    for (; r < pieces; r += kRunStep) {
      ds4_cp_async16_at(base + r * pitch + 16 * v, src(r) + 16 * v);
      v += kVecStep;
      if (v >= VECS) {
        v -= VECS;
        ++r;
      }
    }
  } else {
#pragma unroll 1
    for (int i = static_cast<int>(threadIdx.x); i < pieces * vecs; i += THREADS) {
      const int r = i / vecs, v = i % vecs;
      ds4_cp_async16(dst + r * pitch + 16 * v, src(r) + 16 * v);
    }
  }
}

// The two-stage weight stream on the bulk copy engine (sm_90; the Q8_0 tiles of imma_q8.cu). A
// stage's rows are one cp.async.bulk each, a whole run of a chunk's bytes, completing on the stage's
// mbarrier: one instruction a row, where copy_runs takes one a 16-byte vector (and ~25 for its
// addresses), with the same bytes into the same places. The thread of row 0 also arms the barrier
// with the bytes to expect (copies that land first take the barrier's count below zero for a moment;
// its phase ends only with that thread's arrival). Every thread waits on the phase itself. The caller
// keeps the rule that a stage is refilled only after a block barrier that follows every thread's last
// read of it.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS4_IMMA_BULK 1
// Thread 0 makes the n barriers at bar (one arrival a phase); every thread must then pass a block
// barrier before the first copy or wait.
__device__ __forceinline__ void bulk_init(uint64_t* bar, int n) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < n; ++s) {
      const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(bar + s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(a) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
}
// Arms barrier bar for a phase of `bytes` bytes of copies (one thread, once a phase): its arrival.
__device__ __forceinline__ void bulk_expect(uint64_t* bar, int bytes) {
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes) : "memory");
}
// Rows [0, rows) of `bytes` bytes each (a multiple of 16, 16-byte aligned), row r from src(r) to
// dst + r * pitch, completing on barrier bar, which the caller arms (bulk_expect); every thread of the
// block's THREADS calls it. A bulk copy takes its operands from uniform registers, so a warp issues
// its lanes' copies one after another: the rows are spread over `warps` warps from warp `warp0`
// (lanes 0 .. rows / warps - 1 of each; by default all of the block's) to keep that short. Each
// copying warp also pays ~40 instructions of address set-up, so a kernel issue bound by its
// instructions gives the copies fewer warps (imma_q4k.cu); the others return at once.
template <int THREADS, class Src>
__device__ __forceinline__ void bulk_copy_rows(uint8_t* dst, int pitch, int rows, int bytes, Src src, uint64_t* bar,
                                               int warp0 = 0, int warps = THREADS / DS4_WARP) {
  const int w = static_cast<int>(threadIdx.x) / DS4_WARP - warp0;
  if (w < 0 || w >= warps) return;
  const int per = (rows + warps - 1) / warps, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int r = w * per + lane;
  if (lane >= per || r >= rows) return;
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst + r * pitch));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(d),
               "l"(src(r)), "r"(bytes), "r"(b)
               : "memory");
}
// bulk_copy_rows with the barrier armed for exactly its bytes (by the thread of row 0).
template <int THREADS, class Src>
__device__ __forceinline__ void bulk_rows(uint8_t* dst, int pitch, int rows, int bytes, Src src, uint64_t* bar) {
  if (threadIdx.x == 0 && rows > 0) bulk_expect(bar, rows * bytes);
  bulk_copy_rows<THREADS>(dst, pitch, rows, bytes, src, bar);
}
// Until the phase of barrier bar with this parity has ended (its copies have landed and are visible).
__device__ __forceinline__ void bulk_wait(uint64_t* bar, unsigned parity) {
  const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
}
// Waits on stage `stage`'s barrier for its next phase; phase holds each stage's parity (bit s), flipped here.
__device__ __forceinline__ void bulk_wait_stage(uint64_t* bars, unsigned& phase, int stage) {
  bulk_wait(bars + stage, (phase >> stage) & 1u);  // each thread sees the stage land
  phase ^= 1u << stage;
}
#endif

#endif  // DS4_IMMA

}  // namespace ds4::gpu
