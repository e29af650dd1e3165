//! Rust mirror of `kernels/include/moefuse/abi.h`, in bindgen's shape (type names as in
//! the header, `#[repr(C)]`, layout assertions). Kept by hand because the launchers are
//! per-variant and declared by build.rs from the variant table; the layout tests below
//! and the `abi_version` check at first use catch drift from the header.

#![allow(non_camel_case_types)]

use std::ffi::c_void;

/// `MOEFUSE_ABI_VERSION` this crate was written against.
pub const MOEFUSE_ABI_VERSION: u32 = 6;

/// `moefuse_status`: kept as a plain integer so an unknown value cannot be undefined behaviour.
pub type MoefuseStatus = i32;
/// `MOEFUSE_STATUS_OK`
pub const MOEFUSE_STATUS_OK: MoefuseStatus = 0;
/// `MOEFUSE_STATUS_MISALIGNED`
pub const MOEFUSE_STATUS_MISALIGNED: MoefuseStatus = 1;
/// `MOEFUSE_STATUS_INVALID_PROBLEM`
pub const MOEFUSE_STATUS_INVALID_PROBLEM: MoefuseStatus = 2;
/// `MOEFUSE_STATUS_ARCH_MISMATCH`
pub const MOEFUSE_STATUS_ARCH_MISMATCH: MoefuseStatus = 3;
/// `MOEFUSE_STATUS_WORKSPACE_TOO_SMALL`
pub const MOEFUSE_STATUS_WORKSPACE_TOO_SMALL: MoefuseStatus = 4;
/// `MOEFUSE_STATUS_CUDA_ERROR`
pub const MOEFUSE_STATUS_CUDA_ERROR: MoefuseStatus = 5;
/// `MOEFUSE_STATUS_INTERNAL`
pub const MOEFUSE_STATUS_INTERNAL: MoefuseStatus = 6;

/// `MOEFUSE_B_LAYOUT_NK`: B stored `[n, k]` row-major.
pub const MOEFUSE_B_LAYOUT_NK: i32 = 0;
/// `MOEFUSE_B_LAYOUT_KN`: B stored `[k, n]` row-major.
pub const MOEFUSE_B_LAYOUT_KN: i32 = 1;

/// `moefuse_gemm_args`: `D = alpha * A * B + beta * C`, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseGemmArgs {
    /// Rows of A, C, D.
    pub m: i32,
    /// Columns of B, C, D.
    pub n: i32,
    /// Inner dimension.
    pub k: i32,
    /// `MOEFUSE_B_LAYOUT_*`.
    pub b_layout: i32,
    /// A, `[m, k]` row-major.
    pub a: *const c_void,
    /// B, `[n, k]` or `[k, n]` row-major.
    pub b: *const c_void,
    /// C, `[m, n]` row-major; may be null when `beta == 0`.
    pub c: *const c_void,
    /// D, `[m, n]` row-major.
    pub d: *mut c_void,
    /// Leading dimension of A (elements).
    pub lda: i64,
    /// Leading dimension of B.
    pub ldb: i64,
    /// Leading dimension of C.
    pub ldc: i64,
    /// Leading dimension of D.
    pub ldd: i64,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C.
    pub beta: f32,
}

/// `moefuse_grouped_gemm_args`: grouped GEMM over prefix-sum offsets, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseGroupedGemmArgs {
    /// Number of groups (experts).
    pub num_groups: i32,
    /// Rows the row-indexed buffers hold (ends are clamped to it).
    pub total_rows: i32,
    /// M-grouped: columns of D. K-grouped: columns of B and of each D_e.
    pub n: i32,
    /// M-grouped: inner dimension. K-grouped: columns of A, rows of each D_e.
    pub k: i32,
    /// M-grouped: `MOEFUSE_B_LAYOUT_*` of each W_e.
    pub b_layout: i32,
    /// Tile order: bits 0-1 raster (0 kernel default, 1 along M, 2 along N), bits 8-15
    /// max swizzle (0/1 none, 2, 4, 8).
    pub tile_order: i32,
    /// `[num_groups]` prefix-sum row ends, int32, device memory.
    pub offsets: *const i32,
    /// A, `[total_rows, k]` row-major.
    pub a: *const c_void,
    /// M-grouped: weights `[groups, n, k]` or `[groups, k, n]`; K-grouped: `[total_rows, n]`.
    pub b: *const c_void,
    /// M-grouped: `[total_rows, n]`; K-grouped: `[groups, k, n]`.
    pub d: *mut c_void,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of D's previous content.
    pub beta: f32,
    /// K-grouped contiguous variants only: B's row `r` is row `b_rows[r] / b_rows_div` of a
    /// `[b_source_rows, n]` B (bad indices read zeros); null: B is `[total_rows, n]`.
    pub b_rows: *const i32,
    /// Divisor of `b_rows` entries (>= 1 when `b_rows` is set).
    pub b_rows_div: i32,
    /// Rows of a gathered B (>= 1 when `b_rows` is set).
    pub b_source_rows: i32,
    /// Contiguous variants that gather A only: A's row `r` is row `a_rows[r] / a_rows_div`
    /// of a `[a_source_rows, k]` A (bad indices read zeros); null: A is `[total_rows, k]`.
    pub a_rows: *const i32,
    /// Divisor of `a_rows` entries (>= 1 when `a_rows` is set).
    pub a_rows_div: i32,
    /// Rows of a gathered A (>= 1 when `a_rows` is set).
    pub a_source_rows: i32,
}

