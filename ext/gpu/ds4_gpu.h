// Host interface of the GPU backend (plain C++: included by the Cython binding and by the GPU
// step executor alike). Every kernel launcher takes device pointers and runs asynchronously on
// a stream; the `testing` functions take host buffers, upload, run, download and synchronize
// (they exist so the kernels can be checked from Python against the CPU kernels).
//
// Built without a GPU backend (DS4_GPU=off: neither DS4_GPU_CUDA nor DS4_GPU_HIP defined, and
// not compiled by nvcc or hipcc) this header still compiles: available() is false and every other call throws std::runtime_error,
// so the binding can declare the same functions in every build.
//
// Numerics, shared by every kernel: fp32 accumulation; weights dequantized exactly as
// ext/cpu/quant.cpp does; each matvec column is single-column arithmetic (bit-identical
// whatever else shares the launch); every result is deterministic run to run.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ds4/kernels.h"

#if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP) || defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)
// Devices the GPU backend sees (0: no driver or no device; never throws). Global and unmangled by
// namespace so the binding can declare it without this header (ext/python/_native.pyx does).
int ds4_gpu_device_count();
#endif

namespace ds4::gpu {

using Stream = void*;  // a cudaStream_t / hipStream_t; nullptr is the default stream

// matvec's staged_min (below): the default, and the value that keeps every product on the direct
// kernel.
constexpr int kMatvecStagedMin = 2;
constexpr int kMatvecStagedOff = 1 << 30;

// One part of an expert-grouped product: sorted pairs [first, first + count) share `expert`.
struct ExpertPart {
  int32_t expert, first, count;
};

#if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP) || defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

// True when this build has a GPU backend and at least one device is visible.
bool available();
// The device this process uses, e.g. "NVIDIA H200 (cc 9.0, 132 SMs, 140 GiB)"; "" without one.
std::string device_name();

// --- kernels (device pointers) -------------------------------------------------------------

// Y[c * ldy + r] = sum_k W[r][k] * X[c * ldx + k] for c < ncols (1..16), all rows of W. W.data is
// a device pointer; X 16-byte aligned with ldx % 4 == 0; W.data 16-byte aligned for F32, F16,
// BF16 and Q4_K. K = W.ne[0] must be a multiple of 8 (F32/F16/BF16), 32 (Q8_0, MXFP4) or 256 (Q4_K).
// tall: a Q8_0/F16/BF16 matrix of at least 16384 rows runs with twice the rows per warp (the same
// bits, a different speed; matvec.cuh).
// staged_min: chunks of at least this many columns of a matrix of >= 512 rows (not F32) run on the
// staged kernel (activations in shared memory, a persistent grid; matvec.cuh) where their columns
// fit shared memory in at most 4 pieces; the same bits as the direct kernel, a different speed.
// kMatvecStagedOff: never.
void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, Stream stream,
            bool tall = false, int staged_min = kMatvecStagedMin);
// n_batch equally shaped products in one launch: member i is matvec(W shifted by i *
// w_stride_bytes, X + i * x_stride, Y + i * y_stride) (x_stride a multiple of 4), each member's
// rows computed exactly as their own launch would (the grouped output projection's groups).
void matvec_batched(const TensorView& W, int n_batch, int64_t w_stride_bytes, const float* X, int64_t x_stride,
                    int ncols, int64_t ldx, float* Y, int64_t y_stride, int64_t ldy, Stream stream, bool tall = false,
                    int staged_min = kMatvecStagedMin);
// Reads the device's limits for the staged kernel and raises the shared-memory attributes of the
// kernels that take more than 48 KB (the staged and tall kernels, build_parts at 4096 experts); matvec
// and build_expert_parts call it on first use, but a caller that captures graphs calls it before the
// first capture.
void matvec_prepare();

// Sort pairs by expert (stably) into parts of at most max_part (1..8) pairs, on the device.
// pair_expert[n_pairs]: each pair's expert; out: sorted_pairs[n_pairs] (pair ids in part order),
// parts[n_pairs] (at most n_pairs parts), n_parts[1]. scratch: none; one block.
void build_expert_parts(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part, int32_t* sorted_pairs,
                        ExpertPart* parts, int32_t* n_parts, Stream stream);

// The router's product, the route and the parts in one launch (pass 18, matvec.cu): the logits of
// matvec(W, X), then route(...) and build_expert_parts(ids, n * k, ...) on them, the same bytes as
// those three launches; the launch's last block to finish does the route and the parts. Takes W
// F16/BF16/F32 with at most 256 rows (experts) and 1..8 lanes; elsewhere it returns false and
// launches nothing (the caller runs the three). done: a device counter, zero before the first
// launch; every launch leaves it zero.
bool router_route(const TensorView& W, const float* X, int n, int64_t ldx, float* logits, bool hash,
                  const int32_t* tid2eid, const int32_t* tokens, const float* bias, int k, bool norm, float scale,
                  int32_t* ids, float* weights, int max_part, int32_t* sorted_pairs, ExpertPart* parts,
                  int32_t* n_parts, uint32_t* done, Stream stream);

