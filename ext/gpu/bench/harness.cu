// Device harness of the GPU kernels: checks them against the CPU kernels and a double-precision
// reference, checks width exactness and determinism, and times the matvec at DS4-Flash sizes
// against the measured device-to-device copy bandwidth. One program, so one device call can
// build, check and time (ext/gpu/bench/run.sh).
//
//   harness --check [--seed N]     every kernel on fresh random inputs; exit 1 on any failure
//   harness --quick                a small check (for compute-sanitizer)
//   harness --bench [--json F]     copy bandwidth, then matvec timings (1, 2, 4, 8, 16 columns)
//   harness --bench-staged [--json F]  copy bandwidth, then the DS4-Flash dense shapes on the direct
//                                  and the staged kernel side by side (1, 2, 4, 8, 16 columns)
//   harness --bench-grouped [--json F]  copy bandwidth, then the grouped Q4_K kernel at flash-l4's
//                                  expert shapes (gate/up 4096 -> 2048, down 2048 -> 4096; 256 experts,
//                                  6 routes a lane; 1, 2, 4, 8, 64 lanes): pass 5 beside the pass-6
//                                  variants, each output compared with pass 5's bit for bit (exit 1
//                                  on a difference), then a speedup table
//   harness --bench-fused [--json F]  copy bandwidth, then the fused launches (pass 7) against the
//                                  launches they replace at flash-l4 shapes: the routed gate/up/SwiGLU
//                                  pair against two grouped launches + swiglu (1, 2, 4, 8 lanes), and
//                                  matvec_multi against matvec product by product (u of a CSA and an
//                                  HCA layer, q_lat, the shared gate/up; 1, 2, 4, 8 columns), outputs
//                                  compared bit for bit (exit 1 on a difference)
//   harness --decode               the device decoders run on the host vs the CPU (no GPU needed)
//
// References: weights are dequantized with ext/cpu/quant.cpp (ds4::dequantize_row) and dotted in
// double; the CPU product is ds4::matmul (ext/cpu/matmul.cpp). The agreement bound is 2e-3 of
// sum_k |w_k x_k| per output (the scale rounding errors live on); measured errors print beside it.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
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
#include "matvec.cuh"
#include "matvec_fused.h"
#include "step_ops.h"

using ds4::DType;
using ds4::TensorView;
namespace g = ds4::gpu;