/// A grouped variant's launcher.
pub type GroupedLaunchFn = unsafe extern "C" fn(
    *const MoefuseGroupedGemmArgs,
    *mut c_void,
    usize,
    *mut c_void,
) -> MoefuseStatus;
/// A grouped variant's workspace query.
pub type GroupedWorkspaceFn = unsafe extern "C" fn(*const MoefuseGroupedGemmArgs) -> usize;

/// A variant's launcher: `moefuse_<variant>(args, workspace, workspace_bytes, stream)`.
pub type GemmLaunchFn =
    unsafe extern "C" fn(*const MoefuseGemmArgs, *mut c_void, usize, *mut c_void) -> MoefuseStatus;
/// A variant's workspace query: `moefuse_<variant>_workspace(args)`.
pub type GemmWorkspaceFn = unsafe extern "C" fn(*const MoefuseGemmArgs) -> usize;

/// `MOEFUSE_ROUTER_SOFTMAX_TOPK`: softmax over all experts, then top-k.
pub const MOEFUSE_ROUTER_SOFTMAX_TOPK: i32 = 0;
/// `MOEFUSE_ROUTER_SIGMOID_GROUPED`: DeepSeek-V3's biased, group-limited sigmoid router.
pub const MOEFUSE_ROUTER_SIGMOID_GROUPED: i32 = 1;

/// `MOEFUSE_ACTIVATION_SWIGLU`
pub const MOEFUSE_ACTIVATION_SWIGLU: i32 = 0;
/// `MOEFUSE_ACTIVATION_GEGLU`
pub const MOEFUSE_ACTIVATION_GEGLU: i32 = 1;
/// `MOEFUSE_ACTIVATION_SWIGLU_OAI`
pub const MOEFUSE_ACTIVATION_SWIGLU_OAI: i32 = 2;
/// `MOEFUSE_ACTIVATION_BOUNDED_SWIGLU`
pub const MOEFUSE_ACTIVATION_BOUNDED_SWIGLU: i32 = 3;
/// `MOEFUSE_ACTIVATION_RELU2`
pub const MOEFUSE_ACTIVATION_RELU2: i32 = 4;

/// `MOEFUSE_GATE_UP_SPLIT`: gates in `[0, I)`, ups in `[I, 2I)`.
pub const MOEFUSE_GATE_UP_SPLIT: i32 = 0;
/// `MOEFUSE_GATE_UP_INTERLEAVED`: gate `j` at `2j`, up `j` at `2j + 1`.
pub const MOEFUSE_GATE_UP_INTERLEAVED: i32 = 1;

/// `moefuse_router_args`: router forward, logits to top-k ids and weights, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseRouterArgs {
    /// Tokens `T` (0: nothing is launched).
    pub tokens: i32,
    /// Experts `E`, `1..=512` ([`MAX_EXPERTS`](moefuse_spec::MAX_EXPERTS)).
    pub experts: i32,
    /// Experts per token `k`, `1..=min(16, E)` ([`MAX_TOP_K`](moefuse_spec::MAX_TOP_K)).
    pub top_k: i32,
    /// `MOEFUSE_ROUTER_*`.
    pub kind: i32,
    /// Sigmoid grouped: number of expert groups.
    pub n_group: i32,
    /// Sigmoid grouped: groups kept per token.
    pub topk_group: i32,
    /// 1: divide the chosen weights by their sum.
    pub renormalize: i32,
    /// Sigmoid grouped: final scale of the weights.
    pub routed_scaling_factor: f32,
    /// `[T, E]` fp32 logits.
    pub logits: *const f32,
    /// `[E]` fp32 selection bias or null (sigmoid grouped only).
    pub bias: *const f32,
    /// `[T, k]` int32 out.
    pub topk_ids: *mut i32,
    /// `[T, k]` fp32 out.
    pub topk_weights: *mut f32,
}

