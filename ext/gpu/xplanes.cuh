// Integer Q8_0 products: the activations as exact small integers ("planes"), the dot products in
// 32-bit integer arithmetic (dp4a), one rounding per 32-element unit.
//
// Why (ext/gpu/README.md "Pass 10"): at one column the SIMT Q8_0 products spent ~4 instructions a
// weight (a byte permute and an fma to decode each weight exactly, the fma of the product, the
// unit loads) and ran at 35-40% of the memory bandwidth with the weight stream waiting on the
// instruction stream. Here a unit of 32 weights against one column costs 24 dp4a and ~6 other
// instructions: under one instruction a weight.
//
// The arithmetic. For a unit of 32 activations x_i (one column), E is the exponent with
// max|x_i| < 2^E (clamped to E >= -100), s = 2^(E-22) and m_i = rint(x_i / s), so |m_i| <= 2^22 and
// x_i = s m_i + e_i with |e_i| <= s/2 = 2^-23 2^E. Each m_i is split into three signed bytes,
// m_i = p0_i + 2^8 p1_i + 2^16 p2_i (p0, p1 in -128..127, p2 in -64..64): the unit's planes. A Q8_0
// unit (scale d, int8 q_i) then gives, exactly in integers,
//   S1 = sum q_i p1_i,  T = 2^8 S1 + sum q_i p0_i (|T| < 2^28),  S2 = sum q_i p2_i (|S2| <= 2^18),
// and its contribution to the (row, column) sum is acc = fmaf(fmaf(float(S2), 2^16, float(T)),
// d s, acc): float(T) and the inner fma round once each, d s is exact (a half times a power of
// two), the outer fma rounds once. Against the exact dot product of the unit that is an error of at
// most ~2^-23 of sum |d q_i| max|x| plus the three roundings, where the fp32 kernels' 32 fmas round
// 32 times: the same size of error as the float path (test_gpu_int8.py checks both against float64).
// Zero units give s = 0 (no contribution); a unit holding an inf or NaN gives s = NaN, so the sum is
// NaN as in the float path. The clamp E >= -100 keeps 1/s and 256 s normal floats: a unit whose
// largest |x| is below 2^-100 (~8e-31) is resolved to 2^-123 absolute instead of 2^-23 relative.
//
// Exactness as the other kernels keep it: a column's planes depend on that column alone, a lane
// takes its units in the same order, and the sums are reduced by the same butterfly and k-slice
// tree, so every column of a launch is bit-identical to the column alone, and the planes built by
// the prep kernel (8 threads a unit), copied into shared memory, or built by one lane
// (LanePlanesX) are the same bytes. What changes is the arithmetic against the float path
// (DS4_GPU_MV_INT8=0): a different last bit or so, like the tensor-core switch.
//
// Q4_K (w = dl q - ml per 32-element sub-block, q in 0..15): a sub-block's 32 elements are one X
// unit, and each sub-block is summed once, in integers over all 32: with the unit's planes, M = sum
// m_i over its 32 elements (exact) and the column's sM = s float(M),
//   S1 = sum q p1, T = 2^8 S1 + sum q p0, S2 = sum q p2, F = 2^16 S2 + T (exact in 32 bits: |S2| <=
//   32 * 15 * 64, |T| < 2^24.9, so |F| <= 480 * 2^22 + 2^24.9 < 2^31),
//   acc = fmaf(dl s, float(F), fmaf(-ml, sM, acc))
// (dl s exact: a float of at most 17 significant bits times a power of two; float(F) rounds once).
// A Q4_K unit of matvec.cuh (16 quant bytes, Unit<kQ4_K>) holds half h of sub-blocks 2c and 2c + 1,
// and the lane of its partner unit (the other half h, the next lane) the other halves: each lane
// forms both halves' integers (16 elements each), keeps sub-block 2c + h's and swaps the other
// with its partner (q4k_pair_sum), then does that sub-block's float step. Pass 23 (GPU README):
// pass 22 rounded each half on its own (two float steps a unit a lane); one step a sub-block halves
// the float epilogue of the integer tensor-core kernel (imma_q4k.cu), which is bound by it, and
// lets its mma take a sub-block's 32 elements at once. The min term's scale is the column's alone,
// so a kernel reads it instead of forming (ml s) float(M) per row. Against the exact sum the error
// is that of the float path's size (test_gpu_int8.py); s float(M) overflows only where a unit's
// largest |x| exceeds ~2^102, where the products overflow in any arithmetic.
//
// Layout: a column's planes are `units` records of kPlaneBytes: p0 words 0..7 (elements 4w..4w+3,
// byte j = element 4w + j), p1 words, p2 words, then the floats 256 s at byte 96, sM at 100, s at 104
// and a zero pad at 108 (a record stays 16-byte aligned, and 8 lanes read 8 consecutive records'
// 16-byte pieces without a shared-memory bank conflict).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "matvec_fused.h"

