// Hopper (sm_90a) persistent K-grouped bf16 GEMM over the contiguous grouped layout (the
// weight gradient of an M-grouped layer):
//   D_e = alpha * A[rows_e, :]^T · B[rows_e, :] + beta * D_e      (D_e = d + e*m*n, [m, n])
// with A [total_rows, m] and B [total_rows, n] row-major: both operands are MN-major for the
// tensor cores and the reduction runs over the group's rows.
//
//   warp            role                                              registers
//   0-3 (WG 0)      producers: per 64-row chunk of the group, thread  56
//                   0 loads A as two 64 x 64 TMA boxes and B as four;
//                   a group's last, partial chunk is copied by all
//                   128 threads with 16-byte cp.async (swizzled by
//                   hand), rows past the group's end zero-filled
//   4-11 (2 WGs)    MMA consumers (WGMMA 64x256 each) + store         224
//
// With kClusterM = 2 the CTAs of a pair take the same (group, n-block) at m-blocks 2u and
// 2u + 1 and share B's four 64-wide strips of each whole chunk: CTA r loads strips 2r and
// 2r + 1 into both CTAs by TMA multicast (half of B's L2 reads). A group's last, partial
// chunk is still copied by each CTA for itself (cp.async). When the m-block count is odd, the
// last pair's second CTA has no rows: it loads its strips for the peer and drains.
//
// Gathered rows (a_rows or b_rows set, one operand per launch: the layer's down wgrad reading
// dy's token rows, its gate_up wgrad x's, through source_of instead of permuted copies): row
// r of a chunk is row index[r] / div of the operand, copied by the 128 producers with
// 16-byte cp.async, eight lanes per 128-byte row segment; the other operand still by TMA. A
// gathered B is not multicast (cp.async writes only its own CTA's shared memory): each CTA
// of a pair copies all of B's strips, and a pair's CTA with no rows copies nothing. The
// chunks' row indices travel kAhead chunks ahead of their copies, across tiles, through a
// shared-memory ring filled by 4-byte cp.async: an index loaded just before its chunk's
// copies put an L2 round trip (~1.4 us under the wgrad's load, measured) on every chunk.
//
// Composition: CUTLASS's sm90 TMA/GMMA collective for the MMA side (its shared-memory
// layouts, pipeline and mma/mma_tail); the producer is ours because a TMA box cannot stop at
// a group's end (the next group's rows would enter the reduction); tiles walk (group,
// m-block, n-block) with the n-blocks of one (group, m-block) on consecutive CTAs (they share
// A's rows in L2); store = epilogue::store_masked_rows.
// NOTES: every stage's full barrier takes 129 arrivals: thread 0's in producer_acquire and
// one per producer thread (a plain arrive after a TMA chunk, whose bytes thread 0 expects;
// a cp.async arrival after a partial one). 64 x 1 TMA boxes for the partial chunk cost ~65
// cycles each on the H200 (the fused gate_up's first producer), hence cp.async there.
// NOTES: the gathered producer's hoisted state needs 56 registers (40 spilled); the
// consumers fit 224 without spills (measured unchanged on the down wgrad).
// NOTES: CUTLASS's ptr-array grouped wgrad ran at 0.68x dense on the Qwen3 shapes (its
// per-group tensor-map rewrites sit on the critical path of ~8-chunk reductions); here the
// maps are built once on the host and never change.
#pragma once

#include <cuda.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/fast_math.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "moefuse/common/pipeline_drain.cuh"
#include "moefuse/common/group_layout.cuh"
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/epilogue/tma_store_tile.cuh"

