// The persistent launch of moefuse's sm90 kernels with clusters along M (the contiguous
// grouped GEMM, the contiguous wgrad, the fused gate_up): as many clusters as can be resident
// at once (a pair needs two free SMs of one GPC), never more than there are cluster tiles.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "moefuse/common/status.hpp"

namespace moefuse {

// An A/B knob for benchmarks: environment variable `name` set to "1" forces single CTAs, "2"
// CTA pairs; returns that number, or 0 (unset or anything else: the launcher decides).
// Callers read it once per process (a function-local static), not per launch.
inline int cluster_override(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  return std::strcmp(v, "1") == 0 ? 1 : std::strcmp(v, "2") == 0 ? 2 : 0;
}

// Whether a launch over `rows` routed rows of `experts` experts runs CTA pairs that share
// W_e's tiles: `forced` (cluster_override) when set, else when the experts average at least
// two m-blocks of `tile_m` rows. Below that most pairs would be one tile and an empty
// partner, half the SMs idle (the fused gate_up, GPT-OSS-120B T = 2048, 64 rows per expert:
// 2058 us paired against 1755 single, H200).
inline bool cluster_pairs_pay(int64_t rows, int experts, int tile_m, int forced = 0) {
  if (forced != 0) return forced == 2;
  return rows >= int64_t(2) * tile_m * experts;
}

// Launches `kKernel(args...)` on `stream` with clusters of `kCluster` CTAs of `threads`
// threads and `smem_bytes` of dynamic shared memory (its limit raised here), over
// min(resident clusters, `units`) clusters. The resident count is looked up once per kernel
// and device (a query per launch would cost host time on every call).
template <int kCluster, auto kKernel, class... Args>
moefuse_status launch_on_clusters(int threads, int smem_bytes, int sms, int64_t units, cudaStream_t stream,
                                  const char* name, Args&&... args) {
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  constexpr auto fn = kKernel;
  moefuse_status st = from_cuda(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                                "cudaFuncSetAttribute(smem)");
  if (st != MOEFUSE_STATUS_OK) return st;
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = sms / kCluster;
  if constexpr (kCluster > 1) {
    static std::atomic<int> resident[64];  // one per instantiation, so per kernel
    int device = 0;
    st = from_cuda(cudaGetDevice(&device), "cudaGetDevice");
    if (st != MOEFUSE_STATUS_OK) return st;
    const bool cached = device >= 0 && device < 64;
    clusters = cached ? resident[device].load(std::memory_order_acquire) : 0;
    if (clusters < 1) {
      config.gridDim = dim3(sms / kCluster * kCluster, 1, 1);
      st = from_cuda(cudaOccupancyMaxActiveClusters(&clusters, fn, &config), "cudaOccupancyMaxActiveClusters");
      if (st != MOEFUSE_STATUS_OK) return st;
      if (clusters < 1) return fail(MOEFUSE_STATUS_INTERNAL, "%s: no cluster of %d CTAs fits", name, kCluster);
      if (cached) resident[device].store(clusters, std::memory_order_release);
    }
  }
  if (units < clusters) clusters = int(units > 0 ? units : 1);
  config.gridDim = dim3(clusters * kCluster, 1, 1);
  st = from_cuda(cudaLaunchKernelEx(&config, fn, static_cast<Args&&>(args)...), name);
  if (st != MOEFUSE_STATUS_OK) return st;
  return from_cuda(cudaGetLastError(), name);
}

}  // namespace moefuse
