// Tensor-core matrix-vector products (mma_matvec.cuh has the arithmetic; ext/gpu/MMA.md the
// reasoning): the kernels, the activation pre-split, the slice fold, and the launchers.
//
// A block is 4 warps (128 threads); warp w owns m-tiles [w*MT, w*MT + MT) of the block's
// BR = 64*MT rows and every n-tile of the pass (NT n-tiles of 8 columns). The k loop runs over
// stages of 128 k (4 k-blocks of 32): each stage holds the block's rows of those 128 k (W, copied
// with cp.async as 16-byte vectors) and the pass's columns as hi/lo (B) plus, for Q4_K, the
// sub-block sums Sx. The copy of stage i + S - 1 is in flight while stage i is computed.
//
// Kernels (one template, mma_kernel):
//   narrow  MT 1, NT 1 or 2, activations split in the kernel (a register prefetch of the raw
//           columns, stored as hi/lo after the stage is computed); passes of 8/16 columns
//   wide    MT 2, NT 4 or 8, activations pre-split once per call into scratch
//           (mma_presplit_kernel) and copied like the weights
//   grouped MT 1, NT 1: block (row block, part); a part's pairs are the n-tile's columns
// and each either folds all KS slices itself (PARTIALS false: the registers keep a running sum)
// or computes slices [z gs, z gs + gs) (z = blockIdx.z, gs slices a block, a launch choice) and
// writes each slice's sum to the partials (PARTIALS true, KS > 1; KS == 1 writes Y), which
// mma_fold_kernel / mma_fold_grouped_kernel add in slice order, or (FOLD true: the z blocks of a
// tile are one thread-block cluster) the cluster's blocks add after a cluster barrier, each a
// share of the tile's outputs, by the fold kernel's loop. All give the same bits.
//
// Fragment layout of mma.m16n8k8 .tf32 (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32 type;
// g = lane >> 2, t = lane & 3):
//   A (16 x 8, row): a0 (row g, k t), a1 (row g+8, k t), a2 (row g, k t+4), a3 (row g+8, k t+4)
//   B (8 x 8, col):  b0 (k t, col g), b1 (k t+4, col g)
//   C, D (16 x 8):   c0 (row g, col 2t), c1 (row g, col 2t+1), c2 (row g+8, col 2t), c3 (row g+8, col 2t+1)
// With the k permutation of the .cuh (k-step s: slot t <-> element 8t + s, slot t+4 <->
// element 8t + 4 + s), thread t needs elements 8t .. 8t+7 of a k-block of its rows g, g+8 and of
// its column g: contiguous 8 weights and two 16-byte activation reads.
//
// Shared memory of a stage (dynamic; S stages):
//   W   BR rows x kStride bytes. Q8_0: 9 vectors covering the 136 bytes of 4 blocks (the stage's
//       first block starts 0 or 8 bytes into its first vector: off = 8 (i & 1)); Q4_K: the block
//       head (16 bytes) and the half of qs this stage covers (64 bytes); F16/BF16: 16 vectors,
//       vector v of row r stored at v ^ 4 (r & 1) so the 8 lanes of a 16-byte read phase hit 8
//       different bank groups.
//   hi, lo  NP columns x (128 + 4) floats: the +4 puts columns g and g+1 4 banks apart, so a
//       quarter-warp's 16-byte reads (rows g, g+1; t = 0..3 at 8t) cover 8 bank groups.
//   sx  (Q4_K) NP columns x 4 floats.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.cuh"
#include "mma_matvec.cuh"

namespace ds4::gpu {

// Shape and type only (the .cuh): every build agrees on it.
int mma_kslices(const TensorView& W) {
  const int64_t n256 = W.ne[0] / kMmaKAlign, tiles = (W.ne[1] + 63) / 64;
  int ks = 1;
  while (ks < 16 && tiles * ks < 256 && n256 > 0 && n256 % (2 * ks) == 0) ks *= 2;
  return ks;
}

#if defined(DS4_MMA_MATVEC)

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / DS4_WARP;
constexpr int KC = static_cast<int>(kMmaStageK);  // k per stage
constexpr int KB = KC / 32;                       // k-blocks per stage
constexpr int kBStride = KC + 4;                  // floats per column in the hi/lo stage
constexpr int kMaxNP = 64;                        // widest pass (wide NT = 8)

// --- fragments ----------------------------------------------------------------------------------

// The layout above, for the probe (the kernels use the same formulas through g and t).
__host__ __device__ constexpr int frag_a_row(int lane, int reg) { return (lane >> 2) + 8 * (reg & 1); }
__host__ __device__ constexpr int frag_a_col(int lane, int reg) { return (lane & 3) + 4 * (reg >> 1); }
__host__ __device__ constexpr int frag_b_row(int lane, int reg) { return (lane & 3) + 4 * reg; }
__host__ __device__ constexpr int frag_b_col(int lane) { return lane >> 2; }
__host__ __device__ constexpr int frag_c_row(int lane, int reg) { return (lane >> 2) + 8 * (reg >> 1); }
__host__ __device__ constexpr int frag_c_col(int lane, int reg) { return 2 * (lane & 3) + (reg & 1); }

// D = A B + D (tf32 in, fp32 accumulate). volatile keeps the issue order the source gives (the
// chains are interleaved by hand below).
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Every block of the thread-block cluster has reached this point, and the global-memory writes
// each thread made before it are visible to every thread of the cluster after it (arrive has
// release semantics, wait acquire, at cluster scope; the __threadfence makes the partial sums
// visible at device scope as well, since the blocks sit on different SMs). sm_90 only: the
// launcher takes the inline fold only where the device runs clusters.
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __threadfence();
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// The activation split of the .cuh: hi = tf32(x), lo = tf32(x - hi), low 13 bits cleared (the
// MMA reads only the top 19 bits; clearing them makes the values we define the values it uses).
__device__ __forceinline__ void mma_split(float x, float& hi, float& lo) {
  uint32_t h, l;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(h) : "f"(x));
  hi = __uint_as_float(h & 0xffffe000u);
  const float r = x - hi;  // exact (Sterbenz: hi is within a factor 2 of x)
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(l) : "f"(r));
  lo = __uint_as_float(l & 0xffffe000u);
}

// The fixed Sx tree: a piece of 8 elements, then four pieces.
__device__ __forceinline__ float piece_sum(const float (&v)[8]) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
__device__ __forceinline__ float pieces_sum(float p0, float p1, float p2, float p3) { return (p0 + p1) + (p2 + p3); }

// Byte j of w (biased to 0..255) as 2^23 + byte, then minus `bias`: exact small integers.
template <int J>
DS4_HD float byte_minus(uint32_t w, float bias) {
  return ds4_bits_to_float(ds4_byte_perm(w, 0x4b000000u, 0x7540u | J)) - bias;
}

// Eight decoded values v[0..7] = elements 8t .. 8t+7 of a k-block (one row), as floats.
struct Row8 {
  float v[8];
};

// --- per-type weight stages and decoders ------------------------------------------------------

template <DType T>
struct MmaW;

// Q8_0: a stage = 4 blocks = 136 bytes of the row at byte 136 i, copied as the 9 aligned vectors
// from 136 i - off (off = 8 (i & 1): rows are whole 16-byte vectors since K % 256 == 0, and the
// last stage of a row ends exactly at the row's end).
template <>
struct MmaW<DType::Q8_0> {
  static constexpr int kVec = 9, kStride = 144;
  DS4_HD static int64_t src(int64_t i, int v) { return (136 * i & ~int64_t{15}) + 16 * v; }
  DS4_HD static int dst(int v, int) { return v; }
  // Block E (0..3) of the stage: thread t's 8 q bytes (int8, at byte off + 34E + 2 + 8t) and d.
  template <int E>
  DS4_HD static void decode(const uint8_t* rs, int off, int t, Row8& r, float& d) {
    const int qo = off + 34 * E + 2 + 8 * t;  // off is 0 or 8, so qo % 4 is 2 (E even) or 0 (E odd)
    const uint32_t* w = reinterpret_cast<const uint32_t*>(rs + (qo & ~3));
    uint32_t lo, hi;
    if constexpr ((E & 1) == 0) {
      const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
      lo = ds4_byte_perm(w0, w1, 0x5432u);
      hi = ds4_byte_perm(w1, w2, 0x5432u);
    } else {
      lo = w[0];
      hi = w[1];
    }
    lo ^= 0x80808080u;
    hi ^= 0x80808080u;
    constexpr float kBias = 8388736.0f;  // 2^23 + 128: (2^23 + q + 128) - kBias = q
    r.v[0] = byte_minus<0>(lo, kBias);
    r.v[1] = byte_minus<1>(lo, kBias);
    r.v[2] = byte_minus<2>(lo, kBias);
    r.v[3] = byte_minus<3>(lo, kBias);
    r.v[4] = byte_minus<0>(hi, kBias);
    r.v[5] = byte_minus<1>(hi, kBias);
    r.v[6] = byte_minus<2>(hi, kBias);
    r.v[7] = byte_minus<3>(hi, kBias);
    const int dofs = off + 34 * E;  // % 4: 0 (E even) or 2 (E odd)
    const uint32_t dw = *reinterpret_cast<const uint32_t*>(rs + (dofs & ~3));
    d = half_bits_to_float((E & 1) ? (dw >> 16) : (dw & 0xffffu));
  }
};

// Q4_K: stage i covers sub-blocks 4h .. 4h+3 (h = i & 1) of block i >> 1: the block's 16-byte
// head and qs bytes [64h, 64h + 64) (chunks c = 2h, 2h+1).
template <>
struct MmaW<DType::Q4_K> {
  static constexpr int kVec = 5, kStride = 80;
  DS4_HD static int64_t src(int64_t i, int v) {
    return 144 * (i >> 1) + (v == 0 ? 0 : 16 + 64 * (i & 1) + 16 * (v - 1));
  }
  DS4_HD static int dst(int v, int) { return v; }
};

// (d sc, dmin m) of sub-blocks 2c and 2c+1 from the head words: ggml's get_scale_min_k4, two at a
// time (the same floats as matvec.cuh's q4k_unit_scales and Unit<kQ4_K>::set_scales; a copy here so
// this file does not depend on matvec.cuh's kernels).
DS4_HD void q4k_pair_scales(uint4 head, int c, float& dl0, float& ml0, float& dl1, float& ml1) {
  const int sh = 16 * (c & 1);
  const uint32_t x0 = head.y >> sh, x1 = head.z >> sh, x2 = head.w >> sh;
  const uint32_t sc = c < 2 ? (x0 & 0x3f3fu) : ((x2 & 0x0f0fu) | ((x0 >> 2) & 0x3030u));
  const uint32_t m = c < 2 ? (x1 & 0x3f3fu) : (((x2 >> 4) & 0x0f0fu) | ((x1 >> 2) & 0x3030u));
  const float d = half_bits_to_float(head.x & 0xffffu), dmin = half_bits_to_float(head.x >> 16);
  dl0 = d * byte_to_float<0>(sc);
  dl1 = d * byte_to_float<1>(sc);
  ml0 = dmin * byte_to_float<0>(m);
  ml1 = dmin * byte_to_float<1>(m);
}

// The nibbles of an 8-byte qs piece (two words) as floats: lo nibbles (HI false) or high.
template <bool HI>
DS4_HD void q4k_nibbles(uint2 q, Row8& r) {
  const uint32_t a = HI ? ((q.x >> 4) & 0x0f0f0f0fu) : (q.x & 0x0f0f0f0fu);
  const uint32_t b = HI ? ((q.y >> 4) & 0x0f0f0f0fu) : (q.y & 0x0f0f0f0fu);
  constexpr float k23 = 8388608.0f;
  r.v[0] = byte_minus<0>(a, k23);
  r.v[1] = byte_minus<1>(a, k23);
  r.v[2] = byte_minus<2>(a, k23);
  r.v[3] = byte_minus<3>(a, k23);
  r.v[4] = byte_minus<0>(b, k23);
  r.v[5] = byte_minus<1>(b, k23);
  r.v[6] = byte_minus<2>(b, k23);
  r.v[7] = byte_minus<3>(b, k23);
}

// F16 / BF16: a stage = 128 elements = 16 vectors; thread t's elements of block E are vector 4E + t.
// The two differ only in how a 16-bit pattern becomes a float (Halves: lo / hi half of a word).
template <class Halves>
struct MmaW16 {
  static constexpr int kVec = 16, kStride = 256;
  DS4_HD static int64_t src(int64_t i, int v) { return 256 * i + 16 * v; }
  DS4_HD static int dst(int v, int row) { return v ^ ((row & 1) << 2); }
  template <int E>
  DS4_HD static void decode(const uint8_t* rs, int row, int t, Row8& r) {
    const uint4 q = *reinterpret_cast<const uint4*>(rs + 16 * dst(4 * E + t, row));
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
    for (int i = 0; i < 4; ++i) {
      r.v[2 * i] = Halves::lo(w[i]);
      r.v[2 * i + 1] = Halves::hi(w[i]);
    }
  }
};

struct F16Halves {
  DS4_HD static float lo(uint32_t w) { return half_bits_to_float(w & 0xffffu); }
  DS4_HD static float hi(uint32_t w) { return half_bits_to_float(w >> 16); }
};

struct BF16Halves {
  DS4_HD static float lo(uint32_t w) { return ds4_bits_to_float(w << 16); }
  DS4_HD static float hi(uint32_t w) { return ds4_bits_to_float(w & 0xffff0000u); }
};

template <>
struct MmaW<DType::F16> : MmaW16<F16Halves> {};

template <>
struct MmaW<DType::BF16> : MmaW16<BF16Halves> {};

