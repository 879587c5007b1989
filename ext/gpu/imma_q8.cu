// Tensor-core Q8_0 products for wide calls (prompt rows), bit for bit the SIMT integer path.
//
// What it computes: Y[c][r] = W[r] . X[c] for a Q8_0 matrix and the planes of X's columns
// (xplanes.cuh), with the arithmetic of matvec_blocks' integer Q8_0 path, which every SIMT kernel
// shares (direct, tall, staged, batched, multi, grouped). For row r and column c that is:
//
//   unit u (32 elements):  S1 = sum q p1, T = 2^8 S1 + sum q p0, S2 = sum q p2 (exact integers)
//                          f_u = fmaf(float(S2), 2^16, float(T))
//   lane l of k-slice s:   a[s][l] = fmaf(f_u, d_256(r,u) * s256(c,u), a[s][l]) over its units
//                          u = 32 (s + KS j) + l, j = 0, 1, ... in increasing order, from +0
//   each k-slice:          y_s = the butterfly of warp_sum over l (xor 16, 8, 4, 2, 1)
//   the row:               y = y_0 | y_0 + y_1 | (y_0 + y_1) + (y_2 + y_3)   (KS = 1, 2, 4)
//
// with KS = matvec_kslices(rows, units). Here the integer sums come from mma.sync
// m16n8k32.s8.s8.s32: A = 16 rows x one unit's 32 q, B = one unit's plane bytes x 8 columns. An
// integer sum is exact in any order, so S1, T and S2 are the dp4a chains' integers (T: the p1
// product, times 2^8, is the C operand of the p0 product; |T| < 2^28). Everything after them is
// the same float operations in the same order:
//
// - "Virtual lanes": unit u belongs to lane v = u % 32 of k-slice (u / 32) % KS. Warp w of the
//   block keeps the sums of v = w and v = w + 16 for every output of the block tile, each fed by
//   its own units in increasing order, so a[s][v] is the SIMT lane's register, operation for
//   operation. A unit past the row's end is skipped, as the SIMT lane skips it.
// - The butterfly: lane 0 of warp_sum ends with ((B0 + B4) + (B2 + B6)) + ((B1 + B5) + (B3 + B7)),
//   B_w = A_w + A_(w+8), A_w = a_w + a_(w+16) (every lane ends with those bits: float addition is
//   commutative). A warp forms its A_w in registers; the block adds the rest through shared memory
//   in that order.
// - K-slices one after another (a slice's chunks, then its sums), their y_s kept per output, added
//   at the end as the tree above.
//
// float(S2) is taken exactly (|S2| <= 2^18) by the exponent trick; float(T) is the I2F the SIMT
// path's static_cast gives (round to nearest even). So every output equals the SIMT kernels', and
// a column's bits depend on nothing else in the call (tests/gpu/test_gpu_imma.py checks both).
//
// Layout of the work: block (x, y, z) = rows [32x, 32x + 32) x columns [32y, 32y + 32) of member
// z (calls of at most 8 columns: rows [Hx, Hx + H) x 8 columns, H the narrow tile's height 64, 32
// or 16, NarrowTile); 16 warps (narrow: 16, 8 or 4), each all of the block's outputs (2 m-tiles x 4
// n-tiles; narrow H / 16 x 1) for its virtual lanes (2; narrow 2, 4 or 8). Per chunk of 32 units
// the block copies each of its rows' 1088 bytes (cp.async, two stages; narrow 2, 3 or 4) into
// shared memory; each warp reads the A fragments of its units from there and the B fragments (plane
// words) and scales straight from global memory (L1/L2: every row block reads them); the narrow
// tiles load them a chunk ahead (DS4_GPU_MV_IMMA_AHEAD), the wide one where they are used.
// Bytes it must move: the weights once per 32 columns (narrow: 8), the planes once per 32 rows
// (narrow: H) from L2, Y.
//
// The k order inside an mma is a free choice (integers): k-slots 4t..4t+3 hold the unit's elements
// 8t..8t+3 (plane word 2t) and k-slots 16+4t.. the elements 8t+4.. (word 2t+1), so a thread's B
// words are one 8-byte load and its A words 8 consecutive q bytes.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

