// Token permutation into expert-major rows (with the gather of x fused), the weighted
// combine back to tokens, and the combine's backward. Plain CUDA; one launcher per op.
//
//   launcher               kernels (grid x block)
//   moefuse_moe_permute    count (T/256 x 256): per-chunk expert counts, stable in-chunk ranks
//                          scan (1 x 1024): chunk bases per expert, counts, offsets
//                          place (T/8 x 256, warp per token): row_of, source_of, x gather
//   moefuse_moe_combine    warp per token: fp32 weighted slot sum -> bf16
//   moefuse_moe_combine_bwd  warp per token: dy_perm rows and d_weights dot products
//
// Untrusted device data: expert ids (permute) and row_of (combine, combine_bwd) are
// checked against the buffers' extents before any address is formed from them; a bad slot
// is skipped and raises a MOEFUSE_MOE_ERROR_* bit in the error word, never an access
// outside the buffers. combine and combine_bwd also compare the permutation's tokens stamp
// (flags[1]) with their own token count when given one.
//
// NOTES: stability comes from the count pass ranking each warp's 32 tokens in token order
// (common/rank_slots.cuh: a token names each expert once, so in-expert order is token
// order), the function the expert-parallel count kernel (crates/comm/cuda/ep.cu) also uses.
#include <cuda_bf16.h>

#include "moefuse/moe/common.cuh"
#include "moefuse/moe_abi.h"
#include "moefuse/common/rank_slots.cuh"
#include "moefuse/common/rows.cuh"
#include "moefuse/spec.h"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_permute_args) == 88 && offsetof(moefuse_permute_args, topk_ids) == 16 &&
                  offsetof(moefuse_permute_args, flags) == 80,
              "moefuse_permute_args layout changed: bump MOEFUSE_ABI_VERSION and ffi.rs");
static_assert(sizeof(moefuse_combine_args) == 64 && offsetof(moefuse_combine_args, rows) == 12 &&
                  offsetof(moefuse_combine_args, out) == 40 && offsetof(moefuse_combine_args, errors) == 48 &&
                  offsetof(moefuse_combine_args, expect_tokens) == 56,
              "moefuse_combine_args layout changed: update ffi.rs (MoefuseCombineArgs) and its layout test");
static_assert(sizeof(moefuse_combine_bwd_args) == 80 && offsetof(moefuse_combine_bwd_args, rows) == 12 &&
                  offsetof(moefuse_combine_bwd_args, d_weights) == 56 &&
                  offsetof(moefuse_combine_bwd_args, errors) == 64 &&
                  offsetof(moefuse_combine_bwd_args, expect_tokens) == 72,
              "moefuse_combine_bwd_args layout changed: update ffi.rs (MoefuseCombineBwdArgs) and its layout test");

