// Synchronisation of the one-kernel decode forward (moe/decode.cu): a grid barrier with a
// deadline, and a shared-memory tile filled by bulk copies that complete on an mbarrier.
// sm_90+ only (cp.async.bulk, mbarrier transaction counts); the host takes this path only
// there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefuse/moe_abi.h"

namespace moefuse::moe::decode {

// How long a block waits at the grid barrier before it gives up: every block of the grid
// must be resident at once (the host launches no more than fit), so only an SM held by
// other work for this long, or a fault, gets here.
constexpr uint64_t kGridSyncDeadlineNs = 4'000'000'000ull;

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block of the grid waits here until all have arrived; the writes of every block
// before the barrier are visible to every block after it (read them through L2: `ld.cg`).
// sync[0] counts arrivals and is back to 0 when all have arrived (the last one resets it);
// sync[1] is a generation the last one bumps, which the others wait for. Every block
// arrives even when another gave up, so the words are ready for the next launch either
// way. Returns false (in every thread of the block) when the deadline passed first: the
// block must then skip what depends on the other blocks.
__device__ __forceinline__ bool grid_barrier(uint32_t* sync) {
  __shared__ int passed;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t generation = load_acquire(sync + 1);  // cannot move before this block arrives
    __threadfence();                                     // this block's writes before the arrival
    const uint32_t arrived = atomicAdd(sync, 1u) + 1u;
    bool ok = true;
    if (arrived == gridDim.x) {
      atomicExch(sync, 0u);
      __threadfence();
      atomicAdd(sync + 1, 1u);
    } else {
      const uint64_t deadline = global_time_ns() + kGridSyncDeadlineNs;
      while (load_acquire(sync + 1) == generation) {
        if (global_time_ns() > deadline) {
          ok = false;
          break;
        }
        __nanosleep(64);
      }
    }
    __threadfence();
    passed = ok;
  }
  __syncthreads();
  return passed != 0;
}

// A shared-memory tile written by cp.async.bulk copies that complete on one mbarrier
// (phase 0 only: the tile is filled once per launch).
struct BulkTile {
  uint64_t* barrier;  // in shared memory

  // One thread: the barrier expects one arrival and `bytes` (< 2^20) of transactions.
  __device__ __forceinline__ void expect(uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
  }

  // `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned).
  __device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
    const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
  }

  // Every waiting thread: until the expected bytes have landed.
  __device__ __forceinline__ void wait() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar)
          : "memory");
    }
#endif
  }
};

}  // namespace moefuse::moe::decode
