// Weight-reuse matrix-vector products for 1..16 activation columns, fused dequantization.
//
// Computes Y[c][r] = sum_k W[r][k] * X[c][k] (fp32 accumulate) for a weight matrix stored as
// GGUF rows (ne[0] = K contiguous elements per row, ne[1] = rows) in F32, F16, BF16, Q8_0, Q4_K
// or MXFP4, and NC fp32 activation columns (X[c] at X + xoff(c), Y[c] at Y + yoff(c)).
//
// Layout of the work. A row is cut into units of 32 elements (8 for F32/F16/BF16); lane l of a
// k-slice owns units l, l+32*KS, l+64*KS, ... . A warp handles R rows at once and decodes each
// weight unit once, then applies it to every column, so a weight byte crosses the memory bus
// once per call whatever NC is. KS warps of a block split one row group's units (KS = 1, 2 or
// 4 from the matrix shape alone: more k-slices for short matrices, so they still fill the GPU).
//
// Exactness (each column is single-column arithmetic): lane l accumulates its units in
// increasing order and, inside a unit, its elements in a fixed order, into one fp32 register
// per (row, column) with fmaf(w, x, acc); the 32 lanes are combined by the butterfly of
// warp_sum; k-slices by a fixed tree ((s0 + s1) + (s2 + s3)). Nothing in that sequence depends
// on NC, R or the other columns, so column c of an NC-column call is bit-identical to the same
// column computed alone, and every call is deterministic. (R and the block shape only change
// which registers hold which rows; the unit-to-lane map depends only on K and KS.)
//
// Launch shape: 128 threads (4 warps) per block; a block covers R * 4/KS rows; grid.x = row
// blocks (grid.y = expert parts in the grouped kernel).
// Bytes it must move: rows * row_bytes of weights once, plus NC * K * 4 of activations (read
// from L1/L2 by every row group) and NC * rows * 4 of outputs.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "xplanes.cuh"

namespace ds4::gpu {

// ggml type ids (ds4::DType values), usable as template arguments.
enum : int { kF32 = 0, kF16 = 1, kQ8_0 = 8, kQ4_K = 12, kBF16 = 30, kMXFP4 = 39 };

constexpr int kMatvecThreads = 128;
constexpr int kMatvecWarps = kMatvecThreads / DS4_WARP;
constexpr int kMaxCols = 16;
constexpr int kMaxPartCols = 8;

// Rows a warp carries at once for NC columns: more rows share each activation load (fewer L1
// reads per FMA); fewer keep the (rows x columns) accumulators in registers.
#ifndef DS4_MV_R_NARROW
#define DS4_MV_R_NARROW 4
#endif
#ifndef DS4_MV_R_WIDE
#define DS4_MV_R_WIDE 2
#endif
__host__ __device__ constexpr int rows_per_warp(int nc) { return nc <= 4 ? DS4_MV_R_NARROW : DS4_MV_R_WIDE; }
// The tall variant (matvec's `tall` argument): matrices of at least kTallRows rows (q_b, the LM
// head) carry twice as many rows per warp, so twice the weight rows share each activation load,
// and there are still row blocks enough to fill the GPU (the r84 harness variant measured Q8_0
// [4096 -> 32768] at 8 columns 574 -> 350 us and the LM head at 1 column 256 -> 214 us;
// ext/gpu/README.md). R never changes a result.
constexpr int64_t kTallRows = 16384;
// Host side (matvec.cu): whether a matrix of `rows` rows of `k` elements takes the tall variant when
// asked for: at least kTallRows rows and at least matvec_tall_min_k() elements a row
// (set_matvec_tall_min_k, DS4_GPU_MV_TALL_MIN_K; default 2048, 0: any). R never changes a result.
bool tall_takes(int64_t rows, int64_t k);

// --- units: what one lane loads and decodes at a time ----------------------------------------
// Each Unit<T> gives: kElems (elements per unit), kGroups (groups of 4 elements), Raw (the
// loaded bytes), load(raw, row, u), decode(raw, g, w[4]) and k_of(u, g), the row index of the
// first of the 4 elements of group g (elements of a group are consecutive in k).

//
// Chunked loading (Q8_0 and Q4_K, kChunkBytes > 0): the 32 consecutive units a warp's lanes take
// in one pass are kChunkBytes contiguous bytes of the row, which the warp copies into shared
// memory as 16-byte vectors (coalesced), after which each lane reads its own unit from there with
// load_shared(raw, chunk, lane): the same Raw as load(raw, row, u), so the same bits (matvec_blocks).
// Without it a lane fetches its 34-byte Q8_0 block as 17 halfwords from global memory, each warp
// instruction touching 9 cache lines.

template <int T>
struct Unit;

template <>
struct Unit<kF32> {
  static constexpr int kElems = 8, kGroups = 2, kChunkBytes = 0;
  struct Raw {
    float4 v[2];
  };
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    const float4* p = reinterpret_cast<const float4*>(row) + 2 * u;
    r.v[0] = ds4_ldg(p);
    r.v[1] = ds4_ldg(p + 1);
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    w[0] = r.v[g].x;
    w[1] = r.v[g].y;
    w[2] = r.v[g].z;
    w[3] = r.v[g].w;
  }
  DS4_HD static int64_t k_of(int64_t u, int g) { return 8 * u + 4 * g; }
};

template <>
struct Unit<kF16> {
  static constexpr int kElems = 8, kGroups = 2, kChunkBytes = 0;
  struct Raw {
    uint4 v;
  };
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    r.v = ds4_ldg(reinterpret_cast<const uint4*>(row) + u);
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    const uint32_t a = g == 0 ? r.v.x : r.v.z, b = g == 0 ? r.v.y : r.v.w;
    w[0] = half_bits_to_float(a & 0xffffu);
    w[1] = half_bits_to_float(a >> 16);
    w[2] = half_bits_to_float(b & 0xffffu);
    w[3] = half_bits_to_float(b >> 16);
  }
  DS4_HD static int64_t k_of(int64_t u, int g) { return 8 * u + 4 * g; }
};

template <>
struct Unit<kBF16> {
  static constexpr int kElems = 8, kGroups = 2, kChunkBytes = 0;
  struct Raw {
    uint4 v;
  };
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    r.v = ds4_ldg(reinterpret_cast<const uint4*>(row) + u);
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    const uint32_t a = g == 0 ? r.v.x : r.v.z, b = g == 0 ? r.v.y : r.v.w;
    w[0] = ds4_bits_to_float(a << 16);
    w[1] = ds4_bits_to_float(a & 0xffff0000u);
    w[2] = ds4_bits_to_float(b << 16);
    w[3] = ds4_bits_to_float(b & 0xffff0000u);
  }
  DS4_HD static int64_t k_of(int64_t u, int g) { return 8 * u + 4 * g; }
};

// Zero weights and their sign: Q8_0 q = 0 under a negative d decodes to +0.0 (the CPU: -0.0) and
// MXFP4 code 8 to -0.0 (the CPU: +0.0). Every other value is bit-identical to the CPU's; a sum
// can tell the two zeros apart only in the sign of an exactly zero result.

// Q8_0: 34-byte blocks (2-byte aligned only), one block per unit, read as 17 halfwords.
template <>
struct Unit<kQ8_0> {
  static constexpr int kElems = 32, kGroups = 8, kChunkBytes = 32 * 34;
  struct Raw {
    float d_256, neg_32896_d;
    uint32_t q[8];  // the int8 values as stored, four per word
  };
  DS4_HD static void set_scale(Raw& r, uint32_t d_bits) {
    const float d = half_bits_to_float(d_bits);
    r.d_256 = d * 0.00390625f;
    r.neg_32896_d = d * -32896.0f;
  }
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row + 34 * u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t lo = ds4_ldg(p + 1 + 2 * i), hi = static_cast<uint32_t>(ds4_ldg(p + 2 + 2 * i));
      r.q[i] = lo | (hi << 16);
    }
    set_scale(r, ds4_ldg(p));
  }
  // Unit l of a shared-memory chunk (16-byte aligned): nine aligned words cover its 34 bytes,
  // which start on a word (l even) or half a word in (l odd); byte_perm picks the halfwords.
  __device__ static void load_shared(Raw& r, const uint8_t* chunk, int l) {
    const int off = 34 * l;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(chunk + (off & ~3));
    uint32_t v[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) v[i] = w[i];
    const bool odd = (off & 2) != 0;
    const uint32_t sel = odd ? 0x7654u : 0x5432u;
#pragma unroll
    for (int i = 0; i < 8; ++i) r.q[i] = ds4_byte_perm(v[i], v[i + 1], sel);
    set_scale(r, odd ? (v[0] >> 16) : (v[0] & 0xffffu));
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    const uint32_t b = r.q[g] ^ 0x80808080u;  // biased to 0..255
    w[0] = q8_times<0>(b, r.d_256, r.neg_32896_d);
    w[1] = q8_times<1>(b, r.d_256, r.neg_32896_d);
    w[2] = q8_times<2>(b, r.d_256, r.neg_32896_d);
    w[3] = q8_times<3>(b, r.d_256, r.neg_32896_d);
  }
  DS4_HD static int64_t k_of(int64_t u, int g) { return 32 * u + 4 * g; }
};