// Expert-grouped product over a 3-D stack W [K, rows, n_expert]: for every pair p listed in the
// parts, Y[p * ldy + r] = W[expert(p)][r] . X[x_row[p] * ldx] (x_row null: row p). max_parts
// bounds *n_parts (the launch is sized for it, so a captured graph stays valid). max_cols: the
// widest part the kernel runs at once (a speed choice; wider parts run in pieces, same bits): the
// engine passes its lane count, which bounds a part's width when no lane routes twice to one expert.
// x_rows: the rows of X (0: not given), for the integer Q4_K products' planes (matvec_fused.h
// set_matvec_int8); without it they build the planes lane by lane (the same bits, slower).
void matvec_grouped(const TensorView& W, const ExpertPart* parts, const int32_t* n_parts, int max_parts,
                    const int32_t* sorted_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y,
                    int64_t ldy, Stream stream, int max_cols = 8, int64_t x_rows = 0);

// Q8_0 and Q4_K products load their weights as coalesced chunks through shared memory where the
// matrix allows (on by default; DS4_GPU_MV_CHUNKED=0 turns it off): false sends them to the
// unit-by-unit loads, which give the same bits (for tests and benches; process-wide).
void set_matvec_chunked(bool on);
// The direct kernel's persistent grid (matvec.cu; on by default, DS4_GPU_MV_PERSIST=0 turns it off):
// at most the blocks the device holds at once, each walking several row blocks. Same bits.
void set_matvec_persistent(bool on);
// The tall variant's chunk stages for Q8_0 products of up to 4 columns (matvec.cuh kDenseTall2):
// 1 (default, one stage in static shared memory) or 2 (two stages in dynamic shared memory;
// DS4_GPU_MV_TALL_STAGES=2). Same bits.
void set_matvec_tall_stages(int stages);
// The fewest elements a row a matrix must have to take the tall variant when asked for (matvec.cuh
// kTallRows: q_b has 1024, the LM head 4096): 2048 by default (DS4_GPU_MV_TALL_MIN_K sets it), 0 any,
// -1 back to the environment's value or the default. Same bits; the engine keys its graphs by it.
void set_matvec_tall_min_k(int64_t k);
int64_t matvec_tall_min_k();
// The fewest rows a matrix must have to take the staged kernel, for every width (a measurement
// setting; -1 back to the rule, matvec.cuh: 512 rows, 256 for whole 16-column chunks, pass 39;
// matvec_staged_min_rows() then returns 0). Same bits; the engine keys its graphs by it.
void set_matvec_staged_min_rows(int64_t rows);
int64_t matvec_staged_min_rows();
// The process-wide matvec launch choices (chunked loads; the grouped kernel's variant, stages and
// width, matvec.cuh) as one number: a CUDA graph bakes in the kernels chosen at its capture, so
// the engine keys its graphs by it.
int matvec_settings_key();
// The own grouped kernel's row groups a warp streams (matvec.cuh set_matvec_grouped_groups); the
// engine keys its graphs by it too.
int matvec_grouped_groups();

// Y[i] = X[i] * rsqrt(mean(X[i]^2) + eps) * w (w may be null), rows i < n_rows of n elements; the
// sum of squares in double, as the CPU does. planes given (n % 32 == 0): also Y[i]'s planes for the
// integer products (xplanes.cuh) at planes + i * ldp, the prep kernel's bytes.
void rms_norm(const float* X, int64_t ldx, const float* w, float* Y, int64_t ldy, int n_rows, int64_t n, float eps,
              Stream stream, uint8_t* planes = nullptr, int64_t ldp = 0);

// Y[i] = row tokens[i] of E (F32, F16, BF16, Q8_0, Q4_K or MXFP4), dequantized exactly, written `copies`
// times one after another in Y's row (the step's mHC streams; copies * row width <= ldy).
void embed_rows(const TensorView& E, const int32_t* tokens, int n, float* Y, int64_t ldy, Stream stream,
                int copies = 1);

// Tail RoPE in place: for row i and head h, the interleaved pairs of the last rope_dim elements
// of X[i * row_stride + h * head_dim ...] turn by pos[i] * inv_freq[k] (negated: inverse). cos/sin
// in double, rounded once to float, then the CPU's mul/sub arithmetic.
void rope_tail(float* X, int n_rows, int n_heads, int64_t row_stride, int head_dim, int rope_dim, const int32_t* pos,
               const double* inv_freq, bool inverse, Stream stream);

