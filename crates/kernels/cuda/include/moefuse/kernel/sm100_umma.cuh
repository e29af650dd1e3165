// The UMMA side shared by moefuse's Blackwell (sm_100a) kernels (kernel/sm100_gate_up_fused.cuh,
// kernel/sm100_contiguous_grouped.cuh, kernel/sm100_contiguous_wgrad.cuh): the MMA warp's loop
// over one tile's k-blocks, the two tensor-memory accumulators, and the epilogue warps' row
// loads and stores.
//
//   - Stages: CUTLASS's Hopper TMA pipeline (`PipelineTmaAsync`), whose full barrier counts
//     whatever the producers arrive with (one TMA leader, or 129 with a cp.async gather) and
//     whose empty barrier counts one arrival: the MMA warp's `tcgen05.commit` once the
//     stage's UMMAs have read it.
//   - Accumulators: two stages of 128 lanes x kTileN fp32 columns (all 512 columns for
//     N = 256), CUTLASS's UMMA pipeline between the MMA warp (commit) and the 128 epilogue
//     threads (one arrival each).
//   - Epilogue: warp w may read lanes 32 (w % 4) .. 32 (w % 4) + 31; tile row m sits in lane
//     m and column n in column n (asserted by `accumulators`).
#pragma once

#include <utility>

#include "cute/arch/copy_sm100.hpp"
#include "cute/arch/tmem_allocator_sm100.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/pipeline.hpp"
#include "moefuse/sched/grouped_contiguous.cuh"

namespace moefuse::kernel::sm100 {

constexpr int kAccStages = 2;
constexpr int kColsPerLoad = 32;

template <int kStages>
using StagePipeline = cutlass::PipelineTmaAsync<kStages>;
using AccPipeline = cutlass::PipelineUmmaAsync<kAccStages>;

// Columns [taddr, taddr + 32) of this warp's 32 lanes (lane base in bits 16..31) as fp32, one
// row per thread. Warp-collective (.sync.aligned): call it converged.
template <size_t... I>
CUTE_DEVICE void tmem_load(uint32_t taddr, float (&v)[kColsPerLoad], std::index_sequence<I...>) {
  uint32_t r[kColsPerLoad];
  cute::SM100_TMEM_LOAD_32dp32b32x::copy(taddr, r[I]...);
  cutlass::arch::fence_view_async_tmem_load();
  ((v[I] = __uint_as_float(r[I])), ...);
}
CUTE_DEVICE void tmem_load(uint32_t taddr, float (&v)[kColsPerLoad]) {
  __syncwarp();
  tmem_load(taddr, v, std::make_index_sequence<kColsPerLoad>{});
}

// tcgen05 ordering around the thread syncs between tensor-memory writers and readers.
CUTE_DEVICE void tmem_fence_before_sync() { asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory"); }
CUTE_DEVICE void tmem_fence_after_sync() { asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory"); }

// The MMA warp's operands: shared-memory descriptors of every stage and the two tensor-memory
// accumulators at `tmem_base`.
template <class Mainloop>
struct UmmaOperands {
  using TiledMma = typename Mainloop::TiledMma;
  using TileShape = typename Mainloop::TileShape;
  static constexpr uint32_t kAccColumns = cute::size<1>(TileShape{});

  template <class TensorStorage>
  CUTE_DEVICE static auto make(TensorStorage& tensors, uint32_t tmem_base) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(tensors.smem_A.begin()), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(tensors.smem_B.begin()), typename Mainloop::SmemLayoutB{});
    Tensor acc = TiledMma::make_fragment_C(
        append(partition_shape_C(TiledMma{}, take<0, 2>(TileShape{})), Int<kAccStages>{}));  // (MMA,MMA_M,MMA_N,ACC)
    acc.data() = tmem_base;
    using AccLayout = decltype(acc.layout());
    static_assert(decltype(cute::stride<3>(AccLayout{}))::value == kAccColumns &&
                      AccLayout{}(make_coord(make_coord(1, 0), 0, 0, 0)) == (1 << 16) &&
                      AccLayout{}(make_coord(make_coord(0, 1), 0, 0, 0)) == 1,
                  "sm100 UMMA: the accumulator is not row m at lane m, column n at column n, stages "
                  "kAccColumns columns apart");
    return make_tuple(TiledMma::make_fragment_A(sA), TiledMma::make_fragment_B(sB), acc);
  }
};

// One tile on the MMA warp (all 32 lanes; one elected lane issues): waits for the epilogue to
// free accumulator `fill`, runs `k_tiles` k-blocks of UMMAs from the stages (each freed by a
// commit on its empty barrier once read), then commits the accumulator to the epilogue.
template <class TiledMma, class FragA, class FragB, class Acc, class Stages, class StageState>
CUTE_DEVICE void mma_tile(TiledMma& tiled_mma, FragA const& tCrA, FragB const& tCrB, Acc const& acc, Stages& stages,
                          StageState& read, uint64_t* empty_barriers, AccPipeline& accumulators,
                          typename AccPipeline::PipelineState& fill, int k_tiles) {
  using namespace cute;
  accumulators.producer_acquire(fill);
  tmem_fence_after_sync();
  auto acc_stage = acc(_, _, _, fill.index());
  tiled_mma.accumulate_ = UMMA::ScaleOut::Zero;
  for (int kb = 0; kb < k_tiles; ++kb) {
    stages.consumer_wait(read);
    // Rows gathered by cp.async come through the generic proxy; the UMMA reads through the
    // async one.
    cutlass::arch::fence_view_async_shared();
    const int s = int(read.index());
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      cute::gemm(tiled_mma, tCrA(_, _, k, s), tCrB(_, _, k, s), acc_stage);
      tiled_mma.accumulate_ = UMMA::ScaleOut::One;
    }
    cutlass::arch::umma_arrive(empty_barriers + s);
    ++read;
  }
  accumulators.producer_commit(fill);  // full once every UMMA of the tile is done
  ++fill;
}

