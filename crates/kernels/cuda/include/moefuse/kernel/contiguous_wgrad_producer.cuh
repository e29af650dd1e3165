// The producer of the contiguous K-grouped wgrad (D_e = alpha * A[rows_e, :]^T · B[rows_e, :]),
// shared by the Hopper kernel (kernel/sm90_contiguous_wgrad.cuh: WGMMA consumers) and its
// Blackwell twin (kernel/sm100_contiguous_wgrad.cuh: one UMMA warp, tensor-memory
// accumulators). Both stage one 64-row chunk of the group's rows per pipeline stage as
// 64-wide MN strips of 64 x 128-byte rows (one row per reduction index, 128-byte swizzle),
// A's kTileM / 64 strips and B's kTileN / 64; every stage's full barrier takes 129 arrivals
// (thread 0's in producer_acquire, then one per producer thread).
//
//   chunk                 copied by
//   whole, rows in order  thread 0: A as 64 x 64 TMA boxes, B likewise (with kClusterM = 2
//                         this CTA's half of B's strips into both CTAs of the pair, by
//                         multicast)
//   a group's last,       all 128 threads, 16-byte cp.async swizzled by hand, rows past the
//   partial one           group's end zero-filled (a 64 x 1 TMA box costs ~65 cycles on the
//                         H200: the fused gate_up's first producer)
//   gathered rows         all 128 threads: the gathered operand's rows (index[r] / div) by
//   (a_rows or b_rows)    cp.async, eight lanes per 128-byte row segment; the other operand
//                         by TMA as above. A gathered B is not multicast (cp.async writes only
//                         this CTA's shared memory).
//
// The gathered chunks' row indices travel kAhead chunks ahead of their copies, across tiles,
// through a shared-memory ring filled by 4-byte cp.async: an index loaded just before its
// chunk's copies put an L2 round trip (~1.4 us under the wgrad's load, measured on the H200)
// on every chunk.
//
// Tiles walk (group, m-block unit, n-block) with the n-blocks of one (group, m-block) on
// consecutive CTAs (they share A's rows in L2); with kClusterM = 2 the CTAs of a pair take
// m-blocks 2u and 2u + 1 of one unit.
// NOTES: the producers run on 56 registers on Hopper (setmaxnreg), hence the `unroll 1` and
// the hoisted per-row state below; the Blackwell twin gives them the same code.
#pragma once

#include <cuda.h>

#include "cute/arch/copy_sm80.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/fast_math.h"
#include "moefuse/common/group_layout.cuh"

namespace moefuse::kernel {

// The gathered producer's ring of chunk row indices (kRing chunks of 64 rows).
struct ContiguousWgradRowRing {
  static constexpr int kRing = 8;
  alignas(16) int32_t rows[kRing][64];
};

// What the producer reads; the kernels' Params derive from it.
struct ContiguousWgradOperands {
  CUtensorMap a_chunk;  // A [total_rows, m]: box 64 x 64 (m, rows), 128-byte swizzle
  CUtensorMap b_chunk;  // B [total_rows, n]: box 64 x 64
  const int32_t* offsets;
  const cutlass::bfloat16_t* a;  // [total_rows, m]
  const cutlass::bfloat16_t* b;  // [total_rows, n]
  const int32_t* rows;           // gathered rows: [total_rows] indices, or nullptr (nothing gathered)
  cutlass::FastDivmod rows_div;  // the gathered operand's row is rows[r] / rows_div
  int source_rows;               // rows of the gathered operand (an index at or past it reads zeros)
  int gather_a;                  // 1: A is gathered ([source_rows, m]); 0: B ([source_rows, n])
  int groups;
  int total_rows;
  int m;
  int n;
  int interleave;  // 1: the walk alternates the front and the back of the tile list
};

template <int kTileM, int kTileN, int kTileK, int kClusterM>
struct ContiguousWgradProducer {
  static_assert(kTileM % 64 == 0 && kTileK == 64 && kTileN % 64 == 0 && kTileN <= 256,
                "contiguous wgrad: 64-wide MN strips, 64-row chunks");
  static_assert(kClusterM == 1 || kClusterM == 2, "contiguous wgrad: clusters of 1 or 2 CTAs along M");
  using Operands = ContiguousWgradOperands;
  using Element = cutlass::bfloat16_t;
  static constexpr int kRing = ContiguousWgradRowRing::kRing;
  static constexpr int kAhead = 6;  // chunks whose row indices are in flight before their copies
  static_assert(kAhead < kRing, "a ring slot is rewritten only after every producer has read it");
  static constexpr uint32_t kRingBarrier = 3;  // the producers, once per gathered chunk
  static constexpr int kStripsA = kTileM / 64;
  static constexpr int kStripsB = kTileN / 64;
  static constexpr int kStrip = 64 * kTileK;  // elements of one 64-wide strip of a stage
  static constexpr int kThreads = 128;
  static_assert(kTileK * 2 == kThreads, "two producer threads per row of a partial chunk");
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr int kStageElementsB = kTileN * kTileK;

