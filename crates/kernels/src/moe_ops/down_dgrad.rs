//! The down dgrad with the routed activation backward in its epilogue (moe_abi.h
//! `moefuse_down_dgrad_args`): dy's token rows gathered by the GEMM's producer, and the
//! epilogue turning each tile of `dh_u = dy · D_e` into `d_h_pre`, `h_scaled` and the
//! partials of `d_topk_weights`, so `dh_u` never reaches memory.

use super::{check_routed_gemm, tile_order_word, ActivationKind, GateUpLayout};
use crate::bind::{extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

/// TMA rows and 16-byte stores: every bf16 matrix starts 16-byte aligned.
const ROW_ALIGN: u64 = 16;

/// Columns of `I` per partial of `d_topk_weights` (the kernel's tile width):
/// [`DownDgradFused::partials`] holds `ceil(I / DOWN_DGRAD_COLUMN_BLOCK)` fp32 per row.
///
/// ```
/// assert_eq!(768usize.div_ceil(moefuse_kernels::DOWN_DGRAD_COLUMN_BLOCK), 3);
/// ```
pub const DOWN_DGRAD_COLUMN_BLOCK: usize = ffi::MOEFUSE_DOWN_DGRAD_COLUMN_BLOCK;

/// For the expert-major rows `r` of each expert `e` (rows `offsets[e-1]..offsets[e]`) with
/// slot `s = source_of[r]` and routing weight `w = weights[s]`: `dh_u = dy[s / top_k] · D_e`
/// (bf16, never stored), then the routed activation backward of
/// [`ActivationBackwardRouted`](crate::ActivationBackwardRouted) on it: `d_h_pre` of
/// `w · dh_u`, `h_scaled = w · h` and `d_weights[s] = ⟨dh_u, h⟩` (fp32, per 256-column block
/// into `partials`, then the blocks in order). The caller zeroes `d_weights` (slots no row
/// names keep what is there). Hopper only (`sm_90a`); elsewhere it returns
/// [`KernelError::Launch`] with [`Status::ArchMismatch`](crate::Status::ArchMismatch) and the
/// caller runs the GEMM and the routed activation backward apart. `hidden` and
/// `intermediate` are multiples of 8.
///
/// ```no_run
/// # use moefuse_kernels::{ActivationKind, DownDgradFused, GateUpLayout, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (t, k, d, i, e) = (16, 2, 128, 64, 4);
/// let (dy, w) = (stream.alloc_zeros::<bf16>(t * d)?, stream.alloc_zeros::<bf16>(e * d * i)?);
/// let (offsets, source_of) = (stream.alloc_zeros::<i32>(e)?, stream.alloc_zeros::<i32>(t * k)?);
/// let weights = stream.alloc_zeros::<f32>(t * k)?;
/// let h_pre = stream.alloc_zeros::<bf16>(t * k * 2 * i)?;
/// let mut d_h_pre = stream.alloc_zeros::<bf16>(t * k * 2 * i)?;
/// let mut h_scaled = stream.alloc_zeros::<bf16>(t * k * i)?;
/// let mut partials = stream.alloc_zeros::<f32>(t * k)?;
/// let mut d_weights = stream.alloc_zeros::<f32>(t * k)?;
/// kernels.launch(&stream, DownDgradFused { tokens: t, top_k: k, hidden: d, intermediate: i,
///     experts: e, kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split, tile_order: 0,
///     offsets: &offsets, source_of: &source_of, weights: &weights, dy: &dy, w: &w,
///     h_pre: &h_pre, d_h_pre: &mut d_h_pre, h_scaled: &mut h_scaled,
///     partials: &mut partials, d_weights: &mut d_weights, errors: None, expect_tokens: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DownDgradFused<'a> {
    /// Tokens (rows of dy).
    pub tokens: usize,
    /// Slots per token, `1..=`[`MAX_TOP_K`](moefuse_spec::MAX_TOP_K).
    pub top_k: usize,
    /// `D`, a multiple of 8.
    pub hidden: usize,
    /// `I`, a multiple of 8.
    pub intermediate: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`](moefuse_spec::MAX_EXPERTS).
    pub experts: usize,
    /// The activation of the forward.
    pub kind: ActivationKind,
    /// Gate/up placement of `h_pre` and `d_h_pre` (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// 0 (default), or the contiguous grouped GEMM's raster, band, prefetch and interleave
    /// fields.
    pub tile_order: u32,
    /// `[experts]` prefix-sum ends (device data, clamped by the kernel).
    pub offsets: &'a dyn DevicePtr<i32>,
    /// `[tokens * top_k]`: `t * top_k + j` of each row.
    pub source_of: &'a dyn DevicePtr<i32>,
    /// `[tokens * top_k]` routing weights by slot.
    pub weights: &'a dyn DevicePtr<f32>,
    /// `[tokens, hidden]`.
    pub dy: &'a dyn DevicePtr<bf16>,
    /// `[experts, hidden, intermediate]`: the forward's down weights.
    pub w: &'a dyn DevicePtr<bf16>,
    /// `[tokens * top_k, W]`, `W = 2I` gated, `I` for `Relu2`.
    pub h_pre: &'a dyn DevicePtr<bf16>,
    /// `[tokens * top_k, W]` out.
    pub d_h_pre: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens * top_k, intermediate]` out.
    pub h_scaled: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens * top_k, ceil(intermediate / DOWN_DGRAD_COLUMN_BLOCK)]` scratch.
    pub partials: &'a mut dyn DevicePtrMut<f32>,
    /// `[tokens * top_k]` out.
    pub d_weights: &'a mut dyn DevicePtrMut<f32>,
    /// `[1]` error bits (`MOEFUSE_MOE_ERROR_SOURCE`, `_STALE`), or `None`.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` the permutation's tokens stamp: when it is not `tokens`, `d_weights` is not
    /// written and the stale bit is raised; or no check.
    pub expect_tokens: Option<&'a dyn DevicePtr<u32>>,
}

