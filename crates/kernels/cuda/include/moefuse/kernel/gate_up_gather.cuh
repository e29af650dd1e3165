// The fused gate_up's producer and tile columns, shared by the Hopper kernel
// (kernel/sm90_gate_up_fused.cuh, WGMMA) and the Blackwell kernel
// (kernel/sm100_gate_up_fused.cuh, UMMA): both take A and B stages in the same shared-memory
// form (K-major, 128-byte swizzle, 8-row atoms stacked along M: row r of a stage 128 bytes
// after row r - 1), so one producer fills either. The producers are 128 threads (one per
// tile row); thread 0 also loads W_e's two 128-row TMA boxes per k-block. Every stage's full
// barrier counts 129 arrivals: thread 0's (with W's expected bytes) and one cp.async
// completion per producer thread.
//
// NOTES (the gather): first built as one 64 x 1 TMA box per tile row and k-block (the
// swizzle is a function of the shared-memory address, so the boxes land exactly where a
// 128 x 64 box would): correct, but the TMA unit took ~65 cycles per 128-byte box, so the
// Qwen3-30B-A3B gate_up ran 4385 us against 735 us unfused (H200, 2026-12-03); one thread
// per row (8 chunks each, a warp instruction touching 32 rows) ran 1903 us. Now 128
// threads issue 16-byte cp.async copies, eight lanes per 128-byte row segment (the
// 128-byte swizzle applied by hand: chunk c of row r at chunk c ^ (r % 8)), each thread's
// completion arriving on the stage's full barrier (cp.async.mbarrier.arrive.noinc), W_e's boxes still by TMA on the same barrier:
// 129 arrivals (thread 0's expect-tx and the 128 copies) and W's bytes complete a stage.
// One arrival per warp after cp.async.wait_group (5 per stage) measured no faster (1673 vs
// 1624 us), so the per-thread arrivals stay.
// NOTES (the tile's columns): the B stage holds 256 rows of W_e as two 128-row boxes. Split
// layout: gate rows j0..j0+127 then up rows I+j0..; interleaved: W rows 2*j0..2*j0+255;
// RELU2 (no up half): W rows j0'..j0'+255. So accumulator column c of a split tile is gate
// j0 + c and column c + 128 its up partner; interleaved, columns 2m and 2m + 1 are a pair.
#pragma once

#include <cuda.h>

#include "cute/arch/copy_sm80.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "moefuse/moe_abi.h"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel {

// What a fused gate_up launch gives either arch's kernel (the Hopper kernel's Params add its
// collective's): the tensor maps, the operands and the problem, filled by the launcher.
struct GateUpParams {
  CUtensorMap tmap_w;     // w [E, W, hidden]: box 64 x 128 x 1, 128-byte swizzle
  CUtensorMap tmap_rows;  // contiguous only: x [max_rows, hidden] (rows in order): box 64 x 128
  const int32_t* offsets;
  const int32_t* source_of;      // nullptr: x holds the routed rows in order (contiguous)
  const cutlass::bfloat16_t* x;  // [tokens, hidden], or [max_rows, hidden] contiguous
  cutlass::bfloat16_t* h;
  cutlass::bfloat16_t* h_pre;
  uint32_t* errors;
  int groups;
  int max_rows;  // tokens * top_k
  int top_k;
  int hidden;
  int inter;
  int width;  // W: 2 * inter gated, inter for RELU2
  int act;
  int layout;
  float alpha;
  float limit;
  int band;
  int n_fast;
  int interleave;
  int peers;      // kPeerRows: ranks whose x rows source_of names (1..MOEFUSE_GATE_UP_MAX_PEERS)
  int peer_rows;  // kPeerRows: rows of each rank's x
  const cutlass::bfloat16_t* peer_x[MOEFUSE_GATE_UP_MAX_PEERS];  // kPeerRows: rank s's x [peer_rows, hidden]
};

template <int kTileM_, int kTileN_, int kTileK_, int kClusterM_, bool kPeerRows_, int kMaxPeers_>
struct GateUpGather {
  static constexpr int kTileM = kTileM_;
  static constexpr int kTileN = kTileN_;
  static constexpr int kTileK = kTileK_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr bool kPeerRows = kPeerRows_;
  static constexpr int kMaxPeers = kMaxPeers_;
  static constexpr int kProducerThreads = 128;
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr int kStageElementsB = kTileN * kTileK;
  static_assert(kTileM == kProducerThreads && kTileN == 256 && kTileK == 64,
                "fused gate_up producer: 128 x 256 x 64 tiles (one producer thread per tile row, two 128-row W boxes)");