/// `moefuse_router_bwd_args`: `d_logits` from `d_topk_weights`, selection constant, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseRouterBwdArgs {
    /// Tokens `T` (0: nothing is launched).
    pub tokens: i32,
    /// Experts `E`.
    pub experts: i32,
    /// Experts per token `k`.
    pub top_k: i32,
    /// `MOEFUSE_ROUTER_*`.
    pub kind: i32,
    /// 1: the forward renormalised the chosen weights.
    pub renormalize: i32,
    /// Sigmoid grouped: final scale of the weights.
    pub routed_scaling_factor: f32,
    /// `[T, E]` fp32 logits of the forward.
    pub logits: *const f32,
    /// `[T, k]` int32 ids of the forward.
    pub topk_ids: *const i32,
    /// `[T, k]` fp32 upstream gradient.
    pub d_topk_weights: *const f32,
    /// `[T, E]` fp32 out, every element written.
    pub d_logits: *mut f32,
}

/// `moefuse_activation_routed_args`: the routed activation backward (abi.h): `d_h_pre`
/// from the unweighted `dh_u`, the slots' `d_weights` and the weighted `h_scaled`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseActivationRoutedArgs {
    /// `out = d_h_pre`, `dh = dh_u`.
    pub act: MoefuseActivationArgs,
    /// `tokens * top_k`.
    pub slots: i32,
    /// Slots per token (>= 1; `slots` is a multiple).
    pub top_k: i32,
    /// `[max_rows]` slot of each expert-major row.
    pub source_of: *const i32,
    /// `[slots]` routing weights.
    pub weights: *const f32,
    /// `[slots]` out.
    pub d_weights: *mut f32,
    /// `[max_rows, I]` bf16 out.
    pub h_scaled: *mut c_void,
    /// `[1]` error bits, or null.
    pub errors: *mut u32,
    /// `[1]` the permutation's tokens stamp (a mismatch writes nothing and raises
    /// `MOEFUSE_MOE_ERROR_STALE`), or null.
    pub expect_tokens: *const u32,
}

/// `moefuse_activation_args`: activation forward (`out = h`) or backward (`out = d_h_pre`)
/// over the expert-major intermediate, bf16, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseActivationArgs {
    /// `MOEFUSE_ACTIVATION_*`.
    pub activation: i32,
    /// `MOEFUSE_GATE_UP_*`.
    pub layout: i32,
    /// `I`.
    pub intermediate: i32,
    /// Rows the buffers hold; the row count is clamped to it.
    pub max_rows: i32,
    /// `SwiGluOai`'s sigmoid slope.
    pub alpha: f32,
    /// `SwiGluOai` / `BoundedSwiGlu` clamp.
    pub limit: f32,
    /// Device int32 row count, or null for `max_rows`.
    pub total_rows: *const i32,
    /// `[rows, W]` bf16.
    pub h_pre: *const c_void,
    /// Backward: `[rows, I]` bf16 upstream gradient; forward: unused.
    pub dh: *const c_void,
    /// Forward: `h [rows, I]`; backward: `d_h_pre [rows, W]`; bf16.
    pub out: *mut c_void,
}

/// `moefuse_permute_args`: routed (token, slot) pairs to expert-major rows, with the gather
/// of x fused, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefusePermuteArgs {
    /// Tokens.
    pub tokens: i32,
    /// Experts (<= 512, [`MAX_EXPERTS`](moefuse_spec::MAX_EXPERTS)).
    pub experts: i32,
    /// Slots per token (<= 16, [`MAX_TOP_K`](moefuse_spec::MAX_TOP_K)).
    pub top_k: i32,
    /// Row width of x (multiple of 8) when gathering.
    pub hidden: i32,
    /// `[tokens, top_k]`.
    pub topk_ids: *const i32,
    /// `[tokens, hidden]` bf16, or null.
    pub x: *const c_void,
    /// `[experts]`.
    pub counts: *mut i32,
    /// `[experts]` prefix-sum ends.
    pub offsets: *mut i32,
    /// `[tokens * top_k]`.
    pub row_of: *mut i32,
    /// `[tokens * top_k]`.
    pub source_of: *mut i32,
    /// `[tokens * top_k, hidden]` bf16, or null.
    pub x_perm: *mut c_void,
    /// `moefuse_moe_permute_workspace(tokens, experts)` bytes.
    pub workspace: *mut i32,
    /// `[2]`: error bits (`MOEFUSE_MOE_ERROR_*`) and the tokens stamp it writes, or null.
    pub flags: *mut u32,
}