namespace ds4::gpu {

constexpr int kPlaneBytes = 112;
constexpr int kPlaneScaleOff = 96;  // 256 s, sM, s, 0 (floats)
constexpr int kPlaneThreads = 8;  // threads that build one unit's record in the prep kernel

// One unit's planes of one column, as a lane holds them.
struct UnitPlanes {
  uint32_t p0[8], p1[8], p2[8];
  float s256;  // 256 s: d_256 (Unit<kQ8_0>::Raw) times it is d s
  float sm;    // s float(sum of m_i) over the unit's 32 elements
  float s;
};

// Half h of a unit's planes (elements 16h .. 16h + 15), with the whole unit's s and sM.
struct HalfPlanes {
  uint32_t p0[4], p1[4], p2[4];
  float s;
  float sm;  // s float(M), M over the unit's 32 elements
};

// 1 / s (a power of two; 0 for a zero unit or one holding an inf or NaN), 256 s and s (NaN for the
// latter) of a unit whose largest |x| has the bits amax_bits (the largest of bits(x) & 0x7fffffff:
// the integer order of those bits is the order of |x|, with the infs and NaNs above every number).
__device__ __forceinline__ void plane_scale(uint32_t amax_bits, float* s_inv, float* s256, float* s) {
  if (amax_bits == 0u || amax_bits >= 0x7f800000u) {
    *s_inv = 0.0f;
    *s256 = *s = amax_bits == 0u ? 0.0f : ds4_bits_to_float(0x7fc00000u);
    return;
  }
  const int ef = static_cast<int>(amax_bits >> 23);
  int e = ef == 0 ? -126 : ef - 126;  // max|x| < 2^e
  e = e < -100 ? -100 : e;
  *s_inv = ds4_bits_to_float(static_cast<uint32_t>(127 + 22 - e) << 23);
  *s256 = ds4_bits_to_float(static_cast<uint32_t>(127 + e - 14) << 23);
  *s = ds4_bits_to_float(static_cast<uint32_t>(127 + e - 22) << 23);  // >= 2^-122: normal
}

// The min term's column scale of a unit: s float(M) (exact but for float(M)'s rounding).
__device__ __forceinline__ float plane_min_scale(float s, int32_t m) { return __fmul_rn(s, static_cast<float>(m)); }

// The three digit bytes of x / s rounded to the nearest integer (ties to even): x * s_inv is exact
// (a power of two) or, where it underflows, far below 1/2 and rounds to 0 either way; adding
// 1.5 * 2^23 rounds it to an integer (|x * s_inv| < 2^22), and the float's low bits are that integer.
__device__ __forceinline__ int32_t plane_digits(float x, float s_inv, uint32_t* d0, uint32_t* d1, uint32_t* d2) {
  const float t = __fadd_rn(__fmul_rn(x, s_inv), 12582912.0f);
  const int m = static_cast<int>(ds4_float_to_bits(t)) - 0x4B400000;
  const int p0 = static_cast<int>(static_cast<uint32_t>(m) << 24) >> 24;
  const int r1 = (m - p0) >> 8;
  const int p1 = static_cast<int>(static_cast<uint32_t>(r1) << 24) >> 24;
  const int p2 = (r1 - p1) >> 8;
  *d0 = static_cast<uint32_t>(p0) & 0xffu;
  *d1 = static_cast<uint32_t>(p1) & 0xffu;
  *d2 = static_cast<uint32_t>(p2) & 0xffu;
  return m;
}

// The plane words of four consecutive elements (element j in byte j); returns their sum of m.
__device__ __forceinline__ int32_t plane_words(float4 v, float s_inv, uint32_t* w0, uint32_t* w1, uint32_t* w2) {
  const float e[4] = {v.x, v.y, v.z, v.w};
  uint32_t a = 0, b = 0, c = 0;
  int32_t sum = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t d0, d1, d2;
    sum += plane_digits(e[j], s_inv, &d0, &d1, &d2);
    a |= d0 << (8 * j);
    b |= d1 << (8 * j);
    c |= d2 << (8 * j);
  }
  *w0 = a;
  *w1 = b;
  *w2 = c;
  return sum;
}

