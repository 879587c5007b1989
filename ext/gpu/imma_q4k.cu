// Tensor-core expert-grouped Q4_K products for steps of many rows (prompts), bit for bit the SIMT
// integer path.
//
// What it computes: matvec_grouped's product (matvec.cuh): for each part p (expert e, pairs
// sorted_pairs[first .. first + count), count <= 8) and each of its pairs j, Y[j] = W[e] . X[x_row[j]],
// from X's planes (xplanes.cuh), with the arithmetic every SIMT grouped kernel shares (and the dense
// one: a pair equals its expert's product on its column alone). For row r and column c:
//
//   unit u (16 quant bytes: the low nibbles are half h of sub-block 2c' of a 256-block, the high
//   nibbles half h of sub-block 2c' + 1; Unit<kQ4_K>) belongs to lane u % 32, which sums sub-block
//   2c' + h whole (its partner lane holds the other half; xplanes.cuh q4k_pair_sum):
//     S1 = sum q p1, T = 2^8 S1 + sum q p0, S2 = sum q p2 over the sub-block's 32 elements against
//     its X unit's planes, F = 2^16 S2 + T (exact), s and sM = s float(M) from the unit's record,
//     acc = fmaf(dl s, float(F), fmaf(-ml, sM, acc))     (q4k_sub_block)
//   lanes, k-slices and their sums as in imma_q8.cu (lane u % 32 of slice (u / 32) % KS, units in
//   increasing order; the butterfly; the k-slice tree).
//
// The integer sums come from mma.sync m16n8k32.s8 (A = 16 rows x a sub-block's 32 nibbles as bytes,
// B = its X unit's plane bytes x the part's 8 columns), three a sub-block; everything after them is
// the SIMT lane's float operations in its order, so every pair's bits equal the SIMT kernels'
// (tests/gpu/test_gpu_imma.py). Virtual lanes: warp w of 8 keeps lanes w, w + 8, w + 16 and w + 24,
// so it forms B_w = (a_w + a_(w+16)) + (a_(w+8) + a_(w+24)) in registers; the block adds the eight
// B_w through shared memory in the butterfly's order.
//
// Layout of the work: block (x, y) = rows [32x, 32x + 32) of parts y, y + gridDim.y, ..., 8 warps of
// 32 threads, one n-tile of a part's (up to) 8 pairs. Per chunk of 32 units (four 144-byte blocks a
// row) the block copies its rows' 576 bytes and the part's columns' planes of the chunk's 32 X units
// (bulk copies, one a row or column, or cp.async; two stages: the next chunk is in flight meanwhile)
// into shared memory, then decodes
// the chunk's (dl, ml) pairs once (q4k_unit_scales) for all warps. Warp w is lane w's unit position
// (w >> 1) & 3 = c', w & 1 = h of each of the four blocks: the nibbles (low for h = 0, high for
// h = 1) of all 32 quant bytes of group c', which are sub-block 2c' + h. Bytes it must move: each
// part's expert rows once, the planes of its columns once per 32 rows (L2), Y.
#include <algorithm>
#include <atomic>

#include "imma.cuh"
#include "imma.h"
#include "launch.cuh"
#include "matvec.cuh"
#include "matvec_fused.h"
#include "xplanes.cuh"

