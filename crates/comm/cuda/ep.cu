// Expert-parallel dispatch and combine over NVSHMEM (the non-fused path, like DeepEP's
// normal mode). Five kernels, stream-ordered, no host synchronisation, graph-capturable
// (at one PE only count, dispatch and combine_send run), and two for the instance's life
// (hello at construction, abort on a host-side error):
//
//   kernel          grid        what it does
//   count           T/64        per-chunk counts per expert and per destination rank, and the
//                               stable rank of every (token, slot) inside its chunk; its last
//                               block runs notify: bumps the epoch; chunk counts -> bases;
//                               sends this rank's count row to every PE, waits for theirs;
//                               derives every base
//   dispatch        G           each routed token once per destination into its staging row,
//                               with its slots' expert-major rows, weights and token id; for
//                               this rank itself straight into the expert-major rows (no
//                               staging copy: only the row's info and weights are staged);
//                               launched programmatically behind count (its first rows load
//                               while count runs; griddepcontrol.wait before reading count's
//                               results)
//   expand          G           (more than one PE) waits for every source; the other sources'
//                               staged rows -> expert-major recv_x
//
// Pull mode (params.pull; every peer load/store reachable): dispatch copies each token's row
// once into this rank's symmetric x_home and stages only its routing (stage_info, stage_w);
// dispatch and expand write, per expert-major row, recv_src = source rank * max_tokens +
// token (and the weights and origins as before) and copy no row: the fused gate_up reads
// each row at its home through peer addresses (kernel/sm90_gate_up_fused.cuh, kPeerRows).
// The reuse rule below covers x_home too: dispatch n+1 rewrites it only after every peer's
// combine_send n, which follows that peer's gate_up n on its stream.
//
//   slots_signal    1 x 32      (pull) after the down GEMM wrote each expert output row into
//                               its token's slot at home (recv_dst, filled by dispatch and
//                               expand): raises comb_sig[rank] = epoch everywhere
//   combine_slots   G           (pull) waits for every rank's slots_signal; out[t] = the
//                               token's slots summed in slot order (fp32), as the
//                               single-GPU combine. y_slots of call n+1 are written only
//                               after the owners' expand n+1, which waits for this rank's
//                               dispatch n+1, which follows its combine_slots n.
//
// The pulled backward (same epoch as its forward; its own signal words):
//   bwd_publish     G           (home) d_weights from the slots and dy, dy -> dy_home,
//                               then bwd_sig[rank] = epoch everywhere
//   bwd_gather      G           (owner) waits for every home; w * dy and x of each received
//                               row, read at the homes
//   (the gate_up dgrad stores each dx row into its token's slot at home, y_slots again:
//    every home read its slots in bwd_publish, before the signal the owners waited for)
//   slots_signal,   1 x 32, G   with comb_sig = bwd_comb_sig and no weights: dx summed
//   combine_slots               over the token's slots
//   combine_send    G           per staged row: sum_j w_j * y[row_j] (fp32) -> bf16 partial
//                               into the source's comb_x (one PE: into out[t], and zero rows
//                               for the tokens routed nowhere)
//   combine_reduce  G           (more than one PE) waits for every destination; out[t] = sum
//                               over destinations in rank order (fp32) -> bf16
//   hello           1 x 32      puts this rank's (config hash, epoch base) into every PE's table
//   abort           1 x 32      tells every peer this rank abandoned the call (abort signals)
//
// Layouts (the host model in crates/comm/src/plan.rs is the specification): staging rows
// are ordered by source rank then token; expert-major rows by local expert, then source
// rank, then token. Peers reachable by load/store (NVLink, or this PE) are written directly
// through nvshmem_ptr; others through NVSHMEM puts.
//
// NOTES: completion is signalled once per kernel, by its last block (a device-resident
// counter, reset by that block), with the epoch as the signal value: every rank bumps the
// epoch once per dispatch, so waits compare GE epoch and no signal is ever reset (the rule
// that keeps graph replays and back-to-back calls safe). The buffers of call n+1 are only
// written after every peer finished reading those of call n, because dispatch n+1 follows
// combine n, which waited for every peer's combine_send n.
//
// NOTES: no wait is unbounded. Every wait on a peer polls its signal against a globaltimer
// deadline (timeout_ns); on expiry, or on an abort signal for this epoch, it records a
// fault (first one wins, in device memory and in the host-mapped copy) and the kernel
// exits instead of trapping, so the context stays usable. A fault is sticky: every later
// kernel of the instance returns at once, the sending ones after telling their peers
// (abort signals), so one rank's failure reaches the others in microseconds, not at their
// deadline. Epochs start at a base every rank agrees on at construction (the largest any
// of them used before), so signals of an earlier instance never satisfy a wait.
#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "moefuse/comm/ep_params.h"
#include "moefuse/common/pdl.cuh"
#include "moefuse/common/rank_slots.cuh"
#include "moefuse/common/rows.cuh"
#include "moefuse/spec.h"

#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 900)

