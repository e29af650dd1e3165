/*
 * moefuse C ABI: the whole surface between the CUDA kernels and Rust.
 *
 * One status enum, one argument struct per operation, one launcher per compiled
 * variant (`moefuse_<variant>`, plus `moefuse_<variant>_workspace`), the ABI version,
 * and a thread-local message for the last failure. Plain C: no C++ types cross it.
 * Every launcher reads the CUDA error state right after its launch and reports it.
 */
#ifndef MOEFUSE_ABI_H
#define MOEFUSE_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct layout or launcher signature changes. */
#define MOEFUSE_ABI_VERSION 6

typedef enum moefuse_status {
  MOEFUSE_STATUS_OK = 0,
  /* A pointer or leading dimension breaks the kernel's alignment rule (TMA: 16 bytes). */
  MOEFUSE_STATUS_MISALIGNED = 1,
  /* Sizes the kernel cannot implement (negative, zero where forbidden, too large). */
  MOEFUSE_STATUS_INVALID_PROBLEM = 2,
  /* The current device is not the architecture this variant was compiled for. */
  MOEFUSE_STATUS_ARCH_MISMATCH = 3,
  /* The caller's workspace is smaller than `_workspace()` asked for. */
  MOEFUSE_STATUS_WORKSPACE_TOO_SMALL = 4,
  /* The CUDA runtime reported an error (message in moefuse_last_error()). */
  MOEFUSE_STATUS_CUDA_ERROR = 5,
  /* Anything else: a bug in moefuse. */
  MOEFUSE_STATUS_INTERNAL = 6
} moefuse_status;

/* Layout of B, the second operand, for dense and grouped GEMMs. */
typedef enum moefuse_b_layout {
  /* B stored [N, K] row-major: K contiguous ("weights as nn.Linear stores them"). */
  MOEFUSE_B_LAYOUT_NK = 0,
  /* B stored [K, N] row-major: N contiguous. */
  MOEFUSE_B_LAYOUT_KN = 1
} moefuse_b_layout;

/*
 * D[m, n] = alpha * sum_k A[m, k] * B(k, n) + beta * C[m, n]
 *
 * A is [m, k] row-major with leading dimension lda (elements).
 * B is [n, k] (layout NK) or [k, n] (layout KN) row-major with leading dimension ldb.
 * C and D are [m, n] row-major with leading dimensions ldc, ldd. C may be NULL when
 * beta == 0. All matrices bf16, accumulation in fp32, alpha and beta fp32.
 */
typedef struct moefuse_gemm_args {
  int32_t m;
  int32_t n;
  int32_t k;
  int32_t b_layout; /* moefuse_b_layout; must match the variant */
  const void* a;
  const void* b;
  const void* c;
  void* d;
  int64_t lda;
  int64_t ldb;
  int64_t ldc;
  int64_t ldd;
  float alpha;
  float beta;
} moefuse_gemm_args;

/*
 * Grouped GEMM over experts e = 0..num_groups-1; group e owns rows [start_e, end_e) with
 * end_e = offsets[e] and start_e = end_{e-1} (start_0 = 0): the prefix-sum form, int32, in
 * device memory, so a launch needs no host synchronisation. Ends are clamped to total_rows
 * and a decreasing end gives an empty group, so no offsets can make a kernel touch memory
 * outside the buffers (decreasing ends can make later groups overlap earlier ones: memory
 * safe, result unspecified; the Rust API's check_offsets finds them). Rows past
 * end_{G-1} are left untouched.
 *
 * M-grouped (fwd, dgrad): D[rows_e, :] = alpha * A[rows_e, :] * W_e + beta * D[rows_e, :]
 *   A [total_rows, k], D [total_rows, n] row-major; W_e = b + e*n*k, stored [n, k]
 *   (b_layout NK) or [k, n] (KN). dgrad is the same call with the weights' other layout.
 * K-grouped (wgrad): D_e = alpha * A[rows_e, :]^T * B[rows_e, :] + beta * D_e
 *   A [total_rows, k], B [total_rows, n] row-major; D_e = d + e*k*n, [k, n] row-major.
 *   An empty group gets D_e = 0 when beta == 0 and is left untouched otherwise.
 * bf16 operands, fp32 accumulation. C is D itself (beta reads D's previous content).
 *
 * Gathered rows (contiguous `_contig` variants that say so; every other variant refuses a
 * non-null b_rows or a_rows): row r of an operand is read from row rows[r] / rows_div of a
 * buffer of source_rows rows, e.g. the token rows of x named by the routed slots'
 * source_of (div = top_k), so the layer never materialises the permuted copy. An index that
 * is negative or names a row >= source_rows reads zeros. b_rows: K-grouped B
 * ([b_source_rows, n]). a_rows: A ([a_source_rows, k]). NULL: the operand is [total_rows, .]
 * as above (its div and source_rows ignored).
 */
