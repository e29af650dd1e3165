// Epilogue of the fused gate_up (kernel/sm90_gate_up_fused.cuh): from one warp group's
// 64 x 256 fp32 accumulator slab, the activation h (bf16, `inter` columns) and, when
// training, the pre-activation h_pre (bf16, `width` columns, in the weights' gate/up layout),
// for the tile's first `rows` rows only (the next group's rows share the tile).
// Each store stages 64 x 64 bf16 through the warp group's padded shared slab and writes
// whole 128-byte row segments with 16-byte stores, as epilogue/masked_rows.cuh does.
//
// Accumulator columns of a tile (see the kernel): RELU2: h columns j0..j0+255; split:
// 0..127 gate j0.., 128..255 up j0..; interleaved: W rows 2*j0.. (g, u pairs). A thread's
// fragment holds columns (8 j + 2 q, 8 j + 2 q + 1) of blocks j = 0..31 (q = lane % 4), so
// the split pair is (block j, block j + 16) and the interleaved pair (column c, c + 1).
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/moe/activation_math.cuh"

namespace moefuse::epilogue {

struct ActivationRows {
  int act;
  int layout;
  int inter;
  int width;
  float alpha;
  float limit;

  // Shared -> global: rows [0, rows) and columns [0, cols) of the slab to dst rows (pitch
  // ld) at column gcol; 8 threads per 128-byte segment, 16 rows per sweep.
  CUTE_DEVICE static void slab_out(const __nv_bfloat16* slab, int t, int rows, int cols, cutlass::bfloat16_t* dst,
                                   int64_t ld, int gcol) {
    using S = MaskedRowsStorage;
    const int seg = t % 8;
    CUTE_UNROLL
    for (int sweep = 0; sweep < S::kRows / 16; ++sweep) {
      const int r = sweep * 16 + t / 8;
      if (r < rows && seg * 8 < cols) {
        *reinterpret_cast<uint4*>(dst + r * ld + gcol + seg * 8) =
            *reinterpret_cast<const uint4*>(&slab[r * S::kPitch + seg * 8]);
      }
    }
  }

  // What one warp group's store needs besides the accumulators.
  template <class TileShape, class TiledMma>
  struct Slab {
    TiledMma const& tiled_mma;
    int mma_thread_idx, wg_row0, t, wg_rows;
    __nv_bfloat16* slab;
    uint32_t barrier_id;

    CUTE_DEVICE auto coords() const {
      using namespace cute;
      Tensor cD = make_identity_tensor(make_shape(size<0>(TileShape{}), size<1>(TileShape{})));
      return tiled_mma.get_thread_slice(mma_thread_idx).partition_C(cD);  // (MMA,MMA_M,MMA_N)
    }
    CUTE_DEVICE void sync() const { cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id); }
    // Accumulator pair (i, i + 1) (columns c, c + 1) to the slab as bf16, columns from pass_col0.
    template <class Coords>
    CUTE_DEVICE void put2(Coords const& tCcD, int i, int pass_col0, float a, float b) const {
      using namespace cute;
      const auto c = tCcD(i);
      *reinterpret_cast<__nv_bfloat162*>(
          &slab[(get<0>(c) - wg_row0) * MaskedRowsStorage::kPitch + get<1>(c) - pass_col0]) =
          __float22bfloat162_rn(make_float2(a, b));
    }
  };

