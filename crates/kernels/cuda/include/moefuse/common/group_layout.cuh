// Group-layout math shared by every arch: offsets (prefix-sum ends, device memory) ->
// the per-group problem shapes, operand pointers and strides that CUTLASS's ptr-array
// grouped kernels read, built on the device so a launch never synchronises with the host.
//
//   M-grouped (fwd, dgrad): group e is the GEMM (m_e, n, k) on rows [start_e, end_e).
//   K-grouped (wgrad):      group e is the GEMM (k, n, m_e): D_e = A_e^T * B_e.
//
// Empty groups get a problem with no tiles, so the grouped scheduler never visits them.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/layout.hpp"
#include "moefuse/common/status.hpp"
#include "moefuse/common/stride.hpp"

namespace moefuse {

enum class GroupedKind { kMGrouped, kKGrouped };

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

// Rows [start, end) of group e, with ends clamped to total_rows and a decreasing end read
// as an empty group: whatever the offsets hold, no group leaves the buffers.
struct GroupRows {
  int start;
  int end;
  CUTE_HOST_DEVICE int rows() const { return end - start; }
};

CUTE_HOST_DEVICE GroupRows group_rows(const int32_t* offsets, int e, int total_rows) {
  auto clamp = [&](int32_t v) { return v < 0 ? 0 : (v > total_rows ? total_rows : int(v)); };
  int end = clamp(offsets[e]);
  int start = e == 0 ? 0 : clamp(offsets[e - 1]);
  if (start > end) start = end;
  return {start, end};
}

// The operands of a grouped launch, checked by run only (a workspace query takes a problem
// without them); shared by every grouped launcher. Only a launcher that gathers B's (A's)
// rows, `gathers_b` (`gathers_a`), takes b_rows (a_rows); the others refuse them rather than
// read the operand unpermuted.
inline moefuse_status check_grouped_pointers(const moefuse_grouped_gemm_args* p, const char* name,
                                             bool gathers_b = false, bool gathers_a = false) {
  if (p->offsets == nullptr || p->a == nullptr || p->b == nullptr || p->d == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null pointer (offsets=%p a=%p b=%p d=%p)", name,
                (const void*)p->offsets, p->a, p->b, p->d);
  }
  if (p->b_rows != nullptr && !gathers_b) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: b_rows given, but this variant does not gather B", name);
  }
  if (p->b_rows != nullptr && (p->b_rows_div < 1 || p->b_source_rows < 1)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: gathered B needs b_rows_div >= 1 and b_source_rows >= 1 (%d, %d)",
                name, p->b_rows_div, p->b_source_rows);
  }
  if (p->a_rows != nullptr && !gathers_a) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: a_rows given, but this variant does not gather A", name);
  }
  if (p->a_rows != nullptr && (p->a_rows_div < 1 || p->a_source_rows < 1)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: gathered A needs a_rows_div >= 1 and a_source_rows >= 1 (%d, %d)",
                name, p->a_rows_div, p->a_source_rows);
  }
  // The gathered producers address their operand (B [b_source_rows, n], A [a_source_rows, k])
  // in 32-bit 16-byte chunks.
  if ((p->b_rows != nullptr && int64_t(p->b_source_rows) * (p->n / 8) >= (int64_t(1) << 32)) ||
      (p->a_rows != nullptr && int64_t(p->a_source_rows) * (p->k / 8) >= (int64_t(1) << 32))) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: a gathered operand of 2^32 16-byte chunks or more", name);
  }
  return MOEFUSE_STATUS_OK;
}

// The arrays CUTLASS's grouped kernels read, carved out of the caller's workspace.
template <class Kernel>
struct GroupedArrays {
  using Shape = typename Kernel::ProblemShape::UnderlyingProblemShape;
  using EA = typename Kernel::ElementA;
  using EB = typename Kernel::ElementB;
  using ED = typename Kernel::ElementD;
  using SA = typename Kernel::InternalStrideA;
  using SB = typename Kernel::InternalStrideB;
  using SC = typename Kernel::InternalStrideC;
  using SD = typename Kernel::InternalStrideD;

  Shape* shapes;
  const EA** a;
  const EB** b;
  const ED** c;
  ED** d;
  SA* stride_a;
  SB* stride_b;
  SC* stride_c;
  SD* stride_d;