namespace {

using namespace moefuse::rows;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = MOEFUSE_EP_CHUNK;
static_assert(kChunk % kWarps == 0 && kChunk / kWarps <= 32, "count: each warp ranks at most 32 tokens");
static_assert(sizeof(moefuse_ep_params) == 400 && offsetof(moefuse_ep_params, recv_dst) == 344 &&
                  offsetof(moefuse_ep_params, dy_home) == 352 && offsetof(moefuse_ep_params, recv_x) == 216 &&
                  offsetof(moefuse_ep_params, timeout_ns) == 264 && offsetof(moefuse_ep_params, hello) == 304 &&
                  offsetof(moefuse_ep_params, x_home) == 320,
              "moefuse_ep_params changed: update EpParams in crates/comm/src/ep/params.rs and its layout test");

__device__ __forceinline__ int row_width(const moefuse_ep_params& p) { return p.experts + p.ranks; }

__device__ __forceinline__ void flag(const moefuse_ep_params& p, uint32_t bit) { atomicOr(p.status + 1, bit); }

constexpr int kMaxTopK = MOEFUSE_SPEC_MAX_TOP_K;

// Load/store addresses of this kernel's symmetric buffers on every PE (null where only
// NVSHMEM puts reach it), looked up once per block.
struct PeerTable {
  uint16_t* stage_x[MOEFUSE_EP_MAX_RANKS];
  int32_t* stage_info[MOEFUSE_EP_MAX_RANKS];
  float* stage_w[MOEFUSE_EP_MAX_RANKS];
  uint16_t* comb_x[MOEFUSE_EP_MAX_RANKS];
};

__device__ void fill_peers(PeerTable& t, const moefuse_ep_params& p) {
  for (int pe = threadIdx.x; pe < p.ranks; pe += blockDim.x) {
    t.stage_x[pe] = static_cast<uint16_t*>(nvshmem_ptr(p.stage_x, pe));
    t.stage_info[pe] = static_cast<int32_t*>(nvshmem_ptr(p.stage_info, pe));
    t.stage_w[pe] = static_cast<float*>(nvshmem_ptr(p.stage_w, pe));
    t.comb_x[pe] = static_cast<uint16_t*>(nvshmem_ptr(p.comb_x, pe));
  }
  __syncthreads();
}

// Called by every thread at the end of a sending kernel: the last block to finish raises
// `sig[rank] = epoch` on every PE. NOTES: each block's thread 0 completes its block's puts
// (quiet = system fence for load/store peers) before counting itself; the last block
// fences again before signalling, so every row is visible before any signal.
__device__ void last_block_signals(const moefuse_ep_params& p, uint32_t* done, uint64_t* sig, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  nvshmem_quiet();
  __threadfence_system();
  if (atomicAdd(done, 1u) != gridDim.x - 1) return;
  __threadfence_system();
  *done = 0;
  for (int pe = 0; pe < p.ranks; ++pe) nvshmemx_signal_op(sig + p.rank, epoch, NVSHMEM_SIGNAL_SET, pe);
}

// ---- deadlines and faults -------------------------------------------------------------
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool faulted(const moefuse_ep_params& p) {
  return *reinterpret_cast<volatile uint64_t*>(p.fault) != 0;
}

// The first fault of the instance wins; its words reach the host-mapped copy last word
// first, so a host that sees fault_host[0] != 0 sees the rest.
__device__ void record_fault(const moefuse_ep_params& p, uint32_t kind, uint32_t op, int peer, uint64_t waited,
                             uint64_t epoch) {
  const unsigned long long code = kind | (op << 8);
  if (atomicCAS(reinterpret_cast<unsigned long long*>(p.fault), 0ull, code) != 0ull) return;
  p.fault[1] = uint64_t(peer);
  p.fault[2] = waited;
  p.fault[3] = epoch;
  volatile uint64_t* host = p.fault_host;
  host[1] = uint64_t(peer);
  host[2] = waited;
  host[3] = epoch;
  __threadfence_system();
  host[0] = code;
  __threadfence_system();
}

// Waits until `*sig >= epoch` (true), or records why not (false): an abort signal for this
// epoch or a later one, the deadline, or a fault another thread recorded. NOTES: an abort
// signal of an earlier epoch is stale (an instance or call that already ended) and is
// ignored; the clock is read every 64 polls to keep the loop tight.
__device__ bool wait_signal(const moefuse_ep_params& p, uint64_t* sig, uint64_t epoch, uint32_t op, int peer) {
  const uint64_t start = now_ns();
  for (uint32_t spin = 0;; ++spin) {
    const uint64_t v = nvshmem_signal_fetch(sig);
    if (v & MOEFUSE_EP_ABORT_BIT) {
      if ((v & ~MOEFUSE_EP_ABORT_BIT) >= epoch) {
        record_fault(p, MOEFUSE_EP_FAULT_ABORTED, op, peer, now_ns() - start, epoch);
        return false;
      }
    } else if (v >= epoch) {
      return true;
    }
    if ((spin & 63) == 63) {
      const uint64_t waited = now_ns() - start;
      if (waited > p.timeout_ns) {
        record_fault(p, MOEFUSE_EP_FAULT_TIMEOUT, op, peer, waited, epoch);
        return false;
      }
      if (faulted(p)) return false;
    }
  }
}

// Sets every peer's three signal words of this rank to an abort for `epoch`: whatever they
// wait on for this call ends at once with MOEFUSE_EP_FAULT_ABORTED. One thread calls it.
__device__ void abort_peers(const moefuse_ep_params& p, uint64_t epoch) {
  const uint64_t v = MOEFUSE_EP_ABORT_BIT | epoch;
  for (int pe = 0; pe < p.ranks; ++pe) {
    if (pe == p.rank) continue;
    nvshmemx_signal_op(p.meta_sig + p.rank, v, NVSHMEM_SIGNAL_SET, pe);
    nvshmemx_signal_op(p.disp_sig + p.rank, v, NVSHMEM_SIGNAL_SET, pe);
    nvshmemx_signal_op(p.comb_sig + p.rank, v, NVSHMEM_SIGNAL_SET, pe);
    if (p.pull) {
      nvshmemx_signal_op(p.bwd_sig + p.rank, v, NVSHMEM_SIGNAL_SET, pe);
      nvshmemx_signal_op(p.bwd_comb_sig + p.rank, v, NVSHMEM_SIGNAL_SET, pe);
    }
  }
  nvshmem_quiet();
}

// At the top of a sending kernel: true (and the peers told, once) when the instance has
// faulted, so the kernel must return. Uniform over the grid: only earlier kernels write it.
__device__ bool skip_send(const moefuse_ep_params& p, uint64_t epoch) {
  if (!faulted(p)) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0) abort_peers(p, epoch);
  return true;
}