// Q4_K: 144-byte blocks of 256. Unit (c, h) of a block = the 16 quant bytes
// qs[32c + 16h .. +16): their low nibbles are elements 64c + 16h + i of sub-block 2c, their high
// nibbles elements 64c + 32 + 16h + i of sub-block 2c+1. Eight units per block.
template <>
struct Unit<kQ4_K> {
  static constexpr int kElems = 32, kGroups = 8, kChunkBytes = 4 * 144;
  struct Raw {
    uint4 qs;
    float dl0, ml0, dl1, ml1;
  };
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    const uint8_t* blk = row + 144 * (u >> 3);
    const int c = static_cast<int>(u >> 1) & 3, h = static_cast<int>(u) & 1;
    const uint32_t* bw = reinterpret_cast<const uint32_t*>(blk);
    r.qs = ds4_ldg(reinterpret_cast<const uint4*>(blk + 16 + 32 * c + 16 * h));
    set_scales(r, ds4_ldg(bw), ds4_ldg(bw + 1), ds4_ldg(bw + 2), ds4_ldg(bw + 3), c);
  }
  // Unit l of a shared-memory chunk of four blocks: the block's 16-byte head (d, dmin, the
  // scales) and the lane's 16 quant bytes, two 16-byte reads.
  __device__ static void load_shared(Raw& r, const uint8_t* chunk, int l) {
    const uint8_t* blk = chunk + 144 * (l >> 3);
    const int c = (l >> 1) & 3, h = l & 1;
    const uint4 head = *reinterpret_cast<const uint4*>(blk);
    r.qs = *reinterpret_cast<const uint4*>(blk + 16 + 32 * c + 16 * h);
    set_scales(r, head.x, head.y, head.z, head.w, c);
  }
  DS4_HD static void set_scales(Raw& r, uint32_t dd, uint32_t s0, uint32_t s1, uint32_t s2, int c) {
    const float d = half_bits_to_float(dd & 0xffffu), dmin = half_bits_to_float(dd >> 16);
    float sc, m;
    q4k_scale_min(s0, s1, s2, 2 * c, &sc, &m);
    r.dl0 = d * sc;
    r.ml0 = dmin * m;
    q4k_scale_min(s0, s1, s2, 2 * c + 1, &sc, &m);
    r.dl1 = d * sc;
    r.ml1 = dmin * m;
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    const uint32_t word = (g & 3) == 0 ? r.qs.x : (g & 3) == 1 ? r.qs.y : (g & 3) == 2 ? r.qs.z : r.qs.w;
    const uint32_t nib = g < 4 ? (word & 0x0f0f0f0fu) : ((word >> 4) & 0x0f0f0f0fu);
    const float dl = g < 4 ? r.dl0 : r.dl1, nml = g < 4 ? -r.ml0 : -r.ml1;
    w[0] = fmaf(dl, byte_to_float<0>(nib), nml);
    w[1] = fmaf(dl, byte_to_float<1>(nib), nml);
    w[2] = fmaf(dl, byte_to_float<2>(nib), nml);
    w[3] = fmaf(dl, byte_to_float<3>(nib), nml);
  }
  DS4_HD static int64_t k_of(int64_t u, int g) {
    const int c = static_cast<int>(u >> 1) & 3, h = static_cast<int>(u) & 1;
    return 256 * (u >> 3) + 64 * c + 16 * h + (g < 4 ? 4 * g : 32 + 4 * (g - 4));
  }
};

// MXFP4: 17-byte blocks (byte aligned), one block per unit: E8M0 scale byte, then 16 bytes whose
// low nibbles are elements 0..15 and high nibbles elements 16..31.
template <>
struct Unit<kMXFP4> {
  static constexpr int kElems = 32, kGroups = 8, kChunkBytes = 0;
  struct Raw {
    float d;
    uint32_t q[16];  // one byte per register
  };
  DS4_HD static void load(Raw& r, const uint8_t* row, int64_t u) {
    const uint8_t* p = row + 17 * u;
    r.d = e8m0_half(ds4_ldg(p));
#pragma unroll
    for (int i = 0; i < 16; ++i) r.q[i] = ds4_ldg(p + 1 + i);
  }
  DS4_HD static void decode(const Raw& r, int g, float w[4]) {
    // kvalue * 2^-127 * 2^127 is exact, and so is its product with the power-of-two scale.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t b = r.q[4 * (g & 3) + i];
      const uint32_t code = g < 4 ? (b & 15u) : (b >> 4);
      w[i] = (mxfp4_scaled(code) * 1.7014118346046923e38f) * r.d;  // 2^127
    }
  }
  DS4_HD static int64_t k_of(int64_t u, int g) { return 32 * u + (g < 4 ? 4 * g : 16 + 4 * (g - 4)); }
};

// K-slices for a matrix shape: a function of the shape alone (never of the column count), so
// the reduction tree of a row is fixed for the matrix.
__host__ __device__ constexpr int matvec_kslices(int64_t rows, int64_t units) {
  return (rows >= 8192 || units < 64) ? 1 : (rows >= 2048 || units < 128) ? 2 : 4;
}

// Rows covered by one block for NC columns and KS k-slices.
__host__ __device__ constexpr int64_t matvec_block_rows(int nc, int ks) {
  return static_cast<int64_t>(rows_per_warp(nc)) * (kMatvecWarps / ks);
}

// Shared bytes a block of `warps` warps with R rows each gives the chunked loads (matvec.cuh's
// Unit comment): S stages (2: the next chunk is in flight while the lanes work on this one) of R
// chunks per warp; zero for the types loaded unit by unit.
template <int T>
__host__ __device__ constexpr int chunk_stages(int R, int warps) {
  return warps * 2 * R * Unit<T>::kChunkBytes <= 40 * 1024 ? 2 : 1;
}
template <int T>
__host__ __device__ constexpr int chunk_buffer_bytes(int R, int warps, int stages) {
  return Unit<T>::kChunkBytes > 0 ? warps * stages * R * Unit<T>::kChunkBytes : 16;
}
// Whether a matrix can take the chunked loads: every chunk whole 16-byte vectors (Q8_0: units a
// multiple of 8), rows starting 16-byte aligned.
template <int T>
__host__ __device__ constexpr bool chunk_fits(int64_t units, int64_t row_bytes) {
  return Unit<T>::kChunkBytes > 0 && units % 8 == 0 && row_bytes % 16 == 0;
}

// acc + w[0] x.x + w[1] x.y + w[2] x.z + w[3] x.w as four fmaf in that order: one group of four
// weights of a unit into a (row, column) sum.
__device__ __forceinline__ float fma4(const float* w, float4 x, float acc) {
  acc = fmaf(w[0], x.x, acc);
  acc = fmaf(w[1], x.y, acc);
  acc = fmaf(w[2], x.z, acc);
  return fmaf(w[3], x.w, acc);
}

