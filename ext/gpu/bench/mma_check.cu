// Check and bench of the tensor-core matvec (ext/gpu/mma_matvec.cuh, ext/gpu/MMA.md) on one GPU.
//
// Build and run: ext/gpu/bench/mma_check.sh [OUT_DIR] (nvcc -std=c++17 -O3 -arch=sm_90 -fmad=false
// -DDS4_GPU_CUDA=1 -Iext/include -Iext/gpu -Iext/cpu -Xcompiler -ffp-contract=off, linking
// ext/gpu/mma_matvec.cu, ext/gpu/matvec.cu (the baseline) and ext/cpu/*.cpp (the dequantizer of the
// reference)).
//
//   mma_check [--out DIR] [--seed N] [--quick] [--check-only | --bench-only]
//   mma_check --decode             the host self-test only (no GPU needed)
//
// Checks (every failure prints what failed with the first mismatching element; exit 1 if any
// exactness check fails, 2 if only the accuracy bound fails, 0 otherwise):
//   decode       (host) every 128-k stage of random rows staged and decoded by the kernels' own
//                functions, each weight equal to the CPU dequantizer's; likewise phase 5's streaming
//                stages of 2, 4, 8 chunks, its activation-stage offsets, and its two-parts-a-block
//                assignment (every part of random part lists taken by exactly one block)
//   probe        one MMA with small integers: the fragment layout the kernels assume
//   width        for Q8_0, Q4_K, F16, BF16 at four shapes (K-slices 1, 4, 8, 16; rows not a multiple of
//                16/64/128), ncols in {1,2,3,5,8,9,16,17,64,256}, under every launch configuration
//                (auto, slices folded in the block, one or two slices a block, each with the partials
//                added inline by the tile's cluster and by the fold kernel, wide passes of 64, narrow
//                passes only, no scratch; phase 5's weight stages: phase 1's, forced ch 2/4/8 at 1-3
//                blocks an SM, 1/2/4 staged columns, grouped 1/2 n-tiles a block): every column
//                bit-identical to the 1-column run
//                of that column under phase 2's launch shape (phase 1's stages, fold kernel), also
//                with the columns permuted; the padding of Y untouched
//   grouped      random routings (1, 4, 8, 64 lanes x 6 routes over 16 experts, parts of <= 8 and
//                <= 3), each configuration: every pair bit-identical to mma_matvec of its expert on
//                its column alone (fold kernel); x_row null too; max_cols 1 (parts in pieces)
//   determinism  the same call twice, bit-identical
//   accuracy     against float64 dot products of the CPU dequantizer's weights (ext/cpu/quant.cpp):
//                |y - ref| <= 1e-5 * sum_k |w_k x_k| (+1e-30) per output; the worst ratio printed,
//                the old matvec's beside it
// Bench (d): the flash-l4 Q8_0 shapes at 1, 2, 4, 8, 16 and 256 columns and the grouped Q4_K
// experts (256 experts, 1/4/8/64/256/512 lanes x 6 routes), the old matvec / matvec_grouped beside
// mma_matvec / mma_matvec_grouped (default: partials added inline) and, where a call splits K over
// blocks, mma with the fold kernel (phase 2's shape): median of 20 replays of a CUDA graph (after warm-up), weights
// rotated over >= 512 MB of copies so they come from HBM. One JSON line per measurement to
// OUT/mma_bench.jsonl, a summary to stdout. Phase 5: at <= 8 columns and for every grouped call, the
// default (auto weight stages) beside each streaming variant and phase 1's stages (the old shape),
// with the stage shape each launched ("weight stages" table at the end).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common.cuh"
#include "ds4/kernels.h"
#include "bench_host.h"
#include "ds4_gpu.h"
#include "mma_matvec.cuh"

using ds4::DType;
using ds4::TensorView;
namespace g = ds4::gpu;

