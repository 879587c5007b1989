// The one vendor header of the GPU backend: every ext/gpu source includes this instead of
// cuda_runtime.h or hip_runtime.h, and is written in CUDA spelling. Compiled by nvcc the names
// are CUDA's own; compiled as HIP (hipcc, or CMake's LANGUAGE HIP) the CUDA runtime names used
// here are mapped to their HIP equivalents, as ggml's ggml-cuda/vendors/hip.h does. No kernel is
// ever forked per vendor: where the two differ (warp shuffles, architecture features) this
// header gives one spelling (ds4_shfl_xor, DS4_WARP) and the kernels use only that.
//
// Numerics (both vendors): builds pass -fmad=false (nvcc) / -ffp-contract=off (clang), so
// a*b+c is never silently fused; kernels write fmaf() where they mean a fused multiply-add. The
// clang pragma below keeps that true for HIP even when a build forgets the flag.
//
// Architecture macros (device compilation only):
//   DS4_ARCH_HOPPER  sm_90 (H100/H200)        DS4_ARCH_RDNA3  gfx11xx (gfx1151 Strix Halo)
//   DS4_ARCH_RDNA4   gfx12xx (gfx1201 R9700)   DS4_ARCH_RDNA2  gfx103x (the CI compile target)
//   DS4_ARCH_CDNA    gfx9xx (wave64 hardware; the kernels still use 32-lane logical warps)
#pragma once

#include <cstdint>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(__HIP__)
#define DS4_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#pragma clang fp contract(off)

#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaPeekAtLastError hipPeekAtLastError
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDevice hipGetDevice
#define cudaSetDevice hipSetDevice
#define cudaDeviceProp hipDeviceProp_t
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeSharedMemPerBlockOptin
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDevAttrMaxSharedMemoryPerMultiprocessor hipDeviceAttributeMaxSharedMemoryPerMultiprocessor
#define cudaDevAttrMaxRegistersPerMultiprocessor hipDeviceAttributeMaxRegistersPerMultiprocessor
#define cudaDevAttrMaxThreadsPerMultiProcessor hipDeviceAttributeMaxThreadsPerMultiProcessor
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaFuncGetAttributes hipFuncGetAttributes
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaMallocAsync hipMallocAsync
#define cudaFreeAsync hipFreeAsync
#define cudaMallocHost(ptr, size) hipHostMalloc(ptr, size, hipHostMallocDefault)
#define cudaFreeHost hipHostFree
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemcpyKind hipMemcpyKind
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaStream_t hipStream_t
#define cudaStreamCreate hipStreamCreate
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamCaptureModeGlobal hipStreamCaptureModeGlobal
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaGraphInstantiate(exec, graph, flags) hipGraphInstantiate(exec, graph, nullptr, nullptr, 0)
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraphExecDestroy hipGraphExecDestroy
#define cudaGraphDestroy hipGraphDestroy
#define cudaErrorNoDevice hipErrorNoDevice

#if defined(__HIP_DEVICE_COMPILE__)
#if defined(__gfx1150__) || defined(__gfx1151__) || defined(__gfx1100__) || defined(__gfx1101__) || \
    defined(__gfx1102__) || defined(__gfx1103__)
#define DS4_ARCH_RDNA3 1
#elif defined(__gfx1200__) || defined(__gfx1201__)
#define DS4_ARCH_RDNA4 1
#elif defined(__gfx1030__) || defined(__gfx1031__) || defined(__gfx1032__) || defined(__gfx1034__) || \
    defined(__gfx1035__) || defined(__gfx1036__)
#define DS4_ARCH_RDNA2 1
#elif defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
    defined(__gfx942__) || defined(__gfx950__)
#define DS4_ARCH_CDNA 1
#endif
#endif

#else  // CUDA
#define DS4_CUDA 1
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000
#define DS4_ARCH_HOPPER 1
#endif
#endif

// Logical warp width of every kernel. RDNA runs wave32 natively; on wave64 hardware (CDNA) the
// shuffles below still reduce within 32-lane halves, so the arithmetic is the same everywhere.
#define DS4_WARP 32

// Butterfly partner exchange inside a 32-lane group (full-warp participation required).
template <class T>
__device__ __forceinline__ T ds4_shfl_xor(T v, int mask) {
#if defined(DS4_HIP)
  return __shfl_xor(v, mask, DS4_WARP);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, DS4_WARP);
#endif
}

// The value of lane `lane ^ 1` (lane: the caller's lane, 0..31). Only the two lanes of the pair
// need to call it, so it may sit where the rest of the warp has branched away.
template <class T>
__device__ __forceinline__ T ds4_shfl_pair(T v, int lane) {
#if defined(DS4_HIP)
  (void)lane;
  return __shfl_xor(v, 1, DS4_WARP);
#else
  return __shfl_xor_sync(3u << (lane & 30), v, 1, DS4_WARP);
#endif
}

// Lane src's value inside a 32-lane group (full-warp participation required).
template <class T>
__device__ __forceinline__ T ds4_shfl(T v, int src) {
#if defined(DS4_HIP)
  return __shfl(v, src, DS4_WARP);
#else
  return __shfl_sync(0xffffffffu, v, src, DS4_WARP);
#endif
}

// The largest (MAX) or the smallest of the 32 lanes' values (full-warp participation required;
// every lane gets the result). CUDA sm_80+: one redux instruction; elsewhere five butterfly rounds.
template <bool MAX>
__device__ __forceinline__ uint32_t ds4_warp_reduce_u32(uint32_t v) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return MAX ? __reduce_max_sync(0xffffffffu, v) : __reduce_min_sync(0xffffffffu, v);
#else
  for (int m = DS4_WARP / 2; m >= 1; m >>= 1) {
    const uint32_t o = ds4_shfl_xor(v, m);
    v = MAX ? max(v, o) : min(v, o);
  }
  return v;