// A block's share: row blocks b = b0, b0 + b_step, ... below b_end, each of R * (warps / ks) rows
// (warp w works on rows b * R * (warps / ks) + (w / ks) * R + [0, R) and k-slice w % ks), NC
// columns. xload(c, k): the 4 activations X[c][k..k+3] (k a multiple of 4) from wherever they live
// (GlobalX, StagedX); yoff: the element offset of column c in Y. part: shared scratch of (warps in
// the block) * R * NC floats.
//
// chunked (only where chunk_fits and W is 16-byte aligned): the weights come through wbuf, the
// block's chunk_buffer_bytes<T>(R, warps, S) of shared memory, as one stream per warp across its
// row blocks: with S = 2 the next chunk (of this row block, or the first of the next) is in flight
// while the lanes work on the current one. The same units in the same order as the direct loads,
// so the same bits, whatever the number of row blocks a block takes (a speed choice of the
// launcher).
template <int T, int NC, int R, int S, class XLoad, class YOff>
__device__ __forceinline__ void matvec_blocks(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows,
                                              int64_t units, int ks, int64_t b0, int64_t b_step, int64_t b_end,
                                              XLoad xload, float* __restrict__ Y, YOff yoff, float* part,
                                              bool chunked, uint8_t* wbuf) {
  using U = Unit<T>;
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int group = warp / ks, slice = warp % ks;
  const int64_t br = static_cast<int64_t>(R) * (static_cast<int>(blockDim.x) / DS4_WARP / ks);
  const int64_t stride = static_cast<int64_t>(ks) * DS4_WARP;

  float acc[R][NC];
  // Rows past the end re-read the last row (valid memory); their sums are never stored.
  auto row_of = [&](int64_t b, int r) {
    const int64_t row = b * br + static_cast<int64_t>(group) * R + r;
    return W + (row < rows ? row : rows - 1) * row_bytes;
  };

  // Unit u of every row, decoded once and applied to every column, elements in a fixed order.
  auto apply = [&](const typename U::Raw (&raw)[R], int64_t u) {
    if constexpr (XLoad::kPlanes && T == kQ8_0) {
      // Integer Q8_0 (xplanes.cuh): per column, the unit's planes once, then every row.
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        UnitPlanes xp;
        xload.planes(c, u, xp);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][c] = q8_planes_dot(raw[r].q, raw[r].d_256, xp, acc[r][c]);
      }
    } else if constexpr (XLoad::kPlanes) {
      // Integer Q4_K: the unit's low nibbles are half h of X unit xa, its high nibbles half h of
      // unit xa + 1 (Unit<kQ4_K>::k_of); per column both halves' planes, then every row: the halves'
      // integers, the lane's sub-block 2c + h whole by its partner lane's (lane ^ 1: unit u ^ 1, the
      // same rows and columns now: units % 8 == 0, so both lanes of a pair pass the same bounds), and
      // its float step (xplanes.cuh).
      static_assert(T == kQ4_K, "the planes serve Q8_0 and Q4_K products only");
      const int cq = static_cast<int>(u >> 1) & 3, h = static_cast<int>(u) & 1;
      const int64_t xa = 8 * (u >> 3) + 2 * cq;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        HalfPlanes lo, hi;
        xload.half(c, xa, h, lo);
        xload.half(c, xa + 1, h, hi);
        const float xs = h ? hi.s : lo.s, xsm = h ? hi.sm : lo.sm;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint32_t wq[4] = {raw[r].qs.x, raw[r].qs.y, raw[r].qs.z, raw[r].qs.w};
          uint32_t nl[4], nh[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            nl[i] = wq[i] & 0x0f0f0f0fu;
            nh[i] = (wq[i] >> 4) & 0x0f0f0f0fu;
          }
          const int f = q4k_pair_sum(q4k_half_int(nl, lo), q4k_half_int(nh, hi), h, lane);
          acc[r][c] = q4k_sub_block(f, h ? raw[r].dl1 : raw[r].dl0, h ? raw[r].ml1 : raw[r].ml0, xs, xsm, acc[r][c]);
        }
      }
    } else {
#pragma unroll
      for (int g = 0; g < U::kGroups; ++g) {
        float w[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r) U::decode(raw[r], g, w[r]);
        const int64_t k = U::k_of(u, g);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float4 xv = xload(c, k);
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][c] = fma4(w[r], xv, acc[r][c]);
        }
      }
    }
  };

  // apply's float branch with the unit's activations already loaded (xv[c][g]: column c's group g):
  // the same fmas in the same order.
  auto apply_x = [&](const typename U::Raw (&raw)[R], const float4 (&xv)[NC][U::kGroups]) {
#pragma unroll
    for (int g = 0; g < U::kGroups; ++g) {
      float w[R][4];
#pragma unroll
      for (int r = 0; r < R; ++r) U::decode(raw[r], g, w[r]);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][c] = fma4(w[r], xv[c][g], acc[r][c]);
    }
  };

  auto zero = [&] {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
  };

  // The 32 lanes by the fixed butterfly, then the k-slices by a fixed tree; then Y. Every warp of
  // the block takes part (the block barrier), and leaves part free for the next row block.
  auto finish = [&](int64_t b) {
    const int64_t r0 = b * br + static_cast<int64_t>(group) * R;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[r][c] = warp_sum(acc[r][c]);
    if (ks == 1) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c)
          if (lane == (r * NC + c) % DS4_WARP && r0 + r < rows) Y[yoff(c) + r0 + r] = acc[r][c];
      return;
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) part[(warp * R + r) * NC + c] = acc[r][c];
    }
    __syncthreads();
    if (slice == 0) {
      const int base = group * ks;
      for (int i = lane; i < R * NC; i += DS4_WARP) {
        const int r = i / NC, c = i % NC;
        float s;
        if (ks == 2) {
          s = part[(base * R + r) * NC + c] + part[((base + 1) * R + r) * NC + c];
        } else {
          s = (part[(base * R + r) * NC + c] + part[((base + 1) * R + r) * NC + c]) +
              (part[((base + 2) * R + r) * NC + c] + part[((base + 3) * R + r) * NC + c]);
        }
        if (r0 + r < rows) Y[yoff(c) + r0 + r] = s;
      }
    }
    __syncthreads();
  };

  if constexpr (U::kChunkBytes > 0) {
    if (chunked) {
      // Pass i of a row block covers units [u0, u0 + 32), u0 = slice * 32 + i * stride; lane l
      // works on unit u0 + l, as the direct loop below does.
      constexpr int CB = U::kChunkBytes, UB = CB / DS4_WARP;  // bytes per chunk, per unit
      uint8_t* buf = wbuf + static_cast<int64_t>(warp) * S * R * CB;
      const int64_t first_u = static_cast<int64_t>(slice) * DS4_WARP;
      const int passes = first_u < units ? static_cast<int>((units - first_u + stride - 1) / stride) : 0;
      auto issue = [&](int64_t b, int i, int stage) {
        const int64_t ub = first_u + i * stride;
        const int nvec = static_cast<int>((units - ub < DS4_WARP ? units - ub : DS4_WARP) * UB / 16);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint8_t* src = row_of(b, r) + ub * UB;
          uint8_t* dst = buf + (stage * R + r) * CB;
          for (int v = lane; v < nvec; v += DS4_WARP) ds4_cp_async16(dst + 16 * v, src + 16 * v);
        }
        ds4_cp_async_commit();
      };
      // The item after (b, i) in this warp's stream; false at its end.
      auto issue_next = [&](int64_t b, int i, int stage) {
        if (i + 1 < passes) {
          issue(b, i + 1, stage);
          return true;
        }
        if (b + b_step < b_end && passes > 0) {
          issue(b + b_step, 0, stage);
          return true;
        }
        return false;
      };
      int stage = 0;
      if (b0 < b_end && passes > 0) issue(b0, 0, 0);
      // The first weights are in flight; X and Y belong to the kernels before this one (launch.cuh).
      ds4_grid_begin();
      for (int64_t b = b0; b < b_end; b += b_step) {
        zero();
        for (int i = 0; i < passes; ++i) {
          if constexpr (S == 2) {
            if (!issue_next(b, i, stage ^ 1)) ds4_cp_async_commit();  // an empty group keeps the count right
            ds4_cp_async_wait<1>();
          } else {
            ds4_cp_async_wait<0>();
          }
          ds4_syncwarp();
          const int64_t u0 = first_u + i * stride;
          if (lane < units - u0) {
            typename U::Raw raw[R];
#pragma unroll
            for (int r = 0; r < R; ++r) U::load_shared(raw[r], buf + (stage * R + r) * CB, lane);
            apply(raw, u0 + lane);
          }
          ds4_syncwarp();  // every lane is done with this stage before it is filled again
          if constexpr (S == 2) {
            stage ^= 1;
          } else {
            issue_next(b, i, 0);
          }
        }
        finish(b);
      }
      return;
    }
  }
  // Unit by unit, A passes at a time: all A passes' loads are issued before the first is applied,
  // so A units a row are in flight; they are applied in increasing order, as one pass at a time
  // would (the same order of work, so the same bits). F16/BF16 units (16 bytes) take 2; with one
  // row a warp (the short variant: few rows, long K, so a lane walks many units of one row)
  // F16/BF16 take 8 (F32, twice the bytes a unit: 4), fewer as the columns' accumulators take
  // the registers (ptxas: no spills up to 8 columns). (Pass 10 tried 16 at 1-2 columns: the mHC
  // projection stayed at 9.9 us; the X loads inside each unit's fmas are what wait.) So with one
  // row a warp and one or two columns (kXAhead) the A units' activations are loaded too before the
  // first fma, A halved at two columns for their registers (pass 12).
  constexpr bool kFloatShort = R == 1 && (T == kF16 || T == kBF16 || T == kF32);
  constexpr bool kXAhead = kFloatShort && NC <= 2 && !XLoad::kPlanes;
  constexpr int kShortAhead =
      kXAhead ? (T == kF32 ? 4 : 6) / NC : (T == kF32 ? 4 : 8) / (NC <= 2 ? 1 : NC <= 8 ? 2 : 4);
  constexpr int A = kFloatShort ? (kShortAhead > 1 ? kShortAhead : 1) : (T == kF16 || T == kBF16) ? 2 : 1;
  ds4_grid_begin();
  for (int64_t b = b0; b < b_end; b += b_step) {
    zero();
    const uint8_t* rowp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rowp[r] = row_of(b, r);
    for (int64_t u = static_cast<int64_t>(slice) * DS4_WARP + lane; u < units; u += A * stride) {
      typename U::Raw raw[A][R];
#pragma unroll
      for (int a = 0; a < A; ++a) {
        if (a == 0 || u + a * stride < units) {
#pragma unroll
          for (int r = 0; r < R; ++r) U::load(raw[a][r], rowp[r], u + a * stride);
        }
      }
      if constexpr (kXAhead) {
        float4 xv[A][NC][U::kGroups];
#pragma unroll
        for (int a = 0; a < A; ++a) {
          if (a == 0 || u + a * stride < units) {
#pragma unroll
            for (int c = 0; c < NC; ++c)
#pragma unroll
              for (int g = 0; g < U::kGroups; ++g) xv[a][c][g] = xload(c, U::k_of(u + a * stride, g));
          }
        }
#pragma unroll
        for (int a = 0; a < A; ++a)
          if (a == 0 || u + a * stride < units) apply_x(raw[a], xv[a]);
      } else {
#pragma unroll
        for (int a = 0; a < A; ++a)
          if (a == 0 || u + a * stride < units) apply(raw[a], u + a * stride);
      }
    }
    finish(b);
  }
}

struct DenseOff {
  int64_t ld;
  __device__ int64_t operator()(int c) const { return static_cast<int64_t>(c) * ld; }
};

// Activations read straight from global memory (through the read-only cache): column c at
// X + off(c).
template <class XOff>
struct GlobalX {
  static constexpr bool kPlanes = false;
  const float* X;
  XOff off;
  __device__ float4 operator()(int c, int64_t k) const {
    return ds4_ldg(reinterpret_cast<const float4*>(X + off(c) + k));
  }
};

// A batch of equally shaped products in one launch (grid.y = member): member i reads its weights
// at W + i * w_bytes, its columns at X + i * x and writes Y + i * y (elements). Each member's rows
// are computed exactly as a launch of its own would compute them.
struct MatvecBatch {
  int64_t w_bytes = 0, x = 0, y = 0;
};

// Blocks resident per SM the register allocation must allow: 4 (<= 128 registers a thread) for
// products of up to 4 columns, where the weight stream needs the warps more than the registers,
// 3 (<= 168) for wider ones, whose accumulators need more (a tighter cap spills). Measured on the
// H200 (ext/gpu/README.md, pass 5): left uncapped, the tall kernel took 255 registers and its LM
// head ran 40% slower.
constexpr int matvec_min_blocks(int nc) { return nc <= 4 ? 4 : 3; }

// The direct kernel's row shapes (its SHAPE template argument): kDenseRows carries rows_per_warp(NC)
// rows a warp, kDenseTall twice that (the tall variant above), kDenseShort one row a warp, for
// matrices of so few rows that the usual shape leaves most SMs idle (the mHC projections [16384 ->
// 24] got 6 blocks; one row a warp gives them 24). R never changes a result.
// kDenseTall2 is kDenseTall with two chunk stages (the next chunk in flight while the lanes work on
// this one) in dynamic shared memory, where kDenseTall's 8 rows a warp leave room for one stage in
// the 40 KB static buffer (set_matvec_tall_stages / DS4_GPU_MV_TALL_STAGES=2; chunked types only).
constexpr int kDenseRows = 0, kDenseTall = 1, kDenseShort = 2, kDenseTall2 = 3;
__host__ __device__ constexpr int dense_rows_per_warp(int nc, int shape) {
  return (shape == kDenseTall || shape == kDenseTall2) ? 2 * rows_per_warp(nc)
         : shape == kDenseShort                        ? 1
                                                       : rows_per_warp(nc);
}
// Dynamic shared memory (bytes) the direct kernel <T, NC, SHAPE> takes: kDenseTall2's two stages.
template <int T, int NC, int SHAPE>
constexpr int dense_dynamic_smem() {
  return SHAPE == kDenseTall2 ? chunk_buffer_bytes<T>(dense_rows_per_warp(NC, SHAPE), kMatvecWarps, 2) : 0;
}

