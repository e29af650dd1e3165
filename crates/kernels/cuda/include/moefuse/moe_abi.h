/*
 * moefuse C ABI, part 2: token permutation, combine and its backward (kernels/moe/permute.cu).
 * Part of the surface abi.h describes (same status enum, same conventions: one argument
 * struct per launcher, `void* stream`). NOTES: a separate header because every CUTLASS
 * instance includes abi.h, so any edit there rebuilds all of them (~12 min on 2 cores);
 * additions here are new symbols, which the link checks, so they need no version bump.
 * A layout change of a struct here is checked by the static_asserts in permute.cu and the
 * layout tests in crates/kernels/src/ffi.rs, which are compiled from the same tree (the
 * library is linked statically, so an old library cannot meet new bindings).
 */
#ifndef MOEFUSE_MOE_ABI_H
#define MOEFUSE_MOE_ABI_H

#include "moefuse/abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Token permutation, combine and its backward (kernels/moe/permute.cu). ----
 * Routed (token, slot) pairs are laid out expert-major: rows grouped by expert ascending,
 * stable in token order within an expert (a token names each expert at most once). */

/* Device error word bits (flags[0] / errors[0]): what the kernels found wrong in
 * device-resident inputs they cannot trust. They are set with atomicOr, never cleared by
 * a kernel; the offending slot is skipped, so no kernel touches memory outside its
 * buffers whatever the device data holds. */
#define MOEFUSE_MOE_ERROR_EXPERT_ID 1u /* permute: an expert id outside 0..experts (slot dropped, row_of -1) */
#define MOEFUSE_MOE_ERROR_DUPLICATE 2u /* permute: a token naming one expert twice */
#define MOEFUSE_MOE_ERROR_ROW 4u       /* combine, combine_bwd: a row_of entry outside -1..rows-1 (slot skipped) */
#define MOEFUSE_MOE_ERROR_STALE 8u     /* combine, combine_bwd: *expect_tokens != tokens (nothing read through row_of) */
#define MOEFUSE_MOE_ERROR_SOURCE 16u   /* gate_up fused: a source_of entry outside 0..tokens*top_k-1 (token 0 read instead); activation_bwd_routed: (row skipped) */

/* Tokens per block of the permutation's count pass; the workspace holds one int32 count
 * per (chunk, expert): moefuse_moe_permute_workspace(tokens, experts) bytes. */
#define MOEFUSE_PERMUTE_CHUNK 256

/*
 * Permutation with the gather of x fused: counts [experts] and offsets [experts] (int32
 * prefix-sum ends: the grouped GEMM's), row_of [tokens*top_k] (the expert-major row of
 * (t, j), -1 for an id outside 0..experts), source_of [tokens*top_k] (t*top_k + j of each
 * row; rows past offsets[experts-1] untouched), and, when x_perm is not NULL,
 * x_perm[row] = x[t] (bf16 rows of `hidden`, hidden % 8 == 0). flags (may be NULL) is
 * the device error word pair (see MOEFUSE_MOE_ERROR_*): flags[0] gets
 * MOEFUSE_MOE_ERROR_EXPERT_ID for an out-of-range id and MOEFUSE_MOE_ERROR_DUPLICATE for a
 * token naming one expert twice (both slots kept, in unspecified order); flags[1] is set
 * to `tokens`, the stamp combine and combine_bwd compare through `expect_tokens`.
 * 1 <= experts <= 512, 1 <= top_k <= 16; tokens == 0 writes zero counts and offsets.
 */
typedef struct moefuse_permute_args {
  int32_t tokens;
  int32_t experts;
  int32_t top_k;
  int32_t hidden;
  const int32_t* topk_ids; /* [tokens, top_k] */
  const uint16_t* x;       /* [tokens, hidden] bf16, or NULL */
  int32_t* counts;
  int32_t* offsets;
  int32_t* row_of;
  int32_t* source_of;
  uint16_t* x_perm;        /* [tokens*top_k, hidden] bf16, or NULL */
  int32_t* workspace;      /* moefuse_moe_permute_workspace(tokens, experts) bytes */
  uint32_t* flags;         /* [2] (error bits, tokens stamp), or NULL */
} moefuse_permute_args;

/* Bytes of workspace moefuse_moe_permute needs. */
size_t moefuse_moe_permute_workspace(int32_t tokens, int32_t experts);

