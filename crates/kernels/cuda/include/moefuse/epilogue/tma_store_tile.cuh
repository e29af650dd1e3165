// Epilogue for tiles that lie inside one matrix (the K-grouped wgrad's dW_e, whose rows are
// features, never another group's rows; an M-grouped tile whose 128 rows are all its
// group's): D = alpha * acc, written by TMA stores that clip at the tensor's edges, so the
// consumer warps go on to their next tile's MMAs while the stores drain (store_masked_rows
// issues 16-byte stores after a shared-memory read-back, every pass).
//
//   step (per pass of 64 or 32 columns, one warp group)        who
//   ---------------------------------------------------------+---------------------------
//   wait until the store that last read this slab has read it | thread 0 (the issuer)
//   fragments -> slab (bf16, 128-byte swizzle), proxy fence   | all 128
//   one TMA store of the slab, commit                         | thread 0
//
// NOTES: two slabs per warp group alternate by a running pass count, so the wait is for the
// store before last, which has long finished reading: the pass never waits on memory. The
// issuing thread must drain its stores (store_tail) before the kernel exits.
// NOTES: beta != 0 needs D's old values; that case keeps store_masked_rows.
#pragma once

#include <cuda_bf16.h>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"

namespace moefuse::epilogue {

// One warp group's two 64 x kCols bf16 slabs (rows of kCols * 2 bytes, swizzled as the map's
// CU_TENSOR_MAP_SWIZZLE_128B (kCols 64) or _64B (kCols 32) expects; 1024-byte aligned).
template <int kCols_>
struct TmaSlabs {
  static_assert(kCols_ == 64 || kCols_ == 32, "TMA-store epilogue: passes of 64 (128-byte swizzle) or 32 columns (64-byte)");
  static constexpr int kRows = 64;
  static constexpr int kCols = kCols_;
  static constexpr int kRowBytes = kCols * 2;
  static constexpr int kSlabBytes = kRows * kRowBytes;
  alignas(1024) char slab[2][kSlabBytes];
  // Byte offset of (row r, 16-byte chunk j) in a slab: the swizzle XORs the chunk with
  // address bits 7.. (128-byte rows: r % 8; 64-byte rows: (r / 2) % 4).
  CUTE_DEVICE static int offset(int r, int j) {
    return r * kRowBytes + (kCols == 64 ? (j ^ (r % 8)) : (j ^ ((r >> 1) % 4))) * 16;
  }
};

// Shared memory of two consumer warp groups (32 KiB with 64-column passes).
template <int kCols>
struct TmaStoreStorage {
  TmaSlabs<kCols> wg[2];
};

// Where a pass's box goes: (column, row) of a 2-D map over D, or of matrix `matrix` of a
// 3-D map (cols, rows, matrices).
struct TmaRows2D {
  CUTE_DEVICE void operator()(CUtensorMap const* map, void const* slab, int col, int row) const {
    cute::SM90_TMA_STORE_2D::copy(map, slab, col, row);
  }
};
struct TmaRows3D {
  int matrix;
  CUTE_DEVICE void operator()(CUtensorMap const* map, void const* slab, int col, int row) const {
    cute::SM90_TMA_STORE_3D::copy(map, slab, col, row, matrix);
  }
};

// Consumer perspective (one warp group, 128 threads, named barrier `barrier_id`, its own
// `slabs`): stores the
// warp group's rows [wg_row0, wg_row0 + 64) of the tile at (row0, col0) through `map` (bf16,
// box kCols x 64 (x 1), the storage's swizzle), placed by `at`. The tile's first `rows` rows
// and `cols` columns are inside the tensor (the map clips the rest, so only whole tiles of a
// matrix may use it). `passes` counts this warp group's passes over the kernel's life (slab
// parity).
template <class TileShape, class Slabs, class Accum, class TiledMma, class At>
CUTE_DEVICE void store_tile_tma(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                                Slabs& slabs, uint32_t barrier_id, CUtensorMap const* map, At at, int row0,
                                int rows, int col0, int cols, float alpha, uint32_t& passes) {
  using namespace cute;
  constexpr int kM = size<0>(TileShape{});
  constexpr int kN = size<1>(TileShape{});
  constexpr int kCols = Slabs::kCols;
  static_assert(kN % kCols == 0, "TMA-store epilogue: tile N must be a multiple of the pass width");
  Tensor cD = make_identity_tensor(make_shape(Int<kM>{}, Int<kN>{}));  // (BLK_M,BLK_N) -> (m,n)
  Tensor tCcD = tiled_mma.get_thread_slice(mma_thread_idx).partition_C(cD);  // (MMA,MMA_M,MMA_N)
  static_assert(decltype(size(acc))::value == decltype(size(tCcD))::value, "accumulator and D partitions differ");
  CUTE_STATIC_ASSERT_V((size<0, 0>(tCcD) == Int<2>{}) && (size<0, 1>(tCcD) == Int<2>{}));
  CUTE_STATIC_ASSERT_V((size<0, 2>(tCcD) == Int<kN / 8>{}) && (size<1>(tCcD) == Int<1>{}) &&
                       (size<2>(tCcD) == Int<1>{}));
  if (rows <= wg_row0) return;  // the tensor ends above this warp group's rows
  const bool issuer = mma_thread_idx % 128 == 0;
  CUTE_UNROLL
  for (int pass = 0; pass < kN / kCols; ++pass) {
    if (pass * kCols >= cols) break;
    char* slab = slabs.slab[passes & 1];
    if (issuer) tma_store_wait<1>();  // the store before last read this slab
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
    // Fragments -> shared: column blocks of 8 (one 16-byte chunk of a row each), two row
    // halves; the swizzle puts the 8 rows of one store instruction in 8 different bank
    // groups (conflict-free).
    CUTE_UNROLL
    for (int j = pass * (kCols / 8); j < (pass + 1) * (kCols / 8); ++j) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * h + 4 * j;
        const auto c = tCcD(i);
        const int r = get<0>(c) - wg_row0;
        const int col = get<1>(c) - pass * kCols;
        *reinterpret_cast<__nv_bfloat162*>(slab + Slabs::offset(r, col / 8) + (col % 8) * 2) =
            __float22bfloat162_rn(make_float2(alpha * acc(i), alpha * acc(i + 1)));
      }
    }
    tma_store_fence();  // the generic-proxy writes, visible to the TMA unit
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
    if (issuer) {
      at(map, slab, col0 + pass * kCols, row0 + wg_row0);
      tma_store_arrive();
    }
    ++passes;
  }
}

// The issuing thread's last word: every store has read its slab (the kernel may exit).
CUTE_DEVICE void store_tile_tma_tail(int mma_thread_idx) {
  if (mma_thread_idx % 128 == 0) cute::tma_store_wait<0>();
}

}  // namespace moefuse::epilogue
