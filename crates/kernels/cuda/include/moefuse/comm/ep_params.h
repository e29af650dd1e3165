/*
 * Expert-parallel dispatch/combine: the one argument struct every kernel of
 * crates/comm/cuda/ep.cu takes by value. Mirrored field for field by `EpParams` in
 * crates/comm/src/ep/params.rs (a layout test there checks size and offsets).
 *
 * Buffers, by owner:
 *   caller   x, topk_ids, topk_weights (dispatch inputs), y (combine input), out.
 *   symmetric (same offset on every PE; peers write into them):
 *            meta, meta_sig, stage_x, stage_info, stage_w, disp_sig, comb_x, comb_sig,
 *            hello (the construction handshake).
 *   local    epoch, done, chunk_cnt, pos_local, tokpos, counts_all, dest_row_base,
 *            stage_base, comb_base, src_base, status, fault, and the receive outputs recv_*.
 *   host     fault_host (mapped pinned memory: the host reads it without a sync).
 *
 * Deadlines: every wait on a peer gives up after timeout_ns (globaltimer), records a fault
 * (first one wins) and lets the kernel exit; every later kernel of the instance sees the
 * fault and does nothing (senders first tell their peers, with an abort signal). Signals
 * carry the epoch; an abort signal is MOEFUSE_EP_ABORT_BIT | epoch.
 *
 * C = experts + ranks is the width of a count row: counts per global expert, then
 * tokens per destination rank.
 */
#ifndef MOEFUSE_COMM_EP_PARAMS_H
#define MOEFUSE_COMM_EP_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Tokens per block of the count kernel (8 warps x 8 tokens). */
#define MOEFUSE_EP_CHUNK 64

/* Largest world (peer tables in shared memory; crates/comm checks it before launch). */
#define MOEFUSE_EP_MAX_RANKS 64

/* Bits of status[1]: routing problems found on the device (slots skipped, never UB). */
#define MOEFUSE_EP_BAD_EXPERT_ID 1u
#define MOEFUSE_EP_DUPLICATE_EXPERT 2u
#define MOEFUSE_EP_RECV_OVERFLOW 4u

/* fault[0] = kind | op << 8 (0: none); fault[1] peer; fault[2] waited ns; fault[3] epoch. */
#define MOEFUSE_EP_FAULT_TIMEOUT 1u     /* a peer's signal did not come within timeout_ns */
#define MOEFUSE_EP_FAULT_ABORTED 2u     /* a peer sent an abort signal for this epoch */
#define MOEFUSE_EP_FAULT_LOCAL_ABORT 3u /* this rank abandoned the call (host-side error) */
#define MOEFUSE_EP_OP_NOTIFY 1u         /* dispatch: the count exchange (meta_sig) */
#define MOEFUSE_EP_OP_EXPAND 2u         /* dispatch: waiting for the tokens (disp_sig) */
#define MOEFUSE_EP_OP_COMBINE 3u        /* combine: waiting for the partial sums (comb_sig) */
#define MOEFUSE_EP_OP_BACKWARD 4u       /* pulled backward: waiting for dy (bwd_sig) or dx (bwd_comb_sig) */
#define MOEFUSE_EP_ABORT_BIT (1ull << 63)
#define MOEFUSE_EP_HELLO_MAGIC 0x6d6f656675736501ull

