// Blackwell (sm_100a) fused gate_up of the MoE layer: the contract of the Hopper kernel
// (kernel/sm90_gate_up_fused.cuh: rows of x gathered by `source_of`, or taken in order in
// the contiguous mode, or read from the ranks' x in place with kPeerRows; the activation
// applied to the fp32 accumulators; h and, when training, h_pre stored for the group's rows
// only) on UMMA (tcgen05) with the accumulators in tensor memory:
//
//   warp   role
//   0-3    producers (kernel/gate_up_gather.cuh, the Hopper kernel's own): tile row t of x
//          by 16-byte cp.async per thread, W_e's two 128-row boxes by TMA (thread 0);
//          warp 1 first builds the group table
//   4      MMA: allocates the tensor memory (two accumulator stages of 128 lanes x 256 fp32
//          columns: all 512 columns, one CTA per SM), issues the 128 x 256 x 16 UMMAs of a
//          k-block from shared memory (one elected thread), frees each stage with a commit
//          on its empty barrier and hands a finished accumulator to the epilogue with a
//          commit on the accumulator's full barrier
//   5-8    epilogue: warp w reads tensor-memory lanes 32 (w % 4) .. 32 (w % 4) + 31 (the
//          32 tile rows it may access), one row per thread, 32 columns per load; applies the
//          activation and stores h (and h_pre) from registers, 16 bytes per store
//
// Two accumulator stages let the epilogue of tile i run while the MMAs of tile i + 1 do.
// Single CTAs only (no W_e multicast to pairs yet: the 2-SM UMMA is the next step).
//
// Composition: CUTLASS's sm100 UMMA collective gives the shared-memory layouts (asserted
// to be the producer's), the tiled MMA and the stage count; the pipelines are CUTLASS's
// (the Hopper TMA pipeline for the stages, whose full barrier counts the producer's 129
// arrivals; the UMMA pipeline for the accumulators); the MMA loop, the tensor-memory
// epilogue and the tile order (sched::ContiguousGroupScheduler) are ours.
// NOTES: not yet run on a B200 (none can be reached from this project's machines); it is
// built and its SASS checked in CI, and the layer's Auto policy does not pick it until the
// fused_gpu / layer_gpu tests have passed on one (`set_gate_up_path` can).
#pragma once

#include <cuda.h>

#include "cute/tensor.hpp"
#include "moefuse/kernel/gate_up_gather.cuh"
#include "moefuse/kernel/sm100_umma.cuh"
#include "moefuse/moe/activation_math.cuh"
#include "moefuse/moe_abi.h"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel {

template <class Mainloop_, int kMaxGroups_, bool kPeerRows_ = false>
struct Sm100GateUpFused {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  using SmemLayoutA = typename Mainloop::SmemLayoutA;
  using SmemLayoutB = typename Mainloop::SmemLayoutB;
  static constexpr int kMaxGroups = kMaxGroups_;
  static constexpr int kClusterM = 1;
  static constexpr bool kPeerRows = kPeerRows_;
  static constexpr int kMaxPeers = MOEFUSE_GATE_UP_MAX_PEERS;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  using Gather = GateUpGather<kTileM, kTileN, kTileK, kClusterM, kPeerRows, kMaxPeers>;
  using Scheduler = sched::ContiguousGroupScheduler<kTileM, kClusterM, kMaxGroups>;
  static_assert(cute::size(typename Mainloop::DispatchPolicy::ClusterShape{}) == 1,
                "sm100 fused gate_up: a 1-SM collective (no pairs)");

  // Stages: 129 producer arrivals (Gather), freed by one UMMA commit; two accumulators
  // (kernel/sm100_umma.cuh).
  using Pipelines = sm100::Pipelines<kStages>;
  using StagePipeline = sm100::StagePipeline<kStages>;
  using StageState = cutlass::PipelineState<kStages>;
  using AccPipeline = sm100::AccPipeline;
  using Umma = sm100::UmmaOperands<Mainloop>;
  static constexpr uint32_t kAccColumns = Umma::kAccColumns;
  static_assert(sm100::kAccStages * kAccColumns == 512, "sm100 fused gate_up: two accumulators fill the tensor memory");

