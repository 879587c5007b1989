// Host-side helpers the device harness (harness.cu) and the tensor-core check (mma_check.cu)
// share: f16 rounding, a seeded generator, weight views, random expert routings, medians.
// Header-only, in an unnamed namespace: each program has its own copy and nothing to link.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
