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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

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

// One unit's sums are complete (every lane holds them): h, h_pre and the expert-major
// copies of its slots, lane j writing slot j.
__device__ void gate_up_store(const moefuse_decode_args& a, const int* slots, int n, int p, const float (&s_lo)[kGroupSlots],
                              const float (&s_hi)[kGroupSlots]) {
  const int lane = threadIdx.x & 31;
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
#pragma unroll
  for (int j = 0; j < kGroupSlots; ++j) {
    if (lane != j || j >= n) continue;
    const int s = slots[j];
    int lo, hi;
    pair_rows(a, p, lo, hi);
    const int row = decode::expert_row(a, s);
    const float v_lo = s_lo[j], v_hi = s_hi[j];
    if (gated) {
      decode::store_h(a, s, row, p, bf16_bits(eval(a.activation, a.alpha, a.limit, v_lo, v_hi).h));
    } else {
      decode::store_h(a, s, row, lo, bf16_bits(eval(a.activation, 0.f, 0.f, v_lo, 0.f).h));
      decode::store_h(a, s, row, hi, bf16_bits(eval(a.activation, 0.f, 0.f, v_hi, 0.f).h));
    }
    decode::store_h_pre(a, row, width, lo, hi, v_lo, v_hi);
  }
}

__global__ void __launch_bounds__(kWarps * 32, 2) decode_gate_up_rows_kernel(moefuse_decode_args a) {
  __shared__ RowsShared sm;
  decode::wait_for_prerequisite();
  decode::allow_dependent_launch();
  sm.routing.build(a.topk_ids, a.tokens * a.top_k, a.experts, blockIdx.x == 0 ? a.errors : nullptr);
  sm.groups.build(sm.routing, kGroupSlots);
  const Routing& rt = sm.routing;
  const Groups& gr = sm.groups;
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  const int pairs = gated ? a.intermediate : a.intermediate / 2;
  const int units = gr.count * pairs, spans = (a.hidden + kSpan - 1) / kSpan;
  const int lane = threadIdx.x & 31, stride = balanced_stride(units, int(gridDim.x) * kWarps);
  const int k_lane = lane * 8, gw = int(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  // The issuing side: unit `iu`, span `is`, its two rows.
  int iu = gw < stride ? gw : units, is = 0;
  const uint16_t *i_lo = nullptr, *i_hi = nullptr;
  auto rows_of = [&](int u) {
    const int p = u / gr.count, gi = u - p * gr.count;
    int lo, hi;
    pair_rows(a, p, lo, hi);
    const uint16_t* w = a.w_gate_up + size_t(rt.expert[gr.touched[gi]]) * width * a.hidden;
    i_lo = w + size_t(lo) * a.hidden;
    i_hi = w + size_t(hi) * a.hidden;
  };
  if (iu < units) rows_of(iu);
  uint4 r_lo[kRing], r_hi[kRing];
  auto issue = [&](uint4& lo, uint4& hi) {
    if (iu >= units) return;
    const int k = is * kSpan + k_lane;
    lo = load_row(i_lo, k, a.hidden);
    hi = load_row(i_hi, k, a.hidden);
    if (++is == spans) {
      is = 0;
      iu += stride;
      if (iu < units) rows_of(iu);
    }
  };
#pragma unroll
  for (int r = 0; r < kRing; ++r) issue(r_lo[r], r_hi[r]);
  // The consuming side: unit `cu`, span `cs`, its slots' x rows and the lane's sums.
  int cu = gw < stride ? gw : units, cs = 0, n = 0;
  const int* slots = nullptr;
  const uint16_t* xr[kGroupSlots];
  float s_lo[kGroupSlots], s_hi[kGroupSlots];
  auto start = [&](int u) {
    const int gi = u % gr.count, ti = gr.touched[gi], first = rt.start[ti] + gr.base[gi];
    n = min(rt.start[ti + 1] - first, kGroupSlots);
    slots = rt.slot + first;
#pragma unroll
    for (int j = 0; j < kGroupSlots; ++j) {
      xr[j] = a.x + size_t(slots[j < n ? j : 0] / a.top_k) * a.hidden;
      s_lo[j] = s_hi[j] = 0.f;
    }
  };
  if (cu < units) start(cu);
  while (cu < units) {
#pragma unroll
    for (int r = 0; r < kRing; ++r) {
      if (cu >= units) break;
      const int k = cs * kSpan + k_lane;
      if (k < a.hidden) {
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) {
          if (j < n) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr[j] + k));
            s_lo[j] += dot8(r_lo[r], xv);
            s_hi[j] += dot8(r_hi[r], xv);
          }
        }
      }
      issue(r_lo[r], r_hi[r]);
      if (++cs == spans) {
        // n is the same in every lane: the butterflies of empty slots are skipped whole.
#pragma unroll
        for (int j = 0; j < kGroupSlots; ++j) {
          if (j < n) {
            s_lo[j] = warp_sum(s_lo[j]);
            s_hi[j] = warp_sum(s_hi[j]);
          }
        }
        gate_up_store(a, slots, n, cu / gr.count, s_lo, s_hi);
        cs = 0;
        cu += stride;
        if (cu < units) start(cu);
      }
    }
  }
}

