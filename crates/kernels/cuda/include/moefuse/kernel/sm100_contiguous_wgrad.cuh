// Blackwell (sm_100a) persistent K-grouped bf16 GEMM over the contiguous grouped layout (the
// weight gradient of an M-grouped layer), the twin of kernel/sm90_contiguous_wgrad.cuh (same
// contract, producer, tile walk and stores):
//   D_e = alpha * A[rows_e, :]^T · B[rows_e, :] + beta * D_e      (D_e = d + e*m*n, [m, n])
// with A [total_rows, m] and B [total_rows, n] row-major: both operands are MN-major for the
// UMMAs and the reduction runs over the group's rows.
//
//   warp   role
//   0-3    producers (kernel/contiguous_wgrad_producer.cuh, the Hopper kernel's): per 64-row
//          chunk of the group, A and B as 64-wide strips by TMA; a group's last, partial
//          chunk, and gathered rows (a_rows or b_rows), by 16-byte cp.async
//   4      MMA (kernel/sm100_umma.cuh): 128 x 256 x 16 UMMAs over the tile's chunks into one
//          of two tensor-memory accumulators; a tile of an empty group runs none
//   5-8    epilogue: one row of D_e's tile per thread from tensor memory, alpha/beta, 16-byte
//          stores (rows past m and columns past n masked); an empty group's tile stores zeros
//          (beta == 0) or nothing (beta != 0: D_e untouched, abi.h)
//
// Single CTAs (no B multicast to pairs yet: the Hopper kernel's kClusterM = 2 needs the
// pair's UMMA side too).
// NOTES: not yet run on a B200 (none can be reached from this project's machines): built and
// SASS-checked in CI; the sm100 heuristic does not pick the `_contig` variants until the
// grouped tests have passed on one.
#pragma once

#include "cute/tensor.hpp"
#include "moefuse/kernel/contiguous_wgrad_producer.cuh"
#include "moefuse/kernel/sm100_umma.cuh"

namespace moefuse::kernel {

template <class Mainloop_>
struct Sm100ContiguousWgrad {
  using Mainloop = Mainloop_;
  using TileShape = typename Mainloop::TileShape;
  using TiledMma = typename Mainloop::TiledMma;
  static constexpr int kClusterM = 1;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  static_assert(cute::size(typename Mainloop::DispatchPolicy::ClusterShape{}) == 1,
                "sm100 contiguous wgrad: a 1-SM collective (no pairs)");
  static_assert(kTileM == 128 && kTileK == 64 && kTileN % 64 == 0 && kTileN <= 256,
                "sm100 contiguous wgrad: 128-row tiles (one epilogue thread per row), 64-row chunks");

  using Producer = ContiguousWgradProducer<kTileM, kTileN, kTileK, kClusterM>;
  using Tile = typename Producer::Tile;
  using Pipelines = sm100::Pipelines<kStages>;
  using StagePipeline = sm100::StagePipeline<kStages>;
  using AccPipeline = sm100::AccPipeline;
  using Umma = sm100::UmmaOperands<Mainloop>;
  static constexpr uint32_t kAccColumns = Umma::kAccColumns;
  static_assert(sm100::kAccStages * kAccColumns <= 512, "sm100 contiguous wgrad: accumulators over 512 columns");
  static constexpr uint32_t kTmemColumns = sm100::kAccStages * kAccColumns <= 256 ? 256 : 512;

  static constexpr int kProducerWarps = 4;
  static constexpr int kProducerThreads = Producer::kThreads;
  static_assert(kProducerThreads == kProducerWarps * 32, "four producer warps");
  static constexpr int kMmaWarp = 4;
  static constexpr int kEpilogueThreads = 128;
  static constexpr int kThreads = kProducerThreads + 32 + kEpilogueThreads;

