// Hopper (sm_90a) M-grouped bf16 GEMM over the contiguous grouped layout (forward and
// dgrad): CUTLASS's cooperative TMA/WGMMA mainloop collective inside moefuse's own
// persistent kernel (kernel/sm90_contiguous_grouped.cuh); the host launcher is
// common/contiguous_launch.cuh's.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/layout.hpp"
#include "moefuse/common/contiguous_launch.cuh"
#include "moefuse/common/status.hpp"
#include "moefuse/common/stride.hpp"
#include "moefuse/kernel/sm90_contiguous_grouped.cuh"

namespace moefuse::sm90 {

// The schedule tag of the instance files (variant name field `contig`).
struct Contiguous {};

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, moefuse_b_layout BL>
struct ContiguousGroupedBf16 {
  static_assert(ClusterN == 1 && (ClusterM == 1 || ClusterM == 2),
                "sm90 contiguous grouped GEMM: clusters 1x1 or 2x1 (W_e tiles multicast along M)");
  static_assert(TileN % 16 == 0 && TileN <= 256, "sm90 contiguous grouped GEMM: WGMMA N must be a multiple of 16, <= 256");
  static_assert(TileK * 2 % 128 == 0, "sm90 contiguous grouped GEMM: tile K must span whole 128-byte swizzle rows");

  static constexpr int kMajor = 9;
  static constexpr int kMinor = 0;
  static constexpr moefuse_b_layout kBLayout = BL;
  // Groups the shared-memory tile table holds; larger problems take the ptr-array variants.
  static constexpr int kMaxGroups = 512;

  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TableBytes = cute::Int<int(sizeof(sched::ContiguousGroupTable<kMaxGroups>) +
                                     sizeof(epilogue::MaskedRowsStorage)) + 64>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      typename BLayout<BL>::Cutlass, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<TableBytes::value>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = kernel::Sm90ContiguousGrouped<CollectiveMainloop, kMaxGroups>;
  // The launcher's entry for this kernel or a twin with another row store or epilogue.
  template <class K>
  static constexpr auto kEntry = &kernel::sm90_contiguous_grouped_kernel<K>;
};

}  // namespace moefuse::sm90

