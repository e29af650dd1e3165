// Epilogue for tiles that lie inside one matrix of a batch (the K-grouped wgrad's dW_e, whose
// rows are features, never another group's rows): D = alpha * acc, written by TMA stores
// that clip at the matrix's own edges, so the consumer warps go on to their next tile's MMAs
// while the stores drain (store_masked_rows issues 16-byte stores after a shared-memory
// read-back, every pass). Measured on the H200: the Qwen3 wgrads 5.2 % and 2.9 % faster. The
// M-grouped GEMMs' whole tiles (32-column passes inside the masked slab) were not faster, so
// they keep the masked store (docs/perf-notes.md, session 13).
//
//   step (per 64-column pass, one consumer warp group)        who
//   ---------------------------------------------------------+---------------------------
//   wait until the store that last read this slab has read it | thread 0 (the issuer)
//   fragments -> slab (bf16, 128-byte swizzle), proxy fence   | all 128
//   one 64 x 64 TMA store of the slab, commit                 | thread 0
//
// NOTES: two slabs per warp group alternate by a running pass count, so the wait is for the
// store before last, which has long finished reading: the pass never waits on memory. The
// issuing thread must drain its stores (store_tile_tma_tail) before the kernel exits.
// NOTES: beta != 0 needs D's old values; that case keeps store_masked_rows.
#pragma once

#include <cuda_bf16.h>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "moefuse/epilogue/masked_rows.cuh"

namespace moefuse::epilogue {

// One warp group's two 64 x 64 bf16 slabs (128-byte rows, swizzled as the map's
// CU_TENSOR_MAP_SWIZZLE_128B expects: 1024-byte aligned).
struct TmaSlabs {
  static constexpr int kRows = 64;
  static constexpr int kCols = 64;
  static constexpr int kRowBytes = kCols * 2;
  alignas(1024) char slab[2][kRows * kRowBytes];
  // Byte offset of (row r, 16-byte chunk j) in a slab: the swizzle XORs the chunk with r % 8.
  CUTE_DEVICE static int offset(int r, int j) { return r * kRowBytes + (j ^ (r % 8)) * 16; }
};

// Shared memory of two consumer warp groups (32 KiB).
struct TmaStoreStorage {
  TmaSlabs wg[2];
};

// Consumer perspective (one warp group, 128 threads, named barrier `barrier_id`, its own
// `slabs`): stores the warp group's rows [wg_row0, wg_row0 + 64) of the tile at (row0, col0)
// of matrix `matrix` through `map` (a 3-D bf16 map (cols, rows, matrices), box 64 x 64 x 1,
// 128-byte swizzle). The tile's first `rows` rows and `cols` columns are inside the matrix
// (the map clips the rest). `passes` counts this warp group's passes over the kernel's life
// (slab parity).
template <class TileShape, class Accum, class TiledMma>
CUTE_DEVICE void store_tile_tma(Accum const& acc, TiledMma const& tiled_mma, int mma_thread_idx, int wg_row0,
                                TmaSlabs& slabs, uint32_t barrier_id, CUtensorMap const* map, int matrix, int row0,
                                int rows, int col0, int cols, float alpha, uint32_t& passes) {
  using namespace cute;
  constexpr int kN = size<1>(TileShape{});
  constexpr int kCols = TmaSlabs::kCols;
  const auto tCcD = accumulator_coords<TileShape>(acc, tiled_mma, mma_thread_idx);
  if (rows <= wg_row0) return;  // the matrix ends above this warp group's rows
  const bool issuer = mma_thread_idx % 128 == 0;
  CUTE_UNROLL
  for (int pass = 0; pass < kN / kCols; ++pass) {
    if (pass * kCols >= cols) break;
    char* slab = slabs.slab[passes & 1];
    if (issuer) tma_store_wait<1>();  // the store before last read this slab
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
    // Fragments -> shared: 8 column blocks of 8 (one 16-byte chunk of a row each), two row
    // halves; the swizzle puts the 8 rows of one store instruction in 8 different chunks
    // (conflict-free).
    CUTE_UNROLL
    for (int j = pass * (kCols / 8); j < (pass + 1) * (kCols / 8); ++j) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * h + 4 * j;
        const auto c = tCcD(i);
        const int r = get<0>(c) - wg_row0;
        const int col = get<1>(c) - pass * kCols;
        *reinterpret_cast<__nv_bfloat162*>(slab + TmaSlabs::offset(r, col / 8) + (col % 8) * 2) =
            __float22bfloat162_rn(make_float2(alpha * acc(i), alpha * acc(i + 1)));
      }
    }
    tma_store_fence();  // the generic-proxy writes, visible to the TMA unit
    cutlass::arch::NamedBarrier::arrive_and_wait(128, barrier_id);
    if (issuer) {
      SM90_TMA_STORE_3D::copy(map, slab, col0 + pass * kCols, row0 + wg_row0, matrix);
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