#include "imma.h"
#include "imma.cuh"
#include "launch.cuh"
#include "matvec.cuh"
#include "matvec_fused.h"
#include "xplanes.cuh"

namespace ds4::gpu {

namespace {

std::atomic<int> g_imma{-1};          // -1: not read from the environment yet
std::atomic<int> g_imma_grouped{-1};  // the same for the grouped threshold
std::atomic<int> g_imma_narrow_rows{-1};  // the narrow tile's row threshold (-1: environment)
std::atomic<int> g_imma_ahead{-1};        // the narrow tile's planes a chunk ahead (-1: environment)
std::atomic<int> g_imma_persist{-1};      // the narrow tile's persistent grid (-1: environment)
std::atomic<int> g_imma_tile{-1};         // the narrow tile's height (-1: environment)
std::atomic<int64_t> g_imma_launches{0};  // launches so far (tests: the kernel did run)

constexpr int kImmaChunk = 32 * 34;          // a row's bytes of one chunk of 32 units
constexpr int kImmaPitch = kImmaChunk + 16;  // shared row pitch (spreads the banks)
constexpr int kImmaMaxSlices = 4;
constexpr int kSmPerSm = 233472;  // shared memory of an sm_90 SM, bytes (a block also takes 1 KB)

// A block's tile: MT m-tiles (16 rows) x NT n-tiles (8 columns), every warp all of it, WARPS warps
// (each the 32 / WARPS virtual lanes w, w + WARPS, ...) and NS copy stages. Wide calls take 32 x 32
// (2, 4; 16 warps, 2 stages); calls of at most 8 columns one of the narrow tiles (NarrowTile), so a
// decode step's few columns do not pay for 32.
template <int MT, int NT, int WARPS = 16, int NS = 2>
struct ImmaShape {
  static constexpr int kWarps = WARPS, kThreads = WARPS * DS4_WARP, kLanes = DS4_WARP / WARPS, kStages = NS;
  static constexpr int kRows = 16 * MT, kCols = 8 * NT, kOut = kRows * kCols;
  static constexpr int kPerThread = kOut / kThreads;  // outputs each thread adds up and stores
  static constexpr int kStage = kRows * kImmaPitch;   // one copy stage
  static constexpr int kRedPitch = kCols + 1;         // the sums' row pitch (floats; spreads the banks)
  static constexpr int kRed = kRows * kRedPitch;      // one slot of sums
  // Slots: 16 warps each leave A_w (lanes w, w + 16); fewer warps leave B_v, v < 8 (the butterfly).
  static constexpr int kRedSlots = WARPS == 16 ? 16 : 8;
  static constexpr int kSmem = NS * kStage + kRedSlots * kRed * 4;  // the stages, then the sums
  static constexpr int kBlocksPerSm = kSmPerSm / (kSmem + 1024) > 0 ? kSmPerSm / (kSmem + 1024) : 1;
  static_assert(WARPS == 16 || WARPS == 8 || WARPS == 4, "the butterfly below takes 16, 8 or 4 warps");
  static_assert(kOut % kThreads == 0, "every thread adds the same number of outputs");
  static_assert(NS >= 2 && NS <= 4, "2 to 4 copy stages");
};

#if defined(DS4_IMMA)

// The 8 q bytes 8t..8t+7 of the unit whose 34 bytes start at `unit` (shared, 2-byte aligned) as two
// words (q word 2t, 2t + 1), and its d_256 (Unit<kQ8_0>::set_scale).
__device__ __forceinline__ void unit_q(const uint8_t* unit, int t, uint32_t* lo, uint32_t* hi, float* d_256) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(unit) + 2 + 8 * t;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(at & ~static_cast<uintptr_t>(3));
  if (at & 2) {
    const uint32_t w0 = w[0], w1 = w[1], w2 = w[2];
    *lo = ds4_byte_perm(w0, w1, 0x5432u);
    *hi = ds4_byte_perm(w1, w2, 0x5432u);
  } else {
    *lo = w[0];
    *hi = w[1];
  }
  *d_256 = half_bits_to_float(*reinterpret_cast<const unsigned short*>(unit)) * 0.00390625f;
}

// One unit's B operand for one n-tile: the three plane words this thread holds (column g) and the
// unit scales s256 of its two C columns.
struct ImmaB {
  uint2 b0, b1, b2;
  float s256[2];
};

// AHEAD: each chunk's B operands are loaded into registers a chunk early (issued right after the
// previous chunk's mma work), so their L2 latency overlaps the barrier, the slice sums and the wait
// for the chunk's weights; else each is loaded just before its use. The same values, so the same
// bits; the narrow tiles only (NT = 1: 8 registers a virtual lane).
//
// The copy stream runs NS - 1 chunks ahead of the work: chunk i's copies are issued while chunk
// i - NS + 1 is worked on (two stages: the next chunk's alone).
template <int MT, int NT, bool AHEAD, int WARPS, int NS>
__global__ void __launch_bounds__(ImmaShape<MT, NT, WARPS, NS>::kThreads, ImmaShape<MT, NT, WARPS, NS>::kBlocksPerSm)
    imma_q8_kernel(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                   const uint8_t* __restrict__ P, int64_t ldp, int ncols, float* __restrict__ Y, int64_t ldy,
                   int64_t w_member, int64_t p_member, int64_t y_member, bool interleave) {
  using S = ImmaShape<MT, NT, WARPS, NS>;
  constexpr int L = S::kLanes;
  extern __shared__ __align__(16) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem + NS * S::kStage);
  const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
  const int g = lane >> 2, t = lane & 3;
  W += static_cast<int64_t>(blockIdx.z) * w_member;
  P += static_cast<int64_t>(blockIdx.z) * p_member;
  Y += static_cast<int64_t>(blockIdx.z) * y_member;
  // This block's row blocks: x, x + gridDim.x, ... (one, unless the narrow tile's grid is persistent:
  // then the copy stream runs on from one row block's last chunk into the next one's first).
  const int n_rb = static_cast<int>((rows + S::kRows - 1) / S::kRows);
  int rb = static_cast<int>(blockIdx.x);
  const int c0 = static_cast<int>(blockIdx.y) * S::kCols;

