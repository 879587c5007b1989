// Tensor-core matrix-vector products with fixed per-column arithmetic (TF32 mma.sync, fp32-exact
// activations through a hi/lo split), for any number of columns: the same bits for a column
// whether it runs alone, beside 15 others or inside a 512-column prefill pass.
//
// Computes Y[c][r] = sum_k W[r][k] * X[c][k] for a GGUF weight matrix W (ne[0] = K per row,
// ne[1] = rows) of type Q8_0, Q4_K, F16 or BF16 and fp32 activation columns X[c] at X + c*ldx,
// Y[c] at Y + c*ldy; and the expert-grouped form of matvec_grouped (matvec.cuh) over the same
// parts. CUDA (sm_80+) only: under HIP this header declares the same functions, which report
// "unsupported" (mma_matvec_supported() is false; the launchers throw).
//
// ---- The arithmetic (the one definition; every width, mode and the grouped form implement it) --
//
// MMA = mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: D[16x8] = A[16x8] B[8x8] + C, fp32
// C and D. A = 16 weight rows x 8 k of decoded weight values (exact in TF32: the Q8_0 int8 q,
// the Q4_K 4-bit q, an F16 or BF16 value, as fp32 bit patterns); B = 8 k x 8 columns of hi or lo
// activation parts; one output column of B per activation column.
//
// Activation split (once per value, mma_split): hi = tf32(x) (cvt.rna.tf32.f32, low 13 bits
// cleared), lo = tf32(x - hi) (x - hi is exact in fp32 by Sterbenz). x = hi + lo + e with
// |e| <= 2^-22 |x|.
// K is cut into 32-element k-blocks; inside a k-block the 8 MMA k-slots of k-step s (0..3) hold
// elements {8t + s, 8t + 4 + s : t = 0..3} (slot t <-> element 8t + s, slot t + 4 <-> 8t + 4 + s),
// a fixed permutation that lets MMA thread t read elements 8t .. 8t + 7 contiguously.
// P(row, col, block) = the D of 8 MMAs chained through C from +0: k-steps 0, 1, 2, 3 with B = hi,
// then k-steps 0, 1, 2, 3 with B = lo.
//   Q8_0  (block scale d):              acc = fmaf(P, d, acc)
//   F16, BF16:                          acc = acc + P          (= fmaf(P, 1, acc))
//   Q4_K  (sub-block j = one k-block;   acc = fmaf(P_j, dl_j, acc); acc = fmaf(-ml_j, Sx_j, acc)
//          dl_j = d * sc_j, ml_j = dmin * m_j, both exact fp32 products as matvec.cuh decodes
//          them; Sx_j = sum of x over the sub-block: pieces p_t = ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7))
//          over elements 8t .. 8t+7, then (p0 + p1) + (p2 + p3))
// K-slices: K is cut into KS equal slices (KS = mma_kslices(W): a function of the matrix shape and
// type alone, never of the column count). acc_s starts at +0 for each slice and folds that
// slice's k-blocks in increasing order; y = acc_0, then y = y + acc_s for s = 1 .. KS-1.
//
// Why every column is bit-identical whatever shares the call (width exactness, batch
// invariance): in an MMA, D[i][j] depends only on row i of A, column j of B and C[i][j]; every
// value above is a function of the row's weights and the column's activations, through a
// sequence (blocks, k-steps, hi/lo, slices) fixed by K and KS. The launch shape (columns per pass,
// m-tiles per warp, which block computes which slice, where a column sits among the 8 of its
// n-tile) changes which thread holds a value, never the value. The hardware must compute each D
// element by the same function of its inputs wherever it sits in the tile (ext/gpu/MMA.md;
// mma_check's permuted-column runs test it). Columns past the call's width are B columns of zeros
// and are never stored.
// ------------------------------------------------------------------------------------------------
//
// Layout of the work (mma_matvec.cu): a block of 4 warps covers 4*MT m-tiles of 16 rows (MT = 1 or
// 2) and one pass of NT n-tiles of 8 columns; the weights stream through shared memory in stages
// of 128 k (cp.async, 16-byte vectors), the activations beside them as hi/lo (split in the kernel,
// or copied from a pre-split scratch buffer for wide passes). Each warp decodes its A fragments
// once per k-block and applies them to every n-tile of the pass. Bytes it must move: the weights
// once per pass group (passes of one row block run together and share L2), the activations once
// per block, the outputs once (plus KS partial sums per output where slices run on different
// blocks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ds4/kernels.h"
#include "ds4_gpu.h"

