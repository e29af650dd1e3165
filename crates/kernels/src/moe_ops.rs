//! The MoE operations of the launch layer that are not GEMMs (router, activation, permute,
//! combine; `cuda/moe/*.cu`, abi.h and moe_abi.h), each checked as its C header states.
//! The router and the activation live here, the permutation and the combines in `permute`.

use crate::bind::{check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use moefuse_spec::{MAX_EXPERTS, MAX_TOP_K};

/// The routed-row problem both fused MoE GEMMs (gate_up, down dgrad) take: `experts` and
/// `top_k` in range, `hidden` and `intermediate` multiples of 8 (`I` at most 2^28), `T·k`
/// an `i32`. Returns `T·k`.
fn check_routed_gemm(
    kernel: &str,
    (t, k, d, i, e): (usize, usize, usize, usize, usize),
) -> Result<usize, KernelError> {
    check_range(kernel, "experts", e as i128, 1, MAX_EXPERTS as i128)?;
    check_range(kernel, "top_k", k as i128, 1, MAX_TOP_K as i128)?;
    check_range(kernel, "hidden", d as i128, 8, i32::MAX as i128)?;
    check_range(kernel, "intermediate", i as i128, 8, 1 << 28)?;
    check_multiple(kernel, "hidden", d, 8)?;
    check_multiple(kernel, "intermediate", i, 8)?;
    let tk = extent(kernel, "tokens * top_k", &[t, k])?;
    check_range(kernel, "tokens * top_k", tk as i128, 0, i32::MAX as i128)?;
    Ok(tk)
}

/// A contiguous GEMM's tile-order word (raster 0-2 in bits 0-1) using only the bits of
/// `fields`; `why` names them in the error.
fn tile_order_word(
    kernel: &str,
    word: u32,
    fields: i32,
    why: &'static str,
) -> Result<i32, KernelError> {
    i32::try_from(word)
        .ok()
        .filter(|o| o & !fields == 0 && o & 3 != 3)
        .ok_or_else(|| KernelError::Inconsistent {
            kernel: kernel.to_string(),
            why,
        })
}

mod columns;
mod decode;
mod down_dgrad;
mod down_scatter;
mod gate_up;
mod permute;
pub use columns::{ColumnsToF32, ScatterColumns};
pub use decode::{DecodeForward, DECODE_DIM_MULTIPLE};
pub use down_dgrad::{DownDgradFused, DOWN_DGRAD_COLUMN_BLOCK};
pub use down_scatter::{DownScatter, ScatterRows, ScatterWeights};
pub use gate_up::{GateUpFused, GateUpRows, PeerRows};
pub use permute::{CombineBackward, CombineForward, GatherRows, Permute};

/// How the router scores experts (abi.h `moefuse_router_kind`).
///
/// ```
/// let s = moefuse_kernels::RouterScoring::SigmoidGrouped { n_group: 8, topk_group: 4,
///     routed_scaling_factor: 2.5 };
/// assert_ne!(s, moefuse_kernels::RouterScoring::Softmax);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterScoring {
    /// Softmax over all experts, then top-k.
    Softmax,
    /// DeepSeek-V3's biased, group-limited sigmoid router.
    SigmoidGrouped {
        /// Expert groups (divides the experts, >= 2 experts each).
        n_group: usize,
        /// Groups kept per token, `1..=n_group`.
        topk_group: usize,
        /// Final scale of the weights.
        routed_scaling_factor: f32,
    },
}

