// Programmatic dependent launch (sm_90+; both are no-ops in a grid launched without it):
// shared by the MoE kernels (kernels/moe/) and the expert-parallel exchange (comm's ep.cu).
#pragma once

namespace moefuse {

// Lets the next kernel on the stream, launched with programmatic stream serialization,
// become resident now instead of at this kernel's end.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Waits until this kernel's prerequisite grid has completed and its writes are visible.
// Nothing the prerequisite writes may be read, and nothing it reads may be written, before.
__device__ __forceinline__ void wait_for_prerequisite() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace moefuse