typedef struct moefuse_grouped_gemm_args {
  int32_t num_groups;
  int32_t total_rows;
  int32_t n;
  int32_t k;
  int32_t b_layout;   /* M-grouped: moefuse_b_layout of W_e; K-grouped: ignored */
  int32_t tile_order; /* bits 0-1: raster (0 kernel default, 1 along M, 2 along N);
                         bits 8-15: max swizzle (0 or 1: none; 2, 4, 8), or for the
                         contiguous (`_contig`) variants the band height in m-blocks
                         (0: default, else a power of two up to 128);
                         contiguous variants only: bits 16-23 k-blocks prefetched into
                         L2 (0: none), bit 24 the interleaved tile walk */
  const int32_t* offsets;
  const void* a;
  const void* b;
  void* d;
  float alpha;
  float beta;
  const int32_t* b_rows; /* [total_rows] int32 or NULL: see "Gathered rows" above */
  int32_t b_rows_div;    /* >= 1 when b_rows is set */
  int32_t b_source_rows; /* >= 1 when b_rows is set: rows of B */
  const int32_t* a_rows; /* [total_rows] int32 or NULL: see "Gathered rows" above */
  int32_t a_rows_div;    /* >= 1 when a_rows is set */
  int32_t a_source_rows; /* >= 1 when a_rows is set: rows of A */
} moefuse_grouped_gemm_args;

/* ---- MoE layer pieces that are not GEMMs (kernels/moe/): router and activation. ----
 * Plain CUDA C++, compiled once for every built arch into one fat object, so each has a
 * single launcher `moefuse_moe_<op>(args, stream)`; on a device none of the built archs
 * runs, the launch reports MOEFUSE_STATUS_ARCH_MISMATCH. No workspace. */

/* How moefuse_router_args chooses experts (the Rust RouterKind). */
typedef enum moefuse_router_kind {
  /* p = softmax(logits) over all experts; top-k by logit (ties: lower id); weight p_e,
     divided by the chosen experts' sum of p when renormalize. */
  MOEFUSE_ROUTER_SOFTMAX_TOPK = 0,
  /* DeepSeek-V3: s = sigmoid(logits), selection score s_e + bias[e]; n_group groups of
     experts/n_group consecutive ids scored by the sum of their top 2; the topk_group best
     groups kept (ties: lower group); top-k experts by selection score among them (ties:
     lower id); weight s_e (no bias), divided by the chosen sum when renormalize, then times
     routed_scaling_factor. */
  MOEFUSE_ROUTER_SIGMOID_GROUPED = 1
} moefuse_router_kind;

/*
 * Router forward: logits [tokens, experts] fp32 -> topk_ids [tokens, top_k] int32 and
 * topk_weights [tokens, top_k] fp32, all row-major device memory; slot 0 is each token's
 * best expert. Scores and weights are computed in fp64 and rounded once to fp32.
 * 1 <= experts <= 512, 1 <= top_k <= min(16, experts); sigmoid grouped: n_group divides
 * experts with >= 2 experts per group, 1 <= topk_group <= n_group,
 * top_k <= topk_group * experts / n_group. bias: [experts] fp32 or NULL (zeros), sigmoid
 * grouped only. tokens == 0 launches nothing. Logits and bias must be finite.
 */
typedef struct moefuse_router_args {
  int32_t tokens;
  int32_t experts;
  int32_t top_k;
  int32_t kind; /* moefuse_router_kind */
  int32_t n_group;    /* sigmoid grouped; ignored by softmax */
  int32_t topk_group; /* sigmoid grouped; ignored by softmax */
  int32_t renormalize; /* 0 or 1 */
  float routed_scaling_factor; /* sigmoid grouped; ignored by softmax */
  const float* logits;
  const float* bias;
  int32_t* topk_ids;
  float* topk_weights;
} moefuse_router_args;

/*
 * Router backward, the selection held constant: d_logits [tokens, experts] fp32 (every
 * element written) from d_topk_weights [tokens, top_k] fp32, the forward's logits and its
 * topk_ids (distinct within a token; ids outside 0..experts are ignored). Softmax:
 * d_l_i = p_i (g_i - sum_j g_j p_j), g = dL/dp on the chosen experts (through the
 * renormalisation if any). Sigmoid grouped: d_l = dL/ds * s (1 - s) on the chosen experts,
 * zero elsewhere (the bias gets no gradient). Sizes as for the forward; fp64 inside.
 */
typedef struct moefuse_router_bwd_args {
  int32_t tokens;
  int32_t experts;
  int32_t top_k;
  int32_t kind; /* moefuse_router_kind */
  int32_t renormalize;
  float routed_scaling_factor;
  const float* logits;
  const int32_t* topk_ids;
  const float* d_topk_weights;
  float* d_logits;
} moefuse_router_bwd_args;

/* The expert MLP's activation (the Rust Activation). g = gate, u = up, x = the one input
   of RELU2; alpha and limit come from moefuse_activation_args. */