// Attention with a sink column. Lane i attends over the f16 rows kv[key_rows[j] * head_dim]
// for j in [key_off[i], key_off[i+1]) (K = V): logits q.k / sqrt(head_dim), softmax with
// sinks[h] in the denominator only, out[i][h] = sum p_j k_j. q and out are [n_lanes][n_head]
// [head_dim] fp32; head_dim % 8 == 0 and <= 512; every lane has at most max_keys rows.
void attention_sink(const float* q, const uint16_t* kv, const int32_t* key_rows, const int32_t* key_off, int n_lanes,
                    int n_head, int head_dim, const float* sinks, int max_keys, float* out, Stream stream);

// out[i] = index of the largest of X[i * ldx .. + n) (first one on ties; NaN counts as largest).
// work: device memory of argmax_work_bytes(n_rows) (each row's splits' partial results).
constexpr int kArgmaxMaxSplits = 64;
constexpr size_t argmax_work_bytes(int64_t n_rows) { return static_cast<size_t>(n_rows) * kArgmaxMaxSplits * 8; }
void argmax_rows(const float* X, int64_t ldx, int n_rows, int64_t n, int32_t* out, void* work, Stream stream);

// --- testing: the same on host buffers (synchronous) ---------------------------------------
namespace testing {
void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, bool tall = false,
            int staged_min = kMatvecStagedMin);
// pair p: expert pair_expert[p], activation row x_row[p] of X (x_rows rows); Y[p] out.
void matvec_grouped(const TensorView& W, const float* X, int64_t x_rows, int64_t ldx, const int32_t* pair_expert,
                    const int32_t* x_row, int n_pairs, int max_part, float* Y, int64_t ldy, int max_cols = 8);
// matvec_batched over host buffers, as the engine's grouped output projection uses it: W.ne =
// [K, n_batch * rows], member i its rows [i * rows, (i + 1) * rows); X [ncols][n_batch * K], member
// i reads elements [i * K, (i + 1) * K) of each column; Y [ncols][n_batch * rows] in member order.
void matvec_batched(const TensorView& W, int n_batch, const float* X, int ncols, float* Y, bool tall,
                    int staged_min);
// ds4::gpu::set_matvec_chunked, set_matvec_persistent and set_matvec_grouped (matvec.cuh), for the
// binding.
void set_matvec_chunked(bool on);
void set_matvec_persistent(bool on);
void set_matvec_tall_stages(int stages);
// ds4::gpu::set_matvec_tall_min_k; returns matvec_tall_min_k() after it.
int64_t set_matvec_tall_min_k(int64_t k);
// ds4::gpu::set_matvec_staged_min_rows; returns matvec_staged_min_rows() after it (0: the rule).
int64_t set_matvec_staged_min_rows(int64_t rows);
// variant as ds4::gpu::set_matvec_grouped's; stages 2..4 the own kernel's copy stages, width 1, 2,
// 4 or 8 its widest sub-part (each 0: keep, -1: the default).
void set_matvec_grouped(int variant, int stages = 0, int width = 0);
// ds4::gpu::set_matvec_grouped_groups (matvec.cuh; -1: the default); returns the row groups now.
int set_matvec_grouped_groups(int groups);
// The attention's measurement settings (step_ops.h attn_heads_a_block, attn_split_min), for the
// binding: heads a split block 1, 2 or 4 (-1: the rule; the same bits), and the fewest keys a split
// 8..256 in steps of 8 (-1: the default, 64; changes bits). Each returns the setting now (0: the rule).
int set_attn_heads(int heads);
int set_attn_split_min(int keys);
// The mHC site's streams a sums thread (step_ops.h hc_site_streams): 1 or 2 (-1: the default, 2); it
// changes bits. Returns the setting now.
int set_hc_site_streams(int streams);
// Whether the attention's kernels do their step-input work before the grid wait (step_ops.h
// attn_early: DS4_GPU_ATTN_EARLY, read once a process, default on); for the child-process test.
bool attn_early();
void rms_norm(const float* X, const float* w, float* Y, int n_rows, int64_t n, float eps);
void embed_rows(const TensorView& E, const int32_t* tokens, int n, float* Y);
void rope_tail(float* X, int n_rows, int n_heads, int head_dim, int rope_dim, const int32_t* pos,
               const double* inv_freq, bool inverse);
void attention_sink(const float* q, const uint16_t* kv, int64_t kv_rows, const int32_t* key_rows,
                    const int32_t* key_off, int n_lanes, int n_head, int head_dim, const float* sinks, float* out);
void argmax_rows(const float* X, int n_rows, int64_t n, int32_t* out);
// The step kernels' row round trips (rowops.cuh) on each of n_rows rows of n values, in place:
// kind 0 FP8 (blocks of 64), 1 FP4 (blocks of 32), 2 Hadamard (n a power of two), 3 f16.
void qat_rows(int kind, float* X, int n_rows, int n);
// The biased top-k router (step_ops.h route, not hash-routed) on host arrays: logits [n][n_expert],
// bias [n_expert]; ids and weights [n][k] out.
void route(const float* logits, int n, int n_expert, int k, const float* bias, bool norm, float scale, int32_t* ids,
           float* weights);
