// Host launcher of the down dgrad with the routed activation backward (moe_abi.h:
// moefuse_moe_down_dgrad_fused): the contiguous grouped GEMM (kernel/sm90_contiguous_grouped.cuh,
// 128 x 256 x 64 tiles, W_e as [K, N]) gathering dy's token rows by source_of in its
// producer, with epilogue::ActivationBackwardRows in place of the store, then a small kernel
// that sums each row's per-block partials into d_weights in block order. CTA pairs share
// W_e's tiles when the experts average two m-blocks of rows (the fused gate_up's rule;
// MOEFUSE_DOWN_DGRAD_CLUSTER = 1 | 2 forces one, an A/B knob read once per process). On
// compute capability 10.0 the Blackwell contiguous kernel (kernel/sm100_contiguous_grouped.cuh,
// single CTAs) runs with epilogue::ActivationBackwardRow. A fat object like the other MoE
// kernels: each arch's image carries its own kernel, the other one a trap the capability
// check keeps from running.

#include "moefuse/common/group_layout.cuh"
#include "moefuse/epilogue/activation_backward_row.cuh"
#include "moefuse/epilogue/activation_backward_rows.cuh"
#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"
#include "moefuse/sm100/contiguous_grouped_gemm.cuh"
#include "moefuse/sm90/contiguous_grouped_gemm.cuh"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_down_dgrad_args) == 136, "moefuse_down_dgrad_args layout changed: update ffi.rs");
static_assert(offsetof(moefuse_down_dgrad_args, offsets) == 40, "moefuse_down_dgrad_args layout changed");
static_assert(offsetof(moefuse_down_dgrad_args, partials) == 104, "moefuse_down_dgrad_args layout changed");
static_assert(offsetof(moefuse_down_dgrad_args, expect_tokens) == 128, "moefuse_down_dgrad_args layout changed");

namespace moefuse::moe {
namespace {

template <int kClusterM>
using Config = sm90::ContiguousGroupedBf16<128, 256, 64, kClusterM, 1, sm90::Contiguous, MOEFUSE_B_LAYOUT_KN>;
template <int kClusterM>
using FusedKernel =
    kernel::Sm90ContiguousGrouped<typename Config<kClusterM>::CollectiveMainloop, Config<kClusterM>::kMaxGroups,
                                  epilogue::RowsInOrder, epilogue::ActivationBackwardRows>;
using Config100 = sm100::ContiguousGroupedBf16<128, 256, 64, 1, 1, sm100::Contiguous, MOEFUSE_B_LAYOUT_KN>;
using FusedKernel100 = kernel::Sm100ContiguousGrouped<typename Config100::CollectiveMainloop, Config100::kMaxGroups,
                                                      epilogue::RowsInOrder, epilogue::ActivationBackwardRow>;
constexpr int kMaxGroups = Config<1>::kMaxGroups;
static_assert(FusedKernel<1>::kTileN == MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK &&
                  FusedKernel<2>::kTileN == MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK &&
                  FusedKernel100::kTileN == MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK && Config100::kMaxGroups == kMaxGroups,
              "down dgrad fused: one partial per tile column block, the same group limit on both archs");

int column_blocks(int intermediate) {
  return (intermediate + MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK - 1) / MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK;
}

moefuse_status check(const moefuse_down_dgrad_args* a, const char* name) {
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (!known_activation(a->activation, a->layout)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: activation %d, layout %d", name, a->activation, a->layout);
  }
  if (a->tokens < 0 || a->top_k < 1 || a->top_k > 16 || a->experts < 1 || a->experts > kMaxGroups ||
      a->hidden < 8 || a->intermediate < 8 || a->intermediate > (1 << 28) ||
      int64_t(a->tokens) * a->top_k > INT32_MAX) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens=%d top_k=%d experts=%d (1..%d) hidden=%d intermediate=%d",
                name, a->tokens, a->top_k, a->experts, kMaxGroups, a->hidden, a->intermediate);
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
  if (a->offsets == nullptr || a->source_of == nullptr || a->weights == nullptr || a->dy == nullptr ||
      a->w == nullptr || a->h_pre == nullptr || a->d_h_pre == nullptr || a->h_scaled == nullptr ||
      a->partials == nullptr || a->d_weights == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if (!aligned16(a->dy) || !aligned16(a->w) || !aligned16(a->h_pre) || !aligned16(a->d_h_pre) ||
      !aligned16(a->h_scaled) ||
      ((reinterpret_cast<uintptr_t>(a->offsets) | reinterpret_cast<uintptr_t>(a->source_of) |
        reinterpret_cast<uintptr_t>(a->weights) | reinterpret_cast<uintptr_t>(a->partials) |
        reinterpret_cast<uintptr_t>(a->d_weights)) & 3u)) {
    return fail(MOEFUSE_STATUS_MISALIGNED,
                "%s: dy, w, h_pre, d_h_pre, h_scaled must be 16-byte aligned; offsets, source_of, weights, "
                "partials, d_weights 4",
                name);
  }
  return MOEFUSE_STATUS_OK;
}

// The plain contiguous GEMM's problem over the same operands (A = dy gathered by source_of,
// D unused: the fused epilogue stores), for its checks and parameters.
moefuse_grouped_gemm_args gemm_problem(const moefuse_down_dgrad_args& a) {
  moefuse_grouped_gemm_args g{};
  g.num_groups = a.experts;
  g.total_rows = a.tokens * a.top_k;
  g.n = a.intermediate;
  g.k = a.hidden;
  g.b_layout = MOEFUSE_B_LAYOUT_KN;
  g.tile_order = a.tile_order;
  g.offsets = a.offsets;
  g.a = a.dy;
  g.b = a.w;
  g.d = a.h_scaled;  // never stored through (checked non-null by the grouped checks)
  g.alpha = 1.f;
  g.beta = 0.f;
  g.a_rows = a.source_of;
  g.a_rows_div = a.top_k;
  g.a_source_rows = a.tokens;
  return g;
}

// Cfg/K: the Hopper config and kernel (CTA pairs with kClusterM = 2) or the Blackwell ones.
template <class Cfg, class K, int kClusterM>
moefuse_status launch(const moefuse_down_dgrad_args& a, const moefuse_grouped_gemm_args& g, int sms,
                      cudaStream_t stream, const char* name) {
  typename K::Params p = ContiguousGroupedLauncher<Cfg>::template params<typename K::Params>(g);
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  p.fusion.h_pre = reinterpret_cast<const __nv_bfloat16*>(a.h_pre);
  p.fusion.d_h_pre = reinterpret_cast<__nv_bfloat16*>(a.d_h_pre);
  p.fusion.h_scaled = reinterpret_cast<__nv_bfloat16*>(a.h_scaled);
  p.fusion.partials = a.partials;
  p.fusion.source_of = a.source_of;
  p.fusion.weights = a.weights;
  p.fusion.errors = a.errors;
  p.fusion.slots = a.tokens * a.top_k;
  p.fusion.n_blocks = column_blocks(a.intermediate);
  p.fusion.width = gated ? 2 * a.intermediate : a.intermediate;
  p.fusion.act = ActivationProblem{a.activation, a.layout, a.intermediate, a.alpha, a.limit, gated};
  const int64_t n_blocks = p.fusion.n_blocks;
  const int64_t max_units = (int64_t(g.total_rows) / (int64_t(K::kTileM) * kClusterM) + a.experts) * n_blocks;
  return launch_on_clusters<kClusterM, Cfg::template kEntry<K>>(K::kThreads, K::kSharedBytes, sms, max_units, stream,
                                                                name, p);
}

// d_weights[source_of[r]] = the row's partials summed in block order, for the rows the
// offsets count (one thread per row); nothing with a stale stamp.
__global__ void __launch_bounds__(256)
    sum_partials_kernel(int slots, int n_blocks, int tokens, const int32_t* __restrict__ last_offset,
                        const int32_t* __restrict__ source_of, const float* __restrict__ partials,
                        float* __restrict__ d_weights, uint32_t* errors, const uint32_t* expect_tokens) {
  if (expect_tokens != nullptr && int64_t(*expect_tokens) != tokens) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && errors != nullptr) atomicOr(errors, MOEFUSE_MOE_ERROR_STALE);
    return;
  }
  const int total = *last_offset;
  const int rows = total < 0 ? 0 : (total > slots ? slots : total);  // one row per slot at most
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    const int s = source_of[r];
    if (s < 0 || s >= slots) continue;  // flagged by the GEMM's epilogue
    float sum = 0.f;
    for (int b = 0; b < n_blocks; ++b) sum += partials[int64_t(r) * n_blocks + b];
    d_weights[s] = sum;
  }
}

