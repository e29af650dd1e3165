// Small row kernels the expert-parallel layer's backward uses to carry one fp32 value per
// routed (token, slot) back to the token's rank through an exchange that sums rows:
//   scatter_columns:  out[r, :] = 0, out[r, col_of[r * col_stride]] = value[r]  (bf16)
//   columns_to_f32:   out[r, j] = in[r, j] for j < cols                        (bf16 -> fp32)
// Rows past the device count (count[0], clamped to rows) are not touched. A column index
// outside 0..width-1 leaves the row all zeros and raises MOEFUSE_MOE_ERROR_ROW.
//
// thread | work
// -------+----------------------------------------------------------------------------
// each   | grid-stride over elements of the live rows (one output element per step)
#include <cuda_bf16.h>

#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"

static_assert(sizeof(moefuse_scatter_columns_args) == 56, "moefuse_scatter_columns_args layout changed: update ffi.rs");
static_assert(sizeof(moefuse_columns_to_f32_args) == 32, "moefuse_columns_to_f32_args layout changed: update ffi.rs");

namespace moefuse::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ int64_t live_rows(const int32_t* count, int rows) {
  if (count == nullptr) return rows;
  const int c = *count;
  return c < 0 ? 0 : (c > rows ? rows : c);
}

__global__ void __launch_bounds__(kThreads) scatter_columns_kernel(moefuse_scatter_columns_args a) {
  const int64_t rows = live_rows(a.count, a.rows);
  const int64_t n = rows * a.width;
  auto* out = reinterpret_cast<__nv_bfloat16*>(a.out);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.width;
    const int c = int(i - r * a.width);
    const int col = a.col_of[r * a.col_stride];
    if (c == 0 && (col < 0 || col >= a.width) && a.errors != nullptr) atomicOr(a.errors, MOEFUSE_MOE_ERROR_ROW);
    out[i] = __float2bfloat16_rn(c == col ? a.values[r] : 0.f);
  }
}

__global__ void __launch_bounds__(kThreads) columns_to_f32_kernel(moefuse_columns_to_f32_args a) {
  const int64_t n = int64_t(a.rows) * a.cols;
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(a.in);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.cols;
    const int c = int(i - r * a.cols);
    a.out[i] = __bfloat162float(in[r * a.width + c]);
  }
}

int blocks_for(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_scatter_columns(const moefuse_scatter_columns_args* a, void* stream) {
  const char* name = "moefuse_moe_scatter_columns";
  if (a == nullptr || a->rows < 0 || a->width < 1 || a->col_stride < 1 || a->col_of == nullptr ||
      a->values == nullptr || a->out == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: bad arguments", name);
  }
  if (a->rows == 0) return MOEFUSE_STATUS_OK;
  scatter_columns_kernel<<<blocks_for(int64_t(a->rows) * a->width), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *a);
  return after_launch(name);
}

extern "C" moefuse_status moefuse_moe_columns_to_f32(const moefuse_columns_to_f32_args* a, void* stream) {
  const char* name = "moefuse_moe_columns_to_f32";
  if (a == nullptr || a->rows < 0 || a->cols < 1 || a->width < a->cols || a->in == nullptr || a->out == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: bad arguments", name);
  }
  if (a->rows == 0) return MOEFUSE_STATUS_OK;
  columns_to_f32_kernel<<<blocks_for(int64_t(a->rows) * a->cols), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *a);
  return after_launch(name);
}