namespace {

int g_failures = 0;

void report(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

// --- host data -------------------------------------------------------------------------------

float f16_to_f32(uint16_t h) {
  float out;
  ds4::dequantize_row(DType::F16, reinterpret_cast<const uint8_t*>(&h), &out, 1);
  return out;
}

int64_t elems_per_block(DType t) { return ds4::block_elems(t); }

// Random weights of type t: rows x K (x experts), values of moderate size so the reference
// comparison measures arithmetic, not cancellation of huge terms.
std::vector<uint8_t> random_weights(DType t, int64_t K, int64_t rows, Rng& rng) {
  const int64_t nb = K / elems_per_block(t) * rows;
  const int64_t bb = ds4::block_bytes(t);
  std::vector<uint8_t> w(static_cast<size_t>(nb * bb) + 64);  // slack: never read (bounds are exact)
  uint8_t* p = w.data();
  for (int64_t b = 0; b < nb; ++b, p += bb) {
    switch (t) {
      case DType::F32: {
        const float v = rng.normal();
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::F16: {
        const uint16_t h = f32_to_f16(rng.normal() * 0.5f);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::BF16: {
        const float v = rng.normal();
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const uint16_t h = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::Q8_0: {
        const uint16_t d = f32_to_f16(static_cast<float>(rng.uniform(0.002, 0.02) * (rng.integer(0, 1) ? 1 : -1)));
        std::memcpy(p, &d, 2);
        for (int i = 0; i < 32; ++i) p[2 + i] = static_cast<uint8_t>(rng.integer(-128, 127));
        break;
      }
      case DType::Q4_K: {
        for (int i = 0; i < 144; ++i) p[i] = static_cast<uint8_t>(rng.integer(0, 255));
        const uint16_t d = f32_to_f16(static_cast<float>(rng.uniform(0.0005, 0.005)));
        const uint16_t dmin = f32_to_f16(static_cast<float>(rng.uniform(0.0005, 0.005)));
        std::memcpy(p, &d, 2);
        std::memcpy(p + 2, &dmin, 2);
        break;
      }
      case DType::MXFP4: {
        p[0] = static_cast<uint8_t>(rng.integer(118, 129));
        for (int i = 1; i < 17; ++i) p[i] = static_cast<uint8_t>(rng.integer(0, 255));
        break;
      }
      default:
        break;
    }
  }
  return w;
}


std::vector<float> random_floats(size_t n, Rng& rng) {
  std::vector<float> v(n);
  for (auto& x : v) x = rng.normal();
  return v;
}

const DType kTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_K, DType::MXFP4};

bool bits_equal(const float* a, const float* b, size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// --- checks ----------------------------------------------------------------------------------

// GPU matvec of a K x rows matrix against the double reference and the CPU kernel, and every
// width 1..16 against single columns, bit for bit.
void check_matvec(DType t, int64_t K, int64_t rows, Rng& rng, ds4::ThreadPool& pool, bool all_widths) {
  const std::vector<uint8_t> wbytes = random_weights(t, K, rows, rng);
  const TensorView W = view(t, K, rows, wbytes.data());
  const int NC = 16;
  const std::vector<float> X = random_floats(static_cast<size_t>(NC) * K, rng);

  std::vector<float> gpu(static_cast<size_t>(NC) * rows, std::nanf("")), cpu(gpu.size());
  g::testing::matvec(W, X.data(), NC, K, gpu.data(), rows);
  ds4::matmul(W, X.data(), NC, K, cpu.data(), rows, pool);

  // Reference in double from the CPU dequantizer.
  std::vector<float> wrow(static_cast<size_t>(K));
  double max_ref = 0.0, max_cpu = 0.0, num = 0.0, den = 0.0;
  bool written = true;
  for (int64_t r = 0; r < rows; ++r) {
    ds4::dequantize_row(t, wbytes.data() + r * W.row_bytes(), wrow.data(), K);
    for (int c = 0; c < NC; ++c) {
      double ref = 0.0, scale = 0.0;
      const float* x = &X[static_cast<size_t>(c) * K];
      for (int64_t k = 0; k < K; ++k) {
        ref += static_cast<double>(wrow[k]) * x[k];
        scale += std::fabs(static_cast<double>(wrow[k]) * x[k]);
      }
      const double gv = gpu[c * rows + r];
      written = written && std::isfinite(gv);
      scale = std::max(scale, 1e-30);
      max_ref = std::max(max_ref, std::fabs(gv - ref) / scale);
      max_cpu = std::max(max_cpu, std::fabs(gv - cpu[c * rows + r]) / scale);
      num += (gv - ref) * (gv - ref);
      den += ref * ref;
    }
  }
  const double norm_rel = std::sqrt(num / std::max(den, 1e-300));
  char buf[256];
  std::snprintf(buf, sizeof(buf), "matvec %-5s K=%-5" PRId64 " rows=%-5" PRId64
                " ks=%d: |gpu-ref|/sum|wx| %.2e, |gpu-cpu|/sum|wx| %.2e, norm rel %.2e",
                ds4::dtype_name(t), K, rows, g::matvec_kslices(rows, K / (t == DType::F32 || t == DType::F16 || t == DType::BF16 ? 8 : 32)),
                max_ref, max_cpu, norm_rel);
  report(written && max_ref <= 2e-3 && max_cpu <= 2e-3 && norm_rel <= 2e-3, buf);

  // Determinism: the same call twice, bit for bit.
  std::vector<float> again(gpu.size(), std::nanf(""));
  g::testing::matvec(W, X.data(), NC, K, again.data(), rows);
  report(bits_equal(gpu.data(), again.data(), gpu.size()), std::string("matvec ") + ds4::dtype_name(t) + " deterministic");

  // Width exactness: column c of every width equals column c computed alone.
  std::vector<float> single(gpu.size(), std::nanf(""));
  for (int c = 0; c < NC; ++c) g::testing::matvec(W, &X[static_cast<size_t>(c) * K], 1, K, &single[c * rows], rows);
  int bad = 0;
  const int widths_lo = all_widths ? 1 : NC;
  for (int w = widths_lo; w <= NC; ++w) {
    for (int start : {0, NC - w}) {
      std::vector<float> y(static_cast<size_t>(w) * rows, std::nanf(""));
      g::testing::matvec(W, &X[static_cast<size_t>(start) * K], w, K, y.data(), rows);
      for (int c = 0; c < w; ++c)
        if (!bits_equal(&y[c * rows], &single[(start + c) * rows], rows)) ++bad;
    }
  }
  if (!bits_equal(gpu.data(), single.data(), gpu.size())) ++bad;
  std::snprintf(buf, sizeof(buf), "matvec %s widths %d..16 bit-identical to single columns (%d mismatching columns)",
                ds4::dtype_name(t), widths_lo, bad);
  report(bad == 0, buf);
}

// The staged kernel against the direct one, bit for bit, at every width in `widths` (random
// column offsets), on one shape; the default (staged from 2 columns) at 16 columns too.
void check_staged(DType t, int64_t K, int64_t rows, const std::vector<int>& widths, Rng& rng) {
  const std::vector<uint8_t> wbytes = random_weights(t, K, rows, rng);
  const TensorView W = view(t, K, rows, wbytes.data());
  const int NC = 16;
  const std::vector<float> X = random_floats(static_cast<size_t>(NC) * K, rng);
  int bad = 0, unwritten = 0;
  for (int w : widths) {
    const int start = static_cast<int>(rng.gen() % static_cast<uint64_t>(NC - w + 1));
    std::vector<float> a(static_cast<size_t>(w) * rows, std::nanf("")), b(a.size(), std::nanf(""));
    g::testing::matvec(W, &X[static_cast<size_t>(start) * K], w, K, a.data(), rows, false, g::kMatvecStagedOff);
    g::testing::matvec(W, &X[static_cast<size_t>(start) * K], w, K, b.data(), rows, false, 1);
    for (float v : b) unwritten += std::isnan(v) ? 1 : 0;
    for (int c = 0; c < w; ++c)
      if (!bits_equal(&a[c * rows], &b[c * rows], rows)) ++bad;
  }
  std::vector<float> a(static_cast<size_t>(NC) * rows, std::nanf("")), b(a.size(), std::nanf(""));
  g::testing::matvec(W, X.data(), NC, K, a.data(), rows, false, g::kMatvecStagedOff);
  g::testing::matvec(W, X.data(), NC, K, b.data(), rows);
  for (int c = 0; c < NC; ++c)
    if (!bits_equal(&a[c * rows], &b[c * rows], rows)) ++bad;
  char buf[200];
  std::snprintf(buf, sizeof(buf), "matvec %-5s K=%-5" PRId64 " rows=%-5" PRId64 " staged == direct at %zu widths + default (%d mismatching columns, %d unwritten)",
                ds4::dtype_name(t), K, rows, widths.size(), bad, unwritten);
  report(bad == 0 && unwritten == 0, buf);
}

// Expert-grouped product: each pair bit-identical to the single-column product of its expert.
void check_grouped(DType t, int64_t K, int64_t rows, int n_expert, int n_lanes, int per_lane, int max_part, Rng& rng) {
  const std::vector<uint8_t> wbytes = random_weights(t, K, rows * n_expert, rng);
  const TensorView W = view(t, K, rows, wbytes.data(), n_expert);
  const std::vector<float> X = random_floats(static_cast<size_t>(n_lanes) * K, rng);
  // half the experts: parts of several lanes
  const Routes routes = random_routes(n_lanes, n_expert, per_lane, std::max(1, n_expert / 2), rng);
  const std::vector<int32_t>&pe = routes.expert, &xr = routes.lane;
  const int n_pairs = static_cast<int>(pe.size());
  std::vector<float> y(static_cast<size_t>(n_pairs) * rows, std::nanf(""));
  g::testing::matvec_grouped(W, X.data(), n_lanes, K, pe.data(), xr.data(), n_pairs, max_part, y.data(), rows);
  int bad = 0;
  std::vector<float> single(static_cast<size_t>(rows));
  for (int p = 0; p < n_pairs; ++p) {
    const TensorView We = W.expert(pe[p]);
    g::testing::matvec(We, &X[static_cast<size_t>(xr[p]) * K], 1, K, single.data(), rows);
    if (!bits_equal(single.data(), &y[static_cast<size_t>(p) * rows], rows)) ++bad;
  }
  char buf[200];
  std::snprintf(buf, sizeof(buf), "grouped %-5s K=%" PRId64 " rows=%" PRId64 " %d experts, %d pairs, parts<=%d: %d pairs differ from single columns",
                ds4::dtype_name(t), K, rows, n_expert, n_pairs, max_part, bad);
  report(bad == 0, buf);
}

// Q4_K weights for the pass-6 checks: random_weights' blocks, with a share of blocks made to
// take the own kernel's two-fma fallback (matvec.cuh, q4k_fast_addend): dmin 2^-12 of d (the
// addend -ml - 16 dl is then inexact for most scales), a negative d or dmin, d = 0, all mins 0.
std::vector<uint8_t> q4k_mixed_weights(int64_t K, int64_t rows, Rng& rng) {
  std::vector<uint8_t> w = random_weights(DType::Q4_K, K, rows, rng);
  const int64_t nb = K / 256 * rows;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* p = w.data() + b * 144;
    const int kind = rng.integer(0, 9);
    if (kind == 0) {  // dmin tiny against d
      const uint16_t dmin = f32_to_f16(f16_to_f32(static_cast<uint16_t>(p[0] | (p[1] << 8))) / 4096.0f);
      std::memcpy(p + 2, &dmin, 2);
    } else if (kind == 1) {
      p[1] |= 0x80;  // d < 0
    } else if (kind == 2) {
      p[3] |= 0x80;  // dmin < 0
    } else if (kind == 3) {
      p[0] = p[1] = 0;  // d = +0
    } else if (kind == 4) {
      p[8] = p[9] = p[10] = p[11] = 0;  // mins of sub-blocks 0..3 zero,
      p[12] &= 0x0f, p[13] &= 0x0f, p[14] &= 0x0f, p[15] &= 0x0f;  // and of 4..7
    }
  }
  return w;
}

// The grouped kernel's variants (matvec.cuh: pass 5, the own body, the own body with the one-fma
// decode; copy stages 2..4) against each other bit for bit, every pair, at MAXC 1/2/4/8; and the
// pass-5 result against single-column dense products. `mixed`: q4k_mixed_weights.
void check_grouped_variants(int64_t K, int64_t rows, int n_expert, int n_lanes, int per_lane, bool mixed, Rng& rng) {
  const std::vector<uint8_t> wbytes =
      mixed ? q4k_mixed_weights(K, rows * n_expert, rng) : random_weights(DType::Q4_K, K, rows * n_expert, rng);
  const TensorView W = view(DType::Q4_K, K, rows, wbytes.data(), n_expert);
  const std::vector<float> X = random_floats(static_cast<size_t>(n_lanes) * K, rng);
  // half the experts: parts of several lanes
  const Routes routes = random_routes(n_lanes, n_expert, per_lane, std::max(1, n_expert / 2), rng);
  const std::vector<int32_t>&pe = routes.expert, &xr = routes.lane;
  const int n_pairs = static_cast<int>(pe.size());
  const int v0 = g::matvec_grouped_variant(), s0 = g::matvec_grouped_stages(), w0 = g::matvec_grouped_width();
  auto run = [&](int variant, int stages, int max_cols, int width) {
    g::set_matvec_grouped(variant, stages, width);
    std::vector<float> y(static_cast<size_t>(n_pairs) * rows, std::nanf(""));
    g::testing::matvec_grouped(W, X.data(), n_lanes, K, pe.data(), xr.data(), n_pairs, 8, y.data(), rows, max_cols);
    return y;
  };
  const std::vector<float> ref = run(g::kGroupedPass5, 0, 8, 0);
  int bad_dense = 0;
  std::vector<float> single(static_cast<size_t>(rows));
  for (int p = 0; p < n_pairs; ++p) {
    g::testing::matvec(W.expert(pe[p]), &X[static_cast<size_t>(xr[p]) * K], 1, K, single.data(), rows);
    if (!bits_equal(single.data(), &ref[static_cast<size_t>(p) * rows], rows)) ++bad_dense;
  }
  int bad = 0, unwritten = 0, runs = 0;
  for (int variant : {g::kGroupedOwn, g::kGroupedOwnFast})
    for (int stages : {2, 3, 4})
      for (int max_cols : {1, 2, 4, 8})
        for (int width : {4, 8}) {
          // every stage count at MAXC 1 and 8; every MAXC at 3 stages; width 8 where it matters
          if ((stages != 3 && max_cols != 8 && max_cols != 1) || (width == 8 && max_cols != 8)) continue;
          const std::vector<float> y = run(variant, stages, max_cols, width);
          ++runs;
          for (float v : y) unwritten += std::isnan(v) ? 1 : 0;
          for (int p = 0; p < n_pairs; ++p)
            if (!bits_equal(&y[static_cast<size_t>(p) * rows], &ref[static_cast<size_t>(p) * rows], rows)) ++bad;
        }
  g::set_matvec_grouped(v0, s0, w0);
  char buf[240];
  std::snprintf(buf, sizeof(buf),
                "grouped Q4_K K=%" PRId64 " rows=%" PRId64 " ks=%d%s: own / own-fast == pass 5 over %d runs x %d pairs "
                "(%d differ, %d unwritten); pass 5 == dense (%d differ)",
                K, rows, g::matvec_kslices(rows, K / 32), mixed ? " mixed scales" : "", runs, n_pairs, bad, unwritten,
                bad_dense);
  report(bad == 0 && unwritten == 0 && bad_dense == 0, buf);
}

void check_rms_norm(Rng& rng) {
  const int n_rows = 5;
  const int64_t n = 4096;
  const std::vector<float> X = random_floats(n_rows * n, rng);
  std::vector<float> w = random_floats(n, rng);
  int worst = 0;
  for (bool weighted : {true, false}) {
    std::vector<float> y(X.size(), std::nanf(""));
    g::testing::rms_norm(X.data(), weighted ? w.data() : nullptr, y.data(), n_rows, n, 1e-6f);
    for (int i = 0; i < n_rows; ++i) {
      double ss = 0.0;
      for (int64_t k = 0; k < n; ++k) ss += static_cast<double>(X[i * n + k]) * X[i * n + k];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + 1e-6f));
      for (int64_t k = 0; k < n; ++k) {
        const float ref = weighted ? X[i * n + k] * r * w[k] : X[i * n + k] * r;
        int32_t a, b;
        std::memcpy(&a, &ref, 4);
        std::memcpy(&b, &y[i * n + k], 4);
        worst = std::max(worst, std::abs(a - b));
      }
    }
  }
  report(worst <= 1, "rms_norm within 1 ulp of the CPU formula (max " + std::to_string(worst) + " ulp)");
}

void check_embed(Rng& rng) {
  for (DType t : kTypes) {
    const int64_t K = 512, vocab = 97;
    const std::vector<uint8_t> table = random_weights(t, K, vocab, rng);
    const TensorView E = view(t, K, vocab, table.data());
    std::vector<int32_t> tok = {0, 96, 5, 5, 42};
    std::vector<float> y(tok.size() * K, std::nanf("")), ref(K);
    g::testing::embed_rows(E, tok.data(), static_cast<int>(tok.size()), y.data());
    int bad = 0;
    for (size_t i = 0; i < tok.size(); ++i) {
      ds4::dequantize_row(t, table.data() + tok[i] * E.row_bytes(), ref.data(), K);
      for (int64_t k = 0; k < K; ++k) {
        const float a = ref[k], b = y[i * K + k];
        // Zero weights may differ in sign (Q8_0 q = 0 under d < 0, MXFP4 code 8; see matvec.cuh).
        const bool same = std::memcmp(&a, &b, 4) == 0 || ((t == DType::MXFP4 || t == DType::Q8_0) && a == 0.0f && b == 0.0f);
        bad += !same;
      }
    }
    report(bad == 0, std::string("embed ") + ds4::dtype_name(t) + " rows equal the CPU dequantizer (" +
                         std::to_string(bad) + " differ)");
  }
}

void check_rope(Rng& rng) {
  const int n_rows = 3, n_heads = 4, head_dim = 128, rope_dim = 64, half = rope_dim / 2;
  std::vector<double> inv(half);
  for (int k = 0; k < half; ++k) inv[k] = std::pow(10000.0, -2.0 * k / rope_dim);
  std::vector<int32_t> pos = {0, 77, 1000003};
  for (bool inverse : {false, true}) {
    std::vector<float> x = random_floats(static_cast<size_t>(n_rows) * n_heads * head_dim, rng);
    std::vector<float> ref = x;
    g::testing::rope_tail(x.data(), n_rows, n_heads, head_dim, rope_dim, pos.data(), inv.data(), inverse);
    double worst = 0.0;
    for (int i = 0; i < n_rows; ++i)
      for (int h = 0; h < n_heads; ++h) {
        float* t = &ref[(static_cast<size_t>(i) * n_heads + h) * head_dim + head_dim - rope_dim];
        for (int k = 0; k < half; ++k) {
          const double a = static_cast<double>(pos[i]) * inv[k];
          const float c = static_cast<float>(std::cos(a)), s0 = static_cast<float>(std::sin(a));
          const float s = inverse ? -s0 : s0;
          const float x0 = t[2 * k], x1 = t[2 * k + 1];
          t[2 * k] = x0 * c - x1 * s;
          t[2 * k + 1] = x0 * s + x1 * c;
        }
      }
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(x[i] - ref[i])));
    char buf[128];
    std::snprintf(buf, sizeof(buf), "rope_tail%s max |gpu - cpu formula| %.2e", inverse ? " (inverse)" : "", worst);
    report(worst <= 1e-5, buf);
  }
}

