// The stable count both routing permutations share (moe/permute.cu's count kernel, the
// expert-parallel count kernel in crates/comm/cuda/ep.cu): a warp ranks its tokens' slots
// by expert in token order on its own shared-memory histogram.
#pragma once

#include <cstdint>

namespace moefuse::rows {

// The warp's n_tok tokens (routing `ids`, [n_tok, k] in shared memory), 32 / k of them per
// step: lane = (token i0 + q, slot j). The lanes naming one expert rank among themselves in
// lane order, which is token order (a token's experts are distinct; a duplicate ranks by
// slot), after the rows of earlier steps, which `hist[e]` counts: positions within an expert
// follow token order, as a serial walk over the tokens gives them, in k times fewer
// dependent steps. Every lane calls `step(i, j, e, live, ok, pos, duplicate, q)` once per
// step (so the step may use warp collectives): i the token (valid when live), e its slot j's
// id, ok whether 0 <= e < experts, pos its position within the expert (when ok), duplicate
// whether another slot of the token names the same expert. k <= 32.
template <class Step>
__device__ __forceinline__ void rank_slots(const int* ids, int n_tok, int k, int experts, int* hist, int lane,
                                           Step&& step) {
  const int per_step = 32 / k, q = lane / k, j = lane - q * k;
  const unsigned lower = (1u << lane) - 1u;
  const unsigned token_lanes = (k >= 32 ? ~0u : ((1u << k) - 1u)) << (q * k);
  for (int i0 = 0; i0 < n_tok; i0 += per_step) {
    const int i = i0 + q;
    const bool live = q < per_step && i < n_tok;
    const int e = live ? ids[i * k + j] : -1;
    const bool ok = live && e >= 0 && e < experts;
    const unsigned same_expert = __match_any_sync(~0u, ok ? e : -1 - lane);
    int pos = -1;
    if (ok) {
      const int leader = __ffs(same_expert) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(&hist[e], __popc(same_expert));
      base = __shfl_sync(same_expert, base, leader);
      pos = base + __popc(same_expert & lower);
    }
    step(i, j, e, live, ok, pos, ok && __popc(same_expert & token_lanes) > 1, q);
  }
}

// After every warp's rank_slots: the block's per-warp histograms (kWarps rows of `bins`
// counts, row-major in shared memory) become each warp's exclusive base per bin, in warp
// order (token order), in place, and totals[b] the block's count of bin b. Block-wide; the
// caller synchronises before and after.
template <int kWarps>
__device__ __forceinline__ void warp_bases(int* hist, int bins, int* totals) {
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int v = hist[w * bins + b];
      hist[w * bins + b] = run;
      run += v;
    }
    totals[b] = run;
  }
}

}  // namespace moefuse::rows