impl RouterScoring {
    fn raw(
        &self,
        kernel: &str,
        experts: usize,
        top_k: usize,
    ) -> Result<(i32, i32, i32, f32), KernelError> {
        match *self {
            RouterScoring::Softmax => Ok((ffi::MOEFUSE_ROUTER_SOFTMAX_TOPK, 0, 0, 1.0)),
            RouterScoring::SigmoidGrouped {
                n_group,
                topk_group,
                routed_scaling_factor,
            } => {
                check_range(kernel, "n_group", n_group as i128, 1, (experts / 2) as i128)?;
                check_multiple(kernel, "experts (by n_group)", experts, n_group)?;
                check_range(kernel, "topk_group", topk_group as i128, 1, n_group as i128)?;
                let reachable = topk_group * (experts / n_group);
                check_range(
                    kernel,
                    "top_k (topk_group * experts / n_group)",
                    top_k as i128,
                    1,
                    reachable as i128,
                )?;
                Ok((
                    ffi::MOEFUSE_ROUTER_SIGMOID_GROUPED,
                    n_group as i32,
                    topk_group as i32,
                    routed_scaling_factor,
                ))
            }
        }
    }
}

fn check_routing(
    kernel: &str,
    tokens: usize,
    experts: usize,
    top_k: usize,
) -> Result<(), KernelError> {
    check_range(kernel, "experts", experts as i128, 1, MAX_EXPERTS as i128)?;
    check_range(
        kernel,
        "top_k",
        top_k as i128,
        1,
        experts.min(MAX_TOP_K) as i128,
    )?;
    check_range(
        kernel,
        "tokens * experts",
        tokens as i128 * experts as i128,
        0,
        i32::MAX as i128,
    )
}

/// Router forward: logits `[tokens, experts]` to `topk_ids`/`topk_weights` `[tokens, top_k]`.
///
/// ```no_run
/// # use moefuse_kernels::{Kernels, RouterForward, RouterScoring};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let logits = stream.alloc_zeros::<f32>(4 * 8)?;
/// let (mut ids, mut w) = (stream.alloc_zeros::<i32>(4 * 2)?, stream.alloc_zeros::<f32>(4 * 2)?);
/// kernels.launch(&stream, RouterForward { tokens: 4, experts: 8, top_k: 2,
///     scoring: RouterScoring::Softmax, renormalize: false, logits: &logits, bias: None,
///     topk_ids: &mut ids, topk_weights: &mut w })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct RouterForward<'a> {
    /// Tokens (0: nothing is launched).
    pub tokens: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`] (512).
    pub experts: usize,
    /// Experts per token, `1..=min(`[`MAX_TOP_K`]` (16), experts)`.
    pub top_k: usize,
    /// Scoring.
    pub scoring: RouterScoring,
    /// Divide the chosen weights by their sum.
    pub renormalize: bool,
    /// `[tokens, experts]` fp32.
    pub logits: &'a dyn DevicePtr<f32>,
    /// `[experts]` selection bias (sigmoid grouped only).
    pub bias: Option<&'a dyn DevicePtr<f32>>,
    /// `[tokens, top_k]` out.
    pub topk_ids: &'a mut dyn DevicePtrMut<i32>,
    /// `[tokens, top_k]` out.
    pub topk_weights: &'a mut dyn DevicePtrMut<f32>,
}

impl<'a> RouterForward<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, e, k) = (self.tokens, self.experts, self.top_k);
        check_routing(kernel, t, e, k)?;
        let (kind, n_group, topk_group, scale) = self.scoring.raw(kernel, e, k)?;
        if self.bias.is_some() && self.scoring == RouterScoring::Softmax {
            return Err(KernelError::Inconsistent {
                kernel: kernel.clone(),
                why: "a selection bias is for the sigmoid grouped router only",
            });
        }
        let tk = extent(kernel, "tokens * top_k", &[t, k])?;
        let logits = b.read("logits", self.logits, extent(kernel, "logits", &[t, e])?, 4)?;
        let bias = b.read_opt("bias", self.bias, e, 4)?;
        let ids = b.write("topk_ids", self.topk_ids, tk, 4)?;
        let weights = b.write("topk_weights", self.topk_weights, tk, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::RouterForward(ffi::MoefuseRouterArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            experts: to_i32(kernel, "experts", e)?,
            top_k: to_i32(kernel, "top_k", k)?,
            kind,
            n_group,
            topk_group,
            renormalize: i32::from(self.renormalize),
            routed_scaling_factor: scale,
            logits: logits as *const f32,
            bias: bias as *const f32,
            topk_ids: ids as *mut i32,
            topk_weights: weights as *mut f32,
        })))
    }
}

/// Router backward: `d_logits [tokens, experts]` from `d_topk_weights [tokens, top_k]`.
///
/// ```no_run
/// # use moefuse_kernels::{Kernels, RouterBackward, RouterScoring};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let logits = stream.alloc_zeros::<f32>(4 * 8)?;
/// let ids = stream.alloc_zeros::<i32>(4 * 2)?;
/// let dw = stream.alloc_zeros::<f32>(4 * 2)?;
/// let mut dl = stream.alloc_zeros::<f32>(4 * 8)?;
/// kernels.launch(&stream, RouterBackward { tokens: 4, experts: 8, top_k: 2,
///     scoring: RouterScoring::Softmax, renormalize: false, logits: &logits, topk_ids: &ids,
///     d_topk_weights: &dw, d_logits: &mut dl })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct RouterBackward<'a> {
    /// Tokens (0: nothing is launched).
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The forward's scoring.
    pub scoring: RouterScoring,
    /// The forward renormalised.
    pub renormalize: bool,
    /// `[tokens, experts]` logits of the forward.
    pub logits: &'a dyn DevicePtr<f32>,
    /// `[tokens, top_k]` ids of the forward.
    pub topk_ids: &'a dyn DevicePtr<i32>,
    /// `[tokens, top_k]` upstream gradient.
    pub d_topk_weights: &'a dyn DevicePtr<f32>,
    /// `[tokens, experts]` out.
    pub d_logits: &'a mut dyn DevicePtrMut<f32>,
}