// Q4_K k-block E (0..3) of a 128-k chunk, half h (0, 1) of its 256-k block: head = the block's 16-byte
// head, qsh = the 64 qs bytes of that half. Pair E >> 1 of the chunk is chunk c = 2h + (E >> 1) of
// the block: its qs bytes 32c + 8t .. + 8 (qsh + 32 (E >> 1) + 8t) hold sub-block 2c (low nibbles, E
// even) and 2c + 1 (high nibbles, E odd). Both stage layouts (phase 1's head + half, phase 5's
// whole blocks) decode through it.
template <int E>
DS4_HD void q4k_decode(const uint8_t* head_p, const uint8_t* qsh, int h, int t, Row8& v, float& mul, float& nml) {
  const uint4 head = *reinterpret_cast<const uint4*>(head_p);
  const uint2 q = *reinterpret_cast<const uint2*>(qsh + 32 * (E >> 1) + 8 * t);
  float dl0, ml0, dl1, ml1;
  q4k_pair_scales(head, 2 * h + (E >> 1), dl0, ml0, dl1, ml1);
  if constexpr ((E & 1) == 0) {
    q4k_nibbles<false>(q, v);
    mul = dl0;
    nml = -ml0;
  } else {
    q4k_nibbles<true>(q, v);
    mul = dl1;
    nml = -ml1;
  }
}

// k-block E (0..3) of stage i, from row r's staged bytes rs (r: the row within the block): thread
// t's 8 weights as exact values (elements 128 i + 32 E + 8t .. + 8 of the row, as integers for
// the quantized types), the block's multiplier (Q8_0 d, Q4_K dl, else 1) and negated min (Q4_K
// -ml, else 0). The kernel and the host self-test (testing::mma_decode_selftest) both use it.
template <DType T, int E>
DS4_HD void decode_block(const uint8_t* rs, int64_t i, int r, int t, Row8& v, float& mul, float& nml) {
  if constexpr (T == DType::Q8_0) {
    MmaW<T>::template decode<E>(rs, 8 * static_cast<int>(i & 1), t, v, mul);
    nml = 0.0f;
  } else if constexpr (T == DType::Q4_K) {
    q4k_decode<E>(rs, rs + 16, static_cast<int>(i & 1), t, v, mul, nml);
  } else {
    MmaW<T>::template decode<E>(rs, r, t, v);
    mul = 1.0f;
    nml = 0.0f;
  }
}

// --- phase 5: streaming stages (MMA.md "Phase 5: streaming") -----------------------------------
//
// A streaming stage holds ch (2, 4 or 8) consecutive 128-k chunks of each of the block's 64 rows:
// the row's bytes [CB ch is, CB ch (is + 1)) for stage is (CB = 136 bytes a chunk for Q8_0, 72 for
// Q4_K, 256 for F16/BF16; ch even makes both ends 16-byte aligned, so the copy is nvec = CB ch / 16
// whole contiguous vectors, 272 .. 1088 bytes of one row), stored as they lie in the row (F16/BF16:
// vector v of row r at v ^ 4 (r & 1), the phase-1 swizzle) with a row stride of 16 nvec bytes.
// Chunk j of the stage then decodes exactly as phase 1's stage of that chunk did: Q8_0 from byte
// 136 j & ~15 with off 8 (j & 1) (the same bytes phase 1 copied to its stage: 136 i & ~15 of the
// row, i = ch is + j, and i & 1 = j & 1); Q4_K the head of block j >> 1 of the stage and its qs
// half j & 1; F16/BF16 vectors 16 j .. 16 j + 15. Only where the bytes sit changes, never a value.
template <DType T>
DS4_HD constexpr int stream_chunk_bytes() {
  return T == DType::Q8_0 ? 136 : T == DType::Q4_K ? 72 : 256;
}
template <DType T>
DS4_HD constexpr int stream_nvec(int ch) {
  return stream_chunk_bytes<T>() * ch / 16;
}
// Bytes from one stage row to the next in shared memory: the row's vectors, plus 16 where that
// would be a multiple of 64 bytes for Q8_0 / Q4_K (rows g and g + 2 or g + 4 of a warp's decode
// reads would share banks: 4-way; padded 2-way, as phase 1's 144 / 80-byte rows). F16/BF16 rows
// keep multiples of 128 bytes (their vector swizzle spreads rows g, g + 1).
template <DType T>
DS4_HD constexpr int stream_wstride(int ch) {
  return 16 * stream_nvec<T>(ch) + ((T == DType::Q8_0 || T == DType::Q4_K) && stream_nvec<T>(ch) % 4 == 0 ? 16 : 0);
}
// Source byte (within the row) of vector v of stage is, and where it goes in the stage row (in vectors).
template <DType T>
DS4_HD int64_t stream_src(int64_t is, int ch, int v) {
  return static_cast<int64_t>(stream_chunk_bytes<T>()) * ch * is + 16 * v;
}
template <DType T>
DS4_HD int stream_dst(int v, int r) {
  return T == DType::F16 || T == DType::BF16 ? v ^ ((r & 1) << 2) : v;
}
// k-block E of chunk j of a streaming stage, from the stage row `row` (row r of the block): the
// same values, multiplier and negated min as decode_block of that chunk in phase 1's stage.
template <DType T, int E>
DS4_HD void stream_decode(const uint8_t* row, int j, int r, int t, Row8& v, float& mul, float& nml) {
  if constexpr (T == DType::Q8_0) {
    MmaW<T>::template decode<E>(row + (136 * j & ~15), 8 * (j & 1), t, v, mul);
    nml = 0.0f;
  } else if constexpr (T == DType::Q4_K) {
    const uint8_t* head = row + 144 * (j >> 1);
    q4k_decode<E>(head, head + 16 + 64 * (j & 1), j & 1, t, v, mul, nml);
  } else {
    MmaW<T>::template decode<E>(row + 256 * j, r, t, v);
    mul = 1.0f;
    nml = 0.0f;
  }
}
// The stage's activations: nx columns (nx <= 8; B columns nx .. 7 are zeros in registers, never
// read) of the stage's 128 ch k, raw as copied, [column][128 ch + 4] floats in each ring slot
// beside the weights; split once the stage has landed into the one hi and lo buffer (the same
// layout) and Q4_K's Sx [column][4 ch] (one per k-block), which follow the ring.
DS4_HD constexpr int stream_xstride(int ch) { return static_cast<int>(kMmaStageK) * ch + 4; }
// Raw x: vector q (0 .. 32 ch) of column c of stage is comes from element 128 ch is + 4 q of the
// column and goes to float stream_x_at(c, ch, 4 q) of the slot's raw x; the split takes piece q
// (elements 8q .. 8q + 7) from stream_x_at(c, ch, 8 q) and writes hi and lo there; thread t reads
// k-block kb of chunk jc of column c at stream_x_at(c, ch, 128 jc + 32 kb + 8 t) (8 floats).
DS4_HD int64_t stream_x_src(int64_t is, int ch, int q) { return static_cast<int64_t>(kMmaStageK) * ch * is + 4 * q; }
DS4_HD constexpr int stream_x_at(int c, int ch, int e) { return c * stream_xstride(ch) + e; }
// Sx of column c, k-block b (0 .. 4 ch) of the stage.
DS4_HD constexpr int stream_sx_at(int c, int ch, int b) { return c * 4 * ch + b; }
// Bytes of a ring slot (64 weight rows and the raw x) and of the split buffers after the ring
// (hi, lo, Q4_K's Sx); all multiples of 16.
template <DType T>
DS4_HD constexpr int stream_slot_bytes(int ch, int nx) {
  return 64 * stream_wstride<T>(ch) + nx * stream_xstride(ch) * 4;
}
template <DType T>
DS4_HD constexpr int stream_split_bytes(int ch, int nx) {
  return 2 * nx * stream_xstride(ch) * 4 + (T == DType::Q4_K ? nx * 4 * ch * 4 : 0);
}
constexpr int kStreamMaxStages = 8;  // cp_async_wait_dyn's range

// --- stage geometry --------------------------------------------------------------------------------

template <DType T, int MT, int NT>
struct Geo {
  static constexpr int NP = 8 * NT, BR = kWarps * MT * 16;
  static constexpr int W = BR * MmaW<T>::kStride;
  static constexpr int B = NP * kBStride * 4;
  static constexpr int SX = T == DType::Q4_K ? NP * 16 : 0;
  static constexpr int STAGE = W + 2 * B + SX;
};

// Narrow stages: as many as fit about 75 KB (3 blocks an SM), 3..6.
template <DType T, int NT>
constexpr int narrow_stages() {
  constexpr int s = 75 * 1024 / Geo<T, 1, NT>::STAGE;
  return s < 3 ? 3 : s > 6 ? 6 : s;
}

// Blocks an SM the register allocation must allow: 3 for the narrow kernels (their shared memory
// allows about 3), 2 for wide NT 4, 1 for wide NT 8 (its accumulators need the registers).
constexpr int mma_min_blocks(int mt, int nt) { return mt == 1 ? 3 : nt >= 8 ? 1 : 2; }
constexpr int kWideStages = 2;

template <int NP>
struct Cols {
  int64_t x[NP];  // X: element offset of the column (raw X or the pre-split scratch)
  int64_t y[NP];  // Y: element offset of the output column
  int64_t p[NP];  // partial-sum column
  int n;          // valid columns of this pass
};

struct MmaArgs {
  const uint8_t* W;
  int64_t row_bytes, expert_bytes;
  int rows, K, ks;
  int gs;          // PARTIALS: slices a block computes (ks / gridDim.z)
  const float* X;  // raw activations, or the pre-split scratch (PRESPLIT)
  int64_t ldx;     // element stride of an X column (pre-split: 2K + K/32)
  float* Y;
  int64_t ldy;
  int ncols;
  float* part;    // partial sums [ks][pcols][rows] (PARTIALS with ks > 1)
  int64_t pcols;
  const ExpertPart* parts;
  const int32_t* n_parts;
  const int32_t* sorted;
  const int32_t* x_row;
  // mma_stream_kernel (phase 5): chunks a stage, stages, activation columns staged, bytes a stage.
  int ch, nst, nx, stage_bytes;
};

// --- the block body ------------------------------------------------------------------------------

// The inline fold of a tile's K-slice partials (phase 3; the kernels' FOLD tail): mma_fold_kernel's
// loop, y = p_0, then y = y + p_s in slice order. Output o = column n (o / BR) x row (o % BR):
// consecutive threads read consecutive rows of a partial and write consecutive rows of Y; has(n):
// whether slot n holds a column; cols: the tile's Cols or StreamCols (offsets p and y). __ldcg: the partials were written during this launch (by other
// SMs), so they are read from L2, never from a non-coherent cache.
template <int NP, int BR, class ColsT, class Has>
__device__ __forceinline__ void fold_tile(const MmaArgs& a, const ColsT& cols, int row0, int tid, Has has) {
  cluster_barrier();
  const int64_t stride = a.pcols * a.rows;
  const int zc = static_cast<int>(gridDim.z);
  for (int o = static_cast<int>(blockIdx.z) * kThreads + tid; o < NP * BR; o += zc * kThreads) {
    const int n = o / BR, row = row0 + o % BR;
    if (!has(n) || row >= a.rows) continue;
    const float* q = a.part + cols.p[n] * a.rows + row;
    float v = __ldcg(q);
    for (int sl = 1; sl < a.ks; ++sl) v = v + __ldcg(q + sl * stride);
    a.Y[cols.y[n] + row] = v;
  }
}