  // This thread's plane records (byte offsets from P, below 2^31: the launcher checks): B column
  // c0 + 8 nt + g, C columns c0 + 8 nt + 2t (+1); columns past the call read the last one (never
  // stored).
  uint32_t pb[NT], pc[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    pb[nt] = static_cast<uint32_t>(min(c0 + 8 * nt + g, ncols - 1) * ldp);
#pragma unroll
    for (int j = 0; j < 2; ++j) pc[nt][j] = static_cast<uint32_t>(min(c0 + 8 * nt + 2 * t + j, ncols - 1) * ldp);
  }

  const int64_t n_chunks = (units + 31) / 32;
  // Copy chunk q of row block rb_of's rows into stage `stage` (rows past the end re-read the last row).
  auto issue = [&](int rb_of, int64_t q, int stage) {
    const int64_t u0 = 32 * q, r0 = static_cast<int64_t>(rb_of) * S::kRows;
    const int nvec = static_cast<int>((units - u0 < 32 ? units - u0 : 32) * 34 / 16);
    const uint8_t* wq = W + u0 * 34;
    copy_runs<S::kThreads, kImmaChunk / 16>(smem + stage * S::kStage, kImmaPitch, S::kRows, nvec,
                                            [=](int r) { return wq + min(r0 + r, rows - 1) * row_bytes; });
    ds4_cp_async_commit();
  };
  // The work item after (rb_of, q_of): the row block's next chunk, else the next row block's first;
  // q_of -1 after the last.
  auto advance = [&](int& rb_of, int64_t& q_of) {
    const int64_t nq = chunk_after(q_of, ks, n_chunks);
    if (nq >= 0) {
      q_of = nq;
    } else {
      rb_of += static_cast<int>(gridDim.x);
      q_of = rb_of < n_rb ? 0 : -1;
    }
  };