// Pairs by moefuse::cluster_pairs_pay's rule, MOEFUSE_DOWN_DGRAD_CLUSTER = 1 | 2 forcing either.
bool cluster_pairs(const moefuse_down_dgrad_args& a) {
  static const int forced = moefuse::cluster_override("MOEFUSE_DOWN_DGRAD_CLUSTER");
  return moefuse::cluster_pairs_pay(int64_t(a.tokens) * a.top_k, a.experts, FusedKernel<1>::kTileM, forced);
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_down_dgrad_fused(const moefuse_down_dgrad_args* a, void* stream) {
  const char* name = "moefuse_moe_down_dgrad_fused";
  moefuse_status st = check(a, name);
  if (st != MOEFUSE_STATUS_OK) return st;
  int device = 0, sms = 0, major = 0;
  st = moefuse::check_hopper_or_blackwell(name, &major, &sms, &device);
  if (st != MOEFUSE_STATUS_OK || a->tokens == 0) return st;
  const moefuse_grouped_gemm_args g = gemm_problem(*a);
  st = moefuse::ContiguousGroupedLauncher<Config<1>>::check(&g, name);
  if (st != MOEFUSE_STATUS_OK) return st;
  st = moefuse::check_grouped_pointers(&g, name, /*gathers_b=*/false, /*gathers_a=*/true);
  if (st != MOEFUSE_STATUS_OK) return st;
  const auto s = static_cast<cudaStream_t>(stream);
  if (major == 10) {
    st = launch<Config100, FusedKernel100, 1>(*a, g, sms, s, name);
  } else {
    st = cluster_pairs(*a) ? launch<Config<2>, FusedKernel<2>, 2>(*a, g, sms, s, name)
                           : launch<Config<1>, FusedKernel<1>, 1>(*a, g, sms, s, name);
  }
  if (st != MOEFUSE_STATUS_OK) return st;
  const int rows = g.total_rows;
  const int blocks = (rows + 255) / 256 < 1024 ? (rows + 255) / 256 : 1024;
  sum_partials_kernel<<<blocks, 256, 0, s>>>(rows, column_blocks(a->intermediate), a->tokens,
                                             a->offsets + (a->experts - 1), a->source_of, a->partials, a->d_weights,
                                             a->errors, a->expect_tokens);
  return after_launch(name);
}
