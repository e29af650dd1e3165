// Host launcher of the fused gate_up (moe_abi.h: moefuse_moe_gate_up_fused): checks, the two
// tensor maps (x gathered row by row, W_e in 128-row boxes) and the persistent launch of
// kernel/sm90_gate_up_fused.cuh on compute capability 9.0, kernel/sm100_gate_up_fused.cuh on
// 10.0. A fat object like the other MoE kernels: each arch's image carries its own kernel,
// the other one a trap the capability check keeps from running.

#include "cutlass/gemm/collective/collective_builder.hpp"
#include "moefuse/common/cluster_launch.cuh"
#include "moefuse/common/stride.hpp"
#include "moefuse/common/tensor_map.hpp"
#include "moefuse/kernel/sm100_gate_up_fused.cuh"
#include "moefuse/kernel/sm90_gate_up_fused.cuh"
#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_gate_up_args) == 168, "moefuse_gate_up_args layout changed: update ffi.rs");
static_assert(offsetof(moefuse_gate_up_args, alpha) == 32, "moefuse_gate_up_args layout changed");
static_assert(offsetof(moefuse_gate_up_args, offsets) == 40, "moefuse_gate_up_args layout changed");
static_assert(offsetof(moefuse_gate_up_args, errors) == 88, "moefuse_gate_up_args layout changed");
static_assert(offsetof(moefuse_gate_up_args, peer_x) == 104, "moefuse_gate_up_args layout changed");

namespace moefuse::moe {
namespace {

using Element = cutlass::bfloat16_t;
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
constexpr int kMaxGroups = 512;
constexpr int kDefaultBand = 4;
using Table = sched::ContiguousGroupTable<kMaxGroups>;
using CarveOut = cute::Int<int(sizeof(Table) + sizeof(epilogue::MaskedRowsStorage)) + 64>;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::ColumnMajor, 8, float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
    cutlass::gemm::collective::StageCountAutoCarveout<CarveOut::value>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel = kernel::Sm90GateUpFused<Mainloop, kMaxGroups>;
using KernelPair = kernel::Sm90GateUpFused<Mainloop, kMaxGroups, 2>;
// The expert-parallel pull dispatch's twins: rows read from the ranks' x in place.
using KernelPeer = kernel::Sm90GateUpFused<Mainloop, kMaxGroups, 1, true>;
using KernelPeerPair = kernel::Sm90GateUpFused<Mainloop, kMaxGroups, 2, true>;
static_assert(sizeof(Kernel::Params) == sizeof(KernelPair::Params) && Kernel::kSharedBytes == KernelPair::kSharedBytes &&
                  sizeof(Kernel::Params) == sizeof(KernelPeerPair::Params) &&
                  Kernel::kSharedBytes == KernelPeerPair::kSharedBytes,
              "fused gate_up: the four kernels share their parameters and shared memory");

// The per-row boxes write where the collective's layouts say row r of a stage lives: rows
// 128 bytes apart (8-row swizzle atoms stacked along M), stages one tile apart, and the
// 128-byte swizzle (Swizzle<3,4,3> on byte addresses, applied through the smem pointer)
// that the tensor maps' CU_TENSOR_MAP_SWIZZLE_128B writes.
using SmemA = typename Mainloop::SmemLayoutA;
using SmemB = typename Mainloop::SmemLayoutB;
static_assert(cute::is_same_v<decltype(SmemA{}.layout_a()), cute::Swizzle<3, 4, 3>> &&
                  cute::is_same_v<decltype(SmemB{}.layout_a()), cute::Swizzle<3, 4, 3>>,
              "fused gate_up: A and B stages must use the 128-byte swizzle");
static_assert(SmemA{}.layout_b()(1, 0, 0) == 64 && SmemA{}.layout_b()(8, 0, 0) == 8 * 64 &&
                  SmemA{}.layout_b()(0, 8, 0) == 8 && SmemA{}.layout_b()(0, 0, 1) == 128 * 64,
              "fused gate_up: A stage rows are not 128-byte rows of a 128 x 64 tile");
static_assert(SmemB{}.layout_b()(8, 0, 0) == 8 * 64 && SmemB{}.layout_b()(128, 0, 0) == 128 * 64 &&
                  SmemB{}.layout_b()(0, 0, 1) == 256 * 64,
              "fused gate_up: B stage rows are not 128-byte rows of a 256 x 64 tile");

// Blackwell: CUTLASS's 1-SM UMMA collective for the layouts and the tiled MMA (128 x 256 x
// 64 tiles, as on Hopper), stages sized beside this kernel's own shared storage.
using Table100 = sched::ContiguousGroupTable<kMaxGroups>;
using CarveOut100 = cute::Int<int(sizeof(Table100)) + 256>;
using Mainloop100 = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::ColumnMajor, 8, float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
    cutlass::gemm::collective::StageCountAutoCarveout<CarveOut100::value>,
    cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;
using Kernel100 = kernel::Sm100GateUpFused<Mainloop100, kMaxGroups>;
using KernelPeer100 = kernel::Sm100GateUpFused<Mainloop100, kMaxGroups, true>;
static_assert(Kernel100::kSharedBytes <= 232448, "sm100 fused gate_up: shared storage over the 227 KB a CTA may use");

// The producer writes where the UMMA layouts read (the Hopper asserts above, in the UMMA
// layouts' ((M, K), m, k, stage) coordinates): rows of 128 bytes, 16-element k-blocks
// side by side in a row, stages one tile apart, the 128-byte swizzle.
using SmemA100 = typename Mainloop100::SmemLayoutA;
using SmemB100 = typename Mainloop100::SmemLayoutB;
static_assert(cute::is_same_v<decltype(SmemA100{}.layout_a()), cute::Swizzle<3, 4, 3>> &&
                  cute::is_same_v<decltype(SmemB100{}.layout_a()), cute::Swizzle<3, 4, 3>>,
              "sm100 fused gate_up: A and B stages must use the 128-byte swizzle");
static_assert(SmemA100{}.layout_b()(cute::make_coord(cute::make_coord(1, 0), 0, 0, 0)) == 64 &&
                  SmemA100{}.layout_b()(cute::make_coord(cute::make_coord(0, 1), 0, 0, 0)) == 1 &&
                  SmemA100{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 1, 0)) == 16 &&
                  SmemA100{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 0, 1)) == 128 * 64,
              "sm100 fused gate_up: A stage rows are not 128-byte rows of a 128 x 64 tile");