void check_attention(Rng& rng) {
  const int n_head = 8, head_dim = 512, kv_rows = 3000;
  std::vector<uint16_t> kv(static_cast<size_t>(kv_rows) * head_dim);
  for (auto& h : kv) h = f32_to_f16(rng.normal() * 0.5f);
  // Lanes with 0, 1, 129 and 4000 keys (4 heads x 4000 logits need more than the 48 KB default).
  const std::vector<int> counts = {0, 1, 129, 4000};
  std::vector<int32_t> off = {0}, rows;
  for (int c : counts) {
    for (int j = 0; j < c; ++j) rows.push_back(rng.integer(0, kv_rows - 1));
    off.push_back(static_cast<int32_t>(rows.size()));
  }
  const int n_lanes = static_cast<int>(counts.size());
  const std::vector<float> q = random_floats(static_cast<size_t>(n_lanes) * n_head * head_dim, rng);
  std::vector<float> sinks(n_head);
  for (auto& s : sinks) s = rng.normal();
  std::vector<float> out(q.size(), std::nanf(""));
  g::testing::attention_sink(q.data(), kv.data(), kv_rows, rows.data(), off.data(), n_lanes, n_head, head_dim,
                             sinks.data(), out.data());
  double worst = 0.0;
  bool finite = true;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int li = 0; li < n_lanes; ++li)
    for (int h = 0; h < n_head; ++h) {
      const int n = off[li + 1] - off[li];
      const float* qh = &q[(static_cast<size_t>(li) * n_head + h) * head_dim];
      std::vector<double> l(n);
      double mx = sinks[h];
      for (int j = 0; j < n; ++j) {
        double s = 0.0;
        for (int e = 0; e < head_dim; ++e) s += static_cast<double>(qh[e]) * f16_to_f32(kv[static_cast<size_t>(rows[off[li] + j]) * head_dim + e]);
        l[j] = s * scale;
        mx = std::max(mx, l[j]);
      }
      double den = std::exp(sinks[h] - mx);
      for (int j = 0; j < n; ++j) den += std::exp(l[j] - mx);
      for (int e = 0; e < head_dim; ++e) {
        double o = 0.0, mag = 0.0;
        for (int j = 0; j < n; ++j) {
          const double kvv = f16_to_f32(kv[static_cast<size_t>(rows[off[li] + j]) * head_dim + e]);
          o += std::exp(l[j] - mx) / den * kvv;
          mag += std::exp(l[j] - mx) / den * std::fabs(kvv);
        }
        const double gv = out[(static_cast<size_t>(li) * n_head + h) * head_dim + e];
        finite = finite && std::isfinite(gv);
        worst = std::max(worst, std::fabs(gv - o) / std::max(mag, 1e-30));
      }
    }
  char buf[160];
  std::snprintf(buf, sizeof(buf), "attention_sink (keys 0/1/129/4000, head_dim 512) |gpu-ref|/sum p|k| %.2e", worst);
  report(finite && worst <= 2e-3, buf);
}