namespace ds4::gpu {

namespace {

constexpr int kGqWarps = 8;
constexpr int kGqThreads = kGqWarps * DS4_WARP;
constexpr int kGqMT = 2;                      // m-tiles of 16 rows a warp
constexpr int kGqRows = 16 * kGqMT;           // rows a block
constexpr int kGqCols = 8;                    // one n-tile: a part's pairs
constexpr int kGqChunk = 4 * 144;             // a row's bytes of 32 units
constexpr int kGqPitch = kGqChunk + 16;       // shared row pitch (spreads the banks)
constexpr int kGqStage = kGqRows * kGqPitch;  // one copy stage
constexpr int kGqOut = kGqRows * kGqCols;
constexpr int kGqRed = SumsLayout<kGqRows, kGqCols>::kFloats;  // one warp's slice sums (floats)
constexpr int kGqRedBytes = kGqWarps * kGqRed * 4;
constexpr int kGqPlanePitch = 32 * kPlaneBytes + 16;   // a column's 32 records (padded: banks)
constexpr int kGqPlaneStage = kGqCols * kGqPlanePitch;  // the part's planes of one chunk
// Two weight stages, the sums (and scales), two planes stages: ~102 KB, two blocks an SM.
constexpr int kGqSmem = 2 * kGqStage + kGqRedBytes + 2 * kGqPlaneStage;
constexpr int kGqScalePitch = 17;  // float4 entries a row of a chunk's scales (16, padded: banks)
static_assert(kGqRows * kGqScalePitch * 16 <= kGqWarps * kGqRed * 4, "the scales fit the sums' space");
constexpr int kGqMaxSlices = 4;
constexpr int64_t kImmaGroupedMinExperts = 128;  // imma_q4k_takes counts at least this many experts
static_assert(kGqOut == kGqThreads, "a thread stores one output");
static_assert(kGqRows * 4 == kGqThreads / 2, "warps 4-7 decode a chunk's scales, a thread a (row, block)");
static_assert(kGqCols == kMaxPartCols, "one n-tile holds a whole part");

#if defined(DS4_IMMA)

// BULK: each stage's weight rows and plane runs by the bulk copy engine (one instruction a row or a
// column's run, imma.cuh bulk_copy_rows; sm_90, DS4_GPU_MV_IMMA_BULK), else by cp.async (copy_runs:
// one a 16-byte vector). The same bytes in the same places.
// INDEP: a sub-block's three MMAs independent of each other (imma.cuh plane_sums; the same integers).
template <bool BULK, bool INDEP = false>
__global__ void __launch_bounds__(kGqThreads)
    imma_q4k_grouped_kernel(const uint8_t* __restrict__ W, int64_t expert_bytes, int64_t row_bytes, int rows,
                            int units, int ks, const ExpertPartDev* __restrict__ parts,
                            const int32_t* __restrict__ n_parts, const int32_t* __restrict__ sorted_pairs,
                            const int32_t* __restrict__ x_row, const uint8_t* __restrict__ planes, int64_t ldp,
                            float* __restrict__ Y, int64_t ldy) {
  using L = SumsLayout<kGqRows, kGqCols>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int32_t xrow[kGqCols];  // the part's X rows (past its count: its last column's)
  float* red = reinterpret_cast<float*>(smem + 2 * kGqStage);
  uint8_t* planes_s = smem + 2 * kGqStage + kGqRedBytes;
  // The chunk's scales share the sums' space: each is written after a barrier that ends the other's use.
  float4* scales = reinterpret_cast<float4*>(red);
#if defined(DS4_IMMA_BULK)
  __shared__ uint64_t bulk_bar[2];  // a barrier a stage
  unsigned bulk_phase = 0;          // bit s: the parity of stage s's next phase
  if constexpr (BULK) {
    bulk_init(bulk_bar, 2);
    __syncthreads();
  }
#endif
  // The parts come from the planner just before: wait for it first.
  ds4_grid_begin();
  // Parts p = blockIdx.y, + gridDim.y, ... (the grid is sized for a few waves, not for the bound on
  // parts, most of which a step does not have).
  for (int p = static_cast<int>(blockIdx.y); p < *n_parts; p += static_cast<int>(gridDim.y)) {
    const ExpertPartDev pt = parts[p];
    const int warp = static_cast<int>(threadIdx.x) / DS4_WARP, lane = static_cast<int>(threadIdx.x) % DS4_WARP;
    const int g = lane >> 2, t = lane & 3;
    const int cpos = (warp >> 1) & 3, h = warp & 1;  // the warp's unit position in each block
    const uint8_t* We = W + static_cast<int64_t>(pt.expert) * expert_bytes;
    const int r0 = static_cast<int>(blockIdx.x) * kGqRows;
    if (threadIdx.x < kGqCols) {
      const int j = static_cast<int>(threadIdx.x);
      const int32_t pair = sorted_pairs[pt.first + (j < pt.count ? j : pt.count - 1)];
      xrow[j] = x_row != nullptr ? x_row[pair] : pair;
    }
    __syncthreads();

    const int n_chunks = (units + 31) / 32;
    // Chunk q's weights of the block's rows and the planes of its X units [32q, 32q + 32) of the
    // part's columns, into stage `stage`.
    auto issue = [&](int q, int stage) {
      const int left = units - 32 * q < 32 ? units - 32 * q : 32;  // units % 8 == 0: whole 144-byte blocks
      const uint8_t* wq = We + static_cast<int64_t>(q) * kGqChunk;
      auto wsrc = [=](int r) { return wq + (r0 + r < rows ? r0 + r : rows - 1) * row_bytes; };
      const int64_t pq = static_cast<int64_t>(q) * 32 * kPlaneBytes;
      auto psrc = [=](int j) { return planes + xrow[j] * ldp + pq; };
#if defined(DS4_IMMA_BULK)
      if constexpr (BULK) {
        uint64_t* bar = bulk_bar + stage;
        if (threadIdx.x == 0) bulk_expect(bar, left * (18 * kGqRows + kPlaneBytes * kGqCols));
        // The weight rows on warps 0-3 (8 each), the planes on warp 4 (pass 25: the copies' address
        // set-up had been ~90 of a warp's ~820 instructions a chunk on every warp).
        bulk_copy_rows<kGqThreads>(smem + stage * kGqStage, kGqPitch, kGqRows, left * 18, wsrc, bar, 0, 4);
        bulk_copy_rows<kGqThreads>(planes_s + stage * kGqPlaneStage, kGqPlanePitch, kGqCols, left * kPlaneBytes, psrc,
                                   bar, 4, 1);
        return;
      }
#endif
      copy_runs<kGqThreads, kGqChunk / 16>(smem + stage * kGqStage, kGqPitch, kGqRows, left * 18 / 16, wsrc);
      copy_runs<kGqThreads, 32 * kPlaneBytes / 16>(planes_s + stage * kGqPlaneStage, kGqPlanePitch, kGqCols,
                                                   left * (kPlaneBytes / 16), psrc);
      ds4_cp_async_commit();
    };

    float acc[4][kGqMT][4];
    float ys[kGqMaxSlices] = {0.0f, 0.0f, 0.0f, 0.0f};
    auto zero = [&] {
  #pragma unroll
      for (int k = 0; k < 4; ++k)
  #pragma unroll
        for (int mt = 0; mt < kGqMT; ++mt)
  #pragma unroll
          for (int e = 0; e < 4; ++e) acc[k][mt][e] = 0.0f;
    };

    // Block k of chunk q (units 32 q + 8 k + 2 cpos and + 1: the warp's sub-block 2 cpos + h of it)
    // into virtual lane k's sums.
    auto apply = [&](const uint8_t* chunk, const uint8_t* pl_s, int k, float (&a)[kGqMT][4]) {
      const int xa = 8 * k + 2 * cpos + h;  // the chunk's X unit of the sub-block
      uint32_t b[3][2];
      const uint8_t* rb = pl_s + g * kGqPlanePitch + kPlaneBytes * xa + 4 * t;
  #pragma unroll
      for (int pl = 0; pl < 3; ++pl) {
        b[pl][0] = *reinterpret_cast<const uint32_t*>(rb + 32 * pl);
        b[pl][1] = *reinterpret_cast<const uint32_t*>(rb + 32 * pl + 16);
      }
      float xs[2], xm[2];  // per C column: the unit's s and sM
  #pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float* rc = reinterpret_cast<const float*>(pl_s + (2 * t + j) * kGqPlanePitch + kPlaneBytes * xa +
                                                         kPlaneScaleOff);
        xm[j] = rc[1];
        xs[j] = rc[2];
      }
  #pragma unroll
      for (int mt = 0; mt < kGqMT; ++mt) {
        uint32_t av[4];
        float dl[2], ml[2];
  #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = 16 * mt + g + 8 * rr;
          const uint8_t* qb = chunk + row * kGqPitch + 144 * k + 16 + 32 * cpos + 4 * t;
          const uint32_t q0 = *reinterpret_cast<const uint32_t*>(qb), q1 = *reinterpret_cast<const uint32_t*>(qb + 16);
          av[rr] = (h ? q0 >> 4 : q0) & 0x0f0f0f0fu;      // sub-block elements 4t..4t+3
          av[2 + rr] = (h ? q1 >> 4 : q1) & 0x0f0f0f0fu;  // 16 + 4t..
          const float2 f = reinterpret_cast<const float2*>(scales + row * kGqScalePitch + 4 * k + cpos)[h];
          dl[rr] = f.x, ml[rr] = f.y;
        }
        int tt[4], s2[4];
        plane_sums<INDEP>(tt, s2, av, b);
  #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int rr = e >> 1, j = e & 1;
          a[mt][e] = q4k_sub_block(s2[e] * 65536 + tt[e], dl[rr], ml[rr], xs[j], xm[j], a[mt][e]);
        }
      }
    };

    int stage = 0;
    if (n_chunks > 0) issue(0, 0);
    zero();
    for (int q = n_chunks > 0 ? 0 : -1; q >= 0;) {
      const int nq = static_cast<int>(chunk_after(q, ks, n_chunks));
#if defined(DS4_IMMA_BULK)
      if constexpr (BULK) {
        if (nq >= 0) issue(nq, stage ^ 1);
        bulk_wait_stage(bulk_bar, bulk_phase, stage);
      } else
#endif
      {
        next_stage(nq, stage, issue);
      }
      const uint8_t* chunk = smem + stage * kGqStage;
      const uint8_t* pl_s = planes_s + stage * kGqPlaneStage;
      // The chunk's (dl, ml) pairs once for all warps: entry (row, block k, position c) (a block past
      // the row's end gives values no unit reads). A thread of warps 4-7 (the bulk copies are on warps 0-4)
      // decodes a (row, block)'s four positions from one read of its header (pass 25: a thread an
      // entry had read each header and converted its d and dmin four times); a warp's rows are 32
      // consecutive ones of one block, so its header reads and its stores meet no bank conflict.
      if (threadIdx.x >= kGqThreads / 2) {
        const int i = static_cast<int>(threadIdx.x) - kGqThreads / 2, row = i % kGqRows, k = i / kGqRows;
        const uint4 head = *reinterpret_cast<const uint4*>(chunk + row * kGqPitch + 144 * k);
  #pragma unroll
        for (int c = 0; c < 4; ++c) {
          float4 f;
          q4k_unit_scales(head.x, head.y, head.z, head.w, c, &f.x, &f.y, &f.z, &f.w);
          scales[row * kGqScalePitch + 4 * k + c] = f;
        }
      }
      __syncthreads();
      if (32 * q + 32 <= units) {
        // A whole chunk: the four blocks' applies in one basic block, so the scheduler interleaves
        // their independent chains (loads, mma, the float steps) where a branch between them had kept
        // each apart (pass 26: 78 -> 109 registers, still two blocks an SM; instructions -14%, the
        // kernel -6.7% at 2048 rows).
  #pragma unroll
        for (int k = 0; k < 4; ++k) apply(chunk, pl_s, k, acc[k]);
      } else {
  #pragma unroll
        for (int k = 0; k < 4; ++k)
          if (32 * q + 8 * k < units) apply(chunk, pl_s, k, acc[k]);  // unit 32q + 8k + w < units (units % 8 == 0)
      }
      __syncthreads();  // the stage is free before it is filled again
      const int s_now = slice_of(q, ks);
      if (nq < 0 || slice_of(nq, ks) != s_now) {
        // The slice's butterfly: B_w in registers (lanes w, w + 8, w + 16, w + 24), the rest through
        // shared memory.
  #pragma unroll
        for (int mt = 0; mt < kGqMT; ++mt)
  #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * mt + g + 8 * (e >> 1), col = 2 * t + (e & 1);
            red[warp * kGqRed + L::at(row, col)] =
                (acc[0][mt][e] + acc[2][mt][e]) + (acc[1][mt][e] + acc[3][mt][e]);
          }
        __syncthreads();
        // Output o is row o % kGqRows of column o / kGqRows (imma_q8.cu: a warp stores one line of Y).
        const int o = static_cast<int>(threadIdx.x);
        const int at = L::at(o % kGqRows, o / kGqRows);
        float b[8];
  #pragma unroll
        for (int w = 0; w < 8; ++w) b[w] = red[w * kGqRed + at];
        const float y = butterfly_of_eight(b);
  #pragma unroll
        for (int s = 0; s < kGqMaxSlices; ++s)
          if (s == s_now) ys[s] = y;
        __syncthreads();
        zero();
      }
      q = nq;
      stage ^= 1;
    }
    const int o = static_cast<int>(threadIdx.x);
    const int row = r0 + o % kGqRows, col = o / kGqRows;
    if (row < rows && col < pt.count)
      Y[static_cast<int64_t>(sorted_pairs[pt.first + col]) * ldy + row] = kslice_tree(ys, ks);
    __syncthreads();  // every warp is done with this part's shared memory before the next one's copies
  }
}