__device__ __forceinline__ uint32_t abs_bits_max(float4 v) {
  const uint32_t a = ds4_float_to_bits(v.x) & 0x7fffffffu, b = ds4_float_to_bits(v.y) & 0x7fffffffu;
  const uint32_t c = ds4_float_to_bits(v.z) & 0x7fffffffu, d = ds4_float_to_bits(v.w) & 0x7fffffffu;
  return max(max(a, b), max(c, d));
}

// fmaf(float(S2), 2^16, float(T)) for N words of int8 values q (Q8_0 weights, or Q4_K nibbles as
// bytes) against the matching N words of each plane: S1 = sum q p1, T = 2^8 S1 + sum q p0 and S2 =
// sum q p2, exact in 32-bit integers (N <= 8: |T| < 2^28).
// acc + sum q p over N words of signed bytes (dp4a; exact in 32 bits for the sums below).
template <int N>
__device__ __forceinline__ int plane_dot(const uint32_t (&q)[N], const uint32_t (&p)[N], int acc) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc = ds4_dp4a(static_cast<int>(q[i]), static_cast<int>(p[i]), acc);
  return acc;
}

template <int N>
__device__ __forceinline__ float planes_sum(const uint32_t (&q)[N], const uint32_t (&p0)[N], const uint32_t (&p1)[N],
                                            const uint32_t (&p2)[N]) {
  const int s1 = plane_dot(q, p1, 0), s2 = plane_dot(q, p2, 0);
  const int t = plane_dot(q, p0, s1 * 256);
  return fmaf(static_cast<float>(s2), 65536.0f, static_cast<float>(t));
}

// Unit u of Q8_0 row weights (raw: q words as stored, d_256) against one column's planes xp, added
// to acc as the header describes.
__device__ __forceinline__ float q8_planes_dot(const uint32_t (&q)[8], float d_256, const UnitPlanes& xp, float acc) {
  return fmaf(planes_sum<8>(q, xp.p0, xp.p1, xp.p2), d_256 * xp.s256, acc);
}

// 2^16 S2 + T (the header's F) of sixteen Q4_K nibbles (n: 4 words of bytes 0..15) against the
// matching half of one column's planes: exact (|.| < 2^30 for 16 elements).
__device__ __forceinline__ int q4k_half_int(const uint32_t (&n)[4], const HalfPlanes& xp) {
  const int s1 = plane_dot(n, xp.p1, 0), s2 = plane_dot(n, xp.p2, 0);
  return plane_dot(n, xp.p0, (s2 * 256 + s1) * 256);
}

// The F of the lane's sub-block (2c + h of its unit's block) from its halves' integers f_lo (the low
// nibbles: half h of sub-block 2c) and f_hi (half h of 2c + 1): it keeps one, its partner lane
// (lane ^ 1, half 1 - h of the same sub-blocks) sends the other half of the kept one. Both lanes of
// a pair must call it. Exact: |F| < 2^31 (the header).
__device__ __forceinline__ int q4k_pair_sum(int f_lo, int f_hi, int h, int lane) {
  return (h ? f_hi : f_lo) + ds4_shfl_pair(h ? f_lo : f_hi, lane);
}

// A sub-block's F (with (dl, ml)) against its X unit's s and sM, added to acc as the header describes.
__device__ __forceinline__ float q4k_sub_block(int f, float dl, float ml, float s, float sm, float acc) {
  return fmaf(dl * s, static_cast<float>(f), fmaf(-ml, sm, acc));
}

