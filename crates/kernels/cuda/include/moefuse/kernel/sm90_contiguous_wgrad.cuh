// Hopper (sm_90a) persistent K-grouped bf16 GEMM over the contiguous grouped layout (the
// weight gradient of an M-grouped layer):
//   D_e = alpha * A[rows_e, :]^T · B[rows_e, :] + beta * D_e      (D_e = d + e*m*n, [m, n])
// with A [total_rows, m] and B [total_rows, n] row-major: both operands are MN-major for the
// tensor cores and the reduction runs over the group's rows.
//
//   warp            role                                              registers
//   0-3 (WG 0)      producers (kernel/contiguous_wgrad_producer.cuh):  56
//                   per 64-row chunk of the group, A and B as 64-wide
//                   strips by TMA, a group's last, partial chunk or
//                   gathered rows by 16-byte cp.async
//   4-11 (2 WGs)    MMA consumers (WGMMA 64x256 each) + store         224
//
// With kClusterM = 2 the CTAs of a pair take the same (group, n-block) at m-blocks 2u and
// 2u + 1 and share B's four 64-wide strips of each whole chunk by TMA multicast (half of B's
// L2 reads). When the m-block count is odd, the last pair's second CTA has no rows: it loads
// its strips for the peer and drains.
//
// Composition: CUTLASS's sm90 TMA/GMMA collective for the MMA side (its shared-memory
// layouts, pipeline and mma/mma_tail); the producer is ours because a TMA box cannot stop at
// a group's end (the next group's rows would enter the reduction); tiles walk (group,
// m-block, n-block) with the n-blocks of one (group, m-block) on consecutive CTAs (they share
// A's rows in L2); store = epilogue::store_masked_rows.
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
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/epilogue/tma_store_tile.cuh"
#include "moefuse/kernel/contiguous_wgrad_producer.cuh"

namespace moefuse::kernel {

// The epilogue's shared memory, one kind per launch: TMA stores (beta == 0), or the
// masked-rows store, which reads D back for beta != 0 (the mainloop's stage count is sized around it).
union ContiguousWgradEpilogue {
  epilogue::MaskedRowsStorage masked;
  epilogue::TmaStoreStorage tma;
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
  using Producer = ContiguousWgradProducer<kTileM, kTileN, kTileK, kClusterM>;
  static constexpr int kStrip = Producer::kStrip;
  static constexpr int kProducerThreads = Producer::kThreads;
  static constexpr int kStageElementsA = Producer::kStageElementsA;
  static constexpr int kStageElementsB = Producer::kStageElementsB;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    ContiguousWgradEpilogue epilogue;
    ContiguousWgradRowRing ring;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // The producer's operands (a_chunk, b_chunk, offsets, a, b, rows, ..., m, n, interleave)
  // and the consumers'.
  struct Params : ContiguousWgradOperands {
    CUtensorMap d_tile;  // D [groups, m, n]: box 64 x 64 x 1 (the beta == 0 epilogue's stores)
    typename Mainloop::Params mainloop;  // only for mma()'s signature (it reads none of it)
    cutlass::bfloat16_t* d;
    float alpha;
    float beta;
    int tma_store;  // 1: tiles leave by TMA through d_tile (beta == 0; set by the launcher)
  };
  using Tile = typename Producer::Tile;

  enum class Role { Producer, Consumer };

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
      Producer::run(p, pipeline, write, shared.tensors.smem_A.data(), shared.tensors.smem_B.data(), shared.ring,
                    typename Producer::Walk{stride, m_units, n_blocks, rank}, first, thread_idx);
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
      for (int i = first; Producer::tile_at(p, i, m_units, n_blocks, rank, tile); i += stride) {
        const int k_tiles = tile.chunks();
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
