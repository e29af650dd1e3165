// Hopper (sm_90a) K-grouped bf16 GEMM (wgrad) over the contiguous grouped layout:
// CUTLASS's cooperative TMA/WGMMA mainloop collective (MN-major A and B) inside moefuse's own
// persistent kernel (kernel/sm90_contiguous_wgrad.cuh); the host launcher is
// common/contiguous_wgrad_launch.cuh's, as for the Blackwell twin.
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/contiguous_wgrad_launch.cuh"
#include "moefuse/common/tensor_map.hpp"
#include "moefuse/kernel/sm90_contiguous_wgrad.cuh"
#include "moefuse/sm90/contiguous_grouped_gemm.cuh"

namespace moefuse::sm90 {

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule, moefuse_b_layout BL>
struct ContiguousWgradBf16 {
  static_assert((ClusterM == 1 || ClusterM == 2) && ClusterN == 1,
                "sm90 contiguous wgrad: clusters 1x1 or 2x1 (B's strips multicast along M)");
  static constexpr int kMajor = 9;
  static constexpr int kMinor = 0;
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using CarveOut =
      cute::Int<int(sizeof(kernel::ContiguousWgradEpilogue) + sizeof(kernel::ContiguousWgradRowRing)) + 64>;
  // A^T: A [rows, m] row-major is M-major (ColumnMajor for CUTLASS's M x K A); B [rows, n]
  // row-major is N-major (RowMajor for its K x N B).
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCountAutoCarveout<CarveOut::value>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = kernel::Sm90ContiguousWgrad<CollectiveMainloop, ClusterM>;
  static_assert(Kernel::kSharedBytes <= 232448, "sm90 contiguous wgrad: more shared memory than an SM has");

  // The boxes write where the collective's layouts put them: 64-wide MN strips of
  // 64 x 128-byte rows (one row per reduction index), strips one after the other.
  using SmemA = typename CollectiveMainloop::SmemLayoutA;
  using SmemB = typename CollectiveMainloop::SmemLayoutB;
  static_assert(cute::is_same_v<decltype(SmemA{}.layout_a()), cute::Swizzle<3, 4, 3>> &&
                    cute::is_same_v<decltype(SmemB{}.layout_a()), cute::Swizzle<3, 4, 3>>,
                "sm90 contiguous wgrad: 128-byte swizzled stages");
  static_assert(SmemA{}.layout_b()(1, 0, 0) == 1 && SmemA{}.layout_b()(0, 1, 0) == 64 &&
                    SmemA{}.layout_b()(64, 0, 0) == Kernel::kStrip &&
                    SmemA{}.layout_b()(0, 0, 1) == Kernel::kStageElementsA,
                "sm90 contiguous wgrad: A stage is not 64-wide strips of 128-byte rows");
  static_assert(SmemB{}.layout_b()(1, 0, 0) == 1 && SmemB{}.layout_b()(0, 1, 0) == 64 &&
                    SmemB{}.layout_b()(64, 0, 0) == Kernel::kStrip &&
                    SmemB{}.layout_b()(0, 0, 1) == Kernel::kStageElementsB,
                "sm90 contiguous wgrad: B stage is not 64-wide strips of 128-byte rows");
  static constexpr auto kEntry = &kernel::sm90_contiguous_wgrad_kernel<Kernel>;

  // The launcher's arch part: D's map for the beta == 0 epilogue's TMA stores (run() returns
  // before this when there are no groups) and the collective's arguments (only for mma()'s
  // signature).
  static moefuse_status finish_params(const moefuse_grouped_gemm_args& p, typename Kernel::Params& out) {
    using namespace cute;
    const cuuint64_t rows = cuuint64_t(p.total_rows > 0 ? p.total_rows : 1);
    const cuuint64_t m = cuuint64_t(p.k), n = cuuint64_t(p.n);
    if (p.beta == 0.f && tma_epilogue_enabled()) {
      moefuse_status st = encode_bf16_map<3>(&out.d_tile, p.d, {n, m, cuuint64_t(p.num_groups)},
                                             {n * 2, m * n * 2}, {64, 64, 1}, "D tiles");
      if (st != MOEFUSE_STATUS_OK) return st;
      out.tma_store = 1;
    }
    using StrideA = typename CollectiveMainloop::StrideA;
    using StrideB = typename CollectiveMainloop::StrideB;
    StrideA sa{};
    get<1>(sa) = p.k;  // (_1, ld, L): M-major
    StrideB sb{};
    get<1>(sb) = p.n;  // (_1, ld, L): N-major
    typename CollectiveMainloop::Arguments args{reinterpret_cast<const Element*>(p.a), sa,
                                                reinterpret_cast<const Element*>(p.b), sb};
    out.mainloop = CollectiveMainloop::to_underlying_arguments(make_shape(p.k, p.n, int(rows), 1), args, nullptr);
    return MOEFUSE_STATUS_OK;
  }
};

}  // namespace moefuse::sm90