// Chunks (stages of 128 k) [i0, i1) of rows row0 .. row0 + BR of Wm, the columns in `cols`; a
// slice is spc chunks. PARTIALS: at the end of each slice s its sums go to partial s (ks > 1) or
// to Y (ks == 1). Else [i0, i1) is all of K, the slices are folded in registers and then stored.
// FOLD (with PARTIALS, ks > 1): the tile's slice groups are the gridDim.z blocks of one cluster
// (cluster rank = blockIdx.z); after the partials are written, a cluster barrier, then this block
// adds its share of the tile's outputs over all ks partials in slice order and stores them to Y.
template <DType T, int MT, int NT, int S, bool PARTIALS, bool PRESPLIT, bool FOLD>
__device__ __forceinline__ void mma_body(const MmaArgs& a, const uint8_t* __restrict__ Wm, int row0,
                                         const Cols<8 * NT>& cols, int i0, int i1, int spc, uint8_t* smem) {
  using G = Geo<T, MT, NT>;
  constexpr int NP = G::NP, BR = G::BR;
  constexpr bool kQ4K = T == DType::Q4_K;
  constexpr int kVec = MmaW<T>::kVec, kStride = MmaW<T>::kStride;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / DS4_WARP, lane = tid % DS4_WARP;
  const int g = lane >> 2, t = lane & 3;

  auto w_stage = [&](int st) { return smem + st * G::STAGE; };
  auto hi_stage = [&](int st) { return reinterpret_cast<float*>(smem + st * G::STAGE + G::W); };
  auto lo_stage = [&](int st) { return reinterpret_cast<float*>(smem + st * G::STAGE + G::W + G::B); };
  auto sx_stage = [&](int st) { return reinterpret_cast<float*>(smem + st * G::STAGE + G::W + 2 * G::B); };

  // Weights of chunk i into stage st. Rows past the matrix re-read its last row (never stored).
  auto issue_w = [&](int i, int st) {
    uint8_t* dst = w_stage(st);
    for (int v = tid; v < BR * kVec; v += kThreads) {
      const int r = v / kVec, vec = v % kVec;
      const int row = row0 + r < a.rows ? row0 + r : a.rows - 1;
      const uint8_t* src = Wm + static_cast<int64_t>(row) * a.row_bytes + MmaW<T>::src(i, vec);
      ds4_cp_async16(dst + r * kStride + 16 * MmaW<T>::dst(vec, r), src);
    }
  };

  // Pre-split columns of chunk i into stage st: hi (32 vectors), lo (32), sx (1, Q4_K).
  auto issue_b = [&](int i, int st) {
    constexpr int PER = 64 + (kQ4K ? 1 : 0);
    for (int v = tid; v < NP * PER; v += kThreads) {
      const int j = v / PER, q = v % PER;
      const float* col = a.X + cols.x[j];
      if (q < 32) {
        ds4_cp_async16(hi_stage(st) + j * kBStride + 4 * q, col + static_cast<int64_t>(i) * KC + 4 * q);
      } else if (q < 64) {
        ds4_cp_async16(lo_stage(st) + j * kBStride + 4 * (q - 32), col + a.K + static_cast<int64_t>(i) * KC + 4 * (q - 32));
      } else {
        ds4_cp_async16(sx_stage(st) + 4 * j, col + 2 * static_cast<int64_t>(a.K) + static_cast<int64_t>(i) * KB);
      }
    }
  };

  // In-kernel split: each thread owns NT pieces (8 elements of one column) of a chunk; the 4
  // pieces of a k-block sit on 4 consecutive lanes (their Sx is combined by two shuffles).
  constexpr int kPieces = NP * (KC / 8) / kThreads;
  static_assert(kPieces * kThreads == NP * (KC / 8), "a chunk's pieces split evenly over the block");
  float4 xr[PRESPLIT ? 1 : kPieces][2];
  auto load_x = [&](int i) {
#pragma unroll
    for (int p = 0; p < (PRESPLIT ? 0 : kPieces); ++p) {
      const int idx = tid + p * kThreads, j = idx / (KC / 8), q = idx % (KC / 8);
      if (j < cols.n) {
        const float4* src = reinterpret_cast<const float4*>(a.X + cols.x[j] + static_cast<int64_t>(i) * KC + 8 * q);
        xr[p][0] = ds4_ldg(src);
        xr[p][1] = ds4_ldg(src + 1);
      } else {
        xr[p][0] = make_float4(0.f, 0.f, 0.f, 0.f);
        xr[p][1] = xr[p][0];
      }
    }
  };
  auto store_b = [&](int st) {
#pragma unroll
    for (int p = 0; p < (PRESPLIT ? 0 : kPieces); ++p) {
      const int idx = tid + p * kThreads, j = idx / (KC / 8), q = idx % (KC / 8);
      const float v[8] = {xr[p][0].x, xr[p][0].y, xr[p][0].z, xr[p][0].w,
                          xr[p][1].x, xr[p][1].y, xr[p][1].z, xr[p][1].w};
      float h[8], l[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) mma_split(v[e], h[e], l[e]);
      float4* hp = reinterpret_cast<float4*>(hi_stage(st) + j * kBStride + 8 * q);
      float4* lp = reinterpret_cast<float4*>(lo_stage(st) + j * kBStride + 8 * q);
      hp[0] = make_float4(h[0], h[1], h[2], h[3]);
      hp[1] = make_float4(h[4], h[5], h[6], h[7]);
      lp[0] = make_float4(l[0], l[1], l[2], l[3]);
      lp[1] = make_float4(l[4], l[5], l[6], l[7]);
      if constexpr (kQ4K) {
        // (p0 + p1) + (p2 + p3) on every lane of the four (IEEE addition commutes).
        float s = piece_sum(v);
        s = s + ds4_shfl_xor(s, 1);
        s = s + ds4_shfl_xor(s, 2);
        if ((q & 3) == 0) sx_stage(st)[4 * j + (q >> 2)] = s;
      }
    }
  };

  // run: the folded slices (the first fold copies acc, so a zero's sign is acc's, as in the fold kernel).
  float acc[MT][NT][4], run[PARTIALS ? 1 : MT][PARTIALS ? 1 : NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.0f;
#pragma unroll
  for (int mt = 0; mt < (PARTIALS ? 1 : MT); ++mt)
#pragma unroll
    for (int nt = 0; nt < (PARTIALS ? 1 : NT); ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) run[mt][nt][r] = 0.0f;

  // Stage st (chunk i): the 4 k-blocks in pairs (E0 = 2 bp, E0 + 1), each pair's A decoded once
  // and applied to every n-tile; per (row, column) the blocks are applied in increasing order.
  auto compute = [&](int st, int i) {
    const uint8_t* ws = w_stage(st);
    const float* hs = hi_stage(st);
    const float* ls = lo_stage(st);
    const float* xs = sx_stage(st);
#pragma unroll
    for (int bp = 0; bp < KB / 2; ++bp) {
      Row8 va[MT][2][2];  // [m-tile][block of the pair][row g, row g + 8]
      float mul[MT][2][2], nml[MT][2][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = (warp * MT + mt) * 16 + g + 8 * hr;  // the row within the block
          const uint8_t* rs = ws + r * kStride;
          if (bp == 0) {
            decode_block<T, 0>(rs, i, r, t, va[mt][0][hr], mul[mt][0][hr], nml[mt][0][hr]);
            decode_block<T, 1>(rs, i, r, t, va[mt][1][hr], mul[mt][1][hr], nml[mt][1][hr]);
          } else {
            decode_block<T, 2>(rs, i, r, t, va[mt][0][hr], mul[mt][0][hr], nml[mt][0][hr]);
            decode_block<T, 3>(rs, i, r, t, va[mt][1][hr], mul[mt][1][hr], nml[mt][1][hr]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int bc = 8 * nt + g;  // this thread's B column
        float bh[2][8], bl[2][8], sx[2][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kb = 2 * bp + e;
          const float4* hp = reinterpret_cast<const float4*>(hs + bc * kBStride + 32 * kb + 8 * t);
          const float4* lp = reinterpret_cast<const float4*>(ls + bc * kBStride + 32 * kb + 8 * t);
          const float4 h0 = hp[0], h1 = hp[1], l0 = lp[0], l1 = lp[1];
          bh[e][0] = h0.x, bh[e][1] = h0.y, bh[e][2] = h0.z, bh[e][3] = h0.w;
          bh[e][4] = h1.x, bh[e][5] = h1.y, bh[e][6] = h1.z, bh[e][7] = h1.w;
          bl[e][0] = l0.x, bl[e][1] = l0.y, bl[e][2] = l0.z, bl[e][3] = l0.w;
          bl[e][4] = l1.x, bl[e][5] = l1.y, bl[e][6] = l1.z, bl[e][7] = l1.w;
          if constexpr (kQ4K) {
            sx[e][0] = xs[4 * (8 * nt + 2 * t) + kb];
            sx[e][1] = xs[4 * (8 * nt + 2 * t + 1) + kb];
          } else {
            sx[e][0] = sx[e][1] = 0.0f;
          }
        }
        float P[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 4; ++r) P[mt][e][r] = 0.0f;
        // The chains (one per (m-tile, block)) step by step side by side: hi k-steps 0..3, then
        // lo k-steps 0..3. Slot t <-> element 8t + s (a0, a1, b0), slot t + 4 <-> 8t + 4 + s.
#pragma unroll
        for (int step = 0; step < 8; ++step) {
          const int s = step & 3;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t b0 = __float_as_uint(step < 4 ? bh[e][s] : bl[e][s]);
            const uint32_t b1 = __float_as_uint(step < 4 ? bh[e][4 + s] : bl[e][4 + s]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
              mma_tf32(P[mt][e], __float_as_uint(va[mt][e][0].v[s]), __float_as_uint(va[mt][e][1].v[s]),
                       __float_as_uint(va[mt][e][0].v[4 + s]), __float_as_uint(va[mt][e][1].v[4 + s]), b0, b1);
          }
        }
        // C element r: row g + 8 (r >> 1), column 8 nt + 2t + (r & 1).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              if constexpr (T == DType::F16 || T == DType::BF16) {
                acc[mt][nt][r] = acc[mt][nt][r] + P[mt][e][r];
              } else {
                acc[mt][nt][r] = fmaf(P[mt][e][r], mul[mt][e][r >> 1], acc[mt][nt][r]);
                if constexpr (kQ4K) acc[mt][nt][r] = fmaf(nml[mt][e][r >> 1], sx[e][r & 1], acc[mt][nt][r]);
              }
            }
      }
    }
  };

  // v's sums (C element r: row g + 8 (r >> 1), column 8 nt + 2t + (r & 1)) to partial `slice`
  // (PARTIALS, ks > 1) or to Y.
  auto store = [&](const float (&v)[MT][NT][4], int slice) {
    const bool to_part = PARTIALS && a.ks > 1;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = row0 + (warp * MT + mt) * 16 + g + 8 * (r >> 1);
          const int n = 8 * nt + 2 * t + (r & 1);
          if (row >= a.rows || n >= cols.n) continue;
          if (to_part) a.part[(static_cast<int64_t>(slice) * a.pcols + cols.p[n]) * a.rows + row] = v[mt][nt][r];
          else a.Y[cols.y[n] + row] = v[mt][nt][r];
        }
  };

  // The pipeline: chunk i + S - 1 is copied (and, in-kernel, its columns loaded) while chunk i
  // is computed. Groups are committed every step (empty past the end) so wait<S - 2> always means
  // "chunk i has landed".
#pragma unroll 1
  for (int j = 0; j < S - 1; ++j) {
    const int i = i0 + j;
    if (i < i1) {
      issue_w(i, j);
      if constexpr (PRESPLIT) issue_b(i, j);
    }
    ds4_cp_async_commit();
    if constexpr (!PRESPLIT) {
      if (i < i1) {
        load_x(i);
        store_b(j);
      }
    }
  }
#pragma unroll 1
  for (int i = i0; i < i1; ++i) {
    const int st = (i - i0) % S;
    ds4_cp_async_wait<S - 2>();
    __syncthreads();  // chunk i (every thread's copies and B stores) is in; stage (i-1) % S is free
    const int inext = i + S - 1, stn = (st + S - 1) % S;
    if (inext < i1) {
      issue_w(inext, stn);
      if constexpr (PRESPLIT) issue_b(inext, stn);
    }
    ds4_cp_async_commit();
    if constexpr (!PRESPLIT) {
      if (inext < i1) load_x(inext);
    }
    compute(st, i);
    if constexpr (!PRESPLIT) {
      if (inext < i1) store_b(stn);
    }
    if ((i + 1) % spc == 0) {  // the end of slice i / spc (i is the chunk index within K)
      if constexpr (PARTIALS) {
        store(acc, i / spc);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[mt][nt][r] = 0.0f;
      } else {  // fold it into the running sum
        const bool first = i + 1 == spc;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              run[mt][nt][r] = first ? acc[mt][nt][r] : run[mt][nt][r] + acc[mt][nt][r];
              acc[mt][nt][r] = 0.0f;
            }
      }
    }
  }
  ds4_cp_async_wait<0>();
  if constexpr (!PARTIALS) store(run, 0);
  if constexpr (PARTIALS && FOLD) fold_tile<NP, BR>(a, cols, row0, tid, [&](int n) { return n < cols.n; });
}

// Dense: block (pass x, row block y, slice z). Grouped: block (row block x, part y, slice z).
// FOLD: launched with clusters of (1, 1, gridDim.z) blocks (mma_body).
template <DType T, int MT, int NT, int S, bool PARTIALS, bool GROUPED, bool PRESPLIT, bool FOLD>
__global__ void __launch_bounds__(kThreads, mma_min_blocks(MT, NT)) mma_kernel(MmaArgs a) {
  extern __shared__ __align__(16) uint8_t mma_smem[];
  constexpr int NP = 8 * NT, BR = kWarps * MT * 16;
  __shared__ Cols<NP> cols;
  const int tid = static_cast<int>(threadIdx.x);
  const int nchunks = a.K / KC, spc = nchunks / a.ks;
  const int i0 = PARTIALS ? static_cast<int>(blockIdx.z) * a.gs * spc : 0;
  const int i1 = PARTIALS ? min(i0 + a.gs * spc, nchunks) : nchunks;
  if constexpr (!GROUPED) {
    const int c0 = static_cast<int>(blockIdx.x) * NP;
    const int row0 = static_cast<int>(blockIdx.y) * BR;
    if (tid < NP) {
      const int c = c0 + tid;
      cols.x[tid] = static_cast<int64_t>(c) * a.ldx;
      cols.y[tid] = static_cast<int64_t>(c) * a.ldy;
      cols.p[tid] = c;
    }
    if (tid == 0) cols.n = a.ncols - c0 < NP ? a.ncols - c0 : NP;
    __syncthreads();
    mma_body<T, MT, NT, S, PARTIALS, PRESPLIT, FOLD>(a, a.W, row0, cols, i0, i1, spc, mma_smem);
  } else {
    const int p = static_cast<int>(blockIdx.y);
    if (p >= *a.n_parts) return;
    const ExpertPart pt = a.parts[p];
    const int row0 = static_cast<int>(blockIdx.x) * BR;
    const uint8_t* We = a.W + static_cast<int64_t>(pt.expert) * a.expert_bytes;
    for (int c0 = 0; c0 < pt.count; c0 += NP) {
      __syncthreads();  // the previous piece is done with the column table and the stages
      if (tid < NP) {
        const int j = c0 + tid < pt.count ? c0 + tid : c0;  // past the piece: any valid pair (never stored)
        const int32_t pair = a.sorted[pt.first + j];
        const int32_t xr = a.x_row != nullptr ? a.x_row[pair] : pair;
        cols.x[tid] = static_cast<int64_t>(xr) * a.ldx;
        cols.y[tid] = static_cast<int64_t>(pair) * a.ldy;
        cols.p[tid] = pt.first + j;
      }
      if (tid == 0) cols.n = pt.count - c0 < NP ? pt.count - c0 : NP;
      __syncthreads();
      mma_body<T, MT, NT, S, PARTIALS, PRESPLIT, FOLD>(a, We, row0, cols, i0, i1, spc, mma_smem);
    }
  }
}

// --- phase 5: the streaming kernel -------------------------------------------------------------

// cp.async.wait_group with a run-time count (the stage count is a launch choice): at most n groups
// of this thread still in flight.
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
  switch (n) {
    case 0: ds4_cp_async_wait<0>(); break;
    case 1: ds4_cp_async_wait<1>(); break;
    case 2: ds4_cp_async_wait<2>(); break;
    case 3: ds4_cp_async_wait<3>(); break;
    case 4: ds4_cp_async_wait<4>(); break;
    case 5: ds4_cp_async_wait<5>(); break;
    default: ds4_cp_async_wait<6>(); break;
  }
}

__device__ __forceinline__ int ilog2(int v) { return 31 - __clz(v); }

// Two parts a block (grouped NT 2): parts of one expert are consecutive in the list (the planner
// sorts pairs by expert), so part p's block walks back to the first part of its expert's run; the
// block of an even position in the run takes part p and, where the run goes on, part p + 1 (*second
// = p + 1, else -1); a block of an odd position takes nothing (returns false). Every part is taken
// by exactly one block (testing::mma_decode_selftest checks it on random lists).
DS4_HD bool stream_pair_parts(const ExpertPart* parts, int np, int p, int* second) {
  const int e = parts[p].expert;
  int q = p;
  while (q > 0 && parts[q - 1].expert == e) --q;
  if ((p - q) & 1) return false;
  *second = p + 1 < np && parts[p + 1].expert == e ? p + 1 : -1;
  return true;
}

