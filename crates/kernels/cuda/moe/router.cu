// Router forward and backward (kernels/include/moefuse/abi.h: moefuse_router_args,
// moefuse_router_bwd_args): one warp per token, scores in fp64, top-k by repeated warp
// argmax with ties to the lower id, exactly the CPU reference's `reference::router`.
//
// warp  | role                                  | state
// ------+---------------------------------------+---------------------------------------
// 0..3  | one token each (grid: tokens / 4)     | its scores in shared memory, a taken
//       |                                       | bitmask in a register (bit c: expert
//       |                                       | lane + 32c), its slot's id in lane s
//
// NaN and infinities: selection uses one strict total order on (score, id), torch.topk's:
// NaN ranks above every number (+inf included), equal scores (NaN with NaN, +0 with -0)
// go to the lower id. Every lane and every reduction order picks the same experts, so a
// token never gets an expert twice or loses a slot. Weights follow IEEE arithmetic
// (a NaN or +inf logit makes the token's softmax weights NaN), exactly as the reference.
//
// NOTES: per-lane state never lives in an indexed array (the build fails on local memory):
// a lane's experts are lane + 32c, read from shared memory in fully unrolled loops, and
// "taken" is one bit per c in a register.
#include <cmath>

#include "moefuse/moe/common.cuh"
#include "moefuse/spec.h"

namespace moefuse::moe {
namespace {

constexpr int kMaxExperts = MOEFUSE_SPEC_MAX_EXPERTS;  // crates/spec: limits.rs
constexpr int kMaxTopK = MOEFUSE_SPEC_MAX_TOP_K;
constexpr int kMaxGroups = kMaxExperts / 2;  // every group holds >= 2 experts
constexpr int kPerLane = kMaxExperts / kWarp;
constexpr int kWarpsPerBlock = 4;
static_assert(kPerLane <= 32, "the taken mask is one 32-bit word per lane: kMaxExperts <= 1024");
static_assert(kMaxTopK <= kWarp, "slot s lives in lane s: kMaxTopK <= 32");

// Per-warp shared memory: selection scores, group scores, kept-group bits.
struct RouterSmem {
  double score[kMaxExperts];
  double group[kMaxGroups];
  uint32_t kept[kMaxGroups / 32];
};
static_assert(sizeof(RouterSmem) * kWarpsPerBlock <= 48 * 1024,
              "static shared memory is limited to 48 KiB: use fewer warps per block");

// The reference's overflow-free logistic function.
__device__ __forceinline__ double sigmoid(double x) {
  if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
  double e = exp(x);
  return e / (1.0 + e);
}

// (va, ia) ranks before (vb, ib): NaN above every number, then the higher score, ties
// (equal scores, or both NaN) to the lower id; id -1 is "none". A strict total order, so
// the warp's butterfly reduction agrees in every lane.
__device__ __forceinline__ bool beats(double va, int ia, double vb, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool na = isnan(va), nb = isnan(vb);
  if (na || nb) return na && (!nb || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

// The best of v[0..n) not marked in `taken` (this lane's bit c = entry lane + 32c), with
// ties to the lower index; every lane returns the same index, or -1 when none is left.
__device__ __forceinline__ int warp_argmax(const double* v, int n, uint32_t taken, int lane) {
  double best = -INFINITY;
  int id = -1;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < n && !((taken >> c) & 1u)) {
      double x = v[j];
      if (beats(x, j, best, id)) {  // ascending j: a tie keeps the lower id
        best = x;
        id = j;
      }
    }
  }
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    double ob = __shfl_xor_sync(0xffffffffu, best, o);
    int oi = __shfl_xor_sync(0xffffffffu, id, o);
    if (beats(ob, oi, best, id)) {
      best = ob;
      id = oi;
    }
  }
  return id;
}

// Marks index `win` in the owner lane's taken mask.
__device__ __forceinline__ void take(uint32_t& taken, int win, int lane) {
  if (win >= 0 && (win & (kWarp - 1)) == lane) taken |= 1u << (win / kWarp);
}

// Group-limited selection (sigmoid grouped): scores each group by the sum of its top 2,
// keeps the topk_group best, and returns the taken mask that excludes every expert of the
// other groups. Reads s.score, writes s.group and s.kept.
__device__ uint32_t exclude_groups(RouterSmem& s, int experts, int n_group, int topk_group,
                                   int lane) {
  const int per_group = experts / n_group;
  for (int g = lane; g < n_group; g += kWarp) {
    double top1 = 0.0, top2 = 0.0;
    int i1 = -1, i2 = -1;
    for (int j = g * per_group; j < (g + 1) * per_group; ++j) {
      double x = s.score[j];
      if (beats(x, j, top1, i1)) {
        top2 = top1;
        i2 = i1;
        top1 = x;
        i1 = j;
      } else if (beats(x, j, top2, i2)) {
        top2 = x;
        i2 = j;
      }
    }
    s.group[g] = top1 + top2;  // per_group >= 2: both set
  }
  if (lane < kMaxGroups / 32) s.kept[lane] = 0;
  __syncwarp();
  uint32_t gtaken = 0;
  for (int i = 0; i < topk_group; ++i) {
    int win = warp_argmax(s.group, n_group, gtaken, lane);
    take(gtaken, win, lane);
    if (lane == 0 && win >= 0) s.kept[win / 32] |= 1u << (win % 32);
    __syncwarp();
  }
  uint32_t taken = 0;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    int g = j / per_group;
    if (j < experts && !((s.kept[g / 32] >> (g % 32)) & 1u)) taken |= 1u << c;
  }
  return taken;
}