// PL (Q8_0, Q4_K): X is a planes buffer (xplanes.cuh), ldx and batch.x in bytes.
template <int T, int NC, int SHAPE, bool PL = false>
__global__ void __launch_bounds__(kMatvecThreads, matvec_min_blocks(NC))
    matvec_dense_kernel(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                        const float* __restrict__ X, int64_t ldx, float* __restrict__ Y, int64_t ldy, bool chunked,
                        MatvecBatch batch) {
  W += blockIdx.y * batch.w_bytes;
  Y += blockIdx.y * batch.y;
  constexpr int R = dense_rows_per_warp(NC, SHAPE);
  constexpr int S = SHAPE == kDenseTall2 ? 2 : chunk_stages<T>(R, kMatvecWarps);
  __shared__ float part[kMatvecWarps * R * NC];
  uint8_t* wbuf;
  if constexpr (SHAPE == kDenseTall2) {
    extern __shared__ __align__(16) uint8_t dense_dyn[];
    wbuf = dense_dyn;
  } else {
    __shared__ __align__(16) uint8_t dense_static[chunk_buffer_bytes<T>(R, kMatvecWarps, S)];
    wbuf = dense_static;
  }
  const int64_t br = static_cast<int64_t>(R) * (kMatvecWarps / ks);
  if constexpr (PL) {
    const uint8_t* P = reinterpret_cast<const uint8_t*>(X) + blockIdx.y * batch.x;
    matvec_blocks<T, NC, R, S>(W, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, (rows + br - 1) / br,
                               PlanesX<DenseOff, true>{P, DenseOff{ldx}}, Y, DenseOff{ldy}, part, chunked, wbuf);
  } else {
    X += blockIdx.y * batch.x;
    matvec_blocks<T, NC, R, S>(W, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, (rows + br - 1) / br,
                               GlobalX<DenseOff>{X, DenseOff{ldx}}, Y, DenseOff{ldy}, part, chunked, wbuf);
  }
}

// --- the staged kernel: activations in shared memory, a persistent grid ------------------------
//
// Why: in matvec_blocks lane l reads X[c][k..k+3] at k = 32u + 4g (u its unit), 128 bytes from its
// neighbour's, so every warp-wide float4 read of X touches 32 cache lines, and each warp repeats
// those reads for every R rows; at 8 columns that, not the weights, bounded the direct kernel
// (0.24 TB/s of weights; ext/gpu/README.md). Here a block of kStagedThreads copies the NC columns
// into shared memory once (coalesced), then walks row blocks b = blockIdx.x, + gridDim.x, ...
// with the same matvec_blocks, reading X from shared memory. Same lane-to-unit map, same order,
// same reductions: every column is bit-identical to the direct kernel's (and to one column
// alone). Bytes: the weights once, NC*K*4 of activations per block (gridDim.x blocks: about one
// or two per SM), the outputs once.
//
// Shared layout: column c holds ceil(K/32) rows of 32 floats (8 float4 chunks); logical chunk
// (row, ch) is stored at chunk ch ^ f(row). A 16-byte shared read is served 8 lanes at a time,
// and f makes those 8 lanes' chunks distinct (no bank conflict) for each type's k_of: Q8_0 and
// MXFP4 (row = unit, chunk = g): f = row & 7; F32/F16/BF16 (8-element units: row = u/4, chunk
// = 2(u%4) + g): f = row & 7; Q4_K (row = 8(u/8) + 2c + g/4, chunk = 4h + g%4): f = ((row & 7) >> 1)
// | ((row & 1) << 2). The copy writes whole rows per 8 lanes, conflict-free too.
constexpr int kStagedThreads = 256;
constexpr int kStagedWarps = kStagedThreads / DS4_WARP;
constexpr int kStagedRows = 4;  // rows a warp carries (R); R never changes a result
// Shorter matrices keep the direct kernel (too few row blocks), unless set_matvec_staged_min_rows
// (ds4_gpu.h) says otherwise; R and the kernel never change a result. Whole 16-column chunks (prompt
// steps) take it from kStagedMinRowsFull rows (pass 39: the router's 256 rows, L2-bound on the
// direct kernel there, prefill +0.8-1.3%; at 5-8 columns the same floor cost decode 0.8-1.4%).
constexpr int64_t kStagedMinRows = 512;
constexpr int64_t kStagedMinRowsFull = 256;

template <int T>
__device__ __forceinline__ int staged_chunk(int64_t k) {
  const int j = static_cast<int>(k >> 2);
  const int row = j >> 3, ch = j & 7;
  const int f = T == kQ4_K ? (((row & 7) >> 1) | ((row & 1) << 2)) : (row & 7);
  return (row << 3) | (ch ^ f);
}

template <int T>
struct StagedX {
  static constexpr bool kPlanes = false;
  const float4* xs;  // shared: NC columns of col4 float4 each
  int col4;
  __device__ float4 operator()(int c, int64_t k) const { return xs[c * col4 + staged_chunk<T>(k)]; }
};

// Float4 chunks a column takes in shared memory (K rounded up to whole rows of 32 floats).
__host__ __device__ constexpr int64_t staged_col4(int64_t K) { return (K + 31) / 32 * 8; }

// The staged kernel's chunk buffer (dynamic shared memory, after the columns): two stages.
template <int T>
__host__ __device__ constexpr int staged_wbuf_bytes() {
  return Unit<T>::kChunkBytes > 0 ? chunk_buffer_bytes<T>(kStagedRows, kStagedWarps, 2) : 0;
}

// PL (Q8_0, Q4_K): X is a planes buffer (xplanes.cuh; ldx, batch.x in bytes), copied as it is: the
// columns take NC * units * kPlaneBytes of shared memory (less than the floats' NC * col4 * 16).
template <int T, int NC, bool PL = false>
__global__ void __launch_bounds__(kStagedThreads)
    matvec_staged_kernel(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                         int64_t K, const float* __restrict__ X, int64_t ldx, float* __restrict__ Y, int64_t ldy,
                         bool chunked, MatvecBatch batch) {
  ds4_grid_begin();
  W += blockIdx.y * batch.w_bytes;
  Y += blockIdx.y * batch.y;
  constexpr int R = kStagedRows;
  extern __shared__ float4 xs[];
  __shared__ float part[kStagedWarps * R * NC];
  if constexpr (PL) {
    const uint8_t* P = reinterpret_cast<const uint8_t*>(X) + blockIdx.y * batch.x;
    const int64_t col_vec = units * kPlaneBytes / 16;  // 16-byte vectors a column
    for (int c = 0; c < NC; ++c) {
      const uint4* src = reinterpret_cast<const uint4*>(P + c * ldx);
      uint4* dst = reinterpret_cast<uint4*>(xs) + c * col_vec;
      for (int64_t j = threadIdx.x; j < col_vec; j += kStagedThreads) dst[j] = ds4_ldg(src + j);
    }
    __syncthreads();
    const int64_t br = static_cast<int64_t>(R) * (kStagedWarps / ks);
    const int64_t n_blocks = (rows + br - 1) / br;
    uint8_t* wbuf = reinterpret_cast<uint8_t*>(xs) + NC * col_vec * 16;
    matvec_blocks<T, NC, R, 2>(W, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, n_blocks,
                               PlanesX<DenseOff, false>{reinterpret_cast<const uint8_t*>(xs), DenseOff{col_vec * 16}},
                               Y, DenseOff{ldy}, part, chunked, wbuf);
  } else {
    X += blockIdx.y * batch.x;
    const int col4 = static_cast<int>(staged_col4(K));
    const int k4 = static_cast<int>(K / 4);
    // The copy: four independent 16-byte loads in flight per thread before their stores.
    for (int c = 0; c < NC; ++c) {
      const float4* src = reinterpret_cast<const float4*>(X + static_cast<int64_t>(c) * ldx);
      float4* dst = xs + c * col4;
      for (int j0 = static_cast<int>(threadIdx.x); j0 < k4; j0 += 4 * kStagedThreads) {
        float4 v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = j0 + q * kStagedThreads;
          if (j < k4) v[q] = ds4_ldg(src + j);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = j0 + q * kStagedThreads;
          if (j < k4) dst[staged_chunk<T>(4 * static_cast<int64_t>(j))] = v[q];
        }
      }
    }
    __syncthreads();
    const int64_t br = static_cast<int64_t>(R) * (kStagedWarps / ks);
    const int64_t n_blocks = (rows + br - 1) / br;
    uint8_t* wbuf = reinterpret_cast<uint8_t*>(xs + static_cast<int64_t>(NC) * col4);
    matvec_blocks<T, NC, R, 2>(W, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, n_blocks, StagedX<T>{xs, col4}, Y,
                               DenseOff{ldy}, part, chunked, wbuf);
  }
}

// A part of the expert-grouped product: pairs [first, first + count) of the pair list all use
// expert `expert`; count <= kMaxPartCols.
struct ExpertPartDev {
  int32_t expert, first, count;
};

struct GatherOff {
  const int32_t* idx;  // shared copy of the part's X rows (pair lanes) or Y rows (pair ids)
  int64_t ld;
  __device__ int64_t operator()(int c) const { return static_cast<int64_t>(idx[c]) * ld; }
};

// Expert-grouped product: block (x, p) computes row block x of part p: for each pair id j of the
// part (sorted_pairs[first..first+count)), Y[j] = W[expert] . X[x_row[j]] (x_row null: X[j]). Parts past *n_parts exit (the grid is sized for the
// most parts the step can have, so a captured graph stays valid whatever the routing was).
// The grouped kernel's shared chunk buffer: sized for the widest R it runs (narrow parts).
constexpr int kGroupedRows = rows_per_warp(1) > rows_per_warp(kMaxPartCols) ? rows_per_warp(1) : rows_per_warp(kMaxPartCols);