/*
 * Combine: out[t] = sum over slots j (in order) of w[t, j] * y[row_of[t*top_k + j]],
 * accumulated in fp32, written as bf16; weights NULL means 1 (the unweighted sum the
 * backward uses for dx). hidden % 8 == 0.
 * row_of lives on the device and is not trusted: a slot with row_of == -1 is skipped (the
 * permutation's dropped slot); any other entry outside 0..rows-1 is skipped too and raises
 * MOEFUSE_MOE_ERROR_ROW in errors[0]. When expect_tokens is not NULL and
 * *expect_tokens != tokens (the permutation that wrote row_of had another token count),
 * every out row is written as zeros, row_of is not read, and MOEFUSE_MOE_ERROR_STALE is
 * raised. errors may be NULL (violations are then skipped silently).
 */
typedef struct moefuse_combine_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t rows;                  /* rows y holds, >= 0 */
  const int32_t* row_of;         /* [tokens*top_k] */
  const float* weights;          /* [tokens, top_k] or NULL */
  const uint16_t* y;             /* [rows, hidden] bf16 */
  uint16_t* out;                 /* [tokens, hidden] bf16 */
  uint32_t* errors;              /* [1]: error bits, or NULL */
  const int32_t* expect_tokens;  /* [1]: the permutation's tokens stamp, or NULL */
} moefuse_combine_args;

/*
 * Combine backward: for every (t, j) with row = row_of[t*top_k + j] in 0..rows-1,
 * dy_perm[row] = w[t, j] * dy[t] (bf16) and d_weights[t, j] = <dy[t], y[row]> (fp32, fp32
 * accumulation); d_weights is 0 for skipped slots. hidden % 8 == 0.
 * Gather mode, when weights is NULL: dy_perm[row] = dy[t] unweighted, y and d_weights are
 * not used (may be NULL); the same kernel regathers x rows for a backward (dy = x). Untrusted row_of and
 * expect_tokens as for combine: an entry outside -1..rows-1 is skipped and raises
 * MOEFUSE_MOE_ERROR_ROW; a stale stamp writes d_weights as zeros, touches no dy_perm row
 * and raises MOEFUSE_MOE_ERROR_STALE.
 */
typedef struct moefuse_combine_bwd_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t rows;                  /* rows y and dy_perm both hold, >= 0 */
  const int32_t* row_of;
  const float* weights;          /* [tokens, top_k] */
  const uint16_t* dy;            /* [tokens, hidden] bf16 */
  const uint16_t* y;             /* [rows, hidden] bf16: the forward's unweighted expert outputs */
  uint16_t* dy_perm;             /* [rows, hidden] bf16 */
  float* d_weights;              /* [tokens, top_k] */
  uint32_t* errors;              /* [1]: error bits, or NULL */
  const int32_t* expect_tokens;  /* [1]: the permutation's tokens stamp, or NULL */
} moefuse_combine_bwd_args;

/*
 * Fused gate_up (sm_90a; kernel/sm90_gate_up_fused.cuh): for every expert-major row r of
 * expert e (rows offsets[e-1]..offsets[e]-1, offsets read on the device and clamped to
 * tokens*top_k), with t = source_of[r] / top_k (the token's row of x, read by the GEMM's
 * producer: no x_perm copy),
 *   h_pre[r, :] = x[t, :] · W_e^T               (W_e = w[e] as [W, hidden], W = 2*I gated, I for RELU2)
 *   h[r, j]     = act(h_pre[r, gate j], h_pre[r, up j])   for j < I
 * with the activation applied to the fp32 accumulators in the epilogue (the formulas of
 * moe/activation.cu; h_pre is not rounded first). h_pre is written only when not NULL (the
 * backward's input). Gate/up layouts: split (gate rows 0..I-1, up rows I..2I-1 of W_e) or
 * interleaved (g, u, g, u, ...). Needs hidden % 8 == 0 and intermediate % 8 == 0, 16-byte
 * aligned x, w, h, h_pre, 1 <= experts <= 512. A source_of entry outside
 * 0..tokens*top_k-1 reads token 0 and raises MOEFUSE_MOE_ERROR_SOURCE in errors[0] (may be
 * NULL). Another device than compute capability 9.0 returns MOEFUSE_STATUS_ARCH_MISMATCH
 * (the unfused path then runs).
 * Peer rows (peers > 0; the expert-parallel pull dispatch): source_of[r] = s * peer_rows + t
 * reads row t of peer_x[s] ([peer_rows, hidden] bf16, 16-byte aligned, an address this
 * device loads from: its own memory or a peer's over NVLink); x is then not read (it may
 * be NULL); an entry with s >= peers reads row 0 of peer_x[0] and raises
 * MOEFUSE_MOE_ERROR_SOURCE. 1 <= peers <= MOEFUSE_GATE_UP_MAX_PEERS.
 */