  struct Tile {
    int group, m_block, n_block;
    GroupRows rows;
    CUTE_DEVICE int chunks() const { return (rows.rows() + kTileK - 1) / kTileK; }
  };

  // Tile `index` of the walk over cluster tiles (group, m-block unit, n-block); this CTA
  // (cluster rank `rank`) takes m-block unit * kClusterM + rank, which may be past the last
  // m-block (a tile with no rows: m_block * kTileM >= m).
  CUTE_DEVICE static bool tile_at(Operands const& p, int index, int m_units, int n_blocks, int rank, Tile& t) {
    const int per_group = m_units * n_blocks;
    const int total = p.groups * per_group;
    if (index >= total) return false;
    if (p.interleave) index = (index & 1) ? total - 1 - (index >> 1) : (index >> 1);
    t.group = index / per_group;
    const int r = index - t.group * per_group;
    const int unit = r / n_blocks;
    t.m_block = unit * kClusterM + rank;
    t.n_block = r - unit * n_blocks;
    t.rows = group_rows(p.offsets, t.group, p.total_rows);
    return true;
  }

  // This CTA's tiles in walk order (every role walks its own copy).
  struct Tiles {
    int index, stride, m_units, n_blocks, rank;
    Operands const* p;
    CUTE_DEVICE bool next(Tile& t) {
      if (!tile_at(*p, index, m_units, n_blocks, rank, t)) return false;
      index += stride;
      return true;
    }
  };

  // A's strips of one whole chunk by TMA (thread 0).
  CUTE_DEVICE static void tma_load_a(Operands const& p, uint64_t* barrier, Element* a, int m0, int r0) {
    using namespace cute;
    constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
    CUTE_UNROLL
    for (int s = 0; s < kStripsA; ++s) {
      SM90_TMA_LOAD_2D::copy(&p.a_chunk, barrier, kHint, a + s * kStrip, m0 + 64 * s, r0);
    }
  }

  // B's strips of one whole chunk by TMA (thread 0): all of them, or with kClusterM = 2 this
  // CTA's half into the same stage of both CTAs (the pair walks the same (group, n-block)
  // tiles and chunks, so the stages correspond).
  CUTE_DEVICE static void tma_load_b(Operands const& p, uint64_t* barrier, Element* b, int n0, int r0, int rank) {
    using namespace cute;
    constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
    if constexpr (kClusterM == 1) {
      CUTE_UNROLL
      for (int s = 0; s < kStripsB; ++s) {
        SM90_TMA_LOAD_2D::copy(&p.b_chunk, barrier, kHint, b + s * kStrip, n0 + 64 * s, r0);
      }
    } else {
      constexpr int kMine = kStripsB / kClusterM;
      constexpr uint16_t kBoth = 0b11;
      CUTE_UNROLL
      for (int h = 0; h < kMine; ++h) {
        const int s = rank * kMine + h;
        SM90_TMA_LOAD_MULTICAST_2D::copy(&p.b_chunk, barrier, kBoth, kHint, b + s * kStrip, n0 + 64 * s, r0);
      }
    }
  }

