// Eight bf16 columns of the gate/up intermediate at a time, in fp32: loads of the (g, u)
// pairs of output columns from `h_pre` in either gate/up layout and stores of their
// partials where those inputs sat. Shared by the activation kernels (moe/activation.cu) and
// the down dgrad's activation-backward epilogue (epilogue/activation_backward_rows.cuh), so
// both read and write the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "moefuse/abi.h"
#include "moefuse/moe/activation_math.cuh"

namespace moefuse::moe {

// bf16 <-> fp32 through bits: a bf16 is the upper half of an fp32.
__device__ __forceinline__ float lo_bf16(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t bf16_bits(float x) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
}
__device__ __forceinline__ uint32_t pack2(float a, float b) { return bf16_bits(a) | (bf16_bits(b) << 16); }

__device__ __forceinline__ void unpack8(uint4 q, float (&f)[8], int at) {
  f[at + 0] = lo_bf16(q.x);
  f[at + 1] = hi_bf16(q.x);
  f[at + 2] = lo_bf16(q.y);
  f[at + 3] = hi_bf16(q.y);
  f[at + 4] = lo_bf16(q.z);
  f[at + 5] = hi_bf16(q.z);
  f[at + 6] = lo_bf16(q.w);
  f[at + 7] = hi_bf16(q.w);
}
// Interleaved (g, u, g, u, ...) halves of 16 values.
__device__ __forceinline__ void unpack8_pairs(uint4 q, float (&g)[8], float (&u)[8], int at) {
  g[at + 0] = lo_bf16(q.x);
  u[at + 0] = hi_bf16(q.x);
  g[at + 1] = lo_bf16(q.y);
  u[at + 1] = hi_bf16(q.y);
  g[at + 2] = lo_bf16(q.z);
  u[at + 2] = hi_bf16(q.z);
  g[at + 3] = lo_bf16(q.w);
  u[at + 3] = hi_bf16(q.w);
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8], int at) {
  return make_uint4(pack2(f[at + 0], f[at + 1]), pack2(f[at + 2], f[at + 3]),
                    pack2(f[at + 4], f[at + 5]), pack2(f[at + 6], f[at + 7]));
}
__device__ __forceinline__ uint4 pack8_pairs(const float (&g)[8], const float (&u)[8], int at) {
  return make_uint4(pack2(g[at + 0], u[at + 0]), pack2(g[at + 1], u[at + 1]),
                    pack2(g[at + 2], u[at + 2]), pack2(g[at + 3], u[at + 3]));
}

using bf16 = __nv_bfloat16;

// The activation and gate/up layout of an intermediate (`gated`: every activation but
// RELU2, whose h_pre has only I columns).
struct ActivationProblem {
  int act, layout, inter;
  float alpha, limit;
  bool gated;
};

// Loads the V (g, u) pairs of output columns [j0, j0 + V) of `row` (u = 0 for RELU2); V = 8
// needs j0 % 8 == 0 and a 16-byte aligned row.
template <int V>
__device__ __forceinline__ void load_pairs(const ActivationProblem& p, const bf16* row, int j0,
                                           float (&g)[V], float (&u)[V]) {
  if constexpr (V == 8) {
    const auto* q = reinterpret_cast<const uint4*>(row);
    if (!p.gated) {
      unpack8(__ldg(q + j0 / 8), g, 0);
#pragma unroll
      for (int v = 0; v < 8; ++v) u[v] = 0.f;
    } else if (p.layout == MOEFUSE_GATE_UP_SPLIT) {
      unpack8(__ldg(q + j0 / 8), g, 0);
      unpack8(__ldg(q + (p.inter + j0) / 8), u, 0);
    } else {
      unpack8_pairs(__ldg(q + j0 / 4), g, u, 0);
      unpack8_pairs(__ldg(q + j0 / 4 + 1), g, u, 4);
    }
  } else {
    static_assert(V == 1, "V is 1 or 8");
    if (!p.gated) {
      g[0] = __bfloat162float(row[j0]);
      u[0] = 0.f;
    } else if (p.layout == MOEFUSE_GATE_UP_SPLIT) {
      g[0] = __bfloat162float(row[j0]);
      u[0] = __bfloat162float(row[p.inter + j0]);
    } else {
      g[0] = __bfloat162float(row[2 * j0]);
      u[0] = __bfloat162float(row[2 * j0 + 1]);
    }
  }
}

// Stores V values of each of `dg`, `du` where their inputs sat (du ignored for RELU2).
template <int V>
__device__ __forceinline__ void store_pairs(const ActivationProblem& p, bf16* row, int j0,
                                            const float (&dg)[V], const float (&du)[V]) {
  if constexpr (V == 8) {
    if (!p.gated) {
      *reinterpret_cast<uint4*>(row + j0) = pack8(dg, 0);
    } else if (p.layout == MOEFUSE_GATE_UP_SPLIT) {
      *reinterpret_cast<uint4*>(row + j0) = pack8(dg, 0);
      *reinterpret_cast<uint4*>(row + p.inter + j0) = pack8(du, 0);
    } else {
      uint4* q = reinterpret_cast<uint4*>(row + 2 * j0);
      q[0] = pack8_pairs(dg, du, 0);
      q[1] = pack8_pairs(dg, du, 4);
    }
  } else {
    if (!p.gated) {
      row[j0] = __float2bfloat16_rn(dg[0]);
    } else if (p.layout == MOEFUSE_GATE_UP_SPLIT) {
      row[j0] = __float2bfloat16_rn(dg[0]);
      row[p.inter + j0] = __float2bfloat16_rn(du[0]);
    } else {
      row[2 * j0] = __float2bfloat16_rn(dg[0]);
      row[2 * j0 + 1] = __float2bfloat16_rn(du[0]);
    }
  }
}

// The routed backward of 8 columns of one row, from its unweighted dh_u (`d`), h_pre's
// (g, u) pairs and the row's routing weight `w`: d_h_pre's (dg, du) of w·d, h_scaled's
// w·h with h as the forward stored it (bf16), and ⟨d, h⟩ added to `dot` column by column.
// `eval(g, u)` is the activation (moe::eval, or eval_as<Act> chosen once per tile).
template <class Eval>
__device__ __forceinline__ void routed_backward8(Eval const& eval, float w, const float (&d)[8], const float (&g)[8],
                                                 const float (&u)[8], float (&dg)[8], float (&du)[8],
                                                 float (&hw)[8], float& dot) {
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const Point pt = eval(g[v], u[v]);
    const float h = __bfloat162float(__float2bfloat16_rn(pt.h));
    dot += d[v] * h;
    hw[v] = w * h;
    dg[v] = w * d[v] * pt.dg;
    du[v] = w * d[v] * pt.du;
  }
}

}  // namespace moefuse::moe