  // The producer writes where the UMMA layouts read: 64-wide MN strips of 64 x 128-byte rows
  // (one row per reduction index), 128-byte swizzled, strips one after the other, stages
  // kTile x kTileK apart. The collective's layouts are ((MMA atom: (64, strips), 16 k), 1,
  // k-blocks of 16, (1, stages)).
  template <class Smem, int kTile>
  static constexpr bool kStripsLayout =
      cute::is_same_v<decltype(Smem{}.layout_a()), cute::Swizzle<3, 4, 3>> &&
      Smem{}.layout_b()(cute::make_coord(cute::make_coord(cute::make_coord(1, 0), 0), 0, 0, cute::make_coord(0, 0))) == 1 &&
      Smem{}.layout_b()(cute::make_coord(cute::make_coord(cute::make_coord(0, 1), 0), 0, 0, cute::make_coord(0, 0))) ==
          Producer::kStrip &&
      Smem{}.layout_b()(cute::make_coord(cute::make_coord(cute::make_coord(0, 0), 1), 0, 0, cute::make_coord(0, 0))) == 64 &&
      Smem{}.layout_b()(cute::make_coord(cute::make_coord(cute::make_coord(0, 0), 0), 0, 1, cute::make_coord(0, 0))) ==
          16 * 64 &&
      Smem{}.layout_b()(cute::make_coord(cute::make_coord(cute::make_coord(0, 0), 0), 0, 0, cute::make_coord(0, 1))) ==
          kTile * kTileK;
  static_assert(kStripsLayout<typename Mainloop::SmemLayoutA, kTileM>,
                "sm100 contiguous wgrad: A stage is not 64-wide strips of 128-byte rows");
  static_assert(kStripsLayout<typename Mainloop::SmemLayoutB, kTileN>,
                "sm100 contiguous wgrad: B stage is not 64-wide strips of 128-byte rows");

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename StagePipeline::SharedStorage stages;
    alignas(16) typename AccPipeline::SharedStorage accumulators;
    ContiguousWgradRowRing ring;
    uint32_t tmem_base;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));

  // The producer's operands (a_chunk, b_chunk, offsets, a, b, rows, ..., m, n, interleave)
  // and the store's.
  struct Params : ContiguousWgradOperands {
    cutlass::bfloat16_t* d;
    float alpha;
    float beta;
  };

  // This thread's row `r` of tile `t` from accumulator `acc` (every lane calls it: the
  // tensor-memory loads are warp-collective).
  CUTE_DEVICE static void store_tile_row(Params const& p, uint32_t acc, Tile const& t, int r) {
    const int m0 = t.m_block * kTileM, n0 = t.n_block * kTileN;
    const int row = m0 + r, cols = min(kTileN, p.n - n0);
    cutlass::bfloat16_t* dst =
        row < p.m ? p.d + (int64_t(t.group) * p.m + row) * int64_t(p.n) + n0 : static_cast<cutlass::bfloat16_t*>(nullptr);
    if (t.chunks() > 0) {
      sm100::store_acc_row<kTileN>(acc, dst, cols, p.alpha, p.beta);
      return;
    }
    // An empty group: nothing was accumulated; D_e = 0 (beta == 0) or untouched.
    if (dst == nullptr || p.beta != 0.f) return;
    const float zeros[sm100::kColsPerLoad] = {};
    CUTE_UNROLL
    for (int c0 = 0; c0 < kTileN; c0 += sm100::kColsPerLoad) {
      if (c0 < cols) sm100::store_row(dst + c0, zeros, cols - c0);
    }
  }

  CUTE_DEVICE void operator()(Params const& p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM100_ALL)
    using namespace cute;
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem);
    const int thread_idx = int(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const bool producer = warp_idx < kProducerWarps;
    const bool mma = warp_idx == kMmaWarp;

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(&p.a_chunk);
      cute::prefetch_tma_descriptor(&p.b_chunk);
    }
    // 129 producer arrivals per stage: thread 0's in producer_acquire (no bytes: it expects a
    // TMA chunk's itself), then one per producer thread.
    Pipelines pipes(shared.stages, shared.accumulators, producer, mma, 1 + kProducerThreads, 0, kEpilogueThreads);
    StagePipeline& stages = pipes.stages;
    AccPipeline& accumulators = pipes.accumulators;

    sm100::TensorMemory<kTmemColumns> tmem;
    if (mma) tmem.allocate(&shared.tmem_base);
    __syncthreads();  // barriers and the tensor-memory base visible to every role
    const uint32_t tmem_base = shared.tmem_base;

    const int m_blocks = (p.m + kTileM - 1) / kTileM;
    const int n_blocks = (p.n + kTileN - 1) / kTileN;
    const int first = int(blockIdx.x), stride = int(gridDim.x);
    typename Producer::Tiles tiles{first, stride, m_blocks, n_blocks, 0, &p};

    if (producer) {
      auto write = cutlass::make_producer_start_state<StagePipeline>();
      Producer::run(p, stages, write, shared.tensors.smem_A.begin(), shared.tensors.smem_B.begin(), shared.ring,
                    typename Producer::Walk{stride, m_blocks, n_blocks, 0}, first, thread_idx);
      // No exit with copies in flight: wait until the MMAs have freed every stage.
      if (thread_idx == 0) stages.producer_tail(write);
      __syncwarp();
    } else if (mma) {
      sm100::mma_warp_tiles<Mainloop, kTmemColumns, Tile>(tiles, shared, stages, accumulators, tmem, tmem_base,
                                                          [](Tile const& t) { return t.chunks(); });
    } else {
      const int r = (warp_idx % 4) * 32 + thread_idx % 32;  // this thread's tile row (its lane)
      sm100::epilogue_warps<kAccColumns, Tile>(tiles, accumulators, tmem_base, warp_idx,
                                               [&](uint32_t acc, Tile const& t) { store_tile_row(p, acc, t, r); });
    }
#else
    // Built for another arch: the launcher's capability check keeps this from running.
    __trap();
#endif
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    sm100_contiguous_wgrad_kernel(const __grid_constant__ typename Kernel::Params params) {
  extern __shared__ char smem[];
  Kernel{}(params, smem);
}

}  // namespace moefuse::kernel
