// Host interface of the matvec launches beyond ds4_gpu.h (matvec.cu, matvec_fused.cu), plain C++:
// the engine and the Cython binding include it.
//
// Fused launches (pass 7), two launches that replace several:
//
//   matvec_multi         up to 8 products Y_i = W_i . X of one activation block X (same K, same
//                        columns) in one grid, each output bit-identical to matvec's;
//   matvec_grouped_pair  the routed experts' gate and up products over the same parts in one grid,
//                        optionally with the SwiGLU applied as they are stored (G = swiglu(g, u)),
//                        bit-identical to two matvec_grouped calls (and the swiglu kernel).
//
// Both obey the process-wide switch set_matvec_fuse / DS4_GPU_MV_FUSE=0 (fusion off: matvec_multi
// makes matvec's launches product by product, matvec_grouped_pair declines), which is part of
// matvec_settings_key, so a CUDA graph keeps what it captured.
//
// Tensor-core products (pass 8, MMA.md "Phase 2"): with set_matvec_mma(true) / DS4_GPU_MMA=1
// (default off; CUDA builds only) every product whose weights mma_matvec_fits (Q8_0, Q4_K, F16,
// BF16, K % 256 == 0) runs on mma_matvec.cuh's kernels at every width, dense, batched, in
// matvec_multi and grouped; the rest keep the fp32 SIMT kernels at every width. So each product
// has one arithmetic whatever the column count (width exactness, batch invariance hold per
// setting), and the two settings differ in low bits: the switch is bit 11 of
// matvec_settings_key. The tensor-core kernels take an optional scratch buffer (MatvecScratch)
// for their fastest paths; the overloads below pass one, the ds4_gpu.h forms without it use a
// lazily grown buffer of this module on the default stream outside graph capture, and none
// elsewhere (the same bits, slower paths).
//
// Built without a GPU backend the header still compiles; the testing entry points then throw.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ds4_gpu.h"

namespace ds4::gpu {

constexpr int kMatvecMultiMax = 8;  // products in one matvec_multi call

// One product of a matvec_multi call: Y[c * ldy + r] = W[r] . X[c].
struct MatvecProduct {
  TensorView W;
  float* Y = nullptr;
  int64_t ldy = 0;
};

// Device scratch of the tensor-core products: the wide path's pre-split activations and the
// K-slice partial sums (mma_matvec.cuh, mma_*_scratch_bytes). Used only during a call, in stream
// order, so one buffer serves every product of a stream; 16-byte aligned; empty is allowed.
// planes: the integer Q8_0 products' planes of X (xplanes.cuh), matvec_planes_bytes of the widest
// call; a call without room makes a stream-ordered allocation of its own (the same bits).
// given: planes a producer kernel already wrote beside its output (rms_norm, hc_pre, hc_head,
// swiglu and attention_paged take a planes pointer): a call whose X is one of them reads them
// instead of launching the prep (the same bytes). The caller names them only while they hold X's
// current values.
struct GivenPlanes {
  const float* x = nullptr;  // X: `cols` columns of k elements, ldx apart
  int64_t ldx = 0, k = 0, cols = 0;
  const uint8_t* data = nullptr;  // column c's planes at data + c * ldp
  int64_t ldp = 0;
  // n_batch > 1: the members of a batched product (matvec_batched), member i's column c of X at
  // x + i * x_member + c * ldx, its planes at data + (i * cols + c) * ldp; they serve a call of
  // exactly that shape.
  int64_t x_member = 0;
  int n_batch = 1;
};
constexpr int kGivenPlanesMax = 2;
struct MatvecScratch {
  float* data = nullptr;
  size_t bytes = 0;
  uint8_t* planes = nullptr;
  size_t planes_bytes = 0;
  GivenPlanes given[kGivenPlanesMax];
};

// Bytes of planes for `cols` columns of K elements (K a multiple of 32): 112 per 32 elements.
constexpr size_t matvec_planes_bytes(int64_t K, int64_t cols) {
  return static_cast<size_t>(cols) * static_cast<size_t>(K / 32) * 112;
}

#if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP) || defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

// The tensor-core switch, process-wide, read at launch (DS4_GPU_MMA=1 turns it on; default off
// until measured). In a build without the tensor-core kernels (HIP) it stays off: the setter
// changes nothing and the getter is false.
void set_matvec_mma(bool on);
bool matvec_mma();
// The integer Q8_0 products (xplanes.cuh): on by default, DS4_GPU_MV_INT8=0 or
// set_matvec_int8(false) gives the fp32 decode-and-fma path. Changes low bits (bit 30 of
// matvec_settings_key); each setting is exact and batch-invariant on its own. Process-wide.
void set_matvec_int8(bool on);
bool matvec_int8();
// Producer-built planes: the engine's mHC pre, RMSNorm of q_lat, attention combine, SwiGLUs and
// hc_head write the planes of their output beside it (MatvecScratch::given), so the products of
// that output launch no prep; the same bytes, so the same bits. On unless DS4_GPU_PLANES_FUSED=0 or
// set_planes_fused(false); process-wide, read when the engine launches a step (its graphs are keyed
// by it).
void set_planes_fused(bool on);
bool planes_fused();
// Whether products of W take the tensor-core kernels now: the switch on and mma_matvec_fits(W). A
// function of W and the switch only, never of the column count or the call.
bool matvec_uses_mma(const TensorView& W);
// Scratch (bytes) that lets a product of W with ncols columns (matvec, matvec_multi, a member of
// matvec_batched) take the tensor-core kernels' fastest path; 0 where W is not theirs.
size_t matvec_scratch_bytes(const TensorView& W, int ncols);
// The same for matvec_grouped over a stack W with max_parts parts (the K-slice partials).
size_t matvec_grouped_scratch_bytes(const TensorView& W, int max_parts);

// ds4_gpu.h's matvec, matvec_batched and matvec_grouped with the tensor-core products' scratch
// (unused by the SIMT products; the same bits with any scratch, or none).
void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
            bool tall, int staged_min, const MatvecScratch& scratch);