// The tensor memory of a CTA's accumulators (`kColumns`: a power of two, 32..512): allocated
// by the MMA warp before the block barrier that publishes its base, freed by it once every
// accumulator has been read.
template <uint32_t kColumns>
struct TensorMemory {
  cute::TMEM::Allocator1Sm alloc;
  CUTE_DEVICE void allocate(uint32_t* base_slot) {
    alloc.allocate(kColumns, base_slot);
    alloc.release_allocation_lock();
  }
  CUTE_DEVICE void free(uint32_t base) { alloc.free(base, kColumns); }
};

// The MMA warp's whole run: every tile `scheduler` walks (`Tile`s, mma_tile over
// `k_tiles_of(tile)` k-blocks), then the wait for the epilogue's last reads, then the free.
template <class Mainloop, uint32_t kColumns, class Tile, class Scheduler, class SharedStorage, class Stages,
          class KTiles>
CUTE_DEVICE void mma_warp_tiles(Scheduler& scheduler, SharedStorage& shared, Stages& stages, AccPipeline& accumulators,
                                TensorMemory<kColumns>& tmem, uint32_t tmem_base, KTiles&& k_tiles_of) {
  typename Mainloop::TiledMma tiled_mma;
  auto [tCrA, tCrB, acc] = UmmaOperands<Mainloop>::make(shared.tensors, tmem_base);
  auto* empty = reinterpret_cast<uint64_t*>(&shared.stages.empty_barrier_[0]);
  typename Stages::PipelineState read;
  auto fill = cutlass::make_producer_start_state<AccPipeline>();
  Tile tile;
  while (scheduler.next(tile)) {
    mma_tile(tiled_mma, tCrA, tCrB, acc, stages, read, empty, accumulators, fill, k_tiles_of(tile));
  }
  accumulators.producer_tail(fill);  // every accumulator read before the memory is freed
  tmem.free(tmem_base);
}

// mma_warp_tiles over the M-grouped scheduler's tiles, `k_tiles` k-blocks each.
template <class Mainloop, uint32_t kColumns, class Scheduler, class SharedStorage, class Stages>
CUTE_DEVICE void mma_warp(Scheduler& scheduler, SharedStorage& shared, Stages& stages, AccPipeline& accumulators,
                          TensorMemory<kColumns>& tmem, uint32_t tmem_base, int k_tiles) {
  mma_warp_tiles<Mainloop, kColumns, sched::GroupTile>(scheduler, shared, stages, accumulators, tmem, tmem_base,
                                                       [k_tiles](sched::GroupTile const&) { return k_tiles; });
}

// The epilogue warps' run: per tile, wait for its accumulator, `store(address of this warp's
// lanes at column 0, tile)`, release it to the MMA warp.
template <uint32_t kAccColumns, class Tile = sched::GroupTile, class Scheduler, class Store>
CUTE_DEVICE void epilogue_warps(Scheduler& scheduler, AccPipeline& accumulators, uint32_t tmem_base, int warp_idx,
                                Store&& store) {
  typename AccPipeline::PipelineState drain;
  Tile tile;
  while (scheduler.next(tile)) {
    accumulators.consumer_wait(drain);
    tmem_fence_after_sync();
    store(tmem_base + (uint32_t((warp_idx % 4) * 32) << 16) + uint32_t(drain.index()) * kAccColumns, tile);
    tmem_fence_before_sync();
    accumulators.consumer_release(drain);
    ++drain;
  }
}