// Called by every thread at the start of a receiving kernel: waits until every PE raised
// `sig[pe] >= epoch`. False (for the whole block) when a wait failed: the kernel returns.
__device__ bool wait_all(const moefuse_ep_params& p, uint64_t* sig, uint64_t epoch, uint32_t op) {
  bool ok = !faulted(p);
  for (int pe = threadIdx.x; ok && pe < p.ranks; pe += blockDim.x) {
    ok = wait_signal(p, sig + pe, epoch, op, pe);
  }
  __threadfence_system();
  return !__syncthreads_or(!ok);
}

// The staging row's source rank: the last s with src_base[s] <= i.
__device__ __forceinline__ int source_of(const moefuse_ep_params& p, int i) {
  int s = 0;
  while (s + 1 < p.ranks && p.src_base[s + 1] <= i) ++s;
  return s;
}

// ---- notify: run by the last block of count ---------------------------------------------
// Bumps the epoch; chunk counts -> bases; sends this rank's count row to every PE, waits for
// theirs; derives every base. Every thread of the block calls it.
__device__ void notify(const moefuse_ep_params& p) {
  __shared__ uint64_t epoch_s;
  __shared__ int col_total[MOEFUSE_SPEC_MAX_EXPERTS];   // one per expert
  __shared__ int col_prefix[MOEFUSE_SPEC_MAX_EXPERTS];  // exclusive prefix of col_total
  const int C = row_width(p), R = p.ranks, E = p.experts, El = p.local_experts, me = p.rank;
  const int chunks = (p.tokens + kChunk - 1) / kChunk;
  if (threadIdx.x == 0) {
    epoch_s = *p.epoch + 1;
    *p.epoch = epoch_s;
    p.status[0] = 0;
  }
  __syncthreads();
  if (faulted(p)) {
    if (threadIdx.x == 0) abort_peers(p, epoch_s);
    return;
  }
  // Chunk counts -> exclusive bases per column; this rank's totals into its meta row.
  int* mine = p.meta + me * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    int run = 0;
    // 32 chunks' loads in flight at a time (written by the other count blocks: from L2); a
    // chunk is 64 tokens, so T = 8192 is four rounds.
    for (int ch0 = 0; ch0 < chunks; ch0 += 32) {
      int v[32];
#pragma unroll
      for (int u = 0; u < 32; ++u) v[u] = ch0 + u < chunks ? __ldcg(p.chunk_cnt + (ch0 + u) * C + c) : 0;
#pragma unroll
      for (int u = 0; u < 32; ++u) {
        if (ch0 + u < chunks) p.chunk_cnt[(ch0 + u) * C + c] = run;
        run += v[u];
      }
    }
    mine[c] = run;
  }
  __syncthreads();
  const uint64_t epoch = epoch_s;
  for (int pe = 0; pe < R; ++pe) {
    if (pe != me) {
      nvshmemx_putmem_signal_block(mine, mine, sizeof(int) * size_t(C), p.meta_sig + me, epoch, NVSHMEM_SIGNAL_SET,
                                   pe);
    }
  }
  bool ok = true;
  for (int s = threadIdx.x; ok && s < R; s += blockDim.x) {
    if (s != me) ok = wait_signal(p, p.meta_sig + s, epoch, MOEFUSE_EP_OP_NOTIFY, s);
  }
  __threadfence_system();
  if (__syncthreads_or(!ok)) return;
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) p.counts_all[i] = __ldcv(p.meta + i);
  __syncthreads();

  const int* cnt = p.counts_all;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int total = 0;
    for (int s = 0; s < R; ++s) total += cnt[s * C + e];
    col_total[e] = total;
  }
  __syncthreads();
  // Exclusive prefix of the column totals over all experts, by warp 0 (lane l sums a run
  // of experts; a shuffle scan) in place of a serial sum per expert.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, per = (E + 31) / 32;
    const int e0 = min(lane * per, E), e1 = min(e0 + per, E);
    int mine_sum = 0;
    for (int e = e0; e < e1; ++e) mine_sum += col_total[e];
    int before = mine_sum;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(~0u, before, o);
      if (lane >= o) before += v;
    }
    before -= mine_sum;
    for (int e = e0; e < e1; ++e) {
      col_prefix[e] = before;
      before += col_total[e];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int owner = e / El;
    const int before = col_prefix[e] - col_prefix[owner * El];  // rows of the owner's earlier experts
    int earlier_src = 0;  // rows of this expert from lower source ranks
    for (int s = 0; s < me; ++s) earlier_src += cnt[s * C + e];
    p.dest_row_base[e] = before + earlier_src;
    if (owner == me) {
      p.recv_offsets[e - me * El] = before + col_total[e];
      if (e == me * El + El - 1) p.status[0] = before + col_total[e];
    }
  }
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    int sb = 0, cb = 0;
    for (int s = 0; s < me; ++s) sb += cnt[s * C + E + d];
    for (int q = 0; q < d; ++q) cb += cnt[me * C + E + q];
    p.stage_base[d] = sb;
    p.comb_base[d] = cb;
  }
  if (threadIdx.x == 0) {
    int run = 0;
    for (int s = 0; s < R; ++s) {
      p.src_base[s] = run;
      run += cnt[s * C + E + me];
    }
    p.src_base[R] = run;
  }
}

}  // namespace