// The half h of a unit record at p (global or shared).
template <bool GLOBAL>
__device__ __forceinline__ void load_half_planes(const uint8_t* p, int h, HalfPlanes& xp) {
  const uint4* q = reinterpret_cast<const uint4*>(p + 16 * h);
  const uint4* tail = reinterpret_cast<const uint4*>(p + kPlaneScaleOff);
  const uint4 a = GLOBAL ? ds4_ldg(q) : q[0], b = GLOBAL ? ds4_ldg(q + 2) : q[2], c = GLOBAL ? ds4_ldg(q + 4) : q[4];
  const uint4 t = GLOBAL ? ds4_ldg(tail) : tail[0];
  xp.p0[0] = a.x, xp.p0[1] = a.y, xp.p0[2] = a.z, xp.p0[3] = a.w;
  xp.p1[0] = b.x, xp.p1[1] = b.y, xp.p1[2] = b.z, xp.p1[3] = b.w;
  xp.p2[0] = c.x, xp.p2[1] = c.y, xp.p2[2] = c.z, xp.p2[3] = c.w;
  xp.s = ds4_bits_to_float(t.z);
  xp.sm = ds4_bits_to_float(t.y);
}

// Half h of a whole unit's planes held in registers.
__device__ __forceinline__ void half_of(const UnitPlanes& u, int h, HalfPlanes& xp) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    xp.p0[i] = h ? u.p0[4 + i] : u.p0[i];
    xp.p1[i] = h ? u.p1[4 + i] : u.p1[i];
    xp.p2[i] = h ? u.p2[4 + i] : u.p2[i];
  }
  xp.s = u.s;
  xp.sm = u.sm;
}

// --- where a kernel finds a unit's planes (matvec_blocks' XLoad with kPlanes) -------------------

// Records kPlaneBytes apart from P + off(c) (bytes), in global memory (GLOBAL: read through the
// read-only cache) or shared memory.
template <class Off, bool GLOBAL>
struct PlanesX {
  static constexpr bool kPlanes = true;
  const uint8_t* P;
  Off off;
  __device__ __forceinline__ void planes(int c, int64_t u, UnitPlanes& xp) const {
    const uint4* p = reinterpret_cast<const uint4*>(P + off(c) + kPlaneBytes * u);
    uint4 v[6];
#pragma unroll
    for (int i = 0; i < 6; ++i) v[i] = GLOBAL ? ds4_ldg(p + i) : p[i];
    const uint4 tail = GLOBAL ? ds4_ldg(p + 6) : p[6];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      xp.p0[4 * i] = v[i].x, xp.p0[4 * i + 1] = v[i].y, xp.p0[4 * i + 2] = v[i].z, xp.p0[4 * i + 3] = v[i].w;
      xp.p1[4 * i] = v[2 + i].x, xp.p1[4 * i + 1] = v[2 + i].y, xp.p1[4 * i + 2] = v[2 + i].z,
      xp.p1[4 * i + 3] = v[2 + i].w;
      xp.p2[4 * i] = v[4 + i].x, xp.p2[4 * i + 1] = v[4 + i].y, xp.p2[4 * i + 2] = v[4 + i].z,
      xp.p2[4 * i + 3] = v[4 + i].w;
    }
    xp.s256 = ds4_bits_to_float(tail.x);
    xp.sm = ds4_bits_to_float(tail.y);
    xp.s = ds4_bits_to_float(tail.z);
  }
  // Half h of unit xu of column c.
  __device__ __forceinline__ void half(int c, int64_t xu, int h, HalfPlanes& xp) const {
    load_half_planes<GLOBAL>(P + off(c) + kPlaneBytes * xu, h, xp);
  }
};

// Planes built by the lane from the float column at X + off(c) (elements): the prep kernel's
// arithmetic, one lane doing all 32 elements. For products with no planes buffer (the grouped
// Q8_0 product, whose X rows are only known on the device).
template <class Off>
struct LanePlanesX {
  static constexpr bool kPlanes = true;
  const float* X;
  Off off;
  __device__ __forceinline__ void planes(int c, int64_t u, UnitPlanes& xp) const {
    const float4* p = reinterpret_cast<const float4*>(X + off(c) + 32 * u);
    float4 v[8];
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = ds4_ldg(p + i);
      amax = max(amax, abs_bits_max(v[i]));
    }
    float s_inv;
    plane_scale(amax, &s_inv, &xp.s256, &xp.s);
    int32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m += plane_words(v[i], s_inv, &xp.p0[i], &xp.p1[i], &xp.p2[i]);
    xp.sm = plane_min_scale(xp.s, m);
  }
  __device__ __forceinline__ void half(int c, int64_t xu, int h, HalfPlanes& xp) const {
    UnitPlanes u;
    planes(c, xu, u);
    half_of(u, h, xp);
  }
};

