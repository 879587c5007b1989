// Device discovery and the host-buffer testing entry points of ds4_gpu.h. No kernels here: each
// testing function uploads its inputs, calls the launcher of matvec.cu / ops.cu on the default
// stream, downloads the result and synchronizes, so Python can hold every kernel against the
// CPU kernels. Bytes: the inputs and outputs once each way over PCIe (tests only).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ds4_gpu.h"
#include "common.cuh"
#include "matvec.cuh"
#include "step_ops.h"

// Devices this backend sees; 0 without a driver or a device (never throws). The binding's
// gpu_available() (ext/python/_native.pyx) declares and calls this one global function.
int ds4_gpu_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return 0;
  }
  return n;
}

namespace ds4::gpu {

bool available() { return ds4_gpu_device_count() > 0; }

std::string device_name() {
  if (!available()) return std::string();
  int dev = 0;
  cudaDeviceProp p;
  DS4_GPU_CHECK(cudaGetDevice(&dev));
  DS4_GPU_CHECK(cudaGetDeviceProperties(&p, dev));
  char buf[256];
#if defined(DS4_HIP)
  std::snprintf(buf, sizeof(buf), "%s (%s, %d CUs, %.0f GiB)", p.name, p.gcnArchName, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1 << 30));
#else
  std::snprintf(buf, sizeof(buf), "%s (cc %d.%d, %d SMs, %.0f GiB)", p.name, p.major, p.minor, p.multiProcessorCount,
                static_cast<double>(p.totalGlobalMem) / (1 << 30));
#endif
  return buf;
}