// The columns of a streaming block: NP = 8 NT slots; bit j of mask says slot j holds a column of
// the call (its x is staged and split, its outputs stored); the other slots are zero B columns.
template <int NP>
struct StreamCols {
  int64_t x[NP];  // X: element offset of the column
  int64_t y[NP];  // Y: element offset of the output column
  int64_t p[NP];  // partial-sum column
  uint32_t mask;
};

// mma_body's work (MT 1, NT n-tiles: 64 rows) over streaming stages of a.ch chunks (a.nst of them
// in the ring, a.stage_bytes a slot, then the split buffers; a.nx <= 8 NT activation slots
// staged, B columns past them zeros in registers). Per (row, column) the same values in the same
// order as mma_body: for each chunk i in [i0, i1), k-blocks in pairs (each pair's A decoded once
// and applied to every n-tile), each block's P an 8-MMA chain (hi k-steps 0..3, lo 0..3) from +0,
// then acc = fmaf(P, mul, acc) (Q4_K: and fmaf(-ml, Sx, acc); F16/BF16 acc + P), the slice ends
// at the same chunks with the same stores or register fold, the FOLD tail the same loop. [i0, i1)
// is whole stages (the launcher picks ch dividing the chunks a block computes).
template <DType T, int NT, bool PARTIALS, bool FOLD>
__device__ __forceinline__ void stream_body(const MmaArgs& a, const uint8_t* __restrict__ Wm, int row0,
                                            const StreamCols<8 * NT>& cols, int i0, int i1, int spc, uint8_t* smem) {
  constexpr int NP = 8 * NT, BR = 64;
  constexpr bool kQ4K = T == DType::Q4_K;
  const int ch = a.ch, S = a.nst, nx = a.nx, SB = a.stage_bytes;
  const int nvec = stream_nvec<T>(ch), wstride = stream_wstride<T>(ch), xs = stream_xstride(ch);
  const int wbytes = BR * wstride;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / DS4_WARP, lane = tid % DS4_WARP;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t mask = cols.mask;
  const int lgx = ilog2(32 * ch);  // raw x vectors a column (32 ch), log2
  const int lgp = ilog2(16 * ch);  // 8-element pieces a column (16 ch), log2

  auto w_stage = [&](int st) { return smem + st * SB; };
  auto x_stage = [&](int st) { return reinterpret_cast<float*>(smem + st * SB + wbytes); };
  float* const hs = reinterpret_cast<float*>(smem + S * SB);  // the split buffers after the ring
  float* const ls = hs + nx * xs;
  float* const ss = hs + 2 * nx * xs;

  // Stage is into ring slot st: 8 threads a row (their 16-byte copies of one instruction are 128
  // contiguous bytes of the row), 16 rows at a time; the row pointer once a row. Rows past the
  // matrix re-read its last row (never stored). Then the raw activations of the staged columns.
  auto issue = [&](int is, int st) {
    uint8_t* ws = w_stage(st);
    const int l8 = tid & 7;
    for (int r = tid >> 3; r < BR; r += kThreads / 8) {
      const int row = row0 + r < a.rows ? row0 + r : a.rows - 1;
      const uint8_t* src = Wm + static_cast<int64_t>(row) * a.row_bytes;
      uint8_t* dst = ws + r * wstride;
      for (int v = l8; v < nvec; v += 8) ds4_cp_async16(dst + 16 * stream_dst<T>(v, r), src + stream_src<T>(is, ch, v));
    }
    float* xr = x_stage(st);
    for (int v = tid; v < (nx << lgx); v += kThreads) {
      const int j = v >> lgx, q = v & ((1 << lgx) - 1);
      if ((mask >> j) & 1u) ds4_cp_async16(xr + stream_x_at(j, ch, 4 * q), a.X + cols.x[j] + stream_x_src(is, ch, q));
    }
  };

  // The landed raw x of slot st split into hi, lo and Q4_K's Sx: mma_body's store_b per 8-element
  // piece (the same mma_split, piece_sum and two shuffles; slots without a column give zeros).
  // Pieces of a k-block sit on 4 consecutive lanes; the loop is warp-uniform (nx * 16 ch is a
  // multiple of 32).
  auto split = [&](int st) {
    const float* xr = x_stage(st);
    const int np = nx << lgp;
    for (int base = warp * DS4_WARP; base < np; base += kThreads) {
      const int idx = base + lane, j = idx >> lgp, q = idx & ((1 << lgp) - 1);
      float v[8];
      float4* hp = reinterpret_cast<float4*>(hs + stream_x_at(j, ch, 8 * q));
      float4* lp = reinterpret_cast<float4*>(ls + stream_x_at(j, ch, 8 * q));
      if ((mask >> j) & 1u) {
        const float4* xp = reinterpret_cast<const float4*>(xr + stream_x_at(j, ch, 8 * q));
        const float4 x0 = xp[0], x1 = xp[1];
        v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = 0.0f;
      }
      float h[8], l[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) mma_split(v[e], h[e], l[e]);
      hp[0] = make_float4(h[0], h[1], h[2], h[3]);
      hp[1] = make_float4(h[4], h[5], h[6], h[7]);
      lp[0] = make_float4(l[0], l[1], l[2], l[3]);
      lp[1] = make_float4(l[4], l[5], l[6], l[7]);
      if constexpr (kQ4K) {
        float sm = piece_sum(v);
        sm = sm + ds4_shfl_xor(sm, 1);
        sm = sm + ds4_shfl_xor(sm, 2);
        if ((q & 3) == 0) ss[stream_sx_at(j, ch, q >> 2)] = sm;
      }
    }
  };

  float acc[NT][4], run[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[nt][r] = run[nt][r] = 0.0f;

  // Chunk jc of slot st (its activations in the split buffers): mma_body's compute for MT = 1.
  auto compute = [&](int st, int jc) {
    const uint8_t* ws = w_stage(st);
#pragma unroll
    for (int bp = 0; bp < KB / 2; ++bp) {
      Row8 va[2][2];  // [block of the pair][row g, row g + 8]
      float mul[2][2], nml[2][2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = warp * 16 + g + 8 * hr;
        const uint8_t* row = ws + r * wstride;
        if (bp == 0) {
          stream_decode<T, 0>(row, jc, r, t, va[0][hr], mul[0][hr], nml[0][hr]);
          stream_decode<T, 1>(row, jc, r, t, va[1][hr], mul[1][hr], nml[1][hr]);
        } else {
          stream_decode<T, 2>(row, jc, r, t, va[0][hr], mul[0][hr], nml[0][hr]);
          stream_decode<T, 3>(row, jc, r, t, va[1][hr], mul[1][hr], nml[1][hr]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int bc = 8 * nt + g;  // this thread's B column
        float bh[2][8], bl[2][8], sx[2][2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int kb = 2 * bp + e;
          if (bc < nx) {
            const float4* hp = reinterpret_cast<const float4*>(hs + stream_x_at(bc, ch, KC * jc + 32 * kb + 8 * t));
            const float4* lp = reinterpret_cast<const float4*>(ls + stream_x_at(bc, ch, KC * jc + 32 * kb + 8 * t));
            const float4 h0 = hp[0], h1 = hp[1], l0 = lp[0], l1 = lp[1];
            bh[e][0] = h0.x, bh[e][1] = h0.y, bh[e][2] = h0.z, bh[e][3] = h0.w;
            bh[e][4] = h1.x, bh[e][5] = h1.y, bh[e][6] = h1.z, bh[e][7] = h1.w;
            bl[e][0] = l0.x, bl[e][1] = l0.y, bl[e][2] = l0.z, bl[e][3] = l0.w;
            bl[e][4] = l1.x, bl[e][5] = l1.y, bl[e][6] = l1.z, bl[e][7] = l1.w;
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) bh[e][k] = bl[e][k] = 0.0f;
          }
          if constexpr (kQ4K) {
            const int c0 = 8 * nt + 2 * t;
            sx[e][0] = c0 < nx ? ss[stream_sx_at(c0, ch, 4 * jc + kb)] : 0.0f;
            sx[e][1] = c0 + 1 < nx ? ss[stream_sx_at(c0 + 1, ch, 4 * jc + kb)] : 0.0f;
          } else {
            sx[e][0] = sx[e][1] = 0.0f;
          }
        }
        float P[2][4];
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int r = 0; r < 4; ++r) P[e][r] = 0.0f;
#pragma unroll
        for (int step = 0; step < 8; ++step) {
          const int sk = step & 3;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t b0 = __float_as_uint(step < 4 ? bh[e][sk] : bl[e][sk]);
            const uint32_t b1 = __float_as_uint(step < 4 ? bh[e][4 + sk] : bl[e][4 + sk]);
            mma_tf32(P[e], __float_as_uint(va[e][0].v[sk]), __float_as_uint(va[e][1].v[sk]),
                     __float_as_uint(va[e][0].v[4 + sk]), __float_as_uint(va[e][1].v[4 + sk]), b0, b1);
          }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if constexpr (T == DType::F16 || T == DType::BF16) {
              acc[nt][r] = acc[nt][r] + P[e][r];
            } else {
              acc[nt][r] = fmaf(P[e][r], mul[e][r >> 1], acc[nt][r]);
              if constexpr (kQ4K) acc[nt][r] = fmaf(nml[e][r >> 1], sx[e][r & 1], acc[nt][r]);
            }
          }
      }
    }
  };

  // mma_body's store for MT = 1 (slots without a column are not stored).
  auto store = [&](const float (&v)[NT][4], int slice) {
    const bool to_part = PARTIALS && a.ks > 1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = row0 + warp * 16 + g + 8 * (r >> 1);
        const int n = 8 * nt + 2 * t + (r & 1);
        if (row >= a.rows || !((mask >> n) & 1u)) continue;
        if (to_part) a.part[(static_cast<int64_t>(slice) * a.pcols + cols.p[n]) * a.rows + row] = v[nt][r];
        else a.Y[cols.y[n] + row] = v[nt][r];
      }
  };

  // The pipeline: stage is + S - 1 is copied while stage is is split and computed. One group a
  // step (empty past the end), so wait(S - 2) means "stage is has landed" for this thread's copies;
  // the barrier after it makes every thread's copies visible.
  const int s0 = i0 / ch, s1 = i1 / ch;
#pragma unroll 1
  for (int k = 0; k < S - 1; ++k) {
    if (s0 + k < s1) issue(s0 + k, k);
    ds4_cp_async_commit();
  }
  int st = 0;
#pragma unroll 1
  for (int is = s0; is < s1; ++is) {
    cp_async_wait_dyn(S - 2);
    __syncthreads();  // stage is is in; slot (st - 1) mod S and the split buffers (stage is - 1) are free
    const int nxt = is + S - 1;
    if (nxt < s1) issue(nxt, st == 0 ? S - 1 : st - 1);
    ds4_cp_async_commit();
    split(st);
    __syncthreads();  // hi / lo / Sx of stage is are written
#pragma unroll 1
    for (int jc = 0; jc < ch; ++jc) {
      compute(st, jc);
      const int i = is * ch + jc;  // the chunk index within K
      if ((i + 1) % spc == 0) {
        if constexpr (PARTIALS) {
          store(acc, i / spc);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
        } else {
          const bool first = i + 1 == spc;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              run[nt][r] = first ? acc[nt][r] : run[nt][r] + acc[nt][r];
              acc[nt][r] = 0.0f;
            }
        }
      }
    }
    st = st + 1 == S ? 0 : st + 1;
  }
  ds4_cp_async_wait<0>();
  if constexpr (!PARTIALS) store(run, 0);
  if constexpr (PARTIALS && FOLD)  // slots without a column skipped
    fold_tile<NP, BR>(a, cols, row0, tid, [&](int n) { return ((mask >> n) & 1u) != 0; });
}

// Blocks an SM the streaming kernel's registers must allow.
constexpr int kStreamMinBlocks = 3;

// mma_kernel's narrow NT 1 / grouped forms over streaming stages. Dense (NT 1): block (pass x, row
// block y, slice z), one pass of at most a.nx columns. Grouped: block (row block x, part y, slice
// z); NT 1: the part's pairs in pieces of a.nx columns (a part of more pairs streams its rows once a
// piece); NT 2 (a.nx 16): parts of one expert are consecutive in the part list, and the block of the
// first, third, ... part of an expert's run takes that part and the next one of the same expert
// (n-tiles 0 and 1: each A fragment decoded once for both), in pieces of 8 pairs of each; the
// block of the second, fourth, ... returns at once.
template <DType T, int NT, bool PARTIALS, bool GROUPED, bool FOLD>
__global__ void __launch_bounds__(kThreads, kStreamMinBlocks) mma_stream_kernel(MmaArgs a) {
  extern __shared__ __align__(16) uint8_t mma_smem[];
  constexpr int NP = 8 * NT, BR = 64;
  __shared__ StreamCols<NP> cols;
  const int tid = static_cast<int>(threadIdx.x);
  const int nchunks = a.K / KC, spc = nchunks / a.ks;
  const int i0 = PARTIALS ? static_cast<int>(blockIdx.z) * a.gs * spc : 0;
  const int i1 = PARTIALS ? min(i0 + a.gs * spc, nchunks) : nchunks;
  if constexpr (!GROUPED) {
    static_assert(GROUPED || NT == 1, "dense streaming blocks take one n-tile");
    const int c0 = static_cast<int>(blockIdx.x) * NP;
    const int row0 = static_cast<int>(blockIdx.y) * BR;
    if (tid < NP) {
      const int c = c0 + tid;
      cols.x[tid] = static_cast<int64_t>(c) * a.ldx;
      cols.y[tid] = static_cast<int64_t>(c) * a.ldy;
      cols.p[tid] = c;
    }
    if (tid == 0) {
      const int n = a.ncols - c0 < NP ? a.ncols - c0 : NP;
      cols.mask = n >= 32 ? ~0u : (1u << n) - 1u;
    }
    __syncthreads();
    stream_body<T, NT, PARTIALS, FOLD>(a, a.W, row0, cols, i0, i1, spc, mma_smem);
  } else {
    const int p = static_cast<int>(blockIdx.y);
    const int np = *a.n_parts;
    if (p >= np) return;
    const ExpertPart pt = a.parts[p];
    ExpertPart pt2{};  // NT 2: the next part of the same expert (count 0: none)
    if constexpr (NT == 2) {
      int second = -1;
      if (!stream_pair_parts(a.parts, np, p, &second)) return;  // the block of part p - 1 takes this one
      if (second >= 0) pt2 = a.parts[second];
    }
    const int row0 = static_cast<int>(blockIdx.x) * BR;
    const uint8_t* We = a.W + static_cast<int64_t>(pt.expert) * a.expert_bytes;
    const int step = NT == 2 ? 8 : a.nx;  // pairs of each part a piece
    const int most = pt.count > pt2.count ? pt.count : pt2.count;
    for (int c0 = 0; c0 < most; c0 += step) {
      __syncthreads();  // the previous piece is done with the column table and the stages
      if (tid < NP) {
        const ExpertPart& pp = NT == 2 && tid >= 8 ? pt2 : pt;
        const int k = c0 + (NT == 2 ? tid & 7 : tid);  // the pair within its part
        const bool valid = k < pp.count && (NT == 2 || tid < a.nx);
        const int j = valid ? k : 0;  // an invalid slot points at pair 0 of part p (never read)
        const ExpertPart& src = valid ? pp : pt;
        const int32_t pair = a.sorted[src.first + j];
        const int32_t xr = a.x_row != nullptr ? a.x_row[pair] : pair;
        cols.x[tid] = static_cast<int64_t>(xr) * a.ldx;
        cols.y[tid] = static_cast<int64_t>(pair) * a.ldy;
        cols.p[tid] = src.first + j;
        const unsigned bits = __ballot_sync((1u << NP) - 1u, valid);  // tid < NP <= 16: lanes 0 .. NP - 1 of warp 0
        if (tid == 0) cols.mask = bits;
      }
      __syncthreads();
      stream_body<T, NT, PARTIALS, FOLD>(a, We, row0, cols, i0, i1, spc, mma_smem);
    }
  }
}

