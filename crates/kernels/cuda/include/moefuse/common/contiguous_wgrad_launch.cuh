// The host launcher of the contiguous K-grouped wgrad variants, both archs (Config:
// sm90/ or sm100/contiguous_wgrad.cuh's ContiguousWgradBf16, which names its kernel entry
// `kEntry` and fills its arch's own fields in `finish_params`): checks, the producer's TMA
// maps and the persistent launch. Same C entry points as every grouped variant; no
// workspace. Takes a_rows and b_rows (abi.h "Gathered rows").
#pragma once

#include "cutlass/fast_math.h"
#include "moefuse/abi.h"
#include "moefuse/common/cluster_launch.cuh"
#include "moefuse/common/group_layout.cuh"
#include "moefuse/common/status.hpp"
#include "moefuse/common/tensor_map.hpp"

namespace moefuse {

template <class Config>
struct ContiguousWgradLauncher {
  using Kernel = typename Config::Kernel;
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

  // The producer's operands and the store's; then the arch's own fields
  // (Config::finish_params: Hopper's D map and collective arguments).
  static moefuse_status params(const moefuse_grouped_gemm_args& p, Params& out) {
    // The maps span the total_rows rows (at least 1); only whole chunks inside a group use them.
    const cuuint64_t rows = cuuint64_t(p.total_rows > 0 ? p.total_rows : 1);
    const cuuint64_t m = cuuint64_t(p.k), n = cuuint64_t(p.n);
    // A gathered operand has its source_rows rows and is read by cp.async only (its map
    // spans them and is never used).
    const cuuint64_t b_rows = p.b_rows != nullptr ? cuuint64_t(p.b_source_rows) : rows;
    const cuuint64_t a_rows = p.a_rows != nullptr ? cuuint64_t(p.a_source_rows) : rows;
    moefuse_status st = encode_bf16_map<2>(&out.a_chunk, p.a, {m, a_rows}, {m * 2}, {64, 64}, "A chunks");
    if (st == MOEFUSE_STATUS_OK) st = encode_bf16_map<2>(&out.b_chunk, p.b, {n, b_rows}, {n * 2}, {64, 64}, "B chunks");
    if (st != MOEFUSE_STATUS_OK) return st;
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
    return Config::finish_params(p, out);
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
    return launch_on_clusters<kCluster, Config::kEntry>(
        Kernel::kThreads, Kernel::kSharedBytes, sms, units, stream, name, prm);
  }
};

}  // namespace moefuse

// Defines the two C entry points of one contiguous wgrad variant (generated instance files).
#define MOEFUSE_DEFINE_CONTIGUOUS_WGRAD(NAME, ...)                                                  \
  extern "C" size_t moefuse_##NAME##_workspace(const moefuse_grouped_gemm_args* args) {              \
    return moefuse::ContiguousWgradLauncher<__VA_ARGS__>::workspace(args, #NAME); \
  }                                                                                                  \
  extern "C" moefuse_status moefuse_##NAME(const moefuse_grouped_gemm_args* args, void* workspace,   \
                                           size_t workspace_bytes, void* stream) {                   \
    return moefuse::ContiguousWgradLauncher<__VA_ARGS__>::run(                  \
        args, workspace, workspace_bytes, static_cast<cudaStream_t>(stream), #NAME);                 \
  }
