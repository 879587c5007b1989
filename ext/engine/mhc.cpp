// mHC per lane (spec §3).
#include "mhc.h"

#include <cmath>

#include "ops.h"

namespace ds4 {

namespace {

// ρ = rsqrt(mean(x̂²) + eps) over the flattened hc·d state (the model's norm_eps, not hc_eps).
float state_rsqrt(const HcShape& s, const float* x) {
  const int64_t n = s.hc * s.d;
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + s.norm_eps));
}

}  // namespace

void hc_pre_lane(const HcShape& s, const HcWeights& w, const float* x, const float* raw, float* u, float* post,
                 float* comb) {
  const int hc = s.hc;
  const float rho = state_rsqrt(s, x);
  float pre[kMaxHc];
  for (int i = 0; i < hc; ++i) pre[i] = sigmoidf(w.scale[0] * (rho * raw[i]) + w.base[i]) + s.hc_eps;
  for (int i = 0; i < hc; ++i) post[i] = 2.0f * sigmoidf(w.scale[1] * (rho * raw[hc + i]) + w.base[hc + i]);
  for (int i = 0; i < hc * hc; ++i) comb[i] = w.scale[2] * (rho * raw[2 * hc + i]) + w.base[2 * hc + i];
  sinkhorn(comb, hc, s.iters, s.hc_eps);
  for (int64_t k = 0; k < s.d; ++k) {
    float acc = 0.0f;
    for (int i = 0; i < hc; ++i) acc += pre[i] * x[i * s.d + k];
    u[k] = acc;
  }
}

void hc_post_lane(const HcShape& s, float* x, const float* y, const float* post, const float* comb) {
  const int hc = s.hc;
  float old[kMaxHc];
  for (int64_t e = 0; e < s.d; ++e) {
    for (int j = 0; j < hc; ++j) old[j] = x[j * s.d + e];
    for (int k = 0; k < hc; ++k) {
      float acc = post[k] * y[e];
      for (int j = 0; j < hc; ++j) acc += comb[j * hc + k] * old[j];
      x[k * s.d + e] = acc;
    }
  }
}

void hc_head_lane(const HcShape& s, const HcWeights& w, const float* x, const float* raw, float* h) {
  const int hc = s.hc;
  const float rho = state_rsqrt(s, x);
  float wt[kMaxHc];
  for (int i = 0; i < hc; ++i) wt[i] = sigmoidf(w.scale[0] * (rho * raw[i]) + w.base[i]) + s.hc_eps;
  for (int64_t k = 0; k < s.d; ++k) {
    float acc = 0.0f;
    for (int i = 0; i < hc; ++i) acc += wt[i] * x[i * s.d + k];
    h[k] = acc;
  }
}

}  // namespace ds4