namespace {

int g_exact_failures = 0, g_accuracy_failures = 0;

void report(bool ok, bool exactness, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  std::fflush(stdout);
  if (!ok) ++(exactness ? g_exact_failures : g_accuracy_failures);
}

// --- host data ------------------------------------------------------------------------------------

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Valid weights with realistic scales: Q8_0 |d| in [1e-3, 2e-2] (both signs), random int8; Q4_K
// random 6-bit scales and mins, d in [1e-4, 2e-3], dmin = d * [0.5, 10]; F16/BF16 normal * 0.05
// with a few tiny values (F16 subnormals).
std::vector<uint8_t> random_weights(DType t, int64_t K, int64_t rows, Rng& rng) {
  const int64_t nb = K / ds4::block_elems(t) * rows, bb = ds4::block_bytes(t);
  std::vector<uint8_t> w(static_cast<size_t>(nb * bb));
  uint8_t* p = w.data();
  for (int64_t b = 0; b < nb; ++b, p += bb) {
    switch (t) {
      case DType::Q8_0: {
        const uint16_t d = f32_to_f16(static_cast<float>(rng.uniform(1e-3, 2e-2) * (rng.integer(0, 1) ? 1 : -1)));
        std::memcpy(p, &d, 2);
        for (int i = 0; i < 32; ++i) p[2 + i] = static_cast<uint8_t>(rng.integer(-128, 127));
        break;
      }
      case DType::Q4_K: {
        for (int i = 0; i < 144; ++i) p[i] = static_cast<uint8_t>(rng.integer(0, 255));
        const double d = rng.uniform(1e-4, 2e-3);
        const uint16_t dh = f32_to_f16(static_cast<float>(d));
        const uint16_t mh = f32_to_f16(static_cast<float>(d * rng.uniform(0.5, 10.0)));
        std::memcpy(p, &dh, 2);
        std::memcpy(p + 2, &mh, 2);
        break;
      }
      case DType::F16: {
        const float v = rng.integer(0, 99) == 0 ? rng.normal() * 1e-6f : rng.normal() * 0.05f;
        const uint16_t h = f32_to_f16(v);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::BF16: {
        const uint16_t h = f32_to_bf16(rng.normal() * 0.05f);
        std::memcpy(p, &h, 2);
        break;
      }
      default:
        throw std::logic_error("random_weights: type not covered");
    }
  }
  return w;
}


// Activation column c: normal, with columns of large (x1e3) and small (x1e-3) magnitude, spikes
// (x50 on 1% of elements), a one-hot column and an all-zero column.
void fill_column(float* x, int64_t K, int c, Rng& rng) {
  for (int64_t k = 0; k < K; ++k) x[k] = rng.normal();
  if (c == 6 || c == 13) {
    std::fill(x, x + K, 0.0f);
    if (c == 6) x[K / 3] = 1.5f;
    return;
  }
  const float scale = c % 7 == 3 ? 1e3f : c % 7 == 5 ? 1e-3f : 1.0f;
  for (int64_t k = 0; k < K; ++k) {
    if (rng.integer(0, 99) == 0) x[k] *= 50.0f;
    x[k] *= scale;
  }
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

constexpr uint32_t kSentinel = 0xffffffffu;  // a NaN no kernel produces

// --- device memory ----------------------------------------------------------------------------------

struct DeviceMem {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceMem(size_t n) : bytes(n) { DS4_GPU_CHECK(cudaMalloc(&p, n == 0 ? 16 : n)); }
  ~DeviceMem() { (void)cudaFree(p); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
  void upload(const void* h, size_t n) { DS4_GPU_CHECK(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice)); }
  void fill_sentinel() { DS4_GPU_CHECK(cudaMemset(p, 0xff, bytes)); }
};

template <class T>
std::vector<T> download(const DeviceMem& m, size_t n) {
  std::vector<T> h(n);
  DS4_GPU_CHECK(cudaDeviceSynchronize());
  DS4_GPU_CHECK(cudaMemcpy(h.data(), m.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

constexpr size_t kScratchBytes = size_t{256} << 20;

// --- the configurations every exactness check runs under -----------------------------------------

struct Config {
  const char* name;
  g::MmaConfig cfg;
  bool scratch;
  int max_width = 0;  // dense widths above it skipped (0: none): phase 5's settings change calls of <= 8 columns only
};
// kConfigs[0] is the default; kReference the launch shape of phase 2 (slices on separate blocks
// added by the fold kernel), the reference every configuration is compared with bit for bit.
// Fields: slices, wide, wide_nt, fold_inline, stream, stream_blocks, stream_cols, group_tiles
// (mma_matvec.cuh).
const Config kConfigs[] = {
    {"auto", {0, true, 4, true, 1, 0, 0}, true},
    {"fold-launch", {0, true, 4, false, 1, 0, 0}, true},
    {"slices-in-block", {1, true, 4, true, 1, 0, 0}, true},
    {"slice-per-block", {2, true, 4, true, 1, 0, 0}, true},
    {"slice-per-block fold-launch", {2, true, 4, false, 1, 0, 0}, true},
    {"two-slices-per-block", {3, true, 4, true, 1, 0, 0}, true},
    {"two-slices-per-block fold-launch", {3, true, 4, false, 1, 0, 0}, true},
    {"wide-nt8", {0, true, 8, true, 1, 0, 0}, true},
    {"narrow-only", {0, false, 4, true, 1, 0, 0}, true},
    {"no-scratch", {0, true, 4, true, 1, 0, 0}, false},
    // Phase 5's weight stages, forced (auto takes phase 1's where it keeps more bytes in flight).
    {"phase-1 stages", {0, true, 4, true, 0, 0, 0}, true, 16},
    {"stream ch2", {0, true, 4, false, 2, 3, 0}, true, 16},
    {"stream ch4 2 blocks", {0, true, 4, false, 4, 2, 0}, true, 16},
    {"stream ch8 1 block", {0, true, 4, false, 8, 1, 0}, true, 16},
    {"stream ch4 inline fold", {0, true, 4, true, 4, 3, 0}, true, 16},
    {"stream ch4 slice-per-block 1 col", {2, true, 4, false, 4, 3, 1}, true, 16},
    {"stream ch2 slices-in-block 2 cols", {1, true, 4, false, 2, 2, 2}, true, 16},
    {"stream ch4 no-scratch 4 cols", {0, true, 4, false, 4, 2, 4}, false, 16},
    {"stream group 2 tiles", {0, true, 4, true, 1, 0, 0, 2}, true, 16},
    {"stream group 2 tiles ch2 fold-launch", {0, true, 4, false, 2, 2, 0, 2}, true, 16},
    {"stream group 2 tiles slices-in-block", {1, true, 4, false, 4, 2, 0, 2}, true, 16},
    {"stream group 1 tile", {0, true, 4, false, 1, 0, 0, 1}, true, 16},
};
// Phase 2's launch shape: phase 1's stages, K-slices added by the fold kernel.
const g::MmaConfig kReference{0, true, 4, false, 0, 0, 0, 0};

// First element where got differs from want (bitwise) among n columns of rows (stride ldy);
// also the padding rows..ldy must still hold the sentinel. Returns false and prints on a mismatch.
bool compare_columns(const std::string& what, const std::vector<float>& got, const std::vector<float>& want_all,
                     const std::vector<int>& col_of, int64_t rows, int64_t ldy) {
  for (size_t j = 0; j < col_of.size(); ++j) {
    const int c = col_of[j];
    for (int64_t r = 0; r < ldy; ++r) {
      const float gv = got[j * ldy + r];
      if (r >= rows) {
        if (bits_of(gv) != kSentinel) {
          std::printf("      %s: column %zu wrote past its rows (row %" PRId64 " of ldy %" PRId64 ")\n", what.c_str(), j, r, ldy);
          return false;
        }
        continue;
      }
      const float wv = want_all[static_cast<size_t>(c) * ldy + r];
      if (bits_of(gv) != bits_of(wv)) {
        std::printf("      %s: first mismatch at column %zu (source column %d), row %" PRId64 ": got %.9g (0x%08x), "
                    "1-column run %.9g (0x%08x)\n",
                    what.c_str(), j, c, r, gv, bits_of(gv), wv, bits_of(wv));
        return false;
      }
    }
  }
  return true;
}

// --- checks -------------------------------------------------------------------------------------------

struct Shape {
  int64_t K, rows;
};

void check_decode(uint64_t seed) {
  std::string first;
  const int bad = g::testing::mma_decode_selftest(seed, &first);
  report(bad == 0, true,
         "decode (host): the kernels' stage copy and decoders equal the CPU dequantizer for Q8_0, Q4_K, F16, BF16" +
             (bad ? " (" + std::to_string(bad) + " wrong; first: " + first + ")" : std::string()));
}

void check_probe() {
  std::string first;
  const int bad = g::testing::mma_layout_probe(&first);
  report(bad == 0, true,
         "probe: one m16n8k8 tf32 MMA with the kernels' fragment layout equals the exact product" +
             (bad ? " (" + std::to_string(bad) + " of 128 wrong; first: " + first + ")" : std::string()));
}

// Width exactness, determinism and accuracy of one (type, shape).
void check_dense(DType t, Shape sh, const std::vector<int>& widths, bool quick, Rng& rng, DeviceMem& scratch) {
  const int64_t K = sh.K, rows = sh.rows, ldx = K + 4, ldy = rows + 5;
  constexpr int kCols = 256;
  const std::vector<uint8_t> wh = random_weights(t, K, rows, rng);
  DeviceMem wd(wh.size());
  wd.upload(wh.data(), wh.size());
  const TensorView W = view(t, K, rows, wd.p);
  std::vector<float> xh(static_cast<size_t>(kCols) * ldx, 0.0f);
  for (int c = 0; c < kCols; ++c) fill_column(&xh[static_cast<size_t>(c) * ldx], K, c, rng);
  DeviceMem xd(xh.size() * sizeof(float)), xp(xh.size() * sizeof(float));
  xd.upload(xh.data(), xh.size() * sizeof(float));
  DeviceMem yd(static_cast<size_t>(kCols) * ldy * sizeof(float)), ys(static_cast<size_t>(kCols) * ldy * sizeof(float));
  char tag[160];
  std::snprintf(tag, sizeof(tag), "%s K=%" PRId64 " rows=%" PRId64 " (KS %d)", ds4::dtype_name(t), K, rows, g::mma_kslices(W));

  // The 1-column runs under phase 2's launch shape: the reference of every width and configuration.
  g::set_mma_config(kReference);
  ys.fill_sentinel();
  for (int c = 0; c < kCols; ++c)
    g::mma_matvec(W, xd.as<float>() + static_cast<int64_t>(c) * ldx, 1, ldx, ys.as<float>() + static_cast<int64_t>(c) * ldy, ldy,
                  nullptr, scratch.as<float>(), scratch.bytes);
  const std::vector<float> single = download<float>(ys, static_cast<size_t>(kCols) * ldy);
  int non_finite = 0;
  for (int c = 0; c < kCols; ++c)
    for (int64_t r = 0; r < rows; ++r) non_finite += !std::isfinite(single[static_cast<size_t>(c) * ldy + r]);
  report(non_finite == 0, true, std::string("width ") + tag + ": every 1-column output written and finite (" +
                                    std::to_string(non_finite) + " not)");
  if (non_finite != 0) return;

  // Every width, every configuration, plain and permuted columns.
  std::vector<int> perm(kCols);
  for (const Config& cf : kConfigs) {
    g::set_mma_config(cf.cfg);
    int bad_runs = 0, runs = 0;
    for (int n : widths) {
      if (cf.max_width > 0 && n > cf.max_width) continue;
      for (int permuted = 0; permuted < 2; ++permuted) {
        std::vector<int> col_of(n);
        const DeviceMem* src = &xd;
        if (permuted) {
          for (int c = 0; c < kCols; ++c) perm[c] = c;
          std::shuffle(perm.begin(), perm.end(), rng.gen);
          std::vector<float> sel(static_cast<size_t>(n) * ldx);
          for (int j = 0; j < n; ++j) {
            col_of[j] = perm[j];
            std::memcpy(&sel[static_cast<size_t>(j) * ldx], &xh[static_cast<size_t>(perm[j]) * ldx], ldx * sizeof(float));
          }
          xp.upload(sel.data(), sel.size() * sizeof(float));
          src = &xp;
        } else {
          for (int j = 0; j < n; ++j) col_of[j] = j;
        }
        yd.fill_sentinel();
        g::mma_matvec(W, src->as<float>(), n, ldx, yd.as<float>(), ldy, nullptr, cf.scratch ? scratch.as<float>() : nullptr,
                      cf.scratch ? scratch.bytes : 0);
        const std::vector<float> got = download<float>(yd, static_cast<size_t>(n) * ldy);
        char what[220];
        std::snprintf(what, sizeof(what), "%s [%s] ncols=%d%s", tag, cf.name, n, permuted ? " permuted" : "");
        ++runs;
        if (!compare_columns(what, got, single, col_of, rows, ldy)) ++bad_runs;
      }
    }
    report(bad_runs == 0, true,
           std::string("width ") + tag + " [" + cf.name + "]: " + std::to_string(runs) +
               " runs (widths x plain/permuted), every column equal to its 1-column run: " + std::to_string(bad_runs) +
               " runs differ");
  }
  g::set_mma_config(kConfigs[0].cfg);

  // Determinism: the widest call twice.
  {
    const int n = widths.back();
    yd.fill_sentinel();
    g::mma_matvec(W, xd.as<float>(), n, ldx, yd.as<float>(), ldy, nullptr, scratch.as<float>(), scratch.bytes);
    const std::vector<float> a = download<float>(yd, static_cast<size_t>(n) * ldy);
    yd.fill_sentinel();
    g::mma_matvec(W, xd.as<float>(), n, ldx, yd.as<float>(), ldy, nullptr, scratch.as<float>(), scratch.bytes);
    const std::vector<float> b = download<float>(yd, static_cast<size_t>(n) * ldy);
    report(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0, true,
           std::string("determinism ") + tag + ": the same " + std::to_string(n) + "-column call twice, bit-identical");
  }

  // Accuracy: the first 32 columns (all the special ones) against float64 over the CPU's weights;
  // the old matvec on the same columns for comparison.
  const int na = quick ? 16 : 32;
  std::vector<float> wf(static_cast<size_t>(rows) * K);
  const int64_t rb = W.row_bytes();
  for (int64_t r = 0; r < rows; ++r) ds4::dequantize_row(t, wh.data() + r * rb, &wf[static_cast<size_t>(r) * K], K);
  DeviceMem yo(static_cast<size_t>(na) * ldy * sizeof(float));
  g::matvec(W, xd.as<float>(), na, ldx, yo.as<float>(), ldy, nullptr);
  const std::vector<float> old = download<float>(yo, static_cast<size_t>(na) * ldy);
  double worst = 0.0, worst_old = 0.0;
  int64_t bad = 0;
  std::string first_bad;
  for (int c = 0; c < na; ++c) {
    const float* x = &xh[static_cast<size_t>(c) * ldx];
    for (int64_t r = 0; r < rows; ++r) {
      const float* w = &wf[static_cast<size_t>(r) * K];
      double ref = 0.0, mag = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(w[k]) * static_cast<double>(x[k]);
        ref += p;
        mag += std::fabs(p);
      }
      const double y = single[static_cast<size_t>(c) * ldy + r];
      const double ratio = std::fabs(y - ref) / (mag + 1e-30);
      const double ratio_old = std::fabs(static_cast<double>(old[static_cast<size_t>(c) * ldy + r]) - ref) / (mag + 1e-30);
      worst = std::max(worst, ratio);
      worst_old = std::max(worst_old, ratio_old);
      if (!(std::fabs(y - ref) <= 1e-5 * mag + 1e-30)) {
        if (bad == 0) {
          char b[200];
          std::snprintf(b, sizeof(b), " (first: column %d row %" PRId64 ": %.9g, reference %.12g, sum|wx| %.6g)", c, r, y, ref, mag);
          first_bad = b;
        }
        ++bad;
      }
    }
  }
  char buf[300];
  std::snprintf(buf, sizeof(buf), "accuracy %s: %d columns, worst |y - ref| / sum|wx| = %.3g (bound 1e-5; old matvec %.3g), %" PRId64 " over",
                tag, na, worst, worst_old, bad);
  report(bad == 0, false, buf + first_bad);
}

// Grouped: every pair equal to the single-column mma_matvec of its expert, every configuration.
void check_grouped(DType t, Shape sh, int n_expert, const std::vector<int>& lane_counts, Rng& rng, DeviceMem& scratch) {
  const int64_t K = sh.K, rows = sh.rows, ldx = K + 4, ldy = rows + 3;
  const std::vector<uint8_t> wh = random_weights(t, K, rows * n_expert, rng);
  DeviceMem wd(wh.size());
  wd.upload(wh.data(), wh.size());
  const TensorView W = view(t, K, rows, wd.p, n_expert);
  char tag[160];
  std::snprintf(tag, sizeof(tag), "%s K=%" PRId64 " rows=%" PRId64 " x%d experts (KS %d)", ds4::dtype_name(t), K, rows, n_expert,
                g::mma_kslices(W));
  for (int lanes : lane_counts) {
    for (int max_part : {8, 3}) {
      const Routes routes = random_routes(lanes, n_expert, 6, n_expert / 2, rng);
      const int n_pairs = static_cast<int>(routes.expert.size());
      std::vector<float> xh(static_cast<size_t>(lanes) * ldx, 0.0f);
      for (int l = 0; l < lanes; ++l) fill_column(&xh[static_cast<size_t>(l) * ldx], K, l, rng);
      DeviceMem xd(xh.size() * sizeof(float)), pe(n_pairs * sizeof(int32_t)), xr(n_pairs * sizeof(int32_t)),
          sorted(n_pairs * sizeof(int32_t)), parts(n_pairs * sizeof(g::ExpertPart)), nparts(sizeof(int32_t)),
          yd(static_cast<size_t>(n_pairs) * ldy * sizeof(float)), ys(static_cast<size_t>(n_pairs) * ldy * sizeof(float));
      xd.upload(xh.data(), xh.size() * sizeof(float));
      pe.upload(routes.expert.data(), n_pairs * sizeof(int32_t));
      xr.upload(routes.lane.data(), n_pairs * sizeof(int32_t));
      g::build_expert_parts(pe.as<int32_t>(), n_pairs, n_expert, max_part, sorted.as<int32_t>(), parts.as<g::ExpertPart>(),
                            nparts.as<int32_t>(), nullptr);
      // References: pair p alone = mma_matvec of its expert on its lane's column (phase 2's shape).
      g::set_mma_config(kReference);
      ys.fill_sentinel();
      for (int p = 0; p < n_pairs; ++p)
        g::mma_matvec(W.expert(routes.expert[p]), xd.as<float>() + static_cast<int64_t>(routes.lane[p]) * ldx, 1, ldx,
                      ys.as<float>() + static_cast<int64_t>(p) * ldy, ldy, nullptr, scratch.as<float>(), scratch.bytes);
      const std::vector<float> single = download<float>(ys, static_cast<size_t>(n_pairs) * ldy);
      std::vector<int> col_of(n_pairs);
      for (int p = 0; p < n_pairs; ++p) col_of[p] = p;
      int bad = 0, runs = 0;
      for (const Config& cf : kConfigs) {
        if (cf.cfg.wide_nt != 4 || !cf.cfg.wide) continue;  // the grouped kernel has no wide form
        g::set_mma_config(cf.cfg);
        yd.fill_sentinel();
        g::mma_matvec_grouped(W, parts.as<g::ExpertPart>(), nparts.as<int32_t>(), n_pairs, sorted.as<int32_t>(), xr.as<int32_t>(),
                              xd.as<float>(), ldx, yd.as<float>(), ldy, nullptr, std::min(lanes, 8),
                              cf.scratch ? scratch.as<float>() : nullptr, cf.scratch ? scratch.bytes : 0);
        const std::vector<float> got = download<float>(yd, static_cast<size_t>(n_pairs) * ldy);
        char what[260];
        std::snprintf(what, sizeof(what), "grouped %s [%s] %d lanes, parts<=%d", tag, cf.name, lanes, max_part);
        ++runs;
        if (!compare_columns(what, got, single, col_of, rows, ldy)) ++bad;
      }
      // max_cols 1 under the streaming stages: every part of more than one pair runs in pieces of one.
      {
        g::MmaConfig c1 = kConfigs[0].cfg;
        c1.stream = 2;
        c1.group_tiles = 1;
        g::set_mma_config(c1);
        yd.fill_sentinel();
        g::mma_matvec_grouped(W, parts.as<g::ExpertPart>(), nparts.as<int32_t>(), n_pairs, sorted.as<int32_t>(), xr.as<int32_t>(),
                              xd.as<float>(), ldx, yd.as<float>(), ldy, nullptr, 1, scratch.as<float>(), scratch.bytes);
        const std::vector<float> got = download<float>(yd, static_cast<size_t>(n_pairs) * ldy);
        char what[260];
        std::snprintf(what, sizeof(what), "grouped %s [stream ch2, max_cols 1: %s] %d lanes, parts<=%d", tag,
                      g::testing::mma_last_launch().c_str(), lanes, max_part);
        ++runs;
        if (!compare_columns(what, got, single, col_of, rows, ldy)) ++bad;
      }
      // x_row null: X holds one row per pair.
      {
        g::set_mma_config(kConfigs[0].cfg);
        std::vector<float> xpair(static_cast<size_t>(n_pairs) * ldx);
        for (int p = 0; p < n_pairs; ++p)
          std::memcpy(&xpair[static_cast<size_t>(p) * ldx], &xh[static_cast<size_t>(routes.lane[p]) * ldx], ldx * sizeof(float));
        DeviceMem xpd(xpair.size() * sizeof(float));
        xpd.upload(xpair.data(), xpair.size() * sizeof(float));
        yd.fill_sentinel();
        g::mma_matvec_grouped(W, parts.as<g::ExpertPart>(), nparts.as<int32_t>(), n_pairs, sorted.as<int32_t>(), nullptr,
                              xpd.as<float>(), ldx, yd.as<float>(), ldy, nullptr, 8, scratch.as<float>(), scratch.bytes);
        const std::vector<float> got = download<float>(yd, static_cast<size_t>(n_pairs) * ldy);
        char what[260];
        std::snprintf(what, sizeof(what), "grouped %s [x_row null] %d lanes, parts<=%d", tag, lanes, max_part);
        ++runs;
        if (!compare_columns(what, got, single, col_of, rows, ldy)) ++bad;
      }
      char buf[300];
      std::snprintf(buf, sizeof(buf), "grouped %s: %d lanes x 6 routes, parts<=%d, %d runs: every pair equal to its expert's 1-column mma_matvec (%d runs differ)",
                    tag, lanes, max_part, runs, bad);
      report(bad == 0, true, buf);
    }
  }
  g::set_mma_config(kConfigs[0].cfg);
}

int run_checks(bool quick, Rng& rng) {
  DeviceMem scratch(kScratchBytes);
  check_probe();
  const int cl = g::testing::mma_fold_cluster_limit();
  std::printf("%s  fold inline: clusters of up to %d blocks (KS 16 takes 16 for one slice a block; 1: no clusters, so the\n"
              "      inline configurations run the fold kernel and check nothing new)\n",
              cl > 1 ? "note" : "WARN", cl);
  const std::vector<Shape> shapes = quick ? std::vector<Shape>{{1024, 200}, {4096, 520}, {512, 16400}}
                                          : std::vector<Shape>{{1024, 200}, {2048, 1000}, {4096, 520}, {512, 16400}};
  const std::vector<int> widths = quick ? std::vector<int>{1, 3, 9, 17, 64} : std::vector<int>{1, 2, 3, 5, 8, 9, 16, 17, 64, 256};
  for (DType t : {DType::Q8_0, DType::Q4_K, DType::F16, DType::BF16})
    for (const Shape& s : shapes) check_dense(t, s, widths, quick, rng, scratch);
  const std::vector<int> lanes = quick ? std::vector<int>{1, 8} : std::vector<int>{1, 4, 8, 64};
  for (DType t : {DType::Q4_K, DType::Q8_0, DType::F16, DType::BF16}) {
    check_grouped(t, {1024, 200}, 16, lanes, rng, scratch);
    if (!quick && t == DType::Q4_K) check_grouped(t, {2048, 1000}, 16, lanes, rng, scratch);
  }
  return 0;
}

// --- bench ----------------------------------------------------------------------------------------------

// Seconds per call: op(s, i) captured `per` times into one graph (per chosen so a replay takes
// about 2 ms), replayed 3 times to warm up, then 20 timed replays; the median.
double time_op(const std::function<void(cudaStream_t, int)>& op) {
  // Two eager runs size the graph: about 2 ms of launches (1..256) per replay.
  cudaStream_t s;
  DS4_GPU_CHECK(cudaStreamCreate(&s));
  cudaEvent_t a, b;
  DS4_GPU_CHECK(cudaEventCreate(&a));
  DS4_GPU_CHECK(cudaEventCreate(&b));
  op(s, 0);
  DS4_GPU_CHECK(cudaEventRecord(a, s));
  op(s, 1);
  DS4_GPU_CHECK(cudaEventRecord(b, s));
  DS4_GPU_CHECK(cudaEventSynchronize(b));
  float ms = 0.0f;
  DS4_GPU_CHECK(cudaEventElapsedTime(&ms, a, b));
  DS4_GPU_CHECK(cudaEventDestroy(a));
  DS4_GPU_CHECK(cudaEventDestroy(b));
  DS4_GPU_CHECK(cudaStreamDestroy(s));
  const int per = std::clamp(static_cast<int>(2.0 / std::max(ms, 1e-3f)), 1, 256);
  return time_launches(op, per, 20, 3);
}

double copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  DeviceMem a(bytes), b(bytes);
  DS4_GPU_CHECK(cudaMemset(a.p, 1, bytes));
  const double s = time_op([&](cudaStream_t st, int) {
    DS4_GPU_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, st));
  });
  return 2.0 * static_cast<double>(bytes) / s;
}

// Copies of a weight matrix (>= 512 MB in all, at most 64), so each timed call reads from HBM.
struct WeightSet {
  std::vector<std::unique_ptr<DeviceMem>> copies;
  TensorView base;
  WeightSet(DType t, int64_t K, int64_t rows, int64_t experts, uint64_t seed) {
    const std::vector<uint8_t> host = fast_weights(t, K, rows * experts, seed);
    base = view(t, K, rows, nullptr, experts);
    const size_t bytes = host.size();
    const size_t n = std::max<size_t>(1, std::min<size_t>(64, (size_t{512} << 20) / bytes));
    for (size_t i = 0; i < n; ++i) {
      copies.push_back(std::make_unique<DeviceMem>(bytes));
      copies.back()->upload(host.data(), bytes);
    }
  }
  TensorView at(int i) const {
    TensorView v = base;
    v.data = copies[static_cast<size_t>(i) % copies.size()]->as<uint8_t>();
    return v;
  }
};

struct Row {
  std::string bench, shape, impl;
  int64_t K, rows;
  int ncols;
  double us, gbs, tflops, extra;
};

std::FILE* g_json = nullptr;

// "12.3 us", or "-" for a time not taken (0).
std::string us_or_dash(double seconds) {
  if (!(seconds > 0.0)) return "-";
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f us", seconds * 1e6);
  return b;
}

void emit(const Row& r) {
  if (g_json != nullptr) {
    std::fprintf(g_json,
                 "{\"bench\":\"%s\",\"shape\":\"%s\",\"K\":%" PRId64 ",\"rows\":%" PRId64 ",\"ncols\":%d,\"impl\":\"%s\","
                 "\"us\":%.3f,\"weight_gbs\":%.1f,\"tflops\":%.3f,\"max_rel_diff_vs_old\":%.3g}\n",
                 r.bench.c_str(), r.shape.c_str(), r.K, r.rows, r.ncols, r.impl.c_str(), r.us, r.gbs, r.tflops, r.extra);
    std::fflush(g_json);
  }
}

// Phase 5: the weight-stage variants timed beside the default at <= 8 columns (dense) and for the
// grouped form: MmaConfig's stream / stream_blocks / stream_cols (the same bits under each; the
// exactness checks compare them). "phase-1" is the old shape.
struct StreamVariant {
  const char* name;
  int stream, blocks, cols, tiles;
};
const StreamVariant kStreamVariants[] = {
    {"phase-1", 0, 0, 0, 0},   {"ch2", 2, 3, 0, 0},       {"ch4", 4, 3, 0, 0},       {"ch2/2blk", 2, 2, 0, 0},
    {"ch4/2blk", 4, 2, 0, 0},  {"ch8/1blk", 8, 1, 0, 0},  {"ch2/4cols", 2, 3, 4, 0}, {"ch4/2cols", 4, 3, 2, 0},
    {"1tile", 1, 0, 0, 1},     {"2tiles", 1, 0, 0, 2},    {"8cols", 1, 0, 8, 0},
};
std::vector<std::string> g_stream_summary;

// Times op under each variant (grouped: the *cols ones too; dense: they change nothing) after the
// default's run, whose shape `auto_shape` names; a JSON line each, one summary line.
void time_stream_variants(const std::string& bench, const std::string& name, int64_t K, int64_t rows, int ncols, double bytes,
                          double flops, double s_auto, const std::string& auto_shape,
                          const std::function<void(cudaStream_t, int)>& op) {
  const g::MmaConfig keep = g::mma_config();
  char line[2048];
  int n = std::snprintf(line, sizeof(line), "  %-8s %-30s %s %4d  auto %8.1f us (%s)", bench.c_str(), name.c_str(),
                        bench == "grouped" ? "lanes" : "cols ", ncols, s_auto * 1e6, auto_shape.c_str());
  double best = s_auto;
  std::string best_name = "auto";
  for (const StreamVariant& v : kStreamVariants) {
    if (bench != "grouped" && (v.cols != 0 || v.tiles != 0)) continue;
    g::MmaConfig c = keep;
    c.stream = v.stream;
    c.stream_blocks = v.blocks;
    c.stream_cols = v.cols;
    c.group_tiles = v.tiles;
    g::set_mma_config(c);
    const double sv = time_op(op);
    const std::string shape = g::testing::mma_last_launch();
    const Row r{bench, name, std::string("mma-stream-") + v.name, K, rows, ncols, sv * 1e6, bytes / sv / 1e9, flops / sv / 1e12, 0.0};
    emit(r);
    if (g_json != nullptr) {
      std::fprintf(g_json, "{\"bench\":\"stream-shape\",\"shape\":\"%s\",\"ncols\":%d,\"variant\":\"%s\",\"stages\":\"%s\"}\n",
                   name.c_str(), ncols, v.name, shape.c_str());
    }
    if (n > 0 && n < static_cast<int>(sizeof(line)))
      n += std::snprintf(line + n, sizeof(line) - n, "  %s %.1f", v.name, sv * 1e6);
    if (sv < best) {
      best = sv;
      best_name = std::string(v.name) + " (" + shape + ")";
    }
  }
  g::set_mma_config(keep);
  std::printf("%s\n", line);
  g_stream_summary.push_back(std::string(line) + "\n      fastest: " + best_name);
  std::fflush(stdout);
}

// Largest |new - old| over the outputs, relative to the largest |old| of the output's column: a
// sanity check of the bench runs themselves (the exactness checks above are the real ones).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b, int ncols, int64_t rows) {
  double worst = 0.0;
  for (int c = 0; c < ncols; ++c) {
    double mx = 0.0, d = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const size_t i = static_cast<size_t>(c) * rows + r;
      mx = std::max(mx, std::fabs(static_cast<double>(b[i])));
      d = std::max(d, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    }
    worst = std::max(worst, d / (mx + 1e-30));
  }
  return worst;
}

void bench_dense(const std::string& name, int64_t K, int64_t rows, std::vector<Row>& out, int* sanity_bad) {
  const DType t = DType::Q8_0;
  const WeightSet ws(t, K, rows, 1, 1234 + static_cast<uint64_t>(rows));
  constexpr int kMax = 256;
  std::vector<float> xh(static_cast<size_t>(kMax) * K);
  Rng rng(99);
  for (int c = 0; c < kMax; ++c) fill_column(&xh[static_cast<size_t>(c) * K], K, c == 6 || c == 13 ? c + 1 : c, rng);
  DeviceMem x(xh.size() * sizeof(float)), y(static_cast<size_t>(kMax) * rows * sizeof(float)),
      y2(static_cast<size_t>(kMax) * rows * sizeof(float));
  x.upload(xh.data(), xh.size() * sizeof(float));
  const size_t sb = g::mma_matvec_scratch_bytes(ws.base, kMax);
  DeviceMem scratch(sb);
  const double wbytes = static_cast<double>(ws.base.row_bytes()) * rows;
  const bool tall = rows >= 16384;
  for (int nc : {1, 2, 4, 8, 16, 256}) {
    const double flops = 2.0 * static_cast<double>(rows) * K * nc;
    const double s_old = time_op([&](cudaStream_t st, int i) {
      g::matvec(ws.at(i), x.as<float>(), nc, K, y.as<float>(), rows, st, tall);
    });
    const double s_new = time_op([&](cudaStream_t st, int i) {
      g::mma_matvec(ws.at(i), x.as<float>(), nc, K, y2.as<float>(), rows, st, scratch.as<float>(), sb);
    });
    if (nc <= 8)
      time_stream_variants("dense", name, K, rows, nc, wbytes, flops, s_new, g::testing::mma_last_launch(),
                           [&](cudaStream_t st, int i) {
                             g::mma_matvec(ws.at(i), x.as<float>(), nc, K, y2.as<float>(), rows, st, scratch.as<float>(), sb);
                           });
    // The fold kernel instead (phase 2's launch shape) where the call splits K over blocks.
    double s_launch = 0.0;
    if (nc <= 16 && g::mma_kslices(ws.base) > 1) {
      const g::MmaConfig keep = g::mma_config();
      g::MmaConfig fl = keep;
      fl.fold_inline = false;
      g::set_mma_config(fl);
      s_launch = time_op([&](cudaStream_t st, int i) {
        g::mma_matvec(ws.at(i), x.as<float>(), nc, K, y2.as<float>(), rows, st, scratch.as<float>(), sb);
      });
      g::set_mma_config(keep);
    }
    // One more call of each on copy 0, then the sanity comparison.
    g::matvec(ws.at(0), x.as<float>(), nc, K, y.as<float>(), rows, nullptr, tall);
    g::mma_matvec(ws.at(0), x.as<float>(), nc, K, y2.as<float>(), rows, nullptr, scratch.as<float>(), sb);
    const std::vector<float> yo = download<float>(y, static_cast<size_t>(nc) * rows);
    const std::vector<float> yn = download<float>(y2, static_cast<size_t>(nc) * rows);
    const double rd = rel_diff(yn, yo, nc, rows);
    if (!(rd <= 1e-3)) {
      ++*sanity_bad;
      std::printf("FAIL  bench %s ncols=%d: mma output differs from the old matvec by %.3g of the column's largest value\n",
                  name.c_str(), nc, rd);
    }
    const Row ro{"dense", name, "matvec", K, rows, nc, s_old * 1e6, wbytes / s_old / 1e9, flops / s_old / 1e12, 0.0};
    const Row rn{"dense", name, "mma", K, rows, nc, s_new * 1e6, wbytes / s_new / 1e9, flops / s_new / 1e12, rd};
    emit(ro);
    emit(rn);
    out.push_back(ro);
    out.push_back(rn);
    if (s_launch > 0.0) {
      const Row rl{"dense", name, "mma-fold-launch", K, rows, nc, s_launch * 1e6, wbytes / s_launch / 1e9, flops / s_launch / 1e12, 0.0};
      emit(rl);
      out.push_back(rl);
    }
    if (nc == 256) {  // the wide passes of 64 beside the default 32
      const g::MmaConfig keep = g::mma_config();
      g::MmaConfig c8 = keep;
      c8.wide_nt = 8;
      g::set_mma_config(c8);
      const double s8 = time_op([&](cudaStream_t st, int i) {
        g::mma_matvec(ws.at(i), x.as<float>(), nc, K, y2.as<float>(), rows, st, scratch.as<float>(), sb);
      });
      g::set_mma_config(keep);
      const Row r8{"dense", name, "mma-nt8", K, rows, nc, s8 * 1e6, wbytes / s8 / 1e9, flops / s8 / 1e12, 0.0};
      emit(r8);
      out.push_back(r8);
    }
    std::printf("  %-28s ncols %3d: matvec %9.1f us   mma %9.1f us   x%.2f   mma %7.1f GB/s %7.2f TFLOP/s   fold-launch %s\n",
                name.c_str(), nc, s_old * 1e6, s_new * 1e6, s_old / s_new, wbytes / s_new / 1e9, flops / s_new / 1e12,
                us_or_dash(s_launch).c_str());
    std::fflush(stdout);
  }
}

// Grouped Q4_K experts: `lanes` lanes x 6 routes over 256 experts; 16 routings planned on the device,
// cycled by the timed calls; bytes = the distinct experts a routing reads.
void bench_grouped(const std::string& name, int64_t K, int64_t rows, const std::vector<int>& lane_counts,
                   std::vector<Row>& out, int* sanity_bad) {
  const DType t = DType::Q4_K;
  constexpr int kExperts = 256, kPerLane = 6, kSets = 16;
  const WeightSet ws(t, K, rows, kExperts, 777 + static_cast<uint64_t>(K));
  const double ebytes = static_cast<double>(ws.base.row_bytes()) * rows;
  Rng rng(4242);
  for (int lanes : lane_counts) {
    const int n_pairs = lanes * kPerLane;
    std::vector<float> xh(static_cast<size_t>(lanes) * K);
    for (int l = 0; l < lanes; ++l) fill_column(&xh[static_cast<size_t>(l) * K], K, l == 6 || l == 13 ? l + 1 : l, rng);
    DeviceMem x(xh.size() * sizeof(float)), xr(n_pairs * sizeof(int32_t)), y(static_cast<size_t>(n_pairs) * rows * sizeof(float)),
        y2(static_cast<size_t>(n_pairs) * rows * sizeof(float));
    x.upload(xh.data(), xh.size() * sizeof(float));
    std::vector<int32_t> xrh(n_pairs);
    for (int p = 0; p < n_pairs; ++p) xrh[p] = p / kPerLane;
    xr.upload(xrh.data(), n_pairs * sizeof(int32_t));
    std::vector<std::unique_ptr<DeviceMem>> keep;
    std::vector<int32_t*> sorted(kSets), nparts(kSets);
    std::vector<g::ExpertPart*> parts(kSets);
    double distinct = 0.0;
    for (int k = 0; k < kSets; ++k) {
      const Routes r = random_routes(lanes, kExperts, kPerLane, 0, rng);
      std::vector<char> seen(kExperts, 0);
      for (int32_t e : r.expert) seen[e] = 1;
      distinct += static_cast<double>(std::count(seen.begin(), seen.end(), 1));
      keep.push_back(std::make_unique<DeviceMem>(n_pairs * sizeof(int32_t)));
      keep.back()->upload(r.expert.data(), n_pairs * sizeof(int32_t));
      const int32_t* pe = keep.back()->as<int32_t>();
      keep.push_back(std::make_unique<DeviceMem>(n_pairs * sizeof(int32_t)));
      sorted[k] = keep.back()->as<int32_t>();
      keep.push_back(std::make_unique<DeviceMem>(n_pairs * sizeof(g::ExpertPart)));
      parts[k] = keep.back()->as<g::ExpertPart>();
      keep.push_back(std::make_unique<DeviceMem>(sizeof(int32_t)));
      nparts[k] = keep.back()->as<int32_t>();
      g::build_expert_parts(pe, n_pairs, kExperts, 8, sorted[k], parts[k], nparts[k], nullptr);
    }
    DS4_GPU_CHECK(cudaDeviceSynchronize());
    const double bytes = distinct / kSets * ebytes;
    const double flops = 2.0 * static_cast<double>(n_pairs) * rows * K;
    // Scratch for the sliced path where the launcher would take it (decode-sized steps).
    const size_t sb = n_pairs <= 64 ? g::mma_grouped_scratch_bytes(ws.base, n_pairs) : 0;
    DeviceMem scratch(sb);
    const int maxc = std::min(lanes, 8);
    const double s_old = time_op([&](cudaStream_t st, int i) {
      const int k = i % kSets;
      g::matvec_grouped(ws.at(i), parts[k], nparts[k], n_pairs, sorted[k], xr.as<int32_t>(), x.as<float>(), K, y.as<float>(),
                        rows, st, maxc);
    });
    auto run_new = [&](cudaStream_t st, int i) {
      const int k = i % kSets;
      g::mma_matvec_grouped(ws.at(i), parts[k], nparts[k], n_pairs, sorted[k], xr.as<int32_t>(), x.as<float>(), K,
                            y2.as<float>(), rows, st, maxc, sb ? scratch.as<float>() : nullptr, sb);
    };
    const double s_new = time_op(run_new);
    time_stream_variants("grouped", name, K, rows, lanes, bytes, flops, s_new, g::testing::mma_last_launch(), run_new);
    double s_launch = 0.0;  // the fold kernel instead, where the sliced path is taken (scratch given)
    if (sb > 0) {
      const g::MmaConfig keep = g::mma_config();
      g::MmaConfig fl = keep;
      fl.fold_inline = false;
      g::set_mma_config(fl);
      s_launch = time_op(run_new);
      g::set_mma_config(keep);
    }
    g::matvec_grouped(ws.at(0), parts[0], nparts[0], n_pairs, sorted[0], xr.as<int32_t>(), x.as<float>(), K, y.as<float>(), rows,
                      nullptr, maxc);
    g::mma_matvec_grouped(ws.at(0), parts[0], nparts[0], n_pairs, sorted[0], xr.as<int32_t>(), x.as<float>(), K, y2.as<float>(),
                          rows, nullptr, maxc, sb ? scratch.as<float>() : nullptr, sb);
    const std::vector<float> yo = download<float>(y, static_cast<size_t>(n_pairs) * rows);
    const std::vector<float> yn = download<float>(y2, static_cast<size_t>(n_pairs) * rows);
    const double rd = rel_diff(yn, yo, n_pairs, rows);
    if (!(rd <= 1e-3)) {
      ++*sanity_bad;
      std::printf("FAIL  bench %s %d lanes: mma output differs from the old matvec_grouped by %.3g\n", name.c_str(), lanes, rd);
    }
    const Row ro{"grouped", name, "matvec", K, rows, lanes, s_old * 1e6, bytes / s_old / 1e9, flops / s_old / 1e12, 0.0};
    const Row rn{"grouped", name, "mma", K, rows, lanes, s_new * 1e6, bytes / s_new / 1e9, flops / s_new / 1e12, rd};
    emit(ro);
    emit(rn);
    out.push_back(ro);
    out.push_back(rn);
    if (s_launch > 0.0) {
      const Row rl{"grouped", name, "mma-fold-launch", K, rows, lanes, s_launch * 1e6, bytes / s_launch / 1e9, flops / s_launch / 1e12, 0.0};
      emit(rl);
      out.push_back(rl);
    }
    std::printf("  %-28s lanes %3d: matvec %9.1f us   mma %9.1f us   x%.2f   mma %7.1f GB/s %7.2f TFLOP/s   fold-launch %s\n",
                name.c_str(), lanes, s_old * 1e6, s_new * 1e6, s_old / s_new, bytes / s_new / 1e9, flops / s_new / 1e12,
                us_or_dash(s_launch).c_str());
    std::fflush(stdout);
  }
}

int run_bench(const std::string& out_dir, bool quick) {
  g::matvec_prepare();
  g::mma_prepare();
  const std::string path = out_dir + "/mma_bench.jsonl";
  g_json = std::fopen(path.c_str(), "w");
  if (g_json == nullptr) std::printf("warning: cannot write %s; JSON to stdout only\n", path.c_str());
  const double bw = copy_bandwidth();
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", bw / 1e9);
  if (g_json != nullptr) std::fprintf(g_json, "{\"bench\":\"copy\",\"gbs\":%.1f}\n", bw / 1e9);
  std::vector<Row> rows;
  int sanity_bad = 0;
  struct D {
    const char* name;
    int64_t K, rows;
  };
  const std::vector<D> dense = {{"q_a Q8_0 [4096->1024]", 4096, 1024},         {"kv Q8_0 [4096->512]", 4096, 512},
                                {"q_b Q8_0 [1024->32768]", 1024, 32768},       {"shexp gate Q8_0 [4096->2048]", 4096, 2048},
                                {"shexp down Q8_0 [2048->4096]", 2048, 4096}, {"lm head Q8_0 [4096->129280]", 4096, 129280}};
  for (const D& d : dense) {
    if (quick && d.rows > 40000) continue;
    bench_dense(d.name, d.K, d.rows, rows, &sanity_bad);
  }
  bench_grouped("experts gate Q4_K [4096->2048]", 4096, 2048,
                quick ? std::vector<int>{1, 8} : std::vector<int>{1, 4, 8, 64, 256, 512}, rows, &sanity_bad);
  if (!quick) bench_grouped("experts down Q4_K [2048->4096]", 2048, 4096, {1, 8, 256}, rows, &sanity_bad);
  if (g_json != nullptr) std::fclose(g_json);
  g_json = nullptr;

  std::printf("\nsummary (us a call; mma speedup over the old kernel; mma weight GB/s and useful TFLOP/s; mma with\n"
              "the fold kernel, phase 2's launch shape, where the call splits K over blocks):\n");
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    const Row& o = rows[i];
    if (o.impl != "matvec") continue;
    const Row& n = rows[i + 1];
    const bool fl = i + 2 < rows.size() && rows[i + 2].impl == "mma-fold-launch";
    char launch[48] = "";
    if (fl) std::snprintf(launch, sizeof(launch), "  fold-launch %10.1f", rows[i + 2].us);
    std::printf("  %-8s %-30s %s %4d  old %10.1f  mma %10.1f  x%6.2f  %7.1f GB/s  %6.2f TFLOP/s%s\n", o.bench.c_str(),
                o.shape.c_str(), o.bench == "grouped" ? "lanes" : "cols ", o.ncols, o.us, n.us, o.us / n.us, n.gbs, n.tflops,
                launch);
  }
  std::printf("\nweight stages (MMA.md phase 5; us a call: auto = the default, then each variant of\n"
              "DS4_GPU_MMA_STREAM / _STREAM_BLOCKS / _STREAM_COLS; phase-1 = the old stages):\n");
  for (const std::string& l : g_stream_summary) std::printf("%s\n", l.c_str());
  std::printf("JSON: %s\n", path.c_str());
  if (sanity_bad) report(false, true, "bench runs: " + std::to_string(sanity_bad) + " mma outputs far from the old kernel's");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, checks = true, bench = true, decode_only = false;
  std::string out_dir = std::getenv("OUT") != nullptr ? std::getenv("OUT") : ".";
  uint64_t seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--check-only") bench = false;
    else if (a == "--bench-only") checks = false;
    else if (a == "--decode") decode_only = true;
    else if (a == "--out" && i + 1 < argc) out_dir = argv[++i];
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr, "usage: mma_check [--out DIR] [--seed N] [--quick] [--check-only | --bench-only] | --decode\n");
      return 64;
    }
  }
  if (decode_only || checks) {
    check_decode(seed);
    if (decode_only) return g_exact_failures ? 1 : 0;
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::fprintf(stderr, "mma_check: no CUDA device\n");
    return 3;
  }
  try {
    cudaDeviceProp prop;
    DS4_GPU_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (cc %d.%d, %d SMs); seed %" PRIu64 "\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
                seed);
    if (checks) {
      Rng rng(seed);
      run_checks(quick, rng);
      std::printf("checks: %d exactness failures, %d accuracy failures\n", g_exact_failures, g_accuracy_failures);
    }
    if (bench) run_bench(out_dir, quick);
  } catch (const std::exception& e) {
    std::printf("FAIL  error: %s\n", e.what());
    return 1;
  }
  std::printf("result: %s\n", g_exact_failures ? "EXACTNESS FAILED" : g_accuracy_failures ? "ACCURACY FAILED" : "PASSED");
  return g_exact_failures ? 1 : g_accuracy_failures ? 2 : 0;
}
