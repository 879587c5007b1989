// The SwiGLU of one element, as a device function: G = silu(min(g, L)) * clamp(u, -L, L) (no clamp
// for L <= 0), the expression of lane_ops.cu's swiglu_kernel operation for operation (fminf, fmaxf,
// rowops.cuh's silu_dev, one multiply), so a fused epilogue (matvec_fused.cu) stores the bits that
// kernel would write from the same g and u. Touches registers only.
#pragma once

#include "rowops.cuh"

namespace ds4::gpu {

__device__ __forceinline__ float swiglu_value(float g, float u, float limit) {
  if (limit > 0.0f) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
  }
  return silu_dev(g) * u;
}

}  // namespace ds4::gpu