// The slices' partial sums in slice order: y = p_0, then y = y + p_s.
__global__ void __launch_bounds__(256)
    mma_fold_kernel(const float* __restrict__ part, int ks, int rows, int ncols, float* __restrict__ Y, int64_t ldy) {
  const int r = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x), c = static_cast<int>(blockIdx.y);
  if (r >= rows) return;
  const int64_t stride = static_cast<int64_t>(ncols) * rows;
  const float* p = part + static_cast<int64_t>(c) * rows + r;
  float v = p[0];
  for (int s = 1; s < ks; ++s) v = v + p[s * stride];
  Y[static_cast<int64_t>(c) * ldy + r] = v;
}

__global__ void __launch_bounds__(256)
    mma_fold_grouped_kernel(const float* __restrict__ part, int ks, int rows, int64_t pcols,
                            const ExpertPart* __restrict__ parts, const int32_t* __restrict__ n_parts,
                            const int32_t* __restrict__ sorted, float* __restrict__ Y, int64_t ldy) {
  const int r = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x), p = static_cast<int>(blockIdx.y);
  if (r >= rows || p >= *n_parts) return;
  const ExpertPart pt = parts[p];
  const int64_t stride = pcols * rows;
  for (int j = 0; j < pt.count; ++j) {
    const int64_t pos = pt.first + j;
    const float* q = part + pos * rows + r;
    float v = q[0];
    for (int s = 1; s < ks; ++s) v = v + q[s * stride];
    Y[static_cast<int64_t>(sorted[pos]) * ldy + r] = v;
  }
}

// Column c of X (c < ncols; zeros for ncols <= c < padded) as hi[K], lo[K], sx[K/32] at
// XS + c * (2K + K/32): one thread per k-block.
__global__ void __launch_bounds__(128)
    mma_presplit_kernel(const float* __restrict__ X, int64_t ldx, int ncols, int K, float* __restrict__ XS) {
  const int blk = static_cast<int>(blockIdx.x) * 128 + static_cast<int>(threadIdx.x), c = static_cast<int>(blockIdx.y);
  if (blk >= K / 32) return;
  const int64_t cs = 2 * static_cast<int64_t>(K) + K / 32;
  float* hi = XS + c * cs + 32 * static_cast<int64_t>(blk);
  float* lo = hi + K;
  float p[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    float v[8];
    if (c < ncols) {
      const float4* src = reinterpret_cast<const float4*>(X + c * ldx + 32 * static_cast<int64_t>(blk) + 8 * t);
      const float4 a = ds4_ldg(src), b = ds4_ldg(src + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.0f;
    }
    float h[8], l[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) mma_split(v[e], h[e], l[e]);
    float4* hp = reinterpret_cast<float4*>(hi + 8 * t);
    float4* lp = reinterpret_cast<float4*>(lo + 8 * t);
    hp[0] = make_float4(h[0], h[1], h[2], h[3]);
    hp[1] = make_float4(h[4], h[5], h[6], h[7]);
    lp[0] = make_float4(l[0], l[1], l[2], l[3]);
    lp[1] = make_float4(l[4], l[5], l[6], l[7]);
    p[t] = piece_sum(v);
  }
  XS[c * cs + 2 * static_cast<int64_t>(K) + blk] = pieces_sum(p[0], p[1], p[2], p[3]);
}

__global__ void mma_probe_kernel(float* out) {
  const int lane = static_cast<int>(threadIdx.x);
  auto A = [](int i, int k) { return static_cast<float>(1 + i + 16 * k); };
  auto B = [](int k, int j) { return static_cast<float>(1 + 2 * k + 3 * j); };
  float d[4];
  for (int r = 0; r < 4; ++r) d[r] = static_cast<float>(1000 * frag_c_row(lane, r) + frag_c_col(lane, r));
  mma_tf32(d, __float_as_uint(A(frag_a_row(lane, 0), frag_a_col(lane, 0))),
           __float_as_uint(A(frag_a_row(lane, 1), frag_a_col(lane, 1))),
           __float_as_uint(A(frag_a_row(lane, 2), frag_a_col(lane, 2))),
           __float_as_uint(A(frag_a_row(lane, 3), frag_a_col(lane, 3))),
           __float_as_uint(B(frag_b_row(lane, 0), frag_b_col(lane))),
           __float_as_uint(B(frag_b_row(lane, 1), frag_b_col(lane))));
  for (int r = 0; r < 4; ++r) out[frag_c_row(lane, r) * 8 + frag_c_col(lane, r)] = d[r];
}

// --- host: device limits, configuration ------------------------------------------------------------

struct MmaDevice {
  int sms = 132;
  int optin = 48 * 1024;
  int smem_sm = 100 * 1024;  // shared memory an SM
  int smem_reserved = 1024;  // the system's shared memory a block
  int max_cluster = 1;  // largest cluster every FOLD kernel can be launched with (1: no clusters)
  int stream_fold_smem = 48 * 1024;  // the most a streaming FOLD launch takes (its cluster query's size)
};
MmaDevice g_dev;
std::once_flag g_prepare_once;
std::mutex g_config_mu;
MmaConfig g_config;
bool g_config_env_read = false;

MmaConfig config_now() {
  std::lock_guard<std::mutex> lock(g_config_mu);
  if (!g_config_env_read) {
    // DS4_GPU_MMA_SLICES=0|1|2|3, DS4_GPU_MMA_WIDE=0|1, DS4_GPU_MMA_WIDE_NT=4|8,
    // DS4_GPU_MMA_FOLD=launch|inline (benches; same bits).
    if (const char* e = std::getenv("DS4_GPU_MMA_SLICES")) g_config.slices = std::clamp(std::atoi(e), 0, 3);
    if (const char* e = std::getenv("DS4_GPU_MMA_WIDE")) g_config.wide = std::string(e) != "0";
    if (const char* e = std::getenv("DS4_GPU_MMA_WIDE_NT")) g_config.wide_nt = std::atoi(e) >= 8 ? 8 : 4;
    if (const char* e = std::getenv("DS4_GPU_MMA_FOLD")) g_config.fold_inline = std::string(e) != "launch" && std::string(e) != "0";
    // DS4_GPU_MMA_STREAM=0|1|2|4|8 (0 phase 1's stages, 1 auto), DS4_GPU_MMA_STREAM_BLOCKS=0..3.
    if (const char* e = std::getenv("DS4_GPU_MMA_STREAM")) {
      const int v = std::atoi(e);
      g_config.stream = v <= 0 ? 0 : v == 1 ? 1 : v < 4 ? 2 : v < 8 ? 4 : 8;
    }
    if (const char* e = std::getenv("DS4_GPU_MMA_STREAM_BLOCKS")) g_config.stream_blocks = std::clamp(std::atoi(e), 0, 3);
    if (const char* e = std::getenv("DS4_GPU_MMA_GROUP_TILES")) g_config.group_tiles = std::clamp(std::atoi(e), 0, 2);
    if (const char* e = std::getenv("DS4_GPU_MMA_STREAM_COLS")) {
      const int v = std::atoi(e);
      g_config.stream_cols = v <= 0 ? 0 : v < 2 ? 1 : v < 4 ? 2 : v < 8 ? 4 : 8;
    }
    g_config_env_read = true;
  }
  return g_config;
}

template <DType T, int MT, int NT, int S, bool PARTIALS, bool GROUPED, bool PRESPLIT, bool FOLD = false>
constexpr size_t smem_of() {
  return static_cast<size_t>(S) * Geo<T, MT, NT>::STAGE;
}

// Caps g_dev.max_cluster (a power of two) at the largest cluster a FOLD kernel can be co-scheduled
// with at `smem` bytes of shared memory. Clusters of up to 16 (KS 16: q_a, kv) are "non-portable"
// (sm_90 allows them; the portable limit is 8); a failed query keeps the portable 8.
void cap_cluster(const void* fn, size_t smem) {
  if (g_dev.max_cluster <= 1) return;
  int cap = 8;
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(1, 1, 16);
    lc.blockDim = dim3(kThreads, 1, 1);
    lc.dynamicSmemBytes = smem;
    int most = 0;
    if (cudaOccupancyMaxPotentialClusterSize(&most, fn, &lc) == cudaSuccess && most > 0) cap = most;
  }
  (void)cudaGetLastError();  // a refused attribute or query is not an error of a later launch
  int pow2 = 1;  // slice groups are powers of two
  while (pow2 * 2 <= std::min(cap, 16)) pow2 *= 2;
  g_dev.max_cluster = std::min(g_dev.max_cluster, pow2);
}

template <DType T, int MT, int NT, int S, bool PARTIALS, bool GROUPED, bool PRESPLIT, bool FOLD = false>
void set_attr() {
  const size_t smem = smem_of<T, MT, NT, S, PARTIALS, GROUPED, PRESPLIT, FOLD>();
  if (smem > static_cast<size_t>(g_dev.optin))
    throw std::runtime_error("mma_matvec: a kernel needs " + std::to_string(smem) + " bytes of shared memory, the device allows " +
                             std::to_string(g_dev.optin));
  const void* fn = reinterpret_cast<const void*>(&mma_kernel<T, MT, NT, S, PARTIALS, GROUPED, PRESPLIT, FOLD>);
  DS4_GPU_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  if constexpr (FOLD) cap_cluster(fn, smem);
}

// Shared memory a streaming block may take so that `blocks` of them fit an SM (the system's 1 KB a
// block and the kernel's static column table off), at most the opt-in limit; multiple of 16.
int stream_budget(int blocks) {
  // 512: the static column table (StreamCols<16>: 388 bytes) with room to spare.
  const int b = std::min(g_dev.optin, g_dev.smem_sm / std::max(blocks, 1) - g_dev.smem_reserved - 512);
  return std::max(b, 0) & ~15;
}
constexpr int kStreamBlocksAuto = 3;

template <DType T, int NT, bool PARTIALS, bool GROUPED, bool FOLD>
void set_stream_attr() {
  const void* fn = reinterpret_cast<const void*>(&mma_stream_kernel<T, NT, PARTIALS, GROUPED, FOLD>);
  DS4_GPU_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, g_dev.optin));
  // As set_attr, at the shared memory a streaming FOLD launch takes at most (g_dev.stream_fold_smem:
  // the launcher caps its ring there).
  if constexpr (FOLD) cap_cluster(fn, static_cast<size_t>(g_dev.stream_fold_smem));
}

// Every instantiation the launchers use, per type.
template <DType T>
void set_attrs_type() {
  set_stream_attr<T, 1, false, false, false>();
  set_stream_attr<T, 1, true, false, false>();
  set_stream_attr<T, 1, true, false, true>();
  set_stream_attr<T, 1, false, true, false>();
  set_stream_attr<T, 1, true, true, false>();
  set_stream_attr<T, 1, true, true, true>();
  set_stream_attr<T, 2, false, true, false>();
  set_stream_attr<T, 2, true, true, false>();
  set_stream_attr<T, 2, true, true, true>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), false, false, false>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), true, false, false>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), true, false, false, true>();
  set_attr<T, 1, 2, narrow_stages<T, 2>(), false, false, false>();
  set_attr<T, 1, 2, narrow_stages<T, 2>(), true, false, false>();
  set_attr<T, 1, 2, narrow_stages<T, 2>(), true, false, false, true>();
  set_attr<T, 2, 4, kWideStages, true, false, true>();
  set_attr<T, 2, 8, kWideStages, true, false, true>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), false, true, false>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), true, true, false>();
  set_attr<T, 1, 1, narrow_stages<T, 1>(), true, true, false, true>();
}