namespace moefuse::moe {
namespace {

using namespace moefuse::rows;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = MOEFUSE_PERMUTE_CHUNK;
constexpr int kMaxExperts = MOEFUSE_SPEC_MAX_EXPERTS;  // crates/spec: limits.rs
constexpr int kMaxTopK = MOEFUSE_SPEC_MAX_TOP_K;
static_assert(kChunk == kWarps * 32, "count: 32 tokens per warp");

__device__ __forceinline__ void raise(uint32_t* flags, uint32_t bit) {
  if (flags) atomicOr(flags, bit);
}

// An untrusted row_of entry: itself when inside 0..rows-1, else -1 (the slot is skipped);
// anything but the permutation's own -1 (a dropped slot, flagged by permute) raises
// MOEFUSE_MOE_ERROR_ROW.
__device__ __forceinline__ int checked_row(int row, int rows, uint32_t* errors) {
  if (row >= 0 && row < rows) return row;
  if (row != -1) raise(errors, MOEFUSE_MOE_ERROR_ROW);
  return -1;
}

// The permutation's tokens stamp disagrees with this call's token count.
__device__ __forceinline__ bool stale(const int32_t* expect_tokens, int tokens) {
  return expect_tokens && *expect_tokens != tokens;
}

// ---- count ------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) permute_count(moefuse_permute_args p) {
  extern __shared__ int smem[];
  const int E = p.experts, k = p.top_k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* hist = smem;                             // (kWarps, E): counts, then warp bases
  int* ids = smem + kWarps * E + warp * 32 * k;  // (32, k): this warp's routing
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) hist[i] = 0;
  const int t0 = blockIdx.x * kChunk + warp * 32;
  const int n_tok = max(0, min(32, p.tokens - t0));
  for (int i = lane; i < n_tok * k; i += 32) ids[i] = p.topk_ids[size_t(t0) * k + i];
  __syncthreads();
  int* h = hist + warp * E;
  rank_slots(ids, n_tok, k, E, h, lane, [&](int i, int j, int, bool live, bool ok, int pos, bool dup, int) {
    if (live && !ok) raise(p.flags, MOEFUSE_MOE_ERROR_EXPERT_ID);
    if (dup) raise(p.flags, MOEFUSE_MOE_ERROR_DUPLICATE);
    // row_of holds the in-chunk rank for now; the second pass adds the warp bases, place()
    // the chunk's.
    if (live) p.row_of[size_t(t0 + i) * k + j] = ok ? pos : -1;
  });
  __syncthreads();
  warp_bases<kWarps>(hist, E, p.workspace + blockIdx.x * E);
  __syncthreads();
  for (int i = lane; i < n_tok * k; i += 32) {
    const int e = ids[i];
    if (e >= 0 && e < E) p.row_of[size_t(t0) * k + i] += h[e];
  }
}

// ---- scan: chunk counts -> chunk bases (global, expert start included) -------------------
__global__ void __launch_bounds__(1024) permute_scan(moefuse_permute_args p) {
  __shared__ int total[kMaxExperts];
  const int E = p.experts;
  const int chunks = (p.tokens + kChunk - 1) / kChunk;
  // The stamp combine/combine_bwd compare (expect_tokens): which token count row_of is for.
  if (threadIdx.x == 0 && p.flags) p.flags[1] = uint32_t(p.tokens);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      const int v = p.workspace[c * E + e];
      p.workspace[c * E + e] = run;
      run += v;
    }
    total[e] = run;
    p.counts[e] = run;
  }
  __syncthreads();
  // Offsets (prefix-sum ends) by one thread per expert over the earlier experts' totals.
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int start = 0;
    for (int f = 0; f < e; ++f) start += total[f];
    p.offsets[e] = start + total[e];
    for (int c = 0; c < chunks; ++c) p.workspace[c * E + e] += start;
  }
}

// ---- place: final rows, inverse map, gather --------------------------------------------
__global__ void __launch_bounds__(kThreads) permute_place(moefuse_permute_args p) {
  __shared__ uint4* dst[kWarps][kMaxTopK];
  const int k = p.top_k, D = p.hidden, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= p.tokens) return;
  int row = -1;
  if (lane < k) {
    const int e = p.topk_ids[size_t(t) * k + lane];
    if (e >= 0 && e < p.experts) {
      row = p.row_of[size_t(t) * k + lane] + p.workspace[(t / kChunk) * p.experts + e];
      p.row_of[size_t(t) * k + lane] = row;
      p.source_of[row] = t * k + lane;
    }
  }
  if (!p.x_perm) return;
  const unsigned valid = __ballot_sync(~0u, row >= 0);
  if (row >= 0) dst[warp][__popc(valid & ((1u << lane) - 1))] = reinterpret_cast<uint4*>(p.x_perm + size_t(row) * D);
  __syncwarp();
  warp_copy_row_to(dst[warp], __popc(valid), reinterpret_cast<const uint4*>(p.x + size_t(t) * D), D / 8, lane);
}

