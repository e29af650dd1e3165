// The host launcher of the contiguous grouped GEMM variants, both archs (Config:
// sm90/ or sm100/contiguous_grouped_gemm.cuh's ContiguousGroupedBf16, which names its kernel
// entry `kEntry`): checks, the TMA maps and the persistent launch. Same C entry points as
// every grouped variant; no workspace. Takes a_rows (abi.h "Gathered rows").
#pragma once

#include "moefuse/abi.h"
#include "moefuse/common/cluster_launch.cuh"
#include "moefuse/common/contiguous_params.hpp"
#include "moefuse/common/group_layout.cuh"
#include "moefuse/common/status.hpp"
#include "moefuse/common/stride.hpp"

namespace moefuse {

template <class Config>
struct ContiguousGroupedLauncher {
  using Kernel = typename Config::Kernel;
  using Mainloop = typename Kernel::Mainloop;
  using Params = typename Kernel::Params;
  static constexpr int kDefaultBand = 4;

  static moefuse_status check(const moefuse_grouped_gemm_args* p, const char* name) {
    if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
    if (p->b_layout != Config::kBLayout) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: b_layout %d, variant is compiled for %d", name, p->b_layout,
                  int(Config::kBLayout));
    }
    if (p->num_groups < 0 || p->num_groups > Config::kMaxGroups || p->total_rows < 0 || p->n <= 0 || p->k <= 0) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: groups=%d (at most %d) rows=%d n=%d k=%d", name,
                  p->num_groups, Config::kMaxGroups, p->total_rows, p->n, p->k);
    }
    // tile_order: bits 0-1 raster (0/2: a band's n-blocks first, 1: its m-blocks first),
    // bits 8-15 band height in m-block units (0: default; else a power of two up to 128),
    // bits 16-23 k-blocks of the next tile prefetched into L2 (0: none, the default: prefetching
    // measured slower on the Qwen3 shapes and within noise on the large-K ones), bit 24: the
    // tile list's front and back interleaved (sched/grouped_contiguous.cuh).
    const int band = (p->tile_order >> 8) & 0xff;
    if ((p->tile_order & 3) == 3 || (p->tile_order & ~0x1ffff03) != 0 || (band & (band - 1)) != 0) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tile_order %#x: raster 0-2, band 0 or a power of two", name,
                  p->tile_order);
    }
    if (p->n % 8 != 0 || p->k % 8 != 0) {
      return fail(MOEFUSE_STATUS_MISALIGNED, "%s: n=%d and k=%d must be multiples of 8 (16-byte rows)", name, p->n,
                  p->k);
    }
    return MOEFUSE_STATUS_OK;
  }

  // NOTES: the kernel needs no workspace, but 0 is how a grouped workspace query says
  // "refused" (crates/kernels), so an accepted problem asks for one unused 256-byte slot.
  static size_t workspace(const moefuse_grouped_gemm_args* p, const char* name) {
    if (check(p, name) != MOEFUSE_STATUS_OK) return 0;
    int device = 0, sms = 0;
    if (check_device(Config::kMajor, Config::kMinor, name, &sms, &device) != MOEFUSE_STATUS_OK) return 0;
    return 256;
  }

  // TMA maps: A as [total_rows, K, 1] and W as [N, K, E] (strides per the B layout). P: the
  // Params of this kernel or of its twin with another row store (the same fields, then its
  // row_at, left for the caller).
  template <class P = Params>
  static P params(const moefuse_grouped_gemm_args& p) {
    using namespace cute;
    using StrideA = typename Mainloop::StrideA;
    using StrideB = typename Mainloop::StrideB;
    const int64_t n = p.n, k = p.k;
    // A gathered A has a_source_rows rows, read by cp.async only (its map spans them and is
    // never used for a load).
    const int64_t rows = p.a_rows != nullptr ? p.a_source_rows : p.total_rows;
    StrideA sa = leading_stride<StrideA>(k);
    get<2>(sa) = rows * k;
    StrideB sb = leading_stride<StrideB>(BL_is_nk() ? k : n);
    get<2>(sb) = n * k;
    typename Mainloop::Arguments args{static_cast<const Element*>(p.a), sa, static_cast<const Element*>(p.b), sb};
    // NOTES: the collective builds A and B maps from one (M,N,K,L); A needs L = 1 and B
    // L = E, so each map comes from its own call.
    auto pa = Mainloop::to_underlying_arguments(make_shape(int(rows), p.n, p.k, 1), args, nullptr);
    auto pb = Mainloop::to_underlying_arguments(make_shape(p.total_rows, p.n, p.k, p.num_groups), args, nullptr);
    pa.tma_load_b = pb.tma_load_b;
    P out{};
    out.mainloop = pa;
    fill_contiguous_params(out, p, kDefaultBand);
    return out;
  }

  static moefuse_status run(const moefuse_grouped_gemm_args* p, void* ws, size_t ws_bytes, cudaStream_t stream,
                            const char* name) {
    (void)ws;
    (void)ws_bytes;
    moefuse_status st = check(p, name);
    if (st != MOEFUSE_STATUS_OK || p->num_groups == 0 || p->total_rows == 0) return st;
    st = check_grouped_pointers(p, name, /*gathers_b=*/false, /*gathers_a=*/true);
    if (st != MOEFUSE_STATUS_OK) return st;
    int device = 0, sms = 0;
    st = check_device(Config::kMajor, Config::kMinor, name, &sms, &device);
    if (st != MOEFUSE_STATUS_OK) return st;
    const Params prm = params(*p);
    constexpr int kCluster = Kernel::kClusterM;
    const int64_t n_blocks = (p->n + Kernel::kTileN - 1) / Kernel::kTileN;
    const int64_t unit_rows = int64_t(Kernel::kTileM) * kCluster;
    const int64_t max_units = (int64_t(p->total_rows) / unit_rows + p->num_groups) * n_blocks;
    return launch_on_clusters<kCluster, Config::template kEntry<Kernel>>(Kernel::kThreads, Kernel::kSharedBytes, sms,
                                                                        max_units, stream, name, prm);
  }

 private:
  using Element = cutlass::bfloat16_t;
  static constexpr bool BL_is_nk() { return Config::kBLayout == MOEFUSE_B_LAYOUT_NK; }
};

}  // namespace moefuse

// Defines the two C entry points of one contiguous grouped variant (generated instance files).
#define MOEFUSE_DEFINE_CONTIGUOUS(NAME, ...)                                                          \
  extern "C" size_t moefuse_##NAME##_workspace(const moefuse_grouped_gemm_args* args) {              \
    return moefuse::ContiguousGroupedLauncher<__VA_ARGS__>::workspace(args, #NAME);            \
  }                                                                                                  \
  extern "C" moefuse_status moefuse_##NAME(const moefuse_grouped_gemm_args* args, void* workspace,   \
                                           size_t workspace_bytes, void* stream) {                   \
    return moefuse::ContiguousGroupedLauncher<__VA_ARGS__>::run(args, workspace, workspace_bytes, \
                                                                      static_cast<cudaStream_t>(stream), #NAME); \
  }
