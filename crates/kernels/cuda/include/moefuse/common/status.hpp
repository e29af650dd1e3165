// Host-side status helpers shared by every launcher: the thread-local last-error
// message behind moefuse_last_error(), and conversions from CUDA and CUTLASS codes.
#pragma once

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "moefuse/abi.h"

extern "C" void moefuse_detail_set_error(const char* fmt, ...);

namespace moefuse {

// Records `fmt` as the last error and returns `status`, so a check reads
// `return fail(MOEFUSE_STATUS_MISALIGNED, "...", ...);`.
template <class... Args>
inline moefuse_status fail(moefuse_status status, const char* fmt, Args... args) {
  moefuse_detail_set_error(fmt, args...);
  return status;
}

inline moefuse_status from_cuda(cudaError_t err, const char* where) {
  if (err == cudaSuccess) return MOEFUSE_STATUS_OK;
  return fail(MOEFUSE_STATUS_CUDA_ERROR, "%s: %s (%s)", where, cudaGetErrorString(err),
              cudaGetErrorName(err));
}

// NOTES: CUTLASS folds alignment failures into kErrorMisalignedOperand and shape
// failures into kErrorInvalidProblem; both are reachable only when the Rust-side
// validation missed a case, so the message names the variant to make that visible.
inline moefuse_status from_cutlass(cutlass::Status s, const char* variant, const char* where) {
  switch (s) {
    case cutlass::Status::kSuccess:
      return MOEFUSE_STATUS_OK;
    case cutlass::Status::kErrorMisalignedOperand:
      return fail(MOEFUSE_STATUS_MISALIGNED, "%s: %s: operand misaligned for TMA", variant, where);
    case cutlass::Status::kErrorInvalidProblem:
    case cutlass::Status::kErrorNotSupported:
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: %s: %s", variant, where,
                  cutlass::cutlassGetStatusString(s));
    case cutlass::Status::kErrorWorkspaceNull:
      return fail(MOEFUSE_STATUS_WORKSPACE_TOO_SMALL, "%s: %s: workspace is null", variant, where);
    case cutlass::Status::kErrorInternal: {
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return from_cuda(err, where);
      return fail(MOEFUSE_STATUS_INTERNAL, "%s: %s: %s", variant, where,
                  cutlass::cutlassGetStatusString(s));
    }
    default:
      return fail(MOEFUSE_STATUS_INTERNAL, "%s: %s: %s", variant, where,
                  cutlass::cutlassGetStatusString(s));
  }
}

// Checks that the current device is compute capability `major.minor` (an `a` target
// runs on exactly one capability) and returns its SM count through `sm_count`.
inline moefuse_status check_device(int major, int minor, const char* variant, int* sm_count,
                                   int* device) {
  moefuse_status st = from_cuda(cudaGetDevice(device), "cudaGetDevice");
  if (st != MOEFUSE_STATUS_OK) return st;
  int got_major = 0, got_minor = 0;
  st = from_cuda(cudaDeviceGetAttribute(&got_major, cudaDevAttrComputeCapabilityMajor, *device),
                 "cudaDeviceGetAttribute(major)");
  if (st != MOEFUSE_STATUS_OK) return st;
  st = from_cuda(cudaDeviceGetAttribute(&got_minor, cudaDevAttrComputeCapabilityMinor, *device),
                 "cudaDeviceGetAttribute(minor)");
  if (st != MOEFUSE_STATUS_OK) return st;
  if (got_major != major || got_minor != minor) {
    return fail(MOEFUSE_STATUS_ARCH_MISMATCH, "%s needs compute capability %d.%d, device %d is %d.%d",
                variant, major, minor, *device, got_major, got_minor);
  }
  return from_cuda(cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, *device),
                   "cudaDeviceGetAttribute(sm count)");
}

// The compute capability's major number of the current device (the MoE launchers pick their
// Hopper or Blackwell kernel by it; check_device then checks the exact capability).
inline moefuse_status device_major(int* major) {
  int device = 0;
  moefuse_status st = from_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (st != MOEFUSE_STATUS_OK) return st;
  return from_cuda(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device),
                   "cudaDeviceGetAttribute(major)");
}

// The device check of the MoE launchers with an sm_90a and an sm_100a kernel: `*major` the
// current device's family (10: Blackwell, else checked as 9.0, so that any other device is
// refused as not sm_90a), its SM count and index.
inline moefuse_status check_hopper_or_blackwell(const char* variant, int* major, int* sm_count, int* device) {
  moefuse_status st = device_major(major);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (*major != 10) *major = 9;
  return check_device(*major, 0, variant, sm_count, device);
}

}  // namespace moefuse
