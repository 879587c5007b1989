// ds4 CPU kernel API: weight views, fused-dequant matrix products, the thread pool.
//
// Contract shared by every caller (the DS4 step executor, the tests, the GPU port):
// - A weight matrix is a GGUF tensor viewed as rows: ne[0] = columns (input width, contiguous),
//   ne[1] = rows (outputs), ne[2] = experts (3-D expert stacks). Rows are stored in the tensor's
//   quantized type; dequantization is fused into the dot products.
// - matmul computes Y[c][r] = sum_k W[r][k] * X[c][k] for ncols activation columns. Each column
//   is computed with exactly the arithmetic of a single-column call (same block order, same
//   accumulation order), whatever ncols is and however rows are split between threads: this is
//   what makes a sequence's logits bit-identical whatever else shares the step.
// - Activations are fp32 everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace ds4 {

// GGUF/ggml type ids of the weight types we execute.
enum class DType : int32_t {
  F32 = 0,
  F16 = 1,
  Q8_0 = 8,
  Q4_K = 12,
  I32 = 26,
  BF16 = 30,
  MXFP4 = 39,
};

// Elements per block and bytes per block of a type (F32/F16/BF16/I32: block of 1).
int64_t block_elems(DType t);
int64_t block_bytes(DType t);
const char* dtype_name(DType t);
bool dtype_supported(int32_t ggml_type);

// A read-only view of one GGUF tensor (or one expert slice of a 3-D stack).
struct TensorView {
  DType type = DType::F32;
  int64_t ne[4] = {1, 1, 1, 1};
  const uint8_t* data = nullptr;

  int64_t cols() const { return ne[0]; }
  int64_t rows() const { return ne[1]; }
  int64_t row_bytes() const { return ne[0] / block_elems(type) * block_bytes(type); }
  int64_t nbytes() const { return row_bytes() * ne[1] * ne[2] * ne[3]; }
  // The 2-D view of expert e of a [cols, rows, experts] stack.
  TensorView expert(int64_t e) const;
};

// Dequantize n elements (a whole number of blocks) of type t.
void dequantize_row(DType t, const uint8_t* src, float* dst, int64_t n);

// A fixed pool of worker threads; parallel_for splits [0, n) into contiguous chunks.
class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  int size() const;
  // Runs fn(begin, end) over chunks of [0, n) on the pool (the caller's thread takes part) and
  // returns when all are done. grain: the smallest chunk worth a thread.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  struct Impl;
  Impl* impl_;
};

// Y[c * ldy + r] = dot(row r of W, X[c * ldx ...]) for c < ncols, r in [r0, r1).
void matmul_rows(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
                 int64_t r0, int64_t r1);

// The same over all rows of W, split across the pool.
void matmul(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
            ThreadPool& pool);

// One product of a matmul_batch: y(c)[r] = dot(row r of W, x(c)) for c < ncols, every row of W.
// Column c is read from x_cols[c] when x_cols is set, else from X + c * ldx; its results go to
// y_cols[c] when set, else to Y + c * ldy. (Pointer lists let a product read lanes scattered
// through a buffer, e.g. the lanes routed to one expert, and write them anywhere.)
//
// Optionally a second product over the same columns, W2 (W's shape) into y2(c), is computed
// with the first chunk of rows by chunk of rows, and after(*this, r0, r1) runs on each chunk
// [r0, r1) once both are there: a gated unit's gate, up and activation in one pass, on the
// thread that computed them.
struct MatmulJob {
  TensorView W;
  int ncols = 0;
  const float* X = nullptr;
  int64_t ldx = 0;
  float* Y = nullptr;
  int64_t ldy = 0;
  const float* const* x_cols = nullptr;
  float* const* y_cols = nullptr;
  TensorView W2;  // used when W2.data is set
  float* Y2 = nullptr;
  float* const* y2_cols = nullptr;
  void (*after)(const MatmulJob& job, int64_t r0, int64_t r1) = nullptr;
  const void* ctx = nullptr;  // for after
  // A task instead of a product (W.data null): after(job, r0, r1) over rows [0, task_rows), each
  // row worth task_cost multiply-adds when the batch is split between the threads.
  int64_t task_rows = 0, task_cost = 0;

  // Y = W·X over ncols columns: column c of X at X + c*ldx (or x_cols[c]), of Y at Y + c*ldy
  // (or y_cols[c]).
  static MatmulJob product(const TensorView& W, int ncols, const float* X, int64_t ldx, float* Y, int64_t ldy,
                           const float* const* x_cols = nullptr, float* const* y_cols = nullptr) {
    MatmulJob j;
    j.W = W;
    j.ncols = ncols;
    j.X = X;
    j.ldx = ldx;
    j.Y = Y;
    j.ldy = ldy;
    j.x_cols = x_cols;
    j.y_cols = y_cols;
    return j;
  }

  // Work beside the products of a batch (per-lane control math that nothing in the batch reads):
  // fn(job, r0, r1) for rows [r0, r1) of [0, rows).
  static MatmulJob task(void (*fn)(const MatmulJob&, int64_t, int64_t), const void* ctx, int64_t rows,
                        int64_t cost_per_row) {
    MatmulJob j;
    j.after = fn;
    j.ctx = ctx;
    j.task_rows = rows;
    j.task_cost = cost_per_row;
    return j;
  }
  bool is_task() const { return W.data == nullptr; }

  const float* x(int c) const { return x_cols ? x_cols[c] : X + c * ldx; }
  float* y(int c) const { return y_cols ? y_cols[c] : Y + c * ldy; }
  float* y2(int c) const { return y2_cols ? y2_cols[c] : Y2 + c * ldy; }
};

// Independent products and tasks (at most 64; no job may write what another reads) in one hand-off
// to the pool: their rows are split between the threads together, so many small products cost one
// wake-up instead of one each. Each column's bits are those of a single-column matmul.
void matmul_batch(const MatmulJob* jobs, int n_jobs, ThreadPool& pool);

}  // namespace ds4