  static constexpr int kProducerWarps = 4;
  static constexpr int kMmaWarp = 4;
  static constexpr int kEpilogueWarps = 4;
  static constexpr int kEpilogueThreads = kEpilogueWarps * 32;
  static constexpr int kThreads = (kProducerWarps + 1 + kEpilogueWarps) * 32;
  static constexpr int kColsPerLoad = sm100::kColsPerLoad;

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename StagePipeline::SharedStorage stages;
    alignas(16) typename AccPipeline::SharedStorage accumulators;
    alignas(16) typename Scheduler::Table groups;
    uint32_t tmem_base;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // kernel/gate_up_gather.cuh's (this kernel builds its MMA operands from the shared-memory
  // layouts alone, so it needs no collective parameters).
  using Params = GateUpParams;

  CUTE_HOST_DEVICE static int h_cols_per_tile(int act) { return Gather::h_cols_per_tile(act); }

  // ---- epilogue ---------------------------------------------------------------------------

  // One tile row (this thread's) of one accumulator: h, and h_pre when training. `acc` is
  // the tensor-memory address of the accumulator at this warp's lane base; `row` is the
  // global row or -1 past the group (the loads are warp-collective, the stores masked).
  template <int Act, bool kSplit>
  CUTE_DEVICE static void store_tile_row(Params const& p, uint32_t acc, int64_t row, int n_block) {
    constexpr bool kRelu2 = Act == MOEFUSE_ACTIVATION_RELU2;
    constexpr int kHCols = kRelu2 ? kTileN : kTileN / 2;
    const bool live = row >= 0;
    const int hcol0 = n_block * kHCols;
    cutlass::bfloat16_t* h = p.h + (live ? row : 0) * p.inter;
    cutlass::bfloat16_t* h_pre = p.h_pre == nullptr ? nullptr : p.h_pre + (live ? row : 0) * p.width;
    if constexpr (kSplit) {
      // Columns c and 128 + c: gate and up of h column hcol0 + c.
      CUTE_UNROLL
      for (int c0 = 0; c0 < kTileN / 2; c0 += kColsPerLoad) {
        float g[kColsPerLoad], u[kColsPerLoad], out[kColsPerLoad];
        sm100::tmem_load(acc + c0, g);
        sm100::tmem_load(acc + kTileN / 2 + c0, u);
        if (live) {
          const int cols = p.inter - (hcol0 + c0);
          if (h_pre != nullptr) {
            sm100::store_row(h_pre + hcol0 + c0, g, cols);
            sm100::store_row(h_pre + p.inter + hcol0 + c0, u, cols);
          }
          CUTE_UNROLL
          for (int i = 0; i < kColsPerLoad; ++i) out[i] = moe::eval_as<Act>(p.alpha, p.limit, g[i], u[i]).h;
          sm100::store_row(h + hcol0 + c0, out, cols);
        }
      }
    } else {
      // Interleaved (columns 2m, 2m + 1: gate and up of h column hcol0 + m) or RELU2
      // (column c: h column hcol0 + c); h_pre in the weights' own column order.
      constexpr int kOut = kRelu2 ? kColsPerLoad : kColsPerLoad / 2;
      CUTE_UNROLL
      for (int c0 = 0; c0 < kTileN; c0 += kColsPerLoad) {
        float a[kColsPerLoad], out[kOut];
        sm100::tmem_load(acc + c0, a);
        if (live) {
          if (h_pre != nullptr) sm100::store_row(h_pre + n_block * kTileN + c0, a, p.width - (n_block * kTileN + c0));
          CUTE_UNROLL
          for (int i = 0; i < kOut; ++i) {
            out[i] = kRelu2 ? moe::eval_as<Act>(p.alpha, p.limit, a[i], 0.f).h
                            : moe::eval_as<Act>(p.alpha, p.limit, a[2 * i], a[2 * i + 1]).h;
          }
          const int h0 = hcol0 + (kRelu2 ? c0 : c0 / 2);
          sm100::store_row(h + h0, out, p.inter - h0);
        }
      }
    }
  }

