// Activation forward and backward over the expert-major intermediate
// (kernels/include/moefuse/abi.h: moefuse_activation_args): bf16 in and out, fp32 math,
// the formulas of the CPU reference's `reference::activation`.
//
// thread | work
// -------+------------------------------------------------------------------------------
// each   | grid-stride over (row, chunk of V output columns) for rows < *total_rows;
//        | V = 8 (16-byte loads and stores) when I % 8 == 0 and the buffers are 16-byte
//        | aligned, else V = 1
//
// Routed backward (moefuse_moe_activation_bwd_routed): one warp per row, each lane 8 columns
// at a time; the row's d_weights is the warp's fixed-order sum of its lanes' partials.
//
// NOTES: the row count is read on the device (the last prefix-sum offset), so the grid is
// sized for the capacity and threads past the real rows do nothing; rows past the count are
// never touched.
#include <cuda_bf16.h>

#include <cmath>

#include "moefuse/moe/activation_math.cuh"
#include "moefuse/moe/activation_pairs.cuh"
#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_activation_routed_args) == 112 && offsetof(moefuse_activation_routed_args, slots) == 56 &&
                  offsetof(moefuse_activation_routed_args, source_of) == 64 &&
                  offsetof(moefuse_activation_routed_args, errors) == 96 &&
                  offsetof(moefuse_activation_routed_args, expect_tokens) == 104,
              "moefuse_activation_routed_args layout changed: update ffi.rs");

namespace moefuse::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