impl<'a> RouterBackward<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, e, k) = (self.tokens, self.experts, self.top_k);
        check_routing(kernel, t, e, k)?;
        let (kind, _, _, scale) = self.scoring.raw(kernel, e, k)?;
        let te = extent(kernel, "logits", &[t, e])?;
        let tk = extent(kernel, "tokens * top_k", &[t, k])?;
        let logits = b.read("logits", self.logits, te, 4)?;
        let ids = b.read("topk_ids", self.topk_ids, tk, 4)?;
        let dw = b.read("d_topk_weights", self.d_topk_weights, tk, 4)?;
        let dl = b.write("d_logits", self.d_logits, te, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::RouterBackward(ffi::MoefuseRouterBwdArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            experts: to_i32(kernel, "experts", e)?,
            top_k: to_i32(kernel, "top_k", k)?,
            kind,
            renormalize: i32::from(self.renormalize),
            routed_scaling_factor: scale,
            logits: logits as *const f32,
            topk_ids: ids as *const i32,
            d_topk_weights: dw as *const f32,
            d_logits: dl as *mut f32,
        })))
    }
}

/// The expert MLP's activation (abi.h `moefuse_activation`).
///
/// ```
/// assert!(moefuse_kernels::ActivationKind::SwiGlu.is_gated());
/// assert!(!moefuse_kernels::ActivationKind::Relu2.is_gated());
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActivationKind {
    /// `silu(g) u`.
    SwiGlu,
    /// `gelu_tanh(g) u`.
    GeGlu,
    /// gpt-oss: `g' sigmoid(alpha g') (u' + 1)`, clamped at `limit`.
    SwiGluOai {
        /// Sigmoid slope.
        alpha: f32,
        /// Clamp (> 0).
        limit: f32,
    },
    /// `silu(g') u'`, clamped at `limit`.
    BoundedSwiGlu {
        /// Clamp (> 0).
        limit: f32,
    },
    /// `relu(x)^2`, not gated.
    Relu2,
}

impl ActivationKind {
    /// Whether the input row holds gate and up halves (width `2I`).
    pub fn is_gated(&self) -> bool {
        !matches!(self, ActivationKind::Relu2)
    }

