/*
 * moefuse C ABI: the whole surface between the CUDA kernels and Rust.
 *
 * One status enum, one argument struct per operation, one launcher per compiled
 * variant (`moefuse_<variant>`, plus `moefuse_<variant>_workspace`), the ABI version,
 * and a thread-local message for the last failure. Plain C: no C++ types cross it.
 * Every launcher reads the CUDA error state right after its launch and reports it.
 */
#ifndef MOEFUSE_ABI_H
#define MOEFUSE_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct layout or launcher signature changes. */
#define MOEFUSE_ABI_VERSION 2

typedef enum moefuse_status {
  MOEFUSE_STATUS_OK = 0,
  /* A pointer or leading dimension breaks the kernel's alignment rule (TMA: 16 bytes). */
  MOEFUSE_STATUS_MISALIGNED = 1,
  /* Sizes the kernel cannot implement (negative, zero where forbidden, too large). */
  MOEFUSE_STATUS_INVALID_PROBLEM = 2,
  /* The current device is not the architecture this variant was compiled for. */
  MOEFUSE_STATUS_ARCH_MISMATCH = 3,
  /* The caller's workspace is smaller than `_workspace()` asked for. */
  MOEFUSE_STATUS_WORKSPACE_TOO_SMALL = 4,
  /* The CUDA runtime reported an error (message in moefuse_last_error()). */
  MOEFUSE_STATUS_CUDA_ERROR = 5,
  /* Anything else: a bug in moefuse. */
  MOEFUSE_STATUS_INTERNAL = 6
} moefuse_status;

/* Layout of B, the second operand, for dense and grouped GEMMs. */
typedef enum moefuse_b_layout {
  /* B stored [N, K] row-major: K contiguous ("weights as nn.Linear stores them"). */
  MOEFUSE_B_LAYOUT_NK = 0,
  /* B stored [K, N] row-major: N contiguous. */
  MOEFUSE_B_LAYOUT_KN = 1
} moefuse_b_layout;

/*
 * D[m, n] = alpha * sum_k A[m, k] * B(k, n) + beta * C[m, n]
 *
 * A is [m, k] row-major with leading dimension lda (elements).
 * B is [n, k] (layout NK) or [k, n] (layout KN) row-major with leading dimension ldb.
 * C and D are [m, n] row-major with leading dimensions ldc, ldd. C may be NULL when
 * beta == 0. All matrices bf16, accumulation in fp32, alpha and beta fp32.
 */
typedef struct moefuse_gemm_args {
  int32_t m;
  int32_t n;
  int32_t k;
  int32_t b_layout; /* moefuse_b_layout; must match the variant */
  const void* a;
  const void* b;
  const void* c;
  void* d;
  int64_t lda;
  int64_t ldb;
  int64_t ldc;
  int64_t ldd;
  float alpha;
  float beta;
} moefuse_gemm_args;

/*
 * Grouped GEMM over experts e = 0..num_groups-1; group e owns rows [start_e, end_e) with
 * end_e = offsets[e] and start_e = end_{e-1} (start_0 = 0): the prefix-sum form, int32, in
 * device memory, so a launch needs no host synchronisation. Ends are clamped to total_rows
 * and a decreasing end gives an empty group, so no offsets can make a kernel touch memory
 * outside the buffers (decreasing ends can make later groups overlap earlier ones: memory
 * safe, result unspecified; the Rust API's check_offsets finds them). Rows past
 * end_{G-1} are left untouched.
 *
 * M-grouped (fwd, dgrad): D[rows_e, :] = alpha * A[rows_e, :] * W_e + beta * D[rows_e, :]
 *   A [total_rows, k], D [total_rows, n] row-major; W_e = b + e*n*k, stored [n, k]
 *   (b_layout NK) or [k, n] (KN). dgrad is the same call with the weights' other layout.
 * K-grouped (wgrad): D_e = alpha * A[rows_e, :]^T * B[rows_e, :] + beta * D_e
 *   A [total_rows, k], B [total_rows, n] row-major; D_e = d + e*k*n, [k, n] row-major.
 *   An empty group gets D_e = 0 when beta == 0 and is left untouched otherwise.
 * bf16 operands, fp32 accumulation. C is D itself (beta reads D's previous content).
 */
typedef struct moefuse_grouped_gemm_args {
  int32_t num_groups;
  int32_t total_rows;
  int32_t n;
  int32_t k;
  int32_t b_layout;   /* M-grouped: moefuse_b_layout of W_e; K-grouped: ignored */
  int32_t tile_order; /* bits 0-1: raster (0 kernel default, 1 along M, 2 along N);
                         bits 8-15: max swizzle (0 or 1: none; 2, 4, 8) */
  const int32_t* offsets;
  const void* a;
  const void* b;
  void* d;
  float alpha;
  float beta;
} moefuse_grouped_gemm_args;

/* The ABI version the library was built with (MOEFUSE_ABI_VERSION). */
uint32_t moefuse_abi_version(void);

/* The message of the last non-OK status returned on this thread ("" if none). */
const char* moefuse_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_ABI_H */
