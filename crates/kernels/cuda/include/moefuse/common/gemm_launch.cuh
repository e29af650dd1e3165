// Host launcher shared by the sm90 and sm100 dense GEMM variants: moefuse_gemm_args
// -> CUTLASS Arguments, device and implementability checks, workspace, launch.
// Each arch header provides a `Config` with `Gemm` (a GemmUniversalAdapter),
// `kMajor`/`kMinor` (the one capability an `a` target runs on) and `kBLayout`.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "moefuse/abi.h"
#include "moefuse/common/status.hpp"
#include "moefuse/common/stride.hpp"

namespace moefuse {

template <class Config>
typename Config::Gemm::Arguments to_arguments(const moefuse_gemm_args& p, int device, int sms) {
  using Gemm = typename Config::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  using EA = typename Gemm::ElementA;
  using EB = typename Gemm::ElementB;
  using EC = typename Gemm::ElementC;
  using ED = typename Gemm::ElementD;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.m, p.n, p.k, 1},
      {static_cast<const EA*>(p.a), leading_stride<typename Kernel::StrideA>(p.lda),
       static_cast<const EB*>(p.b), leading_stride<typename Kernel::StrideB>(p.ldb)},
      {{p.alpha, p.beta},
       static_cast<const EC*>(p.c),
       leading_stride<typename Kernel::StrideC>(p.ldc),
       static_cast<ED*>(p.d),
       leading_stride<typename Kernel::StrideD>(p.ldd)}};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  return args;
}

// Checks what the host can know (layout tag, sizes, null pointers) before CUTLASS's
// own can_implement, so the message says which argument is wrong.
template <class Config>
moefuse_status check_args(const moefuse_gemm_args* p, const char* name) {
  if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (p->b_layout != Config::kBLayout) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: b_layout %d, variant is compiled for %d", name,
                p->b_layout, int(Config::kBLayout));
  }
  if (p->m < 0 || p->n <= 0 || p->k <= 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: m=%d n=%d k=%d", name, p->m, p->n, p->k);
  }
  if (p->a == nullptr || p->b == nullptr || p->d == nullptr || (p->beta != 0.f && p->c == nullptr)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null operand (a=%p b=%p c=%p d=%p)", name, p->a,
                p->b, p->c, p->d);
  }
  return MOEFUSE_STATUS_OK;
}

template <class Config>
size_t gemm_workspace(const moefuse_gemm_args* p, const char* name) {
  if (check_args<Config>(p, name) != MOEFUSE_STATUS_OK) return 0;
  int device = 0, sms = 0;
  if (check_device(Config::kMajor, Config::kMinor, name, &sms, &device) != MOEFUSE_STATUS_OK) return 0;
  return Config::Gemm::get_workspace_size(to_arguments<Config>(*p, device, sms));
}

template <class Config>
moefuse_status gemm_run(const moefuse_gemm_args* p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, const char* name) {
  using Gemm = typename Config::Gemm;
  moefuse_status st = check_args<Config>(p, name);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (p->m == 0) return MOEFUSE_STATUS_OK;  // empty problem: nothing to launch
  int device = 0, sms = 0;
  st = check_device(Config::kMajor, Config::kMinor, name, &sms, &device);
  if (st != MOEFUSE_STATUS_OK) return st;
  auto args = to_arguments<Config>(*p, device, sms);
  st = from_cutlass(Gemm::can_implement(args), name, "can_implement");
  if (st != MOEFUSE_STATUS_OK) return st;
  size_t need = Gemm::get_workspace_size(args);
  if (workspace_bytes < need || (need > 0 && workspace == nullptr)) {
    return fail(MOEFUSE_STATUS_WORKSPACE_TOO_SMALL, "%s: workspace %zu bytes, needs %zu", name,
                workspace_bytes, need);
  }
  Gemm gemm;
  st = from_cutlass(gemm.initialize(args, workspace, stream), name, "initialize");
  if (st != MOEFUSE_STATUS_OK) return st;
  st = from_cutlass(gemm.run(stream), name, "run");
  if (st != MOEFUSE_STATUS_OK) return st;
  return from_cuda(cudaGetLastError(), name);
}

}  // namespace moefuse

// Defines the two C entry points of one dense GEMM variant. Used only by the
// generated instance files in kernels/instances/.
#define MOEFUSE_DEFINE_GEMM(NAME, ...)                                                         \
  extern "C" size_t moefuse_##NAME##_workspace(const moefuse_gemm_args* args) {                \
    return moefuse::gemm_workspace<__VA_ARGS__>(args, #NAME);                                  \
  }                                                                                            \
  extern "C" moefuse_status moefuse_##NAME(const moefuse_gemm_args* args, void* workspace,     \
                                           size_t workspace_bytes, void* stream) {             \
    return moefuse::gemm_run<__VA_ARGS__>(args, workspace, workspace_bytes,                    \
                                          static_cast<cudaStream_t>(stream), #NAME);           \
  }
