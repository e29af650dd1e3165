// The small-batch (decode) forward of moe_abi.h (moefuse_moe_decode_forward): two persistent
// kernels that stream every touched expert's weights from memory once, with the few token
// rows as the narrow side of tensor-core MMAs (mma.sync m16n8k16, weights as the 16-row A
// operand, up to 16 routed rows per pass as two 8-column B operands).
//
// Both kernels first build the same routing table in shared memory (decode_routing.cuh):
// the touched experts in ascending order and each one's slots in ascending order.
//
// gate_up kernel (8 warps per block), one unit = (touched expert, 16 rows of W_e):
//   warp   | work
//   -------+-----------------------------------------------------------------------
//   0..7   | an eighth of hidden (K) each: A rows straight from global memory into
//          | registers (16 bytes per lane per row), B = the x rows of the expert's slots
//          | (units taken from a counter the grid shares when unit_counter is given)
//   all    | fixed-order sum of the eight partials in shared memory, the activation on
//          | the fp32 sums, h (and the expert-major copies) written as bf16
// down kernel (16 warps per block), one unit = 16 columns of y (16 rows of every D_e):
//   warp   | work
//   -------+-----------------------------------------------------------------------
//   each   | (16-slot group of a touched expert, K split) items round-robin: y_e
//          | partials per slot
//   all    | fixed-order sum of the splits (bf16 y_e), then y[t] = sum_j w * y_e in
//          | slot order (fp32), written as bf16
//
// Up to kPipelinedMaxTokens tokens at hidden <= 2048 the gate_up runs software-pipelined
// (decode_gate_up_pipelined_kernel: the next unit's loads in flight during the current
// unit's sums and stores).
//
// NOTES: no shared-memory staging for A: each weight element is used by the 8 to 64 columns
// of one MMA group and never again, so registers are the stage. The K order inside an MMA
// is a permutation both operands follow (lane t's 16-byte load covers logical k 2t, 2t+1,
// 2t+8, 2t+9 of one MMA and the same four of the next), so a lane's load is one 16-byte
// vector of A and one of B.
#include <cuda_bf16.h>

#include <atomic>

#include "moefuse/moe/activation_math.cuh"
#include "moefuse/moe/common.cuh"
#include "moefuse/moe/decode_mma.cuh"
#include "moefuse/moe/resident.hpp"
#include "moefuse/moe_abi.h"

// The Rust mirror (crates/kernels/src/ffi.rs) asserts the same numbers.
static_assert(sizeof(moefuse_decode_args) == 144, "moefuse_decode_args layout changed: update ffi.rs");
static_assert(offsetof(moefuse_decode_args, alpha) == 28, "moefuse_decode_args layout changed");
static_assert(offsetof(moefuse_decode_args, topk_ids) == 40, "moefuse_decode_args layout changed");
static_assert(offsetof(moefuse_decode_args, errors) == 128, "moefuse_decode_args layout changed");
static_assert(offsetof(moefuse_decode_args, unit_counter) == 136, "moefuse_decode_args layout changed");