// `n` values (a multiple of 8) as bf16 to dst[0, n), 16 bytes per store, the 8-column chunks
// at or past `limit` columns skipped (row lengths are multiples of 8).
template <int N>
CUTE_DEVICE void store_row(cutlass::bfloat16_t* dst, const float (&v)[N], int limit) {
  static_assert(N % 8 == 0, "whole 16-byte chunks");
  CUTE_UNROLL
  for (int q = 0; q < N / 8; ++q) {
    if (q * 8 >= limit) break;
    uint4 chunk;
    uint32_t* w = reinterpret_cast<uint32_t*>(&chunk);
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 pair = __float22bfloat162_rn(make_float2(v[q * 8 + 2 * i], v[q * 8 + 2 * i + 1]));
      w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    *reinterpret_cast<uint4*>(dst + q * 8) = chunk;
  }
}

// This thread's accumulator row (kN fp32 columns from `acc`) to dst[0, cols):
// alpha * acc + beta * dst, rounded twice as the Hopper stores do (bf16(alpha * acc), then
// bf16(that + beta * dst)); beta == 0 never reads dst. Warp-collective (the tensor-memory
// loads): every lane calls it, a lane with no row passes dst == nullptr.
template <int kN>
CUTE_DEVICE void store_acc_row(uint32_t acc, cutlass::bfloat16_t* dst, int cols, float alpha, float beta) {
  static_assert(kN % kColsPerLoad == 0, "whole tensor-memory loads");
  CUTE_UNROLL
  for (int c0 = 0; c0 < kN; c0 += kColsPerLoad) {
    float v[kColsPerLoad];
    tmem_load(acc + c0, v);
    if (dst == nullptr || c0 >= cols) continue;
    CUTE_UNROLL
    for (int i = 0; i < kColsPerLoad; ++i) v[i] = alpha * v[i];
    if (beta != 0.f) {
      CUTE_UNROLL
      for (int q = 0; q < kColsPerLoad / 8; ++q) {
        if (c0 + q * 8 >= cols) break;
        const uint4 old = *reinterpret_cast<const uint4*>(dst + c0 + q * 8);
        const __nv_bfloat162* o = reinterpret_cast<const __nv_bfloat162*>(&old);
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const float2 b = __bfloat1622float2(o[j]);
          const float2 a = __bfloat1622float2(__float22bfloat162_rn(make_float2(v[q * 8 + 2 * j], v[q * 8 + 2 * j + 1])));
          v[q * 8 + 2 * j] = a.x + beta * b.x;
          v[q * 8 + 2 * j + 1] = a.y + beta * b.y;
        }
      }
    }
    store_row(dst + c0, v, cols - c0);
  }
}

// The stage and accumulator pipelines of a kernel with `producer_arrivals` producer arrivals
// per stage (and `stage_bytes` expected by the TMA leader, thread 0), warps `producer` /
// `mma` / the rest the epilogue; the barriers are initialised by warps 0 and 2 and visible
// after the caller's block barrier.
template <int kStages>
struct Pipelines {
  StagePipeline<kStages> stages;
  AccPipeline accumulators;

  template <class Storage>
  CUTE_DEVICE Pipelines(Storage& stage_storage, typename AccPipeline::SharedStorage& acc_storage, bool producer,
                        bool mma, uint32_t producer_arrivals, uint32_t stage_bytes, int epilogue_threads)
      : stages(stage_storage, stage_params(producer, mma, producer_arrivals, stage_bytes), cute::Shape<cute::_1, cute::_1, cute::_1>{}),
        accumulators(acc_storage, acc_params(producer, mma, epilogue_threads), cute::Shape<cute::_1, cute::_1, cute::_1>{}) {}

  CUTE_DEVICE static typename StagePipeline<kStages>::Params stage_params(bool producer, bool mma, uint32_t arrivals,
                                                                         uint32_t bytes) {
    using Category = typename StagePipeline<kStages>::ThreadCategory;
    typename StagePipeline<kStages>::Params p;
    p.role = producer ? Category::Producer : mma ? Category::Consumer : Category::NonParticipant;
    p.is_leader = threadIdx.x == 0;
    p.num_consumers = 1;  // the MMA warp's commit
    p.num_producers = arrivals;
    p.transaction_bytes = bytes;
    p.initializing_warp = 0;
    return p;
  }
  CUTE_DEVICE static typename AccPipeline::Params acc_params(bool producer, bool mma, int epilogue_threads) {
    using Category = typename AccPipeline::ThreadCategory;
    typename AccPipeline::Params p;
    p.role = mma ? Category::Producer : producer ? Category::NonParticipant : Category::Consumer;
    p.producer_arv_count = 1;
    p.consumer_arv_count = uint32_t(epilogue_threads);
    p.initializing_warp = 2;
    return p;
  }
};

}  // namespace moefuse::kernel::sm100