// ---- down + combine ---------------------------------------------------------------------

// Slots the down kernel keeps y_e of, per warp (MOEFUSE_DECODE_ROW_DOT_MAX_SLOTS).
constexpr int kDownSlots = MOEFUSE_DECODE_ROW_DOT_MAX_SLOTS;

__global__ void __launch_bounds__(kWarps * 32, 2) decode_down_rows_kernel(moefuse_decode_args a) {
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
            const uint4 hv = *reinterpret_cast<const uint4*>(a.h + size_t(slots[j]) * a.intermediate + k);
            acc[j] += dot8(ring[r], hv);
          }
        }
      }
      issue(ring[r]);
      if (++cs < spans) continue;
      cs = 0;
      // y_e of the group's slots, rounded to bf16 as the layer's other paths store it.
#pragma unroll
      for (int j = 0; j < kGroupSlots; ++j) {
        if (j < n) acc[j] = warp_sum(acc[j]);  // n: the same in every lane
      }
#pragma unroll
      for (int j = 0; j < kGroupSlots; ++j) {
        if (lane != j || j >= n) continue;
        const int s = slots[j];
        const __nv_bfloat16 b = __float2bfloat16_rn(acc[j]);
        y_e[warp][rt.position[s]] = __bfloat162float(b);
        if (a.y_e_rows != nullptr) {
          const int row = decode::expert_row(a, s);
          if (row >= 0) a.y_e_rows[size_t(row) * a.hidden + cu] = __bfloat16_as_ushort(b);
        }
      }
      if (++cg < groups) {
        start_group(cg);
        continue;
      }
      __syncwarp();
      // y[t, cu] = sum over the token's slots in order of w * y_e (fp32).
      for (int t = lane; t < a.tokens; t += 32) {
        float v = 0.f;
        for (int j = 0; j < a.top_k; ++j) {
          const int s = t * a.top_k + j, p = rt.position[s];
          if (p >= 0) v += a.topk_weights[s] * y_e[warp][p];
        }
        a.y[size_t(t) * a.hidden + cu] = bf16_bits(v);
      }
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
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.gate_up, decode_gate_up_rows_kernel, kWarps * 32, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.down, decode_down_rows_kernel, kWarps * 32, 0);
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
  cfg.gridDim = dim3(up_blocks);
  if (cudaLaunchKernelEx(&cfg, decode_gate_up_rows_kernel, a) != cudaSuccess) return after_launch(name);
  if (moefuse_status st = after_launch(name); st != MOEFUSE_STATUS_OK) return st;
  cfg.gridDim = dim3(down_blocks);
  if (cudaLaunchKernelEx(&cfg, decode_down_rows_kernel, a) != cudaSuccess) return after_launch(name);
  return after_launch(name);
}

}  // namespace moefuse::moe