__global__ void __launch_bounds__(kWarpsPerBlock* kWarp)
    router_fwd_kernel(moefuse_router_args a) {
  __shared__ RouterSmem smem[kWarpsPerBlock];
  // A kernel launched programmatically behind this one (the decode gate_up) becomes
  // resident now and waits in griddepcontrol.wait for this grid's completion and writes.
  allow_dependent_launch();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int t = blockIdx.x * kWarpsPerBlock + warp;
  if (t >= a.tokens) return;  // whole warps leave; no block barrier follows
  RouterSmem& s = smem[warp];
  const int e = a.experts, k = a.top_k;
  const float* l = a.logits + int64_t(t) * e;
  const bool sigmoid_router = a.kind == MOEFUSE_ROUTER_SIGMOID_GROUPED;

  // Selection scores: the logit (softmax is increasing), or sigmoid + bias.
  double lmax = -INFINITY;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < e) {
      double x = double(l[j]);
      lmax = fmax(lmax, x);
      s.score[j] = sigmoid_router ? sigmoid(x) + (a.bias ? double(a.bias[j]) : 0.0) : x;
    }
  }
  __syncwarp();
  uint32_t taken = sigmoid_router ? exclude_groups(s, e, a.n_group, a.topk_group, lane) : 0u;

  // Top-k, best first: slot i's id lands in lane i.
  int my_id = -1;
  for (int i = 0; i < k; ++i) {
    int win = warp_argmax(s.score, e, taken, lane);
    take(taken, win, lane);
    if (lane == i) my_id = win;
  }
  const bool mine = lane < k && my_id >= 0;

  // Weights.
  double w = 0.0;
  if (sigmoid_router) {
    double sv = mine ? sigmoid(double(l[my_id])) : 0.0;
    double z = a.renormalize ? warp_sum(sv) : 1.0;
    w = sv / z * double(a.routed_scaling_factor);
  } else {
    lmax = warp_max(lmax);
    double part = 0.0;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      int j = lane + kWarp * c;
      if (j < e) part += exp(double(l[j]) - lmax);
    }
    double zsum = warp_sum(part);
    double p = mine ? exp(double(l[my_id]) - lmax) / zsum : 0.0;
    double z = a.renormalize ? warp_sum(p) : 1.0;
    w = p / z;
  }
  if (lane < k) {
    a.topk_ids[int64_t(t) * k + lane] = my_id;
    a.topk_weights[int64_t(t) * k + lane] = float(w);
  }
}