impl<'a> DownDgradFused<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, d, i, e) = (
            self.tokens,
            self.top_k,
            self.hidden,
            self.intermediate,
            self.experts,
        );
        let tk = check_routed_gemm(kernel, (t, k, d, i, e))?;
        let width = if self.kind.is_gated() { 2 * i } else { i };
        let (activation, alpha, limit) = self.kind.raw(kernel)?;
        let tile_order = tile_order_word(
            kernel,
            self.tile_order,
            0x1ff_ff03,
            "tile_order: raster 0-2, band bits 8-15, prefetch bits 16-23, interleave bit 24",
        )?;
        let blocks = i.div_ceil(DOWN_DGRAD_COLUMN_BLOCK);
        let offsets = b.read("offsets", self.offsets, e, 4)?;
        let source_of = b.read("source_of", self.source_of, tk, 4)?;
        let weights = b.read("weights", self.weights, tk, 4)?;
        let dy = b.read("dy", self.dy, extent(kernel, "dy", &[t, d])?, ROW_ALIGN)?;
        let w = b.read("w", self.w, extent(kernel, "w", &[e, d, i])?, ROW_ALIGN)?;
        let h_pre = b.read(
            "h_pre",
            self.h_pre,
            extent(kernel, "h_pre", &[tk, width])?,
            ROW_ALIGN,
        )?;
        let wide = extent(kernel, "d_h_pre", &[tk, width])?;
        let d_h_pre = b.write("d_h_pre", self.d_h_pre, wide, ROW_ALIGN)?;
        let narrow = extent(kernel, "h_scaled", &[tk, i])?;
        let h_scaled = b.write("h_scaled", self.h_scaled, narrow, ROW_ALIGN)?;
        let partials_len = extent(kernel, "partials", &[tk, blocks])?;
        let partials = b.write("partials", self.partials, partials_len, 4)?;
        let d_weights = b.write("d_weights", self.d_weights, tk, 4)?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let expect = b.read_opt("expect_tokens", self.expect_tokens, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::DownDgradFused(ffi::MoefuseDownDgradArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", d)?,
            intermediate: to_i32(kernel, "intermediate", i)?,
            experts: to_i32(kernel, "experts", e)?,
            activation,
            layout: self.layout.raw(),
            tile_order,
            alpha,
            limit,
            offsets: offsets as *const i32,
            source_of: source_of as *const i32,
            weights: weights as *const f32,
            dy: dy as *const _,
            w: w as *const _,
            h_pre: h_pre as *const _,
            d_h_pre: d_h_pre as *mut _,
            h_scaled: h_scaled as *mut _,
            partials: partials as *mut f32,
            d_weights: d_weights as *mut f32,
            errors: errors as *mut u32,
            expect_tokens: expect as *const u32,
        })))
    }
}