  // The h columns one tile covers: 128 gated, 256 for RELU2.
  CUTE_HOST_DEVICE static int h_cols_per_tile(int act) {
    return act == MOEFUSE_ACTIVATION_RELU2 ? kTileN : kTileN / 2;
  }

  // First W row of each of the tile's two 128-row boxes.
  template <class Params>
  CUTE_DEVICE static void w_rows(Params const& p, int n_block, int& first, int& second) {
    const int j0 = n_block * h_cols_per_tile(p.act);
    if (p.act == MOEFUSE_ACTIVATION_RELU2) {
      first = j0;
      second = j0 + 128;
    } else if (p.layout == MOEFUSE_GATE_UP_SPLIT) {
      first = j0;
      second = p.inter + j0;
    } else {
      first = 2 * j0;
      second = 2 * j0 + 128;
    }
  }

  // Producer perspective (warp group 0, thread t of 128): tile row t of x, gathered, and
  // (thread 0) W_e's two boxes, for each k-block of one tile.
  template <class Params, class Pipeline, class PipelineState>
  CUTE_DEVICE static void load_tile(Params const& p, Pipeline& pipeline, PipelineState& write,
                                    cutlass::bfloat16_t* smem_a_stages, cutlass::bfloat16_t* smem_b,
                                    sched::GroupTile const& tile, int total_rows, int k_tiles, int t, int rank) {
    using namespace cute;
    using Chunk = cute::uint128_t;
    constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
    constexpr uint32_t kBytesB = kStageElementsB * sizeof(cutlass::bfloat16_t);
    constexpr uint32_t kBytesA = kStageElementsA * sizeof(cutlass::bfloat16_t);
    int w_first = 0, w_second = 0;
    w_rows(p, tile.n_block, w_first, w_second);
    // Thread 0: k-block kb of W_e's two 128-row boxes into `stage`, the stage's full barrier
    // expecting their bytes plus `more_bytes` (A's box, in the contiguous mode). In a pair,
    // this CTA loads box `rank` into the same stage of both CTAs (the peer loads the other):
    // both walk the same (expert, n-block) tiles and k-blocks, so the stages correspond.
    auto load_w = [&](uint64_t* barrier, int stage, int kb, uint32_t more_bytes) {
      cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, kBytesB + more_bytes);
      auto* b = smem_b + stage * kStageElementsB;
      if constexpr (kClusterM == 1) {
        SM90_TMA_LOAD_3D::copy(&p.tmap_w, barrier, kHint, b, kb * kTileK, w_first, tile.group);
        SM90_TMA_LOAD_3D::copy(&p.tmap_w, barrier, kHint, b + 128 * kTileK, kb * kTileK, w_second, tile.group);
      } else {
        constexpr uint16_t kBoth = 0b11;
        SM90_TMA_LOAD_MULTICAST_3D::copy(&p.tmap_w, barrier, kBoth, kHint, b + rank * 128 * kTileK, kb * kTileK,
                                         rank == 0 ? w_first : w_second, tile.group);
      }
    };
    if (p.source_of == nullptr) {
      // Contiguous rows (x already gathered): one 128-row TMA box of A per k-block beside
      // W's two; rows past the end read zeros, the next group's rows are loaded and never
      // stored. Every producer thread still arrives (the barrier counts 129).
      auto* smem_a = smem_a_stages;
      for (int kb = 0; kb < k_tiles; ++kb) {
        pipeline.producer_acquire(write);
        uint64_t* barrier = pipeline.producer_get_barrier(write);
        const int stage = int(write.index());
        if (t == 0) {
          load_w(barrier, stage, kb, kBytesA);
          SM90_TMA_LOAD_2D::copy(&p.tmap_rows, barrier, kHint, smem_a + stage * kStageElementsA, kb * kTileK,
                                 tile.row0);
        }
        cutlass::arch::ClusterBarrier::arrive(barrier);
        ++write;
      }
      return;
    }
    // The token row of tile row t; rows past the last routed row (the tile's tail) and bad
    // source_of entries read token 0 (their products are never stored).
    const int row = tile.row0 + t;
    int token = 0, peer = 0;
    if (row < total_rows) {
      const int src = p.source_of[row];
      if constexpr (kPeerRows) {
        if (src >= 0 && src / p.peer_rows < p.peers) {
          peer = src / p.peer_rows;
          token = src - peer * p.peer_rows;
        } else if (p.errors != nullptr) {
          atomicOr(p.errors, MOEFUSE_MOE_ERROR_SOURCE);
        }
      } else {
        if (src >= 0 && src < p.max_rows) {
          token = src / p.top_k;
        } else if (p.errors != nullptr) {
          atomicOr(p.errors, MOEFUSE_MOE_ERROR_SOURCE);
        }
      }
    }
    const auto* x_chunks = reinterpret_cast<const Chunk*>(p.x);
    const int64_t row_chunks = p.hidden / 8;
    const int lane = t % 32, warp = t / 32, c = lane % 8;
    const int rows_left = tile.rows - warp * 32;  // this warp's tile rows inside the group
    auto* smem_a = reinterpret_cast<Chunk*>(smem_a_stages);
    constexpr int kChunks = kTileK / 8;  // 16-byte chunks per row and k-block
    static_assert(kChunks == 8, "eight threads copy one 128-byte row segment");
    // Per tile, not per k-block: the 8 rows this thread copies (row i*4 + lane/8 of the
    // warp's 32) as chunk pointers at this lane's 16-byte column, and which are inside the
    // group. Rows past the group's end in this tile are never stored: zero-filled, not
    // read (at T = 1 the 120 tail rows of each tile all read one token's row: one hot line).
    // NOTES: recomputing the token broadcast and the 64-bit address of each row per
    // k-block made the producers the bottleneck of this kernel (ncu, 2026-12-04: the
    // consumers waited on full stages for 23% of their samples while the producer warps
    // issued); the hoisted offsets (32-bit: the launcher refuses an x of 2^32 chunks or
    // more) need kLoadRegisters = 56. Peer rows live in other allocations (no common
    // 32-bit base): their 8 rows are 64-bit pointers, resolved once per tile (the peer's
    // base by an unrolled select, not a dynamically indexed parameter array).
    uint32_t live_rows = 0;
    using RowRef = cute::conditional_t<kPeerRows, const Chunk*, uint32_t>;
    RowRef row_ref[8];
    // Peer rows: this thread's own row's address, then broadcast like the token.
    uint64_t own_row = 0;
    if constexpr (kPeerRows) {
      const cutlass::bfloat16_t* base = p.peer_x[0];
      CUTE_UNROLL
      for (int q = 1; q < kMaxPeers; ++q) base = peer == q ? p.peer_x[q] : base;
      own_row = reinterpret_cast<uint64_t>(reinterpret_cast<const Chunk*>(base) + int64_t(token) * row_chunks);
    }
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int sub = i * 4 + lane / 8;
      if constexpr (kPeerRows) {
        row_ref[i] = reinterpret_cast<const Chunk*>(__shfl_sync(0xffffffffu, own_row, sub)) + c;
      } else {
        const int64_t tok = __shfl_sync(0xffffffffu, token, sub);
        row_ref[i] = uint32_t(tok * row_chunks + c);
      }
      live_rows |= uint32_t(sub < rows_left) << i;
    }
    for (int kb = 0; kb < k_tiles; ++kb) {
      pipeline.producer_acquire(write);  // every producer waits; thread 0 arrives (no bytes yet)
      uint64_t* barrier = pipeline.producer_get_barrier(write);
      const int stage = int(write.index());
      if (t == 0) load_w(barrier, stage, kb, 0);
      // Warp w copies tile rows 32w..32w+31, four rows per instruction: eight lanes per
      // 128-byte row segment (coalesced).
      Chunk* a = smem_a + stage * kStageElementsA / 8;
      const bool valid = (kb * kChunks + c) * 8 < p.hidden;  // hidden % 8 == 0: a chunk is all in or out
      const uint32_t live_now = valid ? live_rows : 0u;
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const int r = warp * 32 + i * 4 + lane / 8;
        const bool live = (live_now >> i) & 1u;
        if constexpr (kPeerRows) {
          // Every row_ref is a real row's address (tail rows: peer 0's row 0); a dead
          // copy reads nothing (source size 0).
          SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(*row_ref[i], a[r * kChunks + (c ^ (r & 7))], live);
          row_ref[i] += kChunks;
        } else {
          SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(x_chunks[live ? row_ref[i] + uint32_t(kb * kChunks) : 0u],
                                                       a[r * kChunks + (c ^ (r & 7))], live);
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(barrier);
      ++write;
    }
  }
};

}  // namespace moefuse::kernel
