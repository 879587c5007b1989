// The integer tensor-core products for wide calls (prompt rows): dense Q8_0 (imma_q8.cu) and the
// expert-grouped Q4_K product (imma_q4k.cu), each bit for bit the SIMT kernels' integer arithmetic
// (xplanes.cuh), so which kernel a call takes is a speed choice only.
#pragma once

#include <cstdint>

#include "ds4/kernels.h"
#include "vendor.h"

namespace ds4::gpu {

// The fewest columns a Q8_0 product (integer products on) must have to take the tensor-core kernel;
// 0: never. DS4_GPU_MV_IMMA=N sets it at start (default kImmaDefaultCols), set_matvec_imma at run
// time. And the fewest pairs per expert (n_pairs / experts of the stack, counting at least 128
// experts: imma_q4k.cu) a grouped Q4_K product must have: its parts are then mostly full 8-column
// tiles (DS4_GPU_MV_IMMA_GROUPED=N, default kImmaDefaultPairs; set_matvec_imma_grouped). A setter's
// -1 goes back to the environment's value or the default. The bits never depend on either
// (imma_q8.cu, imma_q4k.cu); both are part of the graph key so an A/B under graphs measures what it
// names.
// Where the build or the device has no integer mma.sync (HIP, before sm_90 here) the kernels never
// run and the getters still report the settings.
// Pass 11, call 10: 16-row prefill steps 3089 -> 3306 tok/s at 16. Pass 13, call 1: decode at C = 8
// +9.3% at 8, C = 6 +1.9% at 4 (C = 4 -8.5%), so 6. GPU pass 20, call 2 (one process, the narrow
// tile of pass 15-19): at 4, C = 4 +3.6%, C = 6-8 and prompt steps of 16-2048 rows within 1%, so 4.
constexpr int kImmaDefaultCols = 4;
// Pass 13, call 1 (ncu, C = 8): the narrow tile is slower than the SIMT kernels on q_a (1024 rows),
// kv (512) and the shared expert's gate and up (2048): a block per 64 rows is too few blocks.
constexpr int kImmaDefaultNarrowRows = 4096;
constexpr int kImmaDefaultPairs = 2;
void set_matvec_imma(int min_cols);
int matvec_imma();
void set_matvec_imma_grouped(int min_pairs_per_expert);
int matvec_imma_grouped();
// The narrow tile (calls of at most 8 columns, decode widths): the fewest rows (times members) such
// a call must have to take the tensor cores (DS4_GPU_MV_IMMA_NARROW_ROWS=N, default
// kImmaDefaultNarrowRows; 0: any), and
// whether its planes are loaded a chunk ahead (DS4_GPU_MV_IMMA_AHEAD=0/1, default 1), and whether a
// call of one member with more row blocks than SMs runs on a persistent grid, a block an SM walking
// row blocks (DS4_GPU_MV_IMMA_PERSIST=0/1, default 1). -1 in the setter: back to the environment's
// value or the default. The same bits either way; graph key.
void set_matvec_imma_narrow(int min_rows, int ahead, int persist);
int matvec_imma_narrow_rows();
bool matvec_imma_ahead();
bool matvec_imma_persist();
// Which integer tensor-core kernels take a unit's three MMAs independent of each other (imma.cuh
// plane_sums; pass 34), a mask: kImmaIndepQ8 the wide Q8_0 tile, kImmaIndepQ4k the grouped Q4_K kernel,
// kImmaIndepNarrow the narrow Q8_0 tile (decode at 6-8 lanes; pass 35); -1 the default,
// kImmaIndepDefault (pass 34 calls 2-3, 2048-row prompt steps: the grouped kernel's +2.3-2.6%, the wide
// tile's -2.5%, which spills more in that form). The same bits either way; graph key.
constexpr int kImmaIndepQ8 = 1, kImmaIndepQ4k = 2, kImmaIndepNarrow = 4, kImmaIndepDefault = kImmaIndepQ4k;
void set_matvec_imma_indep(int mask);
int matvec_imma_indep();

// The paths a tensor-core launch takes (the same bits on each; testing::imma_launches counts them):
// the Q8_0 tiles' and the grouped Q4_K kernel's cp.async or bulk-copy instantiation
// (DS4_GPU_MV_IMMA_BULK; below sm_90 the bulk one copies by cp.async too).
enum ImmaPath : int { kImmaQ8CpAsync, kImmaQ8Bulk, kImmaQ4kCpAsync, kImmaQ4kBulk, kImmaPaths };
// Whether the kernels take their weights (and Q4_K's planes) by bulk copies: on unless
// DS4_GPU_MV_IMMA_BULK=0 (read once a process).
bool matvec_imma_bulk();
// Counts a launch of either kernel on that path.
void imma_count_launch(ImmaPath path);

// Raise the kernels' shared-memory limits (once; matvec_prepare calls imma_prepare, which calls
// imma_q4k_prepare, before any graph capture). False where a kernel cannot run.
bool imma_prepare();
bool imma_q4k_prepare();

// Y = W X on the tensor cores for n_batch members (member i: weights W.data + i * w_member bytes,
// column c's planes at P + (i * ncols + c) * ldp, Y + i * y_member + c * ldy). Returns false, doing
// nothing, where the kernel does not take the call: fewer than matvec_imma() columns, no kernel in
// this build or device, or weights not laid out for its 16-byte copies.
bool imma_q8_matvec(const TensorView& W, int64_t units, int n_batch, int64_t w_member, const uint8_t* P,
                    int64_t ldp, int ncols, float* Y, int64_t y_member, int64_t ldy, cudaStream_t stream);

// Whether imma_q4k_grouped takes a grouped product of W (a Q4_K stack) with n_pairs pairs; a
// function of W, n_pairs and the switches. matvec_grouped_pair declines where it does, so the gate
// and up products run here, then the SwiGLU kernel: the same bits as the fused store.
bool imma_q4k_takes(const TensorView& W, int64_t n_pairs);

// The expert-grouped product of matvec_grouped (same parts, pairs and bits) on the tensor cores: pair
// j of part p gets Y[j] = W[expert] . X[x_row[j]] from X's planes (row r at planes + r * ldp; x_row
// null: X row j). Parts past *n_parts do nothing. False, doing nothing, where
// !imma_q4k_takes(W, max_parts).
bool imma_q4k_grouped(const TensorView& W, int64_t units, const void* parts, const int32_t* n_parts, int max_parts,
                      const int32_t* sorted_pairs, const int32_t* x_row, const uint8_t* planes, int64_t ldp,
                      float* Y, int64_t ldy, cudaStream_t stream);

}  // namespace ds4::gpu