typedef enum moefuse_activation {
  MOEFUSE_ACTIVATION_SWIGLU = 0,         /* silu(g) u */
  MOEFUSE_ACTIVATION_GEGLU = 1,          /* gelu_tanh(g) u */
  MOEFUSE_ACTIVATION_SWIGLU_OAI = 2,     /* g' sigmoid(alpha g') (u' + 1), clamped */
  MOEFUSE_ACTIVATION_BOUNDED_SWIGLU = 3, /* silu(g') u', clamped */
  MOEFUSE_ACTIVATION_RELU2 = 4           /* relu(x)^2, not gated */
} moefuse_activation;

/* Where gate and up sit in a gated row of width 2I (ignored by RELU2). */
typedef enum moefuse_gate_up_layout {
  MOEFUSE_GATE_UP_SPLIT = 0,      /* g_j = row[j], u_j = row[I + j] */
  MOEFUSE_GATE_UP_INTERLEAVED = 1 /* g_j = row[2j], u_j = row[2j + 1] */
} moefuse_gate_up_layout;

/*
 * Activation over the expert-major intermediate, fp32 math, bf16 in and out, row-major:
 *   forward:  out = h [rows, I] from h_pre [rows, W]        (dh unused, may be NULL)
 *   backward: out = d_h_pre [rows, W] from dh [rows, I] and h_pre [rows, W], recomputing
 *             the activation; the gradient of an input is 0 where its clamp is active.
 * W = 2I for gated activations, I for RELU2. rows = *total_rows (device int32, e.g.
 * offsets[E-1] of the prefix-sum offsets, so no host synchronisation) clamped to
 * [0, max_rows], or max_rows when total_rows is NULL; rows past it are left untouched.
 * Buffers hold max_rows rows. limit: SWIGLU_OAI, BOUNDED_SWIGLU (> 0); alpha: SWIGLU_OAI.
 */
typedef struct moefuse_activation_args {
  int32_t activation; /* moefuse_activation */
  int32_t layout;     /* moefuse_gate_up_layout */
  int32_t intermediate; /* I >= 1 */
  int32_t max_rows;     /* >= 0 */
  float alpha;
  float limit;
  const int32_t* total_rows;
  const void* h_pre;
  const void* dh;
  void* out;
} moefuse_activation_args;

moefuse_status moefuse_moe_router_fwd(const moefuse_router_args* args, void* stream);
moefuse_status moefuse_moe_router_bwd(const moefuse_router_bwd_args* args, void* stream);
moefuse_status moefuse_moe_activation_fwd(const moefuse_activation_args* args, void* stream);
moefuse_status moefuse_moe_activation_bwd(const moefuse_activation_args* args, void* stream);

/*
 * Routed activation backward (the layer's lean Training backward): for every expert-major
 * row r < rows (rows as for moefuse_activation_args) with slot s = source_of[r] (t*top_k + j)
 * and its routing weight w = weights[s], from the unweighted dh_u [rows, I] (= dy[t] · D_e)
 * and h_pre [rows, W], recomputing h = bf16(act(h_pre)) in fp32 as the forward did:
 *   d_h_pre[r] = d act(h_pre) / d h_pre applied to w * dh_u[r]        [rows, W] bf16
 *   d_weights[s] = sum_i dh_u[r, i] * h[r, i]    (fp32, one warp per row, fixed order)
 *   h_scaled[r] = bf16(w * h[r])                  [rows, I] (the down wgrad's operand)
 * A source_of entry outside 0..slots-1 leaves its row's outputs untouched and raises
 * MOEFUSE_MOE_ERROR_SOURCE in *errors (when not NULL). With expect_tokens (the permutation's
 * tokens stamp), a stamp other than slots / top_k (a permutation of another call) touches
 * no output and raises MOEFUSE_MOE_ERROR_STALE: d_weights keeps what the caller put there.
 * I % 8 == 0, 16-byte aligned bf16 buffers, slots a multiple of top_k >= 1.
 */
typedef struct moefuse_activation_routed_args {
  moefuse_activation_args act; /* out = d_h_pre, dh = dh_u */
  int32_t slots;               /* tokens * top_k: the length of weights and d_weights */
  int32_t top_k;               /* >= 1 */
  const int32_t* source_of;    /* [max_rows] */
  const float* weights;        /* [slots] */
  float* d_weights;            /* [slots] */
  void* h_scaled;              /* [max_rows, I] bf16 */
  uint32_t* errors;            /* [1] or NULL */
  const uint32_t* expect_tokens; /* [1] the permutation's tokens stamp, or NULL (no check) */
} moefuse_activation_routed_args;

moefuse_status moefuse_moe_activation_bwd_routed(const moefuse_activation_routed_args* args, void* stream);

/* The ABI version the library was built with (MOEFUSE_ABI_VERSION). */
uint32_t moefuse_abi_version(void);

/* The message of the last non-OK status returned on this thread ("" if none). */
const char* moefuse_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_ABI_H */
