// Hopper (sm_90a) fused gate_up of the MoE layer: a persistent M-grouped bf16 GEMM over the
// expert-major rows whose producer gathers the token rows of x itself (no x_perm copy) and
// whose epilogue applies the activation to the fp32 accumulators:
//   h_pre[r, :] = x[source_of[r] / top_k, :] · W_e^T,   h[r, j] = act(gate j, up j)
// or, without source_of (the contiguous mode), x's row r itself (x already gathered, as the
// unfused path's x_perm): then A comes by one 128-row TMA box per k-block, as in the plain
// contiguous GEMM, and only the activation is fused. With kPeerRows (the expert-parallel
// layer's pull dispatch), source_of[r] = s * peer_rows + t names row t of rank s's x, read
// in place through its peer address (NVLink or this device): the dispatch moved only the
// routing metadata, and the producer reads each remote row where it lives.
//
//   warp            role                                            registers
//   0-3 (WG 0)      producers: warp w copies tile rows 32w..32w+31  56
//                   of x (their tokens' rows, 16-byte cp.async,
//                   8 lanes per 128-byte row segment, swizzled by
//                   hand); thread 0 also loads W_e's two
//                   128-row TMA boxes per k-block;
//                   warp 1 first builds the group table
//   4-11 (2 WGs)    MMA consumers (WGMMA 64x256 each) + epilogue    224
//
// With kClusterM = 2 the CTAs of a pair take the same (expert, n-block) at adjacent
// m-blocks and share W_e's two boxes per k-block: each loads one and multicasts it to both
// (half of W_e's L2 reads; the unfused path's 2-CTA contiguous GEMM does the same). A pair
// whose expert has an odd m-block count gives its second CTA a tile with no rows: it gathers
// nothing, still loads its box for the peer, and releases every stage in step.
//
// Composition: mainloop = CUTLASS's sm90 TMA/GMMA collective for the MMA side only (its
// shared-memory layouts, pipeline and mma/mma_tail); the producer is ours because CUTLASS's
// load() copies whole boxes; tile order = sched::ContiguousGroupScheduler; store =
// epilogue/activation_rows.cuh.
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
// RELU2 (no up half): W rows j0'..j0'+255. A thread's accumulator holds column c and c+128
// in the same registers' lane position (WGMMA column blocks j and j+16), and adjacent
// column pairs, so every (gate, up) pair meets in one thread without shuffles.
#pragma once

#include <cuda.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "moefuse/common/pipeline_drain.cuh"
#include "moefuse/epilogue/activation_rows.cuh"
#include "moefuse/moe_abi.h"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel {

template <class Mainloop_, int kMaxGroups_, int kClusterM_ = 1, bool kPeerRows_ = false>
struct Sm90GateUpFused {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  using MainloopPipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using SmemLayoutA = typename Mainloop::SmemLayoutA;
  using SmemLayoutB = typename Mainloop::SmemLayoutB;
  static constexpr int kMaxGroups = kMaxGroups_;
  // CTAs per cluster along M: 2 share each W_e box pair (CTA r loads box r and multicasts
  // it to both), their tiles the same (expert, n-block) at m-blocks 2u and 2u + 1.
  static constexpr int kClusterM = kClusterM_;
  // Rows read from the x of up to kMaxPeers ranks (64-bit row addresses in the producer).
  static constexpr bool kPeerRows = kPeerRows_;
  static constexpr int kMaxPeers = MOEFUSE_GATE_UP_MAX_PEERS;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  using Scheduler = sched::ContiguousGroupScheduler<kTileM, kClusterM, kMaxGroups>;
  static_assert(kTileM == 128 && kTileN == 256 && kTileK == 64,
                "sm90 fused gate_up: tiles of 128 x 256 x 64 (two 128-row W boxes, one 128-byte row per k-block)");
  // The collective is built for one CTA (only its layouts and mma() are used); the cluster
  // is this kernel's: its pipeline and the producer's multicast.
  static_assert(cute::size(typename Mainloop::DispatchPolicy::ClusterShape{}) == 1, "sm90 fused gate_up: a 1x1 collective");
  static_assert(kClusterM == 1 || kClusterM == 2, "sm90 fused gate_up: clusters of 1 or 2 CTAs along M");

  static constexpr int kThreads = 384;
  static constexpr int kMmaThreads = 256;
  // 56 / 224 (SonicMoE's split for its gathering producers): the producers hold 8 row
  // pointers per tile; 128 * 56 + 256 * 224 <= 64 K registers.
  static constexpr uint32_t kLoadRegisters = 56;
  static constexpr uint32_t kMmaRegisters = 224;
  static constexpr uint32_t kEpilogueBarrier = 1;
  static constexpr int kProducerThreads = 128;
  static_assert(kTileM == kProducerThreads, "sm90 fused gate_up: one producer thread per tile row");
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr int kStageElementsB = kTileN * kTileK;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    alignas(16) typename Scheduler::Table groups;
    epilogue::MaskedRowsStorage epilogue;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  struct Params {
    CUtensorMap tmap_w;  // w [E, W, hidden]: box 64 x 128 x 1, 128-byte swizzle
    CUtensorMap tmap_rows;  // contiguous only: x [max_rows, hidden] (rows in order): box 64 x 128
    typename Mainloop::Params mainloop;  // only for mma()'s signature (it reads none of it)
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
    int width;     // W: 2 * inter gated, inter for RELU2
    int act;
    int layout;
    float alpha;
    float limit;
    int band;
    int n_fast;
    int interleave;
    int peers;      // kPeerRows: ranks whose x rows source_of names (1..kMaxPeers)
    int peer_rows;  // kPeerRows: rows of each rank's x
    const cutlass::bfloat16_t* peer_x[kMaxPeers];  // kPeerRows: rank s's x [peer_rows, hidden]
  };