#endif
}

// The lanes of this warp whose v equals the caller's, as a bit mask (full-warp participation
// required). CUDA sm_70+: one match instruction; elsewhere a walk of the 32 lanes' values.
__device__ __forceinline__ uint32_t ds4_match_mask(int v) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  return __match_any_sync(0xffffffffu, v);
#else
  uint32_t mask = 0;
  for (int j = 0; j < DS4_WARP; ++j) mask |= static_cast<uint32_t>(ds4_shfl(v, j) == v) << j;
  return mask;
#endif
}

// Host-and-device helpers: the decoders in common.cuh / matvec.cuh are DS4_HD so the harness can
// run them on the CPU too (ext/gpu/bench/harness.cu --decode checks them without a GPU).
#define DS4_HD __host__ __device__ __forceinline__
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define DS4_DEVICE_PASS 1
#endif

// Byte permute (PTX prmt / AMD v_perm through HIP's __byte_perm): result byte i is byte
// (s >> 4i) & 7 of the 8-byte value {y:x}. The selector's bit 3 (sign replicate) is never used.
DS4_HD uint32_t ds4_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#if defined(DS4_DEVICE_PASS)
  return __byte_perm(x, y, s);
#else
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

// a . b + c over the four signed bytes of a and of b (dp4a), exact in 32-bit integers. CUDA: one
// instruction (sm_61+); HIP and the host: the four products written out (the compiler may pick a
// dot instruction where the target has one).
DS4_HD int ds4_dp4a(int a, int b, int c) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__)
  return __dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i)
    c += static_cast<int>(static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i))) *
         static_cast<int>(static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i)));
  return c;
#endif
}

DS4_HD float ds4_bits_to_float(uint32_t b) {
#if defined(DS4_DEVICE_PASS)
  return __uint_as_float(b);
#else
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
#endif
}

DS4_HD uint32_t ds4_float_to_bits(float f) {
#if defined(DS4_DEVICE_PASS)
  return __float_as_uint(f);
#else
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  return b;
#endif
}

// A read-only load (the non-coherent cache path on the device).
template <class T>
DS4_HD T ds4_ldg(const T* p) {
#if defined(DS4_DEVICE_PASS)
  return __ldg(p);
#else
  return *p;
#endif
}

// A load from L2, past the SM's own cache: for data another block of the same launch wrote (and
// fenced) before this block read it, as the fused router's last block reads the logits (CUDA's
// cache-global load; HIP: a volatile load, which AMD compiles to an L1-bypassing one).
template <class T>
DS4_HD T ds4_ldcg(const T* p) {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *static_cast<const volatile T*>(p);
#endif
}

// --- warp-scope copies into shared memory (matvec.cuh's chunked weight loads) -----------------
// ds4_cp_async16(dst, src): copy 16 bytes, global -> shared (16-byte aligned both). On sm_80+ an
// asynchronous cp.async (no registers held while it is in flight); elsewhere a plain load and
// store. ds4_cp_async_commit() closes a group of copies; ds4_cp_async_wait<N>() waits until at
// most N groups are still in flight (this lane's copies only: follow it with ds4_syncwarp()
// before reading what other lanes copied).
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DS4_CP_ASYNC 1
#endif

// ds4_smem_of(p) / ds4_cp_async16_at(a, src): the same copy to a shared-memory address converted
// once (a + n bytes is the address of p + n), for loops that would otherwise convert p every copy.
#if defined(DS4_CP_ASYNC)
using ds4_smem_addr = unsigned;
__device__ __forceinline__ ds4_smem_addr ds4_smem_of(void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ds4_cp_async16_at(ds4_smem_addr dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
#else
using ds4_smem_addr = uint8_t*;
__device__ __forceinline__ ds4_smem_addr ds4_smem_of(void* p) { return static_cast<uint8_t*>(p); }
__device__ __forceinline__ void ds4_cp_async16_at(ds4_smem_addr dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
#endif

__device__ __forceinline__ void ds4_cp_async16(void* dst, const void* src) { ds4_cp_async16_at(ds4_smem_of(dst), src); }

__device__ __forceinline__ void ds4_cp_async_commit() {
#if defined(DS4_CP_ASYNC)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void ds4_cp_async_wait() {
#if defined(DS4_CP_ASYNC)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A barrier and shared-memory fence among the 32 lanes of a logical warp (all of them take part).
__device__ __forceinline__ void ds4_syncwarp() {
#if defined(DS4_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// --- programmatic dependent launch (sm_90+; launch.cuh launches kernels with it) ---------------
// A kernel launched with the attribute may be scheduled while the kernel before it in the stream
// is still running; its blocks then run up to ds4_grid_wait(), which returns once that kernel has
// completed and its writes are visible. So every kernel launched through ds4::gpu::launch calls
// ds4_grid_wait() before it reads anything an earlier kernel wrote and before it writes anything;
// before it, only reads of constant data are allowed: weights, and the step's inputs (positions,
// tokens, block tables: in place before the step's first kernel, unchanged during it).
// ds4_grid_release() lets the next kernel of the stream be scheduled now (each block issues it
// after its wait, so at most one kernel runs ahead). Both are no-ops for a kernel launched without
// the attribute, and on other devices (HIP, pre-Hopper), where launch.cuh never sets it.
__device__ __forceinline__ void ds4_grid_wait() {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void ds4_grid_release() {
#if defined(DS4_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The usual kernel opening: wait for the previous kernel, then let the next one be scheduled.
__device__ __forceinline__ void ds4_grid_begin() {
  ds4_grid_wait();
  ds4_grid_release();
}
