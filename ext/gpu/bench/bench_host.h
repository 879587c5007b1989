// Host-side helpers the device harness (harness.cu) and the tensor-core check (mma_check.cu)
// share: f16 rounding, a seeded generator, fast timing weights, weight views, random expert
// routings, medians, graph-replay timing.
// Header-only, in an unnamed namespace: each program has its own copy and nothing to link.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common.cuh"
#include "ds4/kernels.h"

namespace {

// Round to nearest even; normal and subnormal range, overflow to infinity.
uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (ax < 0x38800000u) {
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  double uniform(double a, double b) { return std::uniform_real_distribution<double>(a, b)(gen); }
  float normal() { return static_cast<float>(std::normal_distribution<double>(0.0, 1.0)(gen)); }
  int integer(int a, int b) { return std::uniform_int_distribution<int>(a, b)(gen); }
};

ds4::TensorView view(ds4::DType t, int64_t K, int64_t rows, const void* data, int64_t experts = 1) {
  ds4::TensorView v;
  v.type = t;
  v.ne[0] = K;
  v.ne[1] = rows;
  v.ne[2] = experts;
  v.data = static_cast<const uint8_t*>(data);
  return v;
}

// Each of n_lanes lanes routed to per_lane distinct experts of n_expert, drawn at random: the
// pairs' experts and lanes, lane by lane. fold > 0: expert ids taken mod fold (fewer experts, so
// parts gather several lanes).
struct Routes {
  std::vector<int32_t> expert, lane;
};
Routes random_routes(int n_lanes, int n_expert, int per_lane, int fold, Rng& rng) {
  Routes r;
  for (int l = 0; l < n_lanes; ++l) {
    std::vector<int> ex(n_expert);
    for (int e = 0; e < n_expert; ++e) ex[e] = e;
    std::shuffle(ex.begin(), ex.end(), rng.gen);
    for (int j = 0; j < per_lane; ++j) {
      r.expert.push_back(fold > 0 ? ex[j] % fold : ex[j]);
      r.lane.push_back(l);
    }
  }
  return r;
}

// Fast random weights for timing (hundreds of MB): random bytes, then every scale field and
// float exponent forced into a sane range (no inf/NaN; speed does not depend on the values).
std::vector<uint8_t> fast_weights(ds4::DType t, int64_t K, int64_t rows, uint64_t seed) {
  const int64_t nb = K / ds4::block_elems(t) * rows, bb = ds4::block_bytes(t);
  std::vector<uint8_t> w(static_cast<size_t>(nb * bb));
  uint64_t z = seed;
  for (size_t i = 0; i + 8 <= w.size(); i += 8) {  // splitmix64
    uint64_t r = (z += 0x9e3779b97f4a7c15ull);
    r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
    r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
    r ^= r >> 31;
    std::memcpy(&w[i], &r, 8);
  }
  uint8_t* p = w.data();
  for (int64_t b = 0; b < nb; ++b, p += bb) {
    switch (t) {
      case ds4::DType::F32: p[3] &= 0xbf; break;                         // exponent < 128: |x| < 2
      case ds4::DType::F16: case ds4::DType::BF16: p[1] &= 0xbf; break;  // likewise
      case ds4::DType::Q8_0: p[1] = 0x1c | (p[1] & 0x80); break;         // |d| in [2^-8, 2^-7)
      case ds4::DType::Q4_K: p[1] = 0x18; p[3] = 0x18; break;            // d, dmin in [2^-9, 2^-8)
      case ds4::DType::MXFP4: p[0] = static_cast<uint8_t>(118 + p[0] % 12); break;
      default: break;
    }
  }
  return w;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds per launch: `per_graph` launches captured in one graph, replayed `reps` times
// after `warmups` replays.
double time_launches(const std::function<void(cudaStream_t, int)>& launch, int per_graph, int reps,
                     int warmups = 2) {
  cudaStream_t s;
  DS4_GPU_CHECK(cudaStreamCreate(&s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DS4_GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < per_graph; ++i) launch(s, i);
  DS4_GPU_CHECK(cudaStreamEndCapture(s, &graph));
  DS4_GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  DS4_GPU_CHECK(cudaEventCreate(&a));
  DS4_GPU_CHECK(cudaEventCreate(&b));
  for (int w = 0; w < warmups; ++w) DS4_GPU_CHECK(cudaGraphLaunch(exec, s));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    DS4_GPU_CHECK(cudaEventRecord(a, s));
    DS4_GPU_CHECK(cudaGraphLaunch(exec, s));
    DS4_GPU_CHECK(cudaEventRecord(b, s));
    DS4_GPU_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DS4_GPU_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e-3 / per_graph);
  }
  DS4_GPU_CHECK(cudaGraphExecDestroy(exec));
  DS4_GPU_CHECK(cudaGraphDestroy(graph));
  DS4_GPU_CHECK(cudaEventDestroy(a));
  DS4_GPU_CHECK(cudaEventDestroy(b));
  DS4_GPU_CHECK(cudaStreamDestroy(s));
  return median(t);
}

}  // namespace
