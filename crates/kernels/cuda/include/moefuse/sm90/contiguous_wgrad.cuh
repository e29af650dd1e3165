// Hopper (sm_90a) K-grouped bf16 GEMM (wgrad) over the contiguous grouped layout:
// CUTLASS's cooperative TMA/WGMMA mainloop collective (MN-major A and B) inside moefuse's own
// persistent kernel (kernel/sm90_contiguous_wgrad.cuh), with the host launcher. Same C entry
// points as every grouped variant; no workspace. Takes a_rows and b_rows (abi.h "Gathered
// rows").
#pragma once

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/cluster_launch.cuh"
#include "moefuse/common/status.hpp"
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
};

template <class Config>
struct ContiguousWgradLauncher {
  using Kernel = typename Config::Kernel;
  using Mainloop = typename Config::CollectiveMainloop;
  using Params = typename Kernel::Params;
  using Element = cutlass::bfloat16_t;

  static moefuse_status check(const moefuse_grouped_gemm_args* p, const char* name) {
    if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
    if (p->num_groups < 0 || p->total_rows < 0 || p->n <= 0 || p->k <= 0) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: groups=%d rows=%d n=%d k=%d", name, p->num_groups,
                  p->total_rows, p->n, p->k);
    }
    // The tile walk is (group, m-block, n-block); of the contiguous tile-order fields only
    // bit 24 (front and back of the walk interleaved) changes it, raster, band and prefetch
    // are accepted and have no effect here (a K-grouped tile has no M-band to walk).
    const int band = (p->tile_order >> 8) & 0xff;
    if ((p->tile_order & 3) == 3 || (p->tile_order & ~0x1ffff03) != 0 || (band & (band - 1)) != 0) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tile_order %#x: raster 0-2, band a power of two", name,
                  p->tile_order);
    }
    if (p->n % 8 != 0 || p->k % 8 != 0) {
      return fail(MOEFUSE_STATUS_MISALIGNED, "%s: n=%d and k=%d must be multiples of 8 (16-byte rows)", name, p->n,
                  p->k);
    }
    if (int64_t(p->num_groups) * ((p->k + 127) / 128) * ((p->n + Kernel::kTileN - 1) / Kernel::kTileN) > INT32_MAX) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: too many tiles", name);
    }
    return MOEFUSE_STATUS_OK;
  }

  // 0 means "refused" to a grouped workspace query, so an accepted problem asks for one
  // unused 256-byte slot (as the M-grouped contiguous variants do).
  static size_t workspace(const moefuse_grouped_gemm_args* p, const char* name) {
    if (check(p, name) != MOEFUSE_STATUS_OK) return 0;
    int device = 0, sms = 0;
    if (check_device(Config::kMajor, Config::kMinor, name, &sms, &device) != MOEFUSE_STATUS_OK) return 0;
    return 256;
  }

  static moefuse_status params(const moefuse_grouped_gemm_args& p, Params& out) {
    using namespace cute;
    // The maps span the total_rows rows (at least 1); only whole chunks inside a group use them.
    const cuuint64_t rows = cuuint64_t(p.total_rows > 0 ? p.total_rows : 1);
    const cuuint64_t m = cuuint64_t(p.k), n = cuuint64_t(p.n);
    // A gathered operand has its source_rows rows and is read by cp.async only (its map
    // spans them and is never used).
    const cuuint64_t b_rows = p.b_rows != nullptr ? cuuint64_t(p.b_source_rows) : rows;
    const cuuint64_t a_rows = p.a_rows != nullptr ? cuuint64_t(p.a_source_rows) : rows;
    moefuse_status st = encode_bf16_map<2>(&out.a_chunk, p.a, {m, a_rows}, {m * 2}, {64, 64}, "A chunks");
    if (st == MOEFUSE_STATUS_OK) st = encode_bf16_map<2>(&out.b_chunk, p.b, {n, b_rows}, {n * 2}, {64, 64}, "B chunks");
    // D [groups, m, n] for the beta == 0 epilogue's TMA stores (run() returns before this
    // when there are no groups).
    if (st == MOEFUSE_STATUS_OK && p.beta == 0.f && tma_epilogue_enabled()) {
      st = encode_bf16_map<3>(&out.d_tile, p.d, {n, m, cuuint64_t(p.num_groups)}, {n * 2, m * n * 2}, {64, 64, 1},
                              "D tiles");
      out.tma_store = 1;
    }
    if (st != MOEFUSE_STATUS_OK) return st;
    using StrideA = typename Mainloop::StrideA;
    using StrideB = typename Mainloop::StrideB;
    StrideA sa{};
    get<1>(sa) = p.k;  // (_1, ld, L): M-major
    StrideB sb{};
    get<1>(sb) = p.n;  // (_1, ld, L): N-major
    typename Mainloop::Arguments args{reinterpret_cast<const Element*>(p.a), sa, reinterpret_cast<const Element*>(p.b),
                                      sb};
    out.mainloop = Mainloop::to_underlying_arguments(make_shape(p.k, p.n, int(rows), 1), args, nullptr);
    out.offsets = p.offsets;
    out.a = static_cast<const Element*>(p.a);
    out.b = static_cast<const Element*>(p.b);
    out.d = static_cast<Element*>(p.d);
    // At most one gathered operand (run() refuses both).
    out.gather_a = p.a_rows != nullptr ? 1 : 0;
    out.rows = p.a_rows != nullptr ? p.a_rows : p.b_rows;
    out.rows_div = cutlass::FastDivmod(p.a_rows != nullptr ? p.a_rows_div : (p.b_rows != nullptr ? p.b_rows_div : 1));
    out.source_rows = p.a_rows != nullptr ? p.a_source_rows : (p.b_rows != nullptr ? p.b_source_rows : p.total_rows);
    out.groups = p.num_groups;
    out.total_rows = p.total_rows;
    out.m = p.k;
    out.n = p.n;
    out.alpha = p.alpha;
    out.beta = p.beta;
    out.interleave = (p.tile_order >> 24) & 1;
    return MOEFUSE_STATUS_OK;
  }

  static moefuse_status run(const moefuse_grouped_gemm_args* p, void* ws, size_t ws_bytes, cudaStream_t stream,
                            const char* name) {
    (void)ws;
    (void)ws_bytes;
    moefuse_status st = check(p, name);
    if (st != MOEFUSE_STATUS_OK || p->num_groups == 0) return st;
    st = check_grouped_pointers(p, name, /*gathers_b=*/true, /*gathers_a=*/true);
    if (st != MOEFUSE_STATUS_OK) return st;
    if (p->a_rows != nullptr && p->b_rows != nullptr) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: a_rows and b_rows: one gathered operand per launch", name);
    }
    int device = 0, sms = 0;
    st = check_device(Config::kMajor, Config::kMinor, name, &sms, &device);
    if (st != MOEFUSE_STATUS_OK) return st;
    Params prm{};
    st = params(*p, prm);
    if (st != MOEFUSE_STATUS_OK) return st;
    constexpr int kCluster = Kernel::kClusterM;
    const int64_t m_units = ((p->k + Kernel::kTileM - 1) / Kernel::kTileM + kCluster - 1) / kCluster;
    const int64_t units = int64_t(p->num_groups) * m_units * ((p->n + Kernel::kTileN - 1) / Kernel::kTileN);
    return launch_on_clusters<kCluster, &kernel::sm90_contiguous_wgrad_kernel<Kernel>>(
        Kernel::kThreads, Kernel::kSharedBytes, sms, units, stream, name, prm);
  }
};

}  // namespace moefuse::sm90

// Defines the two C entry points of one contiguous wgrad variant (generated instance files).
#define MOEFUSE_DEFINE_CONTIGUOUS_WGRAD(NAME, ...)                                                  \
  extern "C" size_t moefuse_##NAME##_workspace(const moefuse_grouped_gemm_args* args) {              \
    return moefuse::sm90::ContiguousWgradLauncher<__VA_ARGS__>::workspace(args, #NAME); \
  }                                                                                                  \
  extern "C" moefuse_status moefuse_##NAME(const moefuse_grouped_gemm_args* args, void* workspace,   \
                                           size_t workspace_bytes, void* stream) {                   \
    return moefuse::sm90::ContiguousWgradLauncher<__VA_ARGS__>::run(                  \
        args, workspace, workspace_bytes, static_cast<cudaStream_t>(stream), #NAME);                 \
  }