    /// abi.h's `(activation, alpha, limit)`; the clamped activations need `limit > 0`.
    pub(crate) fn raw(&self, kernel: &str) -> Result<(i32, f32, f32), KernelError> {
        let (raw, alpha, limit) = match *self {
            ActivationKind::SwiGlu => (ffi::MOEFUSE_ACTIVATION_SWIGLU, 0.0, 0.0),
            ActivationKind::GeGlu => (ffi::MOEFUSE_ACTIVATION_GEGLU, 0.0, 0.0),
            ActivationKind::SwiGluOai { alpha, limit } => {
                (ffi::MOEFUSE_ACTIVATION_SWIGLU_OAI, alpha, limit)
            }
            ActivationKind::BoundedSwiGlu { limit } => {
                (ffi::MOEFUSE_ACTIVATION_BOUNDED_SWIGLU, 0.0, limit)
            }
            ActivationKind::Relu2 => (ffi::MOEFUSE_ACTIVATION_RELU2, 0.0, 0.0),
        };
        let clamped = matches!(
            self,
            ActivationKind::SwiGluOai { .. } | ActivationKind::BoundedSwiGlu { .. }
        );
        if clamped && limit.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(KernelError::Inconsistent {
                kernel: kernel.to_string(),
                why: "the clamped activations need limit > 0",
            });
        }
        Ok((raw, alpha, limit))
    }
}

impl GateUpLayout {
    pub(crate) fn raw(self) -> i32 {
        match self {
            GateUpLayout::Split => ffi::MOEFUSE_GATE_UP_SPLIT,
            GateUpLayout::Interleaved => ffi::MOEFUSE_GATE_UP_INTERLEAVED,
        }
    }
}

/// Where gate and up sit in a gated row (abi.h `moefuse_gate_up_layout`).
///
/// ```
/// assert_ne!(moefuse_kernels::GateUpLayout::Split, moefuse_kernels::GateUpLayout::Interleaved);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUpLayout {
    /// Gates in `[0, I)`, ups in `[I, 2I)`.
    Split,
    /// Gate `j` at `2j`, up `j` at `2j + 1`.
    Interleaved,
}

/// Activation forward (`out = h [rows, I]` from `h_pre [rows, W]`) or, with `backward`, its
/// backward (`out = d_h_pre [rows, W]` from `dh [rows, I]` and `h_pre`); `W = 2I` when gated.
///
/// ```no_run
/// # use moefuse_kernels::{Activation, ActivationKind, GateUpLayout, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let h_pre = stream.alloc_zeros::<bf16>(16 * 128)?;
/// let mut h = stream.alloc_zeros::<bf16>(16 * 64)?;
/// kernels.launch(&stream, Activation { kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split,
///     intermediate: 64, max_rows: 16, total_rows: None, h_pre: &h_pre, backward: None, out: &mut h })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Activation<'a> {
    /// The function.
    pub kind: ActivationKind,
    /// Gate/up placement (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// `I >= 1`.
    pub intermediate: usize,
    /// Rows the buffers hold (0: nothing is launched).
    pub max_rows: usize,
    /// `[1]` device row count (clamped to `max_rows` by the kernel), or all `max_rows`.
    pub total_rows: Option<&'a dyn DevicePtr<i32>>,
    /// `[max_rows, W]`.
    pub h_pre: &'a dyn DevicePtr<bf16>,
    /// Backward: `dh [max_rows, I]`; `None` for the forward.
    pub backward: Option<&'a dyn DevicePtr<bf16>>,
    /// Forward `[max_rows, I]`, backward `[max_rows, W]`.
    pub out: &'a mut dyn DevicePtrMut<bf16>,
}

