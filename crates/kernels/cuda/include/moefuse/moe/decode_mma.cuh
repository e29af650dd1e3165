// Building blocks of the decode forward (moe/decode.cu): the per-block routing table, a
// slot's output stores, and the register-direct MMA loop that streams 16 weight rows
// against up to 64 routed rows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moefuse/moe_abi.h"

namespace moefuse::moe::decode {

// K elements one MMA pair consumes per lane group: 4 lanes x 8 bf16 (one 16-byte load each).
constexpr int kChunk = 32;
// 8-column MMA blocks one pass holds in registers (16 routed rows; an expert with more
// slots takes several passes, the later ones reading its weights from L2). Measured: with
// 4 blocks the B registers left room for 2 chunks of A in flight per lane, too few bytes
// in flight to stream at full bandwidth (Mixtral-8x7B T=64: 3.3 TB/s).
constexpr int kMaxGroupBlocks = 2;
constexpr int kMaxExperts = 512;
constexpr int kMaxSlots = MOEFUSE_DECODE_MAX_SLOTS;

// The routed slots of one call, grouped by expert, built by every block from topk_ids:
// expert[0..touched) the touched experts ascending, slot[start[i]..start[i+1]) the slots
// (t * top_k + j) of expert[i] ascending, position[s] the index of slot s in `slot` (-1 for
// an id outside 0..experts-1, which is dropped and flagged).
struct Routing {
  int touched;
  int expert[kMaxExperts];
  int start[kMaxExperts + 1];
  int cursor[kMaxExperts];
  int id[kMaxSlots];
  int slot[kMaxSlots];
  int position[kMaxSlots];

  // Every thread of the block calls it; ends with the block synchronised.
  __device__ void build(const int32_t* ids, int n, int experts, uint32_t* errors) {
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e < experts; e += blockDim.x) cursor[e] = 0;
    __syncthreads();
    for (int s = tid; s < n; s += blockDim.x) {
      const int e = ids[s];
      const bool ok = e >= 0 && e < experts;
      id[s] = ok ? e : -1;
      if (ok) atomicAdd(&cursor[e], 1);
      else if (errors != nullptr) atomicOr(errors, MOEFUSE_MOE_ERROR_EXPERT_ID);
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l scans experts [l * per, (l + 1) * per): counts to starts, touched compacted.
      const int per = (experts + 31) / 32, e0 = min(lane * per, experts), e1 = min(e0 + per, experts);
      int rows = 0, hit = 0;
      for (int e = e0; e < e1; ++e) {
        rows += cursor[e];
        hit += cursor[e] > 0;
      }
      int rows_before = rows, hit_before = hit;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int r = __shfl_up_sync(0xffffffffu, rows_before, o), h = __shfl_up_sync(0xffffffffu, hit_before, o);
        if (lane >= o) {
          rows_before += r;
          hit_before += h;
        }
      }
      rows_before -= rows;
      hit_before -= hit;
      for (int e = e0; e < e1; ++e) {
        const int c = cursor[e];
        if (c > 0) {
          expert[hit_before] = e;
          start[hit_before] = rows_before;
          ++hit_before;
        }
        cursor[e] = rows_before;
        rows_before += c;
      }
      if (lane == 31) {
        touched = hit_before;
        start[hit_before] = rows_before;
      }
      __syncwarp();
      // Stable placement, 32 slots at a time: equal ids in a chunk rank by lane.
      for (int base = 0; base < n; base += 32) {
        const int s = base + lane;
        const int e = s < n ? id[s] : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        if (e >= 0) {
          const int pos = cursor[e] + __popc(peers & ((1u << lane) - 1u));
          slot[pos] = s;
          position[s] = pos;
        } else if (s < n) {
          position[s] = -1;
        }
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) cursor[e] += __popc(peers);
        __syncwarp();
      }
    }
    __syncthreads();
  }
};

// The slots of each touched expert cut into groups of at most `rows` (one MMA pass each):
// group i is rows [base[i], base[i] + rows) of expert entry touched[i] of the routing.
struct Groups {
  int count;
  int touched[kMaxSlots];
  int base[kMaxSlots];

  // Warp 0 of the block fills it from a built routing table; ends with the block
  // synchronised.
  __device__ void build(const Routing& rt, int rows) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const int per = (rt.touched + 31) / 32, t0 = min(lane * per, rt.touched), t1 = min(t0 + per, rt.touched);
      int mine = 0;
      for (int ti = t0; ti < t1; ++ti) mine += (rt.start[ti + 1] - rt.start[ti] + rows - 1) / rows;
      int before = mine;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, before, o);
        if (lane >= o) before += v;
      }
      before -= mine;
      for (int ti = t0; ti < t1; ++ti) {
        for (int b = 0; b < rt.start[ti + 1] - rt.start[ti]; b += rows) {
          touched[before] = ti;
          base[before] = b;
          ++before;
        }
      }
      if (lane == 31) count = before;
    }
    __syncthreads();
  }
};

