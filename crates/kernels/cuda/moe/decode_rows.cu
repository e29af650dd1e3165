// The row-dot kernels of the decode forward (moe_abi.h, MOEFUSE_DECODE_KERNELS_ROW_DOT): for
// the fewest tokens (every expert with at most a handful of routed rows) the expert MLP is a
// set of dot products of weight rows with a few activation rows, so each warp streams whole
// weight rows on the CUDA cores instead of feeding 16-row tensor-core tiles.
//
// Both kernels build decode.cu's routing table (decode_mma.cuh) and cut each touched
// expert's slots into groups of at most kGroupSlots. A warp takes every W-th unit, W the fewest
// warps that give every one of them the same number of units (balanced_stride; the units
// are of equal size, so fixed equal shares leave no tail beyond one unit's length):
//   gate_up unit = (group, row pair of W_e): the gate and up rows of one feature, or two
//                  features for RELU2; h, h_pre (and the expert-major copies) per slot.
//                  Units are numbered pair-major (u = pair * groups + group), so the groups
//                  of one expert read the same rows in the same round (the later reads hit
//                  L2) instead of a whole expert apart (Mixtral's 235 MB: from DRAM again)
//   down unit    = one column d of y: row d of every touched D_e against the slots' h rows,
//                  y_e = bf16(dot) per slot, then y[t, d] = sum_j w * y_e in slot order (fp32)
//
// NOTES: a warp's load covers 512 contiguous bytes of one weight row (16 bytes per lane),
// and a warp keeps kRing of them per row in flight as one stream across its units (a ring
// of registers, refilled as each load is consumed), so no block barrier or unit boundary
// drains the loads; two blocks of eight warps per SM hold 128 KB in flight. Sums: each lane
// adds its k in chunk order, then an xor butterfly over the lanes: fixed, so deterministic
// (a different order from the tensor-core kernels', so not their bits).
#include <cuda_bf16.h>

#include <atomic>

#include "moefuse/moe/activation_math.cuh"
#include "moefuse/moe/common.cuh"
#include "moefuse/moe/decode_mma.cuh"
#include "moefuse/moe/decode_rows.hpp"
#include "moefuse/moe/resident.hpp"
#include "moefuse/moe_abi.h"

namespace moefuse::moe {
namespace {

using decode::bf16_bits;
using decode::Groups;
using decode::Routing;

constexpr int kWarps = 8;
// Loads per weight row in flight per lane (16 bytes each).
constexpr int kRing = 8;
// Slots one unit serves (more slots of one expert: more groups, the later re-reading the
// weights from L2).
constexpr int kGroupSlots = 4;
// K elements one warp-wide load covers: 32 lanes x 8 bf16.
constexpr int kSpan = 256;
// The activation rows each kernel dots the weights with (x for the gate_up, h for the
// down) are copied into shared memory when they take at most this many bytes, so that a
// ring step reads its slots' 16 bytes from shared memory rather than waiting on L1/L2
// (ncu, H100, Qwen3 T = 1: ~19 % of the down kernel's stall samples waited on its h loads).
constexpr int kStageBytes = 32 * 1024;

// Whether `bytes` of activation rows are staged; the host launches the kernel with that
// much dynamic shared memory exactly when this holds.
__host__ __device__ __forceinline__ bool staged(size_t bytes) { return bytes <= size_t(kStageBytes); }

// `bytes` (a multiple of 16) from global memory into `dst`, by the whole block; then a
// barrier. Returns dst as the rows to read.
__device__ const uint16_t* stage_rows(const uint16_t* src, size_t bytes, uint4* dst) {
  const uint4* from = reinterpret_cast<const uint4*>(src);
  for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) dst[i] = from[i];
  __syncthreads();
  return reinterpret_cast<const uint16_t*>(dst);
}

// 16 bytes of a weight row at element k of `row` (zeros past `len`: the last span of a row
// whose length is not a multiple of 256).
__device__ __forceinline__ uint4 load_row(const uint16_t* row, int k, int len) {
  return k < len ? decode::load_stream(row + k) : make_uint4(0u, 0u, 0u, 0u);
}

// sum over the 8 bf16 pairs of w and v, in element order.
__device__ __forceinline__ float dot8(const uint4& w, const uint4& v) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w}, vs[4] = {v.x, v.y, v.z, v.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s = fmaf(__uint_as_float(ws[i] << 16), __uint_as_float(vs[i] << 16), s);
    s = fmaf(__uint_as_float(ws[i] & 0xffff0000u), __uint_as_float(vs[i] & 0xffff0000u), s);
  }
  return s;
}