void prepare_once() {
  int dev = 0, sms = 0, optin = 0, cc = 0, cluster = 0;
  DS4_GPU_CHECK(cudaGetDevice(&dev));
  DS4_GPU_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || optin <= 0) {
    (void)cudaGetLastError();
    optin = 48 * 1024;
  }
  if (cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&cluster, cudaDevAttrClusterLaunch, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    cc = cluster = 0;
  }
  g_dev.sms = std::max(sms, 1);
  // Less the kernels' static shared memory (the column table, at most 1.6 KB) and a margin.
  g_dev.optin = optin - 2048;
  int smem_sm = 0;
  if (cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess || smem_sm <= 0) {
    (void)cudaGetLastError();
    smem_sm = optin;
  }
  g_dev.smem_sm = smem_sm;
  int reserved = 0;
  if (cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) != cudaSuccess || reserved < 0) {
    (void)cudaGetLastError();
    reserved = 1024;
  }
  g_dev.smem_reserved = std::max(reserved, 1024);
  g_dev.stream_fold_smem = stream_budget(kStreamBlocksAuto);
  // The FOLD kernels' barrier is sm_90 code (the build's -arch must be sm_90 or newer too: the
  // module is built for one architecture, so a device of cc >= 9 runs sm_90+ code).
  g_dev.max_cluster = cc >= 9 && cluster != 0 ? 16 : 1;
  set_attrs_type<DType::Q8_0>();
  set_attrs_type<DType::Q4_K>();
  set_attrs_type<DType::F16>();
  set_attrs_type<DType::BF16>();
}

// Blocks in z (slice groups) for a grid of `base` blocks in x and y: the most, up to ks, that keep
// the grid within about 8 blocks an SM (short blocks cost their pipeline start); slices 2 forces
// one slice a block, 3 two.
int slice_groups(int ks, int64_t base, int slices) {
  if (slices == 2) return ks;
  if (slices == 3) return ks >= 4 ? ks / 2 : ks;
  int zc = ks;
  while (zc > 1 && base * zc > 8 * static_cast<int64_t>(g_dev.sms)) zc /= 2;
  return zc;
}

// The narrow and grouped launches: slice_groups, and in auto mode with the inline fold at most the
// largest cluster the device runs (more slices a block instead of the fold launch).
int slice_groups_narrow(int ks, int64_t base, const MmaConfig& cfg) {
  const int zc = slice_groups(ks, base, cfg.slices);
  return cfg.fold_inline && cfg.slices == 0 && g_dev.max_cluster > 1 ? std::min(zc, g_dev.max_cluster) : zc;
}

int64_t presplit_stride(int64_t K) { return 2 * K + K / 32; }
int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
size_t presplit_bytes(int64_t K, int ncols) {
  return static_cast<size_t>(round_up(ncols, kMaxNP) * presplit_stride(K)) * sizeof(float);
}

void check_fits(const TensorView& W, const char* who) {
  if (!mma_matvec_supported(W.type))
    throw std::invalid_argument(std::string(who) + ": weight type " + dtype_name(W.type) +
                                " has no tensor-core kernel (Q8_0, Q4_K, F16, BF16 do)");
  if (W.ne[0] <= 0 || W.ne[0] % kMmaKAlign != 0)
    throw std::invalid_argument(std::string(who) + ": row width " + std::to_string(W.ne[0]) + " is not a multiple of 256");
  if (reinterpret_cast<uintptr_t>(W.data) % 16 != 0)
    throw std::invalid_argument(std::string(who) + ": weight data is not 16-byte aligned");
  if (W.ne[0] > (int64_t{1} << 30) || W.ne[1] > (int64_t{1} << 30))
    throw std::invalid_argument(std::string(who) + ": matrix too large");
}

void check_x(const float* X, int64_t ldx, const char* who) {
  if (reinterpret_cast<uintptr_t>(X) % 16 != 0 || ldx % 4 != 0)
    throw std::invalid_argument(std::string(who) + ": activations must be 16-byte aligned with ldx a multiple of 4");
}

MmaArgs base_args(const TensorView& W, int ks) {
  MmaArgs a{};
  a.W = W.data;
  a.row_bytes = W.row_bytes();
  a.expert_bytes = W.row_bytes() * W.ne[1];
  a.rows = static_cast<int>(W.ne[1]);
  a.K = static_cast<int>(W.ne[0]);
  a.ks = ks;
  return a;
}

template <DType T, int MT, int NT, int S, bool PARTIALS, bool GROUPED, bool PRESPLIT>
void launch(dim3 grid, const MmaArgs& a, cudaStream_t s) {
  mma_kernel<T, MT, NT, S, PARTIALS, GROUPED, PRESPLIT, false>
      <<<grid, kThreads, smem_of<T, MT, NT, S, PARTIALS, GROUPED, PRESPLIT>(), s>>>(a);
  DS4_GPU_CHECK_LAUNCH("mma_kernel");
}

// The FOLD form of a narrow/grouped PARTIALS kernel: clusters of the grid's z blocks (one tile's
// slice groups), which add the partials themselves (no fold launch).
template <DType T, int MT, int NT, int S, bool GROUPED>
void launch_fold(dim3 grid, const MmaArgs& a, cudaStream_t s) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = grid;
  lc.blockDim = dim3(kThreads, 1, 1);
  lc.dynamicSmemBytes = smem_of<T, MT, NT, S, true, GROUPED, false, true>();
  lc.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = grid.z;
  lc.attrs = attr;
  lc.numAttrs = 1;
  DS4_GPU_CHECK(cudaLaunchKernelEx(&lc, mma_kernel<T, MT, NT, S, true, GROUPED, false, true>, a));
  DS4_GPU_CHECK_LAUNCH("mma_kernel (fold inline)");
}

// --- phase 5: the streaming launch shape --------------------------------------------------------

struct StreamShape {
  int ch = 0;  // 0: phase 1's kernel
  int nst = 0, nx = 0, bytes = 0, split = 0;  // ring slots, staged columns, bytes a slot, split buffers
};

int pow2_at_least(int v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

// The streaming stages of a call whose blocks each compute block_chunks chunks with nx staged
// columns (cfg.stream: MmaConfig). For a ch dividing block_chunks and a number of blocks an SM
// (cfg.stream_blocks, else 3 and 2), the ring takes as many slots as fit that many blocks' shared
// memory, at most kStreamMaxStages and at most one more than the block has stages (then the
// prologue issues all of them). In flight at a stage's wait: blocks x (slots - 1, at most the
// block's stages) x 64 rows x ch chunks of weights. Auto: first a block of at least 2 stages (its
// copies overlap its compute), then >= 64 KB in flight an SM (twice the ~32 KB that 4.2 TB/s needs
// at ~1 us of latency), then the longest copy (largest ch), then more blocks (warps) an SM, then
// more in flight; below 64 KB, the most in flight. Phase 1's kernel instead where the best of these
// keeps less than half of its bytes in flight. Forced (cfg.stream 2/4/8): the largest ch <= it,
// and the first block count, that fit.
template <DType T>
StreamShape stream_shape(const MmaConfig& cfg, int nx, int block_chunks, bool fold) {
  if (cfg.stream == 0) return StreamShape{};
  const int blocks_auto[2] = {3, 2};
  const int n_blocks = cfg.stream_blocks > 0 ? 1 : 2;
  constexpr int64_t kEnough = 64 * 1024;
  StreamShape best;
  int64_t best_inflight = -1;
  bool best_multi = false;
  int best_blocks = 0;
  for (int ch = cfg.stream == 1 ? 8 : cfg.stream; ch >= 2; ch /= 2) {
    if (block_chunks % ch != 0) continue;
    const int nst_block = block_chunks / ch;
    const int64_t wstage = int64_t{64} * 16 * stream_nvec<T>(ch);
    for (int b = 0; b < n_blocks; ++b) {
      const int blocks = cfg.stream_blocks > 0 ? cfg.stream_blocks : blocks_auto[b];
      int budget = stream_budget(blocks);
      if (fold) budget = std::min(budget, g_dev.stream_fold_smem);
      const int sb = stream_slot_bytes<T>(ch, nx), sp = stream_split_bytes<T>(ch, nx);
      const int nst = std::min({(budget - sp) / sb, kStreamMaxStages, nst_block + 1});
      if (nst < 2) continue;
      const StreamShape sh{ch, nst, nx, sb, sp};
      if (cfg.stream != 1) return sh;
      const int64_t inflight = blocks * static_cast<int64_t>(std::min(nst - 1, nst_block)) * wstage;
      const bool multi = nst_block >= 2;
      bool better;
      if (best.ch == 0 || multi != best_multi) {
        better = best.ch == 0 || multi;
      } else if ((inflight >= kEnough) != (best_inflight >= kEnough)) {
        better = inflight >= kEnough;
      } else if (inflight >= kEnough) {  // both enough: ch (iterated downwards), blocks, bytes
        better = ch == best.ch && (blocks > best_blocks || (blocks == best_blocks && inflight > best_inflight));
      } else {
        better = inflight > best_inflight;
      }
      if (better) {
        best = sh;
        best_inflight = inflight;
        best_multi = multi;
        best_blocks = blocks;
      }
    }
  }
  if (best.ch != 0) {
    const int64_t phase1 = int64_t{3} * std::min(narrow_stages<T, 1>() - 1, block_chunks) * 64 * MmaW<T>::kStride;
    if (2 * best_inflight < phase1) best = StreamShape{};
  }
  return best;
}

// The shape the last call launched (testing::mma_last_launch; the bench prints it).
std::mutex g_last_mu;
StreamShape g_last_shape;
void note_launch(const StreamShape& sh) {
  std::lock_guard<std::mutex> lock(g_last_mu);
  g_last_shape = sh;
}

template <DType T, int NT, bool PARTIALS, bool GROUPED, bool FOLD>
void launch_stream(dim3 grid, MmaArgs a, const StreamShape& sh, cudaStream_t s) {
  note_launch(sh);
  a.ch = sh.ch;
  a.nst = sh.nst;
  a.nx = sh.nx;
  a.stage_bytes = sh.bytes;
  const size_t smem = static_cast<size_t>(sh.nst) * static_cast<size_t>(sh.bytes) + static_cast<size_t>(sh.split);
  if constexpr (!FOLD) {
    mma_stream_kernel<T, NT, PARTIALS, GROUPED, false><<<grid, kThreads, smem, s>>>(a);
    DS4_GPU_CHECK_LAUNCH("mma_stream_kernel");
  } else {
    cudaLaunchConfig_t lc = {};
    lc.gridDim = grid;
    lc.blockDim = dim3(kThreads, 1, 1);
    lc.dynamicSmemBytes = smem;
    lc.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = grid.z;
    lc.attrs = attr;
    lc.numAttrs = 1;
    DS4_GPU_CHECK(cudaLaunchKernelEx(&lc, mma_stream_kernel<T, NT, PARTIALS, GROUPED, true>, a));
    DS4_GPU_CHECK_LAUNCH("mma_stream_kernel (fold inline)");
  }
}

// Whether a sliced narrow/grouped launch of zc slice groups folds in its clusters.
bool fold_inline_for(const MmaConfig& cfg, int zc) { return cfg.fold_inline && zc > 1 && zc <= g_dev.max_cluster; }

template <DType T>
void dense_typed(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, cudaStream_t s,
                 float* scratch, size_t scratch_bytes) {
  const int ks = mma_kslices(W);
  const MmaConfig cfg = config_now();
  const int64_t rows = W.ne[1], K = W.ne[0];
  MmaArgs a = base_args(W, ks);
  a.Y = Y;
  a.ldy = ldy;
  a.ncols = ncols;
  const size_t part_bytes = ks > 1 ? static_cast<size_t>(ks) * ncols * rows * sizeof(float) : 0;
  note_launch(StreamShape{});
  // Wide: pre-split columns, 2 m-tiles a warp, one slice a block (partials when KS > 1).
  if (cfg.wide && ncols > 16 && cfg.slices != 1 && round_up(ncols, kMaxNP) <= 65535) {
    const size_t pre = presplit_bytes(K, ncols);
    if (scratch != nullptr && scratch_bytes >= pre + round_up(static_cast<int64_t>(part_bytes), 256)) {
      const int padded = static_cast<int>(round_up(ncols, kMaxNP));
      mma_presplit_kernel<<<dim3(static_cast<unsigned>((K / 32 + 127) / 128), static_cast<unsigned>(padded)), 128, 0, s>>>(
          X, ldx, ncols, static_cast<int>(K), scratch);
      DS4_GPU_CHECK_LAUNCH("mma_presplit_kernel");
      a.X = scratch;
      a.ldx = presplit_stride(K);
      a.part = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(scratch) + pre);
      a.pcols = ncols;
      const int64_t rb = (rows + 127) / 128, np = cfg.wide_nt >= 8 ? 64 : 32, passes = (ncols + np - 1) / np;
      const int zc = slice_groups(ks, rb * passes, cfg.slices);
      a.gs = ks / zc;
      const dim3 grid(static_cast<unsigned>(passes), static_cast<unsigned>(rb), static_cast<unsigned>(zc));
      if (cfg.wide_nt >= 8) launch<T, 2, 8, kWideStages, true, false, true>(grid, a, s);
      else launch<T, 2, 4, kWideStages, true, false, true>(grid, a, s);
      if (ks > 1) {
        mma_fold_kernel<<<dim3(static_cast<unsigned>((rows + 255) / 256), static_cast<unsigned>(ncols)), 256, 0, s>>>(
            a.part, ks, static_cast<int>(rows), ncols, Y, ldy);
        DS4_GPU_CHECK_LAUNCH("mma_fold_kernel");
      }
      return;
    }
  }
  // Narrow passes of 8 or 16 columns, activations split in the kernel.
  a.X = X;
  a.ldx = ldx;
  const int nt = ncols <= 8 ? 1 : 2;
  const int64_t passes = (ncols + 8 * nt - 1) / (8 * nt);
  const int64_t rb = (rows + 63) / 64;
  // Slices on separate blocks (partials, then the fold) where the grid would otherwise be short.
  const bool room = scratch != nullptr && scratch_bytes >= part_bytes;
  const int zc = slice_groups_narrow(ks, rb * passes, cfg);
  const bool par = ks > 1 && room && cfg.slices != 1 && zc > 1;
  a.part = scratch;
  a.pcols = ncols;
  a.gs = par ? ks / zc : ks;
  const dim3 grid(static_cast<unsigned>(passes), static_cast<unsigned>(rb), static_cast<unsigned>(par ? zc : 1));
  const bool inl = par && fold_inline_for(cfg, zc);
  const int nchunks = static_cast<int>(K / KC);
  const StreamShape sh = nt == 1 ? stream_shape<T>(cfg, pow2_at_least(ncols), par ? a.gs * (nchunks / ks) : nchunks, inl)
                                 : StreamShape{};
  if (sh.ch != 0) {
    if (inl) launch_stream<T, 1, true, false, true>(grid, a, sh, s);
    else if (par) launch_stream<T, 1, true, false, false>(grid, a, sh, s);
    else launch_stream<T, 1, false, false, false>(grid, a, sh, s);
  } else if (nt == 1) {
    constexpr int S = narrow_stages<T, 1>();
    if (inl) launch_fold<T, 1, 1, S, false>(grid, a, s);
    else if (par) launch<T, 1, 1, S, true, false, false>(grid, a, s);
    else launch<T, 1, 1, S, false, false, false>(grid, a, s);
  } else {
    constexpr int S = narrow_stages<T, 2>();
    if (inl) launch_fold<T, 1, 2, S, false>(grid, a, s);
    else if (par) launch<T, 1, 2, S, true, false, false>(grid, a, s);
    else launch<T, 1, 2, S, false, false, false>(grid, a, s);
  }
  if (par && !inl) {
    mma_fold_kernel<<<dim3(static_cast<unsigned>((rows + 255) / 256), static_cast<unsigned>(ncols)), 256, 0, s>>>(
        scratch, ks, static_cast<int>(rows), ncols, Y, ldy);
    DS4_GPU_CHECK_LAUNCH("mma_fold_kernel");
  }
}

