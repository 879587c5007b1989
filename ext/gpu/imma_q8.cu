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
// z (calls of at most 8 columns: rows [64x, 64x + 64) x 8 columns, ImmaShape); 16 warps, each all
// 32 x 32 outputs (2 m-tiles x 4 n-tiles; or 4 x 1) for its two virtual lanes. Per chunk of 32
// units the block copies each of its rows' 1088 bytes (cp.async, two stages) into shared memory;
// each warp reads the A fragments of its units from there and the B fragments (plane words) and
// scales straight from global memory (L1/L2: every row block reads them); the narrow tile loads
// them a chunk ahead (DS4_GPU_MV_IMMA_AHEAD), the wide one where they are used.
// Bytes it must move: the weights once per 32 columns, the planes once per 32 rows (from L2), Y.
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
std::atomic<int> g_imma_bulk{-1};         // the weights by the bulk copy engine (-1: environment)
std::atomic<int> g_imma_indep{kImmaIndepDefault};  // which tiles take independent MMAs (imma.h mask)
std::atomic<int64_t> g_imma_launches[kImmaPaths] = {};  // launches so far a path (tests: the kernel did run)

constexpr int kImmaWarps = 16;
constexpr int kImmaThreads = kImmaWarps * DS4_WARP;
constexpr int kImmaChunk = 32 * 34;          // a row's bytes of one chunk of 32 units
constexpr int kImmaPitch = kImmaChunk + 16;  // shared row pitch (spreads the banks)
constexpr int kImmaMaxSlices = 4;
static_assert(kImmaWarps == 16, "the butterfly below takes lanes w and w + 16 a warp");

// A block's tile: MT m-tiles (16 rows) x NT n-tiles (8 columns), every warp all of it. Wide calls
// take 32 x 32 (2, 4); calls of at most 8 columns 64 x 8 (4, 1), so a decode step's few columns do
// not pay for 32.
template <int MT, int NT>
struct ImmaShape {
  static constexpr int kRows = 16 * MT, kCols = 8 * NT, kOut = kRows * kCols;
  static constexpr int kStage = kRows * kImmaPitch;  // one copy stage
  static constexpr int kRed = SumsLayout<kRows, kCols>::kFloats;  // one warp's slice sums (floats)
  static constexpr int kSmem = 2 * kStage + kImmaWarps * kRed * 4;  // two stages, then the sums
  static_assert(kOut % kImmaThreads == 0, "every thread adds the same number of outputs");
};

#if defined(DS4_IMMA)