void check_argmax(Rng& rng) {
  const int n_rows = 4;
  const int64_t n = 129280;
  std::vector<float> x = random_floats(static_cast<size_t>(n_rows) * n, rng);
  // Row 1: a tie at the maximum (first index wins); row 2: a NaN (numpy: first NaN); row 3: all equal.
  x[1 * n + 500] = 100.0f;
  x[1 * n + 90000] = 100.0f;
  x[2 * n + 7] = 50.0f;
  x[2 * n + 12345] = std::nanf("");
  x[2 * n + 99999] = std::nanf("");
  for (int64_t k = 0; k < n; ++k) x[3 * n + k] = -1.0f;
  std::vector<int32_t> got(n_rows, -7);
  g::testing::argmax_rows(x.data(), n_rows, n, got.data());
  bool ok = true;
  for (int i = 0; i < n_rows; ++i) {
    int64_t best = 0;
    for (int64_t k = 1; k < n; ++k) {
      const float a = x[i * n + k], b = x[i * n + best];
      if (std::isnan(b)) break;
      if (std::isnan(a) || a > b) best = k;
    }
    ok = ok && got[i] == best;
  }
  report(ok, "argmax (ties: first index; NaN: first NaN) matches numpy's rule");
}

// The own grouped kernel's Q4_K decoders on the host (matvec.cuh, pass 6): for every unit of
// `rows` rows, q4k_unit_scales with the lane's c, the two-fma form always and the one-fma form where
// q4k_fast_addend (and d, dmin >= +0) allow it, against the CPU dequantizer bit for bit (zero signs
// included). Returns the mismatches; *fast_units counts the units the one-fma form took.
int q4k_own_mismatches(const uint8_t* base, int64_t K, int64_t rows, int64_t* fast_units, int64_t* units_seen) {
  int bad = 0;
  std::vector<float> ref(static_cast<size_t>(K));
  const int64_t row_bytes = K / 256 * 144;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = base + r * row_bytes;
    ds4::dequantize_row(DType::Q4_K, row, ref.data(), K);
    for (int64_t u = 0; u < K / 32; ++u) {
      const uint8_t* blk = row + 144 * (u >> 3);
      uint32_t hw[4];
      std::memcpy(hw, blk, 16);
      uint4 qs;
      std::memcpy(&qs, blk + 16 + 16 * (u & 7), 16);
      const int c = static_cast<int>(u >> 1) & 3;
      float dl0, ml0, dl1, ml1, f0, f1;
      g::q4k_unit_scales(hw[0], hw[1], hw[2], hw[3], c, &dl0, &ml0, &dl1, &ml1);
      const bool fast = (hw[0] & 0x80008000u) == 0u && g::q4k_fast_addend(dl0, ml0, &f0) &&
                        g::q4k_fast_addend(dl1, ml1, &f1);
      *fast_units += fast ? 1 : 0;
      *units_seen += 1;
      for (int gi = 0; gi < 8; ++gi) {
        float ws[4], wf[4];
        g::q4k_unit_decode<false>(qs, dl0, -ml0, dl1, -ml1, gi, ws);
        if (fast) g::q4k_unit_decode<true>(qs, 2.0f * dl0, f0, 2.0f * dl1, f1, gi, wf);
        const int64_t k = g::Unit<g::kQ4_K>::k_of(u, gi);
        for (int e = 0; e < 4; ++e) {
          const float a = ref[k + e];
          bad += std::memcmp(&a, &ws[e], 4) != 0 && !(std::isnan(a) && std::isnan(ws[e]));
          if (fast) bad += std::memcmp(&a, &wf[e], 4) != 0;
        }
      }
    }
  }
  return bad;
}

void check_q4k_own_decode(Rng& rng) {
  const int64_t K = 1024, rows = 256, nb = K / 256 * rows;
  struct Case {
    const char* name;
    int kind;
  };
  // 0: random bytes, exponents below inf/NaN (every d/dmin ratio, both signs); 1: the harness's
  // random_weights (d, dmin in [0.0005, 0.005]); 2: flash-l4's synthesized blocks (dmin = 7.5 d,
  // ds4_app/engine/synth.py); 3: q4k_mixed_weights (zeros, negative scales, tiny dmin).
  for (const Case cs : {Case{"random bytes", 0}, Case{"harness weights", 1}, Case{"synth (dmin = 7.5 d)", 2},
                        Case{"mixed scales", 3}}) {
    std::vector<uint8_t> w;
    if (cs.kind == 1) {
      w = random_weights(DType::Q4_K, K, rows, rng);
    } else if (cs.kind == 3) {
      w = q4k_mixed_weights(K, rows, rng);
    } else {
      w.resize(static_cast<size_t>(nb * 144));
      for (auto& b : w) b = static_cast<uint8_t>(rng.integer(0, 255));
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* p = w.data() + b * 144;
        if (cs.kind == 0) {
          p[1] &= 0xbf;
          p[3] &= 0xbf;
        } else {
          const float d = static_cast<float>(rng.uniform(0.5, 1.5) * 1e-4);
          const uint16_t dh = f32_to_f16(d), mh = f32_to_f16(7.5f * d);
          std::memcpy(p, &dh, 2);
          std::memcpy(p + 2, &mh, 2);
          for (int j = 0; j < 8; ++j) {  // sc in 8..31, m = sc + [-3, 3], packed as synth.py does
            const int sc = rng.integer(8, 31), m = sc + rng.integer(-3, 3);
            if (j < 4) {
              p[4 + j] = static_cast<uint8_t>((p[4 + j] & 0xc0) | (sc & 63));
              p[8 + j] = static_cast<uint8_t>((p[8 + j] & 0xc0) | (m & 63));
            } else {
              p[4 + j - 4] = static_cast<uint8_t>((p[4 + j - 4] & 63) | ((sc >> 4) << 6));
              p[8 + j - 4] = static_cast<uint8_t>((p[8 + j - 4] & 63) | ((m >> 4) << 6));
              p[12 + j - 4] = static_cast<uint8_t>((sc & 15) | ((m & 15) << 4));
            }
          }
        }
      }
    }
    int64_t fast = 0, seen = 0;
    const int bad = q4k_own_mismatches(w.data(), K, rows, &fast, &seen);
    char buf[200];
    std::snprintf(buf, sizeof(buf), "decode Q4_K own kernel (%s): %d weights differ from the CPU; one-fma form on %.1f%% of units",
                  cs.name, bad, 100.0 * static_cast<double>(fast) / static_cast<double>(std::max<int64_t>(seen, 1)));
    report(bad == 0, buf);
  }
}

// The device decoders run on the host (they are __host__ __device__): every element of random
// rows over the whole legal range of each type, against the CPU dequantizer, bit for bit. Needs
// no GPU, so it also runs where the harness is built.
template <int T>
int decode_mismatches(const uint8_t* row, int64_t K, const float* ref) {
  using U = g::Unit<T>;
  int bad = 0;
  for (int64_t u = 0; u < K / U::kElems; ++u) {
    typename U::Raw raw;
    U::load(raw, row, u);
    for (int gi = 0; gi < U::kGroups; ++gi) {
      float w[4];
      U::decode(raw, gi, w);
      const int64_t k = U::k_of(u, gi);
      for (int e = 0; e < 4; ++e) {
        const float a = ref[k + e], b = w[e];
        const bool same = std::memcmp(&a, &b, 4) == 0 || (a == 0.0f && b == 0.0f && (T == g::kMXFP4 || T == g::kQ8_0)) ||
                          (std::isnan(a) && std::isnan(b));
        bad += !same;
      }
    }
  }
  return bad;
}

