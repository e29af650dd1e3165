// Hopper (sm_90a) dense bf16 GEMM: CUTLASS TMA warp-specialized WGMMA collective,
// persistent tile scheduler. A config names tile, cluster, schedule and B layout.
//
// Roles (from CUTLASS's kernel, per CTA):
//   warp group 0         -> producer (TMA loads of A and B; registers lowered)
//   warp groups 1..      -> MMA consumers (WGMMA, fp32 accumulators) + TMA-store epilogue
//   coop: both consumers share one 128xN tile; pingpong: each takes its own tile.
#pragma once

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moefuse/common/gemm_launch.cuh"
#include "moefuse/common/layout.hpp"

namespace moefuse::sm90 {

struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr int kMinTileM = 128;
};

struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  static constexpr int kMinTileM = 64;
};

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule,
          moefuse_b_layout BL>
struct GemmBf16 {
  static_assert(TileM % Schedule::kMinTileM == 0,
                "sm90 GEMM: tile M must be a multiple of 128 for the cooperative schedule "
                "(64 for pingpong); pick another tile or schedule");
  static_assert(TileN % 16 == 0 && TileN <= 256, "sm90 GEMM: WGMMA N must be a multiple of 16, <= 256");
  static_assert(TileK * 2 % 128 == 0, "sm90 GEMM: tile K must span whole 128-byte swizzle rows (K % 64)");
  static_assert(ClusterM * ClusterN <= 2, "sm90 GEMM: clusters above 2 CTAs are not instantiated");

  static constexpr int kMajor = 9;
  static constexpr int kMinor = 0;
  static constexpr moefuse_b_layout kBLayout = BL;

  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  static constexpr int kAlign = 16 / sizeof(Element);  // TMA: 16-byte rows

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element,
      cutlass::layout::RowMajor, kAlign, Element, cutlass::layout::RowMajor, kAlign,
      typename Schedule::Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor,
      kAlign, Element, typename BLayout<BL>::Cutlass, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace moefuse::sm90