/// `MOEFUSE_MOE_ERROR_EXPERT_ID`: permute met an expert id outside `0..experts`.
pub const MOEFUSE_MOE_ERROR_EXPERT_ID: u32 = 1;
/// `MOEFUSE_MOE_ERROR_DUPLICATE`: permute met a token naming one expert twice.
pub const MOEFUSE_MOE_ERROR_DUPLICATE: u32 = 2;
/// `MOEFUSE_MOE_ERROR_ROW`: combine met a `row_of` entry outside `-1..rows`.
pub const MOEFUSE_MOE_ERROR_ROW: u32 = 4;
/// `MOEFUSE_MOE_ERROR_STALE`: combine's (or the routed activation backward's) `*expect_tokens` differed from its token count.
pub const MOEFUSE_MOE_ERROR_STALE: u32 = 8;

/// `moefuse_combine_args`: `out[t] = Σ_j w[t, j] · y[row_of[t, j]]`, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseCombineArgs {
    /// Tokens.
    pub tokens: i32,
    /// Slots per token.
    pub top_k: i32,
    /// Row width (multiple of 8).
    pub hidden: i32,
    /// Rows `y` holds: `row_of` entries outside `-1..rows` are skipped and flagged.
    pub rows: i32,
    /// `[tokens * top_k]`.
    pub row_of: *const i32,
    /// `[tokens, top_k]`, or null for 1.
    pub weights: *const f32,
    /// `[rows, hidden]` bf16.
    pub y: *const c_void,
    /// `[tokens, hidden]` bf16.
    pub out: *mut c_void,
    /// `[1]` error bits (`MOEFUSE_MOE_ERROR_*`), or null.
    pub errors: *mut u32,
    /// `[1]` the permutation's tokens stamp, or null (no check).
    pub expect_tokens: *const i32,
}

/// `moefuse_combine_bwd_args`: `dy_perm` rows and `d_weights`, see abi.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseCombineBwdArgs {
    /// Tokens.
    pub tokens: i32,
    /// Slots per token.
    pub top_k: i32,
    /// Row width (multiple of 8).
    pub hidden: i32,
    /// Rows `y` and `dy_perm` both hold: `row_of` entries outside `-1..rows` are skipped
    /// and flagged.
    pub rows: i32,
    /// `[tokens * top_k]`.
    pub row_of: *const i32,
    /// `[tokens, top_k]`.
    pub weights: *const f32,
    /// `[tokens, hidden]` bf16.
    pub dy: *const c_void,
    /// `[rows, hidden]` bf16: the forward's expert outputs.
    pub y: *const c_void,
    /// `[rows, hidden]` bf16.
    pub dy_perm: *mut c_void,
    /// `[tokens, top_k]`.
    pub d_weights: *mut f32,
    /// `[1]` error bits (`MOEFUSE_MOE_ERROR_*`), or null.
    pub errors: *mut u32,
    /// `[1]` the permutation's tokens stamp, or null (no check).
    pub expect_tokens: *const i32,
}

/// `MOEFUSE_MOE_ERROR_SOURCE`: the fused gate_up met a `source_of` entry outside
/// `0..tokens * top_k` (it read token 0 instead).
pub const MOEFUSE_MOE_ERROR_SOURCE: u32 = 16;