  float acc[L][MT][NT][4];
  // Each k-slice's sum of this thread's outputs (slices without a chunk keep +0, as a SIMT warp
  // with no unit does).
  float ys[kImmaMaxSlices][S::kPerThread];
#pragma unroll
  for (int s = 0; s < kImmaMaxSlices; ++s)
#pragma unroll
    for (int j = 0; j < S::kPerThread; ++j) ys[s][j] = 0.0f;
  auto zero = [&] {
#pragma unroll
    for (int i = 0; i < L; ++i)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][mt][nt][e] = 0.0f;
  };

  // Unit u's B operand for n-tile nt (u < units).
  auto load_b = [&](int64_t u, int nt, ImmaB& b) {
    const uint8_t* rec = P + pb[nt] + kPlaneBytes * u;
    b.b0 = ds4_ldg(reinterpret_cast<const uint2*>(rec + 8 * t));
    b.b1 = ds4_ldg(reinterpret_cast<const uint2*>(rec + 32 + 8 * t));
    b.b2 = ds4_ldg(reinterpret_cast<const uint2*>(rec + 64 + 8 * t));
#pragma unroll
    for (int j = 0; j < 2; ++j)
      b.s256[j] = ds4_ldg(reinterpret_cast<const float*>(P + pc[nt][j] + kPlaneBytes * u + kPlaneScaleOff));
  };

  // Unit u (lane v of its chunk) into the sums a of one of this warp's virtual lanes; its B operands
  // are `ahead` (AHEAD) or loaded here, an n-tile at a time.
  auto apply = [&](const uint8_t* chunk, int v, int64_t u, const ImmaB (&ahead)[NT], float (&a)[MT][NT][4]) {
    uint32_t A[MT][4];
    float d[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* unit = chunk + (16 * mt + g + 8 * h) * kImmaPitch + 34 * v;
        uint32_t lo, hi;
        unit_q(unit, t, &lo, &hi, &d[mt][h]);
        A[mt][h] = lo;      // a0 / a1: rows g / g + 8, k-slots 4t..4t+3
        A[mt][2 + h] = hi;  // a2 / a3: k-slots 16 + 4t..
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      ImmaB bn;
      if constexpr (AHEAD) {
        bn = ahead[nt];
      } else {
        load_b(u, nt, bn);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int zero4[4] = {0, 0, 0, 0};
        int s1[4], tt[4], s2[4];
        mma_s8_k32(s1, A[mt], bn.b1.x, bn.b1.y, zero4);
#pragma unroll
        for (int e = 0; e < 4; ++e) s1[e] *= 256;
        mma_s8_k32(tt, A[mt], bn.b0.x, bn.b0.y, s1);
        mma_s8_k32(s2, A[mt], bn.b2.x, bn.b2.y, zero4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float f = fmaf(small_int_to_float(s2[e]), 65536.0f, static_cast<float>(tt[e]));
          a[mt][nt][e] = fmaf(f, d[mt][e >> 1] * bn.s256[e & 1], a[mt][nt][e]);
        }
      }
    }
  };

  // Row block rb_of's outputs from the k-slices' sums, which start again from +0.
  auto store = [&](int rb_of) {
#pragma unroll
    for (int j = 0; j < S::kPerThread; ++j) {
      const int o = static_cast<int>(threadIdx.x) + j * S::kThreads;
      const int64_t row = static_cast<int64_t>(rb_of) * S::kRows + o / S::kCols;
      const int col = c0 + o % S::kCols;
      const float y4[kImmaMaxSlices] = {ys[0][j], ys[1][j], ys[2][j], ys[3][j]};
      const float y = kslice_tree(y4, ks);
      if (row < rows && col < ncols) Y[static_cast<int64_t>(col) * ldy + row] = y;
#pragma unroll
      for (int s = 0; s < kImmaMaxSlices; ++s) ys[s][j] = 0.0f;
    }
  };

  // The first NS - 1 chunks' weights are in flight before the wait for the kernels that wrote the
  // planes (the fetch cursor frb, fq then points at the next chunk to copy).
  int frb = rb;
  int64_t fq = n_chunks > 0 ? 0 : -1;
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) {
    if (fq >= 0) {
      issue(frb, fq, s);
      advance(frb, fq);
    } else {
      ds4_cp_async_commit();  // an empty group keeps the count
    }
  }
  ds4_grid_begin();
  zero();
  // This warp's units of chunk q (virtual lanes warp, warp + WARPS, ...): their B operands.
  ImmaB bq[L][NT];
  auto load_chunk = [&](int64_t q, ImmaB (&b)[L][NT]) {
#pragma unroll
    for (int k = 0; k < L; ++k) {
      const int64_t u = 32 * q + warp + WARPS * k;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (u < units) load_b(u, nt, b[k][nt]);
    }
  };
  if (AHEAD && n_chunks > 0) load_chunk(0, bq);
  int stage = 0, fstage = NS - 1;
  for (int64_t q = n_chunks > 0 ? 0 : -1; q >= 0;) {
    const int64_t nq = chunk_after(q, ks, n_chunks);  // -1: the row block's last chunk
    const int nrb = nq >= 0 ? rb : rb + static_cast<int>(gridDim.x);
    const int64_t n_item = nq >= 0 ? nq : (nrb < n_rb ? 0 : -1);  // the next item worked
    // The copy NS - 1 items ahead into the stage worked last (free since the barrier that ended it),
    // then the wait until this item's copies have landed and every thread sees them.
    if (fq >= 0) {
      issue(frb, fq, fstage);
      advance(frb, fq);
    } else {
      ds4_cp_async_commit();
    }
    ds4_cp_async_wait<NS - 1>();
    __syncthreads();
    fstage = fstage + 1 == NS ? 0 : fstage + 1;
    const uint8_t* chunk = smem + stage * S::kStage;
    if (NT == 1 && interleave && 32 * q + 32 <= units) {
      // A whole chunk (narrow tiles): no branch between this warp's units, so their loads, mma and
      // sums interleave.
#pragma unroll
      for (int k = 0; k < L; ++k) apply(chunk, warp + WARPS * k, 32 * q + warp + WARPS * k, bq[k], acc[k]);
    } else {
#pragma unroll
      for (int k = 0; k < L; ++k) {
        const int v = warp + WARPS * k;
        const int64_t u = 32 * q + v;
        if (u < units) apply(chunk, v, u, bq[k], acc[k]);
      }
    }
    // The next chunk's operands, in flight over the barrier, the sums and the wait for its weights.
    if (AHEAD && n_item >= 0) load_chunk(n_item, bq);
    __syncthreads();  // the stage is free before it is filled again
    const int s_now = static_cast<int>(q % ks);
    if (nq < 0 || nq % ks != s_now) {
      // The slice's butterfly (B_v = A_v + A_(v+8), A_v = a_v + a_(v+16): butterfly_of_eight): what
      // a warp holds in registers, the rest through shared memory.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * mt + g + 8 * (e >> 1), col = 8 * nt + 2 * t + (e & 1);
            const int at = row * S::kRedPitch + col;
            if constexpr (WARPS == 16) {
              red[warp * S::kRed + at] = acc[0][mt][nt][e] + acc[1][mt][nt][e];  // A_w
            } else {
              // v = warp + WARPS j < 8 holds slot j; v + 8, v + 16, v + 24 slots j + 8 / WARPS, ...
#pragma unroll
              for (int j = 0; j < 8 / WARPS; ++j) {
                const float a_v = acc[j][mt][nt][e] + acc[j + 16 / WARPS][mt][nt][e];
                const float a_v8 = acc[j + 8 / WARPS][mt][nt][e] + acc[j + 24 / WARPS][mt][nt][e];
                red[(warp + WARPS * j) * S::kRed + at] = a_v + a_v8;
              }
            }
          }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < S::kPerThread; ++j) {
        const int o = static_cast<int>(threadIdx.x) + j * S::kThreads;
        const int at = (o / S::kCols) * S::kRedPitch + o % S::kCols;
        float b[8];
#pragma unroll
        for (int w = 0; w < 8; ++w)
          b[w] = WARPS == 16 ? red[w * S::kRed + at] + red[(w + 8) * S::kRed + at] : red[w * S::kRed + at];
        const float y = butterfly_of_eight(b);
#pragma unroll
        for (int s = 0; s < kImmaMaxSlices; ++s)
          if (s == s_now) ys[s][j] = y;
      }
      __syncthreads();
      zero();
    }
    if (nq < 0) store(rb);
    rb = nrb;
    q = n_item;
    stage = stage + 1 == NS ? 0 : stage + 1;
  }
  for (; n_chunks == 0 && rb < n_rb; rb += static_cast<int>(gridDim.x)) store(rb);  // no units: every output +0
}