impl<'a> Activation<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (i, rows) = (self.intermediate, self.max_rows);
        check_range(kernel, "intermediate", i as i128, 1, i32::MAX as i128)?;
        let shape = ActivationShape::new(kernel, self.kind, i, rows)?;
        let total = b.read_opt("total_rows", self.total_rows, 1, 4)?;
        let h_pre = b.read("h_pre", self.h_pre, shape.wide, 2)?;
        let backward = self.backward.is_some();
        let dh = b.read_opt("dh", self.backward, shape.narrow, 2)?;
        let out_len = if backward { shape.wide } else { shape.narrow };
        let out = b.write("out", self.out, out_len, 2)?;
        if rows == 0 {
            return Ok(None);
        }
        let args = shape.args(kernel, self.layout, [total, h_pre, dh, out])?;
        Ok(Some(if backward {
            Call::ActivationBackward(args)
        } else {
            Call::ActivationForward(args)
        }))
    }
}

/// What both activation ops check and derive from the activation, `I` and the row count:
/// the kernel's activation code and parameters, the wide (`[rows, W]`) and narrow
/// (`[rows, I]`) buffer lengths.
struct ActivationShape {
    raw: i32,
    alpha: f32,
    limit: f32,
    intermediate: usize,
    rows: usize,
    wide: usize,
    narrow: usize,
}

impl ActivationShape {
    fn new(
        kernel: &str,
        kind: ActivationKind,
        intermediate: usize,
        rows: usize,
    ) -> Result<Self, KernelError> {
        let width = if kind.is_gated() {
            2 * intermediate
        } else {
            intermediate
        };
        check_range(kernel, "row width", width as i128, 1, i32::MAX as i128)?;
        let (raw, alpha, limit) = kind.raw(kernel)?;
        Ok(ActivationShape {
            raw,
            alpha,
            limit,
            intermediate,
            rows,
            wide: extent(kernel, "rows * W", &[rows, width])?,
            narrow: extent(kernel, "rows * I", &[rows, intermediate])?,
        })
    }

    /// The kernel arguments, from the bound addresses `[total_rows, h_pre, dh, out]`.
    fn args(
        &self,
        kernel: &str,
        layout: GateUpLayout,
        [total, h_pre, dh, out]: [u64; 4],
    ) -> Result<ffi::MoefuseActivationArgs, KernelError> {
        Ok(ffi::MoefuseActivationArgs {
            activation: self.raw,
            layout: layout.raw(),
            intermediate: to_i32(kernel, "intermediate", self.intermediate)?,
            max_rows: to_i32(kernel, "max_rows", self.rows)?,
            alpha: self.alpha,
            limit: self.limit,
            total_rows: total as *const i32,
            h_pre: h_pre as *const _,
            dh: dh as *const _,
            out: out as *mut _,
        })
    }
}

