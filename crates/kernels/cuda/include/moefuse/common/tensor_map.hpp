// Host-side tensor maps of moefuse's own TMA producers (the fused gate_up's row gather, the
// contiguous wgrad's chunks): bf16, row-major, 128-byte swizzle, encoded through the driver
// entry point CUTLASS uses (no link against libcuda).
#pragma once

#include <cuda.h>

#include <cstdlib>
#include <cstring>

#include "cutlass/cuda_host_adapter.hpp"
#include "moefuse/abi.h"

extern "C" void moefuse_detail_set_error(const char* fmt, ...);

namespace moefuse {

// A bf16 tensor map over `dims` (innermost first; `strides` in bytes for dims 1..) with
// `box` elements per copy, 128-byte swizzle, zero fill out of range.
template <int Rank>
inline moefuse_status encode_bf16_map(CUtensorMap* map, const void* base, const cuuint64_t (&dims)[Rank],
                                      const cuuint64_t (&strides)[Rank - 1], const cuuint32_t (&box)[Rank],
                                      const char* what) {
  cuuint32_t element_strides[Rank];
  for (int i = 0; i < Rank; ++i) element_strides[i] = 1;
  CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, Rank, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    moefuse_detail_set_error("cuTensorMapEncodeTiled(%s) failed: CUresult %d", what, int(r));
    return MOEFUSE_STATUS_CUDA_ERROR;
  }
  return MOEFUSE_STATUS_OK;
}

// Whether the contiguous wgrad's tiles leave through the TMA-store epilogue (epilogue/
// tma_store_tile.cuh; beta == 0): yes unless MOEFUSE_TMA_EPILOGUE=off (read once), which
// keeps the masked-rows store, for A/B of one build (docs/perf-notes.md, session 13).
inline bool tma_epilogue_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOEFUSE_TMA_EPILOGUE");
    return v == nullptr || std::strcmp(v, "off") != 0;
  }();
  return on;
}

}  // namespace moefuse