template <DType T>
void grouped_typed(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                   const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                   int64_t ldy, cudaStream_t s, int max_cols, float* scratch, size_t scratch_bytes) {
  const int ks = mma_kslices(W);
  const MmaConfig cfg = config_now();
  const int64_t rows = W.ne[1];
  MmaArgs a = base_args(W, ks);
  a.X = X;
  a.ldx = ldx;
  a.Y = Y;
  a.ldy = ldy;
  a.parts = parts;
  a.n_parts = n_parts;
  a.sorted = sorted_pairs;
  a.x_row = x_row;
  a.pcols = 8 * static_cast<int64_t>(max_parts);
  a.part = scratch;
  const size_t need = mma_grouped_scratch_bytes(W, max_parts);
  note_launch(StreamShape{});
  const int64_t rb = (rows + 63) / 64;
  const bool room = ks > 1 && scratch != nullptr && scratch_bytes >= need;
  const int zc = slice_groups_narrow(ks, rb * max_parts, cfg);
  const bool par = room && cfg.slices != 1 && zc > 1;
  a.gs = par ? ks / zc : ks;
  const dim3 grid(static_cast<unsigned>(rb), static_cast<unsigned>(max_parts), static_cast<unsigned>(par ? zc : 1));
  constexpr int S = narrow_stages<T, 1>();
  const bool inl = par && fold_inline_for(cfg, zc);
  const int nchunks = static_cast<int>(W.ne[0] / KC);
  const int block_chunks = par ? a.gs * (nchunks / ks) : nchunks;
  // Two n-tiles a block (two parts of one expert): forced, or auto where the call has room for 8
  // pairs an expert on average (max_parts pairs over W.ne[2] experts: prefill-sized steps).
  const int64_t n_expert = std::max<int64_t>(W.ne[2], 1);
  const bool two = cfg.group_tiles == 2 || (cfg.group_tiles == 0 && max_parts >= 8 * n_expert);
  const StreamShape sh2 = two ? stream_shape<T>(cfg, 16, block_chunks, inl) : StreamShape{};
  // Staged columns: forced, or the call's bound max_cols, but no more than twice the pairs an expert
  // gets on average (max_parts pairs over n_expert), at least 2: a part of more pairs runs in
  // pieces (its rows streamed again), which for a routing near the average is rare, and the smem
  // saved goes to longer weight copies (Q4_K 8 columns: ch 2; 2 columns: ch 8).
  const int mean2 = static_cast<int>(std::min<int64_t>(8, (2 * static_cast<int64_t>(max_parts) + n_expert - 1) / n_expert));
  const int nx = cfg.stream_cols > 0 ? cfg.stream_cols
                                     : std::min(pow2_at_least(std::clamp(max_cols, 1, 8)), std::max(2, pow2_at_least(mean2)));
  const StreamShape sh = sh2.ch != 0 ? StreamShape{} : stream_shape<T>(cfg, nx, block_chunks, inl);
  if (sh2.ch != 0) {
    if (inl) launch_stream<T, 2, true, true, true>(grid, a, sh2, s);
    else if (par) launch_stream<T, 2, true, true, false>(grid, a, sh2, s);
    else launch_stream<T, 2, false, true, false>(grid, a, sh2, s);
  } else if (sh.ch != 0) {
    if (inl) launch_stream<T, 1, true, true, true>(grid, a, sh, s);
    else if (par) launch_stream<T, 1, true, true, false>(grid, a, sh, s);
    else launch_stream<T, 1, false, true, false>(grid, a, sh, s);
  } else if (inl) launch_fold<T, 1, 1, S, true>(grid, a, s);
  else if (par) launch<T, 1, 1, S, true, true, false>(grid, a, s);
  else launch<T, 1, 1, S, false, true, false>(grid, a, s);
  if (par && !inl) {
    mma_fold_grouped_kernel<<<dim3(static_cast<unsigned>((rows + 255) / 256), static_cast<unsigned>(max_parts)), 256, 0, s>>>(
        scratch, ks, static_cast<int>(rows), a.pcols, parts, n_parts, sorted_pairs, Y, ldy);
    DS4_GPU_CHECK_LAUNCH("mma_fold_grouped_kernel");
  }
}

// --- host self-test of the staging and the decoders (testing::mma_decode_selftest) -----------------

// Random bytes for n blocks of T with every scale and float exponent made finite (signs random,
// some Q4_K scales zero), so the CPU dequantizer's values are finite.
template <DType T>
void selftest_bytes(std::mt19937_64& gen, uint8_t* p, int64_t n_bytes) {
  for (int64_t i = 0; i < n_bytes; ++i) p[i] = static_cast<uint8_t>(gen());
  const int64_t bb = block_bytes(T);
  for (int64_t b = 0; b + bb <= n_bytes; b += bb) {
    uint8_t* q = p + b;
    if constexpr (T == DType::Q8_0) {
      q[1] = static_cast<uint8_t>((q[1] & 0x83u) | 0x18u);  // |d| in [2^-9, 2^-7)
    } else if constexpr (T == DType::Q4_K) {
      q[1] = static_cast<uint8_t>((q[1] & 0x83u) | 0x18u);
      q[3] = static_cast<uint8_t>((q[3] & 0x83u) | 0x1cu);
      if (q[4] % 16 == 0) q[0] = q[1] = 0;  // d = 0 now and then
    } else if constexpr (T == DType::F16) {
      if ((q[1] & 0x7cu) == 0x7cu) q[1] &= 0xbfu;  // no inf / NaN
    } else {
      if ((q[1] & 0x7fu) == 0x7fu && (q[0] & 0x80u)) q[1] &= 0xbfu;
    }
  }
}

// Row `rb` bytes, stage i, row parity r: stage the row as issue_w does (MmaW<T>::src / dst), decode
// k-block E for every t with decode_block, compare the implied weights with the CPU's.
template <DType T, int E>
int selftest_block(const uint8_t* stage, const float* deq, int64_t i, int r, std::string* first) {
  int bad = 0;
  for (int t = 0; t < 4; ++t) {
    Row8 v;
    float mul = 0.0f, nml = 0.0f;
    decode_block<T, E>(stage, i, r, t, v, mul, nml);
    for (int j = 0; j < 8; ++j) {
      const int64_t k = 128 * i + 32 * E + 8 * t + j;
      float got;
      if constexpr (T == DType::Q8_0) got = v.v[j] * mul;  // exact product, as the CPU's q * d
      else if constexpr (T == DType::Q4_K) got = fmaf(mul, v.v[j], nml);  // the CPU's one rounding
      else got = v.v[j];
      if (!(got == deq[k]) && !(got != got && deq[k] != deq[k])) {
        if (bad == 0 && first != nullptr && first->empty())
          *first = std::string(dtype_name(T)) + " stage " + std::to_string(i) + " row parity " + std::to_string(r) +
                   " block " + std::to_string(E) + " t " + std::to_string(t) + " element " + std::to_string(k) +
                   ": decoded " + std::to_string(got) + ", CPU " + std::to_string(deq[k]);
        ++bad;
      }
    }
  }
  return bad;
}

template <DType T>
int selftest_type(uint64_t seed, std::string* first) {
  constexpr int64_t K = 2048;
  const int64_t rb = K / block_elems(T) * block_bytes(T);
  std::mt19937_64 gen(seed ^ static_cast<uint64_t>(T));
  std::vector<uint8_t> row(static_cast<size_t>(rb));
  std::vector<float> deq(static_cast<size_t>(K));
  int bad = 0;
  for (int trial = 0; trial < 16; ++trial) {
    selftest_bytes<T>(gen, row.data(), rb);
    dequantize_row(T, row.data(), deq.data(), K);
    for (int64_t i = 0; i < K / KC; ++i) {
      for (int r = 0; r < 2; ++r) {
        alignas(16) uint8_t stage[MmaW<T>::kStride];
        for (int v = 0; v < MmaW<T>::kVec; ++v) {
          const int64_t src = MmaW<T>::src(i, v);
          if (src < 0 || src + 16 > rb) {  // the copy would leave the row
            if (first != nullptr && first->empty())
              *first = std::string(dtype_name(T)) + " stage " + std::to_string(i) + " vector " + std::to_string(v) +
                       " reads bytes " + std::to_string(src) + ".." + std::to_string(src + 16) + " of a " +
                       std::to_string(rb) + "-byte row";
            return bad + 1;
          }
          std::memcpy(stage + 16 * MmaW<T>::dst(v, r), row.data() + src, 16);
        }
        bad += selftest_block<T, 0>(stage, deq.data(), i, r, first);
        bad += selftest_block<T, 1>(stage, deq.data(), i, r, first);
        bad += selftest_block<T, 2>(stage, deq.data(), i, r, first);
        bad += selftest_block<T, 3>(stage, deq.data(), i, r, first);
      }
    }
  }
  return bad;
}