// ---- count (+ notify): grid T/kChunk, block 256, dynamic smem (kWarps * C + kChunk * top_k)
// ints: 8 warps of 8 tokens per 64-token chunk (warp order is token order). Its time is the
// dependent rank_slots steps, bound per SM (MATCH.ANY and shared atomics): 32 warps of 8
// tokens on one SM per 256-token chunk took as long as 8 warps of 32 (sessions 13-14), so
// chunks are 64 tokens, on four times the SMs.
__device__ __forceinline__ void count_chunk(const moefuse_ep_params& p, int* smem) {
  constexpr int kTok = kChunk / kWarps;  // at most 32 (asserted with kChunk above)
  const int C = row_width(p), k = p.top_k;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int* hist = smem;                               // (kWarps, C): counts, then bases
  int* ids = smem + kWarps * C + warp * kTok * k;  // (kTok, k): this warp's routing
  for (int i = threadIdx.x; i < kWarps * C; i += blockDim.x) hist[i] = 0;
  const int t0 = blockIdx.x * kChunk + warp * kTok;
  const int n_tok = max(0, min(kTok, p.tokens - t0));
  // One coalesced load of the warp's ids: the serial walk below then reads shared memory
  // (walking global memory token by token was latency-bound).
  for (int i = lane; i < n_tok * k; i += 32) ids[i] = p.topk_ids[size_t(t0) * k + i];
  __syncthreads();

  // Positions within each expert in token order (rank_slots), and one staging row per
  // (token, destination): its lowest slot going there represents it, and the
  // representatives of one destination rank among themselves in token (= lane) order.
  int* h = hist + warp * C;
  // Every (token, destination) starts as "not sent", in one coalesced pass.
  for (int i = lane; i < n_tok * p.ranks; i += 32) p.tokpos[size_t(t0) * p.ranks + i] = -1;
  __syncwarp();
  const unsigned lower = (1u << lane) - 1u;
  rank_slots(ids, n_tok, k, p.experts, h, lane, [&](int i, int j, int e, bool live, bool ok, int pos, bool dup, int q) {
    const size_t t = size_t(t0) + i;
    if (live && !ok) flag(p, MOEFUSE_EP_BAD_EXPERT_ID);
    if (dup) flag(p, MOEFUSE_EP_DUPLICATE_EXPERT);
    if (live) p.pos_local[t * k + j] = ok ? pos : -1;
    const int d = ok ? e / p.local_experts : -1;
    const unsigned same_dest = __match_any_sync(~0u, ok ? (q << 16) | d : -1 - lane);
    const bool rep = ok && lane == __ffs(same_dest) - 1;
    const unsigned dest_reps = __match_any_sync(~0u, rep ? d : -1 - lane);
    if (rep) {
      const int leader = __ffs(dest_reps) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(&h[p.experts + d], __popc(dest_reps));
      base = __shfl_sync(dest_reps, base, leader);
      p.tokpos[t * p.ranks + d] = base + __popc(dest_reps & lower);
    }
  });
  __syncthreads();

  // Per-warp exclusive bases inside the chunk, and the chunk's totals.
  moefuse::rows::warp_bases<kWarps>(hist, C, p.chunk_cnt + blockIdx.x * C);
  __syncthreads();
  // Chunk-relative positions -> warp bases added, every (token, slot) and (token,
  // destination) independently (a serial walk here waited on one load per token).
  for (int i = lane; i < n_tok * k; i += 32) {
    const int e = ids[i];
    if (e >= 0 && e < p.experts) p.pos_local[size_t(t0) * k + i] += h[e];
  }
  for (int i = lane; i < n_tok * p.ranks; i += 32) {
    const int v = p.tokpos[size_t(t0) * p.ranks + i];
    if (v >= 0) p.tokpos[size_t(t0) * p.ranks + i] = v + h[p.experts + i % p.ranks];
  }
  // The last block to finish runs notify (one launch fewer than a kernel of its own):
  // every block's chunk counts are visible to it (block barrier, then thread 0's fence
  // before its ticket; the last block fences again after its own).
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(p.done + 2, 1u) == gridDim.x - 1;
    if (last) {
      p.done[2] = 0;
      __threadfence();
    }
  }
  __syncthreads();
  if (last) notify(p);
}

extern "C" __global__ void __launch_bounds__(kThreads) moefuse_ep_count(moefuse_ep_params p) {
  extern __shared__ int smem[];
  // dispatch (launched programmatically behind this kernel) may become resident now: it
  // reads nothing this kernel writes before its griddepcontrol.wait.
  moefuse::allow_dependent_launch();
  count_chunk(p, smem);
}

