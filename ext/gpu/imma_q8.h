// The tensor-core Q8_0 product for wide calls (imma_q8.cu): bit for bit the SIMT kernels' integer
// Q8_0 arithmetic (xplanes.cuh), so which kernel a call takes is a speed choice only.
#pragma once

#include <cstdint>

#include "ds4/kernels.h"
#include "vendor.h"

namespace ds4::gpu {

// The fewest columns a Q8_0 product (integer products on) must have to take the tensor-core kernel;
// 0: never. DS4_GPU_MV_IMMA=N sets it at start (default kImmaDefaultCols), set_matvec_imma at run
// time. The bits never depend on it (imma_q8.cu); part of the graph key so an A/B under graphs
// measures what it names. Where the build or the device has no integer mma.sync (HIP, before
// sm_80) the kernel never runs and the getter still reports the setting.
constexpr int kImmaDefaultCols = 32;
void set_matvec_imma(int min_cols);
int matvec_imma();

// Raises the kernel's shared-memory limit (once; matvec_prepare calls it before any graph capture).
// False where the kernel cannot run.
bool imma_prepare();

// Y = W X on the tensor cores for n_batch members (member i: weights W.data + i * w_member bytes,
// column c's planes at P + (i * ncols + c) * ldp, Y + i * y_member + c * ldy). Returns false, doing
// nothing, where the kernel does not take the call: fewer than matvec_imma() columns, no kernel in
// this build or device, or weights not laid out for its 16-byte copies.
bool imma_q8_matvec(const TensorView& W, int64_t units, int n_batch, int64_t w_member, const uint8_t* P,
                    int64_t ldp, int ncols, float* Y, int64_t y_member, int64_t ldy, cudaStream_t stream);

}  // namespace ds4::gpu