// dot8 of two weight vectors with the same v, each element of v widened once.
__device__ __forceinline__ void dot8x2(const uint4& w0, const uint4& w1, const uint4& v, float& s0, float& s1) {
  const uint32_t a[4] = {w0.x, w0.y, w0.z, w0.w}, b[4] = {w1.x, w1.y, w1.z, w1.w}, vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float v_even = __uint_as_float(vs[i] << 16), v_odd = __uint_as_float(vs[i] & 0xffff0000u);
    s0 = fmaf(__uint_as_float(a[i] << 16), v_even, s0);
    s1 = fmaf(__uint_as_float(b[i] << 16), v_even, s1);
    s0 = fmaf(__uint_as_float(a[i] & 0xffff0000u), v_odd, s0);
    s1 = fmaf(__uint_as_float(b[i] & 0xffff0000u), v_odd, s1);
  }
}

// The warp's sums of v[0..N) (N a power of two, 2..32), lane i * 32 / N holding v[i]'s:
// each halving step sends half of the values to the partner lane and keeps the other half
// (log2 N steps, N - 1 shuffles), then butterflies over the lanes that share a value.
// Fixed order: deterministic. NOTES: unconditional shuffles on purpose: the compiler
// wraps each shuffle under a data-dependent branch in a WARPSYNC collective sequence.
template <int N>
__device__ __forceinline__ float sum_to_lanes(float (&v)[N], int lane) {
  static_assert(N >= 2 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two, 2..32");
#pragma unroll
  for (int h = N / 2, off = 16; h >= 1; h /= 2, off /= 2) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = upper ? v[i] : v[i + h], keep = upper ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
#pragma unroll
  for (int off = 16 / N; off >= 1; off /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
  return v[0];
}

// Unit u's coordinates (major, minor) over `minors`, advanced by a fixed stride without a
// division per step: u = major * minors + minor.
struct UnitCursor {
  int major, minor, step_major, step_minor, minors;
  __device__ UnitCursor(int u, int stride, int minors_) : minors(minors_) {
    major = u / minors;
    minor = u - major * minors;
    step_major = stride / minors;
    step_minor = stride - step_major * minors;
  }
  __device__ __forceinline__ void advance() {
    major += step_major;
    minor += step_minor;
    if (minor >= minors) {
      minor -= minors;
      ++major;
    }
  }
};

// The warps that take units: as few as give each the same number, ceil(units / warps), so
// the last round streams with as many loads in flight as the others (DeepSeek-V3's down:
// 7168 columns over 2112 warps would leave 832 warps alone in a fourth round; 1792 warps
// take four each). Warp g takes g, g + stride, ...; a warp at or past the stride none.
__device__ __forceinline__ int balanced_stride(int units, int warps) {
  if (units <= 0) return warps;
  const int rounds = (units + warps - 1) / warps;
  return (units + rounds - 1) / rounds;
}

struct RowsShared {
  Routing routing;
  Groups groups;
};

// ---- gate_up ----------------------------------------------------------------------------

// The two rows of W_e of row pair p: gate and up of feature p (gated), features 2p and
// 2p + 1 (RELU2).
__device__ __forceinline__ void pair_rows(const moefuse_decode_args& a, int p, int& lo, int& hi) {
  if (a.activation == MOEFUSE_ACTIVATION_RELU2) {
    lo = 2 * p;
    hi = lo + 1;
  } else if (a.layout == MOEFUSE_GATE_UP_SPLIT) {
    lo = p;
    hi = a.intermediate + p;
  } else {
    lo = 2 * p;
    hi = lo + 1;
  }
}

// One slot's sums of a finished unit (row pair p): h, h_pre and the expert-major copies.
// NOTES: not inlined, and called once per unit end by the lane that holds the slot: inlined
// into the unrolled ring, the activation's switch was repeated per ring position and per
// slot (19.5 k instructions), and ncu put 41 % of the warps' stall samples on instruction
// fetch (H100, Qwen3 T = 1, 2026-12-07).
__device__ __noinline__ void gate_up_store(const moefuse_decode_args& a, int s, int p, float v_lo, float v_hi) {
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  int lo, hi;
  pair_rows(a, p, lo, hi);
  const int row = decode::expert_row(a, s);
  if (gated) {
    decode::store_h(a, s, row, p, bf16_bits(eval(a.activation, a.alpha, a.limit, v_lo, v_hi).h));
  } else {
    decode::store_h(a, s, row, lo, bf16_bits(eval(a.activation, 0.f, 0.f, v_lo, 0.f).h));
    decode::store_h(a, s, row, hi, bf16_bits(eval(a.activation, 0.f, 0.f, v_hi, 0.f).h));
  }
  decode::store_h_pre(a, row, width, lo, hi, v_lo, v_hi);
}

__global__ void __launch_bounds__(kWarps * 32, 2) decode_gate_up_rows_kernel(const __grid_constant__ moefuse_decode_args a) {
  __shared__ RowsShared sm;
  decode::wait_for_prerequisite();
  decode::allow_dependent_launch();
  sm.routing.build(a.topk_ids, a.tokens * a.top_k, a.experts, blockIdx.x == 0 ? a.errors : nullptr);
  sm.groups.build(sm.routing, kGroupSlots);
  extern __shared__ uint4 stage[];
  const size_t x_bytes = size_t(a.tokens) * a.hidden * 2;
  const uint16_t* x = staged(x_bytes) ? stage_rows(a.x, x_bytes, stage) : a.x;
  const Routing& rt = sm.routing;
  const Groups& gr = sm.groups;
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  const int pairs = gated ? a.intermediate : a.intermediate / 2;
  const int units = gr.count * pairs, spans = (a.hidden + kSpan - 1) / kSpan;
  const int lane = threadIdx.x & 31, stride = balanced_stride(units, int(gridDim.x) * kWarps);
  const int k_lane = lane * 8, gw = int(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  // The issuing side: unit `iu` = (pair ip.major, group ip.minor), span `is`, its two rows.
  int iu = gw < stride ? gw : units, is = 0;
  UnitCursor ip(iu, stride, max(gr.count, 1));
  const uint16_t *i_lo = nullptr, *i_hi = nullptr;
  auto rows_of = [&]() {
    int lo, hi;
    pair_rows(a, ip.major, lo, hi);
    const uint16_t* w = a.w_gate_up + size_t(rt.expert[gr.touched[ip.minor]]) * width * a.hidden;
    i_lo = w + size_t(lo) * a.hidden;
    i_hi = w + size_t(hi) * a.hidden;
  };
  if (iu < units) rows_of();
  uint4 r_lo[kRing], r_hi[kRing];
  auto issue = [&](uint4& lo, uint4& hi) {
    if (iu >= units) return;
    const int k = is * kSpan + k_lane;
    lo = load_row(i_lo, k, a.hidden);
    hi = load_row(i_hi, k, a.hidden);
    if (++is == spans) {
      is = 0;
      iu += stride;
      ip.advance();
      if (iu < units) rows_of();
    }
  };
#pragma unroll
  for (int r = 0; r < kRing; ++r) issue(r_lo[r], r_hi[r]);
  // The consuming side: unit `cu` (cp as ip), span `cs`, its slots' x rows and the lane's
  // sums (s[j] gate or first row of slot j, s[kGroupSlots + j] up or second).
  int cu = gw < stride ? gw : units, cs = 0, n = 0;
  UnitCursor cp(cu, stride, max(gr.count, 1));
  const int* slots = nullptr;
  const uint16_t* xr[kGroupSlots];
  float sum[2 * kGroupSlots];
  auto start = [&]() {
    const int gi = cp.minor, ti = gr.touched[gi], first = rt.start[ti] + gr.base[gi];
    n = min(rt.start[ti + 1] - first, kGroupSlots);
    slots = rt.slot + first;
#pragma unroll
    for (int j = 0; j < kGroupSlots; ++j) xr[j] = x + size_t(slots[j < n ? j : 0] / a.top_k) * a.hidden;
#pragma unroll
    for (int j = 0; j < 2 * kGroupSlots; ++j) sum[j] = 0.f;
  };
  if (cu < units) start();
  while (cu < units) {
#pragma unroll
    for (int r = 0; r < kRing; ++r) {
      if (cu >= units) break;
      const int k = cs * kSpan + k_lane;
      if (k < a.hidden) {
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) {
          if (j < n) {
            const uint4 xv = *reinterpret_cast<const uint4*>(xr[j] + k);  // shared or global
            dot8x2(r_lo[r], r_hi[r], xv, sum[j], sum[kGroupSlots + j]);
          }
        }
      }
      issue(r_lo[r], r_hi[r]);
      if (++cs == spans) {
        // Lane i * 32 / 8 = 4i holds sum[i]: slot j's pair is at lanes 4j and 4(j + 4).
        const float total = sum_to_lanes(sum, lane);
        const float v_lo = __shfl_sync(0xffffffffu, total, 4 * lane);
        const float v_hi = __shfl_sync(0xffffffffu, total, 4 * (lane + kGroupSlots));
        if (lane < n) gate_up_store(a, slots[lane], cp.major, v_lo, v_hi);
        cs = 0;
        cu += stride;
        cp.advance();
        if (cu < units) start();
      }
    }
  }
}

// ---- down + combine ---------------------------------------------------------------------

// Slots the down kernel keeps y_e of, per warp (MOEFUSE_DECODE_ROW_DOT_MAX_SLOTS).
constexpr int kDownSlots = MOEFUSE_DECODE_ROW_DOT_MAX_SLOTS;

// Slot s's y_e at column d, rounded to bf16 as the layer's other paths store it: into the
// warp's y_e (at the slot's position) and its expert-major row. Not inlined, as gate_up_store.
__device__ __noinline__ void down_store(const moefuse_decode_args& a, const Routing& rt, float* y_e, int s, int d,
                                        float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  y_e[rt.position[s]] = __bfloat162float(b);
  decode::store_y_e(a, s, d, __bfloat16_as_ushort(b));
}

// y[t, d] = sum over the token's slots in order of w * y_e (fp32), the warp's lanes over t.
__device__ __noinline__ void combine_column(const moefuse_decode_args& a, const Routing& rt, const float* y_e, int d) {
  for (int t = threadIdx.x & 31; t < a.tokens; t += 32) {
    a.y[size_t(t) * a.hidden + d] = bf16_bits(decode::combine_token(a, rt, t, y_e, 1));
  }
}

__global__ void __launch_bounds__(kWarps * 32, 2) decode_down_rows_kernel(const __grid_constant__ moefuse_decode_args a) {
  __shared__ RowsShared sm;
  __shared__ float y_e[kWarps][kDownSlots];
  const Routing& rt = sm.routing;
  const Groups& gr = sm.groups;
  sm.routing.build(a.topk_ids, a.tokens * a.top_k, a.experts, nullptr);
  sm.groups.build(sm.routing, kGroupSlots);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int k_lane = lane * 8, spans = (a.intermediate + kSpan - 1) / kSpan;
  const int units = a.hidden, groups = gr.count;
  const int stride = balanced_stride(units, int(gridDim.x) * kWarps), gw = int(blockIdx.x) * kWarps + warp;
  // The issuing side: column `iu`, group `ig`, span `is`; weight rows do not depend on the
  // gate_up kernel, so the ring fills before the wait for h.
  int iu = gw < stride ? gw : units, ig = 0, is = 0;
  auto row_of = [&](int u, int g) {
    return a.w_down + (size_t(rt.expert[gr.touched[g]]) * a.hidden + u) * a.intermediate;
  };
  const uint16_t* i_row = iu < units && groups > 0 ? row_of(iu, 0) : nullptr;
  uint4 ring[kRing];
  auto issue = [&](uint4& w) {
    if (iu >= units || groups == 0) return;
    w = load_row(i_row, is * kSpan + k_lane, a.intermediate);
    if (++is == spans) {
      is = 0;
      if (++ig == groups) {
        ig = 0;
        iu += stride;
      }
      if (iu < units) i_row = row_of(iu, ig);
    }
  };
#pragma unroll
  for (int r = 0; r < kRing; ++r) issue(ring[r]);
  decode::wait_for_prerequisite();
  extern __shared__ uint4 stage[];
  const size_t h_bytes = size_t(a.tokens) * a.top_k * a.intermediate * 2;
  const uint16_t* h = staged(h_bytes) ? stage_rows(a.h, h_bytes, stage) : a.h;
  // The consuming side: column `cu`, group `cg`, span `cs`.
  int cu = gw < stride ? gw : units, cg = 0, cs = 0, n = 0;
  const int* slots = nullptr;
  float acc[kGroupSlots];
  auto start_group = [&](int g) {
    const int ti = gr.touched[g], first = rt.start[ti] + gr.base[g];
    n = min(rt.start[ti + 1] - first, kGroupSlots);
    slots = rt.slot + first;
#pragma unroll
    for (int j = 0; j < kGroupSlots; ++j) acc[j] = 0.f;
  };
  if (groups == 0) cu = units;  // nothing routed: y is written below as zeros
  if (cu < units) start_group(0);
  while (cu < units) {
#pragma unroll
    for (int r = 0; r < kRing; ++r) {
      if (cu >= units) break;
      const int k = cs * kSpan + k_lane;
      if (k < a.intermediate) {
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) {
          if (j < n) {
            const uint4 hv = *reinterpret_cast<const uint4*>(h + size_t(slots[j]) * a.intermediate + k);
            acc[j] += dot8(ring[r], hv);
          }
        }
      }
      issue(ring[r]);
      if (++cs < spans) continue;
      cs = 0;
      // y_e of the group's slots: lane 8j holds slot j's, passed to lane j.
      const float total = sum_to_lanes(acc, lane);
      const float v = __shfl_sync(0xffffffffu, total, 8 * lane);
      if (lane < n) down_store(a, rt, y_e[warp], slots[lane], cu, v);
      if (++cg < groups) {
        start_group(cg);
        continue;
      }
      __syncwarp();
      combine_column(a, rt, y_e[warp], cu);
      __syncwarp();
      cg = 0;
      cu += stride;
      if (cu < units) start_group(0);
    }
  }
  // No slot routed anywhere (every id out of range): y is zero.
  if (groups == 0) {
    for (int i = int(blockIdx.x) * blockDim.x + threadIdx.x; i < a.tokens * a.hidden; i += gridDim.x * blockDim.x) {
      a.y[i] = 0;
    }
  }
}

// Resident blocks per device of the two kernels.
ResidentBlocks resident() {
  static std::atomic<int> cache[64][2];
  return resident_blocks(cache, {264, 264}, [] {
    ResidentBlocks per{0, 0};
    // The staged rows: up to kStageBytes of dynamic shared memory beyond the static 27/43 KB.
    cudaFuncSetAttribute(decode_gate_up_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageBytes);
    cudaFuncSetAttribute(decode_down_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageBytes);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.gate_up, decode_gate_up_rows_kernel, kWarps * 32, kStageBytes);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.down, decode_down_rows_kernel, kWarps * 32, kStageBytes);
    return per;
  });
}

}  // namespace