// ---- combine: warp per token -------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) combine(moefuse_combine_args p) {
  __shared__ const uint4* rows[kWarps][kMaxTopK];
  __shared__ float ws[kWarps][kMaxTopK];
  const int k = p.top_k, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= p.tokens) return;
  if (stale(p.expect_tokens, p.tokens)) {
    if (lane == 0) raise(p.errors, MOEFUSE_MOE_ERROR_STALE);
    uint4* out = reinterpret_cast<uint4*>(p.out + size_t(t) * p.hidden);
    for (int c = lane; c < p.hidden / 8; c += 32) out[c] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int row = lane < k ? checked_row(p.row_of[size_t(t) * k + lane], p.rows, p.errors) : -1;
  const unsigned valid = __ballot_sync(~0u, row >= 0);
  if (row >= 0) {
    const int at = __popc(valid & ((1u << lane) - 1));
    rows[warp][at] = reinterpret_cast<const uint4*>(p.y + size_t(row) * p.hidden);
    ws[warp][at] = p.weights ? p.weights[size_t(t) * k + lane] : 1.f;
  }
  __syncwarp();
  warp_weighted_sum(rows[warp], ws[warp], __popc(valid), reinterpret_cast<uint4*>(p.out + size_t(t) * p.hidden),
                    p.hidden / 8, lane);
}

// ---- combine backward: warp per token ----------------------------------------------------
__global__ void __launch_bounds__(kThreads) combine_bwd(moefuse_combine_bwd_args p) {
  const int k = p.top_k, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= p.tokens) return;
  const int n = p.hidden / 8;
  // A stale stamp skips every slot (row_of is not read); NOTES: folded into the loop, as an
  // early return made ptxas spill on sm_100a.
  const bool is_stale = stale(p.expect_tokens, p.tokens);
  const uint4* dy = reinterpret_cast<const uint4*>(p.dy + size_t(t) * p.hidden);
  bool bad = false;  // some entry outside -1..rows-1 (the same in every lane)
  for (int j = 0; j < k; ++j) {
    const int row = is_stale ? -1 : p.row_of[size_t(t) * k + j];
    if (uint32_t(row) >= uint32_t(p.rows)) {  // negative or past the buffers: skipped
      bad |= row != -1;
      if (lane == 0 && p.weights != nullptr) p.d_weights[size_t(t) * k + j] = 0.f;
      continue;
    }
    uint4* out = reinterpret_cast<uint4*>(p.dy_perm + size_t(row) * p.hidden);
    if (p.weights == nullptr) {  // gather mode: the row copied unweighted
      for (int c = lane; c < n; c += 32) out[c] = __ldg(dy + c);
      continue;
    }
    const float w = p.weights[size_t(t) * k + j];
    const uint4* y = reinterpret_cast<const uint4*>(p.y + size_t(row) * p.hidden);
    float dot = 0.f;
    for (int c = lane; c < n; c += 32) {
      const uint4 g = __ldg(dy + c);
      dot += dot_bf16x8(g, __ldg(y + c));
      out[c] = scale_bf16x8(g, w);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(~0u, dot, o);
    if (lane == 0) p.d_weights[size_t(t) * k + j] = dot;
  }
  if (lane == 0 && (bad || is_stale)) {
    raise(p.errors, (bad ? MOEFUSE_MOE_ERROR_ROW : 0u) | (is_stale ? MOEFUSE_MOE_ERROR_STALE : 0u));
  }
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" size_t moefuse_moe_permute_workspace(int32_t tokens, int32_t experts) {
  const size_t chunks = tokens > 0 ? (size_t(tokens) + kChunk - 1) / kChunk : 1;
  return chunks * size_t(experts > 0 ? experts : 1) * sizeof(int32_t);
}