/// The routed activation backward (abi.h `moefuse_activation_routed_args`): from the
/// unweighted `dh_u` and `h_pre`, `d_h_pre` of `w · dh_u`, each slot's
/// `d_weights = <dh_u, h>` and `h_scaled = w · h` (the down wgrad's operand), with `h`
/// recomputed as the forward stored it. `intermediate` is a multiple of 8.
///
/// ```no_run
/// # use moefuse_kernels::{ActivationBackwardRouted, ActivationKind, GateUpLayout, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (rows, i) = (8, 64);
/// let (h_pre, dh) = (stream.alloc_zeros::<bf16>(rows * 2 * i)?, stream.alloc_zeros::<bf16>(rows * i)?);
/// let source_of = stream.clone_htod(&[0i32, 1, 2, 3, 4, 5, 6, 7])?;
/// let weights = stream.alloc_zeros::<f32>(rows)?;
/// let (mut d_h_pre, mut h_scaled) = (stream.alloc_zeros::<bf16>(rows * 2 * i)?, stream.alloc_zeros::<bf16>(rows * i)?);
/// let mut dw = stream.alloc_zeros::<f32>(rows)?;
/// kernels.launch(&stream, ActivationBackwardRouted { kind: ActivationKind::SwiGlu,
///     layout: GateUpLayout::Split, intermediate: i, max_rows: rows, total_rows: None,
///     h_pre: &h_pre, dh_u: &dh, source_of: &source_of, top_k: 2, weights: &weights,
///     d_h_pre: &mut d_h_pre, d_weights: &mut dw, h_scaled: &mut h_scaled, errors: None,
///     expect_tokens: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ActivationBackwardRouted<'a> {
    /// The function.
    pub kind: ActivationKind,
    /// Gate/up placement (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// `I`, a multiple of 8.
    pub intermediate: usize,
    /// Rows the buffers hold (0: nothing is launched).
    pub max_rows: usize,
    /// `[1]` device row count (clamped to `max_rows`), or all `max_rows`.
    pub total_rows: Option<&'a dyn DevicePtr<i32>>,
    /// `[max_rows, W]`.
    pub h_pre: &'a dyn DevicePtr<bf16>,
    /// `[max_rows, I]`: the unweighted `dy · D_e` of each row.
    pub dh_u: &'a dyn DevicePtr<bf16>,
    /// `[max_rows]` slot (`t * top_k + j`) of each row; its length is also the slot count.
    pub source_of: &'a dyn DevicePtr<i32>,
    /// Slots per token (`slots`, the length of `weights`, is a multiple of it).
    pub top_k: usize,
    /// `[slots]` routing weights.
    pub weights: &'a dyn DevicePtr<f32>,
    /// `[max_rows, W]` out.
    pub d_h_pre: &'a mut dyn DevicePtrMut<bf16>,
    /// `[slots]` out.
    pub d_weights: &'a mut dyn DevicePtrMut<f32>,
    /// `[max_rows, I]` out.
    pub h_scaled: &'a mut dyn DevicePtrMut<bf16>,
    /// `[1]` error bits, or none.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` the permutation's tokens stamp: when it is not `slots / top_k` (the rows are
    /// another call's) nothing is written and the stale bit is raised; or no check.
    pub expect_tokens: Option<&'a dyn DevicePtr<u32>>,
}

impl<'a> ActivationBackwardRouted<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (i, rows) = (self.intermediate, self.max_rows);
        check_range(kernel, "intermediate", i as i128, 8, i32::MAX as i128)?;
        check_multiple(kernel, "intermediate", i, 8)?;
        let shape = ActivationShape::new(kernel, self.kind, i, rows)?;
        let (wide, narrow) = (shape.wide, shape.narrow);
        let total = b.read_opt("total_rows", self.total_rows, 1, 4)?;
        let h_pre = b.read("h_pre", self.h_pre, wide, 16)?;
        let dh = b.read("dh_u", self.dh_u, narrow, 16)?;
        let source_of = b.read("source_of", self.source_of, rows, 4)?;
        let slots = self.weights.len();
        check_range(kernel, "slots", slots as i128, 0, i32::MAX as i128)?;
        check_range(kernel, "top_k", self.top_k as i128, 1, i32::MAX as i128)?;
        check_multiple(kernel, "slots", slots, self.top_k)?;
        let weights = b.read("weights", self.weights, slots, 4)?;
        let d_h_pre = b.write("d_h_pre", self.d_h_pre, wide, 16)?;
        let d_weights = b.write("d_weights", self.d_weights, slots, 4)?;
        let h_scaled = b.write("h_scaled", self.h_scaled, narrow, 16)?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let expect = b.read_opt("expect_tokens", self.expect_tokens, 1, 4)?;
        if rows == 0 {
            return Ok(None);
        }
        Ok(Some(Call::ActivationBackwardRouted(
            ffi::MoefuseActivationRoutedArgs {
                act: shape.args(kernel, self.layout, [total, h_pre, dh, d_h_pre])?,
                slots: to_i32(kernel, "slots", slots)?,
                top_k: to_i32(kernel, "top_k", self.top_k)?,
                source_of: source_of as *const i32,
                weights: weights as *const f32,
                d_weights: d_weights as *mut f32,
                h_scaled: h_scaled as *mut _,
                errors: errors as *mut u32,
                expect_tokens: expect as *const u32,
            },
        )))
    }
}

#[cfg(test)]
mod tests;