/// `moefuse_gate_up_args` (moe_abi.h): the fused gate_up (gather, GEMM, activation).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseGateUpArgs {
    /// Tokens (rows of x).
    pub tokens: i32,
    /// Slots per token.
    pub top_k: i32,
    /// `D` (multiple of 8).
    pub hidden: i32,
    /// `I` (multiple of 8).
    pub intermediate: i32,
    /// Experts (groups).
    pub experts: i32,
    /// `MOEFUSE_ACTIVATION_*`.
    pub activation: i32,
    /// `MOEFUSE_GATE_UP_*`.
    pub layout: i32,
    /// 0 or the contiguous grouped GEMM's tile-order fields.
    pub tile_order: i32,
    /// `SwiGluOai`'s sigmoid slope.
    pub alpha: f32,
    /// The clamped activations' limit.
    pub limit: f32,
    /// `[experts]` prefix-sum ends.
    pub offsets: *const i32,
    /// `[tokens * top_k]`: `t * top_k + j` of each expert-major row.
    pub source_of: *const i32,
    /// `[tokens, hidden]` bf16.
    pub x: *const c_void,
    /// `[experts, W, hidden]` bf16.
    pub w: *const c_void,
    /// `[tokens * top_k, intermediate]` bf16 out.
    pub h: *mut c_void,
    /// `[tokens * top_k, W]` bf16 out, or null.
    pub h_pre: *mut c_void,
    /// `[1]` error bits (`MOEFUSE_MOE_ERROR_*`), or null.
    pub errors: *mut u32,
    /// 0 (rows of `x`), or the ranks whose x `source_of` names (`s * peer_rows + t`).
    pub peers: i32,
    /// Rows of each `peer_x[s]`.
    pub peer_rows: i32,
    /// `[peer_rows, hidden]` bf16 of each rank (addresses this device loads from); null past `peers`.
    pub peer_x: [*const c_void; MOEFUSE_GATE_UP_MAX_PEERS],
}

/// `moefuse_down_scatter_args` (moe_abi.h): the down GEMM storing each row at an address.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseDownScatterArgs {
    /// Expert-major rows (h's rows, row_dst's entries).
    pub rows: i32,
    /// Experts (groups).
    pub experts: i32,
    /// `D` (N, multiple of 8).
    pub hidden: i32,
    /// `I` (K, multiple of 8).
    pub intermediate: i32,
    /// 0 or the contiguous grouped GEMM's tile-order fields.
    pub tile_order: i32,
    /// `MOEFUSE_B_LAYOUT_*` of `w`.
    pub b_layout: i32,
    /// `[experts]` prefix-sum ends.
    pub offsets: *const i32,
    /// `[rows, intermediate]` bf16.
    pub h: *const c_void,
    /// `[experts, hidden, intermediate]` (NK) or `[experts, intermediate, hidden]` (KN) bf16.
    pub w: *const c_void,
    /// `[rows]` destination addresses of `hidden` bf16 each.
    pub row_dst: *const u64,
}

/// `MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK`: columns of `I` per partial of the fused down dgrad's
/// `d_topk_weights` (`partials` holds `ceil(I / 256)` per row).
pub const MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK: usize = 256;

/// `moefuse_down_dgrad_args` (moe_abi.h): the down dgrad with the routed activation
/// backward in its epilogue.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseDownDgradArgs {
    /// Tokens (rows of dy).
    pub tokens: i32,
    /// Slots per token.
    pub top_k: i32,
    /// `D` (K, multiple of 8).
    pub hidden: i32,
    /// `I` (N, multiple of 8).
    pub intermediate: i32,
    /// Experts (groups).
    pub experts: i32,
    /// `MOEFUSE_ACTIVATION_*`.
    pub activation: i32,
    /// `MOEFUSE_GATE_UP_*` of `h_pre` and `d_h_pre`.
    pub layout: i32,
    /// 0 or the contiguous grouped GEMM's tile-order fields.
    pub tile_order: i32,
    /// SwiGLU-OAI's alpha.
    pub alpha: f32,
    /// The clamped activations' limit.
    pub limit: f32,
    /// `[experts]` prefix-sum ends.
    pub offsets: *const i32,
    /// `[tokens * top_k]` slot of each row.
    pub source_of: *const i32,
    /// `[tokens * top_k]` routing weights.
    pub weights: *const f32,
    /// `[tokens, hidden]` bf16.
    pub dy: *const c_void,
    /// `[experts, hidden, intermediate]` bf16.
    pub w: *const c_void,
    /// `[tokens * top_k, W]` bf16.
    pub h_pre: *const c_void,
    /// `[tokens * top_k, W]` bf16 out.
    pub d_h_pre: *mut c_void,
    /// `[tokens * top_k, intermediate]` bf16 out.
    pub h_scaled: *mut c_void,
    /// `[tokens * top_k, ceil(intermediate / 256)]` fp32 scratch.
    pub partials: *mut f32,
    /// `[tokens * top_k]` out.
    pub d_weights: *mut f32,
    /// `[1]` error bits, or null.
    pub errors: *mut u32,
    /// `[1]` the permutation's tokens stamp, or null.
    pub expect_tokens: *const u32,
}