// build_expert_parts on host arrays: pair_expert [n_pairs] in; sorted [n_pairs] (-1 past the valid
// pairs) and parts [n_pairs][3] (expert, first, count) out; returns the count of parts.
int expert_parts(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part, int32_t* sorted,
                 int32_t* parts);
// The fused router (router_route) on host arrays: W [d, E], X [n][d]; tid2eid [n_vocab][k] (a hash
// layer's experts of tokens[n]) or null (the biased top-k, bias [E]); out: logits [n][E], ids and
// weights [n][k], sorted [n k], parts [n k][3] (expert, first, count), n_parts [1]. Launches it
// `repeat` times (each leaves its counter zero). False, writing nothing, where it does not take them.
bool router_route(const TensorView& W, const float* X, int n, const int32_t* tid2eid, int64_t n_vocab,
                  const int32_t* tokens, const float* bias, int k, bool norm, float scale, int max_part, int repeat,
                  float* logits, int32_t* ids, float* weights, int32_t* sorted, int32_t* parts, int32_t* n_parts);
// One fused mHC site (step_ops.h hc_site, then hc_comb; 4 streams) on host arrays: X [n][4][d] and post
// [n][4], comb [n][4][4] in place; Y [n][d] the post's y (null: no post); fn the [24][4 d]
// projection (F16, BF16 or F32); scale [3], base [24]; norm_w [d] or null; U [n][d] out.
void hc_site(float* X, int n, int64_t d, const float* Y, float* post, float* comb, const TensorView& fn,
             const float* scale, const float* base, int iters, float hc_eps, float norm_eps, const float* norm_w,
             float* U);
}  // namespace testing

#else  // no GPU backend in this build

inline bool available() { return false; }
inline std::string device_name() { return std::string(); }
namespace testing {
[[noreturn]] inline void no_backend() {
  throw std::runtime_error("this _native build has no GPU backend; rebuild with DS4_GPU=cuda or DS4_GPU=hip");
}
inline void matvec(const TensorView&, const float*, int, int64_t, float*, int64_t, bool = false,
                   int = kMatvecStagedMin) {
  no_backend();
}
inline void matvec_grouped(const TensorView&, const float*, int64_t, int64_t, const int32_t*, const int32_t*, int, int,
                           float*, int64_t, int = 8) {
  no_backend();
}
inline void set_matvec_chunked(bool) { no_backend(); }
inline void set_matvec_persistent(bool) { no_backend(); }
inline void set_matvec_tall_stages(int) { no_backend(); }
inline int64_t set_matvec_tall_min_k(int64_t) { no_backend(); }
inline int64_t set_matvec_staged_min_rows(int64_t) { no_backend(); }
inline void set_matvec_grouped(int, int = 0, int = 0) { no_backend(); }
inline int set_matvec_grouped_groups(int) { no_backend(); }
inline int set_attn_heads(int) { no_backend(); }
inline int set_attn_split_min(int) { no_backend(); }
inline int set_hc_site_streams(int) { no_backend(); }
inline bool attn_early() { no_backend(); }
inline void matvec_batched(const TensorView&, int, const float*, int, float*, bool, int) { no_backend(); }
inline void rms_norm(const float*, const float*, float*, int, int64_t, float) { no_backend(); }
inline void embed_rows(const TensorView&, const int32_t*, int, float*) { no_backend(); }
inline void rope_tail(float*, int, int, int, int, const int32_t*, const double*, bool) { no_backend(); }
inline void attention_sink(const float*, const uint16_t*, int64_t, const int32_t*, const int32_t*, int, int, int,
                           const float*, float*) {
  no_backend();
}
inline void argmax_rows(const float*, int, int64_t, int32_t*) { no_backend(); }
inline void qat_rows(int, float*, int, int) { no_backend(); }
inline void route(const float*, int, int, int, const float*, bool, float, int32_t*, float*) { no_backend(); }
inline int expert_parts(const int32_t*, int, int, int, int32_t*, int32_t*) { no_backend(); }
inline bool router_route(const TensorView&, const float*, int, const int32_t*, int64_t, const int32_t*, const float*,
                         int, bool, float, int, int, float*, int32_t*, float*, int32_t*, int32_t*, int32_t*) {
  no_backend();
}
inline void hc_site(float*, int, int64_t, const float*, float*, float*, const TensorView&, const float*, const float*,
                    int, float, float, const float*, float*) {
  no_backend();
}
}  // namespace testing

#endif

}  // namespace ds4::gpu