void check_decode_on_host(Rng& rng) {
  const int64_t K = 1024, rows = 64;
  for (DType t : kTypes) {
    const int64_t bb = ds4::block_bytes(t), nb = K / elems_per_block(t) * rows;
    std::vector<uint8_t> w(static_cast<size_t>(nb * bb) + 16);
    // 16-byte aligned start, as the device copies are.
    uint8_t* base = w.data() + ((16 - reinterpret_cast<uintptr_t>(w.data()) % 16) % 16);
    for (int64_t i = 0; i < nb * bb; ++i) base[i] = static_cast<uint8_t>(rng.integer(0, 255));
    // No inf/NaN scales (real files have none; the CPU and GPU forms of inf * 0 differ).
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* p = base + b * bb;
      if (t == DType::Q8_0 || t == DType::Q4_K) p[1] &= 0xbf;
      if (t == DType::Q4_K) p[3] &= 0xbf;
      if (t == DType::MXFP4 && p[0] == 255) p[0] = 254;
    }
    if (t == DType::F16 || t == DType::BF16 || t == DType::F32) {
      const int64_t n = K * rows;
      for (int64_t i = 0; i < n; ++i) {  // no NaN payload comparisons: clear NaNs to infinities
        if (t == DType::F16 && (base[2 * i + 1] & 0x7c) == 0x7c) base[2 * i] = 0, base[2 * i + 1] &= 0xfc;
        if (t == DType::BF16 && (base[2 * i + 1] & 0x7f) == 0x7f && (base[2 * i] & 0x80)) base[2 * i] = 0x80;
      }
    }
    std::vector<float> ref(static_cast<size_t>(K));
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = base + r * (K / elems_per_block(t) * bb);
      ds4::dequantize_row(t, row, ref.data(), K);
      switch (t) {
        case DType::F32: bad += decode_mismatches<g::kF32>(row, K, ref.data()); break;
        case DType::F16: bad += decode_mismatches<g::kF16>(row, K, ref.data()); break;
        case DType::BF16: bad += decode_mismatches<g::kBF16>(row, K, ref.data()); break;
        case DType::Q8_0: bad += decode_mismatches<g::kQ8_0>(row, K, ref.data()); break;
        case DType::Q4_K: bad += decode_mismatches<g::kQ4_K>(row, K, ref.data()); break;
        case DType::MXFP4: bad += decode_mismatches<g::kMXFP4>(row, K, ref.data()); break;
        default: break;
      }
    }
    report(bad == 0, std::string("decode ") + ds4::dtype_name(t) + " (host run of the device decoders) equals the CPU dequantizer, " +
                         std::to_string(bad) + " differ");
  }
}

// --- timing ----------------------------------------------------------------------------------

struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes) { DS4_GPU_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceMem() { (void)cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

double copy_bandwidth() {
  const size_t bytes = size_t{1} << 31;  // 2 GiB each way: far beyond the 50-60 MB L2
  DeviceMem a(bytes), b(bytes);
  DS4_GPU_CHECK(cudaMemset(a.p, 1, bytes));
  const double s = time_launches([&](cudaStream_t st, int) {
    DS4_GPU_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, st));
  }, 1, 15);
  return 2.0 * static_cast<double>(bytes) / s;  // bytes read + bytes written
}

struct BenchRow {
  std::string name;
  int ncols;
  double us, gbs, frac;
};

// Random device copies of a weight matrix, enough of them that one pass over all exceeds the L2
// several times, so every timed launch reads its weights from memory.
struct WeightSet {
  std::vector<DeviceMem*> copies;
  TensorView base;
  WeightSet(DType t, int64_t K, int64_t rows, int64_t experts, Rng& rng) {
    const std::vector<uint8_t> host = fast_weights(t, K, rows * experts, rng.gen());
    base = view(t, K, rows, nullptr, experts);
    const size_t bytes = static_cast<size_t>(base.nbytes());
    const int n = static_cast<int>(std::max<size_t>(1, std::min<size_t>(64, (size_t{512} << 20) / bytes)));
    for (int i = 0; i < n; ++i) {
      copies.push_back(new DeviceMem(bytes));
      DS4_GPU_CHECK(cudaMemcpy(copies.back()->p, host.data(), bytes, cudaMemcpyHostToDevice));
    }
  }
  ~WeightSet() {
    for (auto* c : copies) delete c;
  }
  TensorView at(int i) const {
    TensorView v = base;
    v.data = copies[i % copies.size()]->as<uint8_t>();
    return v;
  }
};

// modes: the matvec staged_min values to time (each a row; the name gets " direct" or " staged"
// when more than one is timed).
void bench_dense(const std::string& name, DType t, int64_t K, int64_t rows, double copy_bw, Rng& rng,
                 std::vector<BenchRow>& out, const std::vector<int>& modes = {g::kMatvecStagedMin},
                 bool tall = false) {
  WeightSet ws(t, K, rows, 1, rng);
  DeviceMem x(16 * K * sizeof(float)), y(16 * rows * sizeof(float));
  const std::vector<float> xh = random_floats(16 * K, rng);
  DS4_GPU_CHECK(cudaMemcpy(x.p, xh.data(), xh.size() * sizeof(float), cudaMemcpyHostToDevice));
  for (int nc : {1, 2, 4, 8, 16}) {
    for (int mode : modes) {
      const int per_graph = static_cast<int>(std::max<size_t>(ws.copies.size(), 20));
      const double s = time_launches([&](cudaStream_t st, int i) {
        g::matvec(ws.at(i), x.as<float>(), nc, K, y.as<float>(), rows, st, tall, mode);
      }, per_graph, 15);
      const double bytes = static_cast<double>(ws.base.nbytes()) + 4.0 * nc * (K + rows);
      std::string label = name;
      if (modes.size() > 1) label += mode == g::kMatvecStagedOff ? " direct" : " staged";
      out.push_back({label, nc, s * 1e6, bytes / s / 1e9, bytes / s / copy_bw});
    }
  }
}

// n_sets routings of n_lanes lanes x 6 routes over `experts` experts, each planned once on the
// device (build_expert_parts, parts of up to 8), with the lanes' activations: what a grouped
// launch of the benches below reads. bytes: the distinct experts a routing reads, on average, plus
// the activations and outputs.
struct GroupedRoutings {
  static constexpr int kPerLane = 6, kSets = 16;
  int n_lanes, n_pairs;
  DeviceMem x, y, xr;
  std::vector<std::unique_ptr<DeviceMem>> keep;
  std::vector<int32_t*> sorted, nparts;
  std::vector<g::ExpertPart*> parts;
  double bytes = 0.0;

  GroupedRoutings(int lanes, int64_t K, int64_t rows, int experts, double expert_bytes, Rng& rng)
      : n_lanes(lanes), n_pairs(lanes * kPerLane), x(static_cast<size_t>(lanes) * K * sizeof(float)),
        y(static_cast<size_t>(lanes) * kPerLane * rows * sizeof(float)), xr(lanes * kPerLane * sizeof(int32_t)),
        sorted(kSets), nparts(kSets), parts(kSets) {
    const std::vector<float> xh = random_floats(static_cast<size_t>(n_lanes) * K, rng);
    DS4_GPU_CHECK(cudaMemcpy(x.p, xh.data(), xh.size() * sizeof(float), cudaMemcpyHostToDevice));
    std::vector<int32_t> xrh(n_pairs);
    for (int p = 0; p < n_pairs; ++p) xrh[p] = p / kPerLane;
    DS4_GPU_CHECK(cudaMemcpy(xr.p, xrh.data(), n_pairs * sizeof(int32_t), cudaMemcpyHostToDevice));
    double distinct_total = 0.0;
    for (int sidx = 0; sidx < kSets; ++sidx) {
      const std::vector<int32_t> pe = random_routes(n_lanes, experts, kPerLane, 0, rng).expert;
      std::vector<char> seen(experts, 0);
      for (int32_t e : pe) seen[e] = 1;
      distinct_total += std::count(seen.begin(), seen.end(), 1);
      DeviceMem* pe_d = add(n_pairs * sizeof(int32_t));
      sorted[sidx] = add(n_pairs * sizeof(int32_t))->as<int32_t>();
      parts[sidx] = add(n_pairs * sizeof(g::ExpertPart))->as<g::ExpertPart>();
      nparts[sidx] = add(sizeof(int32_t))->as<int32_t>();
      DS4_GPU_CHECK(cudaMemcpy(pe_d->p, pe.data(), n_pairs * sizeof(int32_t), cudaMemcpyHostToDevice));
      g::build_expert_parts(pe_d->as<int32_t>(), n_pairs, experts, 8, sorted[sidx], parts[sidx], nparts[sidx], nullptr);
    }
    DS4_GPU_CHECK(cudaDeviceSynchronize());
    bytes = distinct_total / kSets * expert_bytes + 4.0 * (n_lanes * K + n_pairs * rows);
  }
  DeviceMem* add(size_t n) {
    keep.push_back(std::make_unique<DeviceMem>(n));
    return keep.back().get();
  }
  // The grouped product of routing k (weights W, activations [n_lanes][K], outputs [pairs][rows]).
  void launch(const TensorView& W, int k, int64_t K, int64_t rows, cudaStream_t st) const {
    g::matvec_grouped(W, parts[k], nparts[k], n_pairs, sorted[k], xr.as<int32_t>(), x.as<float>(), K, y.as<float>(),
                      rows, st, std::min(n_lanes, 8));  // max_cols as the engine sizes it
  }
};