typedef struct moefuse_ep_params {
  int32_t ranks, rank, experts, local_experts;
  int32_t top_k, hidden, tokens, max_tokens;
  int64_t recv_rows_cap; /* rows of recv_x */

  const uint16_t* x;          /* [tokens, hidden] bf16 */
  const int32_t* topk_ids;    /* [tokens, top_k] */
  const float* topk_weights;  /* [tokens, top_k] */

  int32_t* meta;       /* sym [ranks][C]: row s = rank s's counts */
  uint64_t* meta_sig;  /* sym [ranks] */
  uint16_t* stage_x;   /* sym [ranks*max_tokens, hidden]: each received token once */
  int32_t* stage_info; /* sym [ranks*max_tokens][top_k+1]: expert-major row per slot (or -1), token */
  float* stage_w;      /* sym [ranks*max_tokens][top_k] */
  uint64_t* disp_sig;  /* sym [ranks] */
  uint16_t* comb_x;    /* sym [max_tokens*min(top_k,ranks), hidden]: partial sums from each destination */
  uint64_t* comb_sig;  /* sym [ranks] */

  uint64_t* epoch;        /* [1] the last call's epoch; notify increments it (starts at the agreed base) */
  uint32_t* done;         /* [4] finished blocks of dispatch / combine_send / count / bwd_publish (last block resets) */
  int32_t* chunk_cnt;     /* [max_chunks][C] per-chunk counts, then exclusive bases */
  int32_t* pos_local;     /* [max_tokens][top_k] rank of (t, slot) in its expert within the chunk */
  int32_t* tokpos;        /* [max_tokens][ranks] rank of t among tokens sent to d (or -1) */
  int32_t* counts_all;    /* [ranks][C] copy of meta */
  int32_t* dest_row_base; /* [experts] first expert-major row of my tokens at the owner */
  int32_t* stage_base;    /* [ranks] first staged row of mine at d */
  int32_t* comb_base;     /* [ranks] first comb_x row of d's partials here */
  int32_t* src_base;      /* [ranks+1] first staged row of source s here; [ranks] = total */
  uint32_t* status;       /* [2] rows received, error bits */

  uint16_t* recv_x;      /* [recv_rows_cap, hidden] expert-major rows for the grouped GEMM */
  int32_t* recv_offsets; /* [local_experts] prefix-sum ends */
  float* recv_w;         /* [recv_rows_cap] routing weight of each row */
  int32_t* recv_origin;  /* [recv_rows_cap][3] source rank, token, slot */

  const uint16_t* y; /* [recv rows, hidden] expert outputs, in recv_x's row order */
  uint16_t* out;     /* [tokens, hidden] combined bf16 */

  /* Guard block (appended: the offsets above are unchanged). */
  uint64_t timeout_ns;  /* deadline of every wait on a peer */
  uint64_t cfg_hash;    /* hello: this rank's configuration hash */
  uint64_t epoch_base;  /* hello: the epoch this rank proposes to start from */
  uint64_t* fault;      /* [4] first fault of this instance (see above); sticky */
  uint64_t* fault_host; /* [4] host-mapped copy of fault, written last-word-first */
  uint64_t* hello;      /* sym [ranks][4]: magic, cfg_hash, epoch_base, rank of each rank */
  int32_t abort_stage;  /* abort: 0 peers wait for epoch + 1 (dispatch), 1 for epoch (combine) */
  /* Pull block (appended). pull != 0: rows stay home. dispatch copies each token's row once
     into x_home (this rank's, read by the receivers in place) and sends only its routing
     (stage_info, stage_w); no row enters stage_x or recv_x; dispatch and expand write
     recv_src[row] = source rank * max_tokens + token instead. */
  int32_t pull;
  uint16_t* x_home;  /* sym [max_tokens, hidden] (pull) */
  int32_t* recv_src; /* [recv_rows_cap] (pull) source rank * max_tokens + token of each row */
  /* Slot combine (pull): each expert output row goes straight into its token's slot on the
     token's home rank (the down GEMM's scattered store, through recv_dst); the home rank
     sums its tokens' slots in slot order. */
  uint16_t* y_slots;  /* sym [max_tokens * top_k, hidden] (pull): row t * top_k + j */
  uint64_t* recv_dst; /* [recv_rows_cap] (pull) address of each received row's slot at its home */
  /* Pulled backward (appended): the home publishes dy and computes d_weights from its
     slots, the owners gather dy (weighted) and x rows, store dx rows into the home's slots
     (y_slots again: the homes have read them by then), the homes sum them. */
  uint16_t* dy_home;       /* sym [max_tokens, hidden] (pull): this rank's dy */
  uint64_t* bwd_sig;       /* sym [ranks] (pull): dy published (epoch) */
  uint64_t* bwd_comb_sig;  /* sym [ranks] (pull): dx rows stored into the homes' slots (epoch) */
  float* d_weights;        /* bwd_publish: [tokens, top_k] <dy, y_e> per slot (0 where invalid) */
  uint16_t* dy_rows;       /* bwd_gather: [recv_rows_cap, hidden] w * dy of each received row */
  uint16_t* x_rows;        /* bwd_gather: [recv_rows_cap, hidden] x of each received row */
} moefuse_ep_params;

#ifdef __cplusplus
}
#endif

#endif