// The narrow tiles by height (imma.h, matvec_imma_tile): 64 rows (16 warps, 2 stages, one block an
// SM), 32 (8 warps, 3 stages, 2 blocks an SM), 16 (4 warps, 4 stages, 3 blocks an SM).
template <int ROWS>
struct NarrowTile;
template <>
struct NarrowTile<64> {
  using S = ImmaShape<4, 1, 16, 2>;
};
template <>
struct NarrowTile<32> {
  using S = ImmaShape<2, 1, 8, 3>;
};
template <>
struct NarrowTile<16> {
  using S = ImmaShape<1, 1, 4, 4>;
};

// The kernel of tile S.
template <class S, bool AHEAD>
constexpr auto kernel_of() {
  return imma_q8_kernel<S::kRows / 16, S::kCols / 8, AHEAD, S::kWarps, S::kStages>;
}

// Raise tile S's kernels' shared-memory limit; false where the device refuses.
template <class S>
bool allow_smem() {
  return cudaFuncSetAttribute(kernel_of<S, false>(), cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem) ==
             cudaSuccess &&
         cudaFuncSetAttribute(kernel_of<S, true>(), cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem) ==
             cudaSuccess;
}

#endif  // DS4_IMMA

}  // namespace

void set_matvec_imma(int min_cols) {
  if (min_cols < -1) throw std::invalid_argument("set_matvec_imma: min_cols must be >= 0 (0: off; -1: the default)");
  g_imma.store(min_cols, std::memory_order_relaxed);
}

