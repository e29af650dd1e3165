// Host launcher of the scattered down GEMM (moe_abi.h: moefuse_moe_down_scatter): the
// contiguous grouped GEMM (kernel/sm90_contiguous_grouped.cuh, 128 x 256 x 64 tiles, W_e as
// [N, K] or [K, N]) whose epilogue stores row r at the address row_dst[r]
// (epilogue::RowsScattered) instead of into D. CTA pairs share W_e's tiles when the experts
// average two m-blocks of rows, as the fused gate_up decides. On compute capability 10.0 the
// Blackwell twin (kernel/sm100_contiguous_grouped.cuh, single CTAs) runs instead. A fat
// object like the other MoE kernels: each arch's image carries its own kernel, the other one
// a trap the capability check keeps from running.
#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"
#include "moefuse/sm100/contiguous_grouped_gemm.cuh"
#include "moefuse/sm90/contiguous_grouped_gemm.cuh"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_down_scatter_args) == 56, "moefuse_down_scatter_args layout changed: update ffi.rs");
static_assert(offsetof(moefuse_down_scatter_args, offsets) == 24, "moefuse_down_scatter_args layout changed");
static_assert(offsetof(moefuse_down_scatter_args, row_dst) == 48, "moefuse_down_scatter_args layout changed");

namespace moefuse::moe {
namespace {

template <int kClusterM, moefuse_b_layout kLayout>
using Config = sm90::ContiguousGroupedBf16<128, 256, 64, kClusterM, 1, sm90::Contiguous, kLayout>;
template <int kClusterM, moefuse_b_layout kLayout>
using ScatterKernel = kernel::Sm90ContiguousGrouped<typename Config<kClusterM, kLayout>::CollectiveMainloop,
                                                    Config<kClusterM, kLayout>::kMaxGroups, epilogue::RowsScattered>;
template <moefuse_b_layout kLayout>
using Config100 = sm100::ContiguousGroupedBf16<128, 256, 64, 1, 1, sm100::Contiguous, kLayout>;
template <moefuse_b_layout kLayout>
using ScatterKernel100 = kernel::Sm100ContiguousGrouped<typename Config100<kLayout>::CollectiveMainloop,
                                                        Config100<kLayout>::kMaxGroups, epilogue::RowsScattered>;
constexpr int kMaxGroups = Config<1, MOEFUSE_B_LAYOUT_NK>::kMaxGroups;
static_assert(Config100<MOEFUSE_B_LAYOUT_NK>::kMaxGroups == kMaxGroups, "down scatter: both archs' group limits");

moefuse_status check(const moefuse_down_scatter_args* a, const char* name) {
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (a->b_layout != MOEFUSE_B_LAYOUT_NK && a->b_layout != MOEFUSE_B_LAYOUT_KN) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: b_layout %d", name, a->b_layout);
  }
  if (a->rows < 0 || a->experts < 1 || a->experts > kMaxGroups || a->hidden < 8 || a->intermediate < 8) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: rows=%d experts=%d (1..%d) hidden=%d intermediate=%d", name,
                a->rows, a->experts, kMaxGroups, a->hidden, a->intermediate);
  }
  if (a->hidden % 8 != 0 || a->intermediate % 8 != 0) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: hidden=%d and intermediate=%d must be multiples of 8", name,
                a->hidden, a->intermediate);
  }
  const int band = (a->tile_order >> 8) & 0xff;
  if ((a->tile_order & 3) == 3 || (a->tile_order & ~0x1ffff03) != 0 || (band & (band - 1)) != 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tile_order %#x: raster 0-2, band a power of two", name,
                a->tile_order);
  }
  if (a->offsets == nullptr || a->h == nullptr || a->w == nullptr || a->row_dst == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if (!aligned16(a->h) || !aligned16(a->w) || !aligned_for(a->offsets) ||
      !aligned_for(a->row_dst)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: h and w must be 16-byte aligned, offsets 4, row_dst 8", name);
  }
  return MOEFUSE_STATUS_OK;
}

// The plain contiguous GEMM's parameters over the same operands (D unused: the row store
// goes through row_dst), then the scattered store: Cfg/K the Hopper config and kernel (CTA
// pairs with kClusterM = 2) or the Blackwell ones.
template <class Cfg, class K, int kClusterM, moefuse_b_layout kLayout>
moefuse_status launch(const moefuse_down_scatter_args& a, int sms, cudaStream_t stream, const char* name) {
  moefuse_grouped_gemm_args g{};
  g.num_groups = a.experts;
  g.total_rows = a.rows;
  g.n = a.hidden;
  g.k = a.intermediate;
  g.b_layout = kLayout;
  g.tile_order = a.tile_order;
  g.offsets = a.offsets;
  g.a = a.h;
  g.b = a.w;
  g.d = nullptr;
  g.alpha = 1.f;
  g.beta = 0.f;
  typename K::Params p = ContiguousGroupedLauncher<Cfg>::template params<typename K::Params>(g);
  p.row_at = epilogue::RowsScattered{a.row_dst};
  const int64_t n_blocks = (a.hidden + K::kTileN - 1) / K::kTileN;
  const int64_t max_units = (int64_t(a.rows) / (int64_t(K::kTileM) * kClusterM) + a.experts) * n_blocks;
  return launch_on_clusters<kClusterM, Cfg::template kEntry<K>>(K::kThreads, K::kSharedBytes, sms, max_units, stream,
                                                                name, p);
}

template <int kClusterM, moefuse_b_layout kLayout>
moefuse_status launch90(const moefuse_down_scatter_args& a, int sms, cudaStream_t stream, const char* name) {
  return launch<Config<kClusterM, kLayout>, ScatterKernel<kClusterM, kLayout>, kClusterM, kLayout>(a, sms, stream,
                                                                                                   name);
}

template <moefuse_b_layout kLayout>
moefuse_status launch100(const moefuse_down_scatter_args& a, int sms, cudaStream_t stream, const char* name) {
  return launch<Config100<kLayout>, ScatterKernel100<kLayout>, 1, kLayout>(a, sms, stream, name);
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_down_scatter(const moefuse_down_scatter_args* a, void* stream) {
  const char* name = "moefuse_moe_down_scatter";
  moefuse_status st = check(a, name);
  if (st != MOEFUSE_STATUS_OK) return st;
  int device = 0, sms = 0, major = 0;
  st = moefuse::check_hopper_or_blackwell(name, &major, &sms, &device);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (a->rows == 0) return MOEFUSE_STATUS_OK;
  const auto s = static_cast<cudaStream_t>(stream);
  const bool kn = a->b_layout == MOEFUSE_B_LAYOUT_KN;
  if (major == 10) {
    return kn ? launch100<MOEFUSE_B_LAYOUT_KN>(*a, sms, s, name) : launch100<MOEFUSE_B_LAYOUT_NK>(*a, sms, s, name);
  }
  const bool pairs = moefuse::cluster_pairs_pay(a->rows, a->experts, 128);
  if (kn) {
    return pairs ? launch90<2, MOEFUSE_B_LAYOUT_KN>(*a, sms, s, name) : launch90<1, MOEFUSE_B_LAYOUT_KN>(*a, sms, s, name);
  }
  return pairs ? launch90<2, MOEFUSE_B_LAYOUT_NK>(*a, sms, s, name) : launch90<1, MOEFUSE_B_LAYOUT_NK>(*a, sms, s, name);
}