namespace moefuse::moe {
namespace {

using decode::bf16_bits;
using decode::kChunk;
using decode::kMaxGroupBlocks;
using decode::Routing;

constexpr int kGateUpWarps = 8;
constexpr int kDownWarps = 16;
// y_e partials of the down kernel: at most this many floats of dynamic shared memory
// (80 KiB; one block per SM).
constexpr int kPartFloats = 20480;

// ---- gate_up ----------------------------------------------------------------------------

// The eight warps' MMA partials of one group: [warp][column block][lane][fragment].
using GateUpPartials = float[kGateUpWarps][kMaxGroupBlocks][32][4];

struct GateUpShared {
  Routing routing;
  int next[2];  // the block's next units (unit_counter)
  GateUpPartials partial;
};

// The two rows of W_e a lane's fragments hold for tile `tile`: (row g, row g + 8) of the
// A tile, i.e. the gate and up rows of feature f0 + g when gated, features f0 + g and
// f0 + g + 8 for RELU2.
__device__ __forceinline__ void tile_rows(const moefuse_decode_args& a, int tile, int g, int& lo, int& hi) {
  if (a.activation == MOEFUSE_ACTIVATION_RELU2) {
    lo = tile * 16 + g;
    hi = lo + 8;
  } else if (a.layout == MOEFUSE_GATE_UP_SPLIT) {
    lo = tile * 8 + g;
    hi = a.intermediate + lo;
  } else {
    lo = 2 * (tile * 8 + g);
    hi = lo + 1;
  }
}

// One unit's slots [s0, s0 + n) of the expert's list, n <= 64: the warp's K range of the
// MMAs into shared partials.
template <int NB, int U>
__device__ void gate_up_partial(const moefuse_decode_args& a, GateUpShared& sm, const int* slots, int n,
                                const uint16_t* w_lo, const uint16_t* w_hi, int c0, int c1) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  uint32_t b_off[NB];  // tokens * hidden < 2^26
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int col = nb * 8 + g;
    b_off[nb] = uint32_t(slots[col < n ? col : 0] / a.top_k) * uint32_t(a.hidden);
  }
  float acc[NB][4];
  // Two blocks of 8 warps per SM (128 registers): U chunks per lane in flight (8 with one
  // column block, 4 with two).
  decode::mma_rows<NB, U>(acc, w_lo, w_hi, a.x, b_off, c0, c1);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sm.partial[warp][nb][lane][i] = acc[nb][i];
  }
}

__device__ void gate_up_store(const moefuse_decode_args& a, const GateUpPartials& partial, const int* slots, int n,
                              int tile, int blocks) {
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  for (int i = threadIdx.x; i < blocks * 32; i += blockDim.x) {
    const int nb = i >> 5, lane = i & 31, g = lane >> 2, t = lane & 3;
    float c[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kGateUpWarps; ++w) v += partial[w][nb][lane][r];
      c[r] = v;
    }
    int lo, hi;
    tile_rows(a, tile, g, lo, hi);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = nb * 8 + 2 * t + half;
      if (col >= n) continue;
      const int s = slots[col];
      const float v_lo = c[half], v_hi = c[2 + half];
      const int row = decode::expert_row(a, s);
      if (gated) {
        const Point p = eval(a.activation, a.alpha, a.limit, v_lo, v_hi);
        decode::store_h(a, s, row, tile * 8 + g, bf16_bits(p.h));
      } else {
        const int f = tile * 16 + g;
        decode::store_h(a, s, row, f, bf16_bits(eval(a.activation, 0.f, 0.f, v_lo, 0.f).h));
        decode::store_h(a, s, row, f + 8, bf16_bits(eval(a.activation, 0.f, 0.f, v_hi, 0.f).h));
      }
      decode::store_h_pre(a, row, width, lo, hi, v_lo, v_hi);
    }
  }
}

// Chunks per lane in flight in both kernels with one 8-column block (4 with two).
// NOTES: batches of 4 chunks (every load of a batch before its first MMA; at 8, ptxas
// starts the MMAs after 7 loads) were 1-4 % slower on Mixtral-8x7B and DeepSeek-V3 and no
// faster than the pipelined gate_up on Qwen3-30B-A3B (H200, 2026-12-07), and two L2
// prefetches from the gate_up kernel (its next unit's rows; the down weights once its units
// ran out) were 13-19 % slower at every Qwen3-30B-A3B T on the H100 (docs/perf-notes.md,
// sessions 28 and 29): all removed.
constexpr int kBatch = 8;

