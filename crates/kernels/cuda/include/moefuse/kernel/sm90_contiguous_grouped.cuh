// Hopper (sm_90a) persistent M-grouped bf16 GEMM over the contiguous grouped layout:
//   D[rows_e, :] = alpha * A[rows_e, :] * W_e + beta * D[rows_e, :]
// with one TMA map over all of A `[total_rows, K]` and one 3-D map over W `[E, N, K]`
// (or `[E, K, N]`), both built on the host once per call and never rewritten on the
// device (CUTLASS's ptr-array kernel rewrites a CTA's maps whenever it changes group).
//
//   warp            role                                     registers
//   0               producer: TMA loads of A rows and W_e    40
//                   (W_e multicast to the cluster's 2 CTAs)
//   1               builds the group table, then idle        40
//   2-3             idle (their registers go to the MMA)     40
//   4-11 (2 WGs)    MMA consumers (WGMMA 64xN each) + store  232
//
// Composition: mainloop = CUTLASS's sm90 TMA/GMMA collective (load/load_tail,
// mma/mma_tail), tile order = sched::ContiguousGroupScheduler, store =
// epilogue::store_masked_rows. A tile's A box may run past its group's rows into the
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
template <class Mainloop_, int kMaxGroups_, class RowAt_ = epilogue::RowsInOrder>
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
  static constexpr uint32_t kLoadRegisters = 40;
  static constexpr uint32_t kMmaRegisters = 232;
  // Named barriers of the two consumer warp groups' epilogues (ids above CUTLASS's reserved ones).
  static constexpr uint32_t kEpilogueBarrier = 1;
  static_assert(cute::size(TiledMma{}) == kMmaThreads,
                "sm90 contiguous grouped GEMM: the TiledMma must span two warp groups (cooperative builder)");
  static_assert(kTileM == 128, "sm90 contiguous grouped GEMM: two consumer warp groups of 64 rows make TileM 128");

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
    RowAt_ row_at;  // where each row of D is stored (empty for RowsInOrder)
  };

  enum class Role { Producer, Idle, Consumer };

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
    const Role role = warp_group > 0 ? Role::Consumer : (warp_idx == 0 ? Role::Producer : Role::Idle);

    if (warp_idx == 0 && cute::elect_one_sync()) Mainloop::prefetch_tma_descriptors(p.mainloop);
    if (warp_idx == 1) Scheduler::build(shared.groups, p.offsets, p.groups, p.total_rows);

    typename MainloopPipeline::Params pipe_params;
    pipe_params.role = role == Role::Producer ? MainloopPipeline::ThreadCategory::Producer
                                              : MainloopPipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
    pipe_params.num_consumers = kMmaThreads;
    pipe_params.transaction_bytes = p.mainloop.tma_transaction_bytes;
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
          mainloop.mma(pipeline, read, acc, k_tiles, mma_thread_idx, shared.tensors, p.mainloop);
          mainloop.mma_tail(pipeline, read, k_tiles);
        } else {
          // NOTES: a group's last tile with <= 64 rows: the warp group of rows 64-127 has
          // nothing to store, so it skips its WGMMAs and the other one runs at the full
          // tensor-core rate (ping-pong's observation), halving a small tile's time. It
          // still waits and releases every stage, in step, so the barrier phases stay exact.
          moefuse::drain_stages(pipeline, read, k_tiles);
          read.advance(k_tiles);
          continue;
        }
        read.advance(k_tiles);
        const int col0 = tile.n_block * kTileN;
        epilogue::store_masked_rows<TileShape>(acc, tiled_mma, mma_thread_idx, wg_row0, shared.epilogue,
                                               kEpilogueBarrier + wg_row0 / 64, p.d, int64_t(p.n), tile.row0,
                                               tile.rows, col0, min(kTileN, p.n - col0), p.alpha, p.beta, p.row_at);
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
