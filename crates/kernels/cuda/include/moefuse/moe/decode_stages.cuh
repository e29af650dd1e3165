// The staged weight stream of the decode gate_up kernel (moe/decode.cu, the `staged`
// variant): a producer warp copies 16 weight rows x kStageK columns per stage into shared
// memory with bulk copies (cp.async.bulk, one per row, completing on the stage's full
// barrier), the consumer warps run the MMAs from there and release the stage on its empty
// barrier. The bytes in flight are the stages (no registers hold them), so one block per SM
// keeps ~130 KB of weights in flight however few columns the MMAs have.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moefuse::moe::decode {

// K elements of one stage (per weight row) and the stages of the ring.
constexpr int kStageK = 512;
constexpr int kStages = 8;
// Row pitch in a stage: 64 bytes past the row, so that rows g and g + 1 (one 128-byte
// wavefront of 16-byte loads: lanes (g, t) for two g) fall into different bank halves.
constexpr int kStagePitch = kStageK * 2 + 64;
constexpr int kStageBytes = 16 * kStagePitch;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// After every barrier_init, before any other thread or the bulk-copy unit uses them.
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also expects `bytes` of bulk copies to complete on the barrier.
__device__ __forceinline__ void barrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory,
// completing on `bar`; the lines are marked evict-first in L2 (read once).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint4 load_shared(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p))
               : "memory");
  return v;
}

// Named barrier over the first `threads` threads of the block (the consumer warps).
__device__ __forceinline__ void consumers_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// The ring's position: stage index and the parity of its current phase, advanced in the
// same order by the producer and the consumers.
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace moefuse::moe::decode
