// Blackwell (sm_100a) persistent M-grouped bf16 GEMM over the contiguous grouped layout, the
// twin of kernel/sm90_contiguous_grouped.cuh (same contract, tile order and masked stores):
//   D[rows_e, :] = alpha * A[rows_e, :] * W_e + beta * D[rows_e, :]
// with one TMA map over A `[total_rows, K]` and one 3-D map over W `[E, N, K]` (or
// `[E, K, N]`), never rewritten on the device; or A gathered (`a_rows`: tile row r is row
// a_rows[r] / div of A, by cp.async), as the layer's dgrads read dy's token rows.
//
//   warp   role
//   0      producer (TMA): A's 128-row box at the tile's first row (past the group's rows:
//          loaded, multiplied, never stored) and W_e's tile, one elected thread
//   0-3    producers (gathered A): A's rows by kernel/row_gather.cuh, W_e by TMA (thread 0);
//          warp 1 first builds the group table
//   4      MMA (kernel/sm100_umma.cuh): 128 x 256 x 16 UMMAs into two tensor-memory
//          accumulators
//   5-8    epilogue: one tile row per thread from tensor memory, alpha/beta, stored through
//          RowAt_ (D's row, or a per-row address: the expert-parallel combine), 16-byte
//          stores; or a fused per-row epilogue (Fusion_)
//
// Single CTAs (no W_e multicast to pairs yet), no L2 prefetch of the next tile. The fused
// epilogue of the down dgrad (the routed activation backward) is
// epilogue/activation_backward_row.cuh.
// NOTES: not yet run on a B200 (none can be reached from this project's machines): built and
// SASS-checked in CI; the sm100 heuristic does not pick the `_contig` variants until the
// grouped tests have passed on one.
#pragma once

#include "cute/tensor.hpp"
#include "moefuse/epilogue/masked_rows.cuh"
#include "moefuse/kernel/row_gather.cuh"
#include "moefuse/kernel/sm100_umma.cuh"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel {

// RowAt_: where the plain store puts each row (epilogue::RowsInOrder or RowsScattered).
// Fusion_: epilogue::NoFusion (the plain store) or a per-row fused epilogue with
// `store<kTileN>(params, acc, row, col0, cols, n_block)` (epilogue::ActivationBackwardRow: the
// down dgrad's routed activation backward).
template <class Mainloop_, int kMaxGroups_, class RowAt_ = epilogue::RowsInOrder, class Fusion_ = epilogue::NoFusion>
struct Sm100ContiguousGrouped {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  static constexpr int kClusterM = 1;
  static constexpr int kMaxGroups = kMaxGroups_;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  using Scheduler = sched::ContiguousGroupScheduler<kTileM, kClusterM, kMaxGroups>;
  static_assert(cute::size(typename Mainloop::DispatchPolicy::ClusterShape{}) == 1,
                "sm100 contiguous grouped GEMM: a 1-SM collective (no pairs)");
  static_assert(kTileM == 128 && kTileK == 64 && kTileN % 32 == 0,
                "sm100 contiguous grouped GEMM: 128-row tiles (one epilogue thread per row), 64-element k-blocks");

  using Pipelines = sm100::Pipelines<kStages>;
  using StagePipeline = sm100::StagePipeline<kStages>;
  using StageState = cutlass::PipelineState<kStages>;
  using AccPipeline = sm100::AccPipeline;
  using Umma = sm100::UmmaOperands<Mainloop>;
  static constexpr uint32_t kAccColumns = Umma::kAccColumns;
  static_assert(sm100::kAccStages * kAccColumns <= 512, "sm100 contiguous grouped GEMM: accumulators over 512 columns");
  static constexpr uint32_t kTmemColumns = sm100::kAccStages * kAccColumns <= 256 ? 256 : 512;

  static constexpr int kProducerWarps = 4;
  static constexpr int kProducerThreads = kProducerWarps * 32;
  static constexpr int kMmaWarp = 4;
  static constexpr int kEpilogueThreads = 128;
  static constexpr int kThreads = kProducerThreads + 32 + kEpilogueThreads;
  static constexpr int kStageElementsA = kTileM * kTileK;
  static constexpr uint32_t kBytesB = kTileN * kTileK * sizeof(cutlass::bfloat16_t);