// A block takes its units (touched expert, 16 rows of W_e) statically (blockIdx.x,
// blockIdx.x + gridDim.x, ...) or, with a.unit_counter (zero at the launch), from a counter
// the grid shares, one unit ahead, so that the blocks that stream faster take more units
// and the gate_up ends together (H100: 1-3.5 % faster at T = 8..64, docs/perf-notes.md).
// The down kernel zeroes the counter again.
__global__ void __launch_bounds__(kGateUpWarps * 32, 2) decode_gate_up_kernel(moefuse_decode_args a) {
  __shared__ GateUpShared sm;
  // Launched programmatically behind the router: resident before it ends, reading its
  // topk_ids only once it has completed.
  wait_for_prerequisite();
  allow_dependent_launch();
  // The first unit's atomic is issued before the table build, which hides its round trip.
  uint32_t* counter = a.unit_counter;
  int first_unit = 0;
  if (counter != nullptr && threadIdx.x == 0) first_unit = int(atomicAdd(counter, 1u));
  sm.routing.build(a.topk_ids, a.tokens * a.top_k, a.experts, blockIdx.x == 0 ? a.errors : nullptr);
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  const int tiles = width / 16;
  const int units = sm.routing.touched * tiles;
  const int chunks = a.hidden / kChunk, warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int c0 = chunks * warp / kGateUpWarps, c1 = chunks * (warp + 1) / kGateUpWarps;
  int u = blockIdx.x;
  if (counter != nullptr) {
    if (threadIdx.x == 0) sm.next[0] = first_unit;
    __syncthreads();
    u = sm.next[0];
  }
  for (int i = 0; u < units; ++i) {
    // The unit after this one, read after this one's barriers (a touched expert has a
    // slot, so there is at least one group below); the other half of `next` was last read
    // before them.
    if (counter != nullptr && threadIdx.x == 0) sm.next[(i + 1) & 1] = int(atomicAdd(counter, 1u));
    const int ti = u / tiles, tile = u - ti * tiles, e = sm.routing.expert[ti];
    int lo, hi;
    tile_rows(a, tile, g, lo, hi);
    const uint16_t* w = a.w_gate_up + size_t(e) * width * a.hidden;
    const uint16_t *w_lo = w + size_t(lo) * a.hidden, *w_hi = w + size_t(hi) * a.hidden;
    const int first = sm.routing.start[ti], count = sm.routing.start[ti + 1] - first;
    for (int base = 0; base < count; base += 8 * kMaxGroupBlocks) {
      const int n = min(count - base, 8 * kMaxGroupBlocks), blocks = (n + 7) / 8;
      const int* slots = sm.routing.slot + first + base;
      __syncthreads();  // the previous group's partials are read (and sm.next written)
      if (blocks == 1) gate_up_partial<1, kBatch>(a, sm, slots, n, w_lo, w_hi, c0, c1);
      else gate_up_partial<2, kBatch / 2>(a, sm, slots, n, w_lo, w_hi, c0, c1);
      __syncthreads();
      gate_up_store(a, sm.partial, slots, n, tile, blocks);
    }
    u = counter != nullptr ? sm.next[(i + 1) & 1] : u + int(gridDim.x);
  }
}

// ---- gate_up, pipelined (hidden <= 2048, tokens <= kPipelinedMaxTokens) ------------------

// The pipelined gate_up's units: (group of at most 8 slots of one touched expert, 16 rows
// of W_e), for hidden of at most 8 * kGateUpWarps chunks (2048), so that a warp's share of a
// unit is one batch of at most 8 chunks.
constexpr int kPipelinedChunks = 8;
// The most tokens the pipelined gate_up serves. Measured on the H200 (2026-12-07, graph-
// replayed Qwen3-30B-A3B, against the general kernel in the same call): 30.6 / 31.5 µs at
// T = 1, 47.2 / 48.9 at 2, 76.3 / 77.6 at 4, 196.5 / 199.6 at 16, 268.5 / 271.6 at 32, but
// 311.0 / 303.6 at 64 (docs/perf-notes.md, session 29).
constexpr int kPipelinedMaxTokens = 32;

struct GateUpPipelinedShared {
  Routing routing;
  decode::Groups groups;
  int unit[3];                 // the units of iterations i, i + 1, i + 2 (at i % 3)
  GateUpPartials partial[2];   // iteration i's at i & 1
};

// The A rows of one unit (a warp's 8 chunks of rows lo and hi), loaded in one batch.
struct UnitRows {
  uint4 lo[kPipelinedChunks], hi[kPipelinedChunks];
};

