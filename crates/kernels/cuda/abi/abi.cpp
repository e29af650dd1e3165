// The variant-independent part of the C ABI: version and last-error message.
#include <cstdarg>
#include <cstdio>

#include "moefuse/abi.h"

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
static_assert(sizeof(moefuse_grouped_gemm_args) == 64, "moefuse_grouped_gemm_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(offsetof(moefuse_grouped_gemm_args, offsets) == 24, "moefuse_grouped_gemm_args layout changed");
static_assert(offsetof(moefuse_grouped_gemm_args, alpha) == 56, "moefuse_grouped_gemm_args layout changed");