namespace moefuse::kernel {

// The epilogue's shared memory, one kind per launch: TMA stores (beta == 0), or the
// masked-rows store, which reads D back for beta != 0 (the mainloop's stage count is sized around it).
union ContiguousWgradEpilogue {
  epilogue::MaskedRowsStorage masked;
  epilogue::TmaStoreStorage tma;
};

// The gathered producer's ring of chunk row indices (kRing chunks of 64 rows), beside the epilogue.
struct ContiguousWgradRowRing {
  static constexpr int kRing = 8;
  alignas(16) int32_t rows[kRing][64];
};

template <class Mainloop_, int kClusterM_ = 1>
struct Sm90ContiguousWgrad {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  using MainloopPipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static_assert(kTileM == 128 && kTileK == 64 && kTileN % 64 == 0 && kTileN <= 256,
                "sm90 contiguous wgrad: 128 x N x 64 tiles (64-wide MN strips, 64-row chunks)");
  // The collective is built for one CTA (its layouts and mma() are used); the cluster is
  // this kernel's: its pipeline and the producer's multicast.
  static_assert(cute::size(typename Mainloop::DispatchPolicy::ClusterShape{}) == 1, "sm90 contiguous wgrad: a 1x1 collective");
  static constexpr int kClusterM = kClusterM_;
  static_assert(kClusterM == 1 || kClusterM == 2, "sm90 contiguous wgrad: clusters of 1 or 2 CTAs along M");
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;

  static constexpr int kThreads = 384;
  static constexpr int kMmaThreads = 256;
  static constexpr uint32_t kLoadRegisters = 56;
  static constexpr uint32_t kMmaRegisters = 224;
  static constexpr uint32_t kEpilogueBarrier = 1;  // and 2: one per consumer warp group
  static constexpr uint32_t kRingBarrier = 3;      // the producers, once per gathered chunk
  static constexpr int kRing = ContiguousWgradRowRing::kRing;
  static constexpr int kAhead = 6;  // chunks whose row indices are in flight before their copies
  static_assert(kAhead < kRing, "a ring slot is rewritten only after every producer has read it");
  static constexpr int kStripsA = kTileM / 64;
  static constexpr int kStripsB = kTileN / 64;
  static constexpr int kStrip = 64 * kTileK;
  static constexpr int kProducerThreads = 128;
  static_assert(kTileK * 2 == kProducerThreads, "two producer threads per row of a partial chunk");  // elements of one 64-wide strip of a stage
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr int kStageElementsB = kTileN * kTileK;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    ContiguousWgradEpilogue epilogue;
    ContiguousWgradRowRing ring;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  struct Params {
    CUtensorMap a_chunk;  // A [total_rows, m]: box 64 x 64 (m, rows), 128-byte swizzle
    CUtensorMap b_chunk;  // B [total_rows, n]: box 64 x 64
    CUtensorMap d_tile;   // D [groups, m, n]: box 64 x 64 x 1 (the beta == 0 epilogue's stores)
    typename Mainloop::Params mainloop;  // only for mma()'s signature (it reads none of it)
    const int32_t* offsets;
    const cutlass::bfloat16_t* a;  // [total_rows, m]
    const cutlass::bfloat16_t* b;  // [total_rows, n]
    cutlass::bfloat16_t* d;
    const int32_t* rows;  // gathered rows: [total_rows] indices, or nullptr (nothing gathered)
    cutlass::FastDivmod rows_div;  // the gathered operand's row is rows[r] / rows_div
    int source_rows;      // rows of the gathered operand (an index at or past it reads zeros)
    int gather_a;         // 1: A is gathered ([source_rows, m]); 0: B ([source_rows, n])
    int groups;
    int total_rows;
    int m;
    int n;
    float alpha;
    float beta;
    int interleave;  // 1: the walk alternates the front and the back of the tile list
    int tma_store;   // 1: tiles leave by TMA through d_tile (beta == 0; set by the launcher)
  };

  struct Tile {
    int group, m_block, n_block;
    GroupRows rows;
  };

  enum class Role { Producer, Consumer };

