// A tile's 128 rows gathered from anywhere in a row-major bf16 matrix into one 128-byte-
// swizzled shared-memory stage (K-major, 8-row atoms stacked along M: row r at 128 r bytes,
// its 16-byte chunk c at chunk c ^ (r % 8)), one k-block at a time, by 128 threads with
// 16-byte cp.async: thread t of warp w copies, for each of 8 rows i * 4 + t / 8 of its warp's
// 32, the chunk t % 8 (eight lanes per 128-byte row segment: coalesced). Rows with no source
// and chunks past K are zero-filled, never read. Used by kernel/sm100_contiguous_grouped.cuh.
#pragma once

#include "cute/arch/copy_sm80.hpp"
#include "cute/tensor.hpp"

namespace moefuse::kernel {

struct GatheredRows {
  using Chunk = cute::uint128_t;
  // Per tile, not per k-block: the 8 rows this thread copies as 32-bit chunk offsets at its
  // lane's 16-byte column (the launchers refuse a matrix of 2^32 chunks), and which are live.
  uint32_t live = 0;
  uint32_t ref[8];

  // `src`: the source row of this thread's tile row (thread t of 128 holds row t), or -1.
  CUTE_DEVICE GatheredRows(int src, uint32_t row_chunks) {
    const int lane = int(threadIdx.x % 32);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int from = __shfl_sync(0xffffffffu, src, i * 4 + lane / 8);
      live |= uint32_t(from >= 0) << i;
      ref[i] = uint32_t(from < 0 ? 0 : from) * row_chunks + uint32_t(lane % 8);
    }
  }

  // K-block `kb` (64 columns of a `k`-column matrix) of the tile's rows from `a` into `stage`.
  CUTE_DEVICE void copy(const Chunk* a, Chunk* stage, int kb, int k, int t) const {
    constexpr int kChunks = 8;  // 16-byte chunks per row and k-block
    const int lane = t % 32, warp = t / 32, c = lane % 8;
    const bool valid = (kb * kChunks + c) * 8 < k;  // k % 8 == 0: a chunk is all in or out
    const uint32_t live_now = valid ? live : 0u;
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int r = warp * 32 + i * 4 + lane / 8;
      const bool on = (live_now >> i) & 1u;
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(a[on ? ref[i] + uint32_t(kb * kChunks) : 0u],
                                                         stage[r * kChunks + (c ^ (r & 7))], on);
    }
  }
};

}  // namespace moefuse::kernel