// LP (Q8_0, Q4_K): the integer products, the planes built by each lane (LanePlanesX).
template <int T, int NC, bool LP>
__device__ __forceinline__ void grouped_part(const uint8_t* We, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                                             const float* X, const int32_t* lanes, int64_t ldx, float* Y,
                                             const int32_t* ids, int64_t ldy, float* part, bool chunked,
                                             uint8_t* wbuf) {
  constexpr int R = rows_per_warp(NC);
  // The buffer holds S stages of kGroupedRows rows; a narrower R uses its front part.
  constexpr int S = chunk_stages<T>(kGroupedRows, kMatvecWarps);
  const int64_t br = matvec_block_rows(NC, ks);
  if constexpr (LP) {
    matvec_blocks<T, NC, R, S>(We, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, (rows + br - 1) / br,
                               LanePlanesX<GatherOff>{X, GatherOff{lanes, ldx}}, Y, GatherOff{ids, ldy}, part, chunked,
                               wbuf);
  } else {
    matvec_blocks<T, NC, R, S>(We, row_bytes, rows, units, ks, blockIdx.x, gridDim.x, (rows + br - 1) / br,
                               GlobalX<GatherOff>{X, GatherOff{lanes, ldx}}, Y, GatherOff{ids, ldy}, part, chunked,
                               wbuf);
  }
}

// Columns c0.. of a part, in sub-parts of at most MAXC columns (each column is single-column
// arithmetic, so how a part is cut never changes a result).
template <int T, int NC, bool LP>
__device__ __forceinline__ void grouped_part_nc(int nc, const uint8_t* We, int64_t row_bytes, int64_t rows,
                                                int64_t units, int ks, const float* X, const int32_t* lanes,
                                                int64_t ldx, float* Y, const int32_t* ids, int64_t ldy, float* part,
                                                bool chunked, uint8_t* wbuf) {
  if (nc == NC) {
    grouped_part<T, NC, LP>(We, row_bytes, rows, units, ks, X, lanes, ldx, Y, ids, ldy, part, chunked, wbuf);
  } else if constexpr (NC > 1) {
    grouped_part_nc<T, NC - 1, LP>(nc, We, row_bytes, rows, units, ks, X, lanes, ldx, Y, ids, ldy, part, chunked, wbuf);
  }
}

// planes: Q8_0 and Q4_K products take the integer arithmetic (xplanes.cuh, LanePlanesX), as the
// dense products do with the switch on, so every pair still equals its dense product.
// MAXC (1, 2, 4 or 8): the widest sub-part a block runs, chosen by the launcher from the lanes of
// the step (a part has at most one pair per lane unless a lane routes twice to one expert, which
// the sub-parts cover): the register file and the grid are sized for it, so a decode step of one
// lane does not pay for 8-column code. MAXC <= 4 gives every width the same R (the grid's rows).
static_assert(rows_per_warp(1) == rows_per_warp(4), "sub-parts of up to 4 columns share one row count");
template <int T, int MAXC>
__global__ void __launch_bounds__(kMatvecThreads, matvec_min_blocks(MAXC))
    matvec_grouped_kernel(const uint8_t* __restrict__ W, int64_t expert_bytes, int64_t row_bytes, int64_t rows,
                          int64_t units, int ks, const ExpertPartDev* __restrict__ parts,
                          const int32_t* __restrict__ n_parts, const int32_t* __restrict__ sorted_pairs,
                          const int32_t* __restrict__ x_row, const float* __restrict__ X, int64_t ldx,
                          float* __restrict__ Y, int64_t ldy, bool chunked, bool planes) {
  ds4_grid_begin();
  constexpr int S = chunk_stages<T>(kGroupedRows, kMatvecWarps);
  __shared__ float part[kMatvecWarps * kGroupedRows * MAXC];
  __shared__ __align__(16) uint8_t wbuf[chunk_buffer_bytes<T>(kGroupedRows, kMatvecWarps, S)];
  __shared__ int32_t lanes[MAXC], ids[MAXC];
  const int p = static_cast<int>(blockIdx.y);
  if (p >= *n_parts) return;
  const ExpertPartDev pt = parts[p];
  const int64_t block_rows = matvec_block_rows(pt.count < MAXC ? pt.count : MAXC, ks);
  if (static_cast<int64_t>(blockIdx.x) * block_rows >= rows) return;  // narrow parts need fewer blocks
  // (A block takes row blocks blockIdx.x, + gridDim.x, ...; the launcher sizes the grid.)
  const uint8_t* We = W + static_cast<int64_t>(pt.expert) * expert_bytes;
  for (int c0 = 0; c0 < pt.count; c0 += MAXC) {
    const int nc = pt.count - c0 < MAXC ? pt.count - c0 : MAXC;
    if (c0 > 0) __syncthreads();  // the previous sub-part is done with lanes, ids and part
    if (threadIdx.x < MAXC) {
      const int c = static_cast<int>(threadIdx.x);
      const int32_t pair = c < nc ? sorted_pairs[pt.first + c0 + c] : 0;
      ids[c] = pair;
      lanes[c] = x_row != nullptr ? x_row[pair] : pair;
    }
    __syncthreads();
    if ((T == kQ8_0 || T == kQ4_K) && planes)
      grouped_part_nc<T, MAXC, T == kQ8_0 || T == kQ4_K>(nc, We, row_bytes, rows, units, ks, X, lanes, ldx, Y, ids, ldy, part,
                                           chunked, wbuf);
    else
      grouped_part_nc<T, MAXC, false>(nc, We, row_bytes, rows, units, ks, X, lanes, ldx, Y, ids, ldy, part, chunked,
                                      wbuf);
  }
}

// --- pass 6: the grouped kernel's own body (Q4_K) ----------------------------------------------
//
// What the kernel above spends its time on at flash-l4 shapes (ext/gpu/README.md, pass 5, and the
// ptxas report of 3b06184): a warp carries R = 4 rows of one k-slice for only 2 passes of 32 units
// (gate/up, K = 4096, KS = 2) or 1 (down), then meets the other k-slice's warp at a block barrier;
// its copies are issued at its start and its decode runs after them, so load, decode and reduction
// run in series; and under the 128-register cap its Q4_K instantiations spill (MAXC 4: 852 bytes
// of spill loads a thread, MAXC 2: 236). This body keeps every bit of that arithmetic and changes
// where it runs:
//
// - Virtual k-slices: one warp computes whole rows. Pass q of a row (units [32q, 32q + 32), lane l
//   on unit 32q + l) belongs to k-slice q % KS; the warp keeps one accumulator set per k-slice, each
//   fed in that slice's own unit order, and at the end puts each set through warp_sum and adds the
//   sets as the k-slice tree does (s0 + s1; KS = 1: s0). Every output is bit-identical to the kernel
//   above (so to the dense one), with no shared `part`, no block barrier (a warp never waits for
//   another) and KS times the passes per warp to pipeline.
// - A deeper copy stream: each warp's chunks (its rows' passes in order) run `stages` - 1 passes
//   ahead (stages 2..4, a runtime choice; dynamic shared memory), so later passes are in flight
//   while the lanes decode earlier ones.
// - No register cap (the launch bound is the block size only; DS4_MV_OWN_MINB sets one for
//   experiments), and rows per warp chosen for the doubled accumulators (grouped_own_rows_nc).
// - Optionally (FAST) a one-fma Q4_K decode: w = fmaf(2 dl, 8 + q/2, C) with C = -ml - 16 dl, where
//   8 + q/2 is one byte_perm (q in mantissa bits 19..22 of a float of exponent 2^3). Exactly,
//   2 dl (8 + q/2) + C = dl q - ml, rounded once: the value fmaf(dl, q, -ml) gives, provided C is
//   exact, which q4k_fast_addend checks per sub-block (it holds whenever dmin's exponent is within
//   about -3..+11 of d's; in real and synthesized files dmin is the larger by 2^0..2^4). Where it
//   does not, or where d or dmin is negative (then a zero weight's sign could differ), the lane's
//   pass takes Unit<kQ4_K>::decode's two-fma form. A weight costs byte_perm + fmaf instead of
//   byte_perm + fadd + fmaf, plus its fmaf into each column.
//
// Lane l always works on unit position l & 7 of a Q4_K block (a pass starts at a multiple of 32
// units), so c = (l >> 1) & 3 is a lane constant: q4k_unit_scales takes both of the unit's (scale,
// min) pairs with one shift chosen once per lane instead of q4k_scale_min's byte selects per unit.
//
// Launch: 128 threads; block (x, p) covers rows [4 RM x, 4 RM (x + 1)) of part p, RM the most rows
// a warp carries at any of its widths, each warp its own R-row groups of them (grouped_own_nc);
// dynamic shared memory grouped_own_smem(MAXC, stages). Taken for Q4_K matrices that take the
// chunked loads with KS <= 2 (every DS4 expert shape) and whose expert is below 2^31 bytes; the
// rest stay on the kernel above.

// Values of the runtime switch (set_matvec_grouped, DS4_GPU_MV_GROUPED in matvec.cu).
enum : int { kGroupedPass5 = 0, kGroupedOwn = 1, kGroupedOwnFast = 2 };
constexpr int kGroupedMaxStages = 4;

