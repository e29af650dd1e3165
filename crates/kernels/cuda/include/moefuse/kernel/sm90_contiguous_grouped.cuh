// Hopper (sm_90a) persistent M-grouped bf16 GEMM over the contiguous grouped layout:
//   D[rows_e, :] = alpha * A[rows_e, :] * W_e + beta * D[rows_e, :]
// with one TMA map over all of A `[total_rows, K]` and one 3-D map over W `[E, N, K]`
// (or `[E, K, N]`), both built on the host once per call and never rewritten on the
// device (CUTLASS's ptr-array kernel rewrites a CTA's maps whenever it changes group).
//
//   warp            role                                     registers
//   0               producer: TMA loads of A rows and W_e    56
//                   (W_e multicast to the cluster's 2 CTAs)
//   1               builds the group table, then idle        56
//   2-3             idle (their registers go to the MMA)     56
//   4-11 (2 WGs)    MMA consumers (WGMMA 64xN each) + store  224
//
// Gathered A (a_rows set: the layer's down dgrad reading dy's token rows through source_of
// instead of a permuted copy): warps 0-3 all produce. Tile row t is row a_rows[r] / div of
// A, copied by thread t's warp with 16-byte cp.async (eight lanes per 128-byte row segment,
// the fused gate_up's producer), W_e still by TMA from thread 0; each stage's full barrier
// then takes 129 arrivals (thread 0's with W_e's bytes, one cp.async arrival per thread).
// Rows past the tile's group and bad indices are zero-filled, never read.
//
// Composition: mainloop = CUTLASS's sm90 TMA/GMMA collective (load/load_tail,
// mma/mma_tail), tile order = sched::ContiguousGroupScheduler, store =
// epilogue::store_masked_rows or a fused epilogue (Fusion_). A tile's A box may run past its group's rows into the
// next group's (loaded, multiplied, never stored).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "moefuse/common/pipeline_drain.cuh"
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel {

// RowAt_: where the epilogue stores each row (epilogue::RowsInOrder: D; RowsScattered: a
// per-row address table, the expert-parallel down GEMM's combine into the home ranks).
// Fusion_: what the epilogue does with the tile instead of storing it (epilogue::NoFusion:
// store D through RowAt_; ActivationBackwardRows: the down dgrad's routed activation
// backward), with its own Params and a per-tile RowState read before the tile's mainloop.
template <class Mainloop_, int kMaxGroups_, class RowAt_ = epilogue::RowsInOrder, class Fusion_ = epilogue::NoFusion>
struct Sm90ContiguousGrouped {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  using MainloopPipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;
  using ClusterShape = typename Mainloop::DispatchPolicy::ClusterShape;
  static constexpr int kClusterM = cute::size<0>(ClusterShape{});
  static constexpr int kMaxGroups = kMaxGroups_;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  using Scheduler = sched::ContiguousGroupScheduler<kTileM, kClusterM, kMaxGroups>;
  static_assert(cute::size<1>(ClusterShape{}) == 1 && kClusterM <= 2,
                "sm90 contiguous grouped GEMM: clusters of 1 or 2 CTAs along M (sharing W_e tiles)");

  static constexpr int kThreads = 384;
  static constexpr int kMmaThreads = 256;
  // NOTES: 56 for the gathered producer's eight hoisted 32-bit row offsets (as the fused
  // gate_up's); the consumers then get 224, which they fit without spills.
  static constexpr uint32_t kLoadRegisters = 56;
  static constexpr uint32_t kMmaRegisters = 224;
  static constexpr int kProducerThreads = 128;
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr uint32_t kBytesB = kTileN * kTileK * sizeof(cutlass::bfloat16_t);
  // Named barriers of the two consumer warp groups' epilogues (ids above CUTLASS's reserved ones).
  static constexpr uint32_t kEpilogueBarrier = 1;
  static_assert(cute::size(TiledMma{}) == kMmaThreads,
                "sm90 contiguous grouped GEMM: the TiledMma must span two warp groups (cooperative builder)");
  static_assert(kTileM == 128, "sm90 contiguous grouped GEMM: two consumer warp groups of 64 rows make TileM 128");
  static_assert(kTileK == 64, "sm90 contiguous grouped GEMM: a k-block is one 128-byte swizzle row");
  // The gathered producer writes A where the collective's layout puts it: K-major rows of
  // 64 elements, one after the other, 128-byte swizzled, stages kTileM x kTileK apart.
  using SmemA = typename Mainloop::SmemLayoutA;
  static_assert(cute::is_same_v<decltype(SmemA{}.layout_a()), cute::Swizzle<3, 4, 3>>,
                "sm90 contiguous grouped GEMM: a 128-byte swizzled A stage");
  static_assert(SmemA{}.layout_b()(1, 0, 0) == kTileK && SmemA{}.layout_b()(0, 1, 0) == 1 &&
                    SmemA{}.layout_b()(9, 0, 0) == 9 * kTileK && SmemA{}.layout_b()(0, 0, 1) == kStageElementsA,
                "sm90 contiguous grouped GEMM: A stage is not K-major rows of 64 elements");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    alignas(16) typename Scheduler::Table groups;
    epilogue::MaskedRowsStorage epilogue;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  struct Params {
    typename Mainloop::Params mainloop;
    const int32_t* offsets;
    cutlass::bfloat16_t* d;
    int groups;
    int total_rows;
    int n;
    int k;
    float alpha;
    float beta;
    int band;      // m-blocks per band of the tile order
    int n_fast;    // 1: a band's n-blocks first
    int interleave;  // 1: the tile list's front and back alternate
    int prefetch;  // k-blocks of the next tile's A and W_e tiles prefetched into L2
    const int32_t* a_rows;  // gathered A: [total_rows] indices, or nullptr (A is [total_rows, k])
    const cutlass::bfloat16_t* a;  // gathered A: [a_source_rows, k]
    int a_rows_div;
    int a_source_rows;
    RowAt_ row_at;  // where each row of D is stored (empty for RowsInOrder)
    typename Fusion_::Params fusion;  // the fused epilogue's operands (empty for NoFusion)
  };

  enum class Role { Producer, Idle, Consumer };

  // The raw a_rows entry of tile row t (-1 past the tile's rows); loaded a tile ahead of its
  // use, so the index's L2 round trip is not on the producer's path.
  CUTE_DEVICE static int tile_index(Params const& p, sched::GroupTile const& tile, int t) {
    return t < tile.rows ? __ldg(p.a_rows + tile.row0 + t) : -1;
  }

  // Producer perspective, gathered A (thread t of warp group 0): the k-blocks of one tile
  // whose row t is a_rows entry `index`. W_e's tile by TMA from thread 0 (this CTA's half of a
  // multicast tile, as the collective's load); A's 128 rows by cp.async. Per tile, not per
  // k-block: the 8 rows this thread copies (row i*4 + lane/8 of its warp's 32) as 32-bit
  // chunk offsets at its lane's 16-byte column, and which are live (the launcher refuses an
  // A of 2^32 chunks).
  template <class TensorB>
  CUTE_DEVICE static void load_gathered(Params const& p, MainloopPipeline& pipeline, PipelineState& write,
                                        SharedStorage& shared, sched::GroupTile const& tile, TensorB const& gB,
                                        int index, int k_tiles, int t, uint32_t rank) {
    using namespace cute;
    using Chunk = cute::uint128_t;
    const int row = index < 0 ? -1 : index / p.a_rows_div;
    const int src = row < p.a_source_rows ? row : -1;
    const uint32_t row_chunks = uint32_t(p.k / 8);
    const int lane = t % 32, warp = t / 32, c = lane % 8;
    uint32_t live_rows = 0, row_ref[8];
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int from = __shfl_sync(0xffffffffu, src, i * 4 + lane / 8);
      live_rows |= uint32_t(from >= 0) << i;
      row_ref[i] = uint32_t(from < 0 ? 0 : from) * row_chunks + uint32_t(c);
    }
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), typename Mainloop::SmemLayoutB{});
    auto block_tma_b = p.mainloop.tma_load_b.get_slice(rank % kClusterM);
    Tensor tBgB = block_tma_b.partition_S(gB(_, _, tile.n_block, _, 0));  // (TMA,TMA_N,TMA_K,k)
    Tensor tBsB = block_tma_b.partition_D(sB);                            // (TMA,TMA_N,TMA_K,PIPE)
    uint16_t mcast_mask_b = 0;
    if constexpr (is_same_v<typename Mainloop::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      mcast_mask_b = uint16_t((1u << kClusterM) - 1);  // the cluster is kClusterM x 1
    }
    const auto* a_chunks = reinterpret_cast<const Chunk*>(p.a);
    auto* smem_a = reinterpret_cast<Chunk*>(shared.tensors.smem_A.data());
    constexpr int kChunks = kTileK / 8;  // 16-byte chunks per row and k-block
    for (int kb = 0; kb < k_tiles; ++kb) {
      pipeline.producer_acquire(write);  // every producer waits; thread 0 arrives with W_e's bytes
      auto* barrier = pipeline.producer_get_barrier(write);
      const int stage = int(write.index());
      if (t == 0) copy(p.mainloop.tma_load_b.with(*barrier, mcast_mask_b), tBgB(_, _, _, kb), tBsB(_, _, _, stage));
      Chunk* a = smem_a + stage * kStageElementsA / 8;
      const bool valid = (kb * kChunks + c) * 8 < p.k;  // k % 8 == 0: a chunk is all in or out
      const uint32_t live_now = valid ? live_rows : 0u;
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const int r = warp * 32 + i * 4 + lane / 8;
        const bool live = (live_now >> i) & 1u;
        SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>::copy(a_chunks[live ? row_ref[i] + uint32_t(kb * kChunks) : 0u],
                                                     a[r * kChunks + (c ^ (r & 7))], live);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(barrier));
      ++write;
    }
  }

  // Consumer perspective: waits for each of `k_tiles` stages to fill and releases it
  // unread (a warp group with no rows in the tile).
  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    using X = Underscore;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);

    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int lane_idx = cutlass::canonical_lane_idx();
    const int warp_group = cutlass::canonical_warp_group_idx();
    const bool gathered = p.a_rows != nullptr;
    const Role role =
        warp_group > 0 ? Role::Consumer : (warp_idx == 0 || gathered ? Role::Producer : Role::Idle);

    if (warp_idx == 0 && cute::elect_one_sync()) Mainloop::prefetch_tma_descriptors(p.mainloop);
    if (warp_idx == 1) Scheduler::build(shared.groups, p.offsets, p.groups, p.total_rows);

    typename MainloopPipeline::Params pipe_params;
    pipe_params.role = role == Role::Producer ? MainloopPipeline::ThreadCategory::Producer
                                              : MainloopPipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    pipe_params.num_consumers = kMmaThreads;
    // Gathered A: thread 0 expects W_e's bytes only, and every producer thread arrives.
    pipe_params.transaction_bytes = gathered ? kBytesB : p.mainloop.tma_transaction_bytes;
    pipe_params.num_producers = gathered ? 1 + kProducerThreads : 1;
    // NOTES: the constructor initialises the barriers from warp 0; the block barrier below
    // makes them (and the group table) visible before any role touches them.
    MainloopPipeline pipeline(shared.pipeline, pipe_params, ClusterShape{});
    if constexpr (kClusterM > 1) {
      cute::cluster_sync();  // the peer's barriers must be initialised before any multicast
    } else {
      __syncthreads();
    }
    const uint32_t rank = cute::block_rank_in_cluster();

    const int n_blocks = (p.n + kTileN - 1) / kTileN;
    const int k_tiles = (p.k + kTileK - 1) / kTileK;
    Scheduler scheduler(shared.groups, n_blocks, p.band, p.n_fast != 0, p.interleave != 0, int(blockIdx.x) / kClusterM,
                        int(gridDim.x) / kClusterM, int(rank));
    Mainloop mainloop;
    sched::GroupTile tile;

    if (role != Role::Consumer) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      if (role != Role::Producer) return;
      Tensor mA = p.mainloop.tma_load_a.get_tma_tensor(make_shape(p.total_rows, p.k, 1));  // (ROWS,K,1)
      Tensor mB = p.mainloop.tma_load_b.get_tma_tensor(make_shape(p.n, p.k, p.groups));    // (N,K,E)
      auto tiles_of = [&](sched::GroupTile const& t) {
        Tensor gA = local_tile(domain_offset(make_coord(t.row0, 0, 0), mA), TileShape{}, make_coord(_, _, _),
                               Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
        Tensor gB = local_tile(domain_offset(make_coord(0, 0, t.group), mB), TileShape{}, make_coord(_, _, _),
                               Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
        return make_tuple(gA, gB);
      };
      PipelineState write = cutlass::make_producer_start_state<MainloopPipeline>();
      if (gathered) {
        Scheduler first_peek = scheduler;  // a copy walks ahead (the table is shared, read-only)
        int index = first_peek.next(tile) ? tile_index(p, tile, thread_idx) : -1;
        while (scheduler.next(tile)) {
          auto [gA, gB] = tiles_of(tile);
          sched::GroupTile next_tile;
          Scheduler peek = scheduler;
          const int next_index = peek.next(next_tile) ? tile_index(p, next_tile, thread_idx) : -1;
          load_gathered(p, pipeline, write, shared, tile, gB, index, k_tiles, thread_idx, rank);
          index = next_index;
        }
        if (warp_idx == 0 && cute::elect_one_sync()) pipeline.producer_tail(write);
        __syncwarp();
        return;
      }
      while (scheduler.next(tile)) {
        auto [gA, gB] = tiles_of(tile);
        // Optional (tuning): the next tile's first k-blocks asked into L2 a whole tile ahead
        // of their loads, exactly the TMA boxes this CTA will load (its half of a multicast
        // W_e tile). NOTES: off by default: on the H200 it slowed the Qwen3 shapes (8 blocks:
        // +5%) and moved the large-K ones within their noise (grouped_gemm_sweep, p<N>).
        sched::GroupTile next_tile;
        Scheduler ahead = scheduler;
        if (p.prefetch > 0 && ahead.next(next_tile) && cute::elect_one_sync()) {
          auto [gA_next, gB_next] = tiles_of(next_tile);
          Tensor tAgA = p.mainloop.tma_load_a.get_slice(0).partition_S(gA_next(_, _, 0, _, 0));  // (TMA,TMA_M,TMA_K,k)
          Tensor tBgB = p.mainloop.tma_load_b.get_slice(rank % kClusterM)
                            .partition_S(gB_next(_, _, next_tile.n_block, _, 0));  // (TMA,TMA_N,TMA_K,k)
          const int blocks = min(p.prefetch, k_tiles);
          for (int kb = 0; kb < blocks; ++kb) {
            cute::prefetch(p.mainloop.tma_load_a, tAgA(_, _, _, kb));
            cute::prefetch(p.mainloop.tma_load_b, tBgB(_, _, _, kb));
          }
        }
        __syncwarp();
        auto k_iter = make_coord_iterator(shape<3>(gA));
        mainloop.load(p.mainloop, pipeline, write, make_tuple(gA, gB), make_coord(0, tile.n_block, _, 0), k_iter,
                      k_tiles, lane_idx, rank, shared.tensors);
        write.advance(k_tiles);
      }
      mainloop.load_tail(pipeline, write);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
      const int mma_thread_idx = thread_idx % kMmaThreads;
      TiledMma tiled_mma;
      // First tile row this warp group computes (0 or 64).
      const int wg_row0 = get<0>(tiled_mma.get_thread_slice(mma_thread_idx)
                                     .partition_C(make_identity_tensor(take<0, 2>(TileShape{})))(0)) /
                          64 * 64;
      PipelineState read;
      while (scheduler.next(tile)) {
        auto acc = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // (MMA,MMA_M,MMA_N)
        if (tile.rows > wg_row0) {
          // Loads issued now, consumed after the mainloop (the fused epilogue's row data).
          const auto row_state = Fusion_::prepare(p.fusion, tile.row0, tile.rows, wg_row0, mma_thread_idx % 128);
          mainloop.mma(pipeline, read, acc, k_tiles, mma_thread_idx, shared.tensors, p.mainloop);
          mainloop.mma_tail(pipeline, read, k_tiles);
          read.advance(k_tiles);
          const int col0 = tile.n_block * kTileN;
          const int cols = min(kTileN, p.n - col0);
          const uint32_t barrier = kEpilogueBarrier + wg_row0 / 64;
          if constexpr (Fusion_::kFused) {
            Fusion_::template store<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue, barrier,
                                               p.fusion, tile.row0, tile.rows, col0, cols, tile.n_block, row_state);
          } else {
            epilogue::store_masked_rows<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue, barrier,
                                                   p.d, int64_t(p.n), tile.row0, tile.rows, col0, cols, p.alpha,
                                                   p.beta, p.row_at);
          }
        } else {
          // NOTES: a group's last tile with <= 64 rows: the warp group of rows 64-127 has
          // nothing to store, so it skips its WGMMAs and the other one runs at the full
          // tensor-core rate (ping-pong's observation), halving a small tile's time. It
          // still waits and releases every stage, in step, so the barrier phases stay exact.
          moefuse::drain_stages(pipeline, read, k_tiles);
          read.advance(k_tiles);
        }
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
    sm90_contiguous_grouped_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