void matvec_batched(const TensorView& W, int n_batch, int64_t w_stride_bytes, const float* X, int64_t x_stride,
                    int ncols, int64_t ldx, float* Y, int64_t y_stride, int64_t ldy, Stream stream, bool tall,
                    int staged_min, const MatvecScratch& scratch);
void matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, Stream stream, int max_cols, const MatvecScratch& scratch, int64_t x_rows = 0);

// Every products[i] computed as matvec(W_i, X, ncols, ldx, Y_i, ldy_i, stream, tall, staged_min)
// would compute it (the same bits), with fewer launches: the products matvec would send to its
// direct kernel run as one grid per type (Q8_0 shares its grid with F16 or BF16), those it would
// send to the staged kernel keep their own launches (they already stream X once per block), and
// chunks of more than 8 columns run product by product. The W_i share K = ne[0] and may differ in
// type and rows. n_products 0..8; no allocation and no host synchronisation (graph capture safe,
// once matvec_prepare has run). With the tensor-core switch on, the products matvec_uses_mma takes
// run one by one on mma_matvec (with `scratch`) and the others as above. Returns the launches it
// made: the SIMT kernel launches, plus one for each tensor-core product (its activation pre-split
// and K-slice fold, where the launcher takes them, are not counted).
int matvec_multi(const MatvecProduct* products, int n_products, const float* X, int ncols, int64_t ldx,
                 Stream stream, bool tall = false, int staged_min = kMatvecStagedMin,
                 const MatvecScratch& scratch = MatvecScratch{});

// The routed experts' gate and up products in one launch: for every pair p of the parts, with
// g = Wg[expert(p)][r] . X[x_row[p]] and u = the same with Wu, G[p * ldy + r] = g and U[p * ldy + r]
// = u (U non-null), or G[p * ldy + r] = swiglu(g, u, swiglu_limit) (U null; lane_ops.cu's
// swiglu: silu(min(g, L)) * clamp(u, -L, L), no clamp for L <= 0). Arguments as matvec_grouped's.
// Each g and u has the bits matvec_grouped gives it, so the result equals matvec_grouped twice
// (then swiglu) bit for bit. Served by the own body (DS4_GPU_MV_GROUPED=1, the default) for Q4_K
// stacks of one shape that it takes, parts run at most 4 columns wide; otherwise, with fusion off,
// and where either stack takes the tensor-core kernels (matvec_uses_mma), it launches nothing and
// returns false: the caller makes the separate launches.
// x_rows, scratch: as matvec_grouped's (with the integer products on and x_rows 0 it declines).
bool matvec_grouped_pair(const TensorView& Wg, const TensorView& Wu, const ExpertPart* parts, const int32_t* n_parts,
                         int max_parts, const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx,
                         float* G, float* U, int64_t ldy, float swiglu_limit, Stream stream, int max_cols = 8,
                         int64_t x_rows = 0, const MatvecScratch& scratch = MatvecScratch{});

// Fusion on (default; DS4_GPU_MV_FUSE=0 turns it off) or off, process-wide; read at launch.
void set_matvec_fuse(bool on);
bool matvec_fuse();

