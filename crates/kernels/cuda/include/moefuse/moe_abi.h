/*
 * moefuse C ABI, part 2: token permutation, combine and its backward (kernels/moe/permute.cu).
 * Part of the surface abi.h describes (same status enum, same conventions: one argument
 * struct per launcher, `void* stream`). NOTES: a separate header because every CUTLASS
 * instance includes abi.h, so any edit there rebuilds all of them (~12 min on 2 cores);
 * additions here are new symbols, which the link checks, so they need no version bump.
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

/* Tokens per block of the permutation's count pass; the workspace holds one int32 count
 * per (chunk, expert): moefuse_moe_permute_workspace(tokens, experts) bytes. */
#define MOEFUSE_PERMUTE_CHUNK 256

/*
 * Permutation with the gather of x fused: counts [experts] and offsets [experts] (int32
 * prefix-sum ends: the grouped GEMM's), row_of [tokens*top_k] (the expert-major row of
 * (t, j), -1 for an id outside 0..experts), source_of [tokens*top_k] (t*top_k + j of each
 * row; rows past offsets[experts-1] untouched), and, when x_perm is not NULL,
 * x_perm[row] = x[t] (bf16 rows of `hidden`, hidden % 8 == 0). flags (may be NULL) gets
 * bit 1 for an out-of-range id and bit 2 for a token naming one expert twice (both slots
 * kept, in unspecified order). 1 <= experts <= 512, 1 <= top_k <= 16; tokens == 0 writes
 * zero counts and offsets.
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
  uint32_t* flags;         /* [1], or NULL */
} moefuse_permute_args;

/* Bytes of workspace moefuse_moe_permute needs. */
size_t moefuse_moe_permute_workspace(int32_t tokens, int32_t experts);

/*
 * Combine: out[t] = sum over slots j (in order) of w[t, j] * y[row_of[t*top_k + j]],
 * accumulated in fp32, written as bf16; weights NULL means 1 (the unweighted sum the
 * backward uses for dx). Slots with row_of < 0 are skipped. hidden % 8 == 0.
 */
typedef struct moefuse_combine_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t _pad;
  const int32_t* row_of;  /* [tokens*top_k] */
  const float* weights;   /* [tokens, top_k] or NULL */
  const uint16_t* y;      /* [rows, hidden] bf16 */
  uint16_t* out;          /* [tokens, hidden] bf16 */
} moefuse_combine_args;

/*
 * Combine backward: for every (t, j) with row = row_of[t*top_k + j] >= 0,
 * dy_perm[row] = w[t, j] * dy[t] (bf16) and d_weights[t, j] = <dy[t], y[row]> (fp32, fp32
 * accumulation); d_weights is 0 for skipped slots. hidden % 8 == 0.
 */
typedef struct moefuse_combine_bwd_args {
  int32_t tokens;
  int32_t top_k;
  int32_t hidden;
  int32_t _pad;
  const int32_t* row_of;
  const float* weights;   /* [tokens, top_k] */
  const uint16_t* dy;     /* [tokens, hidden] bf16 */
  const uint16_t* y;      /* [rows, hidden] bf16: the forward's unweighted expert outputs */
  uint16_t* dy_perm;      /* [rows, hidden] bf16 */
  float* d_weights;       /* [tokens, top_k] */
} moefuse_combine_bwd_args;

moefuse_status moefuse_moe_permute(const moefuse_permute_args* args, void* stream);
moefuse_status moefuse_moe_combine(const moefuse_combine_args* args, void* stream);
moefuse_status moefuse_moe_combine_bwd(const moefuse_combine_bwd_args* args, void* stream);

#ifdef __cplusplus
}
#endif

#endif