__global__ void __launch_bounds__(kWarpsPerBlock* kWarp)
    router_bwd_kernel(moefuse_router_bwd_args a) {
  __shared__ double grad[kWarpsPerBlock][kMaxExperts];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int t = blockIdx.x * kWarpsPerBlock + warp;
  if (t >= a.tokens) return;
  double* g = grad[warp];
  const int e = a.experts, k = a.top_k;
  const float* l = a.logits + int64_t(t) * e;
  float* dl = a.d_logits + int64_t(t) * e;
  const bool sigmoid_router = a.kind == MOEFUSE_ROUTER_SIGMOID_GROUPED;

  // Slot `lane`: its expert and upstream gradient (ids outside 0..e are ignored).
  int id = -1;
  double d = 0.0;
  if (lane < k) {
    id = a.topk_ids[int64_t(t) * k + lane];
    d = double(a.d_topk_weights[int64_t(t) * k + lane]);
    if (id < 0 || id >= e) id = -1;
  }
  const bool mine = id >= 0;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < e) g[j] = 0.0;
  }
  __syncwarp();

  if (sigmoid_router) {
    // dL/dl_i = dL/ds_i s_i (1 - s_i) on the chosen experts, zero elsewhere.
    const double rsf = double(a.routed_scaling_factor);
    double sv = mine ? sigmoid(double(l[id])) : 0.0;
    double z = warp_sum(sv);
    double c = warp_sum(mine ? d * sv / z : 0.0);
    double ds = a.renormalize ? rsf * (d - c) / z : rsf * d;
    if (mine) g[id] = ds * sv * (1.0 - sv);
    __syncwarp();
#pragma unroll
    for (int cc = 0; cc < kPerLane; ++cc) {
      int j = lane + kWarp * cc;
      if (j < e) dl[j] = float(g[j]);
    }
    return;
  }

  // Softmax: dL/dl_i = p_i (g_i - sum_j g_j p_j), g = dL/dp on the chosen experts.
  double lmax = -INFINITY;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < e) lmax = fmax(lmax, double(l[j]));
  }
  lmax = warp_max(lmax);
  double part = 0.0;
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < e) part += exp(double(l[j]) - lmax);
  }
  const double zsum = warp_sum(part);
  double p = mine ? exp(double(l[id]) - lmax) / zsum : 0.0;
  double gs = d;
  if (a.renormalize) {
    double z = warp_sum(p);
    double c = warp_sum(mine ? d * p / z : 0.0);
    gs = (d - c) / z;
  }
  double gp = warp_sum(mine ? gs * p : 0.0);
  if (mine) g[id] = gs;
  __syncwarp();
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    int j = lane + kWarp * c;
    if (j < e) {
      double pj = exp(double(l[j]) - lmax) / zsum;
      dl[j] = float(pj * (g[j] - gp));
    }
  }
}

moefuse_status check_sizes(const char* name, int tokens, int experts, int top_k, int kind) {
  if (tokens < 0 || experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > kMaxTopK ||
      top_k > experts) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM,
                "%s: tokens=%d experts=%d top_k=%d (need tokens >= 0, 1 <= experts <= %d, "
                "1 <= top_k <= min(%d, experts))",
                name, tokens, experts, top_k, kMaxExperts, kMaxTopK);
  }
  if (kind != MOEFUSE_ROUTER_SOFTMAX_TOPK && kind != MOEFUSE_ROUTER_SIGMOID_GROUPED) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: unknown router kind %d", name, kind);
  }
  return MOEFUSE_STATUS_OK;
}

int blocks_for(int tokens) { return (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock; }

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_router_fwd(const moefuse_router_args* p, void* stream) {
  const char* name = "moefuse_moe_router_fwd";
  if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  moefuse_status st = check_sizes(name, p->tokens, p->experts, p->top_k, p->kind);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (p->kind == MOEFUSE_ROUTER_SIGMOID_GROUPED) {
    int ng = p->n_group, kg = p->topk_group;
    if (ng < 1 || p->experts % ng != 0 || p->experts / ng < 2 || kg < 1 || kg > ng ||
        p->top_k > kg * (p->experts / ng)) {
      return fail(MOEFUSE_STATUS_INVALID_PROBLEM,
                  "%s: n_group=%d topk_group=%d for experts=%d top_k=%d (need n_group | experts, "
                  ">= 2 experts per group, 1 <= topk_group <= n_group, top_k <= kept experts)",
                  name, ng, kg, p->experts, p->top_k);
    }
  } else if (p->bias != nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: a bias was given to the softmax router", name);
  }
  if (p->logits == nullptr || p->topk_ids == nullptr || p->topk_weights == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer (logits=%p ids=%p weights=%p)",
                name, (const void*)p->logits, (void*)p->topk_ids, (void*)p->topk_weights);
  }
  if (p->tokens == 0) return MOEFUSE_STATUS_OK;
  router_fwd_kernel<<<blocks_for(p->tokens), kWarpsPerBlock * kWarp, 0,
                      static_cast<cudaStream_t>(stream)>>>(*p);
  return after_launch(name);
}

extern "C" moefuse_status moefuse_moe_router_bwd(const moefuse_router_bwd_args* p, void* stream) {
  const char* name = "moefuse_moe_router_bwd";
  if (p == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  moefuse_status st = check_sizes(name, p->tokens, p->experts, p->top_k, p->kind);
  if (st != MOEFUSE_STATUS_OK) return st;
  if (p->logits == nullptr || p->topk_ids == nullptr || p->d_topk_weights == nullptr ||
      p->d_logits == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM,
                "%s: null buffer (logits=%p ids=%p d_weights=%p d_logits=%p)", name,
                (const void*)p->logits, (const void*)p->topk_ids, (const void*)p->d_topk_weights,
                (void*)p->d_logits);
  }
  if (p->tokens == 0) return MOEFUSE_STATUS_OK;
  router_bwd_kernel<<<blocks_for(p->tokens), kWarpsPerBlock * kWarp, 0,
                      static_cast<cudaStream_t>(stream)>>>(*p);
  return after_launch(name);
}