  // Tile `index` of the walk over cluster tiles (group, m-block unit, n-block); this CTA
  // (cluster rank `rank`) takes m-block unit * kClusterM + rank, which may be past the last
  // m-block (a tile with no rows: m_block * kTileM >= m).
  CUTE_DEVICE static bool tile_at(Params const& p, int index, int m_units, int n_blocks, int rank, Tile& t) {
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

  // A's strips of one whole chunk by TMA (thread 0).
  CUTE_DEVICE static void tma_load_a(Params const& p, uint64_t* barrier, cutlass::bfloat16_t* a, int m0, int r0) {
    using namespace cute;
    constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
    CUTE_UNROLL
    for (int s = 0; s < kStripsA; ++s) {
      SM90_TMA_LOAD_2D::copy(&p.a_chunk, barrier, kHint, a + s * kStrip, m0 + 64 * s, r0);
    }
  }

  // B's strips of one whole chunk by TMA (thread 0): all four, or with kClusterM = 2 this
  // CTA's half into the same stage of both CTAs (the pair walks the same (group, n-block)
  // tiles and chunks, so the stages correspond).
  CUTE_DEVICE static void tma_load_b(Params const& p, uint64_t* barrier, cutlass::bfloat16_t* b, int n0, int r0,
                                     int rank) {
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
  CUTE_DEVICE static void copy_partial_chunk(Params const& p, cutlass::bfloat16_t* a, cutlass::bfloat16_t* b, int m0,
                                             int n0, int row_a, int row_b, int thread) {
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

  // Producer perspective (warp group 0, thread t of 128): the chunks of one tile.
  CUTE_DEVICE static void load_tile(Params const& p, MainloopPipeline& pipeline, PipelineState& write,
                                    SharedStorage& shared, Tile const& t, int thread, int rank) {
    using namespace cute;
    constexpr uint32_t kBytes = (kStageElementsA + kStageElementsB) * sizeof(cutlass::bfloat16_t);
    static_assert(kStripsB % kClusterM == 0, "a pair splits B's strips evenly");
    const int m0 = t.m_block * kTileM, n0 = t.n_block * kTileN;
    const int chunks = (t.rows.rows() + kTileK - 1) / kTileK;
    auto* smem_a = shared.tensors.smem_A.data();
    auto* smem_b = shared.tensors.smem_B.data();
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
  CUTE_DEVICE static void seek(Params const& p, Walk const& w, ChunkCursor& c) {
    while ((c.valid = tile_at(p, c.index, w.m_units, w.n_blocks, w.rank, c.tile))) {
      c.chunk = 0;
      c.chunks = (c.tile.rows.rows() + kTileK - 1) / kTileK;
      if (c.chunks > 0) return;
      c.index += w.stride;
    }
  }
  CUTE_DEVICE static void step(Params const& p, Walk const& w, ChunkCursor& c) {
    if (++c.chunk == c.chunks) {
      c.index += w.stride;
      seek(p, w, c);
    }
  }
  // The operand row of a ring entry: -1 for a bad index (the row reads zeros). A
  // multiply-shift division: the producers issue every instruction of the gather, and a
  // runtime `/` is ~20 of them (ncu, session 16: the producers were the bottleneck).
  CUTE_DEVICE static int resolve(Params const& p, int index) {
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
  CUTE_DEVICE static void gather_chunk(const cutlass::bfloat16_t* operand, int width, int col0,
                                       cutlass::bfloat16_t* stage, int const (&src)[4], int thread) {
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

  // Producer perspective, gathered rows (thread t of 128): every chunk of this CTA's tiles.
  CUTE_DEVICE static void load_gathered(Params const& p, MainloopPipeline& pipeline, PipelineState& write,
                                        SharedStorage& shared, Walk const& w, int first, int thread) {
    using namespace cute;
    constexpr uint32_t kBytesA = kStageElementsA * sizeof(cutlass::bfloat16_t);
    constexpr uint32_t kBytesB = kStageElementsB * sizeof(cutlass::bfloat16_t);
    const bool gather_a = p.gather_a != 0;
    // Threads 0-63 copy one row index each of the chunk `c` into ring slot `slot` (rows past
    // the group read 0; the copies below never use them).
    auto issue_indices = [&](ChunkCursor const& c, int slot) {
      if (thread < kTileK) {
        const int row = c.tile.rows.start + c.chunk * kTileK + thread;
        const bool live = row < c.tile.rows.end;
        SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>::copy(reinterpret_cast<const uint32_t*>(p.rows)[live ? row : 0],
                                                        reinterpret_cast<uint32_t&>(shared.ring.rows[slot][thread]),
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
      cutlass::arch::NamedBarrier::arrive_and_wait(kProducerThreads, kRingBarrier);
      const int32_t* ring = shared.ring.rows[seq % kRing];
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
      auto* a = shared.tensors.smem_A.data() + stage * kStageElementsA;
      auto* b = shared.tensors.smem_B.data() + stage * kStageElementsB;
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

  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_group = cutlass::canonical_warp_group_idx();
    const Role role = warp_group > 0 ? Role::Consumer : Role::Producer;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(&p.a_chunk);
      cute::prefetch_tma_descriptor(&p.b_chunk);
      if (p.tma_store) cute::prefetch_tma_descriptor(&p.d_tile);
    }
    typename MainloopPipeline::Params pipe_params;
    pipe_params.role = role == Role::Producer ? MainloopPipeline::ThreadCategory::Producer
                                              : MainloopPipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    pipe_params.num_consumers = kMmaThreads;
    pipe_params.num_producers = 1 + kProducerThreads;
    pipe_params.transaction_bytes = 0;  // thread 0 expects a TMA chunk's bytes itself
    MainloopPipeline pipeline(shared.pipeline, pipe_params, ClusterShape{});
    if constexpr (kClusterM > 1) {
      cute::cluster_sync();  // the peer's barriers initialised before any multicast or remote release
    } else {
      __syncthreads();
    }
    const int rank = kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;
    const int first = int(blockIdx.x) / kClusterM, stride = int(gridDim.x) / kClusterM;

    const int m_blocks = (p.m + kTileM - 1) / kTileM;
    const int m_units = (m_blocks + kClusterM - 1) / kClusterM;
    const int n_blocks = (p.n + kTileN - 1) / kTileN;
    Tile tile;
    if (role != Role::Consumer) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      PipelineState write = cutlass::make_producer_start_state<MainloopPipeline>();
      if (p.rows != nullptr) {
        load_gathered(p, pipeline, write, shared, Walk{stride, m_units, n_blocks, rank}, first, thread_idx);
      } else {
        for (int i = first; tile_at(p, i, m_units, n_blocks, rank, tile); i += stride) {
          load_tile(p, pipeline, write, shared, tile, thread_idx, rank);
        }
      }
      if (warp_idx == 0 && cute::elect_one_sync()) pipeline.producer_tail(write);
      __syncwarp();
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
      const int mma_thread_idx = thread_idx % kMmaThreads;
      TiledMma tiled_mma;
      Mainloop mainloop;
      const int wg_row0 = get<0>(tiled_mma.get_thread_slice(mma_thread_idx)
                                     .partition_C(make_identity_tensor(take<0, 2>(TileShape{})))(0)) /
                          64 * 64;
      PipelineState read;
      uint32_t store_passes = 0;  // the TMA epilogue's slab parity
      for (int i = first; tile_at(p, i, m_units, n_blocks, rank, tile); i += stride) {
        const int k_tiles = (tile.rows.rows() + kTileK - 1) / kTileK;
        auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // (MMA,MMA_M,MMA_N)
        if (tile.m_block >= m_blocks) {
          // The pair's second CTA past the last m-block: no output; it releases every stage
          // its own and its peer's loads filled, in step.
          moefuse::drain_stages(pipeline, read, k_tiles);
          read.advance(k_tiles);
          continue;
        }
        if (k_tiles > 0) {
          mainloop.mma(pipeline, read, acc, k_tiles, mma_thread_idx, shared.tensors, p.mainloop);
          mainloop.mma_tail(pipeline, read, k_tiles);
          read.advance(k_tiles);
        } else if (p.beta != 0.f) {
          continue;  // an empty group with beta != 0: D_e left untouched (abi.h)
        } else {
          clear(acc);  // an empty group: D_e = 0
        }
        const int m0 = tile.m_block * kTileM, n0 = tile.n_block * kTileN;
        const uint32_t barrier = kEpilogueBarrier + wg_row0 / 64;
        if (p.tma_store) {
          epilogue::store_tile_tma<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue.tma.wg[wg_row0 / 64], barrier,
                                              &p.d_tile, tile.group, m0, min(kTileM, p.m - m0), n0,
                                              min(kTileN, p.n - n0), p.alpha, store_passes);
        } else {
          cutlass::bfloat16_t* d = p.d + int64_t(tile.group) * p.m * p.n;
          epilogue::store_masked_rows<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue.masked,
                                                 barrier, d, int64_t(p.n), m0, min(kTileM, p.m - m0), n0,
                                                 min(kTileN, p.n - n0), p.alpha, p.beta);
        }
      }
      epilogue::store_tile_tma_tail(mma_thread_idx);
    }
#else
    __trap();
#endif
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    sm90_contiguous_wgrad_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