  // A group's last, partial chunk into one stage, by cp.async: chunk row k by threads 2k and
  // 2k + 1, half of its strips each, reading A's row `row_a` and B's row `row_b` (-1: zeros;
  // so are columns past the matrix). Both producers use it (gathered rows or not).
  CUTE_DEVICE static void copy_partial_chunk(Operands const& p, Element* a, Element* b, int m0, int n0, int row_a,
                                             int row_b, int thread) {
    using Chunk = cute::uint128_t;
    constexpr int kStrips = kStripsA + kStripsB;
    static_assert(kStrips % 2 == 0, "two producer threads per row share its strips");
    const int k = thread / 2;
#pragma unroll 1  // the producers run on 56 registers
    for (int h = 0; h < kStrips / 2; ++h) {
      const int s = (thread % 2) * (kStrips / 2) + h;
      const bool is_a = s < kStripsA;
      const int col0 = is_a ? m0 + 64 * s : n0 + 64 * (s - kStripsA);
      const int width = is_a ? p.m : p.n;
      const int from = is_a ? row_a : row_b;
      const auto* src = reinterpret_cast<const Chunk*>((is_a ? p.a : p.b) + int64_t(from < 0 ? 0 : from) * width);
      auto* dst = reinterpret_cast<Chunk*>((is_a ? a + s * kStrip : b + (s - kStripsA) * kStrip) + k * 64);
      CUTE_UNROLL
      for (int q = 0; q < 8; ++q) {
        const bool valid = from >= 0 && col0 + 8 * q < width;  // width % 8 == 0
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(src[valid ? col0 / 8 + q : 0], dst[q ^ (k & 7)], valid);
      }
    }
  }

  // Thread t of 128: the chunks of one tile (rows in order) into the stages at smem_a /
  // smem_b.
  template <class Pipeline, class PipelineState>
  CUTE_DEVICE static void load_tile(Operands const& p, Pipeline& pipeline, PipelineState& write, Element* smem_a,
                                    Element* smem_b, Tile const& t, int thread, int rank) {
    constexpr uint32_t kBytes = (kStageElementsA + kStageElementsB) * sizeof(Element);
    static_assert(kStripsB % kClusterM == 0, "a pair splits B's strips evenly");
    const int m0 = t.m_block * kTileM, n0 = t.n_block * kTileN;
    const int chunks = t.chunks();
    for (int c = 0; c < chunks; ++c) {
      pipeline.producer_acquire(write);  // every producer waits; thread 0 arrives (no bytes yet)
      uint64_t* barrier = pipeline.producer_get_barrier(write);
      const int stage = int(write.index());
      auto* a = smem_a + stage * kStageElementsA;
      auto* b = smem_b + stage * kStageElementsB;
      const int r0 = t.rows.start + c * kTileK;
      if (r0 + kTileK <= t.rows.end) {
        if (thread == 0) {
          cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, kBytes);
          tma_load_a(p, barrier, a, m0, r0);
          tma_load_b(p, barrier, b, n0, r0, rank);
        }
        cutlass::arch::ClusterBarrier::arrive(barrier);
      } else {
        // The group's last chunk: rows past the group's end are zeros.
        const int row = r0 + thread / 2;
        const int from = row < t.rows.end ? row : -1;
        copy_partial_chunk(p, a, b, m0, n0, from, from, thread);
        cutlass::arch::cpasync_barrier_arrive_noinc(barrier);
      }
      ++write;
    }
  }

  // ---- Gathered rows: the producers walk a stream of (tile, chunk) pairs. ----

  // A position in the stream: tile `index` of the walk and its chunk; tiles without rows are
  // skipped (their consumers store zeros or nothing; no stage is loaded for them).
  struct ChunkCursor {
    int index;
    Tile tile;
    int chunk;
    int chunks;
    bool valid;
  };
  struct Walk {
    int stride, m_units, n_blocks, rank;
  };
  CUTE_DEVICE static void seek(Operands const& p, Walk const& w, ChunkCursor& c) {
    while ((c.valid = tile_at(p, c.index, w.m_units, w.n_blocks, w.rank, c.tile))) {
      c.chunk = 0;
      c.chunks = c.tile.chunks();
      if (c.chunks > 0) return;
      c.index += w.stride;
    }
  }
  CUTE_DEVICE static void step(Operands const& p, Walk const& w, ChunkCursor& c) {
    if (++c.chunk == c.chunks) {
      c.index += w.stride;
      seek(p, w, c);
    }
  }
  // The operand row of a ring entry: -1 for a bad index (the row reads zeros). A
  // multiply-shift division: the producers issue every instruction of the gather, and a
  // runtime `/` is ~20 of them (ncu, session 16: the producers were the bottleneck).
  CUTE_DEVICE static int resolve(Operands const& p, int index) {
    const int r = index < 0 ? -1 : p.rows_div.div(index);
    return r < p.source_rows ? r : -1;
  }