// Grouped experts: n_lanes lanes x 6 routes over `experts` experts; bytes = distinct experts read.
void bench_grouped(const std::string& name, DType t, int64_t K, int64_t rows, int experts, double copy_bw, Rng& rng,
                   std::vector<BenchRow>& out) {
  WeightSet ws(t, K, rows, experts, rng);
  for (int n_lanes : {1, 2, 4, 8, 16}) {
    const GroupedRoutings r(n_lanes, K, rows, experts, static_cast<double>(ws.base.row_bytes()) * rows, rng);
    const double s = time_launches(
        [&](cudaStream_t st, int i) { r.launch(ws.at(i), i % GroupedRoutings::kSets, K, rows, st); }, 32, 15);
    out.push_back({name, n_lanes, s * 1e6, r.bytes / s / 1e9, r.bytes / s / copy_bw});
  }
}

// A grouped kernel to time (matvec.cuh, pass 6): variant and copy stages.
struct GroupedConfig {
  std::string label;
  int variant, stages, width;
};

// The grouped kernel's configurations side by side on the same weights (one copy of `experts`
// experts) and the same routings (16 per lane count, n_lanes x 6 routes, planned on the device),
// then each configuration's output on the first routing against the first configuration's, bit for
// bit (*mismatches counts the differing configurations). Rows named "<name> <label>", cols = lanes.
void bench_grouped_configs(const std::string& name, DType t, int64_t K, int64_t rows, int experts,
                           const std::vector<int>& lane_counts, const std::vector<GroupedConfig>& configs,
                           double copy_bw, Rng& rng, std::vector<BenchRow>& out, int* mismatches) {
  WeightSet ws(t, K, rows, experts, rng);
  const int v0 = g::matvec_grouped_variant(), s0 = g::matvec_grouped_stages(), w0 = g::matvec_grouped_width();
  for (int n_lanes : lane_counts) {
    const GroupedRoutings r(n_lanes, K, rows, experts, static_cast<double>(ws.base.row_bytes()) * rows, rng);
    const size_t n_out = static_cast<size_t>(r.n_pairs) * rows;
    std::vector<float> first;
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const GroupedConfig& cf = configs[ci];
      g::set_matvec_grouped(cf.variant, cf.stages, cf.width);
      const double sec = time_launches(
          [&](cudaStream_t st, int i) { r.launch(ws.at(i), i % GroupedRoutings::kSets, K, rows, st); }, 32, 15);
      out.push_back({name + " " + cf.label, n_lanes, sec * 1e6, r.bytes / sec / 1e9, r.bytes / sec / copy_bw});
      // The same launch once more on routing 0, then its output against the first configuration's.
      DS4_GPU_CHECK(cudaMemset(r.y.p, 0xff, n_out * sizeof(float)));
      r.launch(ws.at(0), 0, K, rows, nullptr);
      DS4_GPU_CHECK(cudaDeviceSynchronize());
      std::vector<float> yh(n_out);
      DS4_GPU_CHECK(cudaMemcpy(yh.data(), r.y.p, yh.size() * sizeof(float), cudaMemcpyDeviceToHost));
      if (ci == 0) {
        first = yh;
      } else if (!bits_equal(first.data(), yh.data(), yh.size())) {
        ++*mismatches;
        std::printf("FAIL  %s %s at %d lanes: output differs from %s\n", name.c_str(), cf.label.c_str(), n_lanes,
                    configs[0].label.c_str());
      }
    }
  }
  g::set_matvec_grouped(v0, s0, w0);
}