  static constexpr size_t kAlign = 256;
  static size_t round(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

  // Bytes for `groups` groups, each array 256-byte aligned.
  static size_t bytes(int groups) {
    size_t g = size_t(groups);
    return round(g * sizeof(Shape)) + 4 * round(g * sizeof(void*)) + round(g * sizeof(SA)) +
           round(g * sizeof(SB)) + round(g * sizeof(SC)) + round(g * sizeof(SD));
  }

  static GroupedArrays carve(void* base, int groups) {
    char* p = static_cast<char*>(base);
    size_t g = size_t(groups);
    auto take = [&](size_t n) {
      char* q = p;
      p += round(n);
      return q;
    };
    GroupedArrays r;
    r.shapes = reinterpret_cast<Shape*>(take(g * sizeof(Shape)));
    r.a = reinterpret_cast<const EA**>(take(g * sizeof(void*)));
    r.b = reinterpret_cast<const EB**>(take(g * sizeof(void*)));
    r.c = reinterpret_cast<const ED**>(take(g * sizeof(void*)));
    r.d = reinterpret_cast<ED**>(take(g * sizeof(void*)));
    r.stride_a = reinterpret_cast<SA*>(take(g * sizeof(SA)));
    r.stride_b = reinterpret_cast<SB*>(take(g * sizeof(SB)));
    r.stride_c = reinterpret_cast<SC*>(take(g * sizeof(SC)));
    r.stride_d = reinterpret_cast<SD*>(take(g * sizeof(SD)));
    return r;
  }
};

// One thread per group (grid-stride): writes group e's shape, pointers and strides.
// The leading dimensions follow from the packed layouts in abi.h.
template <class Kernel, GroupedKind Kind>
__global__ void prepare_groups(moefuse_grouped_gemm_args p, GroupedArrays<Kernel> out) {
  using Arrays = GroupedArrays<Kernel>;
  const auto* a = static_cast<const typename Arrays::EA*>(p.a);
  const auto* b = static_cast<const typename Arrays::EB*>(p.b);
  auto* d = static_cast<typename Arrays::ED*>(p.d);
  const int64_t n = p.n, k = p.k;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.num_groups; e += gridDim.x * blockDim.x) {
    GroupRows rows = group_rows(p.offsets, e, p.total_rows);
    const int m = rows.rows();
    if constexpr (Kind == GroupedKind::kMGrouped) {
      // (m_e, n, k): A rows of the group, the group's weights, D rows of the group.
      out.shapes[e] = typename Arrays::Shape(m, p.n, p.k);
      out.a[e] = a + rows.start * k;
      out.b[e] = b + e * n * k;
      out.d[e] = d + rows.start * n;
      out.stride_a[e] = leading_stride<typename Arrays::SA>(k);
      out.stride_b[e] = leading_stride<typename Arrays::SB>(p.b_layout == MOEFUSE_B_LAYOUT_NK ? k : n);
    } else {
      // (k, n, m_e): A^T (column-major, ld k) times B (k-major rows, ld n); no tiles when
      // the group is empty (a zero-length reduction would leave the accumulators unset).
      out.shapes[e] = typename Arrays::Shape(m > 0 ? p.k : 0, p.n, m);
      out.a[e] = a + rows.start * k;
      out.b[e] = b + rows.start * n;
      out.d[e] = d + e * k * n;
      out.stride_a[e] = leading_stride<typename Arrays::SA>(k);
      out.stride_b[e] = leading_stride<typename Arrays::SB>(n);
    }
    out.c[e] = out.d[e];
    out.stride_c[e] = leading_stride<typename Arrays::SC>(n);
    out.stride_d[e] = leading_stride<typename Arrays::SD>(n);
  }
}

// Zeroes D_e of every empty group of a K-grouped problem (beta == 0): grid (chunks, groups),
// 16-byte stores; k*n*sizeof(Element) bytes per group is a multiple of 16 because n % 8 == 0.
// NOTES: a template so that every instance file may define it (a plain __global__ in a
// header is one symbol per translation unit and collides at link time).
template <class Element>
__global__ void zero_empty_groups(moefuse_grouped_gemm_args p) {
  const int e = blockIdx.y;
  if (group_rows(p.offsets, e, p.total_rows).rows() != 0) return;
  const int64_t bytes = int64_t(p.k) * p.n * int64_t(sizeof(Element));
  const int64_t vecs = bytes / 16;
  uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(p.d) + int64_t(e) * bytes);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace moefuse