static_assert(SmemB100{}.layout_b()(cute::make_coord(cute::make_coord(1, 0), 0, 0, 0)) == 64 &&
                  SmemB100{}.layout_b()(cute::make_coord(cute::make_coord(128, 0), 0, 0, 0)) == 128 * 64 &&
                  SmemB100{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 1, 0)) == 16 &&
                  SmemB100{}.layout_b()(cute::make_coord(cute::make_coord(0, 0), 0, 0, 1)) == 256 * 64,
              "sm100 fused gate_up: B stage rows are not 128-byte rows of a 256 x 64 tile");

moefuse_status check(const moefuse_gate_up_args* a, const char* name) {
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (!known_activation(a->activation, a->layout)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: activation %d, layout %d", name, a->activation, a->layout);
  }
  if (a->tokens < 0 || a->top_k < 1 || a->top_k > 16 || a->experts < 1 || a->experts > kMaxGroups ||
      a->hidden < 8 || a->intermediate < 8 || a->intermediate > (1 << 28) ||
      int64_t(a->tokens) * a->top_k > INT32_MAX) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens=%d top_k=%d experts=%d hidden=%d intermediate=%d", name,
                a->tokens, a->top_k, a->experts, a->hidden, a->intermediate);
  }
  if (a->hidden % 8 != 0 || a->intermediate % 8 != 0) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: hidden=%d and intermediate=%d must be multiples of 8", name,
                a->hidden, a->intermediate);
  }
  const int band = (a->tile_order >> 8) & 0xff;
  if ((a->tile_order & 3) == 3 || (a->tile_order & ~0x100ff03) != 0 || (band & (band - 1)) != 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tile_order %#x: raster 0-2, band a power of two, interleave",
                name, a->tile_order);
  }
  // The gathering producer keeps 32-bit chunk offsets into x (sm90_gate_up_fused.cuh).
  if (int64_t(a->tokens) * a->hidden / 8 >= (int64_t(1) << 32)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: x of %d x %d exceeds 2^32 16-byte chunks", name, a->tokens,
                a->hidden);
  }
  if (a->peers < 0 || a->peers > MOEFUSE_GATE_UP_MAX_PEERS ||
      (a->peers > 0 && (a->source_of == nullptr || a->peer_rows < 1))) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: peers=%d (0..%d, with source_of), peer_rows=%d", name, a->peers,
                MOEFUSE_GATE_UP_MAX_PEERS, a->peer_rows);
  }
  for (int s = 0; s < a->peers; ++s) {
    if (a->peer_x[s] == nullptr || !aligned16(a->peer_x[s])) {
      return fail(MOEFUSE_STATUS_MISALIGNED, "%s: peer_x[%d] must be a 16-byte aligned address", name, s);
    }
  }
  if (a->offsets == nullptr || (a->peers == 0 && a->x == nullptr) || a->w == nullptr || a->h == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if ((a->x != nullptr && !aligned16(a->x)) || !aligned16(a->w) || !aligned16(a->h) || (a->h_pre != nullptr && !aligned16(a->h_pre)) ||
      !aligned_for(a->offsets) || !aligned_for(a->source_of)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: x, w, h, h_pre must be 16-byte aligned, offsets and source_of 4",
                name);
  }
  return MOEFUSE_STATUS_OK;
}

