// Resident blocks per device of a decode kernel pair (gate_up, down), looked up once per
// device: the decode pair (moe/decode.cu) sizes its grids by it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

namespace moefuse::moe {

struct ResidentBlocks {
  int gate_up, down;
};

// SMs x blocks per SM of each kernel of a pair on the current device: `per_sm()` returns the
// blocks per SM (and may set kernel attributes first); it runs on the first call from each
// device, whose result `cache` keeps (concurrent first calls compute the same numbers).
// `fallback` where no device is current.
template <typename PerSm>
ResidentBlocks resident_blocks(std::atomic<int> (&cache)[64][2], ResidentBlocks fallback, PerSm per_sm) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return fallback;
  int up = cache[dev][0].load(std::memory_order_acquire), down = cache[dev][1].load(std::memory_order_acquire);
  if (up > 0 && down > 0) return {up, down};
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const ResidentBlocks per = per_sm();
  up = std::max(1, sms) * std::max(1, per.gate_up);
  down = std::max(1, sms) * std::max(1, per.down);
  cache[dev][0].store(up, std::memory_order_release);
  cache[dev][1].store(down, std::memory_order_release);
  return {up, down};
}

}  // namespace moefuse::moe