#endif  // DS4_IMMA

}  // namespace

bool imma_q4k_takes(const TensorView& W, int64_t n_pairs) {
#if defined(DS4_IMMA)
  const int min_pairs = matvec_imma_grouped();
  // N pairs per expert, counting at least kImmaGroupedMinExperts experts: a step of few pairs over few
  // experts stays on the SIMT kernels.
  const int64_t experts = std::max<int64_t>(W.ne[2], kImmaGroupedMinExperts);
  if (min_pairs == 0 || n_pairs < static_cast<int64_t>(min_pairs) * experts || W.type != DType::Q4_K ||
      !matvec_int8() || !cuda_sm90())
    return false;
  const int64_t units = W.ne[0] / 32, expert_bytes = W.row_bytes() * W.ne[1];
  return units % 8 == 0 && units < (int64_t{1} << 24) && W.ne[1] < (int64_t{1} << 30) && expert_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(W.data) % 16 == 0;
#else
  (void)W, (void)n_pairs;
  return false;
#endif
}

bool imma_q4k_prepare() {
#if defined(DS4_IMMA)
  static const bool ready = [] {
    auto smem = [](auto kernel) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGqSmem) == cudaSuccess;
    };
    const bool ok = smem(imma_q4k_grouped_kernel<false>) && smem(imma_q4k_grouped_kernel<true>) &&
                    smem(imma_q4k_grouped_kernel<false, true>) && smem(imma_q4k_grouped_kernel<true, true>);
    (void)cudaGetLastError();
    return ok;
  }();
  return ready;