// Whether kernel K is a Hopper one (its Params carry the sm90 collective's).
template <class K>
constexpr bool kHopper = cute::is_same_v<typename K::Mainloop, Mainloop>;

template <class K>
moefuse_status params_of(const moefuse_gate_up_args& a, typename K::Params& p) {
  using namespace cute;
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int64_t width = gated ? 2 * int64_t(a.intermediate) : a.intermediate;
  const int64_t rows = int64_t(a.tokens) * a.top_k;
  const int64_t tokens = a.tokens > 0 ? a.tokens : 1;
  moefuse_status st = moefuse::encode_bf16_map<3>(&p.tmap_w, a.w, {cuuint64_t(a.hidden), cuuint64_t(width), cuuint64_t(a.experts)},
                 {cuuint64_t(a.hidden) * 2, cuuint64_t(width * a.hidden) * 2}, {64, 128, 1}, "W boxes");
  if (st != MOEFUSE_STATUS_OK) return st;
  // Peer rows: x is not read; the collective's (unread) Params still need an operand.
  const void* x = a.peers > 0 ? static_cast<const void*>(a.peer_x[0]) : a.x;
  if (a.source_of == nullptr) {  // contiguous: x is [tokens * top_k, hidden], rows in order
    st = moefuse::encode_bf16_map<2>(&p.tmap_rows, a.x, {cuuint64_t(a.hidden), cuuint64_t(rows)},
                                     {cuuint64_t(a.hidden) * 2}, {64, 128}, "x rows");
    if (st != MOEFUSE_STATUS_OK) return st;
  }
  if constexpr (kHopper<K>) {
    // The collective's own Params, never read by mma() (see the kernel): built over the same
    // operands as a dense problem so every map in it is valid.
    using StrideA = typename Mainloop::StrideA;
    using StrideB = typename Mainloop::StrideB;
    StrideA sa = leading_stride<StrideA>(a.hidden);
    get<2>(sa) = 0;
    StrideB sb = leading_stride<StrideB>(a.hidden);
    get<2>(sb) = width * a.hidden;
    typename Mainloop::Arguments args{reinterpret_cast<const Element*>(x), sa, reinterpret_cast<const Element*>(a.w),
                                      sb};
    p.mainloop = Mainloop::to_underlying_arguments(make_shape(int(tokens), int(width), a.hidden, 1), args, nullptr);
  }
  const int band = (a.tile_order >> 8) & 0xff;
  p.offsets = a.offsets;
  p.source_of = a.source_of;
  p.x = reinterpret_cast<const Element*>(x);
  p.peers = a.peers;
  p.peer_rows = a.peer_rows;
  for (int s = 0; s < MOEFUSE_GATE_UP_MAX_PEERS; ++s) {
    p.peer_x[s] = reinterpret_cast<const Element*>(s < a.peers ? a.peer_x[s] : a.peer_x[0]);
  }
  p.h = reinterpret_cast<Element*>(a.h);
  p.h_pre = reinterpret_cast<Element*>(a.h_pre);
  p.errors = a.errors;
  p.groups = a.experts;
  p.max_rows = int(rows);
  p.top_k = a.top_k;
  p.hidden = a.hidden;
  p.inter = a.intermediate;
  p.width = int(width);
  p.act = a.activation;
  p.layout = a.layout;
  p.alpha = a.alpha;
  p.limit = a.limit;
  p.band = band > 0 ? band : kDefaultBand;
  p.n_fast = (a.tile_order & 3) == 1 ? 0 : 1;
  p.interleave = (a.tile_order >> 24) & 1;
  return MOEFUSE_STATUS_OK;
}

