// The down dgrad's routed activation backward for the Blackwell contiguous kernel
// (kernel/sm100_contiguous_grouped.cuh): the formulas of epilogue/activation_backward_rows.cuh
// (the Hopper epilogue; same Params, same moe::routed_backward8), one tile row per thread,
// read from tensor memory 32 columns at a time. For the row's columns j of I in the tile:
//   dh_u = bf16(acc), h = bf16(act(g, u)), d_h_pre = (w dh_u) act'(g, u), h_scaled = bf16(w h),
//   partial = sum_j dh_u h (fp32, in column order, one per row and 256-column block).
// The partial's order differs from the Hopper epilogue's (8 threads per row there, a shuffle
// tree), so d_topk_weights may differ between the archs in the last fp32 bits; on one arch
// it is deterministic.
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "moefuse/epilogue/activation_backward_rows.cuh"
#include "moefuse/kernel/sm100_umma.cuh"
#include "moefuse/moe/activation_pairs.cuh"
#include "moefuse/moe_abi.h"

namespace moefuse::epilogue {

struct ActivationBackwardRow {
  static constexpr bool kFused = true;
  using Params = ActivationBackwardRows::Params;

  // Row `row` of the tile (-1 past its group: only the warp-collective loads run), the
  // accumulator at `acc` (this warp's lane base), columns [col0, col0 + cols) of I.
  template <int kTileN>
  CUTE_DEVICE static void store(Params const& p, uint32_t acc, int row, int col0, int cols, int n_block) {
    float w = 0.f;  // the row's routing weight; 0 for a bad slot, which raises the error bit
    if (row >= 0) {
      const int s = __ldg(p.source_of + row);
      if (s >= 0 && s < p.slots) {
        w = __ldg(p.weights + s);
      } else if (p.errors != nullptr) {
        atomicOr(p.errors, MOEFUSE_MOE_ERROR_SOURCE);
      }
    }
    // One straight-line body per activation, chosen once per tile (the Hopper epilogue's
    // NOTES say why).
    moe::with_activation(p.act.act, [&](auto a) {
      store_as<decltype(a)::value, kTileN>(p, acc, row, col0, cols, n_block, w);
    });
  }

  template <int Act, int kTileN>
  CUTE_DEVICE static void store_as(Params const& p, uint32_t acc, int row, int col0, int cols, int n_block,
                                   float w) {
    const auto eval = [&](float g, float u) { return moe::eval_as<Act>(p.act.alpha, p.act.limit, g, u); };
    const int64_t r = row < 0 ? 0 : row;
    float dot = 0.f;
    CUTE_UNROLL
    for (int c0 = 0; c0 < kTileN; c0 += kernel::sm100::kColsPerLoad) {
      float v[kernel::sm100::kColsPerLoad];
      kernel::sm100::tmem_load(acc + c0, v);
      if (row < 0 || c0 >= cols) continue;
      CUTE_UNROLL
      for (int q = 0; q < kernel::sm100::kColsPerLoad / 8; ++q) {
        if (c0 + q * 8 >= cols) break;
        const int j0 = col0 + c0 + q * 8;
        float d[8], g[8], u[8], dg[8], du[8], hw[8];
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) d[i] = __bfloat162float(__float2bfloat16_rn(v[q * 8 + i]));  // dh_u as stored
        moe::load_pairs<8>(p.act, p.h_pre + r * p.width, j0, g, u);
        moe::routed_backward8(eval, w, d, g, u, dg, du, hw, dot);
        moe::store_pairs<8>(p.act, p.d_h_pre + r * p.width, j0, dg, du);
        *reinterpret_cast<uint4*>(p.h_scaled + r * p.act.inter + j0) = moe::pack8(hw, 0);
      }
    }
    if (row >= 0) p.partials[r * p.n_blocks + n_block] = dot;
  }
};

}  // namespace moefuse::epilogue