// ---- dispatch: grid G, block 256 ------------------------------------------------------
// Launched programmatically behind count: its blocks become resident while count (and its
// notify) runs, and each warp loads its first token's routing and the head of its row (the
// call's inputs, complete before count began) before waiting for count; everything count
// writes (epoch, fault, bases, positions) is read after the wait, and nothing is written
// before it. After a token's stores each warp loads its next token's head and routing, whose
// round trip then overlaps that of the next token's bases and positions.
// NOTES: registers: 103 on sm_90a (two blocks per SM, as before), 146 on sm_100a (one block
// per SM; capped at 128 it spills 16 bytes: the head's stores and the rest-of-row loop side
// by side). Not measured on a B200 yet.
extern "C" __global__ void __launch_bounds__(kThreads) moefuse_ep_dispatch(moefuse_ep_params p) {
  __shared__ PeerTable peers;
  __shared__ uint4* dst_rows[kWarps][kMaxTopK];
  __shared__ uint4 heads[kWarps][kHeadVectors];  // 32 KB: each warp's current row head
  fill_peers(peers, p);
  const int k = p.top_k, D = p.hidden, n = D / 8;
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  int t = blockIdx.x * kWarps + threadIdx.x / 32;
  uint4* head = heads[threadIdx.x / 32];
  int e = -1;
  float w = 0.f;
  auto load_token = [&](int tok) {
    load_row_head(head, reinterpret_cast<const uint4*>(p.x + size_t(tok) * D), n, lane);
    e = lane < k ? p.topk_ids[size_t(tok) * k + lane] : -1;
    w = lane < k ? p.topk_weights[size_t(tok) * k + lane] : 0.f;
  };
  if (t < p.tokens) load_token(t);
  moefuse::wait_for_prerequisite();
  const uint64_t epoch = *p.epoch;
  if (skip_send(p, epoch)) return;
  const int C = row_width(p);
  for (; t < p.tokens; t += warps) {
    const int* base = p.chunk_cnt + (t / kChunk) * C;
    int row_in_expert = -1;
    if (lane < k && e >= 0 && e < p.experts) row_in_expert = p.dest_row_base[e] + base[e] + p.pos_local[t * k + lane];
    const uint16_t* src = p.x + size_t(t) * D;
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
    if (p.pull) {
      // Pull: the row goes once into this rank's x_home, where every receiver reads it.
      uint4* home = reinterpret_cast<uint4*>(p.x_home + size_t(t) * D);
      warp_copy_row_with_head(&home, 1, head, src4, n, lane);
    }
    for (int d = 0; d < p.ranks; ++d) {
      const int tp = p.tokpos[t * p.ranks + d];
      if (tp < 0) continue;
      const size_t i = size_t(p.stage_base[d] + base[p.experts + d] + tp);
      const bool here = row_in_expert >= 0 && e / p.local_experts == d;
      const int info = lane < k ? (here ? row_in_expert : -1) : t;
      if (d == p.rank) {
        // This rank: the expert-major rows directly (what expand does for the others);
        // only the staged row's info and weights are written (combine_send reads them).
        int row = here ? row_in_expert : -1;
        if (row >= p.recv_rows_cap) {
          flag(p, MOEFUSE_EP_RECV_OVERFLOW);
          row = -1;
        }
        const unsigned valid = __ballot_sync(~0u, row >= 0);
        if (row >= 0) {
          dst_rows[threadIdx.x / 32][__popc(valid & ((1u << lane) - 1))] =
              reinterpret_cast<uint4*>(p.recv_x + size_t(row) * D);
          p.recv_w[row] = w;
          p.recv_origin[3 * size_t(row) + 0] = p.rank;
          p.recv_origin[3 * size_t(row) + 1] = t;
          p.recv_origin[3 * size_t(row) + 2] = lane;
          if (p.pull) {
            p.recv_src[row] = p.rank * p.max_tokens + t;
            p.recv_dst[row] = reinterpret_cast<uint64_t>(p.y_slots + (size_t(t) * k + lane) * D);
          }
        }
        if (lane <= k) p.stage_info[i * (k + 1) + lane] = info;
        if (lane < k) p.stage_w[i * k + lane] = w;
        if (!p.pull) {
          __syncwarp();
          warp_copy_row_with_head(dst_rows[threadIdx.x / 32], __popc(valid), head, src4, n, lane);
        }
        __syncwarp();
      } else if (uint16_t* peer_x = peers.stage_x[d]) {
        // (pull: every peer is load/store reachable, checked at construction)
        if (!p.pull) {
          uint4* dst = reinterpret_cast<uint4*>(peer_x + i * D);
          warp_copy_row_with_head(&dst, 1, head, src4, n, lane);
        }
        if (lane <= k) peers.stage_info[d][i * (k + 1) + lane] = info;
        if (lane < k) peers.stage_w[d][i * k + lane] = w;
      } else {
        nvshmemx_putmem_nbi_warp(p.stage_x + i * D, src, sizeof(uint16_t) * size_t(D), d);
        if (lane <= k) nvshmem_int_p(p.stage_info + i * (k + 1) + lane, info, d);
        if (lane < k) nvshmem_float_p(p.stage_w + i * k + lane, w, d);
      }
    }
    if (t + warps < p.tokens) load_token(t + warps);
  }
  last_block_signals(p, p.done + 0, p.disp_sig, epoch);
}

// A staged row's routing (its slots' expert-major rows and weights, and its token), loaded
// one row ahead by expand and combine_send: a warp issues the next row's loads before it
// works on the current one, so its next row starts without their round trip.
struct StagedRouting {
  int row;     // lane < k: the slot's expert-major row here, or -1
  float w;     // lane < k: the slot's weight
  int token;   // the staged row's token (its home index)