namespace testing {
namespace {

// A device allocation that frees itself; filled from and copied back to host memory.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  Buffer(const void* host, size_t bytes) : Buffer(bytes) { upload(host); }
  ~Buffer() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void upload(const void* host) { upload(host, bytes_); }
  void upload(const void* host, size_t bytes) {
    if (bytes > 0) DS4_GPU_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
  }
  void download(void* host) const {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Columns repacked to a stride that is a multiple of 4 floats (the kernels' float4 loads).
std::vector<float> pack_columns(const float* X, int ncols, int64_t k, int64_t ldx, int64_t* ld_out) {
  const int64_t ld = (k + 3) / 4 * 4;
  std::vector<float> v(static_cast<size_t>(ncols) * ld, 0.0f);
  for (int c = 0; c < ncols; ++c) std::memcpy(&v[c * ld], X + c * ldx, static_cast<size_t>(k) * sizeof(float));
  *ld_out = ld;
  return v;
}

void sync() { DS4_GPU_CHECK(cudaDeviceSynchronize()); }

}  // namespace

void matvec(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy, bool tall,
            int staged_min) {
  if (ncols <= 0) return;
  Buffer w(W.data, static_cast<size_t>(W.nbytes()));
  int64_t ld = 0;
  const std::vector<float> xs = pack_columns(X, ncols, W.ne[0], ldx, &ld);
  Buffer x(xs.data(), xs.size() * sizeof(float));
  const int64_t rows = W.ne[1];
  Buffer y(static_cast<size_t>(ncols) * rows * sizeof(float));
  TensorView dv = W;
  dv.data = w.as<uint8_t>();
  ds4::gpu::matvec(dv, x.as<float>(), ncols, ld, y.as<float>(), rows, nullptr, tall, staged_min);
  std::vector<float> out(static_cast<size_t>(ncols) * rows);
  sync();
  y.download(out.data());
  for (int c = 0; c < ncols; ++c) std::memcpy(Y + c * ldy, &out[c * rows], static_cast<size_t>(rows) * sizeof(float));
}

void matvec_batched(const TensorView& W, int n_batch, const float* X, int ncols, float* Y, bool tall,
                    int staged_min) {
  if (ncols <= 0) return;
  if (n_batch < 1 || W.ne[1] % n_batch != 0)
    throw std::invalid_argument("GPU batched matvec: the rows do not split into " + std::to_string(n_batch));
  const int64_t K = W.ne[0], rows = W.ne[1] / n_batch;
  Buffer w(W.data, static_cast<size_t>(W.nbytes()));
  Buffer x(X, static_cast<size_t>(ncols) * n_batch * K * sizeof(float));
  Buffer y(static_cast<size_t>(ncols) * n_batch * rows * sizeof(float));
  TensorView dv = W;
  dv.data = w.as<uint8_t>();
  dv.ne[1] = rows;
  ds4::gpu::matvec_batched(dv, n_batch, rows * W.row_bytes(), x.as<float>(), K, ncols, n_batch * K, y.as<float>(),
                           rows, n_batch * rows, nullptr, tall, staged_min);
  sync();
  y.download(Y);
}

void matvec_grouped(const TensorView& W, const float* X, int64_t x_rows, int64_t ldx, const int32_t* pair_expert,
                    const int32_t* x_row, int n_pairs, int max_part, float* Y, int64_t ldy, int max_cols) {
  if (n_pairs <= 0) return;
  const int64_t n_expert = W.ne[2], rows = W.ne[1];
  for (int p = 0; p < n_pairs; ++p) {
    if (pair_expert[p] < 0 || pair_expert[p] >= n_expert)
      throw std::invalid_argument("GPU grouped matvec: pair " + std::to_string(p) + " names expert " +
                                  std::to_string(pair_expert[p]) + " of " + std::to_string(n_expert));
    if (x_row[p] < 0 || x_row[p] >= x_rows)
      throw std::invalid_argument("GPU grouped matvec: pair " + std::to_string(p) + " reads activation row " +
                                  std::to_string(x_row[p]) + " of " + std::to_string(x_rows));
  }
  Buffer w(W.data, static_cast<size_t>(W.nbytes()));
  int64_t ld = 0;
  const std::vector<float> xs = pack_columns(X, static_cast<int>(x_rows), W.ne[0], ldx, &ld);
  Buffer x(xs.data(), xs.size() * sizeof(float));
  Buffer pe(pair_expert, n_pairs * sizeof(int32_t)), xr(x_row, n_pairs * sizeof(int32_t));
  Buffer sorted(n_pairs * sizeof(int32_t)), parts(n_pairs * sizeof(ExpertPart)), n_parts(sizeof(int32_t));
  Buffer y(static_cast<size_t>(n_pairs) * rows * sizeof(float));
  TensorView dv = W;
  dv.data = w.as<uint8_t>();
  build_expert_parts(pe.as<int32_t>(), n_pairs, static_cast<int>(n_expert), max_part, sorted.as<int32_t>(),
                     parts.as<ExpertPart>(), n_parts.as<int32_t>(), nullptr);
  ds4::gpu::matvec_grouped(dv, parts.as<ExpertPart>(), n_parts.as<int32_t>(), n_pairs, sorted.as<int32_t>(),
                           xr.as<int32_t>(), x.as<float>(), ld, y.as<float>(), rows, nullptr, max_cols, x_rows);
  std::vector<float> out(static_cast<size_t>(n_pairs) * rows);
  sync();
  y.download(out.data());
  for (int p = 0; p < n_pairs; ++p) std::memcpy(Y + p * ldy, &out[p * rows], static_cast<size_t>(rows) * sizeof(float));
}

void set_matvec_chunked(bool on) { ds4::gpu::set_matvec_chunked(on); }

void set_matvec_persistent(bool on) { ds4::gpu::set_matvec_persistent(on); }

void set_matvec_tall_stages(int stages) { ds4::gpu::set_matvec_tall_stages(stages); }

int64_t set_matvec_tall_min_k(int64_t k) {
  ds4::gpu::set_matvec_tall_min_k(k);
  return ds4::gpu::matvec_tall_min_k();
}

int64_t set_matvec_staged_min_rows(int64_t rows) {
  ds4::gpu::set_matvec_staged_min_rows(rows);
  return ds4::gpu::matvec_staged_min_rows();
}

void set_matvec_grouped(int variant, int stages, int width) {
  ds4::gpu::set_matvec_grouped(variant, stages, width);
}
int set_matvec_grouped_groups(int groups) {
  ds4::gpu::set_matvec_grouped_groups(groups);
  return ds4::gpu::matvec_grouped_groups();
}

void rms_norm(const float* X, const float* w, float* Y, int n_rows, int64_t n, float eps) {
  if (n_rows <= 0) return;
  const size_t bytes = static_cast<size_t>(n_rows) * n * sizeof(float);
  Buffer x(X, bytes), y(bytes);
  Buffer wt(w ? static_cast<size_t>(n) * sizeof(float) : 0);
  if (w) wt.upload(w);
  ds4::gpu::rms_norm(x.as<float>(), n, w ? wt.as<float>() : nullptr, y.as<float>(), n, n_rows, n, eps, nullptr);
  sync();
  y.download(Y);
}

void embed_rows(const TensorView& E, const int32_t* tokens, int n, float* Y) {
  if (n <= 0) return;
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= E.ne[1])
      throw std::invalid_argument("GPU embed_rows: token " + std::to_string(tokens[i]) + " outside the table");
  const int64_t rows = E.ne[1];
  TensorView table = E;
  table.ne[2] = table.ne[3] = 1;
  Buffer e(E.data, static_cast<size_t>(table.row_bytes() * rows)), t(tokens, n * sizeof(int32_t));
  Buffer y(static_cast<size_t>(n) * E.ne[0] * sizeof(float));
  table.data = e.as<uint8_t>();
  ds4::gpu::embed_rows(table, t.as<int32_t>(), n, y.as<float>(), E.ne[0], nullptr);
  sync();
  y.download(Y);
}

void rope_tail(float* X, int n_rows, int n_heads, int head_dim, int rope_dim, const int32_t* pos,
               const double* inv_freq, bool inverse) {
  if (n_rows <= 0) return;
  const size_t bytes = static_cast<size_t>(n_rows) * n_heads * head_dim * sizeof(float);
  Buffer x(X, bytes), p(pos, n_rows * sizeof(int32_t)), f(inv_freq, (rope_dim / 2) * sizeof(double));
  ds4::gpu::rope_tail(x.as<float>(), n_rows, n_heads, static_cast<int64_t>(n_heads) * head_dim, head_dim, rope_dim,
                      p.as<int32_t>(), f.as<double>(), inverse, nullptr);
  sync();
  x.download(X);
}

void attention_sink(const float* q, const uint16_t* kv, int64_t kv_rows, const int32_t* key_rows,
                    const int32_t* key_off, int n_lanes, int n_head, int head_dim, const float* sinks, float* out) {
  if (n_lanes <= 0) return;
  int max_keys = 0;
  for (int i = 0; i < n_lanes; ++i) {
    if (key_off[i + 1] < key_off[i]) throw std::invalid_argument("GPU attention: key_off must not decrease");
    max_keys = std::max(max_keys, key_off[i + 1] - key_off[i]);
  }
  const int n_keys = key_off[n_lanes];
  for (int j = key_off[0]; j < n_keys; ++j)
    if (key_rows[j] < 0 || key_rows[j] >= kv_rows)
      throw std::invalid_argument("GPU attention: key row " + std::to_string(key_rows[j]) + " outside the pool");
  const size_t qbytes = static_cast<size_t>(n_lanes) * n_head * head_dim * sizeof(float);
  Buffer qd(q, qbytes), o(qbytes), k(kv, static_cast<size_t>(kv_rows) * head_dim * sizeof(uint16_t));
  Buffer rows(static_cast<size_t>(std::max(n_keys, 1)) * sizeof(int32_t));
  rows.upload(key_rows, static_cast<size_t>(n_keys) * sizeof(int32_t));
  Buffer off(key_off, (n_lanes + 1) * sizeof(int32_t)), s(sinks, n_head * sizeof(float));
  ds4::gpu::attention_sink(qd.as<float>(), k.as<uint16_t>(), rows.as<int32_t>(), off.as<int32_t>(), n_lanes, n_head,
                           head_dim, s.as<float>(), max_keys, o.as<float>(), nullptr);
  sync();
  o.download(out);
}

void argmax_rows(const float* X, int n_rows, int64_t n, int32_t* out) {
  if (n_rows <= 0) return;
  Buffer x(X, static_cast<size_t>(n_rows) * n * sizeof(float)), o(n_rows * sizeof(int32_t)),
      w(ds4::gpu::argmax_work_bytes(n_rows));
  ds4::gpu::argmax_rows(x.as<float>(), n, n_rows, n, o.as<int32_t>(), w.as<float>(), nullptr);
  sync();
  o.download(out);
}

void route(const float* logits, int n, int n_expert, int k, const float* bias, bool norm, float scale, int32_t* ids,
           float* weights) {
  if (n <= 0) return;
  const size_t picks = static_cast<size_t>(n) * k;
  Buffer lg(logits, static_cast<size_t>(n) * n_expert * sizeof(float)), b(bias, n_expert * sizeof(float));
  Buffer id(picks * sizeof(int32_t)), w(picks * sizeof(float));
  ds4::gpu::route(lg.as<float>(), n, n_expert, k, false, nullptr, nullptr, b.as<float>(), norm, scale, id.as<int32_t>(),
                  w.as<float>(), nullptr);
  sync();
  id.download(ids);
  w.download(weights);
}

int expert_parts(const int32_t* pair_expert, int n_pairs, int n_expert, int max_part, int32_t* sorted,
                 int32_t* parts) {
  if (n_pairs < 1) throw std::invalid_argument("testing::expert_parts: need at least one pair");
  const size_t n = static_cast<size_t>(n_pairs);
  Buffer pe(pair_expert, n * 4), so(n * 4), pa(n * sizeof(ExpertPart)), np(4);
  std::vector<int32_t> fill(n, -1);
  so.upload(fill.data());
  build_expert_parts(pe.as<int32_t>(), n_pairs, n_expert, max_part, so.as<int32_t>(), pa.as<ExpertPart>(),
                     np.as<int32_t>(), nullptr);
  sync();
  int32_t count = 0;
  np.download(&count);
  so.download(sorted);
  pa.download(parts);
  return count;
}

bool router_route(const TensorView& W, const float* X, int n, const int32_t* tid2eid, int64_t n_vocab,
                  const int32_t* tokens, const float* bias, int k, bool norm, float scale, int max_part, int repeat,
                  float* logits, int32_t* ids, float* weights, int32_t* sorted, int32_t* parts, int32_t* n_parts) {
  const int64_t d = W.ne[0], E = W.ne[1];
  const size_t picks = static_cast<size_t>(n) * k;
  Buffer w(W.data, static_cast<size_t>(W.nbytes())), x(X, static_cast<size_t>(n) * d * 4), b(bias, E * 4);
  Buffer tk(tokens, static_cast<size_t>(n) * 4), t2e(tid2eid, tid2eid ? static_cast<size_t>(n_vocab) * k * 4 : 0);
  Buffer lg(static_cast<size_t>(n) * E * 4), id(picks * 4), wt(picks * 4), so(picks * 4), pa(picks * 12), np(4);
  Buffer done(4);
  DS4_GPU_CHECK(cudaMemset(done.as<void>(), 0, 4));
  TensorView dv = W;
  dv.data = w.as<uint8_t>();
  bool took = true;
  for (int r = 0; r < repeat && took; ++r)
    took = ds4::gpu::router_route(dv, x.as<float>(), n, d, lg.as<float>(), tid2eid != nullptr, t2e.as<int32_t>(),
                                  tk.as<int32_t>(), b.as<float>(), k, norm, scale, id.as<int32_t>(), wt.as<float>(),
                                  max_part, so.as<int32_t>(), pa.as<ExpertPart>(), np.as<int32_t>(),
                                  done.as<uint32_t>(), nullptr);
  sync();
  if (!took) return false;
  lg.download(logits);
  id.download(ids);
  wt.download(weights);
  so.download(sorted);
  pa.download(parts);
  np.download(n_parts);
  return true;
}

void hc_site(float* X, int n, int64_t d, const float* Y, float* post, float* comb, const TensorView& fn,
             const float* scale, const float* base, int iters, float hc_eps, float norm_eps, const float* norm_w,
             float* U) {
  if (n <= 0) return;
  constexpr int hc = kHcSiteStreams, mix = kHcSiteMix;
  if (fn.ne[0] != hc * d || fn.ne[1] != mix) throw std::invalid_argument("testing::hc_site: fn must be [24][4 d]");
  const size_t rows = static_cast<size_t>(n);
  Buffer x(X, rows * hc * d * 4), xo(rows * hc * d * 4), po(post, rows * hc * 4), co(comb, rows * hc * hc * 4);
  Buffer u(rows * d * 4);
  Buffer y(Y, Y ? rows * d * 4 : 0), w(fn.data, static_cast<size_t>(fn.nbytes())), sc(scale, 3 * 4), ba(base, mix * 4);
  Buffer nw(norm_w, norm_w ? static_cast<size_t>(d) * 4 : 0);
  Buffer scratch(hc_site_scratch_bytes(n, d));
  HcSite s;
  s.X = x.as<float>();
  s.X_out = xo.as<float>();
  s.n = n;
  s.hc = hc;
  s.d = d;
  s.has_post = Y != nullptr;
  s.Y = y.as<float>();
  s.post = po.as<float>();
  s.comb = co.as<float>();
  s.fn = w.as<uint8_t>();
  s.fn_type = static_cast<int>(fn.type);
  s.fn_row_bytes = fn.row_bytes();
  s.scale = sc.as<float>();
  s.base = ba.as<float>();
  s.hc_eps = hc_eps;
  s.norm_eps = norm_eps;
  s.norm_w = norm_w ? nw.as<float>() : nullptr;
  s.U = u.as<float>();
  s.scratch = scratch.as<uint8_t>();
  s.scratch_rows = n;
  ds4::gpu::hc_site(s, nullptr);
  ds4::gpu::hc_comb(co.as<float>(), n, iters, hc_eps, nullptr);
  sync();
  (Y ? xo : x).download(X);
  po.download(post);
  co.download(comb);
  u.download(U);
}

}  // namespace testing
}  // namespace ds4::gpu