  template <class TileShape, class Accum, class TiledMma>
  CUTE_DEVICE void run(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                       MaskedRowsStorage& storage, uint32_t barrier_id, cutlass::bfloat16_t* h,
                       cutlass::bfloat16_t* h_pre, int row0, int rows, int n_block) const {
    using namespace cute;
    using S = MaskedRowsStorage;
    constexpr int kM = size<0>(TileShape{});
    constexpr int kN = size<1>(TileShape{});
    static_assert(kN == 256, "activation epilogue: 256-column tiles (two 128-column halves)");
    Tensor cD = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));
    Tensor tCcD = tiled_mma.get_thread_slice(mma_thread_idx).partition_C(cD);  // (MMA,MMA_M,MMA_N)
    CUTE_STATIC_ASSERT_V((size<0, 0>(tCcD) == Int<2>{}) && (size<0, 1>(tCcD) == Int<2>{}));
    CUTE_STATIC_ASSERT_V((size<0, 2>(tCcD) == Int<kN / 8>{}) && (size<1>(tCcD) == Int<1>{}) &&
                         (size<2>(tCcD) == Int<1>{}));
    const Slab<TileShape, TiledMma> out{tiled_mma,      mma_thread_idx, wg_row0, mma_thread_idx % 128,
                                        min(rows - wg_row0, S::kRows), storage.slab[(wg_row0 / S::kRows) & 1],
                                        barrier_id};
    const bool relu2 = act == MOEFUSE_ACTIVATION_RELU2;
    const bool split = !relu2 && layout == MOEFUSE_GATE_UP_SPLIT;
    if (h_pre != nullptr) store_h_pre<kN>(acc, out, split, h_pre + int64_t(row0 + wg_row0) * width, n_block);
    // One straight-line body per (activation, layout), chosen once per tile (see eval_as).
    cutlass::bfloat16_t* dst = h + int64_t(row0 + wg_row0) * inter;
    moe::with_activation(act, [&](auto a) {
      constexpr int kAct = decltype(a)::value;
      if constexpr (kAct == MOEFUSE_ACTIVATION_RELU2) {
        store_h<kAct, false, kN>(acc, out, dst, n_block);
      } else if (split) {
        store_h<kAct, true, kN>(acc, out, dst, n_block);
      } else {
        store_h<kAct, false, kN>(acc, out, dst, n_block);
      }
    });
  }

  // 1. h_pre (training only): the accumulators as they are, placed in the weights' layout.
  template <int kN, class Accum, class Out>
  CUTE_DEVICE void store_h_pre(Accum const& acc, Out const& out, bool split, cutlass::bfloat16_t* dst,
                               int n_block) const {
    using S = MaskedRowsStorage;
    const auto tCcD = out.coords();
    CUTE_UNROLL
    for (int pass = 0; pass < kN / S::kCols; ++pass) {
      int gcol, cols;
      if (split) {
        const int j = n_block * (kN / 2) + (pass % 2) * S::kCols;
        gcol = (pass < 2 ? 0 : inter) + j;
        cols = min(S::kCols, inter - j);
      } else {
        gcol = n_block * kN + pass * S::kCols;
        cols = min(S::kCols, width - gcol);
      }
      if (cols <= 0) continue;  // uniform over the warp group
      CUTE_UNROLL
      for (int j = pass * 8; j < pass * 8 + 8; ++j) {
        CUTE_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 2 * hh + 4 * j;
          out.put2(tCcD, i, pass * S::kCols, acc(i), acc(i + 1));
        }
      }
      out.sync();
      slab_out(out.slab, out.t, out.wg_rows, cols, dst, width, gcol);
      out.sync();
    }
  }

  // 2. h: the activation of each (gate, up) pair, 64 h columns per pass.
  template <int Act, bool kSplit, int kN, class Accum, class Out>
  CUTE_DEVICE void store_h(Accum const& acc, Out const& out, cutlass::bfloat16_t* dst, int n_block) const {
    using namespace cute;
    using S = MaskedRowsStorage;
    constexpr bool kRelu2 = Act == MOEFUSE_ACTIVATION_RELU2;
    constexpr int kHCols = kRelu2 ? kN : kN / 2;
    const auto tCcD = out.coords();
    auto f = [&](float g, float u) { return moe::eval_as<Act>(alpha, limit, g, u).h; };
    CUTE_UNROLL
    for (int pass = 0; pass < kHCols / S::kCols; ++pass) {
      const int hcol0 = n_block * kHCols + pass * S::kCols;
      const int cols = min(S::kCols, inter - hcol0);
      if (cols <= 0) break;  // uniform over the warp group
      if constexpr (kRelu2) {
        CUTE_UNROLL
        for (int j = pass * 8; j < pass * 8 + 8; ++j) {
          CUTE_UNROLL
          for (int hh = 0; hh < 2; ++hh) {
            const int i = 2 * hh + 4 * j;
            out.put2(tCcD, i, pass * S::kCols, f(acc(i), 0.f), f(acc(i + 1), 0.f));
          }
        }
      } else if constexpr (kSplit) {
        CUTE_UNROLL
        for (int j = pass * 8; j < pass * 8 + 8; ++j) {
          CUTE_UNROLL
          for (int hh = 0; hh < 2; ++hh) {
            const int i = 2 * hh + 4 * j;  // gate block j; its up partner is block j + 16
            const int u = i + 4 * (kN / 16);
            out.put2(tCcD, i, pass * S::kCols, f(acc(i), acc(u)), f(acc(i + 1), acc(u + 1)));
          }
        }
      } else {
        CUTE_UNROLL
        for (int j = pass * 16; j < pass * 16 + 16; ++j) {
          CUTE_UNROLL
          for (int hh = 0; hh < 2; ++hh) {
            const int i = 2 * hh + 4 * j;  // columns (g, u) = (c, c + 1), c even
            const auto c = tCcD(i);
            out.slab[(get<0>(c) - out.wg_row0) * S::kPitch + get<1>(c) / 2 - pass * S::kCols] =
                __float2bfloat16_rn(f(acc(i), acc(i + 1)));
          }
        }
      }
      out.sync();
      slab_out(out.slab, out.t, out.wg_rows, cols, dst, inter, hcol0);
      out.sync();
    }
  }
};

}  // namespace moefuse::epilogue