  enum class Role { Producer, Consumer };

  // The h columns one tile covers: 128 gated, 256 for RELU2.
  CUTE_HOST_DEVICE static int h_cols_per_tile(int act) {
    return act == MOEFUSE_ACTIVATION_RELU2 ? kTileN : kTileN / 2;
  }

  // First W row of each of the tile's two 128-row boxes.
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
  CUTE_DEVICE static void load_tile(Params const& p, MainloopPipeline& pipeline, PipelineState& write,
                                    SharedStorage& shared, sched::GroupTile const& tile, int total_rows,
                                    int k_tiles, int t, int rank) {
    using namespace cute;
    using Chunk = cute::uint128_t;
    constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);
    constexpr uint32_t kBytesB = kStageElementsB * sizeof(cutlass::bfloat16_t);
    constexpr uint32_t kBytesA = kStageElementsA * sizeof(cutlass::bfloat16_t);
    auto* smem_b = shared.tensors.smem_B.data();
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
      auto* smem_a = shared.tensors.smem_A.data();
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
    auto* smem_a = reinterpret_cast<Chunk*>(shared.tensors.smem_A.data());
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

  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);

    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_group = cutlass::canonical_warp_group_idx();
    const Role role = warp_group > 0 ? Role::Consumer : Role::Producer;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(&p.tmap_w);
      if (p.source_of == nullptr) cute::prefetch_tma_descriptor(&p.tmap_rows);
    }
    if (warp_idx == 1) Scheduler::build(shared.groups, p.offsets, p.groups, p.max_rows);

    typename MainloopPipeline::Params pipe_params;
    pipe_params.role = role == Role::Producer ? MainloopPipeline::ThreadCategory::Producer
                                              : MainloopPipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    pipe_params.num_consumers = kMmaThreads;
    // Full barriers: thread 0's arrive in producer_acquire plus one cp.async arrival per
    // producer thread; W's bytes are expected by thread 0 per stage (transaction_bytes 0).
    pipe_params.num_producers = 1 + kProducerThreads;
    pipe_params.transaction_bytes = 0;
    MainloopPipeline pipeline(shared.pipeline, pipe_params, ClusterShape{});
    if constexpr (kClusterM > 1) {
      cute::cluster_sync();  // the peer's barriers initialised before any multicast or remote release
    } else {
      __syncthreads();  // barriers and the group table visible to every role
    }
    const int rank = kClusterM > 1 ? int(cute::block_rank_in_cluster()) : 0;

    const int n_blocks = (p.inter + h_cols_per_tile(p.act) - 1) / h_cols_per_tile(p.act);
    const int k_tiles = (p.hidden + kTileK - 1) / kTileK;
    const int total_rows = p.groups > 0 ? shared.groups.row_end[p.groups - 1] : 0;
    Scheduler scheduler(shared.groups, n_blocks, p.band, p.n_fast != 0, p.interleave != 0,
                        int(blockIdx.x) / kClusterM, int(gridDim.x) / kClusterM, rank);
    sched::GroupTile tile;

    if (role != Role::Consumer) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      PipelineState write = cutlass::make_producer_start_state<MainloopPipeline>();
      while (scheduler.next(tile)) load_tile(p, pipeline, write, shared, tile, total_rows, k_tiles, thread_idx, rank);
      // Producer tail: wait until the consumers released every stage (no early exit with
      // loads in flight).
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
      epilogue::ActivationRows store{p.act, p.layout, p.inter, p.width, p.alpha, p.limit};
      while (scheduler.next(tile)) {
        auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // (MMA,MMA_M,MMA_N)
        if (tile.rows <= wg_row0) {
          // A group's last tile with <= 64 rows: this warp group has no rows to store (see
          // kernel/sm90_contiguous_grouped.cuh); it releases every stage in step.
          moefuse::drain_stages(pipeline, read, k_tiles);
          read.advance(k_tiles);
          continue;
        }
        mainloop.mma(pipeline, read, acc, k_tiles, mma_thread_idx, shared.tensors, p.mainloop);
        mainloop.mma_tail(pipeline, read, k_tiles);
        read.advance(k_tiles);
        store.template run<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue,
                                      kEpilogueBarrier + wg_row0 / 64, p.h, p.h_pre, tile.row0, tile.rows,
                                      tile.n_block);
      }
    }
#else
    // Built for another arch: the launcher's capability check keeps this from running.
    __trap();
#endif
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    sm90_gate_up_fused_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
