// A per-warp ring of weight stages for the decode kernels (moe/decode.cu): the warp's
// lanes issue bulk copies (cp.async.bulk, one per weight row) of the stages it will read
// next into shared memory, completing on the stage's mbarrier, while the warp runs the MMAs
// of the stage it holds. No registers hold bytes in flight, so a warp keeps `Depth` stages
// of DRAM traffic going across its units, barriers and epilogues.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefuse/moe/decode_mma.cuh"

namespace moefuse::moe::decode {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// The barrier's initialisation visible to the async proxy (the bulk copies' complete_tx).
__device__ __forceinline__ void fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, both 16-byte aligned.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#endif
}

__device__ __forceinline__ uint4 load_shared(const char* p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_addr(p)));
  return v;
}

// One warp's ring: `Depth` stages of 16 weight rows x `Chunks` K chunks (64 bytes each).
// Rows are `kStride` bytes apart, 16 more than their data: a lane group's 64 bytes of rows
// g = 0..7 then start 16 bytes apart modulo 128, every 16-byte bank group is hit by exactly
// four of the 32 lanes, and a warp's 512-byte load takes the minimum four wavefronts (with
// an odd chunk count every row would start on the same banks: eight).
template <int Chunks, int Depth>
struct WarpRing {
  static_assert(Chunks % 2 == 0, "an odd chunk count puts every row on the same banks");
  static constexpr int kStride = Chunks * 64 + 16;
  static constexpr int kStageBytes = 16 * kStride;
  static constexpr int kBytes = Depth * kStageBytes;

  char* stage;     // [Depth][16][kStride]
  uint64_t* full;  // [Depth]

  // Lane 0 initialises the barriers; the warp is synchronised after.
  __device__ void init() {
    if ((threadIdx.x & 31) == 0) {
      for (int i = 0; i < Depth; ++i) mbarrier_init(&full[i], 1);
      fence_barrier_init();
    }
    __syncwarp();
  }

  // Stage number n (0, 1, ...) of the warp's sequence: `n_chunks` <= Chunks K chunks from
  // chunk `c0` of 16 weight rows; lane r < 16 copies row r, which starts at `row`.
  __device__ void issue(int n, const uint16_t* row, int c0, int n_chunks) {
    const int lane = threadIdx.x & 31, slot = n % Depth;
    const uint32_t bytes = uint32_t(n_chunks) * 64;
    if (lane == 0) mbarrier_expect_tx(&full[slot], 16 * bytes);
    __syncwarp();
    if (lane < 16) bulk_copy(stage + slot * kStageBytes + lane * kStride, row + c0 * kChunk, bytes, &full[slot]);
  }

  // Waits for stage n; its 16 rows at the returned address, kStride bytes apart.
  __device__ const char* wait(int n) {
    const int slot = n % Depth;
    mbarrier_wait(&full[slot], uint32_t(n / Depth) & 1u);
    return stage + slot * kStageBytes;
  }
};

}  // namespace moefuse::moe::decode