// Host side (matvec.cu): which grouped kernel Q4_K products take (kGroupedPass5, kGroupedOwn,
// kGroupedOwnFast; all give the same bits), the own kernel's copy stages (2..4) and the widest
// sub-part it runs at once (1, 2, 4 or 8: wider parts run in pieces, re-reading their weights, so
// that the kernel's registers, which its widest body sets, stay few for the narrow parts that make
// up most of a step); 0 keeps a value, -1 goes back to the environment's or the default.
// Process-wide, read at launch (a graph keeps what it captured).
void set_matvec_grouped(int variant, int stages = 0, int width = 0);
int matvec_grouped_variant();
int matvec_grouped_stages();
int matvec_grouped_width();
// The own kernel's row groups a warp streams in one copy stream (1..kGroupedMaxGroups; 0: chosen
// per launch by grouped_own_groups; -1: back to DS4_GPU_MV_GROUPED_GROUPS=N, else 0): a block then
// covers that many times the rows, and each warp's copies run on from one row group's last pass
// into the next one's first instead of each row group starting its stream anew. Which warp computes
// a row changes; its arithmetic does not.
constexpr int kGroupedMaxGroups = 16;
void set_matvec_grouped_groups(int groups);
int matvec_grouped_groups();  // the setting (0: per launch)
// The row groups a launch of the own kernel over `rows` rows of max_parts parts takes, its blocks
// covering block_rows rows each with one (grouped_own_block_rows); resident: the kernel's blocks
// the device holds at once (0: unknown).
int grouped_own_groups(int64_t rows, int64_t block_rows, int max_parts, int64_t resident);
// Blocks of kernel fn (threads a block, smem bytes of dynamic shared memory) the whole device holds
// at once; 0 where the runtime cannot say. Asked once per (fn, threads, smem).
int64_t device_resident_blocks(const void* fn, int threads, size_t smem);

// The (d*sc, dmin*m) pairs of the two sub-blocks of unit position c (0..3) of a Q4_K block whose
// first 16 bytes are the words dd, s0, s1, s2: sub-blocks 2c and 2c + 1 use bytes 2 (c & 1) and
// 2 (c & 1) + 1 of the scale words, so one shift by 16 (c & 1) brings both to the low half
// (ggml's get_scale_min_k4, two at a time). The same floats as Unit<kQ4_K>::set_scales.
DS4_HD void q4k_unit_scales(uint32_t dd, uint32_t s0, uint32_t s1, uint32_t s2, int c, float* dl0, float* ml0,
                            float* dl1, float* ml1) {
  const int sh = 16 * (c & 1);
  const uint32_t x0 = s0 >> sh, x1 = s1 >> sh, x2 = s2 >> sh;
  const uint32_t sc = c < 2 ? (x0 & 0x3f3fu) : ((x2 & 0x0f0fu) | ((x0 >> 2) & 0x3030u));
  const uint32_t m = c < 2 ? (x1 & 0x3f3fu) : (((x2 >> 4) & 0x0f0fu) | ((x1 >> 2) & 0x3030u));
  const float d = half_bits_to_float(dd & 0xffffu), dmin = half_bits_to_float(dd >> 16);
  *dl0 = d * byte_to_float<0>(sc);
  *dl1 = d * byte_to_float<1>(sc);
  *ml0 = dmin * byte_to_float<0>(m);
  *ml1 = dmin * byte_to_float<1>(m);
}

// C = -ml - 16 dl for the one-fma decode, and whether it is exact; meaningful for d, dmin >= +0,
// which the caller checks. Then both terms are <= 0, so the larger-magnitude one, big, has
// |big| <= |C| <= 2 |big| and C - big is exact (Sterbenz): it equals the other term iff the sum was
// not rounded. inf and NaN fail the test.
DS4_HD bool q4k_fast_addend(float dl, float ml, float* c) {
  const float a = -ml, b = dl * -16.0f;  // exact: a power-of-two multiple
  const float s = a + b;
  const float big = fminf(a, b), small = fmaxf(a, b);
  *c = s;
  return s - big == small;
}

// The nibbles of `word` (low: HI false, high: HI true) as bytes q << 3, so that byte_perm makes
// byte i the third byte of a float whose top byte is 0x41: 2^3 (1 + q/16) = 8 + q/2, which times
// 2 dl is 16 dl + dl q, exactly.
template <bool HI>
DS4_HD uint32_t q4k_fast_bytes(uint32_t word) {
  return (HI ? (word >> 1) : (word << 3)) & 0x78787878u;
}
template <int I>
DS4_HD float q4k_fast_q(uint32_t fb) {
  return ds4_bits_to_float(ds4_byte_perm(fb, 0x41000000u, 0x7044u | (I << 8)));
}

// Group g (0..7) of a unit's 32 weights (elements k_of(u, g) .. + 3) from its 16 quant bytes, per
// sub-block a multiplier m and an addend a: FAST: fmaf(m = 2 dl, 8 + q/2, a = C); else
// fmaf(m = dl, q, a = -ml), as Unit<kQ4_K>::decode.
template <bool FAST>
DS4_HD void q4k_unit_decode(uint4 qs, float m0, float a0, float m1, float a1, int g, float w[4]) {
  const uint32_t word = (g & 3) == 0 ? qs.x : (g & 3) == 1 ? qs.y : (g & 3) == 2 ? qs.z : qs.w;
  const float m = g < 4 ? m0 : m1, a = g < 4 ? a0 : a1;
  if (FAST) {
    const uint32_t fb = g < 4 ? q4k_fast_bytes<false>(word) : q4k_fast_bytes<true>(word);
    w[0] = fmaf(m, q4k_fast_q<0>(fb), a);
    w[1] = fmaf(m, q4k_fast_q<1>(fb), a);
    w[2] = fmaf(m, q4k_fast_q<2>(fb), a);
    w[3] = fmaf(m, q4k_fast_q<3>(fb), a);
  } else {
    const uint32_t nib = g < 4 ? (word & 0x0f0f0f0fu) : ((word >> 4) & 0x0f0f0f0fu);
    w[0] = fmaf(m, byte_to_float<0>(nib), a);
    w[1] = fmaf(m, byte_to_float<1>(nib), a);
    w[2] = fmaf(m, byte_to_float<2>(nib), a);
    w[3] = fmaf(m, byte_to_float<3>(nib), a);
  }
}

// Offset of group g's first element from the unit's first (k_of(u, g) - k_of(u, 0)).
__host__ __device__ constexpr int q4k_group_k(int g) { return g < 4 ? 4 * g : 16 + 4 * g; }

// Rows a warp of the own kernel carries for NC columns. Its accumulators are KS x R x NC (one set
// per virtual k-slice), so it takes fewer rows than rows_per_warp for the same registers; R never
// changes a result.
#ifndef DS4_MV_OWN_R2
#define DS4_MV_OWN_R2 4  // rows for 1-2 columns
#endif
#ifndef DS4_MV_OWN_R4
#define DS4_MV_OWN_R4 2  // 3-4 columns
#endif
#ifndef DS4_MV_OWN_R8
#define DS4_MV_OWN_R8 2  // 5-8 columns
#endif
__host__ __device__ constexpr int grouped_own_rows_nc(int nc) {
  return nc <= 2 ? DS4_MV_OWN_R2 : nc <= 4 ? DS4_MV_OWN_R4 : DS4_MV_OWN_R8;
}
// Rows per warp the own kernel's blocks and buffers are sized for: the most of its sub-part widths.
__host__ __device__ constexpr int grouped_own_rows(int maxc) {
  int r = 0;
  for (int nc = 1; nc <= maxc; ++nc) r = grouped_own_rows_nc(nc) > r ? grouped_own_rows_nc(nc) : r;
  return r;
}

// Dynamic shared memory of one block of the own kernel.
__host__ __device__ constexpr int grouped_own_smem(int maxc, int stages) {
  return kMatvecWarps * stages * grouped_own_rows(maxc) * Unit<kQ4_K>::kChunkBytes;
}

// Until at most stages - 1 copy groups of this lane are in flight (the oldest one has landed).
__device__ __forceinline__ void grouped_own_wait(int stages) {
  if (stages >= 4) ds4_cp_async_wait<3>();
  else if (stages == 3) ds4_cp_async_wait<2>();
  else if (stages == 2) ds4_cp_async_wait<1>();
  else ds4_cp_async_wait<0>();
}

// A pass's 32 weights of R rows applied to NC columns: per group, per column, per row, the
// group's 4 elements in order (Unit-by-unit, the order of matvec_blocks' apply).
template <bool FAST, int R, int NC>
__device__ __forceinline__ void grouped_own_apply(const uint4 (&qs)[R], const float (&m0)[R], const float (&a0)[R],
                                                  const float (&m1)[R], const float (&a1)[R],
                                                  const float* const (&xq)[NC], float (&acc)[R][NC]) {
#pragma unroll
  for (int g = 0; g < 8; ++g) {
    float w[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) q4k_unit_decode<FAST>(qs[r], m0[r], a0[r], m1[r], a1[r], g, w[r]);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 xv = ds4_ldg(reinterpret_cast<const float4*>(xq[c] + q4k_group_k(g)));
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][c] = fma4(w[r], xv, acc[r][c]);
    }
  }
}

// The integer form of grouped_own_apply (xplanes.cuh): rec[c] is column c's planes record of the X
// unit under the lane's low nibbles (the high nibbles' is the next record), h the lane's half, and
// (dl, ml) each row's pair of the lane's sub-block 2c + h, whose sum the lane keeps (q4k_pair_sum:
// its partner lane ^ 1 holds the other half; both lanes run every pass alike).
template <int R, int NC>
__device__ __forceinline__ void grouped_own_apply_planes(const uint4 (&qs)[R], const float (&dl)[R],
                                                         const float (&ml)[R], const uint8_t* const (&rec)[NC], int h,
                                                         int lane, float (&acc)[R][NC]) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    HalfPlanes lo, hi;
    load_half_planes<true>(rec[c], h, lo);
    load_half_planes<true>(rec[c] + kPlaneBytes, h, hi);
    const float xs = h ? hi.s : lo.s, xsm = h ? hi.sm : lo.sm;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t wq[4] = {qs[r].x, qs[r].y, qs[r].z, qs[r].w};
      uint32_t nl[4], nh[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        nl[i] = wq[i] & 0x0f0f0f0fu;
        nh[i] = (wq[i] >> 4) & 0x0f0f0f0fu;
      }
      const int f = q4k_pair_sum(q4k_half_int(nl, lo), q4k_half_int(nh, hi), h, lane);
      acc[r][c] = q4k_sub_block(f, dl[r], ml[r], xs, xsm, acc[r][c]);
    }
  }
}