__device__ __forceinline__ void unit_rows_of(const moefuse_decode_args& a, const GateUpPipelinedShared& sm, int unit,
                                             int tiles, int width, const uint16_t*& w_lo, const uint16_t*& w_hi) {
  const int gi = unit / tiles, tile = unit - gi * tiles, g = (threadIdx.x & 31) >> 2;
  int lo, hi;
  tile_rows(a, tile, g, lo, hi);
  const uint16_t* w = a.w_gate_up + size_t(sm.routing.expert[sm.groups.touched[gi]]) * width * a.hidden;
  w_lo = w + size_t(lo) * a.hidden;
  w_hi = w + size_t(hi) * a.hidden;
}

// The warp's nc (1..8) chunks from c0; the places past nc reload the last chunk (unused:
// the MMAs skip them; the barrier between these loads and their MMAs keeps ptxas from
// starting any MMA before the last load).
__device__ __forceinline__ void issue_unit(const moefuse_decode_args& a, const GateUpPipelinedShared& sm, int unit,
                                           int tiles, int width, int c0, int nc, UnitRows& r) {
  const uint16_t *w_lo, *w_hi;
  unit_rows_of(a, sm, unit, tiles, width, w_lo, w_hi);
  const int k8 = (threadIdx.x & 3) * 8;
#pragma unroll
  for (int u = 0; u < kPipelinedChunks; ++u) {
    const int c = c0 + min(u, nc - 1);
    r.lo[u] = decode::load_stream(w_lo + c * kChunk + k8);
    r.hi[u] = decode::load_stream(w_hi + c * kChunk + k8);
  }
}

// The same gate_up as decode_gate_up_kernel (the same sums in the same order, so the same
// bits), with the unit loop software-pipelined: a warp issues its next unit's loads right
// after its MMAs of the current one, before the block barrier, and the current unit's sum,
// activation and stores (warp 0) run while they are in flight. One barrier per unit (the
// partials alternate between two buffers). An expert with more than 8 slots takes several
// groups (the general kernel's 16-column pass holds the same per-column sums). Needs
// hidden <= kGateUpWarps * kPipelinedChunks * kChunk (2048); a warp with no chunk (hidden
// below 256) adds a zero partial, as in the general kernel.
__global__ void __launch_bounds__(kGateUpWarps * 32, 2) decode_gate_up_pipelined_kernel(moefuse_decode_args a) {
  __shared__ GateUpPipelinedShared sm;
  wait_for_prerequisite();
  allow_dependent_launch();
  uint32_t* counter = a.unit_counter;
  auto take = [&](int i) { return counter != nullptr ? int(atomicAdd(counter, 1u)) : int(blockIdx.x + i * gridDim.x); };
  // The first two units' atomics are issued before the table build, which hides their
  // round trip.
  int first[2] = {0, 0};
  if (threadIdx.x == 0) {
    first[0] = take(0);
    first[1] = take(1);
  }
  sm.routing.build(a.topk_ids, a.tokens * a.top_k, a.experts, blockIdx.x == 0 ? a.errors : nullptr);
  sm.groups.build(sm.routing, 8);
  const bool gated = a.activation != MOEFUSE_ACTIVATION_RELU2;
  const int width = gated ? 2 * a.intermediate : a.intermediate;
  const int tiles = width / 16;
  const int units = sm.groups.count * tiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, k8 = (lane & 3) * 8;
  const int chunks = a.hidden / kChunk;
  const int c0 = chunks * warp / kGateUpWarps, nc = chunks * (warp + 1) / kGateUpWarps - c0;
  if (threadIdx.x == 0) {
    sm.unit[0] = first[0];
    sm.unit[1] = first[1];
  }
  __syncthreads();
  int u = sm.unit[0];
  UnitRows rows;
  if (u < units && nc > 0) issue_unit(a, sm, u, tiles, width, c0, nc, rows);
  for (int i = 0; u < units; ++i) {
    const int next = sm.unit[(i + 1) % 3];
    // The unit of iteration i + 2: its slot was last read (as iteration i - 1's unit)
    // before the barrier of iteration i - 1.
    if (threadIdx.x == 0) sm.unit[(i + 2) % 3] = take(i + 2);
    const int gi = u / tiles, tile = u - gi * tiles, ti = sm.groups.touched[gi];
    const int first = sm.routing.start[ti] + sm.groups.base[gi];
    const int n = min(sm.routing.start[ti + 1] - first, 8);
    const int* slots = sm.routing.slot + first;
    const uint32_t b_off = uint32_t(slots[g < n ? g : 0] / a.top_k) * uint32_t(a.hidden);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c = 0; c < kPipelinedChunks; ++c) {
      if (c < nc) {
        const uint4 bv = __ldg(reinterpret_cast<const uint4*>(a.x + b_off + (c0 + c) * kChunk + k8));
        decode::mma_chunk(acc, rows.lo[c], rows.hi[c], bv);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) sm.partial[i & 1][warp][0][lane][r] = acc[r];
    if (next < units && nc > 0) issue_unit(a, sm, next, tiles, width, c0, nc, rows);
    // partial[i & 1] is complete. Iteration i + 1 writes the other buffer, and iteration
    // i + 2 this one only after the barrier of i + 1, which every thread reaches after its
    // stores below.
    __syncthreads();
    gate_up_store(a, sm.partial[i & 1], slots, n, tile, 1);
    u = next;
  }
}