// Downloads n floats of a device buffer.
std::vector<float> download(const float* d, size_t n) {
  std::vector<float> h(n);
  DS4_GPU_CHECK(cudaDeviceSynchronize());
  DS4_GPU_CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

// Pass 7: the routed experts' gate/up/SwiGLU as one matvec_grouped_pair launch against two grouped
// launches and the swiglu kernel (flash-l4: Q4_K [4096 -> 2048] x 256, 6 routes a lane), on the same
// routings, then the two outputs on routing 0 bit for bit (*mismatches counts differences).
void bench_fused_pair(double copy_bw, Rng& rng, std::vector<BenchRow>& out, int* mismatches) {
  const int64_t K = 4096, F = 2048;
  const int E = 256;
  const float limit = 10.0f;
  WeightSet wg(DType::Q4_K, K, F, E, rng), wu(DType::Q4_K, K, F, E, rng);
  for (int n_lanes : {1, 2, 4, 8}) {
    const GroupedRoutings r(n_lanes, K, F, E, 2.0 * static_cast<double>(wg.base.row_bytes()) * F, rng);
    DeviceMem u(static_cast<size_t>(r.n_pairs) * F * sizeof(float));
    const int mc = std::min(n_lanes, 8);
    auto separate = [&](cudaStream_t st, int i, int k) {
      g::matvec_grouped(wg.at(i), r.parts[k], r.nparts[k], r.n_pairs, r.sorted[k], r.xr.as<int32_t>(), r.x.as<float>(),
                        K, r.y.as<float>(), F, st, mc);
      g::matvec_grouped(wu.at(i), r.parts[k], r.nparts[k], r.n_pairs, r.sorted[k], r.xr.as<int32_t>(), r.x.as<float>(),
                        K, u.as<float>(), F, st, mc);
      g::swiglu(r.y.as<float>(), u.as<float>(), r.n_pairs, F, limit, st);
    };
    auto fused = [&](cudaStream_t st, int i, int k) {
      if (!g::matvec_grouped_pair(wg.at(i), wu.at(i), r.parts[k], r.nparts[k], r.n_pairs, r.sorted[k],
                                  r.xr.as<int32_t>(), r.x.as<float>(), K, r.y.as<float>(), nullptr, F, limit, st, mc))
        throw std::runtime_error("bench-fused: matvec_grouped_pair declined (DS4_GPU_MV_FUSE=0 or a grouped variant other than 1?)");
    };
    const std::string name = "routed gate/up/swiglu Q4_K [4096 -> 2048] x256";
    const double s_sep = time_launches([&](cudaStream_t st, int i) { separate(st, i, i % GroupedRoutings::kSets); }, 32, 15);
    const double s_fus = time_launches([&](cudaStream_t st, int i) { fused(st, i, i % GroupedRoutings::kSets); }, 32, 15);
    out.push_back({name + " separate", n_lanes, s_sep * 1e6, r.bytes / s_sep / 1e9, r.bytes / s_sep / copy_bw});
    out.push_back({name + " fused", n_lanes, s_fus * 1e6, r.bytes / s_fus / 1e9, r.bytes / s_fus / copy_bw});
    const size_t n_out = static_cast<size_t>(r.n_pairs) * F;
    separate(nullptr, 0, 0);
    const std::vector<float> want = download(r.y.as<float>(), n_out);
    DS4_GPU_CHECK(cudaMemset(r.y.p, 0xff, n_out * sizeof(float)));
    fused(nullptr, 0, 0);
    const std::vector<float> got = download(r.y.as<float>(), n_out);
    if (!bits_equal(want.data(), got.data(), n_out)) {
      ++*mismatches;
      std::printf("FAIL  %s at %d lanes: the fused output differs from the separate launches'\n", name.c_str(), n_lanes);
    }
  }
}

// Pass 7: matvec_multi against matvec product by product, one set of products of one X (rotated
// weight copies, so every timed launch reads from memory), then each output bit for bit.
struct MultiShape {
  DType t;
  int64_t rows;
};
void bench_fused_multi(const std::string& name, int64_t K, const std::vector<MultiShape>& shapes, bool tall,
                       double copy_bw, Rng& rng, std::vector<BenchRow>& out, int* mismatches) {
  const int n = static_cast<int>(shapes.size());
  std::vector<std::unique_ptr<WeightSet>> ws;
  std::vector<std::unique_ptr<DeviceMem>> ys;
  double wbytes = 0.0;
  int64_t all_rows = 0;
  for (const MultiShape& sh : shapes) {
    ws.push_back(std::make_unique<WeightSet>(sh.t, K, sh.rows, 1, rng));
    ys.push_back(std::make_unique<DeviceMem>(static_cast<size_t>(8) * sh.rows * sizeof(float)));
    wbytes += static_cast<double>(ws.back()->base.nbytes());
    all_rows += sh.rows;
  }
  DeviceMem x(static_cast<size_t>(8) * K * sizeof(float));
  const std::vector<float> xh = random_floats(static_cast<size_t>(8) * K, rng);
  DS4_GPU_CHECK(cudaMemcpy(x.p, xh.data(), xh.size() * sizeof(float), cudaMemcpyHostToDevice));
  auto products = [&](int i) {
    std::vector<g::MatvecProduct> ps(n);
    for (int j = 0; j < n; ++j) ps[j] = {ws[j]->at(i), ys[j]->as<float>(), shapes[j].rows};
    return ps;
  };
  for (int nc : {1, 2, 4, 8}) {
    auto separate = [&](cudaStream_t st, int i) {
      for (int j = 0; j < n; ++j)
        g::matvec(ws[j]->at(i), x.as<float>(), nc, K, ys[j]->as<float>(), shapes[j].rows, st, tall, g::kMatvecStagedMin);
    };
    auto fused = [&](cudaStream_t st, int i) {
      const std::vector<g::MatvecProduct> ps = products(i);
      g::matvec_multi(ps.data(), n, x.as<float>(), nc, K, st, tall, g::kMatvecStagedMin);
    };
    const double bytes = wbytes + 4.0 * nc * (K + all_rows);
    const double s_sep = time_launches(separate, 32, 15), s_fus = time_launches(fused, 32, 15);
    out.push_back({name + " separate", nc, s_sep * 1e6, bytes / s_sep / 1e9, bytes / s_sep / copy_bw});
    out.push_back({name + " fused", nc, s_fus * 1e6, bytes / s_fus / 1e9, bytes / s_fus / copy_bw});
    std::vector<std::vector<float>> want(n);
    separate(nullptr, 0);
    for (int j = 0; j < n; ++j) want[j] = download(ys[j]->as<float>(), static_cast<size_t>(nc) * shapes[j].rows);
    for (int j = 0; j < n; ++j) DS4_GPU_CHECK(cudaMemset(ys[j]->p, 0xff, static_cast<size_t>(nc) * shapes[j].rows * 4));
    fused(nullptr, 0);
    for (int j = 0; j < n; ++j) {
      const std::vector<float> got = download(ys[j]->as<float>(), want[j].size());
      if (!bits_equal(want[j].data(), got.data(), got.size())) {
        ++*mismatches;
        std::printf("FAIL  %s, product %d at %d columns: the fused output differs\n", name.c_str(), j, nc);
      }
    }
  }
}

enum BenchMode { kBenchDefault, kBenchStaged, kBenchChunked, kBenchGrouped, kBenchFused };

int run_bench(const char* json_path, Rng& rng, BenchMode mode) {
  g::matvec_prepare();  // outside the graph captures below
  const double bw = copy_bandwidth();
  std::printf("device-to-device copy: %.1f GB/s (read + write)\n", bw / 1e9);
  std::vector<BenchRow> rows;
  int mismatches = 0;
  if (mode == kBenchFused) {
    bench_fused_pair(bw, rng, rows, &mismatches);
    const DType q8 = DType::Q8_0, f16 = DType::F16;
    bench_fused_multi("u: q_a, kv, compressor, indexer (CSA layer)", 4096,
                      {{q8, 1024}, {q8, 512}, {f16, 1024}, {f16, 1024}, {f16, 64}, {f16, 256}, {f16, 256}}, false, bw,
                      rng, rows, &mismatches);
    bench_fused_multi("u: q_a, kv, compressor (HCA layer)", 4096, {{q8, 1024}, {q8, 512}, {f16, 512}, {f16, 512}},
                      false, bw, rng, rows, &mismatches);
    bench_fused_multi("u: q_a, kv (sliding-window layer)", 4096, {{q8, 1024}, {q8, 512}}, false, bw, rng, rows,
                      &mismatches);
    bench_fused_multi("q_lat: q_b, indexer q_b (tall)", 1024, {{q8, 32768}, {f16, 8192}}, true, bw, rng, rows,
                      &mismatches);
    bench_fused_multi("shared expert gate, up", 4096, {{q8, 2048}, {q8, 2048}}, false, bw, rng, rows, &mismatches);
  } else if (mode == kBenchGrouped) {
    // The grouped Q4_K kernel at flash-l4's expert shapes (256 experts, 6 routes a lane), pass 5
    // against the own body (pass 6) at each copy-stage count, with the one-fma decode and without.
    const std::vector<int> lanes = {1, 2, 4, 8, 64};
    const std::vector<GroupedConfig> configs = {
        {"pass5", g::kGroupedPass5, 0, 0},          {"own s3", g::kGroupedOwn, 3, 4},
        {"own-fast s2", g::kGroupedOwnFast, 2, 4},  {"own-fast s3", g::kGroupedOwnFast, 3, 4},
        {"own-fast s4", g::kGroupedOwnFast, 4, 4},  {"own-fast s3 w8", g::kGroupedOwnFast, 3, 8}};
    bench_grouped_configs("grouped Q4_K [4096 -> 2048] x256 gate/up", DType::Q4_K, 4096, 2048, 256, lanes, configs, bw,
                          rng, rows, &mismatches);
    bench_grouped_configs("grouped Q4_K [2048 -> 4096] x256 down", DType::Q4_K, 2048, 4096, 256, lanes, configs, bw,
                          rng, rows, &mismatches);
  } else if (mode == kBenchChunked) {
    // The flash-l4 decode shapes with the unit-by-unit and the chunked weight loads (same bits).
    for (bool chunked : {false, true}) {
      g::set_matvec_chunked(chunked);
      const std::string how = chunked ? " chunked" : " unit loads";
      bench_dense("Q8_0 [4096 -> 1024] q_a" + how, DType::Q8_0, 4096, 1024, bw, rng, rows);
      bench_dense("Q8_0 [4096 -> 2048] shared gate/up" + how, DType::Q8_0, 4096, 2048, bw, rng, rows);
      bench_dense("Q8_0 [8192 -> 4096] wo_b" + how, DType::Q8_0, 8192, 4096, bw, rng, rows);
      bench_dense("Q8_0 [1024 -> 32768] q_b tall" + how, DType::Q8_0, 1024, 32768, bw, rng, rows,
                  {g::kMatvecStagedMin}, true);
      bench_dense("Q8_0 [4096 -> 129280] lm head tall" + how, DType::Q8_0, 4096, 129280, bw, rng, rows,
                  {g::kMatvecStagedMin}, true);
      bench_grouped("grouped Q4_K [4096 -> 2048] x256" + how, DType::Q4_K, 4096, 2048, 256, bw, rng, rows);
      bench_grouped("grouped Q4_K [2048 -> 4096] x256" + how, DType::Q4_K, 2048, 4096, 256, bw, rng, rows);
    }
    g::set_matvec_chunked(true);
  } else if (mode == kBenchStaged) {
    // The DS4-Flash dense shapes (q_a and one wo_a group, q_b, wo_b, the shared expert's gate and
    // down, a compressor, the LM head), each on the direct and on the staged kernel (staged from
    // one column here, to see where it pays).
    const std::vector<int> both = {g::kMatvecStagedOff, 1};
    bench_dense("Q8_0 [4096 -> 1024] q_a, wo_a group", DType::Q8_0, 4096, 1024, bw, rng, rows, both);
    bench_dense("Q8_0 [1024 -> 32768] q_b", DType::Q8_0, 1024, 32768, bw, rng, rows, both);
    bench_dense("Q8_0 [8192 -> 4096] wo_b", DType::Q8_0, 8192, 4096, bw, rng, rows, both);
    bench_dense("Q8_0 [4096 -> 2048] shared gate/up", DType::Q8_0, 4096, 2048, bw, rng, rows, both);
    bench_dense("Q8_0 [2048 -> 4096] shared down", DType::Q8_0, 2048, 4096, bw, rng, rows, both);
    bench_dense("Q8_0 [4096 -> 32768]", DType::Q8_0, 4096, 32768, bw, rng, rows, both);
    bench_dense("F16 [4096 -> 1024] compressor", DType::F16, 4096, 1024, bw, rng, rows, both);
    bench_dense("Q4_K [4096 -> 2048] one expert", DType::Q4_K, 4096, 2048, bw, rng, rows, both);
    bench_dense("Q8_0 [4096 -> 129280] lm head", DType::Q8_0, 4096, 129280, bw, rng, rows, both);
  } else {
  bench_dense("Q8_0 [4096 -> 32768]", DType::Q8_0, 4096, 32768, bw, rng, rows);
  bench_dense("Q4_K [4096 -> 2048] one expert", DType::Q4_K, 4096, 2048, bw, rng, rows);
  bench_dense("MXFP4 [2048 -> 4096] one expert", DType::MXFP4, 2048, 4096, bw, rng, rows);
  bench_dense("F16 [4096 -> 1024]", DType::F16, 4096, 1024, bw, rng, rows);
  bench_dense("BF16 [4096 -> 1024]", DType::BF16, 4096, 1024, bw, rng, rows);
  bench_dense("F32 [16384 -> 24]", DType::F32, 16384, 24, bw, rng, rows);
  bench_dense("Q8_0 [4096 -> 129280] lm head", DType::Q8_0, 4096, 129280, bw, rng, rows);
  bench_grouped("grouped Q4_K [4096 -> 2048] x256, 6 routes/lane", DType::Q4_K, 4096, 2048, 256, bw, rng, rows);
  bench_grouped("grouped MXFP4 [2048 -> 4096] x256, 6 routes/lane", DType::MXFP4, 2048, 4096, 256, bw, rng, rows);
  }
  std::printf("\n%-52s %5s %10s %9s %8s\n", "matrix", "cols", "us/call", "GB/s", "of copy");
  for (const auto& r : rows)
    std::printf("%-52s %5d %10.2f %9.1f %7.1f%%\n", r.name.c_str(), r.ncols, r.us, r.gbs, 100.0 * r.frac);
  if (mode == kBenchGrouped) {
    // Each configuration against pass 5 at the same shape and lanes (the first row of its group).
    std::printf("\n%-52s %5s %10s %10s\n", "grouped, against pass 5", "lanes", "us/call", "speedup");
    for (const auto& r : rows) {
      const std::string shape = r.name.substr(0, r.name.rfind(" x256 ") + 5);
      for (const auto& b : rows)
        if (b.ncols == r.ncols && b.name.compare(0, shape.size(), shape) == 0 && b.name.find(" pass5") != std::string::npos &&
            &b != &r)
          std::printf("%-52s %5d %10.2f %9.3fx\n", r.name.c_str(), r.ncols, r.us, b.us / r.us);
    }
    std::printf("grouped variants bit-identical to pass 5: %s (%d mismatching)\n", mismatches ? "NO" : "yes",
                mismatches);
  }
  if (mode == kBenchFused)
    std::printf("fused launches bit-identical to the separate ones: %s (%d mismatching)\n", mismatches ? "NO" : "yes",
                mismatches);
  if (json_path) {
    FILE* f = std::fopen(json_path, "w");
    if (!f) return 1;
    std::fprintf(f, "{\"device\": \"%s\", \"copy_gbs\": %.2f, \"rows_per_warp\": [%d, %d], \"results\": [\n",
                 g::device_name().c_str(), bw / 1e9, DS4_MV_R_NARROW, DS4_MV_R_WIDE);
    for (size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, "  {\"matrix\": \"%s\", \"cols\": %d, \"us\": %.3f, \"gbs\": %.2f, \"frac_copy\": %.4f}%s\n",
                   rows[i].name.c_str(), rows[i].ncols, rows[i].us, rows[i].gbs, rows[i].frac,
                   i + 1 < rows.size() ? "," : "");
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return mismatches ? 1 : 0;
}

int run_check(uint64_t seed, bool quick) {
  Rng rng(seed);
  ds4::ThreadPool pool(0);
  std::printf("device: %s; seed %" PRIu64 "; rows per warp %d (<=4 cols) / %d\n", g::device_name().c_str(), seed,
              DS4_MV_R_NARROW, DS4_MV_R_WIDE);
  for (DType t : kTypes) {
    if (quick) {
      check_matvec(t, 512, 37, rng, pool, false);
      continue;
    }
    check_matvec(t, 4096, 300, rng, pool, true);   // 4 k-slices
    check_matvec(t, 4096, 2100, rng, pool, false);  // 2 k-slices
    check_matvec(t, 512, 9001, rng, pool, false);   // 1 k-slice, a partial last block
  }
  // The staged kernel (matvec.cuh): 4, 2 and 1 k-slices, a partial last row block, an odd K.
  const std::vector<int> all_w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, some_w = {1, 2, 5, 8, 16};
  for (DType t : kTypes) {
    if (t == DType::F32) continue;
    if (quick) {
      check_staged(t, 512, 520, {1, 3, 16}, rng);
      continue;
    }
    check_staged(t, 4096, 600, all_w, rng);
    check_staged(t, 2048, 2100, some_w, rng);
    check_staged(t, 512, 9001, all_w, rng);
    if (t != DType::Q4_K) check_staged(t, (t == DType::F16 || t == DType::BF16) ? 1000 : 1056, 520, all_w, rng);
  }
  for (DType t : kTypes) {
    check_grouped(t, 512, quick ? 40 : 300, 16, quick ? 3 : 9, 6, 8, rng);
    if (!quick) check_grouped(t, 512, 300, 16, 9, 6, 1, rng);
  }
  // The grouped kernel's variants (pass 6), bit for bit: flash-l4's gate/up and down shapes (KS 2;
  // 4 and 2 passes a row), KS 1 with a partial pass and a partial row block, KS 2 with a partial
  // last pass, a KS 4 shape (stays on the pass-5 kernel), and blocks that force the two-fma fallback.
  if (quick) {
    check_grouped_variants(1280, 40, 4, 3, 2, true, rng);
  } else {
    check_grouped_variants(4096, 2048, 8, 9, 6, false, rng);
    check_grouped_variants(2048, 4096, 8, 9, 6, true, rng);
    check_grouped_variants(1280, 300, 16, 9, 6, true, rng);
    check_grouped_variants(2304, 300, 16, 9, 6, true, rng);  // KS 2, a partial third pass
    check_grouped_variants(512, 300, 16, 9, 6, false, rng);
    check_grouped_variants(4096, 300, 8, 5, 6, true, rng);
  }
  check_rms_norm(rng);
  check_embed(rng);
  check_rope(rng);
  check_attention(rng);
  check_argmax(rng);
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool check = false, quick = false, bench = false, decode = false;
  BenchMode mode = kBenchDefault;
  const char* json = nullptr;
  uint64_t seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") check = true;
    else if (a == "--quick") check = quick = true;
    else if (a == "--bench") bench = true;
    else if (a == "--bench-staged") bench = true, mode = kBenchStaged;
    else if (a == "--bench-chunked") bench = true, mode = kBenchChunked;
    else if (a == "--bench-grouped") bench = true, mode = kBenchGrouped;
    else if (a == "--bench-fused") bench = true, mode = kBenchFused;
    else if (a == "--decode") decode = true;
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr,
                   "usage: harness [--decode] [--check | --quick] [--bench | --bench-staged | --bench-chunked | --bench-grouped "
                   "| --bench-fused "
                   "[--json FILE]] "
                   "[--seed N]\n");
      return 2;
    }
  }
  if (decode) {
    Rng rng(seed);
    check_decode_on_host(rng);
    check_q4k_own_decode(rng);
    if (!check && !bench) return g_failures ? 1 : 0;
  }
  if (!g::available()) {
    std::fprintf(stderr, "no GPU device\n");
    return 3;
  }
  try {
    int rc = 0;
    if (check) rc |= run_check(seed, quick);
    if (bench) {
      Rng rng(seed + 1);
      rc |= run_bench(json, rng, mode);
    }
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
