// Epilogue for M-grouped tiles whose last rows may belong to another group:
// D[r, c] = alpha * acc + beta * D[r, c] for the tile's first `rows` rows and first `cols`
// columns only. Each consumer warp group stages its 64-row slab through shared memory in
// passes of 64 columns (bf16, padded rows: conflict-free both ways), then writes whole
// 128-byte row segments with 16-byte stores, predicated on the row.
// NOTES: no TMA store: a TMA store clips at the tensor's end, not at the group's, and would
// overwrite the next group's rows. Storing the WGMMA fragments straight to global memory
// (two bf16 per lane, 8 rows per instruction) measured ~2.5 us per 128x256 tile: each
// instruction touches 8 lines; this staging writes 4 lines per instruction, all full.
// With beta != 0 the product is rounded to bf16 before beta * D is added (two roundings).
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"

namespace moefuse::epilogue {

// Where row `row` of D (the contiguous grouped layout's row) is stored.
// In order: D itself, row * ldd.
struct RowsInOrder {
  CUTE_DEVICE cutlass::bfloat16_t* operator()(cutlass::bfloat16_t* d, int64_t ldd, int row) const {
    return d + int64_t(row) * ldd;
  }
};

// Scattered: row r at the address row_ptr[r] (16-byte aligned; this device's memory or a
// peer's over NVLink), whatever D and ldd say: the expert-parallel down GEMM writes each
// expert output row straight into its token's slot on the token's home rank.
struct RowsScattered {
  const uint64_t* row_ptr;
  CUTE_DEVICE cutlass::bfloat16_t* operator()(cutlass::bfloat16_t*, int64_t, int row) const {
    return reinterpret_cast<cutlass::bfloat16_t*>(__ldg(row_ptr + row));
  }
};

// The plain store (the contiguous kernel's default Fusion_): nothing fused, nothing read
// before the mainloop; the kernel stores D with store_masked_rows.
struct NoFusion {
  static constexpr bool kFused = false;
  struct Params {};
  struct RowState {};
  CUTE_DEVICE static RowState prepare(Params const&, int, int, int, int) { return {}; }
};

// Shared memory of one consumer warp group: a 64 x 64 bf16 slab, rows padded to 72.
struct MaskedRowsStorage {
  static constexpr int kRows = 64;
  static constexpr int kCols = 64;
  static constexpr int kPitch = 72;  // 144-byte rows: 8 rows of a fragment store hit distinct banks
  alignas(16) __nv_bfloat16 slab[2][kRows * kPitch];
};

// Each accumulator element's (row, column) in the tile, for one thread of a cooperative
// WGMMA accumulator of two 64-row warp groups: ((2 columns, 2 row halves, N/8 column
// blocks), 1, 1), which the stores below index as i = 2 * half + 4 * block (+1: next column).
template <class TileShape, class Accum, class TiledMma>
CUTE_DEVICE auto accumulator_coords(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx) {
  using namespace cute;
  constexpr int kM = size<0>(TileShape{});
  constexpr int kN = size<1>(TileShape{});
  static_assert(kN % 64 == 0, "the rows epilogues store 64-column passes: tile N must be a multiple of 64");
  Tensor cD = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));  // (BLK_M,BLK_N) -> (m,n)
  Tensor tCcD = tiled_mma.get_thread_slice(mma_thread_idx).partition_C(cD);  // (MMA,MMA_M,MMA_N)
  static_assert(decltype(size(acc))::value == decltype(size(tCcD))::value, "accumulator and D partitions differ");
  CUTE_STATIC_ASSERT_V((size<0, 0>(tCcD) == Int<2>{}) && (size<0, 1>(tCcD) == Int<2>{}));
  CUTE_STATIC_ASSERT_V((size<0, 2>(tCcD) == Int<kN / 8>{}) && (size<1>(tCcD) == Int<1>{}) &&
                       (size<2>(tCcD) == Int<1>{}));
  return tCcD;
}

// One 64-column pass of a warp group's accumulator to its padded slab as bf16 (alpha * acc):
// 8 column blocks of 8, two row halves, one bf16 pair each (indices i = 2 * half + 4 * block,
// as accumulator_coords says). The caller syncs the warp group before reading the slab.
template <class Accum, class Coords>
CUTE_DEVICE void fragments_to_slab(Accum const& acc, Coords const& tCcD, __nv_bfloat16* slab, int wg_row0, int pass,
                                   float alpha) {
  using namespace cute;
  using S = MaskedRowsStorage;
  CUTE_UNROLL
  for (int j = pass * 8; j < pass * 8 + 8; ++j) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * h + 4 * j;
      const auto c = tCcD(i);
      *reinterpret_cast<__nv_bfloat162*>(&slab[(get<0>(c) - wg_row0) * S::kPitch + get<1>(c) - pass * S::kCols]) =
          __float22bfloat162_rn(make_float2(alpha * acc(i), alpha * acc(i + 1)));
    }
  }
}

// Consumer perspective (one warp group, 128 threads, named barrier `barrier_id`): stores the
// warp group's rows [wg_row0, wg_row0 + 64) of the tile. Waits on nothing else.
// `row_at` maps a row to its storage (RowsInOrder: D's row; RowsScattered: a table's address).
template <class TileShape, class Accum, class TiledMma, class RowAt = RowsInOrder>
CUTE_DEVICE void store_masked_rows(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                                   MaskedRowsStorage& storage, uint32_t barrier_id, cutlass::bfloat16_t* d,
                                   int64_t ldd, int row0, int rows, int col0, int cols, float alpha, float beta,
                                   RowAt row_at = {}) {
  using namespace cute;
  using S = MaskedRowsStorage;
  constexpr int kN = size<1>(TileShape{});
  static_assert(S::kCols == 64, "masked-rows epilogue: 64-column passes");
  const auto tCcD = accumulator_coords<TileShape>(acc, tiled_mma, mma_thread_idx);
  __nv_bfloat16* slab = storage.slab[(wg_row0 / S::kRows) & 1];
  const int t = mma_thread_idx % 128;
  const int wg_rows = min(rows - wg_row0, S::kRows);  // rows of this slab to store (> 0)
  CUTE_UNROLL
  for (int pass = 0; pass < kN / S::kCols; ++pass) {
    if (pass * S::kCols >= cols) break;
    fragments_to_slab(acc, tCcD, slab, wg_row0, pass, alpha);
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
    // Shared -> global: 8 threads per 128-byte row segment, 16 rows per sweep.
    const int seg = t % 8;
    const int gcol = col0 + pass * S::kCols + seg * 8;
    CUTE_UNROLL
    for (int sweep = 0; sweep < S::kRows / 16; ++sweep) {
      const int r = sweep * 16 + t / 8;
      if (r < wg_rows && pass * S::kCols + seg * 8 < cols) {
        uint4 v = *reinterpret_cast<const uint4*>(&slab[r * S::kPitch + seg * 8]);
        uint4* dst = reinterpret_cast<uint4*>(row_at(d, ldd, row0 + wg_row0 + r) + gcol);
        if (beta != 0.f) {
          const uint4 old = *dst;
          const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&old);
          __nv_bfloat162* n = reinterpret_cast<__nv_bfloat162*>(&v);
          CUTE_UNROLL
          for (int q = 0; q < 4; ++q) {
            const float2 a = __bfloat1622float2(n[q]);
            const float2 b = __bfloat1622float2(o[q]);
            n[q] = __float22bfloat162_rn(make_float2(a.x + beta * b.x, a.y + beta * b.y));
          }
        }
        *dst = v;
      }
    }
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);  // the slab is rewritten next pass
  }
}

}  // namespace moefuse::epilogue