// Where the own body's sums go. GroupedStore: one product, Y[off] = v. A store with kPair true
// runs two products of the same shape at once (matvec_fused.cu's gate/up pair): a warp's R row
// slots are R/2 rows of the first matrix (We) and the same R/2 rows of the second (We2), and the
// store gets both sums of an output element, (off, first, second).
struct GroupedStore {
  static constexpr bool kPair = false;
  float* Y;
  __device__ __forceinline__ void operator()(int64_t off, float v) const { Y[off] = v; }
};

// NC columns (pairs[0..NC) of a part: Y row pairs[c], X row x_row[pairs[c]], or pairs[c] when
// x_row is null) of ng row groups, group g rows rg .. rg + H (rg = r0 + g r_step, each below rows)
// of expert matrix We (and, Store::kPair, of We2), H = R or R/2 (R = grouped_own_rows_nc(NC) row
// slots); buf: this warp's stages x R chunks. Row slot r holds row rg + r of We, or (kPair, r >= H)
// row rg + r - H of We2: a slot's arithmetic is the same whichever matrix it reads, so every sum has
// the bits of the one-product body. One copy stream serves the groups in turn: the passes of group
// g + 1 are in flight while the warp computes group g's last ones.
// PL: the integer products, X's planes (xplanes.cuh) at planes + (X row) * ldp.
template <int NC, int KS, bool FAST, class Store, bool PL>
__device__ __forceinline__ void grouped_own_part(const uint8_t* __restrict__ We, const uint8_t* __restrict__ We2,
                                                 int64_t row_bytes, int rows, int r0, int r_step, int ng, int units,
                                                 const int32_t* __restrict__ pairs, const int32_t* __restrict__ x_row,
                                                 const float* __restrict__ X, int64_t ldx, const Store& store,
                                                 int64_t ldy, uint8_t* buf, int stages,
                                                 const uint8_t* __restrict__ planes, int64_t ldp) {
  constexpr int R = grouped_own_rows_nc(NC);
  static_assert(!Store::kPair || R % 2 == 0, "a paired warp takes as many rows of each matrix");
  constexpr int H = Store::kPair ? R / 2 : R;  // output rows of the warp
  constexpr int CB = Unit<kQ4_K>::kChunkBytes, UB = CB / DS4_WARP;  // 576 bytes a chunk, 18 a unit
  const int lane = static_cast<int>(threadIdx.x) % DS4_WARP;

  // Rows past the end re-read the last row (valid memory); their sums are never stored. Lane l
  // copies the 16-byte vectors l and l + 32 of each chunk (a chunk is at most 36 vectors).
  const uint8_t* src_l = We + 16 * lane;
  const uint8_t* src2_l = (Store::kPair ? We2 : We) + 16 * lane;
  const int passes = (units + DS4_WARP - 1) / DS4_WARP;
  // The copy stream's cursor: the next pass to issue is pass iq of row group ig, whose row slot r
  // reads from row_src[r] (its row's first chunk). The launcher keeps an expert matrix below 2^31
  // bytes. Kept as a cursor, not recomputed from a pass count, so that a copy costs its address add.
  int ig = 0, iq = 0;
  const uint8_t* row_src[R];
  auto aim = [&](int g) {
    const int rg = r0 + g * r_step;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = rg + (r < H ? r : r - H);
      row_src[r] = (r < H ? src_l : src2_l) + (row < rows ? row : rows - 1) * static_cast<int>(row_bytes);
    }
  };
  aim(0);
  const ds4_smem_addr dst_l = ds4_smem_of(buf + 16 * lane);
  // The cursor's pass into stage st, one commit group; then the cursor moves on.
  auto issue = [&](int st) {
    if (ig < ng) {
      const int left = units - iq * DS4_WARP;
      const int nvec = (left < DS4_WARP ? left : DS4_WARP) * UB / 16;  // units % 8 == 0: whole vectors
      const ds4_smem_addr dst = dst_l + st * R * CB;
      const int off = iq * CB;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint8_t* src = row_src[r] + off;
        if (lane < nvec) ds4_cp_async16_at(dst + r * CB, src);
        if (lane + DS4_WARP < nvec) ds4_cp_async16_at(dst + r * CB + 16 * DS4_WARP, src + 16 * DS4_WARP);
      }
      if (++iq == passes) {
        iq = 0;
        if (++ig < ng) aim(ig);
      }
    }
    ds4_cp_async_commit();  // an empty group past the end keeps the count right
  };
  // The stream starts before the column indices are read (they do not gate the copies).
  for (int f = 0; f < stages - 1; ++f) issue(f);

  // Lane l's elements of pass q (unit u = 32 q + l, so u >> 3 = 4 q + (l >> 3) and c, h from l):
  // k = Unit<kQ4_K>::k_of(u, g) = 1024 q + 256 (l >> 3) + 64 c + 16 h + q4k_group_k(g).
  const int lane_k = 256 * (lane >> 3) + 64 * ((lane >> 1) & 3) + 16 * (lane & 1);
  const float* xp[NC];
  const uint8_t* rp[NC];  // PL: the record of X unit lane_k / 32 (the lane's low nibbles) in pass 0
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int32_t pair = pairs[c];
    const int32_t xr = x_row != nullptr ? x_row[pair] : pair;
    xp[c] = X + static_cast<int64_t>(xr) * ldx + lane_k;
    if constexpr (PL) rp[c] = planes + static_cast<int64_t>(xr) * ldp + (lane_k / 32) * kPlaneBytes;
  }
  const int cpos = (lane >> 1) & 3;
  const int head_off = 144 * (lane >> 3), qs_off = head_off + 16 + 16 * (lane & 7);

  int st = 0;  // the stage of the pass being computed (its stream position % stages)
#pragma unroll 1
  for (int g = 0; g < ng; ++g) {
    const int rg = r0 + g * r_step;
    float acc[KS][R][NC];
#pragma unroll
    for (int s = 0; s < KS; ++s)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[s][r][c] = 0.0f;

    for (int q0 = 0; q0 < passes; q0 += KS) {
#pragma unroll
      for (int s = 0; s < KS; ++s) {
        const int q = q0 + s;
        if (q < passes) {
          int st_issue = st + stages - 1;  // the pass stages - 1 ahead goes where the previous one was
          if (st_issue >= stages) st_issue -= stages;
          issue(st_issue);
          grouped_own_wait(stages);
          ds4_syncwarp();
          if (lane < units - q * DS4_WARP) {
            const uint8_t* chunk = buf + st * R * CB;
            uint4 qs[R];
            float dl0[R], a0[R], dl1[R], a1[R];  // two-fma form: dl, -ml
            float m0[R], c0[R], m1[R], c1[R];    // FAST: 2 dl, C = -ml - 16 dl
            bool fast = FAST;
#pragma unroll
            for (int r = 0; r < R; ++r) {
              const uint4 head = *reinterpret_cast<const uint4*>(chunk + r * CB + head_off);
              qs[r] = *reinterpret_cast<const uint4*>(chunk + r * CB + qs_off);
              float ml0, ml1;
              q4k_unit_scales(head.x, head.y, head.z, head.w, cpos, &dl0[r], &ml0, &dl1[r], &ml1);
              a0[r] = -ml0;
              a1[r] = -ml1;
              if (FAST) {
                const bool e0 = q4k_fast_addend(dl0[r], ml0, &c0[r]), e1 = q4k_fast_addend(dl1[r], ml1, &c1[r]);
                fast = fast && (head.x & 0x80008000u) == 0u && e0 && e1;
                m0[r] = 2.0f * dl0[r];  // exact
                m1[r] = 2.0f * dl1[r];
              }
            }
            if constexpr (PL) {
              const uint8_t* rq[NC];
              float dl[R], ml[R];  // the lane's sub-block 2 cpos + (lane & 1)
#pragma unroll
              for (int c = 0; c < NC; ++c) rq[c] = rp[c] + 32 * q * kPlaneBytes;  // 1024 elements a pass
#pragma unroll
              for (int r = 0; r < R; ++r) dl[r] = (lane & 1) ? dl1[r] : dl0[r], ml[r] = -((lane & 1) ? a1[r] : a0[r]);
              grouped_own_apply_planes<R, NC>(qs, dl, ml, rq, lane & 1, lane, acc[s]);
            } else {
              const float* xq[NC];
#pragma unroll
              for (int c = 0; c < NC; ++c) xq[c] = xp[c] + 1024 * q;
              // One form for all R rows of the lane's pass: the one-fma form only where every row allows it.
              if (FAST && fast) grouped_own_apply<true, R, NC>(qs, m0, c0, m1, c1, xq, acc[s]);
              else grouped_own_apply<false, R, NC>(qs, dl0, a0, dl1, a1, xq, acc[s]);
            }
          }
          ds4_syncwarp();  // every lane is done with stage st before it is filled again
          st = st + 1 == stages ? 0 : st + 1;
        }
      }
    }

    // Each k-slice's sums by the butterfly, added as the k-slice tree adds them; then the store.
    // (warp_sum leaves every lane the same bits, so any lane may store.)
    auto sum = [&](int r, int c) {
      float v = warp_sum(acc[0][r][c]);
      if constexpr (KS == 2) v = v + warp_sum(acc[1][r][c]);
      return v;
    };
#pragma unroll
    for (int r = 0; r < H; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float v = sum(r, c);
        if constexpr (Store::kPair) {
          const float v2 = sum(r + H, c);
          if (lane == (r * NC + c) % DS4_WARP && rg + r < rows)
            store(static_cast<int64_t>(pairs[c]) * ldy + rg + r, v, v2);
        } else {
          if (lane == (r * NC + c) % DS4_WARP && rg + r < rows) store(static_cast<int64_t>(pairs[c]) * ldy + rg + r, v);
        }
      }
  }
}