/// `MOEFUSE_GATE_UP_MAX_PEERS`: most ranks a fused gate_up reads rows from.
pub const MOEFUSE_GATE_UP_MAX_PEERS: usize = 8;

/// `moefuse_decode_args` (moe_abi.h): the small-batch forward's two kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseDecodeArgs {
    /// Tokens, `1..=MOEFUSE_DECODE_MAX_TOKENS`.
    pub tokens: i32,
    /// Slots per token.
    pub top_k: i32,
    /// `D` (multiple of 32).
    pub hidden: i32,
    /// `I` (multiple of 32).
    pub intermediate: i32,
    /// Experts.
    pub experts: i32,
    /// `MOEFUSE_ACTIVATION_*`.
    pub activation: i32,
    /// `MOEFUSE_GATE_UP_*`.
    pub layout: i32,
    /// `SwiGluOai`'s sigmoid slope.
    pub alpha: f32,
    /// The clamped activations' limit.
    pub limit: f32,
    /// `[tokens, top_k]` expert ids.
    pub topk_ids: *const i32,
    /// `[tokens, top_k]` routing weights.
    pub topk_weights: *const f32,
    /// `[tokens * top_k]` expert-major rows, or null.
    pub row_of: *const i32,
    /// `[tokens, hidden]` bf16.
    pub x: *const c_void,
    /// `[experts, W, hidden]` bf16.
    pub w_gate_up: *const c_void,
    /// `[experts, hidden, intermediate]` bf16.
    pub w_down: *const c_void,
    /// `[tokens * top_k, intermediate]` bf16 scratch.
    pub h: *mut c_void,
    /// `[tokens, hidden]` bf16 out.
    pub y: *mut c_void,
    /// `[tokens * top_k, W]` bf16 expert-major out, or null.
    pub h_pre_rows: *mut c_void,
    /// `[tokens * top_k, intermediate]` bf16 expert-major out, or null.
    pub h_rows: *mut c_void,
    /// `[tokens * top_k, hidden]` bf16 expert-major out, or null.
    pub y_e_rows: *mut c_void,
    /// `[1]` error bits, or null.
    pub errors: *mut u32,
    /// `[1]` word the kernels keep (zero before its first use): the gate_up's unit
    /// counter; or null (fixed shares).
    pub unit_counter: *mut u32,
}

/// `MOEFUSE_DECODE_MAX_TOKENS` (moe_abi.h).
pub const MOEFUSE_DECODE_MAX_TOKENS: usize = 64;
/// `MOEFUSE_DECODE_MAX_SLOTS` (moe_abi.h).
pub const MOEFUSE_DECODE_MAX_SLOTS: usize = 1024;

/// `moefuse_scatter_columns_args` (moe_abi.h): one value per row into a zeroed bf16 row.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseScatterColumnsArgs {
    /// Rows of `out`.
    pub rows: i32,
    /// Columns of `out`.
    pub width: i32,
    /// Elements between consecutive rows' column indices in `col_of`.
    pub col_stride: i32,
    /// 0.
    pub reserved: i32,
    /// `[1]` live rows, or null.
    pub count: *const i32,
    /// `[rows * col_stride]` column of each row.
    pub col_of: *const i32,
    /// `[rows]` fp32.
    pub values: *const f32,
    /// `[rows, width]` bf16.
    pub out: *mut c_void,
    /// `[1]` error bits, or null.
    pub errors: *mut u32,
}

/// `moefuse_columns_to_f32_args` (moe_abi.h): the first `cols` columns of bf16 rows as fp32.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MoefuseColumnsToF32Args {
    /// Rows.
    pub rows: i32,
    /// Columns of `in`.
    pub width: i32,
    /// Columns read and written.
    pub cols: i32,
    /// 0.
    pub reserved: i32,
    /// `[rows, width]` bf16.
    pub input: *const c_void,
    /// `[rows, cols]` fp32.
    pub out: *mut f32,
}

/// A MoE launcher (`moefuse_moe_<op>(args, stream)`), generic over its argument struct.
pub type MoeLaunchFn<A> = unsafe extern "C" fn(*const A, *mut c_void) -> MoefuseStatus;