#if defined(DS4_GPU_CUDA) && !(defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIP__))
#define DS4_MMA_MATVEC 1  // this build has the tensor-core kernels
#endif

namespace ds4::gpu {

// The k elements of one pipeline stage: every supported K is a multiple of 256 (two stages).
constexpr int64_t kMmaStageK = 128;
constexpr int64_t kMmaKAlign = 256;

// Weight types these kernels take (Q8_0, Q4_K, F16, BF16) in a build that has them; false under
// HIP and in builds without a GPU backend.
bool mma_matvec_supported(DType t);

// Whether W can run here: a supported type, K a multiple of 256, W.data 16-byte aligned (so every
// row and every 128-k stage of a row is whole 16-byte vectors). Phase 2 sends the rest to matvec.
bool mma_matvec_fits(const TensorView& W);

// K-slices of W: the smallest power of two KS such that (rows / 64 row blocks) x KS >= 256, at most
// 16, each slice a multiple of 256 elements. Shape and type only (the arithmetic above depends on
// it), so it is a property of the matrix, never of a call.
int mma_kslices(const TensorView& W);

// Launch choices; none changes a result (mma_check compares them bit for bit).
//   slices: 0 auto; 1 every block folds all KS slices itself (no scratch); 2 one slice per block,
//           partial sums in scratch and a fold kernel (more blocks for short matrices); 3 two
//           slices per block (where KS >= 4), each slice's partial written on its own
//   wide:   passes of more than 16 columns use the wide kernel (activations pre-split into
//           scratch, 2 m-tiles a warp) when scratch allows; false: 16-column narrow passes
//   wide_nt: n-tiles of 8 columns a wide pass carries (4 or 8)
//   fold_inline: where slices run on separate blocks of a narrow (<= 16 columns) or grouped call,
//           those blocks form one thread-block cluster per tile and the last step of the kernel
//           adds the tile's partial sums in slice order (sm_90 clusters; no second launch); false:
//           the fold kernel, a second launch (phase 1/2's shape). Same additions in the same
//           order either way. Where clusters are unavailable the fold kernel runs regardless.
//           Off by default: on the H200 the cluster kernels ran slower than kernel + fold launch
//           (flash-l4 C=1 decode 468.7 against 495.7 tok/s; MMA.md "Phase 3: measured").
//   stream: the weight stages of calls of at most 8 columns (dense) and of the grouped form
//           (MMA.md "Phase 5: streaming"): 0 phase 1's stages (128 k of each of 64 rows: 144 /
//           80 / 256 bytes a row a stage); 1 auto: stages of ch = 2, 4 or 8 chunks of 128 k (one
//           contiguous copy of 272 .. 1088 bytes a row), activations staged for the call's columns
//           only, the ring sized to the shared memory of stream_blocks blocks an SM, ch and the ring
//           picked for the most weight bytes in flight (phase 1's stages where those keep more);
//           2, 4, 8: at most that ch (the largest that fits), whatever phase 1 would keep
//   stream_blocks: blocks an SM the streaming ring's shared memory is sized for (1..3; 0 auto: 3;
//           the kernel's registers, <= 168, allow 3)
//   stream_cols: the grouped form's activation columns a streaming stage holds (1, 2, 4, 8; 0 auto:
//           max_cols, at most the power of two >= twice the average pairs an expert (max_parts /
//           experts), at least 2); a part of more pairs runs in pieces of that many (its rows
//           streamed once a piece), so fewer leaves room for longer weight copies where most parts
//           are small
//   group_tiles: n-tiles a grouped streaming block takes (MMA.md phase 5): 1 one part; 2 two
//           consecutive parts of the same expert (each A fragment decoded once for both; the block
//           of the second part returns at once); 0 auto: 2 where max_parts >= 8 x the experts (8
//           pairs an expert on average), else 1. Needs the streaming stages (stream != 0)
//   Env: DS4_GPU_MMA_STREAM=0|1|2|4|8, DS4_GPU_MMA_STREAM_BLOCKS=0..3, DS4_GPU_MMA_STREAM_COLS=0|1|2|4|8,
//   DS4_GPU_MMA_GROUP_TILES=0|1|2. Same bits under every value.
// stream defaults to 0 (phase 1's stages): measured on the H200 (README "Pass 9: outcome"), the
// streaming stages made flash-l4 decode with the tensor cores 4-8% faster but prefill 8-9% slower,
// and prefill is what the tensor-core path is for.
struct MmaConfig {
  int slices = 0;
  bool wide = true;
  int wide_nt = 4;
  bool fold_inline = false;
  int stream = 0;
  int stream_blocks = 0;
  int stream_cols = 0;
  int group_tiles = 0;
};
void set_mma_config(const MmaConfig& c);
MmaConfig mma_config();

// Scratch (bytes) that lets mma_matvec take its fastest path for ncols columns: the pre-split
// activations of a wide call (ceil(ncols / 64) * 64 columns of 2K + K/32 floats) plus KS partial
// sums per output (KS * ncols * rows floats) where slices run on separate blocks. Less (or none)
// is fine: the call then takes a path that needs less, with the same bits.
size_t mma_matvec_scratch_bytes(const TensorView& W, int ncols);

// Y[c * ldy + r] = sum_k W[r][k] X[c * ldx + k], c < ncols (any ncols >= 0), every row. X 16-byte
// aligned, ldx % 4 == 0; W must fit (mma_matvec_fits). scratch: device memory of scratch_bytes
// (16-byte aligned; nullptr/0 allowed), used only during the call (stream-ordered). Never
// allocates, so it can be captured in a CUDA graph (call mma_prepare first).
void mma_matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
                float* scratch = nullptr, size_t scratch_bytes = 0);

