// Blackwell (sm_100a) grouped bf16 GEMM: CUTLASS's ptr-array UMMA (tcgen05, TMEM)
// kernel over a GroupProblemShape, persistent over all groups' tiles; the per-group
// tensor maps are rewritten on the device when a CTA moves to another group.
// Same tile/schedule vocabulary as sm100/gemm.cuh, operand layouts per GroupedLayouts;
// kept in sm90/grouped_gemm.cuh's section order so the two diff cleanly.
#pragma once

#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "moefuse/common/grouped_launch.cuh"
#include "moefuse/sm100/gemm.cuh"

namespace moefuse::sm100 {

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, GroupedKind Kind,
          moefuse_b_layout BL>
struct GroupedBf16 {
  static_assert(TileM == 64 * Schedule::kSms || TileM == 128 * Schedule::kSms,
                "sm100 grouped GEMM: MMA tile M must be 64 or 128 per SM; a 2-SM schedule doubles it");
  static_assert(ClusterM % Schedule::kSms == 0, "sm100 grouped GEMM: a 2-SM schedule needs cluster M % 2 == 0");
  static_assert(TileN % 16 == 0 && TileN <= 256, "sm100 grouped GEMM: UMMA N must be a multiple of 16, <= 256");
  static_assert(TileK * 2 % 128 == 0, "sm100 grouped GEMM: tile K must span whole 128-byte swizzle rows (K % 64)");

  static constexpr int kMajor = 10;
  static constexpr int kMinor = 0;
  static constexpr GroupedKind kKind = Kind;
  static constexpr moefuse_b_layout kBLayout = BL;

  using Element = cutlass::bfloat16_t;
  using Layouts = GroupedLayouts<Kind, BL>;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  static constexpr int kAlign = 16 / sizeof(Element);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, cutlass::layout::RowMajor*, kAlign,
      Element, cutlass::layout::RowMajor*, kAlign, typename Schedule::GroupedEpilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, typename Layouts::A*, kAlign, Element,
      typename Layouts::B*, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::GroupedKernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace moefuse::sm100