  __device__ __forceinline__ void load(const moefuse_ep_params& p, int i, int lane) {
    const int k = p.top_k;
    const int32_t* info = p.stage_info + size_t(i) * (k + 1);
    row = lane < k ? __ldcg(info + lane) : -1;
    w = lane < k ? __ldcg(p.stage_w + size_t(i) * k + lane) : 0.f;
    token = __ldcg(info + k);
  }
};

// ---- expand: grid G, block 256 --------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kThreads) moefuse_ep_expand(moefuse_ep_params p) {
  __shared__ uint4* dst_rows[kWarps][kMaxTopK];
  __shared__ uint16_t* slots_of[MOEFUSE_EP_MAX_RANKS];  // pull: each source's y_slots, as loaded here
  const uint64_t epoch = *p.epoch;
  if (p.pull) {
    for (int pe = threadIdx.x; pe < p.ranks; pe += blockDim.x) {
      slots_of[pe] = static_cast<uint16_t*>(nvshmem_ptr(p.y_slots, pe));
    }
  }
  if (!wait_all(p, p.disp_sig, epoch, MOEFUSE_EP_OP_EXPAND)) return;  // (its barrier publishes slots_of)
  const int k = p.top_k, D = p.hidden, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int staged = p.src_base[p.ranks];
  const int own0 = p.src_base[p.rank], own1 = p.src_base[p.rank + 1];  // dispatch expanded these
  const int warps = gridDim.x * kWarps;
  int i = blockIdx.x * kWarps + warp;
  StagedRouting next;
  if (i < staged) next.load(p, i, lane);
  for (; i < staged; i += warps) {
    const StagedRouting cur = next;
    if (i + warps < staged) next.load(p, i + warps, lane);
    if (i >= own0 && i < own1) continue;
    // Lane j < k: slot j's expert-major row here (or -1); compact the valid ones.
    int row = cur.row;
    if (row >= p.recv_rows_cap) {
      flag(p, MOEFUSE_EP_RECV_OVERFLOW);
      row = -1;
    }
    const unsigned valid = __ballot_sync(~0u, row >= 0);
    if (row >= 0) {
      const int slot = lane;
      dst_rows[warp][__popc(valid & ((1u << lane) - 1))] = reinterpret_cast<uint4*>(p.recv_x + size_t(row) * D);
      p.recv_w[row] = cur.w;
      const int s = source_of(p, i), t = cur.token;
      p.recv_origin[3 * size_t(row) + 0] = s;
      p.recv_origin[3 * size_t(row) + 1] = t;
      p.recv_origin[3 * size_t(row) + 2] = slot;
      if (p.pull) {
        p.recv_src[row] = s * p.max_tokens + t;
        p.recv_dst[row] = reinterpret_cast<uint64_t>(slots_of[s] + (size_t(t) * k + slot) * D);
      }
    }
    if (p.pull) continue;  // the receivers read the row at its home (x_home)
    __syncwarp();
    warp_copy_row_to(dst_rows[warp], __popc(valid), reinterpret_cast<const uint4*>(p.stage_x + size_t(i) * D), D / 8,
                     lane);
    __syncwarp();
  }
}

// ---- combine_send: grid G, block 256 --------------------------------------------------
extern "C" __global__ void __launch_bounds__(kThreads, 2) moefuse_ep_combine_send(moefuse_ep_params p) {
  __shared__ PeerTable peers;
  __shared__ const uint4* y_rows[kWarps][kMaxTopK];
  __shared__ float y_w[kWarps][kMaxTopK];
  const uint64_t epoch = *p.epoch;
  if (skip_send(p, epoch)) return;
  fill_peers(peers, p);
  const int C = row_width(p), D = p.hidden, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int staged = p.src_base[p.ranks];
  const int warps = gridDim.x * kWarps;
  int i = blockIdx.x * kWarps + warp;
  StagedRouting next;
  if (i < staged) next.load(p, i, lane);
  for (; i < staged; i += warps) {
    const StagedRouting cur = next;
    const int row = cur.row < p.recv_rows_cap ? cur.row : -1;  // flagged by expand
    const unsigned valid = __ballot_sync(~0u, row >= 0);
    if (row >= 0) {
      const int at = __popc(valid & ((1u << lane) - 1));
      y_rows[warp][at] = reinterpret_cast<const uint4*>(p.y + size_t(row) * D);
      y_w[warp][at] = cur.w;
    }
    __syncwarp();
    if (i + warps < staged) next.load(p, i + warps, lane);
    const int n_rows = __popc(valid);
    const int src = source_of(p, i);
    // Where the source keeps this destination's partials: after those of lower ranks.
    int at = i - p.src_base[src];
    for (int q = 0; q < p.rank; ++q) at += p.counts_all[src * C + p.experts + q];
    uint16_t* peer = peers.comb_x[src];
    uint4* target = reinterpret_cast<uint4*>(peer ? peer + size_t(at) * D : p.stage_x + size_t(i) * D);
    // One PE: the partial is the token's whole output (what combine_reduce would copy).
    if (p.ranks == 1) target = reinterpret_cast<uint4*>(p.out + size_t(cur.token) * D);
    warp_weighted_sum(y_rows[warp], y_w[warp], n_rows, target, D / 8, lane);
    if (!peer) {
      // The staged row is no longer needed: it held the partial; put it to the source.
      __syncwarp();
      nvshmemx_putmem_warp(p.comb_x + size_t(at) * D, p.stage_x + size_t(i) * D, sizeof(uint16_t) * size_t(D), src);
    }
    __syncwarp();
  }
  if (p.ranks == 1) {
    // Tokens routed nowhere (every id invalid) were never staged: their output is zero.
    for (int t = blockIdx.x * kWarps + warp; t < p.tokens; t += warps) {
      if (p.tokpos[t] >= 0) continue;
      for (int c = lane; c < D / 8; c += 32) reinterpret_cast<uint4*>(p.out + size_t(t) * D)[c] = make_uint4(0, 0, 0, 0);
    }
  }
  last_block_signals(p, p.done + 1, p.comb_sig, epoch);
}