// Scratch (bytes) for the grouped form's sliced path: KS * 8 * max_parts * rows floats.
size_t mma_grouped_scratch_bytes(const TensorView& W, int max_parts);

// The grouped product of matvec_grouped (ds4_gpu.h), same parameters and meaning: over a 3-D stack
// W [K, rows, n_expert], for each pair p of the parts, Y[p * ldy + r] = W[expert(p)][r] .
// X[x_row[p] * ldx] (x_row null: row p). Each part is one n-tile (parts of more than 8 pairs run in
// pieces); max_cols (the most pairs a part holds, as for matvec_grouped) sizes the streaming
// kernel's activation stage (MmaConfig::stream): a part with more pairs runs in pieces of that many,
// so a wrong bound costs time, never a bit. Every pair's output is bit-identical to mma_matvec of
// its expert on its column alone. scratch as for mma_matvec.
void mma_matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                        const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                        int64_t ldy, Stream stream, int max_cols = 8, float* scratch = nullptr,
                        size_t scratch_bytes = 0);

// Raise the kernels' dynamic shared-memory limits and read the device's SM count (once per
// process; the launchers call it on first use, but a caller that captures graphs calls it before
// the first capture).
void mma_prepare();

namespace testing {
// Host only (no GPU): for Q8_0, Q4_K, F16, BF16 rows of random valid blocks, every 128-k stage copied
// into a stage row as the kernel's cp.async copies do and every k-block decoded by the kernel's
// decoder for every thread t; each implied weight (Q8_0 q*d, Q4_K fmaf(dl, q, -ml), F16/BF16 the
// value) compared with ext/cpu/quant.cpp's. Phase 5's streaming stages too: for ch = 2, 4, 8 chunks a
// stage, every stage copied with the streaming kernel's offsets and decoded by its decoder; the
// activation stage's index functions; and the two-parts-a-block assignment on random part lists
// (every part taken once). Returns the number of wrong items; *first the first.
int mma_decode_selftest(uint64_t seed, std::string* first);
// One MMA on the device with A[i][k] = 1 + i + 16k, B[k][j] = 1 + 2k + 3j (small integers, so
// the product is exact), C[i][j] = 1000 i + j, placed by the fragment layout mma_matvec.cu uses;
// compares D with the host's exact result. Returns the number of wrong elements; *first names
// the first (row, column, got, want) when there is one.
int mma_layout_probe(std::string* first);
// The largest thread-block cluster the inline fold (MmaConfig::fold_inline) launches on this device
// (after mma_prepare): 1 means no clusters, so every sliced call takes the fold kernel.
int mma_fold_cluster_limit();
// The weight stages the last mma_matvec / mma_matvec_grouped call of this process launched: "phase-1
// stages", or the streaming shape ("ch 2 x 3 stages, 1 cols, 57 KB"; MmaConfig::stream).
std::string mma_last_launch();
}  // namespace testing

}  // namespace ds4::gpu