// ---- down + combine ---------------------------------------------------------------------

struct DownShared {
  Routing routing;
  decode::Groups groups;
};

// Every 128-byte line of the 16 rows of D_e at column d0 for the touched experts, into L2,
// up to kPrefetchBytes per block (all blocks together stay well inside L2).
constexpr int kPrefetchBytes = 192 * 1024;

__device__ void prefetch_tile(const moefuse_decode_args& a, const Routing& rt, int d0) {
  const int lines_per_row = a.intermediate * 2 / 128;
  const int per_expert = 16 * lines_per_row;
  const int total = min(rt.touched * per_expert, kPrefetchBytes / 128);
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int ti = i / per_expert, rest = i - ti * per_expert, row = rest / lines_per_row;
    const int line = rest - row * lines_per_row;
    const uint16_t* p = a.w_down + (size_t(rt.expert[ti]) * a.hidden + d0 + row) * a.intermediate + line * 64;
    decode::prefetch_l2(p);
  }
}

template <int NB>
__device__ void down_partial(const moefuse_decode_args& a, const int* slots, int n, const uint16_t* w_lo,
                             const uint16_t* w_hi, int c0, int c1, float* part) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint32_t b_off[NB];  // tokens * top_k * intermediate < 2^30
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int col = nb * 8 + g;
    b_off[nb] = uint32_t(slots[col < n ? col : 0]) * uint32_t(a.intermediate);
  }
  float acc[NB][4];
  // One block of 16 warps per SM (128 registers): 8 chunks per lane in flight.
  decode::mma_rows<NB, NB == 1 ? kBatch : kBatch / 2>(acc, w_lo, w_hi, a.h, b_off, c0, c1);
  // part[p][r]: slot p of this expert's list, y column r of the tile.
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = nb * 8 + 2 * t + half;
      if (col < n) {
        part[col * 16 + g] = acc[nb][half];
        part[col * 16 + g + 8] = acc[nb][2 + half];
      }
    }
  }
}