moefuse_status decode_rows_launch(const moefuse_decode_args& a, cudaStream_t stream, const char* name) {
  if (a.tokens * a.top_k > kDownSlots) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: the row-dot kernels take at most %d slots (tokens %d x top_k %d)",
                name, kDownSlots, a.tokens, a.top_k);
  }
  if (a.activation == MOEFUSE_ACTIVATION_RELU2 && a.intermediate % 2 != 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: RELU2 row pairs need an even intermediate", name);
  }
  const ResidentBlocks r = resident();
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int slots = a.tokens * a.top_k;
  // At most min(experts, slots) experts are touched, each with groups of kGroupSlots.
  const int max_units = (min(a.experts, slots) + slots / kGroupSlots) * (gated ? a.intermediate : a.intermediate / 2);
  const int up_blocks = max(1, min(r.gate_up, (max_units + kWarps - 1) / kWarps));
  const int down_blocks =
      max(1, min(r.down, (a.hidden + kWarps - 1) / kWarps));
  // Programmatic stream serialization, as the tensor-core pair (decode.cu).
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kWarps * 32);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // The staged activation rows (x, then h) in dynamic shared memory, where they fit.
  const size_t x_bytes = size_t(a.tokens) * a.hidden * 2, h_bytes = size_t(slots) * a.intermediate * 2;
  cfg.gridDim = dim3(up_blocks);
  cfg.dynamicSmemBytes = staged(x_bytes) ? x_bytes : 0;
  if (cudaLaunchKernelEx(&cfg, decode_gate_up_rows_kernel, a) != cudaSuccess) return after_launch(name);
  if (moefuse_status st = after_launch(name); st != MOEFUSE_STATUS_OK) return st;
  cfg.gridDim = dim3(down_blocks);
  cfg.dynamicSmemBytes = staged(h_bytes) ? h_bytes : 0;
  if (cudaLaunchKernelEx(&cfg, decode_down_rows_kernel, a) != cudaSuccess) return after_launch(name);
  return after_launch(name);
}

}  // namespace moefuse::moe
