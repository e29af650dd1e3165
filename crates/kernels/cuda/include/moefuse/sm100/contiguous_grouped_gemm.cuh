// Blackwell (sm_100a) M-grouped bf16 GEMM over the contiguous grouped layout (forward and
// dgrad): CUTLASS's 1-SM UMMA collective (layouts, TMA atoms, tiled MMA) inside moefuse's own
// persistent kernel (kernel/sm100_contiguous_grouped.cuh); the host launcher is
// common/contiguous_launch.cuh's, as for the Hopper twin.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/contiguous_launch.cuh"
#include "moefuse/common/layout.hpp"
#include "moefuse/kernel/sm100_contiguous_grouped.cuh"

namespace moefuse::sm100 {

// The schedule tag of the instance files (variant name field `contig`).
struct Contiguous {};

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, moefuse_b_layout BL>
struct ContiguousGroupedBf16 {
  static_assert(TileM == 128 && ClusterM == 1 && ClusterN == 1,
                "sm100 contiguous grouped GEMM: 128-row 1-SM tiles, no clusters (yet)");
  static_assert(TileN % 32 == 0 && TileN <= 256, "sm100 contiguous grouped GEMM: UMMA N a multiple of 32, <= 256");
  static_assert(TileK == 64, "sm100 contiguous grouped GEMM: a k-block is one 128-byte swizzle row");

  static constexpr int kMajor = 10;
  static constexpr int kMinor = 0;
  static constexpr moefuse_b_layout kBLayout = BL;
  // Groups the shared-memory tile table holds; larger problems take the ptr-array variants.
  static constexpr int kMaxGroups = 512;

  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlign = 16 / sizeof(Element);
  using TableBytes = cute::Int<int(sizeof(sched::ContiguousGroupTable<kMaxGroups>)) + 256>;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      typename BLayout<BL>::Cutlass, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<TableBytes::value>,
      cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;

  using Kernel = kernel::Sm100ContiguousGrouped<CollectiveMainloop, kMaxGroups>;
  static_assert(Kernel::kSharedBytes <= 232448, "sm100 contiguous grouped GEMM: over the 227 KB a CTA may use");
  // The launcher's entry for this kernel or a twin with another row store.
  template <class K>
  static constexpr auto kEntry = &kernel::sm100_contiguous_grouped_kernel<K>;
};

}  // namespace moefuse::sm100
