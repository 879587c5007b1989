// Kernel launches with programmatic dependent launch (PDL): the one way the engine's kernels are
// launched. On a CUDA device of compute capability 9.0+ with the switch on, `launch` sets
// cudaLaunchAttributeProgrammaticStreamSerialization, so the kernel may be scheduled while the
// previous kernel of the stream finishes: its blocks become resident during that kernel's tail,
// and a matvec issues its first weight copies before waiting (vendor.h's ds4_grid_wait). Under a
// CUDA graph capture the attribute becomes a programmatic edge, so replays keep the overlap.
// Elsewhere (HIP, older devices, the switch off, the legacy default stream the testing entry points
// use) it is the plain <<<>>> launch.
//
// Contract with the kernel: every kernel launched here calls ds4_grid_wait() (usually through
// ds4_grid_begin()) before it reads anything an earlier kernel wrote or writes anything. Results do
// not depend on the switch (the same instructions on the same values; only when blocks start
// changes), which tests/gpu/test_gpu_pdl.py checks bit for bit.
#pragma once

#include <atomic>
#include <utility>

#include "common.cuh"
#include "ds4_gpu.h"

namespace ds4::gpu {

// The switch: DS4_GPU_PDL=0 (or set_pdl(false)) turns it off; on by default where the device
// supports it (CUDA, compute capability 9.0+; set_pdl(true) elsewhere leaves it off). Read at
// launch; bit 17 of matvec_settings_key, so the engine's graphs of each setting are apart.
bool pdl_on();
void set_pdl(bool on);
// Whether the current device is a CUDA device of compute capability 9.0+ (the Hopper features:
// programmatic dependent launch, the bulk L2 prefetch). Asked once; false under HIP.
bool cuda_sm90();
// Multiprocessors of the current device (0 where the runtime cannot say). Asked once.
int device_sms();
// A process-wide launch switch read from the environment once into `state` (-1: not read yet):
// on unless `name` is "0" or `allowed` is false; its setter stores 0 or 1 into `state`.
bool env_switch(std::atomic<int>& state, const char* name, bool allowed = true);

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A&&... args) {
#if defined(DS4_CUDA)
  if (stream != nullptr && pdl_on()) {  // the testing hooks' legacy default stream: plain launches
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    DS4_GPU_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
    return;
  }
#endif
  kernel<<<grid, block, smem, stream>>>(std::forward<A>(args)...);
}

}  // namespace ds4::gpu