// ---- combine_reduce: grid G, block 256 ------------------------------------------------
extern "C" __global__ void __launch_bounds__(kThreads, 2) moefuse_ep_combine_reduce(moefuse_ep_params p) {
  __shared__ const uint4* parts[kWarps][MOEFUSE_EP_MAX_RANKS];
  const uint64_t epoch = *p.epoch;
  if (!wait_all(p, p.comb_sig, epoch, MOEFUSE_EP_OP_COMBINE)) return;
  const int C = row_width(p), D = p.hidden, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = gridDim.x * kWarps;
  const int n = D / 8;
  for (int t = blockIdx.x * kWarps + warp; t < p.tokens; t += warps) {
    // The token's partials, one per destination it went to, in rank order.
    const int* base = p.chunk_cnt + (t / kChunk) * C;
    int n_parts = 0;
    for (int d0 = 0; d0 < p.ranks; d0 += 32) {
      const int d = d0 + lane;
      const int tp = d < p.ranks ? p.tokpos[t * p.ranks + d] : -1;
      const unsigned has = __ballot_sync(~0u, tp >= 0);
      if (tp >= 0) {
        const size_t at = size_t(p.comb_base[d] + base[p.experts + d] + tp);
        parts[warp][n_parts + __popc(has & ((1u << lane) - 1))] = reinterpret_cast<const uint4*>(p.comb_x + at * D);
      }
      n_parts += __popc(has);
    }
    __syncwarp();
    warp_weighted_sum(parts[warp], nullptr, n_parts, reinterpret_cast<uint4*>(p.out + size_t(t) * D), n, lane);
    __syncwarp();
  }
}

// ---- slots_signal: grid 1, block 32 (pull) ----------------------------------------------
// After the down GEMM stored this rank's expert outputs into their homes' y_slots (stream
// order: that kernel has completed): fence, then raise comb_sig[rank] = epoch on every PE.
extern "C" __global__ void __launch_bounds__(32) moefuse_ep_slots_signal(moefuse_ep_params p) {
  const uint64_t epoch = *p.epoch;
  if (skip_send(p, epoch)) return;
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int pe = 0; pe < p.ranks; ++pe) nvshmemx_signal_op(p.comb_sig + p.rank, epoch, NVSHMEM_SIGNAL_SET, pe);
}

// ---- combine_slots: grid G, block 256 (pull) --------------------------------------------
// Waits for every rank's slots_signal, then per token: out[t] = sum over its valid slots j,
// in slot order, of w[t, j] * y_slots[t * top_k + j] (fp32, bf16 out; zeros when no slot is
// valid): the single-GPU layer's combine, over rows that the owners' down GEMMs wrote here.
extern "C" __global__ void __launch_bounds__(kThreads, 2) moefuse_ep_combine_slots(moefuse_ep_params p) {
  __shared__ const uint4* rows[kWarps][kMaxTopK];
  __shared__ float ws[kWarps][kMaxTopK];
  const uint64_t epoch = *p.epoch;
  if (!wait_all(p, p.comb_sig, epoch, MOEFUSE_EP_OP_COMBINE)) return;
  const int k = p.top_k, D = p.hidden, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = gridDim.x * kWarps;
  // A token's routing is loaded one token ahead (as in combine_send): the next token's ids
  // and weights are in flight while the current token's slots are summed.
  int next_e = -1;
  float next_w = 1.f;
  auto load_routing = [&](int tok) {
    next_e = lane < k ? p.topk_ids[size_t(tok) * k + lane] : -1;
    next_w = lane < k && p.topk_weights != nullptr ? p.topk_weights[size_t(tok) * k + lane] : 1.f;
  };
  int t = blockIdx.x * kWarps + warp;
  if (t < p.tokens) load_routing(t);
  for (; t < p.tokens; t += warps) {
    const int e = next_e;
    const float w = next_w;
    const bool valid = e >= 0 && e < p.experts;
    const unsigned mask = __ballot_sync(~0u, valid);
    if (valid) {
      const int at = __popc(mask & ((1u << lane) - 1));
      rows[warp][at] = reinterpret_cast<const uint4*>(p.y_slots + (size_t(t) * k + lane) * D);
      ws[warp][at] = w;
    }
    __syncwarp();
    if (t + warps < p.tokens) load_routing(t + warps);
    warp_weighted_sum(rows[warp], ws[warp], __popc(mask), reinterpret_cast<uint4*>(p.out + size_t(t) * D), D / 8,
                      lane);
    __syncwarp();
  }
}