__global__ void __launch_bounds__(kDownWarps * 32, 1) decode_down_kernel(moefuse_decode_args a, int split_cap) {
  __shared__ DownShared sm;
  extern __shared__ float part[];  // [splits][valid slots][16]
  Routing& rt = sm.routing;
  rt.build(a.topk_ids, a.tokens * a.top_k, a.experts, nullptr);
  // Work items: (group of at most 16 slots of one expert, K split). The groups of one
  // expert sit next to each other in the item order, so different warps stream the same
  // weights at the same time and the second read meets the first in L2.
  decode::Groups& gr = sm.groups;
  gr.build(rt, 8 * kMaxGroupBlocks);
  // Launched programmatically, the block may run beside the gate_up kernel's last blocks:
  // it warms L2 with its first tile's weights, then waits for h.
  if (blockIdx.x < a.hidden / 16) prefetch_tile(a, rt, blockIdx.x * 16);
  wait_for_prerequisite();
  // The gate_up kernel has completed: its unit counter is free for the next call.
  if (a.unit_counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *a.unit_counter = 0u;
  const int valid = rt.start[rt.touched], chunks = a.intermediate / kChunk;
  // K splits so that every warp has work when there are few groups.
  int splits = (kDownWarps + gr.count - 1) / max(gr.count, 1);
  splits = max(1, min(splits, min(split_cap, chunks)));
  const int items = gr.count * splits, tiles = a.hidden / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int d0 = tile * 16;
    for (int item = warp; item < items; item += kDownWarps) {
      const int gi = item / splits, sp = item - gi * splits;
      const int ti = gr.touched[gi], e = rt.expert[ti];
      const uint16_t* w = a.w_down + (size_t(e) * a.hidden + d0) * a.intermediate;
      const uint16_t *w_lo = w + size_t(g) * a.intermediate, *w_hi = w + size_t(g + 8) * a.intermediate;
      const int c0 = chunks * sp / splits, c1 = chunks * (sp + 1) / splits;
      const int first = rt.start[ti] + gr.base[gi];
      const int n = min(rt.start[ti + 1] - first, 8 * kMaxGroupBlocks);
      const int* slots = rt.slot + first;
      float* p = part + (size_t(sp) * valid + first) * 16;
      if (n <= 8) down_partial<1>(a, slots, n, w_lo, w_hi, c0, c1, p);
      else down_partial<2>(a, slots, n, w_lo, w_hi, c0, c1, p);
    }
    __syncthreads();
    // y_e = bf16(sum of the splits in order), kept as float in the first split's place.
    for (int i = threadIdx.x; i < valid * 16; i += blockDim.x) {
      float v = 0.f;
      for (int sp = 0; sp < splits; ++sp) v += part[size_t(sp) * valid * 16 + i];
      const __nv_bfloat16 b = __float2bfloat16_rn(v);
      part[i] = __bfloat162float(b);
      decode::store_y_e(a, rt.slot[i >> 4], d0 + (i & 15), __bfloat16_as_ushort(b));
    }
    __syncthreads();
    // y[t, d0 + r] = sum over the token's slots in order of w * y_e (fp32).
    for (int i = threadIdx.x; i < a.tokens * 16; i += blockDim.x) {
      const int t = i >> 4, r = i & 15;
      a.y[size_t(t) * a.hidden + d0 + r] = bf16_bits(decode::combine_token(a, rt, t, part + r, 16));
    }
    __syncthreads();  // part is rewritten by the next tile
  }
}

// ---- host -------------------------------------------------------------------------------

// Resident blocks per device of the two kernels; the down kernel's dynamic shared memory
// limit is raised on the same first call.
ResidentBlocks resident_grids() {
  static std::atomic<int> cache[64][2];
  return resident_blocks(cache, {132, 132}, [] {
    ResidentBlocks per{0, 0};
    // Both gate_up kernels (at most 128 registers and 43 KB of shared memory) hold two
    // blocks per SM, so the general kernel's figure serves the pipelined one too.
    cudaFuncSetAttribute(decode_down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         int(kPartFloats * sizeof(float)));
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.gate_up, decode_gate_up_kernel, kGateUpWarps * 32, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per.down, decode_down_kernel, kDownWarps * 32,
                                                  kPartFloats * sizeof(float));
    return per;
  });
}