#else
  return false;
#endif
}

bool imma_q4k_grouped(const TensorView& W, int64_t units, const void* parts, const int32_t* n_parts, int max_parts,
                      const int32_t* sorted_pairs, const int32_t* x_row, const uint8_t* planes, int64_t ldp,
                      float* Y, int64_t ldy, cudaStream_t stream) {
#if defined(DS4_IMMA)
  if (planes == nullptr || !imma_q4k_takes(W, max_parts)) return false;
  if (max_parts <= 0 || W.ne[1] == 0) return true;
  if (reinterpret_cast<uintptr_t>(planes) % 16 != 0 || ldp % 16 != 0) return false;
  if (!imma_q4k_prepare()) return false;
  const int64_t rows = W.ne[1];
  const int ks = matvec_kslices(rows, units);
  // Blocks for about eight of each SM's two resident blocks, each working its share of the parts.
  const int64_t row_blocks = (rows + kGqRows - 1) / kGqRows;
  const int64_t part_blocks = std::min<int64_t>(max_parts, std::max<int64_t>(1, 8 * device_sms() / row_blocks));
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(part_blocks));
  const bool bulk = matvec_imma_bulk(), indep = (matvec_imma_indep() & kImmaIndepQ4k) != 0;
  auto* kernel = bulk ? (indep ? imma_q4k_grouped_kernel<true, true> : imma_q4k_grouped_kernel<true>)
                      : (indep ? imma_q4k_grouped_kernel<false, true> : imma_q4k_grouped_kernel<false>);
  launch(kernel, grid, kGqThreads, kGqSmem, stream,
         W.data, W.row_bytes() * rows, W.row_bytes(), static_cast<int>(rows), static_cast<int>(units), ks,
         static_cast<const ExpertPartDev*>(parts), n_parts, sorted_pairs, x_row, planes, ldp, Y, ldy);
  DS4_GPU_CHECK_LAUNCH("imma_q4k_grouped_kernel");
  imma_count_launch(bulk ? kImmaQ4kBulk : kImmaQ4kCpAsync);
  return true;
#else
  (void)W, (void)units, (void)parts, (void)n_parts, (void)max_parts, (void)sorted_pairs, (void)x_row, (void)planes,
      (void)ldp, (void)Y, (void)ldy, (void)stream;
  return false;
#endif
}

}  // namespace ds4::gpu
