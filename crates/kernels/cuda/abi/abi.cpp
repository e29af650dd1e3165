// The variant-independent part of the C ABI: version and last-error message.
#include <cstdarg>
#include <cstdio>

#include "moefuse/abi.h"
#include "moefuse/spec.h"

namespace {
thread_local char last_error[1024] = "";
}

extern "C" uint32_t moefuse_abi_version(void) { return MOEFUSE_ABI_VERSION; }

extern "C" const char* moefuse_last_error(void) { return last_error; }

extern "C" void moefuse_detail_set_error(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(last_error, sizeof(last_error), fmt, args);
  va_end(args);
}

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
#include <cstddef>
static_assert(sizeof(moefuse_gemm_args) == 88, "moefuse_gemm_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_gemm_args, a) == 16, "moefuse_gemm_args layout changed");
static_assert(offsetof(moefuse_gemm_args, lda) == 48, "moefuse_gemm_args layout changed");
static_assert(offsetof(moefuse_gemm_args, alpha) == 80, "moefuse_gemm_args layout changed");
static_assert(sizeof(moefuse_grouped_gemm_args) == 96, "moefuse_grouped_gemm_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_grouped_gemm_args, offsets) == 24, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, alpha) == 56, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, b_rows) == 64, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, b_source_rows) == 76, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, a_rows) == 80, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, a_source_rows) == 92, "moefuse_grouped_gemm_args layout changed");

// spec.h (generated from crates/spec) against what abi.h and the kernel headers state. The
// kernel headers are included by every CUTLASS instance, so they keep their literals until a
// kernel rebuild is due anyway; these asserts make a change to crates/spec that they do not
// follow fail here, in the one-second host unit, instead of drifting.
static_assert(sizeof(((moefuse_grouped_gemm_args*)nullptr)->tile_order) * 8 >
                  MOEFUSE_SPEC_TILE_ORDER_INTERLEAVE_SHIFT + MOEFUSE_SPEC_TILE_ORDER_INTERLEAVE_BITS,
              "abi.h's tile_order word must hold every spec.h field below its sign bit");
static_assert(MOEFUSE_SPEC_TILE_ORDER_PTR_ARRAY_MASK ==
                  (MOEFUSE_SPEC_TILE_ORDER_RASTER_MASK | MOEFUSE_SPEC_TILE_ORDER_WIDTH_MASK),
              "spec.h: the ptr-array variants read raster and swizzle");
static_assert(MOEFUSE_SPEC_TILE_ORDER_CONTIGUOUS_MASK ==
                  (MOEFUSE_SPEC_TILE_ORDER_PTR_ARRAY_MASK | MOEFUSE_SPEC_TILE_ORDER_PREFETCH_MASK |
                   MOEFUSE_SPEC_TILE_ORDER_INTERLEAVE_MASK),
              "spec.h: the contiguous variants read every field");
static_assert(MOEFUSE_SPEC_TILE_ORDER_RASTER_SHIFT == 0 && MOEFUSE_SPEC_TILE_ORDER_RASTER_MASK == 3 &&
                  MOEFUSE_SPEC_TILE_ORDER_WIDTH_SHIFT == 8 && MOEFUSE_SPEC_TILE_ORDER_WIDTH_MASK == 0xff00 &&
                  MOEFUSE_SPEC_TILE_ORDER_PREFETCH_SHIFT == 16 && MOEFUSE_SPEC_TILE_ORDER_INTERLEAVE_SHIFT == 24,
              "abi.h documents tile_order as raster bits 0-1, swizzle/band 8-15, prefetch 16-23, interleave 24, "
              "and common/grouped_launch.cuh and sm90/contiguous_grouped_gemm.cuh decode those bits: change them "
              "with crates/spec");
static_assert(MOEFUSE_SPEC_TILE_ORDER_PTR_ARRAY_MASK == 0xff03 && MOEFUSE_SPEC_TILE_ORDER_CONTIGUOUS_MASK == 0x1ffff03,
              "common/grouped_launch.cuh refuses tile_order & ~0xff03, sm90/contiguous_grouped_gemm.cuh "
              "tile_order & ~0x1ffff03: change them with crates/spec");
static_assert(MOEFUSE_SPEC_TILE_ORDER_RASTER_ALONG_M == 1 && MOEFUSE_SPEC_TILE_ORDER_RASTER_ALONG_N == 2 &&
                  MOEFUSE_SPEC_TILE_ORDER_MAX_SWIZZLE == 8,
              "common/grouped_launch.cuh maps raster 1 to AlongM, 2 to AlongN and takes swizzles up to 8");
static_assert(MOEFUSE_SPEC_GROUPED_KIND_M_GROUPED == 0 && MOEFUSE_SPEC_GROUPED_KIND_K_GROUPED == 1,
              "common/group_layout.cuh declares enum class GroupedKind { kMGrouped, kKGrouped }: keep the order");
static_assert(MOEFUSE_SPEC_CONTIGUOUS_MAX_GROUPS == 512,
              "sm90/contiguous_grouped_gemm.cuh sizes its group table with kMaxGroups = 512: change it with "
              "crates/spec");
static_assert(MOEFUSE_SPEC_MAX_EXPERTS == 512 && MOEFUSE_SPEC_MAX_TOP_K == 16,
              "abi.h's router comment states 1 <= experts <= 512 and top_k <= 16");
