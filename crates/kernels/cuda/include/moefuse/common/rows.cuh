// Warp-wide operations on bf16 rows shared by the data-movement kernels (token
// permutation and combine in kernels/moe/, expert-parallel dispatch and combine in
// kernels/comm/): 16-byte vectors of 8 bf16, several loads in flight per lane.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moefuse::rows {

// Loads per lane kept in flight: a warp moves 32 x kUnroll x 16 bytes per step, which with
// 16 warps per SM covers memory latency (one load per lane reached ~0.5 TB/s).
constexpr int kUnroll = 4;

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], uint4 v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] += w * f.x;
    acc[2 * q + 1] += w * f.y;
  }
}

__device__ __forceinline__ uint4 to_bf16x8(const float (&acc)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return v;
}

__device__ __forceinline__ float dot_bf16x8(uint4 a, uint4 b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(x[q]), g = __bfloat1622float2(y[q]);
    s += f.x * g.x + f.y * g.y;
  }
  return s;
}

__device__ __forceinline__ uint4 scale_bf16x8(uint4 v, float w) {
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    h[q] = __floats2bfloat162_rn(w * f.x, w * f.y);
  }
  return v;
}

// warp_copy_row_to's loads in flight per lane: a 4 KB row (hidden 2048) in one round trip.
// With 4, the expert-parallel dispatch (one token per warp, two warps' worth of tokens per
// warp slot) wrote its expert-major rows at ~2.7 TB/s.
constexpr int kCopyUnroll = 8;

// Copies vectors [c0 - lane, n) of one row (c0 = lane + a multiple of 32) into `n_dst`
// destinations with the whole warp: warp_copy_row_to from c0.
__device__ __forceinline__ void warp_copy_row_from(uint4* const* dst, int n_dst, const uint4* src, int n, int c0) {
  int c = c0;
  for (; c + 32 * (kCopyUnroll - 1) < n; c += 32 * kCopyUnroll) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = __ldcg(src + c + 32 * u);
    for (int j = 0; j < n_dst; ++j) {
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) dst[j][c + 32 * u] = v[u];
    }
  }
  for (; c < n; c += 32) {
    const uint4 v = __ldcg(src + c);
    for (int j = 0; j < n_dst; ++j) dst[j][c] = v;
  }
}

// Copies one row of `n` 16-byte vectors from `src` into `n_dst` destinations with the whole
// warp (a row feeding several experts is read once). Loads bypass L1 (`src` may have been
// written by a peer GPU during the kernel).
__device__ __forceinline__ void warp_copy_row_to(uint4* const* dst, int n_dst, const uint4* src, int n, int lane) {
  warp_copy_row_from(dst, n_dst, src, n, lane);
}

// A row's head: its first kHeadVectors 16-byte vectors (4 KB, a whole row at hidden 2048),
// copied into a warp's shared-memory buffer by cp.async before the row's destinations are
// known (e.g. before a grid dependency resolves), so that its round trip overlaps whatever
// comes between and holds no registers. Lane l copies, and later reads, vectors l, l + 32, ...
// only: no warp barrier is needed between the two.
constexpr int kHeadVectors = 32 * kCopyUnroll;

__device__ __forceinline__ void load_row_head(uint4* head, const uint4* src, int n, int lane) {
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // an earlier head never waited for
  for (int c = lane; c < kHeadVectors && c < n; c += 32) {
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(head + c));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src + c) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// warp_copy_row_to with the row's head in `head` (load_row_head of the same `src`, by the
// same warp): waits for the lane's head copies, stores them, then copies the rest.
__device__ __forceinline__ void warp_copy_row_with_head(uint4* const* dst, int n_dst, const uint4* head,
                                                        const uint4* src, int n, int lane) {
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#pragma unroll
  for (int u = 0; u < kCopyUnroll; ++u) {
    const int c = lane + 32 * u;
    if (c < n) {
      const uint4 v = head[c];
      for (int j = 0; j < n_dst; ++j) dst[j][c] = v;
    }
  }
  warp_copy_row_from(dst, n_dst, src, n, lane + kHeadVectors);
}

// warp_weighted_sum's loads in flight per lane: kRowBatch rows x kSumUnroll vectors
// (16 bytes each). With one row at a time (4 loads in flight) the expert-parallel combine
// read its rows at ~2.6 TB/s; 4 x 2 doubles that in 89 registers (the EP combine_send,
// two 256-thread blocks per SM), where 8 x 2 needed 152 or spilled at 128.
constexpr int kRowBatch = 4;
constexpr int kSumUnroll = 2;

// out = sum_j w[j] * rows[j] over `n_rows` rows of `n` vectors (w null: weights 1), summed
// in fp32 in row order (deterministic), written as bf16 with the whole warp.
__device__ __forceinline__ void warp_weighted_sum(const uint4* const* rows, const float* w, int n_rows, uint4* out,
                                                  int n, int lane) {
  for (int c0 = lane; c0 < n; c0 += 32 * kSumUnroll) {
    float acc[kSumUnroll][8] = {};
    for (int j0 = 0; j0 < n_rows; j0 += kRowBatch) {
      uint4 v[kRowBatch][kSumUnroll];
#pragma unroll
      for (int r = 0; r < kRowBatch; ++r) {
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) {
          if (j0 + r < n_rows && c0 + 32 * u < n) v[r][u] = __ldcg(rows[j0 + r] + c0 + 32 * u);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowBatch; ++r) {
        if (j0 + r >= n_rows) break;
        const float wj = w ? w[j0 + r] : 1.f;
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) {
          if (c0 + 32 * u < n) add_bf16x8(acc[u], v[r][u], wj);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      if (c0 + 32 * u < n) out[c0 + 32 * u] = to_bf16x8(acc[u]);
    }
  }
}

}  // namespace moefuse::rows