// Phase 5's stages: for ch = 2, 4, 8, every stage of random rows copied as the streaming kernel's
// issue does (stream_src / stream_dst: every source vector inside the row, every destination inside
// the stage row and written once), then every chunk j, k-block E and thread t decoded by
// stream_decode and compared with the CPU's weights, for both row parities (the F16/BF16 swizzle).
template <DType T>
int stream_selftest_type(uint64_t seed, std::string* first) {
  constexpr int64_t K = 2048;
  const int64_t rb = K / block_elems(T) * block_bytes(T);
  std::mt19937_64 gen(seed ^ (static_cast<uint64_t>(T) << 8) ^ 0x5eedu);
  std::vector<uint8_t> row(static_cast<size_t>(rb));
  std::vector<float> deq(static_cast<size_t>(K));
  auto fail = [&](const std::string& why) {
    if (first != nullptr && first->empty()) *first = std::string(dtype_name(T)) + " (streaming stage) " + why;
  };
  int bad = 0;
  for (int trial = 0; trial < 8; ++trial) {
    selftest_bytes<T>(gen, row.data(), rb);
    dequantize_row(T, row.data(), deq.data(), K);
    for (int ch = 2; ch <= 8; ch *= 2) {
      const int nvec = stream_nvec<T>(ch);
      if (nvec * 16 != stream_chunk_bytes<T>() * ch) {
        fail("ch " + std::to_string(ch) + ": a stage row is not whole vectors");
        return bad + 1;
      }
      for (int64_t is = 0; is < K / KC / ch; ++is) {
        for (int r = 0; r < 2; ++r) {
          std::vector<uint8_t> stage(static_cast<size_t>(16 * nvec), 0);
          std::vector<int> hit(static_cast<size_t>(nvec), 0);
          for (int v = 0; v < nvec; ++v) {
            const int64_t src = stream_src<T>(is, ch, v);
            const int dst = stream_dst<T>(v, r);
            if (src < 0 || src + 16 > rb || src % 16 != 0 || dst < 0 || dst >= nvec || hit[static_cast<size_t>(dst)]++ != 0) {
              fail("ch " + std::to_string(ch) + " stage " + std::to_string(is) + " vector " + std::to_string(v) + ": source byte " +
                   std::to_string(src) + " of a " + std::to_string(rb) + "-byte row, destination vector " + std::to_string(dst) +
                   " of " + std::to_string(nvec));
              return bad + 1;
            }
            std::memcpy(stage.data() + 16 * dst, row.data() + src, 16);
          }
          for (int j = 0; j < ch; ++j) {
            for (int E = 0; E < 4; ++E) {
              for (int t = 0; t < 4; ++t) {
                Row8 v;
                float mul = 0.0f, nml = 0.0f;
                switch (E) {
                  case 0: stream_decode<T, 0>(stage.data(), j, r, t, v, mul, nml); break;
                  case 1: stream_decode<T, 1>(stage.data(), j, r, t, v, mul, nml); break;
                  case 2: stream_decode<T, 2>(stage.data(), j, r, t, v, mul, nml); break;
                  default: stream_decode<T, 3>(stage.data(), j, r, t, v, mul, nml); break;
                }
                for (int e = 0; e < 8; ++e) {
                  const int64_t k = KC * (ch * is + j) + 32 * E + 8 * t + e;
                  float got;
                  if constexpr (T == DType::Q8_0) got = v.v[e] * mul;
                  else if constexpr (T == DType::Q4_K) got = fmaf(mul, v.v[e], nml);
                  else got = v.v[e];
                  if (!(got == deq[k]) && !(got != got && deq[k] != deq[k])) {
                    if (bad == 0)
                      fail("ch " + std::to_string(ch) + " stage " + std::to_string(is) + " chunk " + std::to_string(j) +
                           " row parity " + std::to_string(r) + " block " + std::to_string(E) + " t " + std::to_string(t) +
                           " element " + std::to_string(k) + ": decoded " + std::to_string(got) + ", CPU " +
                           std::to_string(deq[k]));
                    ++bad;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return bad;
}

// Phase 5's activation stage: the raw copy (stream_x_src -> stream_x_at) of nx columns of a stage,
// then where the split reads each 8-element piece, where compute reads thread t's k-block, and
// where Sx goes and is read: each must name the element (column, k) it stands for, every stage
// float at most one source, and a column's floats inside its stride.
int stream_x_selftest(std::string* first) {
  int bad = 0;
  auto fail = [&](const std::string& why) {
    if (first != nullptr && first->empty()) *first = "activation stage: " + why;
    ++bad;
  };
  constexpr int64_t K = 2048;
  for (int ch = 2; ch <= 8; ch *= 2) {
    const int nx = 8, xs = stream_xstride(ch);
    for (int64_t is = 0; is < K / KC / ch; ++is) {
      // Element (c, k) encoded as c * K + k.
      std::vector<int64_t> stage(static_cast<size_t>(nx) * xs, -1);
      for (int c = 0; c < nx; ++c)
        for (int q = 0; q < 32 * ch; ++q) {
          const int64_t src = stream_x_src(is, ch, q);
          const int at = stream_x_at(c, ch, 4 * q);
          if (at % 4 != 0 || at < c * xs || at + 4 > c * xs + xs - 4 || src + 4 > K) {
            fail("ch " + std::to_string(ch) + " column " + std::to_string(c) + " vector " + std::to_string(q) + " lands at float " +
                 std::to_string(at));
            return bad;
          }
          for (int e = 0; e < 4; ++e) {
            if (stage[static_cast<size_t>(at + e)] != -1) fail("two copies land on float " + std::to_string(at + e));
            stage[static_cast<size_t>(at + e)] = c * K + src + e;
          }
        }
      for (int c = 0; c < nx; ++c) {
        for (int q = 0; q < 16 * ch; ++q)  // the split's piece q: elements 8q .. 8q + 7 of the stage
          for (int e = 0; e < 8; ++e)
            if (stage[static_cast<size_t>(stream_x_at(c, ch, 8 * q) + e)] != c * K + KC * ch * is + 8 * q + e)
              fail("split piece " + std::to_string(q) + " of column " + std::to_string(c) + " reads a wrong element");
        for (int jc = 0; jc < ch; ++jc)
          for (int kb = 0; kb < 4; ++kb)
            for (int t = 0; t < 4; ++t)
              for (int e = 0; e < 8; ++e)
                if (stage[static_cast<size_t>(stream_x_at(c, ch, KC * jc + 32 * kb + 8 * t) + e)] !=
                    c * K + KC * (ch * is + jc) + 32 * kb + 8 * t + e)
                  fail("compute chunk " + std::to_string(jc) + " block " + std::to_string(kb) + " t " + std::to_string(t) +
                       " of column " + std::to_string(c) + " reads a wrong element");
        // Sx: the split writes piece q's k-block (q >> 2) at stream_sx_at(c, ch, q >> 2); compute
        // reads k-block kb of chunk jc at stream_sx_at(c, ch, 4 jc + kb): the same k-block index.
        for (int jc = 0; jc < ch; ++jc)
          for (int kb = 0; kb < 4; ++kb) {
            const int q = 16 * jc + 4 * kb;  // the first piece of that k-block
            if (stream_sx_at(c, ch, q >> 2) != stream_sx_at(c, ch, 4 * jc + kb) || stream_sx_at(c, ch, 4 * jc + kb) < 4 * ch * c ||
                stream_sx_at(c, ch, 4 * jc + kb) >= 4 * ch * (c + 1))
              fail("Sx of chunk " + std::to_string(jc) + " block " + std::to_string(kb) + " of column " + std::to_string(c));
          }
      }
    }
  }
  return bad;
}

// stream_pair_parts on random part lists (runs of 1 .. 9 parts an expert, experts increasing):
// every part taken by exactly one block, the second part of a block always of the same expert and
// the next in the list.
int stream_pairs_selftest(uint64_t seed, std::string* first) {
  std::mt19937_64 gen(seed ^ 0x9a17u);
  int bad = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<ExpertPart> parts;
    int e = 0;
    const int n_runs = 1 + static_cast<int>(gen() % 40);
    for (int r = 0; r < n_runs; ++r) {
      e += 1 + static_cast<int>(gen() % 3);
      const int len = 1 + static_cast<int>(gen() % 9);
      for (int k = 0; k < len; ++k) parts.push_back(ExpertPart{e, static_cast<int32_t>(parts.size()) * 8, 8});
    }
    const int np = static_cast<int>(parts.size());
    std::vector<int> taken(static_cast<size_t>(np), 0);
    for (int p = 0; p < np; ++p) {
      int second = -1;
      if (!stream_pair_parts(parts.data(), np, p, &second)) continue;
      ++taken[static_cast<size_t>(p)];
      if (second >= 0) {
        if (second != p + 1 || parts[static_cast<size_t>(second)].expert != parts[static_cast<size_t>(p)].expert) {
          if (first != nullptr && first->empty()) *first = "two parts a block: part " + std::to_string(p) + " pairs with " + std::to_string(second);
          ++bad;
          continue;
        }
        ++taken[static_cast<size_t>(second)];
      }
    }
    for (int p = 0; p < np; ++p)
      if (taken[static_cast<size_t>(p)] != 1) {
        if (first != nullptr && first->empty())
          *first = "two parts a block: part " + std::to_string(p) + " taken " + std::to_string(taken[static_cast<size_t>(p)]) + " times";
        ++bad;
      }
  }
  return bad;
}

}  // namespace

bool mma_matvec_supported(DType t) {
  return t == DType::Q8_0 || t == DType::Q4_K || t == DType::F16 || t == DType::BF16;
}

bool mma_matvec_fits(const TensorView& W) {
  return mma_matvec_supported(W.type) && W.ne[0] > 0 && W.ne[0] % kMmaKAlign == 0 &&
         reinterpret_cast<uintptr_t>(W.data) % 16 == 0 && W.ne[0] <= (int64_t{1} << 30) && W.ne[1] <= (int64_t{1} << 30);
}

void set_mma_config(const MmaConfig& c) {
  if (c.slices < 0 || c.slices > 3) throw std::invalid_argument("set_mma_config: slices must be 0, 1, 2 or 3");
  if (c.wide_nt != 4 && c.wide_nt != 8) throw std::invalid_argument("set_mma_config: wide_nt must be 4 or 8");
  if (c.stream != 0 && c.stream != 1 && c.stream != 2 && c.stream != 4 && c.stream != 8)
    throw std::invalid_argument("set_mma_config: stream must be 0, 1, 2, 4 or 8");
  if (c.stream_blocks < 0 || c.stream_blocks > 3) throw std::invalid_argument("set_mma_config: stream_blocks must be 0..3");
  if (c.stream_cols != 0 && c.stream_cols != 1 && c.stream_cols != 2 && c.stream_cols != 4 && c.stream_cols != 8)
    throw std::invalid_argument("set_mma_config: stream_cols must be 0, 1, 2, 4 or 8");
  if (c.group_tiles < 0 || c.group_tiles > 2) throw std::invalid_argument("set_mma_config: group_tiles must be 0, 1 or 2");
  (void)config_now();  // the environment is read first, so it never overrides an explicit setting
  std::lock_guard<std::mutex> lock(g_config_mu);
  g_config = c;
}

MmaConfig mma_config() { return config_now(); }

size_t mma_matvec_scratch_bytes(const TensorView& W, int ncols) {
  if (ncols <= 0) return 0;
  const int ks = mma_kslices(W);
  const size_t part = ks > 1 ? static_cast<size_t>(ks) * ncols * W.ne[1] * sizeof(float) : 0;
  if (ncols <= 16) return part;
  return presplit_bytes(W.ne[0], ncols) + static_cast<size_t>(round_up(static_cast<int64_t>(part), 256));
}

size_t mma_grouped_scratch_bytes(const TensorView& W, int max_parts) {
  const int ks = mma_kslices(W);
  if (ks <= 1 || max_parts <= 0) return 0;
  return static_cast<size_t>(ks) * 8 * max_parts * W.ne[1] * sizeof(float);
}

void mma_prepare() { std::call_once(g_prepare_once, prepare_once); }

void mma_matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
                float* scratch, size_t scratch_bytes) {
  check_fits(W, "mma_matvec");
  check_x(X, ldx, "mma_matvec");
  if (ncols < 0) throw std::invalid_argument("mma_matvec: negative column count");
  if (ncols > 65535) throw std::invalid_argument("mma_matvec: at most 65535 columns a call");
  if (reinterpret_cast<uintptr_t>(scratch) % 16 != 0) throw std::invalid_argument("mma_matvec: scratch must be 16-byte aligned");
  if (ncols == 0 || W.ne[1] == 0) return;
  mma_prepare();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (W.type) {
    case DType::Q8_0: dense_typed<DType::Q8_0>(W, X, ncols, ldx, Y, ldy, s, scratch, scratch_bytes); break;
    case DType::Q4_K: dense_typed<DType::Q4_K>(W, X, ncols, ldx, Y, ldy, s, scratch, scratch_bytes); break;
    case DType::F16: dense_typed<DType::F16>(W, X, ncols, ldx, Y, ldy, s, scratch, scratch_bytes); break;
    case DType::BF16: dense_typed<DType::BF16>(W, X, ncols, ldx, Y, ldy, s, scratch, scratch_bytes); break;
    default: break;  // check_fits refused it
  }
}

void mma_matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                        const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                        int64_t ldy, Stream stream, int max_cols, float* scratch, size_t scratch_bytes) {
  check_fits(W, "mma_matvec_grouped");
  check_x(X, ldx, "mma_matvec_grouped");
  if (max_parts < 0 || max_parts > 65535) throw std::invalid_argument("mma_matvec_grouped: max_parts must be 0..65535");
  if (reinterpret_cast<uintptr_t>(scratch) % 16 != 0)
    throw std::invalid_argument("mma_matvec_grouped: scratch must be 16-byte aligned");
  if (max_parts == 0 || W.ne[1] == 0) return;
  mma_prepare();
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (W.type) {
    case DType::Q8_0: grouped_typed<DType::Q8_0>(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, max_cols, scratch, scratch_bytes); break;
    case DType::Q4_K: grouped_typed<DType::Q4_K>(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, max_cols, scratch, scratch_bytes); break;
    case DType::F16: grouped_typed<DType::F16>(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, max_cols, scratch, scratch_bytes); break;
    case DType::BF16: grouped_typed<DType::BF16>(W, parts, n_parts, max_parts, sorted_pairs, x_row, X, ldx, Y, ldy, s, max_cols, scratch, scratch_bytes); break;
    default: break;
  }
}

namespace testing {
int mma_decode_selftest(uint64_t seed, std::string* first) {
  return selftest_type<DType::Q8_0>(seed, first) + selftest_type<DType::Q4_K>(seed, first) +
         selftest_type<DType::F16>(seed, first) + selftest_type<DType::BF16>(seed, first) +
         stream_selftest_type<DType::Q8_0>(seed, first) + stream_selftest_type<DType::Q4_K>(seed, first) +
         stream_selftest_type<DType::F16>(seed, first) + stream_selftest_type<DType::BF16>(seed, first) +
         stream_x_selftest(first) + stream_pairs_selftest(seed, first);
}

int mma_fold_cluster_limit() {
  mma_prepare();
  return g_dev.max_cluster;
}

std::string mma_last_launch() {
  std::lock_guard<std::mutex> lock(g_last_mu);
  if (g_last_shape.ch == 0) return "phase-1 stages";
  return "ch " + std::to_string(g_last_shape.ch) + " x " + std::to_string(g_last_shape.nst) + " stages, " +
         std::to_string(g_last_shape.nx) + (g_last_shape.nx > 8 ? " cols (2 parts a block), " : " cols, ") + std::to_string((g_last_shape.nst * g_last_shape.bytes + g_last_shape.split) / 1024) + " KB";
}

int mma_layout_probe(std::string* first) {
  float* d = nullptr;
  DS4_GPU_CHECK(cudaMalloc(&d, 128 * sizeof(float)));
  mma_probe_kernel<<<1, 32>>>(d);
  cudaError_t err = cudaGetLastError();
  float h[128];
  if (err == cudaSuccess) err = cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  (void)cudaFree(d);
  DS4_GPU_CHECK(err);
  int bad = 0;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double want = 1000.0 * i + j;
      for (int k = 0; k < 8; ++k) want += (1.0 + i + 16.0 * k) * (1.0 + 2.0 * k + 3.0 * j);
      if (static_cast<double>(h[i * 8 + j]) != want) {
        if (bad == 0 && first != nullptr)
          *first = "row " + std::to_string(i) + " col " + std::to_string(j) + ": got " + std::to_string(h[i * 8 + j]) +
                   ", want " + std::to_string(want);
        ++bad;
      }
    }
  return bad;
}
}  // namespace testing

#else  // no tensor-core kernels in this build (HIP)

namespace {
[[noreturn]] void unsupported(const char* who) {
  throw std::runtime_error(std::string(who) + ": the tensor-core kernels need a CUDA build (sm_80 or newer)");
}
}  // namespace

bool mma_matvec_supported(DType) { return false; }
bool mma_matvec_fits(const TensorView&) { return false; }
void set_mma_config(const MmaConfig&) {}
MmaConfig mma_config() { return MmaConfig{}; }
size_t mma_matvec_scratch_bytes(const TensorView&, int) { return 0; }
size_t mma_grouped_scratch_bytes(const TensorView&, int) { return 0; }
void mma_prepare() {}
void mma_matvec(const TensorView&, const float*, int, int64_t, float*, int64_t, Stream, float*, size_t) {
  unsupported("mma_matvec");
}
void mma_matvec_grouped(const TensorView&, const ExpertPart*, const int32_t*, int, const int32_t*, const int32_t*,
                        const float*, int64_t, float*, int64_t, Stream, int, float*, size_t) {
  unsupported("mma_matvec_grouped");
}
namespace testing {
int mma_decode_selftest(uint64_t, std::string*) { unsupported("mma_decode_selftest"); }
int mma_layout_probe(std::string*) { unsupported("mma_layout_probe"); }
int mma_fold_cluster_limit() { return 1; }
std::string mma_last_launch() { return "unsupported"; }
}  // namespace testing

#endif

}  // namespace ds4::gpu