#define MOEFUSE_GATE_UP_MAX_PEERS 8

typedef struct moefuse_gate_up_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t intermediate;
  int32_t experts;
  int32_t activation;        /* MOEFUSE_ACTIVATION_* */
  int32_t layout;            /* MOEFUSE_GATE_UP_SPLIT or _INTERLEAVED */
  int32_t tile_order;        /* 0: default; else as moefuse_grouped_gemm_args.tile_order (contiguous fields) */
  float alpha;               /* SWIGLU_OAI's alpha */
  float limit;               /* the clamped activations' limit */
  const int32_t* offsets;    /* [experts] prefix-sum ends */
  const int32_t* source_of;  /* [tokens*top_k] t*top_k + j of each row, or NULL: x holds the routed rows in order */
  const uint16_t* x;         /* [tokens, hidden] bf16 ([tokens*top_k, hidden] without source_of) */
  const uint16_t* w;         /* [experts, W, hidden] bf16 */
  uint16_t* h;               /* [tokens*top_k, intermediate] bf16 */
  uint16_t* h_pre;           /* [tokens*top_k, W] bf16, or NULL */
  uint32_t* errors;          /* [1]: error bits, or NULL */
  int32_t peers;             /* 0: rows of x; 1..MOEFUSE_GATE_UP_MAX_PEERS: rows of peer_x[s] */
  int32_t peer_rows;         /* rows of each peer_x[s] */
  const uint16_t* peer_x[MOEFUSE_GATE_UP_MAX_PEERS]; /* [peer_rows, hidden] bf16 each; unused entries NULL */
} moefuse_gate_up_args;

moefuse_status moefuse_moe_gate_up_fused(const moefuse_gate_up_args* args, void* stream);

/*
 * Scattered down GEMM (sm_90a; moe/down_scatter.cu: kernel/sm90_contiguous_grouped.cuh with
 * the RowsScattered store): for every expert-major row r of expert e (rows
 * offsets[e-1]..offsets[e]-1, offsets read on the device and clamped to rows),
 *   out_r = h[r, :] · W_e^T       (b_layout NK: W_e = w[e] as [hidden, intermediate])
 *   out_r = h[r, :] · W_e         (b_layout KN: W_e = w[e] as [intermediate, hidden])
 * stored as hidden bf16 values at the address row_dst[r], not into a matrix: the
 * expert-parallel layer's down GEMM (and its backward's gate_up dgrad, KN) writes each
 * output row straight into its token's slot on the token's home rank (row_dst holds this device's or peers' addresses,
 * 16-byte aligned, written by the dispatch). Rows past offsets[experts-1] are not stored.
 * Needs hidden % 8 == 0, intermediate % 8 == 0, 16-byte aligned h and w, 1 <= experts <=
 * 512. Another device than compute capability 9.0 returns MOEFUSE_STATUS_ARCH_MISMATCH.
 */
typedef struct moefuse_down_scatter_args {
  int32_t rows;              /* expert-major rows: h's rows and row_dst's entries */
  int32_t experts;
  int32_t hidden;            /* N */
  int32_t intermediate;      /* K */
  int32_t tile_order;        /* 0: default; else as moefuse_grouped_gemm_args.tile_order (contiguous fields) */
  int32_t b_layout;          /* moefuse_b_layout of w */
  const int32_t* offsets;    /* [experts] prefix-sum ends */
  const uint16_t* h;         /* [rows, intermediate] bf16 */
  const uint16_t* w;         /* [experts, hidden, intermediate] (NK) or [experts, intermediate, hidden] (KN) bf16 */
  const uint64_t* row_dst;   /* [rows] addresses of hidden bf16 each */
} moefuse_down_scatter_args;

moefuse_status moefuse_moe_down_scatter(const moefuse_down_scatter_args* args, void* stream);