  // The gathered producer writes A where the UMMA layout reads it: K-major rows of 64
  // elements, one after the other, 128-byte swizzled, stages kTileM x kTileK apart.
  using SmemA = typename Mainloop::SmemLayoutA;
  static_assert(cute::is_same_v<decltype(SmemA{}.layout_a()), cute::Swizzle<3, 4, 3>>,
                "sm100 contiguous grouped GEMM: a 128-byte swizzled A stage");
  static_assert(SmemA{}.layout_b()(cute::make_coord(cute::make_coord(1, 0), 0, 0, 0)) == kTileK &&
                    SmemA{}.layout_b()(cute::make_coord(cute::make_coord(0, 1), 0, 0, 0)) == 1 &&
                    SmemA{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 1, 0)) == 16 &&
                    SmemA{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 0, 1)) == kStageElementsA,
                "sm100 contiguous grouped GEMM: A stage is not K-major rows of 64 elements");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename StagePipeline::SharedStorage stages;
    alignas(16) typename AccPipeline::SharedStorage accumulators;
    alignas(16) typename Scheduler::Table groups;
    uint32_t tmem_base;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // The Hopper kernel's fields (common/contiguous_params.hpp fills them) with this
  // collective's maps.
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
    int band;
    int n_fast;
    int interleave;
    int prefetch;  // unused here (no L2 prefetch yet)
    const int32_t* a_rows;
    const cutlass::bfloat16_t* a;
    int a_rows_div;
    int a_source_rows;
    RowAt_ row_at;
    typename Fusion_::Params fusion;  // the fused epilogue's operands (empty for NoFusion)
  };

  // ---- producers ---------------------------------------------------------------------------

  // W_e's tile (and, with `tma_a`, A's box) of one tile as TMA partitions: (TMA, k) views.
  template <class TensorA, class TensorB, class SmemA_, class SmemB_>
  CUTE_DEVICE static auto tile_partitions(Params const& p, TensorA const& mA, TensorB const& mB, SmemA_ const& sA,
                                          SmemB_ const& sB, sched::GroupTile const& tile) {
    using namespace cute;
    using X = Underscore;
    Tensor gA = local_tile(domain_offset(make_coord(tile.row0, 0, 0), mA), TileShape{}, make_coord(_, _, _),
                           Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB = local_tile(domain_offset(make_coord(0, 0, tile.group), mB), TileShape{}, make_coord(_, _, _),
                           Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
    ThrMMA cta_mma = TiledMma{}.get_slice(0);
    Tensor tCgA = cta_mma.partition_A(gA);  // (MMA,MMA_M,MMA_K,m,k,l)
    Tensor tCgB = cta_mma.partition_B(gB);  // (MMA,MMA_N,MMA_K,n,k,l)
    auto [tAgA, tAsA] = tma_partition(p.mainloop.tma_load_a, Int<0>{}, Layout<_1>{}, group_modes<0, 3>(sA),
                                      group_modes<0, 3>(tCgA));
    auto [tBgB, tBsB] = tma_partition(p.mainloop.tma_load_b, Int<0>{}, Layout<_1>{}, group_modes<0, 3>(sB),
                                      group_modes<0, 3>(tCgB));
    return make_tuple(tAgA(_, 0, _, 0), tAsA, tBgB(_, tile.n_block, _, 0), tBsB);  // (TMA,k), (TMA,PIPE)
  }

  // One thread (TMA) or 128 (gathered A): every k-block of one tile into the stages.
  template <class TensorA, class TensorB, class SmemA_, class SmemB_>
  CUTE_DEVICE static void load_tile(Params const& p, StagePipeline& stages, StageState& write, TensorA const& mA,
                                    TensorB const& mB, SmemA_ const& sA, SmemB_ const& sB, SharedStorage& shared,
                                    sched::GroupTile const& tile, int k_tiles, int t) {
    using namespace cute;
    auto [tAgA, tAsA, tBgB, tBsB] = tile_partitions(p, mA, mB, sA, sB, tile);
    if (p.a_rows == nullptr) {
      for (int kb = 0; kb < k_tiles; ++kb) {
        stages.producer_acquire(write);  // the leader expects A's and W_e's bytes
        auto* barrier = stages.producer_get_barrier(write);
        const int s = int(write.index());
        copy(p.mainloop.tma_load_a.with(*barrier, uint16_t(0)), tAgA(_, kb), tAsA(_, s));
        copy(p.mainloop.tma_load_b.with(*barrier, uint16_t(0)), tBgB(_, kb), tBsB(_, s));
        ++write;
      }
      return;
    }
    // Gathered: tile row t is row a_rows[row0 + t] / div of A (past the tile's rows and for
    // a bad index: no row, zero-filled).
    const int index = t < tile.rows ? __ldg(p.a_rows + tile.row0 + t) : -1;
    const int row = index < 0 ? -1 : index / p.a_rows_div;
    const GatheredRows rows(row < p.a_source_rows ? row : -1, uint32_t(p.k / 8));
    const auto* a = reinterpret_cast<const GatheredRows::Chunk*>(p.a);
    auto* smem_a = reinterpret_cast<GatheredRows::Chunk*>(shared.tensors.smem_A.begin());
    for (int kb = 0; kb < k_tiles; ++kb) {
      stages.producer_acquire(write);  // every producer waits; thread 0 expects W_e's bytes
      auto* barrier = stages.producer_get_barrier(write);
      const int s = int(write.index());
      if (t == 0) copy(p.mainloop.tma_load_b.with(*barrier, uint16_t(0)), tBgB(_, kb), tBsB(_, s));
      rows.copy(a, smem_a + s * kStageElementsA / 8, kb, p.k, t);
      cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(barrier));
      ++write;
    }
  }

  // ---- epilogue ----------------------------------------------------------------------------

  // This thread's tile row: D[row, col0 + c] = alpha * acc + beta * D (two roundings, as the
  // Hopper store), for c < cols.
  CUTE_DEVICE static void store_row(Params const& p, uint32_t acc, int row, int col0, int cols) {
    cutlass::bfloat16_t* dst = row >= 0 ? p.row_at(p.d, int64_t(p.n), row) + col0 : nullptr;
    sm100::store_acc_row<kTileN>(acc, dst, cols, p.alpha, p.beta);
  }

  // ---- the kernel --------------------------------------------------------------------------

  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM100_ALL)
    using namespace cute;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const bool gathered = p.a_rows != nullptr;
    const bool producer = warp_idx < kProducerWarps;
    const bool mma = warp_idx == kMmaWarp;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(p.mainloop.tma_load_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.mainloop.tma_load_b.get_tma_descriptor());
    }
    if (warp_idx == 1) Scheduler::build(shared.groups, p.offsets, p.groups, p.total_rows);
    // TMA A: one leader arrival with A's and W_e's bytes; gathered: 129 arrivals, W_e's bytes.
    Pipelines pipes(shared.stages, shared.accumulators, producer, mma,
                    gathered ? 1 + kProducerThreads : 1,
                    gathered ? kBytesB : uint32_t(Mainloop::TmaTransactionBytes), kEpilogueThreads);
    StagePipeline& stages = pipes.stages;
    AccPipeline& accumulators = pipes.accumulators;

    sm100::TensorMemory<kTmemColumns> tmem;
    if (mma) tmem.allocate(&shared.tmem_base);
    __syncthreads();  // barriers, the group table and the tensor-memory base visible to every role
    const uint32_t tmem_base = shared.tmem_base;

    const int n_blocks = (p.n + kTileN - 1) / kTileN;
    const int k_tiles = (p.k + kTileK - 1) / kTileK;
    Scheduler scheduler(shared.groups, n_blocks, p.band, p.n_fast != 0, p.interleave != 0, int(blockIdx.x),
                        int(gridDim.x), 0);
    sched::GroupTile tile;

    if (producer) {
      if (!gathered && warp_idx != 0) return;
      if (gathered || thread_idx == 0) {  // thread 0: the pipeline's leader
        Tensor mA = p.mainloop.tma_load_a.get_tma_tensor(make_shape(p.total_rows, p.k, 1));  // (ROWS,K,1)
        Tensor mB = p.mainloop.tma_load_b.get_tma_tensor(make_shape(p.n, p.k, p.groups));    // (N,K,E)
        Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.begin()), typename Mainloop::SmemLayoutA{});
        Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.begin()), typename Mainloop::SmemLayoutB{});
        StageState write = cutlass::make_producer_start_state<StagePipeline>();
        while (scheduler.next(tile)) load_tile(p, stages, write, mA, mB, sA, sB, shared, tile, k_tiles, thread_idx);
        // No exit with copies in flight: wait until the MMAs have freed every stage.
        if (thread_idx == 0) stages.producer_tail(write);
      }
      __syncwarp();
    } else if (mma) {
      sm100::mma_warp<Mainloop>(scheduler, shared, stages, accumulators, tmem, tmem_base, k_tiles);
    } else {
      const int r = (warp_idx % 4) * 32 + thread_idx % 32;  // this thread's tile row (its lane)
      sm100::epilogue_warps<kAccColumns>(
          scheduler, accumulators, tmem_base, warp_idx, [&](uint32_t acc, sched::GroupTile const& t) {
            const int col0 = t.n_block * kTileN, cols = min(kTileN, p.n - col0);
            const int row = r < t.rows ? t.row0 + r : -1;
            if constexpr (Fusion_::kFused) {
              Fusion_::template store<kTileN>(p.fusion, acc, row, col0, cols, t.n_block);
            } else {
              store_row(p, acc, row, col0, cols);
            }
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
    sm100_contiguous_grouped_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