// ---- a slot's outputs -------------------------------------------------------------------

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// Slot s's expert-major row (row_of, for the copies a backward reads), or -1: no row_of, or
// a row outside 0..tokens * top_k.
__device__ __forceinline__ int expert_row(const moefuse_decode_args& a, int s) {
  if (a.row_of == nullptr) return -1;
  const int row = a.row_of[s];
  return row >= 0 && row < a.tokens * a.top_k ? row : -1;
}

// Slot s's activation output at column f: into h, and into h_rows at its expert-major row.
__device__ __forceinline__ void store_h(const moefuse_decode_args& a, int s, int row, int f, uint16_t v) {
  a.h[size_t(s) * a.intermediate + f] = v;
  if (row >= 0 && a.h_rows != nullptr) a.h_rows[size_t(row) * a.intermediate + f] = v;
}

// A slot's pre-activation values at columns lo and hi of its h_pre_rows row (`width` wide).
__device__ __forceinline__ void store_h_pre(const moefuse_decode_args& a, int row, int width, int lo, int hi,
                                            float v_lo, float v_hi) {
  if (row < 0 || a.h_pre_rows == nullptr) return;
  a.h_pre_rows[size_t(row) * width + lo] = bf16_bits(v_lo);
  a.h_pre_rows[size_t(row) * width + hi] = bf16_bits(v_hi);
}

// Slot s's y_e value (bf16 bits) at column d into its expert-major y_e_rows row, if any.
__device__ __forceinline__ void store_y_e(const moefuse_decode_args& a, int s, int d, uint16_t v) {
  if (a.y_e_rows == nullptr) return;
  const int row = expert_row(a, s);
  if (row >= 0) a.y_e_rows[size_t(row) * a.hidden + d] = v;
}

// Token t's output at one column: w * y_e over its valid slots in slot order (fp32), the
// y_e of the slot at routing position p read at y_e[p * stride]: the one fixed order of the
// decode combine.
__device__ __forceinline__ float combine_token(const moefuse_decode_args& a, const Routing& rt, int t,
                                               const float* y_e, int stride) {
  float v = 0.f;
  for (int j = 0; j < a.top_k; ++j) {
    const int s = t * a.top_k + j, p = rt.position[s];
    if (p >= 0) v += a.topk_weights[s] * y_e[p * stride];
  }
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// 16 bytes of a weight row, read once: not kept in L1.
__device__ __forceinline__ uint4 load_stream(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 32 K elements: lane (g, t) holds k 8t..8t+7 of A rows g (lo) and g + 8 (hi) and of B
// column g; the first MMA takes k 8t..8t+3 as its logical 2t, 2t+1, 2t+8, 2t+9, the second
// k 8t+4..8t+7. Both operands follow the same permutation, so the sum is the dot product.
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& lo, const uint4& hi, const uint4& b) {
  mma_bf16(d, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  mma_bf16(d, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// acc[nb] = A[16, K range] · B[nb]ᵀ for K chunks [c0, c1): A rows a_lo (row g) and a_hi
// (row g + 8) of this lane, U chunks of A in flight per lane, B rows b + b_off[nb] (column
// nb * 8 + g; 32-bit element offsets keep eight of them in eight registers). C fragment:
// acc[nb][0..1] = (row g, columns 2t, 2t+1), acc[nb][2..3] = (row g + 8, same columns).
// Whole batches of U chunks, then the rest one chunk at a time.
// NOTES: a batch costs one memory round trip only if all its loads issue before its first
// MMA, and at 128 registers ptxas starts the MMAs early when they do not fit (U = 8 with one
// column block: 7 of the 8 chunks' loads go first). A last partial batch with clamped loads
// and predicated MMAs (b57ebaa), or extra batches of U/2 and U/4 for the rest, left fewer
// loads before the first MMA (4.5 of 8; spills): Qwen3-30B-A3B decode 9-12 % slower at every
// T (H100, 2026-12-07, docs/perf-notes.md "Session 28").
template <int NB, int U>
__device__ __forceinline__ void mma_rows(float (&acc)[NB][4], const uint16_t* a_lo, const uint16_t* a_hi,
                                         const uint16_t* b, const uint32_t (&b_off)[NB], int c0, int c1) {
  const int k8 = (threadIdx.x & 3) * 8;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;
  int c = c0;
  // (not unrolled: two batches merged into one would let the MMAs start mid-batch)
#pragma unroll 1
  for (; c + U <= c1; c += U) {
    uint4 lo[U], hi[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      lo[u] = load_stream(a_lo + (c + u) * kChunk + k8);
      hi[u] = load_stream(a_hi + (c + u) * kChunk + k8);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint4 bv = __ldg(reinterpret_cast<const uint4*>(b + b_off[nb] + (c + u) * kChunk + k8));
        mma_chunk(acc[nb], lo[u], hi[u], bv);
      }
    }
  }
  for (; c < c1; ++c) {
    const uint4 lo = load_stream(a_lo + c * kChunk + k8), hi = load_stream(a_hi + c * kChunk + k8);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4 bv = __ldg(reinterpret_cast<const uint4*>(b + b_off[nb] + c * kChunk + k8));
      mma_chunk(acc[nb], lo, hi, bv);
    }
  }
}

}  // namespace moefuse::moe::decode