// A threshold switch: read from the environment (name) on first use, default `fallback`.
static int threshold_now(std::atomic<int>& state, const char* name, int fallback) {
  int v = state.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv(name);
    v = (e == nullptr || *e == 0) ? fallback : std::max(0, std::atoi(e));
    state.store(v, std::memory_order_relaxed);
  }
  return v;
}

int matvec_imma() { return threshold_now(g_imma, "DS4_GPU_MV_IMMA", kImmaDefaultCols); }

void set_matvec_imma_grouped(int min_pairs_per_expert) {
  if (min_pairs_per_expert < -1)
    throw std::invalid_argument("set_matvec_imma_grouped: min_pairs_per_expert must be >= 0 (0: off; -1: the default)");
  g_imma_grouped.store(min_pairs_per_expert, std::memory_order_relaxed);
}

int matvec_imma_grouped() { return threshold_now(g_imma_grouped, "DS4_GPU_MV_IMMA_GROUPED", kImmaDefaultPairs); }

void set_matvec_imma_narrow(int min_rows, int ahead, int persist) {
  if (min_rows < -1) throw std::invalid_argument("set_matvec_imma_narrow: min_rows must be >= 0 (-1: the default)");
  if (ahead < -1 || ahead > 1 || persist < -1 || persist > 1)
    throw std::invalid_argument("set_matvec_imma_narrow: ahead and persist must be 0, 1 or -1");
  g_imma_narrow_rows.store(min_rows, std::memory_order_relaxed);
  g_imma_ahead.store(ahead, std::memory_order_relaxed);
  g_imma_persist.store(persist, std::memory_order_relaxed);
}

