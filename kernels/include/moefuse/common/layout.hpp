// Layout tags shared by every arch: how moefuse_b_layout maps onto CUTLASS layouts.
#pragma once

#include "cutlass/layout/matrix.h"
#include "moefuse/abi.h"
#include "moefuse/common/group_layout.cuh"

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

// Operand layouts of a grouped problem.
//   M-grouped: A rows of the group [m_e, k] row-major; B = W_e per the weights' layout.
//   K-grouped: A = X_e^T, column-major (its rows are X's columns); B = the group's rows of
//              the second activation, [m_e, n] row-major, i.e. a K x N row-major operand.
template <GroupedKind Kind, moefuse_b_layout BL>
struct GroupedLayouts {
  using A = cutlass::layout::RowMajor;
  using B = typename BLayout<BL>::Cutlass;
};

template <moefuse_b_layout BL>
struct GroupedLayouts<GroupedKind::kKGrouped, BL> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

}  // namespace moefuse