#[cfg(moefuse_moe_linked)]
extern "C" {
    /// `moefuse_moe_router_fwd(args, stream)`
    pub fn moefuse_moe_router_fwd(
        args: *const MoefuseRouterArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_router_bwd(args, stream)`
    pub fn moefuse_moe_router_bwd(
        args: *const MoefuseRouterBwdArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_activation_fwd(args, stream)`
    pub fn moefuse_moe_activation_fwd(
        args: *const MoefuseActivationArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_activation_bwd(args, stream)`
    pub fn moefuse_moe_activation_bwd(
        args: *const MoefuseActivationArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_activation_bwd_routed(args, stream)`
    pub fn moefuse_moe_activation_bwd_routed(
        args: *const MoefuseActivationRoutedArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_scatter_columns(args, stream)`
    pub fn moefuse_moe_scatter_columns(
        args: *const MoefuseScatterColumnsArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_columns_to_f32(args, stream)`
    pub fn moefuse_moe_columns_to_f32(
        args: *const MoefuseColumnsToF32Args,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_decode_forward(args, stream)`
    pub fn moefuse_moe_decode_forward(
        args: *const MoefuseDecodeArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_gate_up_fused(args, stream)`
    pub fn moefuse_moe_gate_up_fused(
        args: *const MoefuseGateUpArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_down_scatter(args, stream)`
    pub fn moefuse_moe_down_scatter(
        args: *const MoefuseDownScatterArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_down_dgrad_fused(args, stream)`
    pub fn moefuse_moe_down_dgrad_fused(
        args: *const MoefuseDownDgradArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_permute(args, stream)`
    pub fn moefuse_moe_permute(
        args: *const MoefusePermuteArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_permute_workspace(tokens, experts)`: bytes.
    pub fn moefuse_moe_permute_workspace(tokens: i32, experts: i32) -> usize;
    /// `moefuse_moe_combine(args, stream)`
    pub fn moefuse_moe_combine(
        args: *const MoefuseCombineArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
    /// `moefuse_moe_combine_bwd(args, stream)`
    pub fn moefuse_moe_combine_bwd(
        args: *const MoefuseCombineBwdArgs,
        stream: *mut c_void,
    ) -> MoefuseStatus;
}

#[cfg(moefuse_kernels_linked)]
extern "C" {
    /// `moefuse_abi_version()`
    pub fn moefuse_abi_version() -> u32;
    /// `moefuse_last_error()`: thread-local, NUL-terminated, never null.
    pub fn moefuse_last_error() -> *const std::ffi::c_char;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn gemm_args_layout_matches_abi_h() {
        assert_eq!(size_of::<MoefuseGemmArgs>(), 88);
        assert_eq!(align_of::<MoefuseGemmArgs>(), 8);
        assert_eq!(offset_of!(MoefuseGemmArgs, b_layout), 12);
        assert_eq!(offset_of!(MoefuseGemmArgs, a), 16);
        assert_eq!(offset_of!(MoefuseGemmArgs, d), 40);
        assert_eq!(offset_of!(MoefuseGemmArgs, lda), 48);
        assert_eq!(offset_of!(MoefuseGemmArgs, ldd), 72);
        assert_eq!(offset_of!(MoefuseGemmArgs, alpha), 80);
        assert_eq!(offset_of!(MoefuseGemmArgs, beta), 84);
    }

    #[test]
    fn grouped_args_layout_matches_abi_h() {
        assert_eq!(size_of::<MoefuseGroupedGemmArgs>(), 96);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, a_rows), 80);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, a_source_rows), 92);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, b_rows), 64);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, b_source_rows), 76);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, offsets), 24);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, d), 48);
        assert_eq!(offset_of!(MoefuseGroupedGemmArgs, alpha), 56);
    }
    #[test]
    fn router_args_layout_matches_abi_h() {
        assert_eq!(size_of::<MoefuseRouterArgs>(), 64);
        assert_eq!(align_of::<MoefuseRouterArgs>(), 8);
        assert_eq!(offset_of!(MoefuseRouterArgs, renormalize), 24);
        assert_eq!(offset_of!(MoefuseRouterArgs, routed_scaling_factor), 28);
        assert_eq!(offset_of!(MoefuseRouterArgs, logits), 32);
        assert_eq!(offset_of!(MoefuseRouterArgs, bias), 40);
        assert_eq!(offset_of!(MoefuseRouterArgs, topk_ids), 48);
        assert_eq!(offset_of!(MoefuseRouterArgs, topk_weights), 56);
        assert_eq!(size_of::<MoefuseScatterColumnsArgs>(), 56);
        assert_eq!(offset_of!(MoefuseScatterColumnsArgs, count), 16);
        assert_eq!(offset_of!(MoefuseScatterColumnsArgs, errors), 48);
        assert_eq!(size_of::<MoefuseColumnsToF32Args>(), 32);
        assert_eq!(offset_of!(MoefuseColumnsToF32Args, input), 16);
        assert_eq!(size_of::<MoefuseDecodeArgs>(), 144);
        assert_eq!(offset_of!(MoefuseDecodeArgs, alpha), 28);
        assert_eq!(offset_of!(MoefuseDecodeArgs, topk_ids), 40);
        assert_eq!(offset_of!(MoefuseDecodeArgs, errors), 128);
        assert_eq!(offset_of!(MoefuseDecodeArgs, unit_counter), 136);
        assert_eq!(size_of::<MoefuseGateUpArgs>(), 168);
        assert_eq!(size_of::<MoefuseDownDgradArgs>(), 136);
        assert_eq!(offset_of!(MoefuseDownDgradArgs, offsets), 40);
        assert_eq!(offset_of!(MoefuseDownDgradArgs, partials), 104);
        assert_eq!(offset_of!(MoefuseDownDgradArgs, expect_tokens), 128);
        assert_eq!(size_of::<MoefuseDownScatterArgs>(), 56);
        assert_eq!(offset_of!(MoefuseDownScatterArgs, offsets), 24);
        assert_eq!(offset_of!(MoefuseDownScatterArgs, row_dst), 48);
        assert_eq!(offset_of!(MoefuseGateUpArgs, peer_x), 104);
        assert_eq!(offset_of!(MoefuseGateUpArgs, alpha), 32);
        assert_eq!(offset_of!(MoefuseGateUpArgs, offsets), 40);
        assert_eq!(offset_of!(MoefuseGateUpArgs, errors), 88);
        assert_eq!(size_of::<MoefuseRouterBwdArgs>(), 56);
        assert_eq!(offset_of!(MoefuseRouterBwdArgs, routed_scaling_factor), 20);
        assert_eq!(offset_of!(MoefuseRouterBwdArgs, logits), 24);
        assert_eq!(offset_of!(MoefuseRouterBwdArgs, topk_ids), 32);
        assert_eq!(offset_of!(MoefuseRouterBwdArgs, d_topk_weights), 40);
        assert_eq!(offset_of!(MoefuseRouterBwdArgs, d_logits), 48);
    }

    #[test]
    fn activation_args_layout_matches_abi_h() {
        assert_eq!(size_of::<MoefusePermuteArgs>(), 88);
        assert_eq!(offset_of!(MoefusePermuteArgs, topk_ids), 16);
        assert_eq!(offset_of!(MoefusePermuteArgs, flags), 80);
        assert_eq!(size_of::<MoefuseCombineArgs>(), 64);
        assert_eq!(offset_of!(MoefuseCombineArgs, rows), 12);
        assert_eq!(offset_of!(MoefuseCombineArgs, out), 40);
        assert_eq!(offset_of!(MoefuseCombineArgs, errors), 48);
        assert_eq!(offset_of!(MoefuseCombineArgs, expect_tokens), 56);
        assert_eq!(size_of::<MoefuseCombineBwdArgs>(), 80);
        assert_eq!(offset_of!(MoefuseCombineBwdArgs, rows), 12);
        assert_eq!(offset_of!(MoefuseCombineBwdArgs, d_weights), 56);
        assert_eq!(offset_of!(MoefuseCombineBwdArgs, errors), 64);
        assert_eq!(offset_of!(MoefuseCombineBwdArgs, expect_tokens), 72);
        assert_eq!(size_of::<MoefuseActivationArgs>(), 56);
        assert_eq!(offset_of!(MoefuseActivationArgs, alpha), 16);
        assert_eq!(offset_of!(MoefuseActivationArgs, limit), 20);
        assert_eq!(offset_of!(MoefuseActivationArgs, total_rows), 24);
        assert_eq!(offset_of!(MoefuseActivationArgs, h_pre), 32);
        assert_eq!(offset_of!(MoefuseActivationArgs, dh), 40);
        assert_eq!(offset_of!(MoefuseActivationArgs, out), 48);
        assert_eq!(size_of::<MoefuseActivationRoutedArgs>(), 112);
        assert_eq!(offset_of!(MoefuseActivationRoutedArgs, expect_tokens), 104);
        assert_eq!(offset_of!(MoefuseActivationRoutedArgs, slots), 56);
        assert_eq!(offset_of!(MoefuseActivationRoutedArgs, source_of), 64);
        assert_eq!(offset_of!(MoefuseActivationRoutedArgs, errors), 96);
    }
}