/*
 * Down dgrad with the routed activation backward (sm_90a; moe/down_dgrad_fused.cu:
 * kernel/sm90_contiguous_grouped.cuh gathering dy by source_of, with the epilogue of
 * epilogue/activation_backward_rows.cuh): for every expert-major row r of expert e (rows
 * offsets[e-1]..offsets[e]-1, offsets read on the device and clamped to tokens*top_k), with
 * s = source_of[r] (its slot t*top_k + j) and w = weights[s]:
 *   dh_u[r, :]     = dy[t, :] · W_e          (W_e = w[e] as [hidden, intermediate]; bf16, not stored)
 *   h[r, i]        = bf16(act(h_pre[r, gate i], h_pre[r, up i]))   (as the forward stored it)
 *   d_h_pre[r]     = d act / d h_pre applied to w * dh_u[r]         [rows, W] bf16, h_pre's layout
 *   h_scaled[r, i] = bf16(w * h[r, i])                              [rows, I] (the down wgrad's operand)
 *   d_weights[s]   = sum_i dh_u[r, i] * h[r, i]
 * the last in fp32 and a fixed order: per block of MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK columns
 * into partials[r, block] (the epilogue), then the blocks in order (a second kernel). The
 * formulas are moefuse_moe_activation_bwd_routed's over the dgrad's bf16 output.
 * d_weights of slots no row names are left as they are (the caller zeroes it). A source_of
 * entry outside 0..tokens*top_k-1 zero-fills its row of dy, leaves its d_weights untouched
 * and raises MOEFUSE_MOE_ERROR_SOURCE. With expect_tokens (the permutation's tokens stamp),
 * a stamp other than tokens raises MOEFUSE_MOE_ERROR_STALE and d_weights is not written
 * (d_h_pre and h_scaled are, from the rows as they stand). Needs hidden % 8 == 0,
 * intermediate % 8 == 0, 16-byte aligned dy, w, h_pre, d_h_pre, h_scaled, 1 <= experts <=
 * 512. Another device than compute capability 9.0 returns MOEFUSE_STATUS_ARCH_MISMATCH (the
 * unfused stages then run).
 */
#define MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK 256

typedef struct moefuse_down_dgrad_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;                /* K */
  int32_t intermediate;          /* N */
  int32_t experts;
  int32_t activation;            /* MOEFUSE_ACTIVATION_* */
  int32_t layout;                /* MOEFUSE_GATE_UP_SPLIT or _INTERLEAVED (h_pre, d_h_pre) */
  int32_t tile_order;            /* 0: default; else as moefuse_grouped_gemm_args.tile_order (contiguous fields) */
  float alpha;                   /* SWIGLU_OAI's alpha */
  float limit;                   /* the clamped activations' limit */
  const int32_t* offsets;        /* [experts] prefix-sum ends */
  const int32_t* source_of;      /* [tokens*top_k] t*top_k + j of each row */
  const float* weights;          /* [tokens*top_k] routing weights by slot */
  const uint16_t* dy;            /* [tokens, hidden] bf16 */
  const uint16_t* w;             /* [experts, hidden, intermediate] bf16 */
  const uint16_t* h_pre;         /* [tokens*top_k, W] bf16 */
  uint16_t* d_h_pre;             /* [tokens*top_k, W] bf16 out */
  uint16_t* h_scaled;            /* [tokens*top_k, intermediate] bf16 out */
  float* partials;               /* [tokens*top_k, ceil(intermediate / MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK)] scratch */
  float* d_weights;              /* [tokens*top_k] out */
  uint32_t* errors;              /* [1]: error bits, or NULL */
  const uint32_t* expect_tokens; /* [1]: the permutation's tokens stamp, or NULL (no check) */
} moefuse_down_dgrad_args;

moefuse_status moefuse_moe_down_dgrad_fused(const moefuse_down_dgrad_args* args, void* stream);

/*
 * Row kernels for carrying one fp32 value per routed (token, slot) through an exchange
 * that sums rows (moe/rows.cu):
 * scatter_columns: for r < min(*count, rows) (all rows when count is NULL):
 *   out[r, :] = 0 and out[r, col_of[r * col_stride]] = values[r] (bf16 [rows, width]); a
 *   column outside 0..width-1 leaves the row zero and raises MOEFUSE_MOE_ERROR_ROW.
 * columns_to_f32: out[r, j] = in[r, j] for r < rows, j < cols (in bf16 [rows, width],
 *   out fp32 [rows, cols], cols <= width).
 */
typedef struct moefuse_scatter_columns_args {
  int32_t rows;
  int32_t width;
  int32_t col_stride;
  int32_t reserved;          /* 0 */
  const int32_t* count;      /* [1] live rows, or NULL */
  const int32_t* col_of;     /* [rows * col_stride] */
  const float* values;       /* [rows] */
  uint16_t* out;             /* [rows, width] bf16 */
  uint32_t* errors;          /* [1], or NULL */
} moefuse_scatter_columns_args;

