// Blackwell (sm_100a) dense bf16 GEMM: CUTLASS UMMA (tcgen05) collective with the
// accumulator in tensor memory, TMA loads and TMA-store epilogue, 1-SM or 2-SM MMA.
// Kept in the same order as sm90/gemm.cuh so the two diff cleanly.
//
// Roles (from CUTLASS's sm100 kernel, per CTA):
//   warp 0      -> MMA issue (tcgen05.mma into TMEM)
//   warp 1      -> scheduler
//   warp 2      -> mainloop producer (TMA loads of A and B)
//   warp 3      -> epilogue producer (C loads)
//   warps 4..7  -> epilogue (TMEM -> registers -> TMA store)
#pragma once

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moefuse/common/gemm_launch.cuh"
#include "moefuse/common/layout.hpp"

namespace moefuse::sm100 {

struct OneSm {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized1Sm;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  static constexpr int kSms = 1;
};

// NOTES: one kernel never mixes .cta_group::1 and ::2 instructions (CUDA 13 rejects it);
// a 2-SM schedule is its own variant.
struct TwoSm {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecialized2SmSm100;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized2Sm;
  using GroupedKernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100;
  using GroupedEpilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm;
  static constexpr int kSms = 2;
};

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, class Schedule,
          moefuse_b_layout BL>
struct GemmBf16 {
  static_assert(TileM == 64 * Schedule::kSms || TileM == 128 * Schedule::kSms,
                "sm100 GEMM: MMA tile M must be 64 or 128 per SM; a 2-SM schedule doubles it");
  static_assert(ClusterM % Schedule::kSms == 0,
                "sm100 GEMM: a 2-SM schedule needs cluster M to be a multiple of 2");
  static_assert(TileN % 16 == 0 && TileN <= 256, "sm100 GEMM: UMMA N must be a multiple of 16, <= 256");
  static_assert(TileK * 2 % 128 == 0, "sm100 GEMM: tile K must span whole 128-byte swizzle rows (K % 64)");

  static constexpr int kMajor = 10;
  static constexpr int kMinor = 0;
  static constexpr moefuse_b_layout kBLayout = BL;

  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  static constexpr int kAlign = 16 / sizeof(Element);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element,
      cutlass::layout::RowMajor, kAlign, Element, cutlass::layout::RowMajor, kAlign,
      typename Schedule::Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor,
      kAlign, Element, typename BLayout<BL>::Cutlass, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace moefuse::sm100
