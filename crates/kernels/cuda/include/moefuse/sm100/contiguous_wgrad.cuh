// Blackwell (sm_100a) K-grouped bf16 GEMM (wgrad) over the contiguous grouped layout:
// CUTLASS's 1-SM UMMA collective (MN-major A and B: its layouts and tiled MMA) inside
// moefuse's own persistent kernel (kernel/sm100_contiguous_wgrad.cuh); the host launcher is
// common/contiguous_wgrad_launch.cuh's, as for the Hopper twin.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/contiguous_wgrad_launch.cuh"
#include "moefuse/kernel/sm100_contiguous_wgrad.cuh"
#include "moefuse/sm100/contiguous_grouped_gemm.cuh"

namespace moefuse::sm100 {

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, moefuse_b_layout BL>
struct ContiguousWgradBf16 {
  static_assert(TileM == 128 && TileK == 64 && ClusterM == 1 && ClusterN == 1,
                "sm100 contiguous wgrad: 128 x N x 64 1-SM tiles, no clusters (yet)");
  static constexpr int kMajor = 10;
  static constexpr int kMinor = 0;
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  // The kernel's shared memory beside the collective's stages: the row ring, the
  // accumulator pipeline and the tensor-memory base.
  using CarveOut = cute::Int<int(sizeof(kernel::ContiguousWgradRowRing)) + 256>;
  // A^T: A [rows, m] row-major is M-major (ColumnMajor for CUTLASS's M x K A); B [rows, n]
  // row-major is N-major (RowMajor for its K x N B).
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCountAutoCarveout<CarveOut::value>,
      cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;
  using Kernel = kernel::Sm100ContiguousWgrad<CollectiveMainloop>;
  static_assert(Kernel::kSharedBytes <= 232448, "sm100 contiguous wgrad: over the 227 KB a CTA may use");
  static constexpr auto kEntry = &kernel::sm100_contiguous_wgrad_kernel<Kernel>;

  // The launcher's arch part: nothing beyond the producer's maps and the store's fields.
  static moefuse_status finish_params(const moefuse_grouped_gemm_args&, typename Kernel::Params&) {
    return MOEFUSE_STATUS_OK;
  }
};

}  // namespace moefuse::sm100
