// Layout tags shared by every arch: how moefuse_b_layout maps onto CUTLASS layouts.
#pragma once

#include "cutlass/layout/matrix.h"
#include "moefuse/abi.h"

namespace moefuse {

template <moefuse_b_layout L>
struct BLayout;

// B stored [n, k] row-major: CUTLASS sees a K x N column-major operand (K-major).
template <>
struct BLayout<MOEFUSE_B_LAYOUT_NK> {
  using Cutlass = cutlass::layout::ColumnMajor;
};

// B stored [k, n] row-major: a K x N row-major operand (N-major).
template <>
struct BLayout<MOEFUSE_B_LAYOUT_KN> {
  using Cutlass = cutlass::layout::RowMajor;
};

}  // namespace moefuse