// The 8 q bytes 8t..8t+7 of lane v's unit, whose 34 bytes start at `unit` (shared memory), as two
// words (q word 2t, 2t + 1), and its d_256 (Unit<kQ8_0>::set_scale). A stage and a row pitch are
// multiples of 4 bytes, so the q bytes start on a 4-byte boundary for v odd (34 v = 2 mod 4) and 2
// bytes past one for v even: three aligned words, their bytes picked by v's parity. Plain offsets
// from the shared pointer: casting it to an integer had made every read a generic load with 64-bit
// address arithmetic.
__device__ __forceinline__ void unit_q(const uint8_t* unit, int v, int t, uint32_t* lo, uint32_t* hi, float* d_256) {
  const int odd = v & 1;
  // Reading w[2] stays inside the row's pitch (the last unit's third word ends at byte 34 * 31 + 38).
  const uint32_t* w = reinterpret_cast<const uint32_t*>(unit + 8 * t + 2 * odd);
  const uint32_t sel = odd ? 0x3210u : 0x5432u, w0 = w[0], w1 = w[1], w2 = w[2];
  *lo = ds4_byte_perm(w0, w1, sel);
  *hi = ds4_byte_perm(w1, w2, sel);
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
// bits; the narrow tile only (NT = 1: 16 registers).
// BULK: the weights by the bulk copy engine (imma.cuh bulk_rows; sm_90, DS4_GPU_MV_IMMA_BULK), else
// by cp.async (copy_runs). The same bytes in the same places, so the same bits.
// INDEP: a unit's three MMAs independent of each other (imma.cuh plane_sums; the same integers).
template <int MT, int NT, bool AHEAD, bool BULK, bool INDEP = false>
__global__ void __launch_bounds__(kImmaThreads, 1)
    imma_q8_kernel(const uint8_t* __restrict__ W, int64_t row_bytes, int64_t rows, int64_t units, int ks,
                   const uint8_t* __restrict__ P, int64_t ldp, int ncols, float* __restrict__ Y, int64_t ldy,
                   int64_t w_member, int64_t p_member, int64_t y_member) {
  using S = ImmaShape<MT, NT>;
  using L = SumsLayout<S::kRows, S::kCols>;
  extern __shared__ __align__(16) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem + 2 * S::kStage);
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
#if defined(DS4_IMMA_BULK)
  __shared__ uint64_t bulk_bar[2];  // a barrier a stage
  unsigned bulk_phase = 0;          // bit s: the parity of stage s's next phase
  if constexpr (BULK) {
    bulk_init(bulk_bar, 2);
    __syncthreads();
  }
#endif
  // Copy chunk q of the block's rows into stage `stage` (rows past the end re-read the last row).
  auto issue = [&](int rb_of, int64_t q, int stage) {
    const int64_t u0 = 32 * q;
    const int r0 = rb_of * S::kRows, last = static_cast<int>(rows) - 1;  // rows < 2^31, as n_rb
    const int nvec = static_cast<int>((units - u0 < 32 ? units - u0 : 32) * 34 / 16);
    const uint8_t* wq = W + u0 * 34;
    auto src = [=](int r) { return wq + static_cast<int64_t>(min(r0 + r, last)) * row_bytes; };
#if defined(DS4_IMMA_BULK)
    if constexpr (BULK) {
      bulk_rows<kImmaThreads>(smem + stage * S::kStage, kImmaPitch, S::kRows, 16 * nvec, src, bulk_bar + stage);
    } else
#endif
    {
      copy_runs<kImmaThreads, kImmaChunk / 16>(smem + stage * S::kStage, kImmaPitch, S::kRows, nvec, src);
      ds4_cp_async_commit();
    }
  };

  float acc[2][MT][NT][4];
  // Each k-slice's sum of this thread's outputs (slices without a chunk keep +0, as a SIMT warp
  // with no unit does).
  float ys[kImmaMaxSlices][S::kOut / kImmaThreads];
#pragma unroll
  for (int s = 0; s < kImmaMaxSlices; ++s)
#pragma unroll
    for (int j = 0; j < S::kOut / kImmaThreads; ++j) ys[s][j] = 0.0f;
  auto zero = [&] {
#pragma unroll
    for (int i = 0; i < 2; ++i)
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
        unit_q(unit, v, t, &lo, &hi, &d[mt][h]);
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
      const uint32_t b[3][2] = {{bn.b0.x, bn.b0.y}, {bn.b1.x, bn.b1.y}, {bn.b2.x, bn.b2.y}};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        int tt[4], s2[4];
        plane_sums<INDEP>(tt, s2, A[mt], b);
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
    for (int j = 0; j < S::kOut / kImmaThreads; ++j) {
      const int o = static_cast<int>(threadIdx.x) + j * kImmaThreads;
      const int64_t row = static_cast<int64_t>(rb_of) * S::kRows + o % S::kRows;
      const int col = c0 + o / S::kRows;
      const float y4[kImmaMaxSlices] = {ys[0][j], ys[1][j], ys[2][j], ys[3][j]};
      const float y = kslice_tree(y4, ks);
      if (row < rows && col < ncols) Y[static_cast<int64_t>(col) * ldy + row] = y;
#pragma unroll
      for (int s = 0; s < kImmaMaxSlices; ++s) ys[s][j] = 0.0f;
    }
  };

  // The first weights are in flight before the wait for the kernels that wrote the planes.
  if (n_chunks > 0) issue(rb, 0, 0);
  ds4_grid_begin();
  zero();
  // This warp's two units of chunk q (virtual lanes warp and warp + 16): their B operands.
  ImmaB bq[2][NT];
  auto load_chunk = [&](int64_t q, ImmaB (&b)[2][NT]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t u = 32 * q + warp + 16 * k;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (u < units) load_b(u, nt, b[k][nt]);
    }
  };
  if (AHEAD && n_chunks > 0) load_chunk(0, bq);
  int stage = 0;
  for (int64_t q = n_chunks > 0 ? 0 : -1; q >= 0;) {
    const int64_t nq = chunk_after(q, ks, n_chunks);  // -1: the row block's last chunk
    // The next copy: the row block's next chunk, else the next row block's first (if any).
    const int nrb = nq >= 0 ? rb : rb + static_cast<int>(gridDim.x);
    const int64_t n_item = nq >= 0 ? nq : (nrb < n_rb ? 0 : -1);
#if defined(DS4_IMMA_BULK)
    if constexpr (BULK) {
      if (n_item >= 0) issue(nrb, n_item, stage ^ 1);
      bulk_wait_stage(bulk_bar, bulk_phase, stage);
    } else
#endif
    {
      next_stage(n_item, stage, [&](int64_t q_of, int st) { issue(nrb, q_of, st); });
    }
    const uint8_t* chunk = smem + stage * S::kStage;
    if (NT == 1 && 32 * q + 32 <= units) {
      // A whole chunk (the narrow tile): no branch between this warp's two units, so their loads, mma
      // and sums interleave (pass 15, call 2: decode C = 6-8 +2-4%; the wide tile would spill).
#pragma unroll
      for (int k = 0; k < 2; ++k) apply(chunk, warp + 16 * k, 32 * q + warp + 16 * k, bq[k], acc[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int v = warp + 16 * k;
        const int64_t u = 32 * q + v;
        if (u < units) apply(chunk, v, u, bq[k], acc[k]);
      }
    }
    // The next chunk's operands, in flight over the barrier, the sums and the wait for its weights.
    if (AHEAD && n_item >= 0) load_chunk(n_item, bq);
    __syncthreads();  // the stage is free before it is filled again
    const int s_now = slice_of(q, ks);
    if (nq < 0 || slice_of(nq, ks) != s_now) {
      // The slice's butterfly: A_w in registers, the rest through shared memory.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * mt + g + 8 * (e >> 1), col = 8 * nt + 2 * t + (e & 1);
            red[warp * S::kRed + L::at(row, col)] = acc[0][mt][nt][e] + acc[1][mt][nt][e];
          }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < S::kOut / kImmaThreads; ++j) {
        // Output o is row o % kRows of column o / kRows: a warp's stores are 32 consecutive rows of one
        // column of Y (one 128-byte line), and its reads here 32 rows of one column of the sums (no
        // bank conflict). Pass 22: o had run along a row, so a warp's 32 stores went to 32 lines.
        const int o = static_cast<int>(threadIdx.x) + j * kImmaThreads;
        const int at = L::at(o % S::kRows, o / S::kRows);
        float b[8];
#pragma unroll
        for (int w = 0; w < 8; ++w) b[w] = red[w * S::kRed + at] + red[(w + 8) * S::kRed + at];
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
    stage ^= 1;
  }
  for (; n_chunks == 0 && rb < n_rb; rb += static_cast<int>(gridDim.x)) store(rb);  // no units: every output +0
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

void set_matvec_imma_indep(int mask) {
  if (mask < -1 || mask > (kImmaIndepQ8 | kImmaIndepQ4k | kImmaIndepNarrow))
    throw std::invalid_argument("set_matvec_imma_indep: mask must be 0..7 (1 the wide Q8_0 tile, 2 the grouped Q4_K "
                                "kernel, 4 the narrow Q8_0 tile) or -1");
  g_imma_indep.store(mask < 0 ? kImmaIndepDefault : mask, std::memory_order_relaxed);
}

int matvec_imma_indep() { return g_imma_indep.load(std::memory_order_relaxed); }
// DS4_GPU_MV_IMMA_BULK=0: the Q8_0 tiles and the grouped Q4_K kernel copy by cp.async (read once a
// process; the same bits either way, so not part of the graph key).
bool matvec_imma_bulk() { return env_switch(g_imma_bulk, "DS4_GPU_MV_IMMA_BULK"); }

void imma_count_launch(ImmaPath path) { g_imma_launches[path].fetch_add(1, std::memory_order_relaxed); }

bool imma_prepare() {
#if defined(DS4_IMMA)
  static const bool ready = [] {
    auto smem = [](auto kernel, int bytes) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) == cudaSuccess;
    };
    auto both = [&](auto bulk) {
      constexpr bool B = decltype(bulk)::value;
      return smem(imma_q8_kernel<2, 4, false, B>, ImmaShape<2, 4>::kSmem) &&
             smem(imma_q8_kernel<2, 4, false, B, true>, ImmaShape<2, 4>::kSmem) &&
             smem(imma_q8_kernel<4, 1, false, B>, ImmaShape<4, 1>::kSmem) &&
             smem(imma_q8_kernel<4, 1, true, B>, ImmaShape<4, 1>::kSmem) &&
             smem(imma_q8_kernel<4, 1, false, B, true>, ImmaShape<4, 1>::kSmem) &&
             smem(imma_q8_kernel<4, 1, true, B, true>, ImmaShape<4, 1>::kSmem);
    };
    const bool ok = both(std::false_type{}) && both(std::true_type{});
    (void)cudaGetLastError();
    return ok;
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
int set_matvec_imma_indep(int mask) {
  ds4::gpu::set_matvec_imma_indep(mask);
  return matvec_imma_indep();
}
int64_t imma_launches(int path) {
  if (path < -1 || path >= kImmaPaths)
    throw std::invalid_argument("imma_launches: path must be -1 (all) or one of imma.h's ImmaPath values");
  if (path >= 0) return g_imma_launches[path].load(std::memory_order_relaxed);
  int64_t n = 0;
  for (const auto& c : g_imma_launches) n += c.load(std::memory_order_relaxed);
  return n;
}
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
  // A narrow call (the 64 x 8 tile: decode widths) has a block per 64 rows of each member: too few
  // row blocks leave SMs idle, so it may ask for a least height (DS4_GPU_MV_IMMA_NARROW_ROWS).
  if (ncols <= 8 && rows * n_batch < matvec_imma_narrow_rows()) return false;
  const int ks = matvec_kslices(rows, units);
  if (!imma_prepare()) return false;
  // The tile by width (the bits never depend on it): 64 x 8 up to 8 columns, 32 x 32 from 9.
  auto go = [&](auto kernel, auto shape) {
    using S = decltype(shape);
    // The narrow tile of one member with more row blocks than SMs: one block an SM (its shared memory
    // allows no second), each walking row blocks x, x + grid, ...
    const int64_t n_rb = (rows + S::kRows - 1) / S::kRows;
    const int sms = device_sms();
    const bool persist = ncols <= 8 && n_batch == 1 && sms > 0 && n_rb > sms && matvec_imma_persist();
    const dim3 grid(static_cast<unsigned>(persist ? sms : n_rb),
                    static_cast<unsigned>((ncols + S::kCols - 1) / S::kCols), static_cast<unsigned>(n_batch));
    launch(kernel, grid, kImmaThreads, S::kSmem, stream, W.data, W.row_bytes(), rows, units, ks, P, ldp, ncols, Y, ldy,
           w_member, static_cast<int64_t>(ncols) * ldp, y_member);
  };
  auto pick = [&](auto bulk) {
    constexpr bool B = decltype(bulk)::value;
    const int indep = matvec_imma_indep();
    auto narrow = [&](auto ahead) {
      constexpr bool A = decltype(ahead)::value;
      if ((indep & kImmaIndepNarrow) != 0) {
        go(imma_q8_kernel<4, 1, A, B, true>, ImmaShape<4, 1>{});
      } else {
        go(imma_q8_kernel<4, 1, A, B>, ImmaShape<4, 1>{});
      }
    };
    if (ncols > 8 && (indep & kImmaIndepQ8) != 0) {
      go(imma_q8_kernel<2, 4, false, B, true>, ImmaShape<2, 4>{});
    } else if (ncols > 8) {
      go(imma_q8_kernel<2, 4, false, B>, ImmaShape<2, 4>{});
    } else if (matvec_imma_ahead()) {
      narrow(std::true_type{});
    } else {
      narrow(std::false_type{});
    }
  };
  const bool bulk = matvec_imma_bulk();
  if (bulk) {
    pick(std::true_type{});
  } else {
    pick(std::false_type{});
  }
  DS4_GPU_CHECK_LAUNCH("imma_q8_kernel");
  imma_count_launch(bulk ? kImmaQ8Bulk : kImmaQ8CpAsync);
  return true;
#else
  (void)W, (void)units, (void)n_batch, (void)w_member, (void)P, (void)ldp, (void)ncols, (void)Y, (void)y_member,
      (void)ldy, (void)stream;
  return false;
#endif
}

}  // namespace ds4::gpu