extern "C" moefuse_status moefuse_moe_permute(const moefuse_permute_args* a, void* stream) {
  const char* name = "moefuse_moe_permute";
  if (!a) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null arguments", name);
  if (a->tokens < 0 || a->experts < 1 || a->experts > kMaxExperts || a->top_k < 1 || a->top_k > kMaxTopK ||
      (a->x_perm && (a->hidden < 8 || a->hidden % 8 != 0))) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens %d, experts %d, top_k %d, hidden %d out of range", name,
                a->tokens, a->experts, a->top_k, a->hidden);
  }
  if (!a->topk_ids && a->tokens > 0) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null topk_ids", name);
  if (!a->counts || !a->offsets || !a->row_of || !a->source_of || !a->workspace || (a->x_perm && !a->x)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null output or workspace", name);
  }
  if (a->x_perm && ((reinterpret_cast<uintptr_t>(a->x) | reinterpret_cast<uintptr_t>(a->x_perm)) % 16 != 0)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: x and x_perm must be 16-byte aligned", name);
  }
  auto s = static_cast<cudaStream_t>(stream);
  const int chunks = a->tokens > 0 ? (a->tokens + kChunk - 1) / kChunk : 0;
  if (chunks > 0) {
    const size_t smem = sizeof(int) * (size_t(kWarps) * a->experts + size_t(kWarps) * 32 * a->top_k);
    permute_count<<<chunks, kThreads, smem, s>>>(*a);
    if (auto st = after_launch("permute_count"); st != MOEFUSE_STATUS_OK) return st;
  }
  permute_scan<<<1, 1024, 0, s>>>(*a);
  if (auto st = after_launch("permute_scan"); st != MOEFUSE_STATUS_OK) return st;
  if (a->tokens > 0) {
    permute_place<<<(a->tokens + kWarps - 1) / kWarps, kThreads, 0, s>>>(*a);
    return after_launch("permute_place");
  }
  return MOEFUSE_STATUS_OK;
}

extern "C" moefuse_status moefuse_moe_combine(const moefuse_combine_args* a, void* stream) {
  const char* name = "moefuse_moe_combine";
  if (!a) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null arguments", name);
  if (a->tokens < 0 || a->top_k < 1 || a->top_k > kMaxTopK || a->hidden < 8 || a->hidden % 8 != 0 || a->rows < 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens %d, top_k %d, hidden %d, rows %d out of range", name,
                a->tokens, a->top_k, a->hidden, a->rows);
  }
  if (a->tokens == 0) return MOEFUSE_STATUS_OK;
  if (!a->row_of || !a->out || (a->rows > 0 && !a->y)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if ((reinterpret_cast<uintptr_t>(a->y) | reinterpret_cast<uintptr_t>(a->out)) % 16 != 0) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: y and out must be 16-byte aligned", name);
  }
  combine<<<(a->tokens + kWarps - 1) / kWarps, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(*a);
  return after_launch(name);
}

extern "C" moefuse_status moefuse_moe_combine_bwd(const moefuse_combine_bwd_args* a, void* stream) {
  const char* name = "moefuse_moe_combine_bwd";
  if (!a) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null arguments", name);
  if (a->tokens < 0 || a->top_k < 1 || a->top_k > kMaxTopK || a->hidden < 8 || a->hidden % 8 != 0 || a->rows < 0) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens %d, top_k %d, hidden %d, rows %d out of range", name,
                a->tokens, a->top_k, a->hidden, a->rows);
  }
  if (a->tokens == 0) return MOEFUSE_STATUS_OK;
  const bool gather = a->weights == nullptr;  // dy_perm = dy rows only
  if (!a->row_of || !a->dy || (!gather && !a->d_weights) || (a->rows > 0 && ((!gather && !a->y) || !a->dy_perm))) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: null buffer", name);
  }
  if ((reinterpret_cast<uintptr_t>(a->dy) | reinterpret_cast<uintptr_t>(a->y) |
       reinterpret_cast<uintptr_t>(a->dy_perm)) % 16 != 0) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: dy, y and dy_perm must be 16-byte aligned", name);
  }
  combine_bwd<<<(a->tokens + kWarps - 1) / kWarps, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(*a);
  return after_launch(name);
}
