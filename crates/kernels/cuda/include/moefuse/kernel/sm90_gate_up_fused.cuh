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
// load() copies whole boxes (kernel/gate_up_gather.cuh, shared with the sm100a kernel);
// tile order = sched::ContiguousGroupScheduler; store = epilogue/activation_rows.cuh.
// NOTES (the accumulator): a thread's WGMMA fragment holds column c and c + 128 in the same
// registers' lane position (column blocks j and j + 16), and adjacent column pairs, so every
// (gate, up) pair meets in one thread without shuffles.
#pragma once

#include <cuda.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "moefuse/common/pipeline_drain.cuh"
#include "moefuse/epilogue/activation_rows.cuh"
#include "moefuse/kernel/gate_up_gather.cuh"
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
  // The producer (gather, W_e's boxes) and the tile's columns: kernel/gate_up_gather.cuh.
  using Gather = GateUpGather<kTileM, kTileN, kTileK, kClusterM, kPeerRows, kMaxPeers>;
  static constexpr int kProducerThreads = Gather::kProducerThreads;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    alignas(16) typename Scheduler::Table groups;
    epilogue::MaskedRowsStorage epilogue;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // kernel/gate_up_gather.cuh's, and the collective's own (only for mma()'s signature: it
  // reads none of it).
  struct Params : GateUpParams {
    typename Mainloop::Params mainloop;
  };

  enum class Role { Producer, Consumer };

  // The h columns one tile covers (the launcher sizes its grid with it).
  CUTE_HOST_DEVICE static int h_cols_per_tile(int act) { return Gather::h_cols_per_tile(act); }

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
      while (scheduler.next(tile)) {
        Gather::load_tile(p, pipeline, write, shared.tensors.smem_A.data(), shared.tensors.smem_B.data(), tile,
                          total_rows, k_tiles, thread_idx, rank);
      }
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