// --- the prep kernel (x_planes_kernel, matvec.cu) ----------------------------------------------
//
// Column j of a call is column j % ncols of batch member j / ncols: floats at X + (j / ncols) *
// x_member + (j % ncols) * ldx, planes at P + j * ldp. kPlaneThreads threads a unit, each four
// elements: the unit's largest |x| by a shuffle over its 8 threads, then each thread writes its word
// of each plane, and the first the unit's tail. Bytes: 4 K in, 3.5 K out a column.
constexpr int kPlanesPrepThreads = 128;

// Thread w (0..7) of a unit's group holding the unit's elements 4w..4w+3 in v writes its part of the
// unit's record rec (live false: a thread past the column's end, which still takes part in the
// shuffles; its group's threads must all be live or all not). Every group of 8 consecutive lanes of
// a warp is one unit's. The prep kernel and the producers that write planes beside their output
// (unit_planes_of_row, swiglu) all build the record here, so the bytes are the same.
__device__ __forceinline__ void unit_planes_part(float4 v, int w, bool live, uint8_t* rec) {
  uint32_t amax = abs_bits_max(v);
#pragma unroll
  for (int o = 1; o < kPlaneThreads; o <<= 1) amax = max(amax, ds4_shfl_xor(amax, o));
  float s_inv, s256, s;
  plane_scale(amax, &s_inv, &s256, &s);
  uint32_t w0, w1, w2;
  int32_t m = plane_words(v, s_inv, &w0, &w1, &w2);
#pragma unroll
  for (int o = 1; o < kPlaneThreads; o <<= 1) m += ds4_shfl_xor(m, o);  // integers: any order
  if (live) {
    uint32_t* r = reinterpret_cast<uint32_t*>(rec);
    r[w] = w0;
    r[8 + w] = w1;
    r[16 + w] = w2;
    float* tail = reinterpret_cast<float*>(r) + kPlaneScaleOff / 4;
    if (w == 0) {
      tail[0] = s256;
      tail[1] = plane_min_scale(s, m);
      tail[2] = s;
      tail[3] = 0.0f;
    }
  }
}

// The planes of the row x (n elements, n % 32 == 0) into P (records kPlaneBytes apart), by the whole
// block (blockDim.x a multiple of 32; every thread must call it). For a kernel that has just
// written x itself: the caller's __syncthreads() before this makes those writes visible, and x is
// read with plain loads (never the read-only path, which may hold stale lines of it).
__device__ __forceinline__ void unit_planes_of_row(const float* x, int64_t n, uint8_t* P) {
  const int64_t threads = n / 32 * kPlaneThreads;
  for (int64_t t0 = 0; t0 < threads; t0 += blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const bool live = t < threads;
    const float4 v = live ? reinterpret_cast<const float4*>(x)[t] : make_float4(0.f, 0.f, 0.f, 0.f);
    unit_planes_part(v, static_cast<int>(t % kPlaneThreads), live, P + kPlaneBytes * (t / kPlaneThreads));
  }
}

// --- host side (matvec.cu) -----------------------------------------------------------------

// The integer Q8_0 products: on unless DS4_GPU_MV_INT8=0 or set_matvec_int8(false) (matvec_fused.h).
bool int8_on();

// Planes of a call's columns: column j at data + j * ldp. `owned`: a stream-ordered allocation this
// lease frees (in stream order) when it goes, where the caller's scratch had no room.
struct PlanesLease {
  const uint8_t* data = nullptr;
  int64_t ldp = 0;
  void* owned = nullptr;
  cudaStream_t stream = nullptr;
  PlanesLease() = default;
  PlanesLease(const PlanesLease&) = delete;
  PlanesLease& operator=(const PlanesLease&) = delete;
  PlanesLease(PlanesLease&& o) noexcept { *this = static_cast<PlanesLease&&>(o); }
  PlanesLease& operator=(PlanesLease&& o) noexcept;
  ~PlanesLease();
};

// The planes of n_batch x ncols columns of K elements (member i's column c at X + i * x_member + c *
// ldx): the given planes of X where scratch names them (the same X, ldx, K and shape), else the
// prep kernel's, into scratch's planes space when it has room.
PlanesLease prepare_planes(const float* X, int64_t ldx, int64_t x_member, int ncols, int n_batch, int64_t K,
                           const MatvecScratch& scratch, cudaStream_t stream);

}  // namespace ds4::gpu