  CUTE_DEVICE static void store_tile(Params const& p, uint32_t acc, int64_t row, int n_block) {
    const bool split = p.act != MOEFUSE_ACTIVATION_RELU2 && p.layout == MOEFUSE_GATE_UP_SPLIT;
    // One straight-line body per (activation, layout), chosen once per tile.
    moe::with_activation(p.act, [&](auto a) {
      constexpr int kAct = decltype(a)::value;
      if constexpr (kAct == MOEFUSE_ACTIVATION_RELU2) {
        store_tile_row<kAct, false>(p, acc, row, n_block);
      } else if (split) {
        store_tile_row<kAct, true>(p, acc, row, n_block);
      } else {
        store_tile_row<kAct, false>(p, acc, row, n_block);
      }
    });
  }

  // ---- the kernel -------------------------------------------------------------------------

  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM100_ALL)
    using namespace cute;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const bool producer = warp_idx < kProducerWarps;
    const bool mma = warp_idx == kMmaWarp;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(&p.tmap_w);
      if (p.source_of == nullptr) cute::prefetch_tma_descriptor(&p.tmap_rows);
    }
    if (warp_idx == 1) Scheduler::build(shared.groups, p.offsets, p.groups, p.max_rows);

    Pipelines pipes(shared.stages, shared.accumulators, producer, mma, 1 + Gather::kProducerThreads, 0,
                    kEpilogueThreads);
    StagePipeline& stages = pipes.stages;
    AccPipeline& accumulators = pipes.accumulators;

    sm100::TensorMemory<sm100::kAccStages * kAccColumns> tmem;
    if (mma) tmem.allocate(&shared.tmem_base);
    __syncthreads();  // barriers, the group table and the tensor-memory base visible to every role
    const uint32_t tmem_base = shared.tmem_base;

    const int n_blocks = (p.inter + h_cols_per_tile(p.act) - 1) / h_cols_per_tile(p.act);
    const int k_tiles = (p.hidden + kTileK - 1) / kTileK;
    const int total_rows = p.groups > 0 ? shared.groups.row_end[p.groups - 1] : 0;
    Scheduler scheduler(shared.groups, n_blocks, p.band, p.n_fast != 0, p.interleave != 0, int(blockIdx.x),
                        int(gridDim.x), 0);
    sched::GroupTile tile;

    if (producer) {
      StageState write = cutlass::make_producer_start_state<StagePipeline>();
      auto* smem_a = reinterpret_cast<cutlass::bfloat16_t*>(shared.tensors.smem_A.begin());
      auto* smem_b = reinterpret_cast<cutlass::bfloat16_t*>(shared.tensors.smem_B.begin());
      while (scheduler.next(tile)) {
        Gather::load_tile(p, stages, write, smem_a, smem_b, tile, total_rows, k_tiles, thread_idx, 0);
      }
      // No exit with copies in flight: wait until the MMAs have freed every stage.
      if (warp_idx == 0 && cute::elect_one_sync()) stages.producer_tail(write);
      __syncwarp();
    } else if (mma) {
      sm100::mma_warp<Mainloop>(scheduler, shared, stages, accumulators, tmem, tmem_base, k_tiles);
    } else {
      const int r = (warp_idx % 4) * 32 + thread_idx % 32;  // this thread's tile row (its lane)
      sm100::epilogue_warps<kAccColumns>(scheduler, accumulators, tmem_base, warp_idx,
                                         [&](uint32_t acc, sched::GroupTile const& t) {
                                           const int64_t row = r < t.rows ? int64_t(t.row0) + r : -1;
                                           store_tile(p, acc, row, t.n_block);
                                         });
    }
#else
    // Built for another arch: the launcher's capability check keeps this from running.
    __trap();
#endif
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    sm100_gate_up_fused_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