  // Rows of one whole chunk of `operand` ([., width]) at columns col0.. into kStrips 64-wide
  // strips of `stage`. Thread t copies column chunk t % 8 of chunk rows t / 8 + 16 j (j < 4)
  // in every strip: eight lanes read one row's 128 contiguous bytes per instruction. One
  // address per row, the strips at immediate offsets from it; a copy that reads nothing
  // (bad row, or a strip past the matrix) points at the row's first chunk. 32-bit chunk
  // offsets: the launcher refuses an operand of 2^32 16-byte chunks.
  template <int kStrips>
  CUTE_DEVICE static void gather_chunk(const Element* operand, int width, int col0, Element* stage,
                                       int const (&src)[4], int thread) {
    using Chunk = cute::uint128_t;
    const int q = thread % 8;
    const uint32_t row_chunks = uint32_t(width / 8);
    const uint32_t col = uint32_t(col0 / 8 + q);
    // Strips whose column chunk is inside the matrix (width % 8 == 0: all in or out).
    const int strips = col >= row_chunks ? 0 : min(kStrips, int((row_chunks - col + 7) / 8));
    auto* stage_chunks = reinterpret_cast<Chunk*>(stage);
    const auto* base = reinterpret_cast<const Chunk*>(operand);
    if (strips == kStrips) {
      // Every strip inside the matrix (the common case): a bad row reads nothing from row 0,
      // whose kStrips strips exist (width >= col0 + kStrips * 64), at the same offsets.
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const int k = thread / 8 + 16 * j;
        const bool live = src[j] >= 0;
        const Chunk* row = base + (live ? uint32_t(src[j]) * row_chunks : 0u) + col;
        Chunk* dst = stage_chunks + k * 8 + (q ^ (k & 7));
        CUTE_UNROLL
        for (int s = 0; s < kStrips; ++s) {
          cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(row[s * 8], dst[s * kStrip / 8], live);
        }
      }
      return;
    }
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int k = thread / 8 + 16 * j;
      const bool live = src[j] >= 0;
      const Chunk* row = base + (live ? uint32_t(src[j]) * row_chunks + col : 0u);
      Chunk* dst = stage_chunks + k * 8 + (q ^ (k & 7));
      CUTE_UNROLL
      for (int s = 0; s < kStrips; ++s) {
        const bool valid = live && s < strips;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(row[valid ? s * 8 : 0], dst[s * kStrip / 8], valid);
      }
    }
  }

  // Thread t of 128, gathered rows: every chunk of this CTA's tiles (walk `w` from tile
  // `first`) into the stages at smem_a / smem_b.
  template <class Pipeline, class PipelineState>
  CUTE_DEVICE static void load_gathered(Operands const& p, Pipeline& pipeline, PipelineState& write,
                                        Element* smem_a, Element* smem_b, ContiguousWgradRowRing& ring_rows,
                                        Walk const& w, int first, int thread) {
    using namespace cute;
    constexpr uint32_t kBytesA = kStageElementsA * sizeof(Element);
    constexpr uint32_t kBytesB = kStageElementsB * sizeof(Element);
    const bool gather_a = p.gather_a != 0;
    // Threads 0-63 copy one row index each of the chunk `c` into ring slot `slot` (rows past
    // the group read 0; the copies below never use them).
    auto issue_indices = [&](ChunkCursor const& c, int slot) {
      if (thread < kTileK) {
        const int row = c.tile.rows.start + c.chunk * kTileK + thread;
        const bool live = row < c.tile.rows.end;
        SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(reinterpret_cast<const uint32_t*>(p.rows)[live ? row : 0],
                                                        reinterpret_cast<uint32_t&>(ring_rows.rows[slot][thread]),
                                                        live);
      }
    };
    ChunkCursor cur{first}, ahead{first};
    seek(p, w, cur);
    seek(p, w, ahead);
    int seq = 0, seq_ahead = 0;
    CUTE_UNROLL
    for (int a = 0; a < kAhead; ++a) {
      if (ahead.valid) {
        issue_indices(ahead, seq_ahead++ % kRing);
        step(p, w, ahead);
      }
      cp_async_fence();
    }
    while (cur.valid) {
      // Chunk seq's indices: one commit group per chunk, kAhead - 1 younger ones may pend;
      // then every producer's copies are visible to all of them.
      cp_async_wait<kAhead - 1>();
      cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, kRingBarrier);
      const int32_t* ring = ring_rows.rows[seq % kRing];
      const Tile& t = cur.tile;
      const int m0 = t.m_block * kTileM, n0 = t.n_block * kTileN;
      const int r0 = t.rows.start + cur.chunk * kTileK;
      const bool whole = r0 + kTileK <= t.rows.end;
      // A pair's CTA past the last m-block (its consumers only drain) copies no A rows, and
      // with a gathered B (no peer waits on its copies) nothing at all.
      const bool no_rows = m0 >= p.m;
      const bool idle = no_rows && !gather_a;
      int src[4];
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) src[j] = resolve(p, ring[thread / 8 + 16 * j]);
      pipeline.producer_acquire(write);  // every producer waits; thread 0 arrives (no bytes yet)
      uint64_t* barrier = pipeline.producer_get_barrier(write);
      const int stage = int(write.index());
      auto* a = smem_a + stage * kStageElementsA;
      auto* b = smem_b + stage * kStageElementsB;
      if (idle) {
        cutlass::arch::ClusterBarrier::arrive(barrier);
      } else if (whole) {
        if (thread == 0) {
          cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, gather_a ? kBytesB : kBytesA);
          if (gather_a) {
            tma_load_b(p, barrier, b, n0, r0, w.rank);
          } else {
            tma_load_a(p, barrier, a, m0, r0);
          }
        }
        if (!gather_a) {
          gather_chunk<kStripsB>(p.b, p.n, n0, b, src, thread);
        } else if (!no_rows) {
          gather_chunk<kStripsA>(p.a, p.m, m0, a, src, thread);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(barrier);
      } else {
        // The group's last chunk: rows past the group's end and bad indices are zeros.
        const int k = thread / 2;
        const int row = r0 + k;
        const bool live = row < t.rows.end;
        const int gathered = live ? resolve(p, ring[k]) : -1;
        const int row_a = no_rows || !live ? -1 : (gather_a ? gathered : row);
        const int row_b = !live ? -1 : (gather_a ? row : gathered);
        copy_partial_chunk(p, a, b, m0, n0, row_a, row_b, thread);
        cutlass::arch::cpasync_barrier_arrive_noinc(barrier);
      }
      ++write;
      if (ahead.valid) {
        issue_indices(ahead, seq_ahead++ % kRing);
        step(p, w, ahead);
      }
      cp_async_fence();
      ++seq;
      step(p, w, cur);
    }
  }

  // Every chunk of this CTA's tiles (tile `first`, then every `stride`-th), rows in order or
  // gathered, into the stages.
  template <class Pipeline, class PipelineState>
  CUTE_DEVICE static void run(Operands const& p, Pipeline& pipeline, PipelineState& write, Element* smem_a,
                              Element* smem_b, ContiguousWgradRowRing& ring, Walk const& w, int first, int thread) {
    if (p.rows != nullptr) {
      load_gathered(p, pipeline, write, smem_a, smem_b, ring, w, first, thread);
      return;
    }
    Tile tile;
    for (int i = first; tile_at(p, i, w.m_units, w.n_blocks, w.rank, tile); i += w.stride) {
      load_tile(p, pipeline, write, smem_a, smem_b, tile, thread, w.rank);
    }
  }
};

}  // namespace moefuse::kernel