typedef struct moefuse_columns_to_f32_args {
  int32_t rows;
  int32_t width;
  int32_t cols;
  int32_t reserved;          /* 0 */
  const uint16_t* in;        /* [rows, width] bf16 */
  float* out;                /* [rows, cols] */
} moefuse_columns_to_f32_args;

moefuse_status moefuse_moe_scatter_columns(const moefuse_scatter_columns_args* args, void* stream);
moefuse_status moefuse_moe_columns_to_f32(const moefuse_columns_to_f32_args* args, void* stream);

/*
 * Small-batch (decode) forward (moe/decode.cu): the whole expert MLP of a few tokens in two
 * kernels that stream each touched expert's weights once, on any arch with mma.sync (built
 * into the fat object for every target). With s = t*top_k + j, e = topk_ids[s]:
 *   gate_up kernel:  h[s, :] = act(x[t] · W_e^T)     (fp32 accumulators, activation as in
 *                    moe/activation_math.cuh; W_e = w_gate_up[e] as [W, hidden])
 *   down kernel:     y_e = bf16(h[s] · D_e^T)        (D_e = w_down[e] as [hidden, intermediate])
 *                    y[t] = bf16(sum over j in order of topk_weights[s] * y_e)   (fp32)
 * h is slot-major scratch [tokens*top_k, intermediate]. When row_of is not NULL, the
 * expert-major copies a backward reads are written too, each only when its pointer is not
 * NULL: h_pre_rows[row_of[s]] (the pre-activation, bf16 of the accumulators),
 * h_rows[row_of[s]], y_e_rows[row_of[s]] (row_of entries outside 0..tokens*top_k-1 are
 * skipped). topk_ids live on the device and are not trusted: a slot whose id is outside
 * 0..experts-1 contributes nothing and raises MOEFUSE_MOE_ERROR_EXPERT_ID in errors[0].
 * Limits: 1 <= tokens <= MOEFUSE_DECODE_MAX_TOKENS, tokens*top_k <= MOEFUSE_DECODE_MAX_SLOTS,
 * hidden and intermediate multiples of 32, 16-byte aligned x, weights, h, y and the
 * expert-major outputs. Deterministic: no atomics on data, fixed summation orders.
 * unit_counter: a word, zero before its first use, then owned by the kernels (one caller
 * stream at a time): the gate_up kernel's blocks take their units from it (and the down
 * kernel zeroes it again); NULL: each block takes a fixed share.
 */
#define MOEFUSE_DECODE_MAX_TOKENS 64
#define MOEFUSE_DECODE_MAX_SLOTS 1024
typedef struct moefuse_decode_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t intermediate;
  int32_t experts;
  int32_t activation;           /* MOEFUSE_ACTIVATION_* */
  int32_t layout;               /* MOEFUSE_GATE_UP_SPLIT or _INTERLEAVED */
  float alpha;                  /* SWIGLU_OAI's alpha */
  float limit;                  /* the clamped activations' limit */
  const int32_t* topk_ids;      /* [tokens, top_k] */
  const float* topk_weights;    /* [tokens, top_k] */
  const int32_t* row_of;        /* [tokens*top_k] expert-major rows, or NULL */
  const uint16_t* x;            /* [tokens, hidden] bf16 */
  const uint16_t* w_gate_up;    /* [experts, W, hidden] bf16 */
  const uint16_t* w_down;       /* [experts, hidden, intermediate] bf16 */
  uint16_t* h;                  /* [tokens*top_k, intermediate] bf16 scratch */
  uint16_t* y;                  /* [tokens, hidden] bf16 */
  uint16_t* h_pre_rows;         /* [tokens*top_k, W], or NULL */
  uint16_t* h_rows;             /* [tokens*top_k, intermediate], or NULL */
  uint16_t* y_e_rows;           /* [tokens*top_k, hidden], or NULL */
  uint32_t* errors;             /* [1] error bits, or NULL */
  uint32_t* unit_counter;       /* [1] zeroed word the kernels keep, or NULL */
} moefuse_decode_args;

moefuse_status moefuse_moe_decode_forward(const moefuse_decode_args* args, void* stream);

moefuse_status moefuse_moe_permute(const moefuse_permute_args* args, void* stream);
moefuse_status moefuse_moe_combine(const moefuse_combine_args* args, void* stream);
moefuse_status moefuse_moe_combine_bwd(const moefuse_combine_bwd_args* args, void* stream);

#ifdef __cplusplus
}
#endif

#endif
