// Host launcher shared by the sm90 and sm100 grouped GEMM variants: checks, workspace
// (CUTLASS's own, then the per-group arrays), the device-side prepare kernel, the
// CUTLASS ptr-array grouped kernel. One stream, no host synchronisation: graph-capturable.
// A `Config` provides `Gemm` (a GemmUniversalAdapter over a GroupProblemShape kernel),
// `kMajor`/`kMinor`, `kKind` (M- or K-grouped) and `kBLayout`.
#pragma once

#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "moefuse/abi.h"
#include "moefuse/common/group_layout.cuh"
#include "moefuse/common/status.hpp"

namespace moefuse {

template <class Config>
struct GroupedLauncher {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using Arrays = GroupedArrays<Kernel>;
  static constexpr size_t kAlign = Arrays::kAlign;

  // Sizes, layout and tile order: all the workspace query needs.
  static moefuse_status check(const moefuse_grouped_gemm_args* p, const char* name) {
    if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
    if (Config::kKind == GroupedKind::kMGrouped && p->b_layout != Config::kBLayout) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: b_layout %d, variant is compiled for %d", name,
                  p->b_layout, int(Config::kBLayout));
    }
    const int swizzle = (p->tile_order >> 8) & 0xff;
    if ((p->tile_order & 3) == 3 || (p->tile_order & ~0xff03) != 0 || (swizzle & (swizzle - 1)) != 0 || swizzle > 8) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tile_order %#x: raster 0-2, swizzle 1, 2, 4 or 8", name,
                  p->tile_order);
    }
    if (p->num_groups < 0 || p->total_rows < 0 || p->n <= 0 || p->k <= 0) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: groups=%d rows=%d n=%d k=%d", name, p->num_groups,
                  p->total_rows, p->n, p->k);
    }
    if (p->n % 8 != 0 || p->k % 8 != 0) {
      return fail(MOEFUSE_STATUS_MISALIGNED, "%s: n=%d and k=%d must be multiples of 8 (16-byte rows)", name,
                  p->n, p->k);
    }
    return MOEFUSE_STATUS_OK;
  }

  static typename Gemm::Arguments arguments(const moefuse_grouped_gemm_args& p, const Arrays& arr, int device,
                                            int sms) {
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion{};
    fusion.alpha = p.alpha;
    fusion.beta = p.beta;
    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.num_groups, arr.shapes, nullptr},
        {arr.a, arr.stride_a, arr.b, arr.stride_b},
        {fusion, p.beta != 0.f ? arr.c : nullptr, arr.stride_c, arr.d, arr.stride_d}};
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sms;
    using Raster = decltype(args.scheduler.raster_order);
    const int raster = p.tile_order & 3;
    if (raster == 1) args.scheduler.raster_order = Raster::AlongM;
    if (raster == 2) args.scheduler.raster_order = Raster::AlongN;
    const int swizzle = (p.tile_order >> 8) & 0xff;
    if (swizzle > 1) args.scheduler.max_swizzle_size = swizzle;
    return args;
  }

  static size_t cutlass_bytes(const moefuse_grouped_gemm_args& p, int device, int sms) {
    size_t ws = Gemm::get_workspace_size(arguments(p, Arrays{}, device, sms));
    return (ws + kAlign - 1) / kAlign * kAlign;
  }

  static size_t workspace(const moefuse_grouped_gemm_args* p, const char* name) {
    if (check(p, name) != MOEFUSE_STATUS_OK) return 0;
    int device = 0, sms = 0;
    if (check_device(Config::kMajor, Config::kMinor, name, &sms, &device) != MOEFUSE_STATUS_OK) return 0;
    return cutlass_bytes(*p, device, sms) + Arrays::bytes(p->num_groups);
  }

  static moefuse_status run(const moefuse_grouped_gemm_args* p, void* ws, size_t ws_bytes, cudaStream_t stream,
                            const char* name) {
    moefuse_status st = check(p, name);
    if (st != MOEFUSE_STATUS_OK || p->num_groups == 0) return st;
    st = check_grouped_pointers(p, name);
    if (st != MOEFUSE_STATUS_OK) return st;
    int device = 0, sms = 0;
    st = check_device(Config::kMajor, Config::kMinor, name, &sms, &device);
    if (st != MOEFUSE_STATUS_OK) return st;
    const size_t lead = cutlass_bytes(*p, device, sms);
    const size_t need = lead + Arrays::bytes(p->num_groups);
    if (ws == nullptr || ws_bytes < need || reinterpret_cast<uintptr_t>(ws) % kAlign != 0) {
      return fail(MOEFUSE_STATUS_WORKSPACE_TOO_SMALL, "%s: workspace %p of %zu bytes, needs %zu bytes, %zu-aligned",
                  name, ws, ws_bytes, need, kAlign);
    }
    Arrays arr = Arrays::carve(static_cast<char*>(ws) + lead, p->num_groups);
    const int threads = 256;
    prepare_groups<Kernel, Config::kKind><<<(p->num_groups + threads - 1) / threads, threads, 0, stream>>>(*p, arr);
    st = from_cuda(cudaGetLastError(), "prepare_groups");
    if (st != MOEFUSE_STATUS_OK) return st;
    if (Config::kKind == GroupedKind::kKGrouped && p->beta == 0.f) {
      zero_empty_groups<typename Arrays::ED><<<dim3(16, p->num_groups), threads, 0, stream>>>(*p);
      st = from_cuda(cudaGetLastError(), "zero_empty_groups");
      if (st != MOEFUSE_STATUS_OK) return st;
    }
    auto args = arguments(*p, arr, device, sms);
    Gemm gemm;
    st = from_cutlass(gemm.initialize(args, ws, stream), name, "initialize");
    if (st != MOEFUSE_STATUS_OK) return st;
    st = from_cutlass(gemm.run(stream), name, "run");
    if (st != MOEFUSE_STATUS_OK) return st;
    return from_cuda(cudaGetLastError(), name);
  }
};

}  // namespace moefuse

// Defines the two C entry points of one grouped GEMM variant (generated instance files).
#define MOEFUSE_DEFINE_GROUPED(NAME, ...)                                                            \
  extern "C" size_t moefuse_##NAME##_workspace(const moefuse_grouped_gemm_args* args) {              \
    return moefuse::GroupedLauncher<__VA_ARGS__>::workspace(args, #NAME);                            \
  }                                                                                                  \
  extern "C" moefuse_status moefuse_##NAME(const moefuse_grouped_gemm_args* args, void* workspace,   \
                                           size_t workspace_bytes, void* stream) {                   \
    return moefuse::GroupedLauncher<__VA_ARGS__>::run(args, workspace, workspace_bytes,              \
                                                      static_cast<cudaStream_t>(stream), #NAME);     \
  }