moefuse_status check(const moefuse_decode_args* a, const char* name) {
  if (a == nullptr) return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: args is null", name);
  if (!known_activation(a->activation, a->layout)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: activation %d, layout %d", name, a->activation, a->layout);
  }
  if (a->tokens < 1 || a->tokens > MOEFUSE_DECODE_MAX_TOKENS || a->top_k < 1 || a->top_k > 16 ||
      a->tokens * a->top_k > MOEFUSE_DECODE_MAX_SLOTS || a->experts < 1 || a->experts > decode::kMaxExperts) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: tokens %d (1..%d), top_k %d, experts %d", name, a->tokens,
                MOEFUSE_DECODE_MAX_TOKENS, a->top_k, a->experts);
  }
  if (a->hidden < kChunk || a->hidden % kChunk != 0 || a->intermediate < kChunk || a->intermediate % kChunk != 0 ||
      a->hidden > (1 << 20) || a->intermediate > (1 << 20)) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: hidden %d and intermediate %d must be multiples of %d", name,
                a->hidden, a->intermediate, kChunk);
  }
  if (a->topk_ids == nullptr || a->topk_weights == nullptr || a->x == nullptr || a->w_gate_up == nullptr ||
      a->w_down == nullptr || a->h == nullptr || a->y == nullptr) {
    return fail(MOEFUSE_STATUS_INVALID_PROBLEM, "%s: a required pointer is null", name);
  }
  const void* rows[] = {a->x, a->w_gate_up, a->w_down, a->h, a->y, a->h_pre_rows, a->h_rows, a->y_e_rows};
  for (const void* p : rows) {
    if (!aligned16(p)) return fail(MOEFUSE_STATUS_MISALIGNED, "%s: a bf16 matrix is not 16-byte aligned", name);
  }
  if (!aligned_for(a->unit_counter)) {
    return fail(MOEFUSE_STATUS_MISALIGNED, "%s: unit_counter is not 4-byte aligned", name);
  }
  return MOEFUSE_STATUS_OK;
}

}  // namespace
}  // namespace moefuse::moe

using namespace moefuse::moe;

extern "C" moefuse_status moefuse_moe_decode_forward(const moefuse_decode_args* a, void* stream) {
  const char* name = "moefuse_moe_decode_forward";
  if (moefuse_status st = check(a, name); st != MOEFUSE_STATUS_OK) return st;
  auto s = static_cast<cudaStream_t>(stream);
  const ResidentBlocks grids = resident_grids();
  // At most min(experts, slots) experts are touched: no block beyond their units.
  const int slots = a->tokens * a->top_k;
  const int width = a->activation == MOEFUSE_ACTIVATION_RELU2 ? a->intermediate : 2 * a->intermediate;
  const int max_units = min(a->experts, slots) * (width / 16);
  // Both kernels are launched with programmatic stream serialization (kept by stream
  // capture): the gate_up kernel's blocks become resident while the router (or whatever
  // precedes) finishes and wait for it in griddepcontrol.wait; the down kernel's blocks
  // build their table and prefetch their first tile's weights into L2 while the gate_up
  // kernel's last blocks run, then wait for h.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t up = {};
  up.gridDim = dim3(min(grids.gate_up, max_units));
  up.blockDim = dim3(kGateUpWarps * 32);
  up.stream = s;
  up.attrs = attr;
  up.numAttrs = 1;
  const bool pipelined =
      a->hidden <= kGateUpWarps * kPipelinedChunks * kChunk && a->tokens <= kPipelinedMaxTokens;
  auto* gate_up = pipelined ? decode_gate_up_pipelined_kernel : decode_gate_up_kernel;
  if (cudaLaunchKernelEx(&up, gate_up, *a) != cudaSuccess) return after_launch(name);
  if (moefuse_status st = after_launch(name); st != MOEFUSE_STATUS_OK) return st;
  // The y_e partials: splits x slots x 16 floats. Splits serve warps that would idle when
  // few experts are touched; a token names top_k distinct experts, so at least top_k are
  // touched (a duplicate id can only lower the splits the kernel takes: it clamps).
  const int split_cap =
      max(1, min((kDownWarps + a->top_k - 1) / a->top_k, kPartFloats / (16 * slots)));
  const size_t smem = size_t(split_cap) * slots * 16 * sizeof(float);
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(min(grids.down, a->hidden / 16));
  launch.blockDim = dim3(kDownWarps * 32);
  launch.dynamicSmemBytes = smem;
  launch.stream = s;
  launch.attrs = attr;
  launch.numAttrs = 1;
  if (cudaLaunchKernelEx(&launch, decode_down_kernel, *a, split_cap) != cudaSuccess) return after_launch(name);
  return after_launch(name);
}