// ---- bwd_publish: grid G, block 256 (pull, the backward's first kernel, at home) --------
// Per token: d_weights[t, j] = <dy[t], y_slots[t*k + j]> over its valid slots (fp32, lanes'
// partial sums reduced in a fixed order; 0 for an invalid slot), and dy[t] into dy_home;
// the last block raises bwd_sig[rank] = epoch everywhere. The slots are this call's
// forward's expert outputs: nothing writes them before every owner has seen this signal.
extern "C" __global__ void __launch_bounds__(kThreads) moefuse_ep_bwd_publish(moefuse_ep_params p) {
  const uint64_t epoch = *p.epoch;
  if (skip_send(p, epoch)) return;
  const int k = p.top_k, D = p.hidden, n = D / 8, lane = threadIdx.x % 32;
  const int warps = gridDim.x * kWarps;
  for (int t = blockIdx.x * kWarps + threadIdx.x / 32; t < p.tokens; t += warps) {
    const uint4* dy = reinterpret_cast<const uint4*>(p.x + size_t(t) * D);
    uint4* home = reinterpret_cast<uint4*>(p.dy_home + size_t(t) * D);
    for (int c = lane; c < n; c += 32) home[c] = __ldg(dy + c);
    for (int j = 0; j < k; ++j) {
      const int e = p.topk_ids[size_t(t) * k + j];
      float dot = 0.f;
      if (e >= 0 && e < p.experts) {
        const uint4* y = reinterpret_cast<const uint4*>(p.y_slots + (size_t(t) * k + j) * D);
        for (int c = lane; c < n; c += 32) dot += dot_bf16x8(__ldg(dy + c), __ldcg(y + c));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(~0u, dot, o);
      if (lane == 0) p.d_weights[size_t(t) * k + j] = dot;
    }
  }
  last_block_signals(p, p.done + 3, p.bwd_sig, epoch);
}

// ---- bwd_gather: grid G, block 256 (pull, at each owner) -------------------------------
// Waits for every home's bwd_publish; per received row r (of the forward's, still in
// recv_src, recv_w): dy_rows[r] = bf16(w_r * dy[token]) and x_rows[r] = x[token], both read
// at the token's home (dy_home, x_home) through peer addresses.
extern "C" __global__ void __launch_bounds__(kThreads) moefuse_ep_bwd_gather(moefuse_ep_params p) {
  __shared__ const uint16_t* dy_of[MOEFUSE_EP_MAX_RANKS];
  __shared__ const uint16_t* x_of[MOEFUSE_EP_MAX_RANKS];
  const uint64_t epoch = *p.epoch;
  for (int pe = threadIdx.x; pe < p.ranks; pe += blockDim.x) {
    dy_of[pe] = static_cast<const uint16_t*>(nvshmem_ptr(p.dy_home, pe));
    x_of[pe] = static_cast<const uint16_t*>(nvshmem_ptr(p.x_home, pe));
  }
  if (!wait_all(p, p.bwd_sig, epoch, MOEFUSE_EP_OP_BACKWARD)) return;  // (its barrier publishes the tables)
  const int D = p.hidden, n = D / 8, lane = threadIdx.x % 32;
  const int rows = min(int64_t(p.status[0]), p.recv_rows_cap);
  const int warps = gridDim.x * kWarps;
  for (int r = blockIdx.x * kWarps + threadIdx.x / 32; r < rows; r += warps) {
    const int src = p.recv_src[r];
    const int s = src / p.max_tokens, t = src - s * p.max_tokens;
    const float w = p.recv_w[r];
    const uint4* dy = reinterpret_cast<const uint4*>(dy_of[s] + size_t(t) * D);
    const uint4* x = reinterpret_cast<const uint4*>(x_of[s] + size_t(t) * D);
    uint4* dy_out = reinterpret_cast<uint4*>(p.dy_rows + size_t(r) * D);
    uint4* x_out = reinterpret_cast<uint4*>(p.x_rows + size_t(r) * D);
    for (int c = lane; c < n; c += 32) {
      dy_out[c] = scale_bf16x8(__ldcg(dy + c), w);
      x_out[c] = __ldcg(x + c);
    }
  }
}

// ---- hello: grid 1, block 32 ----------------------------------------------------------
// Row `rank` of every PE's handshake table gets this rank's record; the host brackets the
// launch with barriers and reads its own table (no device wait).
extern "C" __global__ void __launch_bounds__(32) moefuse_ep_hello(moefuse_ep_params p) {
  const uint64_t record[4] = {MOEFUSE_EP_HELLO_MAGIC, p.cfg_hash, p.epoch_base, uint64_t(p.rank)};
  uint64_t* row = p.hello + 4 * size_t(p.rank);
  for (int pe = threadIdx.x; pe < p.ranks; pe += blockDim.x) {
    for (int w = 0; w < 4; ++w) nvshmem_uint64_p(row + w, record[w], pe);
  }
  nvshmem_quiet();
}

// ---- abort: grid 1, block 32 ----------------------------------------------------------
// A host-side error ended this rank's part of the call: record it here (so later kernels of
// the instance do nothing) and send abort signals for the epoch the peers wait on. In the
// dispatch stage that is the next epoch, which this rank takes too.
extern "C" __global__ void __launch_bounds__(32) moefuse_ep_abort(moefuse_ep_params p) {
  if (threadIdx.x != 0) return;
  const bool dispatching = p.abort_stage == 0;
  const uint64_t epoch = *p.epoch + (dispatching ? 1 : 0);
  *p.epoch = epoch;
  record_fault(p, MOEFUSE_EP_FAULT_LOCAL_ABORT, dispatching ? MOEFUSE_EP_OP_NOTIFY : MOEFUSE_EP_OP_COMBINE, p.rank, 0,
               epoch);
  abort_peers(p, epoch);
}

#endif