// Columns pairs[0..nc) of a part with nc <= NC, dispatched to the body compiled for nc, over the
// block's groups * RM * 4 row slots: warp w takes slots (4 g + w) R .. + R of them for g = 0 ..
// groups * RM / R - 1 (R the body's rows per warp) in one copy stream, so every width covers the
// same rows with the same blocks. A slot is a row (one product) or, Store::kPair, half a row of
// each product: a block then covers groups * RM * 2 rows of both.
template <int NC, int KS, bool FAST, int RM, class Store, bool PL>
__device__ __forceinline__ void grouped_own_nc(int nc, const uint8_t* We, const uint8_t* We2, int64_t row_bytes,
                                               int rows, int units, const int32_t* pairs, const int32_t* x_row,
                                               const float* X, int64_t ldx, const Store& store, int64_t ldy,
                                               uint8_t* buf, int stages, int groups, const uint8_t* planes,
                                               int64_t ldp) {
  if (nc == NC) {
    constexpr int R = grouped_own_rows_nc(NC);
    static_assert(RM % R == 0, "a block's rows are whole row groups of every width");
    constexpr int H = Store::kPair ? R / 2 : R, HM = Store::kPair ? RM / 2 : RM;
    const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
    const int r0 = static_cast<int>(blockIdx.x) * kMatvecWarps * HM * groups + warp * H;
    constexpr int step = kMatvecWarps * H;
    if (r0 >= rows) return;  // no barrier follows: no other warp waits for this one
    const int left = (rows - r0 + step - 1) / step;  // the warp's groups that start below rows
    const int ng = groups * (RM / R) < left ? groups * (RM / R) : left;
    grouped_own_part<NC, KS, FAST, Store, PL>(We, We2, row_bytes, rows, r0, step, ng, units, pairs, x_row, X, ldx,
                                              store, ldy, buf, stages, planes, ldp);
  } else if constexpr (NC > 1) {
    grouped_own_nc<NC - 1, KS, FAST, RM, Store, PL>(nc, We, We2, row_bytes, rows, units, pairs, x_row, X, ldx, store,
                                                    ldy, buf, stages, groups, planes, ldp);
  }
}

// Row slots of one block of the own kernel (4 warps x RM), and the rows of a matrix they cover.
__host__ __device__ constexpr int grouped_own_block_rows(int maxc, bool pair) {
  return kMatvecWarps * grouped_own_rows(maxc) / (pair ? 2 : 1);
}

// The grouped product of matvec_grouped_kernel (same parts, same pairs, same bits) with the own
// body above: block (x, p) runs rows [B x, B (x + 1)) of part p (B = groups * grouped_own_block_rows)
// in sub-parts of at most MAXC columns, each warp its own rows. Parts past *n_parts exit. W2: the
// second stack of a paired store (same shape as W; unused otherwise).
#ifndef DS4_MV_OWN_MINB
#define DS4_MV_OWN_MINB 1
#endif
// PL: the integer products (planes: X's planes, a row of them ldp bytes).
template <int MAXC, int KS, bool FAST, class Store, bool PL = false>
__global__ void __launch_bounds__(kMatvecThreads, DS4_MV_OWN_MINB)
    matvec_grouped_own_kernel(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2, int64_t expert_bytes,
                              int64_t row_bytes, int rows, int units, const ExpertPartDev* __restrict__ parts,
                              const int32_t* __restrict__ n_parts, const int32_t* __restrict__ sorted_pairs,
                              const int32_t* __restrict__ x_row, const float* __restrict__ X, int64_t ldx,
                              const Store store, int64_t ldy, int stages, int groups,
                              const uint8_t* __restrict__ planes, int64_t ldp) {
  ds4_grid_begin();
  extern __shared__ __align__(16) uint8_t grouped_own_buf[];
  const int p = static_cast<int>(blockIdx.y);
  if (p >= *n_parts) return;
  const ExpertPartDev pt = parts[p];
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP;
  uint8_t* buf = grouped_own_buf + warp * stages * grouped_own_rows(MAXC) * Unit<kQ4_K>::kChunkBytes;
  const int64_t eoff = static_cast<int64_t>(pt.expert) * expert_bytes;
  const uint8_t* We = W + eoff;
  const uint8_t* We2 = Store::kPair ? W2 + eoff : We;
  for (int c0 = 0; c0 < pt.count; c0 += MAXC) {
    const int nc = pt.count - c0 < MAXC ? pt.count - c0 : MAXC;
    grouped_own_nc<MAXC, KS, FAST, grouped_own_rows(MAXC), Store, PL>(nc, We, We2, row_bytes, rows, units,
                                                                       sorted_pairs + pt.first + c0, x_row, X, ldx,
                                                                       store, ldy, buf, stages, groups, planes, ldp);
  }
}

// --- matvec_multi: several products of one activation block in one grid ----------------------
//
// Why: at one column a product of a few MB (q_a 4.4 MB, kv 2.2 MB, the compressors 1-8 MB) is a
// launch whose ramp and tail cost as much as its bytes (ext/gpu/README.md, pass 6: 28 Q8_0
// launches, 305 us for ~0.5 GB). Products that read the same X (the projections of u; of q_lat;
// the shared expert's gate and up) run here as one grid: their row blocks are laid end to end,
// block b belongs to the last product whose first block is <= b, and it runs that product's row
// block b - first exactly as matvec_dense_kernel runs it (the same matvec_blocks call: the unit-
// to-lane map and KS of the product's own shape, the same butterfly and k-slice tree). So every
// output has the bits of matvec's direct kernel, hence of its tall and staged kernels too (those
// are bit-identical to it). R and the chunked loads are speed choices and may differ.
//
// Types: one instantiation serves products of type TA or TB (TA == TB: one type), the body chosen
// per block by the product's type (block-uniform); the launcher groups the products by type and
// pairs Q8_0 with F16 or BF16 (DS4's attention projections with its compressor and indexer ones).
// Launch: 128 threads, grid.x = the products' row blocks, at most kMultiMax products.
// Bytes: every product's weights once, NC x K x 4 of X (through L1/L2), the outputs once.
constexpr int kMultiMax = 8;
constexpr int kMultiMaxCols = 8;  // wider chunks run product by product (matvec)

struct MultiProduct {
  const uint8_t* W;
  float* Y;
  int32_t row_bytes, rows, ldy;  // the launcher checks they fit
  int32_t first_block;  // its row blocks are grid blocks first_block, first_block + 1, ...
  int32_t ks, type;     // k-slices of its shape (matvec_kslices), its ggml type
  int32_t chunked;      // the chunked loads (where chunk_fits and W is 16-byte aligned)
};

struct MultiArgs {
  MultiProduct p[kMultiMax];
  int64_t K;
  const uint8_t* planes;  // the Q8_0 products' planes of X (xplanes.cuh), null for the float path
  int64_t ldp;            // bytes a column of planes
  int32_t n;
};

template <int T, int NC, int R>
__device__ __forceinline__ void multi_product(const MultiProduct& p, const MultiArgs& a, const float* __restrict__ X,
                                              int64_t ldx, float* part, uint8_t* wbuf) {
  constexpr int S = chunk_stages<T>(R, kMatvecWarps);
  const int64_t units = a.K / Unit<T>::kElems;
  const int64_t br = static_cast<int64_t>(R) * (kMatvecWarps / p.ks);
  const int64_t nb = (p.rows + br - 1) / br;
  const int64_t b = static_cast<int64_t>(blockIdx.x) - p.first_block;
  // One row block: b_step = b_end = nb ends the loop after it.
  if constexpr (T == kQ8_0 || T == kQ4_K) {
    if (a.planes != nullptr) {
      matvec_blocks<T, NC, R, S>(p.W, p.row_bytes, p.rows, units, p.ks, b, nb, nb,
                                 PlanesX<DenseOff, true>{a.planes, DenseOff{a.ldp}}, p.Y, DenseOff{p.ldy}, part,
                                 p.chunked != 0, wbuf);
      return;
    }
  }
  matvec_blocks<T, NC, R, S>(p.W, p.row_bytes, p.rows, units, p.ks, b, nb, nb, GlobalX<DenseOff>{X, DenseOff{ldx}}, p.Y,
                             DenseOff{p.ldy}, part, p.chunked != 0, wbuf);
}

// The descriptor table stays in the parameter space, read by index (CUDA: __grid_constant__, so a
// dynamic index needs no local copy and the fields load from the constant cache; HIP: kernel
// arguments are memory already).
#if defined(DS4_HIP)
#define DS4_GRID_CONSTANT
#else
#define DS4_GRID_CONSTANT __grid_constant__
#endif

template <int TA, int TB, int NC, bool TALL>
__global__ void __launch_bounds__(kMatvecThreads, matvec_min_blocks(NC))
    matvec_multi_kernel(const DS4_GRID_CONSTANT MultiArgs a, const float* __restrict__ X, int64_t ldx) {
  constexpr int R = (TALL ? 2 : 1) * rows_per_warp(NC);
  constexpr int BA = chunk_buffer_bytes<TA>(R, kMatvecWarps, chunk_stages<TA>(R, kMatvecWarps));
  constexpr int BB = chunk_buffer_bytes<TB>(R, kMatvecWarps, chunk_stages<TB>(R, kMatvecWarps));
  __shared__ float part[kMatvecWarps * R * NC];
  __shared__ __align__(16) uint8_t wbuf[BA > BB ? BA : BB];
  int i = 0;  // this block's product: the last whose first block is at or below blockIdx.x
#pragma unroll
  for (int j = 1; j < kMultiMax; ++j)
    if (j < a.n && static_cast<int>(blockIdx.x) >= a.p[j].first_block) i = j;
  const MultiProduct& p = a.p[i];
  if constexpr (TA == TB) {
    multi_product<TA, NC, R>(p, a, X, ldx, part, wbuf);
  } else {
    if (p.type == TA) multi_product<TA, NC, R>(p, a, X, ldx, part, wbuf);
    else multi_product<TB, NC, R>(p, a, X, ldx, part, wbuf);
  }
}

}  // namespace ds4::gpu
