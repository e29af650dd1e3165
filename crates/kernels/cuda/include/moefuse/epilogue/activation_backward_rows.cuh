// Epilogue of the down dgrad that runs the routed activation backward on its tile
// (moe/down_dgrad_fused.cu), so `dh_u` is never written and read back. For the tile's first
// `rows` rows r and its columns j in [col0, col0 + cols) of I, with w the row's routing
// weight (weights[source_of[r]], read before the tile's mainloop):
//   dh_u        = bf16(acc)                      the unweighted dy · D_e, as the GEMM stored it
//   h           = bf16(act(g, u))                g, u: h_pre's gate and up columns of j
//   d_h_pre     = (w dh_u) act'(g, u)            at h_pre's gate/up positions
//   h_scaled    = bf16(w h)                      the down wgrad's operand
//   partial     = sum_j dh_u h                   fp32, one per row and 256-column block
// The row's d_topk_weights is its partials summed in block order (the launcher's second
// kernel): the same formulas as moe/activation.cu's routed kernel, in a fixed order.
//
// Per 64-column pass, as epilogue/masked_rows.cuh: the fragments go to the warp group's
// padded slab as bf16, then each thread takes 8 columns of 4 rows (8 threads per 128-byte
// row segment, 16 rows per sweep), reads their h_pre and writes d_h_pre and h_scaled with
// 16-byte stores. A thread keeps the same 4 rows in every pass, so its 4 dot products run
// across the passes and are summed over the row's 8 threads once, at the end.
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/moe/activation_pairs.cuh"
#include "moefuse/moe_abi.h"

namespace moefuse::epilogue {

struct ActivationBackwardRows {
  static constexpr bool kFused = true;
  static constexpr int kSweeps = MaskedRowsStorage::kRows / 16;

  struct Params {
    const __nv_bfloat16* h_pre;  // [rows, width]
    __nv_bfloat16* d_h_pre;      // [rows, width]
    __nv_bfloat16* h_scaled;     // [rows, inter]
    float* partials;             // [rows, n_blocks]
    const int32_t* source_of;    // [rows] slot of each row
    const float* weights;        // [slots] routing weights
    uint32_t* errors;            // [1] or nullptr
    int slots;
    int n_blocks;
    int width;
    moe::ActivationProblem act;
  };

  // The routing weights of the 4 rows a thread stores (0 past the tile's rows and for a
  // bad slot, which also raises MOEFUSE_MOE_ERROR_SOURCE).
  struct RowState {
    float w[kSweeps];
  };

  CUTE_DEVICE static RowState prepare(Params const& p, int row0, int rows, int wg_row0, int t) {
    RowState st;
    CUTE_UNROLL
    for (int sweep = 0; sweep < kSweeps; ++sweep) {
      const int r = wg_row0 + sweep * 16 + t / 8;
      st.w[sweep] = 0.f;
      if (r < rows) {
        const int s = __ldg(p.source_of + row0 + r);
        if (s >= 0 && s < p.slots) {
          st.w[sweep] = __ldg(p.weights + s);
        } else if (t % 8 == 0 && p.errors != nullptr) {
          atomicOr(p.errors, MOEFUSE_MOE_ERROR_SOURCE);
        }
      }
    }
    return st;
  }

  // Consumer perspective (one warp group, 128 threads, named barrier `barrier_id`): rows
  // [wg_row0, wg_row0 + 64) of the tile, columns [col0, col0 + cols) of I, n-block n_block.
  // NOTES: one straight-line body per activation, chosen once per tile (as the fused
  // gate_up's epilogue does): with the activation switched per element (moe::eval) the 512
  // elements a thread computes per tile were each a branch of their own, and the whole
  // fused stage measured 1.3-1.4 ms against 0.57 ms for the two unfused kernels (H200).
  template <class TileShape, class Accum, class TiledMma>
  CUTE_DEVICE static void store(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                                MaskedRowsStorage& storage, uint32_t barrier_id, Params const& p, int row0, int rows,
                                int col0, int cols, int n_block, RowState const& st) {
    moe::with_activation(p.act.act, [&](auto a) {
      store_as<decltype(a)::value, TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, storage, barrier_id, p, row0,
                                              rows, col0, cols, n_block, st);
    });
  }

  template <int Act, class TileShape, class Accum, class TiledMma>
  CUTE_DEVICE static void store_as(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                                   MaskedRowsStorage& storage, uint32_t barrier_id, Params const& p, int row0,
                                   int rows, int col0, int cols, int n_block, RowState const& st) {
    using namespace cute;
    using S = MaskedRowsStorage;
    constexpr int kN = size<1>(TileShape{});
    const auto tCcD = accumulator_coords<TileShape>(acc, tiled_mma, mma_thread_idx);
    __nv_bfloat16* slab = storage.slab[(wg_row0 / S::kRows) & 1];
    const int t = mma_thread_idx % 128;
    const int seg = t % 8;
    const int wg_rows = min(rows - wg_row0, S::kRows);
    float dot[kSweeps] = {};
    CUTE_UNROLL
    for (int pass = 0; pass < kN / S::kCols; ++pass) {
      if (pass * S::kCols >= cols) break;
      const int j0 = col0 + pass * S::kCols + seg * 8;  // this thread's 8 columns of I
      const bool col_live = pass * S::kCols + seg * 8 < cols;
      fragments_to_slab(acc, tCcD, slab, wg_row0, pass, 1.f);  // the dh_u the unfused dgrad stores
      cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
      CUTE_UNROLL
      for (int sweep = 0; sweep < kSweeps; ++sweep) {
        const int r = sweep * 16 + t / 8;
        if (r < wg_rows && col_live) {
          float d[8], g[8], u[8], dg[8], du[8], hw[8];
          moe::unpack8(*reinterpret_cast<const uint4*>(&slab[r * S::kPitch + seg * 8]), d, 0);
          const int64_t row = row0 + wg_row0 + r;
          moe::load_pairs<8>(p.act, p.h_pre + row * p.width, j0, g, u);
          const auto eval = [&](float gv, float uv) { return moe::eval_as<Act>(p.act.alpha, p.act.limit, gv, uv); };
          moe::routed_backward8(eval, st.w[sweep], d, g, u, dg, du, hw, dot[sweep]);
          moe::store_pairs<8>(p.act, p.d_h_pre + row * p.width, j0, dg, du);
          *reinterpret_cast<uint4*>(p.h_scaled + row * p.act.inter + j0) = moe::pack8(hw, 0);
        }
      }
      cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);  // the slab is rewritten next pass
    }
    // The row's 8 threads are 8 consecutive lanes: a fixed shuffle tree.
    CUTE_UNROLL
    for (int sweep = 0; sweep < kSweeps; ++sweep) {
      float v = dot[sweep];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      const int r = sweep * 16 + t / 8;
      if (seg == 0 && r < wg_rows) p.partials[int64_t(row0 + wg_row0 + r) * p.n_blocks + n_block] = v;
    }
  }
};

}  // namespace moefuse::epilogue