__device__ __forceinline__ int rows_of(const int32_t* total_rows, int max_rows) {
  if (total_rows == nullptr) return max_rows;
  int r = *total_rows;
  return r < 0 ? 0 : (r > max_rows ? max_rows : r);
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    activation_fwd_kernel(ActivationProblem p, int max_rows, const int32_t* total_rows,
                          const bf16* __restrict__ h_pre, bf16* __restrict__ h) {
  const int64_t rows = rows_of(total_rows, max_rows);
  const int64_t chunks = p.inter / V, width = p.gated ? 2 * int64_t(p.inter) : p.inter;
  const int64_t n = rows * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    // 32-bit division when the index fits (the 64-bit one costs ~4x the instructions).
    const int64_t r = n <= 0xffffffffll ? int64_t(uint32_t(i) / uint32_t(chunks)) : i / chunks;
    const int j0 = int(i - r * chunks) * V;
    float g[V], u[V], out[V];
    load_pairs<V>(p, h_pre + r * width, j0, g, u);
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = eval(p.act, p.alpha, p.limit, g[v], u[v]).h;
    bf16* dst = h + r * p.inter + j0;
    if constexpr (V == 8) {
      *reinterpret_cast<uint4*>(dst) = pack8(out, 0);
    } else {
      dst[0] = __float2bfloat16_rn(out[0]);
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    activation_bwd_kernel(ActivationProblem p, int max_rows, const int32_t* total_rows,
                          const bf16* __restrict__ h_pre, const bf16* __restrict__ dh,
                          bf16* __restrict__ d_h_pre) {
  const int64_t rows = rows_of(total_rows, max_rows);
  const int64_t chunks = p.inter / V, width = p.gated ? 2 * int64_t(p.inter) : p.inter;
  const int64_t n = rows * chunks;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    // 32-bit division when the index fits (the 64-bit one costs ~4x the instructions).
    const int64_t r = n <= 0xffffffffll ? int64_t(uint32_t(i) / uint32_t(chunks)) : i / chunks;
    const int j0 = int(i - r * chunks) * V;
    float g[V], u[V], d[V], dg[V], du[V];
    load_pairs<V>(p, h_pre + r * width, j0, g, u);
    const bf16* src = dh + r * p.inter + j0;
    if constexpr (V == 8) {
      unpack8(*reinterpret_cast<const uint4*>(src), d, 0);
    } else {
      d[0] = __bfloat162float(src[0]);
    }
#pragma unroll
    for (int v = 0; v < V; ++v) {
      Point pt = eval(p.act, p.alpha, p.limit, g[v], u[v]);
      dg[v] = d[v] * pt.dg;
      du[v] = d[v] * pt.du;
    }
    store_pairs<V>(p, d_h_pre + r * width, j0, dg, du);
  }
}

// Warp per row: d_h_pre = act'(h_pre) (w dh_u), d_weights[s] = <dh_u, h>, h_scaled = w h.
__global__ void __launch_bounds__(kThreads)
    activation_bwd_routed_kernel(ActivationProblem p, moefuse_activation_routed_args a) {
  const int lane = threadIdx.x & 31;
  // A permutation of another call (its tokens stamp disagrees): nothing is written.
  if (a.expect_tokens != nullptr && int64_t(*a.expect_tokens) * a.top_k != a.slots) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && a.errors != nullptr) atomicOr(a.errors, MOEFUSE_MOE_ERROR_STALE);
    return;
  }
  const int64_t rows = rows_of(a.act.total_rows, a.act.max_rows);
  const int64_t width = p.gated ? 2 * int64_t(p.inter) : p.inter;
  const int chunks = p.inter / 8;
  const auto* h_pre = static_cast<const bf16*>(a.act.h_pre);
  const auto* dh = static_cast<const bf16*>(a.act.dh);
  auto* d_h_pre = static_cast<bf16*>(a.act.out);
  auto* h_scaled = static_cast<bf16*>(a.h_scaled);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5); r < rows; r += warps) {
    const int s = a.source_of[r];
    if (s < 0 || s >= a.slots) {
      if (lane == 0 && a.errors != nullptr) atomicOr(a.errors, MOEFUSE_MOE_ERROR_SOURCE);
      continue;
    }
    const float w = a.weights[s];
    float dot = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      const int j0 = c * 8;
      float g[8], u[8], d[8], dg[8], du[8], hw[8];
      load_pairs<8>(p, h_pre + r * width, j0, g, u);
      unpack8(*reinterpret_cast<const uint4*>(dh + r * p.inter + j0), d, 0);
      routed_backward8([&](float gv, float uv) { return eval(p.act, p.alpha, p.limit, gv, uv); }, w, d, g, u, dg,
                       du, hw, dot);
      store_pairs<8>(p, d_h_pre + r * width, j0, dg, du);
      *reinterpret_cast<uint4*>(h_scaled + r * p.inter + j0) = pack8(hw, 0);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(~0u, dot, o);
    if (lane == 0) a.d_weights[s] = dot;
  }
}

moefuse_status check(const moefuse_activation_args* a, const char* name, bool backward) {
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (a->activation < MOEFUSE_ACTIVATION_SWIGLU || a->activation > MOEFUSE_ACTIVATION_RELU2) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: unknown activation %d", name, a->activation);
  }
  if (a->layout != MOEFUSE_GATE_UP_SPLIT && a->layout != MOEFUSE_GATE_UP_INTERLEAVED) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: unknown gate/up layout %d", name, a->layout);
  }
  if (a->intermediate < 1 || a->max_rows < 0 || a->intermediate > (1 << 29)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: intermediate=%d max_rows=%d", name,
                a->intermediate, a->max_rows);
  }
  if (a->h_pre == nullptr || a->out == nullptr || (backward && a->dh == nullptr)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer (h_pre=%p dh=%p out=%p)", name,
                a->h_pre, a->dh, a->out);
  }
  if ((reinterpret_cast<uintptr_t>(a->h_pre) | reinterpret_cast<uintptr_t>(a->out) |
       reinterpret_cast<uintptr_t>(backward ? a->dh : nullptr)) & 1u) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: bf16 buffers must be 2-byte aligned", name);
  }
  if (a->total_rows != nullptr && !aligned_for(a->total_rows)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: total_rows must be 4-byte aligned", name);
  }
  return MOEFUSE_STATUS_OK;
}