// matvec.cu's checks and choices, shared with matvec_fused.cu's launchers.
namespace detail {
int64_t matvec_check_weights(const TensorView& W, const char* who);  // units a row
void matvec_check_activations(const float* X, int64_t ldx, const char* who);
bool matvec_chunked_on();
// Staged pieces matvec would cut an nc-column chunk into (0: the direct kernel takes it).
int matvec_staged_pieces(const TensorView& W, int nc, int staged_min);
// matvec of a product whose X planes are already made (planes: column c at planes + c * ldp;
// null: matvec's own path). matvec_multi makes one set of planes for all its Q8_0 products.
void matvec_with_planes(const TensorView& W, const float* X, const uint8_t* planes, int64_t ldp, int ncols,
                        int64_t ldx, float* Y, int64_t ldy, Stream stream, bool tall, int staged_min,
                        const MatvecScratch& scratch);
}  // namespace detail

namespace testing {
// matvec_multi over host buffers: W[i] host views sharing K, X [ncols][K], Y[i] [ncols][W[i].ne[1]].
// Returns the launches it made.
int matvec_multi(const TensorView* W, int n, const float* X, int ncols, float* const* Y, bool tall, int staged_min);
// matvec_grouped_pair over host buffers, pairs as testing::matvec_grouped's (the device planner,
// parts of max_part). swiglu false: G and U [n_pairs][ne1] out; true: G = swiglu(gate, up) and U
// is left as it was. Where the fused launch declines, the separate launches (and the swiglu
// kernel) fill the same outputs. Returns whether the fused launch ran.
bool matvec_grouped_pair(const TensorView& Wg, const TensorView& Wu, const float* X, int64_t x_rows,
                         const int32_t* pair_expert, const int32_t* x_row, int n_pairs, int max_part, float* G,
                         float* U, bool swiglu, float swiglu_limit, int max_cols);
// lane_ops.cu's swiglu kernel on host rows: G = swiglu(G, U) in place, rows x width.
void swiglu(float* G, const float* U, int rows, int64_t width, float limit);
void set_matvec_fuse(bool on);
// set_matvec_mma(on); returns matvec_mma() after it (false where the build has no tensor-core kernels).
bool set_matvec_mma(bool on);
// launch.cuh's set_pdl(on); returns pdl_on() after it (false where the device has no PDL).
bool set_pdl(bool on);
// set_matvec_int8(on); returns matvec_int8() after it.
bool set_matvec_int8(bool on);
// set_planes_fused(on); returns planes_fused() after it.
bool set_planes_fused(bool on);
// set_matvec_imma(min_cols) (imma.h: 0 off, -1 the default); returns matvec_imma() after it.
int set_matvec_imma(int min_cols);
// set_matvec_imma_grouped(min_pairs_per_expert) (imma.h: 0 off, -1 the default); returns
// matvec_imma_grouped() after it.
int set_matvec_imma_grouped(int min_pairs_per_expert);
// set_matvec_imma_narrow(min_rows, ahead, persist) (imma.h: -1 the default); returns
// matvec_imma_narrow_rows() * 4 + matvec_imma_persist() * 2 + matvec_imma_ahead() after it.
int set_matvec_imma_narrow(int min_rows, int ahead, int persist);
// set_matvec_imma_indep(mask) (imma.h: 1 the wide Q8_0 tile, 2 the grouped Q4_K kernel, 4 the narrow
// Q8_0 tile, -1 the default); returns matvec_imma_indep() after it.
int set_matvec_imma_indep(int mask);
// Launches of the integer tensor-core kernels so far in this process (a test's proof that they ran):
// path -1 all of them, else those on one ImmaPath (imma.h).
int64_t imma_launches(int path);
// Launches of the planes prep kernel so far in this process (what the producer-built planes save).
int64_t planes_prep_launches();
}  // namespace testing

#else  // no GPU backend in this build

namespace testing {
inline int matvec_multi(const TensorView*, int, const float*, int, float* const*, bool, int) { no_backend(); }
inline bool matvec_grouped_pair(const TensorView&, const TensorView&, const float*, int64_t, const int32_t*,
                                const int32_t*, int, int, float*, float*, bool, float, int) {
  no_backend();
}
inline void swiglu(float*, const float*, int, int64_t, float) { no_backend(); }
inline void set_matvec_fuse(bool) { no_backend(); }
inline bool set_matvec_mma(bool) { no_backend(); }
inline bool set_pdl(bool) { no_backend(); }
inline bool set_matvec_int8(bool) { no_backend(); }
inline bool set_planes_fused(bool) { no_backend(); }
inline int set_matvec_imma(int) { no_backend(); }
inline int set_matvec_imma_grouped(int) { no_backend(); }
inline int set_matvec_imma_narrow(int, int, int) { no_backend(); }
inline int set_matvec_imma_indep(int) { no_backend(); }
inline int64_t imma_launches(int) { no_backend(); }
inline int64_t planes_prep_launches() { no_backend(); }
}  // namespace testing

#endif

}  // namespace ds4::gpu
