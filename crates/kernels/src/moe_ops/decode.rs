//! The small-batch (decode) forward of the launch layer (moe_abi.h `moefuse_decode_args`):
//! routing table, gate_up + activation, down + weighted combine in two kernels that stream
//! each touched expert's weights once.

use super::{ActivationKind, GateUpLayout};
use crate::bind::{check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_spec::{MAX_EXPERTS, MAX_TOP_K};

/// 16-byte vector loads and stores of every bf16 row.
const ROW_ALIGN: u64 = 16;
/// K elements per MMA step of a lane group: `hidden` and `intermediate` are multiples.
pub const DECODE_DIM_MULTIPLE: usize = 32;

/// `y[t] = Σ_j w[t,j] · bf16(act(x[t] · W_eᵀ) · D_eᵀ)` for `tokens ≤ 64` (`e = topk_ids[t,j]`),
/// in two kernels that read each touched expert's weights once: the whole MoE forward
/// after routing. `h` is its slot-major scratch `[tokens·top_k, I]`. With `row_of` (the
/// permutation's expert-major row of each slot), the expert-major copies a backward reads
/// are written too (`h_pre_rows`, `h_rows`, `y_e_rows`, each when given). Ids outside
/// `0..experts` drop their slot and raise `ffi::MOEFUSE_MOE_ERROR_EXPERT_ID` in `errors`.
/// Runs on every arch the MoE kernels are built for (`mma.sync`).
///
/// ```no_run
/// # use moefuse_kernels::{ActivationKind, DecodeForward, GateUpLayout, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (t, k, d, i, e) = (1, 2, 128, 64, 4);
/// let x = stream.alloc_zeros::<bf16>(t * d)?;
/// let (gate_up, down) = (stream.alloc_zeros::<bf16>(e * 2 * i * d)?, stream.alloc_zeros::<bf16>(e * d * i)?);
/// let (ids, w) = (stream.clone_htod(&[0i32, 3])?, stream.clone_htod(&[0.5f32, 0.5])?);
/// let (mut h, mut y) = (stream.alloc_zeros::<bf16>(t * k * i)?, stream.alloc_zeros::<bf16>(t * d)?);
/// kernels.launch(&stream, DecodeForward { tokens: t, top_k: k, hidden: d, intermediate: i,
///     experts: e, kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split,
///     topk_ids: &ids, topk_weights: &w, x: &x, w_gate_up: &gate_up, w_down: &down,
///     h: &mut h, y: &mut y, row_of: None, h_pre_rows: None, h_rows: None, y_e_rows: None,
///     errors: None, unit_counter: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DecodeForward<'a> {
    /// Tokens, `1..=64` (`ffi::MOEFUSE_DECODE_MAX_TOKENS`).
    pub tokens: usize,
    /// Slots per token; `tokens · top_k ≤ 1024`.
    pub top_k: usize,
    /// `D`, a multiple of 32.
    pub hidden: usize,
    /// `I`, a multiple of 32.
    pub intermediate: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`].
    pub experts: usize,
    /// The activation.
    pub kind: ActivationKind,
    /// Gate/up rows of `W_e` (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// `[tokens, top_k]` expert ids (device data, checked by the kernels).
    pub topk_ids: &'a dyn DevicePtr<i32>,
    /// `[tokens, top_k]` routing weights.
    pub topk_weights: &'a dyn DevicePtr<f32>,
    /// `[tokens, hidden]`.
    pub x: &'a dyn DevicePtr<bf16>,
    /// `[experts, W, hidden]`, `W = 2I` gated, `I` for `Relu2`.
    pub w_gate_up: &'a dyn DevicePtr<bf16>,
    /// `[experts, hidden, intermediate]`.
    pub w_down: &'a dyn DevicePtr<bf16>,
    /// `[tokens · top_k, intermediate]` scratch.
    pub h: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens, hidden]` out.
    pub y: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens · top_k]` expert-major row of each slot; needed by the three `*_rows`.
    pub row_of: Option<&'a dyn DevicePtr<i32>>,
    /// `[tokens · top_k, W]` expert-major pre-activation out.
    pub h_pre_rows: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[tokens · top_k, I]` expert-major activation out.
    pub h_rows: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[tokens · top_k, hidden]` expert-major unweighted expert outputs.
    pub y_e_rows: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[1]` error bits, or `None`.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` word, zero before its first use, that the kernels keep (one stream at a
    /// time): the gate_up kernel's blocks take their units from it, so that the faster ones
    /// take more, and the down kernel zeroes it again; or `None`: fixed shares. The same
    /// sums in the same order either way, so the same bits.
    pub unit_counter: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a> DecodeForward<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, d, i, e) = (
            self.tokens,
            self.top_k,
            self.hidden,
            self.intermediate,
            self.experts,
        );
        check_range(kernel, "experts", e as i128, 1, MAX_EXPERTS as i128)?;
        check_range(kernel, "top_k", k as i128, 1, MAX_TOP_K as i128)?;
        check_range(
            kernel,
            "tokens",
            t as i128,
            1,
            ffi::MOEFUSE_DECODE_MAX_TOKENS as i128,
        )?;
        let m = DECODE_DIM_MULTIPLE;
        check_range(kernel, "hidden", d as i128, m as i128, 1 << 20)?;
        check_range(kernel, "intermediate", i as i128, m as i128, 1 << 20)?;
        check_multiple(kernel, "hidden", d, m)?;
        check_multiple(kernel, "intermediate", i, m)?;
        let tk = extent(kernel, "tokens * top_k", &[t, k])?;
        check_range(
            kernel,
            "tokens * top_k",
            tk as i128,
            1,
            ffi::MOEFUSE_DECODE_MAX_SLOTS as i128,
        )?;
        if self.row_of.is_none()
            && (self.h_pre_rows.is_some() || self.h_rows.is_some() || self.y_e_rows.is_some())
        {
            return Err(KernelError::Inconsistent {
                kernel: kernel.clone(),
                why: "the expert-major outputs need row_of",
            });
        }
        let width = if self.kind.is_gated() { 2 * i } else { i };
        let (activation, alpha, limit) = self.kind.raw(kernel)?;
        let topk_ids = b.read("topk_ids", self.topk_ids, tk, 4)?;
        let topk_weights = b.read("topk_weights", self.topk_weights, tk, 4)?;
        let x = b.read("x", self.x, extent(kernel, "x", &[t, d])?, ROW_ALIGN)?;
        let w_gate_up = b.read(
            "w_gate_up",
            self.w_gate_up,
            extent(kernel, "w_gate_up", &[e, width, d])?,
            ROW_ALIGN,
        )?;
        let w_down = b.read(
            "w_down",
            self.w_down,
            extent(kernel, "w_down", &[e, d, i])?,
            ROW_ALIGN,
        )?;
        let h = b.write("h", self.h, extent(kernel, "h", &[tk, i])?, ROW_ALIGN)?;
        let y = b.write("y", self.y, extent(kernel, "y", &[t, d])?, ROW_ALIGN)?;
        let row_of = b.read_opt("row_of", self.row_of, tk, 4)?;
        let h_pre_rows = b.write_opt(
            "h_pre_rows",
            self.h_pre_rows,
            extent(kernel, "h_pre_rows", &[tk, width])?,
            ROW_ALIGN,
        )?;
        let h_rows = b.write_opt(
            "h_rows",
            self.h_rows,
            extent(kernel, "h_rows", &[tk, i])?,
            ROW_ALIGN,
        )?;
        let y_e_rows = b.write_opt(
            "y_e_rows",
            self.y_e_rows,
            extent(kernel, "y_e_rows", &[tk, d])?,
            ROW_ALIGN,
        )?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let unit_counter = b.write_opt("unit_counter", self.unit_counter, 1, 4)?;
        Ok(Some(Call::DecodeForward(ffi::MoefuseDecodeArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", d)?,
            intermediate: to_i32(kernel, "intermediate", i)?,
            experts: to_i32(kernel, "experts", e)?,
            activation,
            layout: self.layout.raw(),
            alpha,
            limit,
            topk_ids: topk_ids as *const i32,
            topk_weights: topk_weights as *const f32,
            row_of: row_of as *const i32,
            x: x as *const _,
            w_gate_up: w_gate_up as *const _,
            w_down: w_down as *const _,
            h: h as *mut _,
            y: y as *mut _,
            h_pre_rows: h_pre_rows as *mut _,
            h_rows: h_rows as *mut _,
            y_e_rows: y_e_rows as *mut _,
            errors: errors as *mut u32,
            unit_counter: unit_counter as *mut u32,
        })))
    }
}