int matvec_imma_narrow_rows() {
  return threshold_now(g_imma_narrow_rows, "DS4_GPU_MV_IMMA_NARROW_ROWS", kImmaDefaultNarrowRows);
}

bool matvec_imma_ahead() { return env_switch(g_imma_ahead, "DS4_GPU_MV_IMMA_AHEAD"); }

bool matvec_imma_persist() { return env_switch(g_imma_persist, "DS4_GPU_MV_IMMA_PERSIST"); }

// Pass 15 experiment: a whole chunk's units without a branch between them (DS4_GPU_MV_IMMA_ILP=0:
// one at a time, as before). Read once; the same bits either way.
static bool imma_interleave() {
  static const bool on = [] {
    const char* e = std::getenv("DS4_GPU_MV_IMMA_ILP");
    return e == nullptr || *e == 0 || std::atoi(e) != 0;
  }();
  return on;
}

static bool tile_known(int rows) { return rows == 16 || rows == 32 || rows == 64; }

void set_matvec_imma_tile(int rows) {
  if (rows != -1 && !tile_known(rows))
    throw std::invalid_argument("set_matvec_imma_tile: rows must be 16, 32 or 64 (-1: the default)");
  g_imma_tile.store(rows, std::memory_order_relaxed);
}

int matvec_imma_tile() {
  int v = g_imma_tile.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* e = std::getenv("DS4_GPU_MV_IMMA_TILE");
    v = e != nullptr && tile_known(std::atoi(e)) ? std::atoi(e) : kImmaDefaultTile;
    g_imma_tile.store(v, std::memory_order_relaxed);
  }
  return v;
}

void imma_count_launch() { g_imma_launches.fetch_add(1, std::memory_order_relaxed); }

bool imma_prepare() {
#if defined(DS4_IMMA)
  static const bool ready = [] {
    const bool wide = cudaFuncSetAttribute(kernel_of<ImmaShape<2, 4>, false>(),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           ImmaShape<2, 4>::kSmem) == cudaSuccess;
    const bool narrow = allow_smem<NarrowTile<64>::S>() && allow_smem<NarrowTile<32>::S>() &&
                        allow_smem<NarrowTile<16>::S>();
    (void)cudaGetLastError();
    return wide && narrow;
  }();
  (void)imma_q4k_prepare();
  return ready;
#else
  return false;
#endif
}

namespace testing {
int set_matvec_imma(int min_cols) {
  ds4::gpu::set_matvec_imma(min_cols);
  return matvec_imma();
}
int set_matvec_imma_grouped(int min_pairs_per_expert) {
  ds4::gpu::set_matvec_imma_grouped(min_pairs_per_expert);
  return matvec_imma_grouped();
}
int set_matvec_imma_narrow(int min_rows, int ahead, int persist) {
  ds4::gpu::set_matvec_imma_narrow(min_rows, ahead, persist);
  return matvec_imma_narrow_rows() * 4 + (matvec_imma_persist() ? 2 : 0) + (matvec_imma_ahead() ? 1 : 0);
}
int set_matvec_imma_tile(int rows) {
  ds4::gpu::set_matvec_imma_tile(rows);
  return matvec_imma_tile();
}
int64_t imma_launches() { return g_imma_launches.load(std::memory_order_relaxed); }
}  // namespace testing

