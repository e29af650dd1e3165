// Shared by the MoE kernels that are not GEMMs (kernels/moe/*.cu): status helpers without
// CUTLASS, the launch check, warp reductions, and the ABI layout assertions.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moefuse/abi.h"
#include "moefuse/common/pdl.cuh"

extern "C" void moefuse_detail_set_error(const char* fmt, ...);

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_router_args) == 64, "moefuse_router_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_router_args, routed_scaling_factor) == 28, "moefuse_router_args layout changed");
static_assert(offsetof(moefuse_router_args, logits) == 32, "moefuse_router_args layout changed");
static_assert(offsetof(moefuse_router_args, topk_weights) == 56, "moefuse_router_args layout changed");
static_assert(sizeof(moefuse_router_bwd_args) == 56, "moefuse_router_bwd_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_router_bwd_args, logits) == 24, "moefuse_router_bwd_args layout changed");
static_assert(offsetof(moefuse_router_bwd_args, d_logits) == 48, "moefuse_router_bwd_args layout changed");
static_assert(sizeof(moefuse_activation_args) == 56, "moefuse_activation_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_activation_args, total_rows) == 24, "moefuse_activation_args layout changed");
static_assert(offsetof(moefuse_activation_args, out) == 48, "moefuse_activation_args layout changed");

// The compute capabilities this fat object carries SASS for, for messages ("900,1000").
#define MOEFUSE_MOE_STR2(...) #__VA_ARGS__
#define MOEFUSE_MOE_STR(...) MOEFUSE_MOE_STR2(__VA_ARGS__)
#ifdef __CUDA_ARCH_LIST__
#define MOEFUSE_MOE_BUILT_FOR "compute " MOEFUSE_MOE_STR(__CUDA_ARCH_LIST__)
#else
#define MOEFUSE_MOE_BUILT_FOR "unknown archs"
#endif

namespace moefuse::moe {

constexpr int kWarp = 32;

// Whether `p` is 16-byte aligned (the vector loads and stores of bf16 rows).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether `p` is aligned for a T (a device word that kernels update atomically).
template <typename T>
inline bool aligned_for(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
}

// Whether an activation and a gate/up layout are among abi.h's enumerators.
inline bool known_activation(int activation, int layout) {
  return activation >= MOEFUSE_ACTIVATION_SWIGLU && activation <= MOEFUSE_ACTIVATION_RELU2 &&
         (layout == MOEFUSE_GATE_UP_SPLIT || layout == MOEFUSE_GATE_UP_INTERLEAVED);
}

// Records `fmt` as the last error and returns `status`.
template <class... Args>
inline moefuse_status fail(moefuse_status status, const char* fmt, Args... args) {
  moefuse_detail_set_error(fmt, args...);
  return status;
}

// Reads the CUDA error state right after a launch. A device none of the fat object's
// SASS images runs on is an arch mismatch, not a CUDA failure.
inline moefuse_status after_launch(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return MOEFUSE_STATUS_OK;
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    return fail(MOEFUSE_STATUS_ARCH_MISMATCH, "%s: no kernel image for this device (built for %s): %s",
                kernel, MOEFUSE_MOE_BUILT_FOR, cudaGetErrorString(err));
  }
  return fail(MOEFUSE_STATUS_CUDA_ERROR, "%s: launch failed: %s (%s)", kernel,
              cudaGetErrorString(err), cudaGetErrorName(err));
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Programmatic dependent launch: common/pdl.cuh.
using moefuse::allow_dependent_launch;
using moefuse::wait_for_prerequisite;

}  // namespace moefuse::moe
