// Internals of the CPU kernels shared by quant.cpp, matmul.cpp, threadpool.cpp and the testing
// surface of the Python binding. Callers outside ext/cpu use ds4/kernels.h only.
//
// SIMD dispatch: every kernel exists as a scalar path (the portable check, always compiled) and
// an AVX2+FMA+F16C path (compiled with function-level target attributes, so the module still
// loads on CPUs without AVX2). The path is chosen once per process (first use; environment
// variable DS4_SIMD=scalar|avx2|auto) so results of one process never mix the two paths. The
// paths need not agree bit for bit with each other (FMA rounds once, mul+add twice), but each is
// deterministic and batch-invariant on its own. Within the AVX2 path, the fused matmul kernels
// have AVX-512 twins that give the same bits (used where the CPU has AVX-512 F/BW/VL/DQ unless
// DS4_AVX512=0; tests/test_native_kernels.py compares the two).
#pragma once

#include <cstdint>

#include "ds4/kernels.h"

namespace ds4::cpu {

enum class SimdPath : int { Scalar = 0, Avx2 = 1 };

// Elements decoded at a time by the matmul kernels: one Q4_K block, 8 Q8_0 or MXFP4 blocks.
constexpr int64_t kGroup = 256;

// The path every public kernel of this process uses.
SimdPath active_path();
const char* path_name(SimdPath p);
// Whether this CPU (and OS) can run the path.
bool path_supported(SimdPath p);

// Whether the AVX2 path runs its AVX-512 twins (the CPU has AVX-512 F/BW/VL/DQ and DS4_AVX512 is
// not 0; fixed per process). The twins give the same bits as the 256-bit kernels.
bool avx512_enabled();

// Physical cores available to this process (sysfs topology, bounded by the affinity mask).
int physical_cores();

// Decode n elements (a whole number of blocks) of type t with the given path. Both paths are
// bit-identical to gguf.quants.dequantize; dst must hold n floats.
void decode(SimdPath p, DType t, const uint8_t* src, float* dst, int64_t n);

// matmul_rows / matmul of ds4/kernels.h on an explicit path (the tests force each path).
void matmul_rows_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y,
                    int64_t ldy, int64_t r0, int64_t r1);
void matmul_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy,
               ThreadPool& pool);
void matmul_batch_on(SimdPath p, const MatmulJob* jobs, int n_jobs, ThreadPool& pool);

}  // namespace ds4::cpu