bool imma_q8_matvec(const TensorView& W, int64_t units, int n_batch, int64_t w_member, const uint8_t* P,
                    int64_t ldp, int ncols, float* Y, int64_t y_member, int64_t ldy, cudaStream_t stream) {
#if defined(DS4_IMMA)
  const int min_cols = matvec_imma();
  if (min_cols == 0 || ncols < min_cols || W.type != DType::Q8_0 || !cuda_sm90()) return false;
  // The 16-byte copies: whole vectors a chunk (units a multiple of 8), rows and members 16-byte aligned.
  if (units % 8 != 0 || W.row_bytes() % 16 != 0 || w_member % 16 != 0 ||
      reinterpret_cast<uintptr_t>(W.data) % 16 != 0 || ldp % 8 != 0 || reinterpret_cast<uintptr_t>(P) % 8 != 0 ||
      static_cast<int64_t>(ncols) * ldp >= (int64_t{1} << 31))
    return false;
  const int64_t rows = W.ne[1];
  // A narrow call (decode widths) has a block per tile height of rows of each member: too few row
  // blocks leave SMs idle, so it may ask for a least height (DS4_GPU_MV_IMMA_NARROW_ROWS).
  if (ncols <= 8 && rows * n_batch < matvec_imma_narrow_rows()) return false;
  const int ks = matvec_kslices(rows, units);
  if (!imma_prepare()) return false;
  // The tile by width (the bits never depend on it): a narrow tile (x 8 columns) up to 8 columns,
  // 32 x 32 from 9.
  auto go = [&](auto shape, auto ahead) {
    using S = decltype(shape);
    // The narrow tile of one member with more row blocks than its blocks fill the SMs with: that many
    // blocks (their shared memory allows no more), each walking row blocks x, x + grid, ...
    const int64_t n_rb = (rows + S::kRows - 1) / S::kRows;
    const int64_t resident = static_cast<int64_t>(device_sms()) * S::kBlocksPerSm;
    const bool persist = ncols <= 8 && n_batch == 1 && resident > 0 && n_rb > resident && matvec_imma_persist();
    const dim3 grid(static_cast<unsigned>(persist ? resident : n_rb),
                    static_cast<unsigned>((ncols + S::kCols - 1) / S::kCols), static_cast<unsigned>(n_batch));
    launch(kernel_of<S, decltype(ahead)::value>(), grid, S::kThreads, S::kSmem, stream, W.data, W.row_bytes(), rows,
           units, ks, P, ldp, ncols, Y, ldy, w_member, static_cast<int64_t>(ncols) * ldp, y_member,
           imma_interleave());
  };
  auto narrow = [&](auto shape) {
    if (matvec_imma_ahead()) {
      go(shape, std::true_type{});
    } else {
      go(shape, std::false_type{});
    }
  };
  if (ncols > 8) {
    go(ImmaShape<2, 4>{}, std::false_type{});
  } else if (matvec_imma_tile() == 16) {
    narrow(NarrowTile<16>::S{});
  } else if (matvec_imma_tile() == 32) {
    narrow(NarrowTile<32>::S{});
  } else {
    narrow(NarrowTile<64>::S{});
  }
  DS4_GPU_CHECK_LAUNCH("imma_q8_kernel");
  imma_count_launch();
  return true;
#else
  (void)W, (void)units, (void)n_batch, (void)w_member, (void)P, (void)ldp, (void)ncols, (void)Y, (void)y_member,
      (void)ldy, (void)stream;
  return false;
#endif
}

}  // namespace ds4::gpu