// Whether W_e boxes are shared by CTA pairs (KernelPair): moefuse::cluster_pairs_pay's rule,
// MOEFUSE_GATE_UP_CLUSTER = 1 | 2 forcing either.
bool cluster_pairs(const moefuse_gate_up_args& a) {
  static const int forced = moefuse::cluster_override("MOEFUSE_GATE_UP_CLUSTER");
  return moefuse::cluster_pairs_pay(int64_t(a.tokens) * a.top_k, a.experts, Kernel::kTileM, forced);
}

// The persistent launch of kernel K (common/cluster_launch.cuh).
template <class K>
moefuse_status launch(const moefuse_gate_up_args& a, int sms, cudaStream_t stream, const char* name) {
  typename K::Params p{};
  moefuse_status st = params_of<K>(a, p);
  if (st != MOEFUSE_STATUS_OK) return st;
  constexpr int kCluster = K::kClusterM;
  const int h_cols = K::h_cols_per_tile(a.activation);
  const int64_t n_blocks = (a.intermediate + h_cols - 1) / h_cols;
  const int64_t max_units = (int64_t(p.max_rows) / (K::kTileM * kCluster) + a.experts) * n_blocks;
  if constexpr (kHopper<K>) {
    return moefuse::launch_on_clusters<kCluster, &moefuse::kernel::sm90_gate_up_fused_kernel<K>>(
        K::kThreads, K::kSharedBytes, sms, max_units, stream, name, p);
  } else {
    return moefuse::launch_on_clusters<kCluster, &moefuse::kernel::sm100_gate_up_fused_kernel<K>>(
        K::kThreads, K::kSharedBytes, sms, max_units, stream, name, p);
  }
}


}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_gate_up_fused(const moefuse_gate_up_args* a, void* stream) {
  const char* name = "moefuse_moe_gate_up_fused";
  moefuse_status st = check(a, name);
  if (st != MOEFUSE_STATUS_OK) return st;
  int device = 0, sms = 0, major = 0;
  st = moefuse::check_hopper_or_blackwell(name, &major, &sms, &device);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (a->tokens == 0) return MOEFUSE_STATUS_OK;
  const auto s = static_cast<cudaStream_t>(stream);
  if (major == 10) {  // single CTAs (kernel/sm100_gate_up_fused.cuh)
    return a->peers > 0 ? launch<KernelPeer100>(*a, sms, s, name) : launch<Kernel100>(*a, sms, s, name);
  }
  if (a->peers > 0) {
    return cluster_pairs(*a) ? launch<KernelPeerPair>(*a, sms, s, name) : launch<KernelPeer>(*a, sms, s, name);
  }
  return cluster_pairs(*a) ? launch<KernelPair>(*a, sms, s, name) : launch<Kernel>(*a, sms, s, name);
}