ActivationProblem problem_of(const moefuse_activation_args& a) {
  return ActivationProblem{a.activation, a.layout, a.intermediate, a.alpha, a.limit,
                 a.activation != MOEFUSE_ACTIVATION_RELU2};
}

int blocks_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  return int(b < kMaxBlocks ? (b < 1 ? 1 : b) : kMaxBlocks);
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_activation_fwd(const moefuse_activation_args* a,
                                                      void* stream) {
  const char* name = "moefuse_moe_activation_fwd";
  moefuse_status st = check(a, name, false);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (a->max_rows == 0) return MOEFUSE_STATUS_OK;
  const ActivationProblem p = problem_of(*a);
  auto s = static_cast<cudaStream_t>(stream);
  const auto* in = static_cast<const __nv_bfloat16*>(a->h_pre);
  auto* out = static_cast<__nv_bfloat16*>(a->out);
  if (a->intermediate % 8 == 0 && aligned16(in) && aligned16(out)) {
    activation_fwd_kernel<8><<<blocks_for(int64_t(a->max_rows) * (a->intermediate / 8)), kThreads,
                               0, s>>>(p, a->max_rows, a->total_rows, in, out);
  } else {
    activation_fwd_kernel<1><<<blocks_for(int64_t(a->max_rows) * a->intermediate), kThreads, 0,
                               s>>>(p, a->max_rows, a->total_rows, in, out);
  }
  return after_launch(name);
}

extern "C" moefuse_status moefuse_moe_activation_bwd(const moefuse_activation_args* a,
                                                      void* stream) {
  const char* name = "moefuse_moe_activation_bwd";
  moefuse_status st = check(a, name, true);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (a->max_rows == 0) return MOEFUSE_STATUS_OK;
  const ActivationProblem p = problem_of(*a);
  auto s = static_cast<cudaStream_t>(stream);
  const auto* in = static_cast<const __nv_bfloat16*>(a->h_pre);
  const auto* dh = static_cast<const __nv_bfloat16*>(a->dh);
  auto* out = static_cast<__nv_bfloat16*>(a->out);
  if (a->intermediate % 8 == 0 && aligned16(in) && aligned16(dh) && aligned16(out)) {
    activation_bwd_kernel<8><<<blocks_for(int64_t(a->max_rows) * (a->intermediate / 8)), kThreads,
                               0, s>>>(p, a->max_rows, a->total_rows, in, dh, out);
  } else {
    activation_bwd_kernel<1><<<blocks_for(int64_t(a->max_rows) * a->intermediate), kThreads, 0,
                               s>>>(p, a->max_rows, a->total_rows, in, dh, out);
  }
  return after_launch(name);
}

extern "C" moefuse_status moefuse_moe_activation_bwd_routed(const moefuse_activation_routed_args* a,
                                                             void* stream) {
  const char* name = "moefuse_moe_activation_bwd_routed";
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  moefuse_status st = check(&a->act, name, true);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (a->act.intermediate % 8 != 0 || a->slots < 0 || a->top_k < 1 || a->slots % a->top_k != 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM,
                "%s: intermediate %d (multiple of 8), slots %d (a multiple of top_k), top_k %d (>= 1)", name,
                a->act.intermediate, a->slots, a->top_k);
  }
  if (a->act.max_rows == 0) return MOEFUSE_STATUS_OK;
  if (a->source_of == nullptr || a->weights == nullptr || a->d_weights == nullptr || a->h_scaled == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if (!aligned16(a->act.h_pre) || !aligned16(a->act.dh) || !aligned16(a->act.out) || !aligned16(a->h_scaled)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: bf16 buffers must be 16-byte aligned", name);
  }
  const ActivationProblem p = problem_of(a->act);
  const int warps_per_block = kThreads / 32;
  const int64_t blocks = (int64_t(a->act.max_rows) + warps_per_block - 1) / warps_per_block;
  activation_bwd_routed_kernel<<<int(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0,
                                 static_cast<cudaStream_t>(stream)>>>(p, *a);
  return after_launch(name);
}
