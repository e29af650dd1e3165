//! The fused gate_up of the launch layer (moe_abi.h `moefuse_gate_up_args`): the token rows
//! of x gathered by the GEMM's producer (or read in order from an already gathered x), the
//! activation in its epilogue.

use super::{ActivationKind, GateUpLayout};
use crate::bind::{check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_spec::{MAX_EXPERTS, MAX_TOP_K};

/// TMA rows and 16-byte stores: every bf16 matrix starts 16-byte aligned.
const ROW_ALIGN: u64 = 16;

/// `h[r] = act(x[source_of[r] / top_k] · W_eᵀ)` for the expert-major rows `r` of each expert
/// `e` (rows `offsets[e-1]..offsets[e]`), and `h_pre[r]` (the pre-activation) when given:
/// the permutation's gather, the gate_up GEMM and the activation in one kernel. Without
/// `source_of`, `x` is `[tokens * top_k, hidden]` already in expert-major order (the unfused
/// path's `x_perm`) and row `r` reads row `r`: only the activation is fused. Hopper only
/// (`sm_90a`); elsewhere it returns [`KernelError::Launch`] with
/// [`Status::ArchMismatch`](crate::Status::ArchMismatch), and the caller runs the unfused
/// stages. `hidden` and `intermediate` are multiples of 8.
///
/// ```no_run
/// # use moefuse_kernels::{ActivationKind, GateUpFused, GateUpLayout, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (t, k, d, i, e) = (16, 2, 128, 64, 4);
/// let (x, w) = (stream.alloc_zeros::<bf16>(t * d)?, stream.alloc_zeros::<bf16>(e * 2 * i * d)?);
/// let (offsets, source_of) = (stream.alloc_zeros::<i32>(e)?, stream.alloc_zeros::<i32>(t * k)?);
/// let mut h = stream.alloc_zeros::<bf16>(t * k * i)?;
/// kernels.launch(&stream, GateUpFused { tokens: t, top_k: k, hidden: d, intermediate: i,
///     experts: e, kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split, tile_order: 0,
///     offsets: &offsets, source_of: Some(&source_of), x: &x, w: &w, h: &mut h, h_pre: None,
///     errors: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GateUpFused<'a> {
    /// Tokens (rows of x).
    pub tokens: usize,
    /// Slots per token, `1..=`[`MAX_TOP_K`].
    pub top_k: usize,
    /// `D`, a multiple of 8.
    pub hidden: usize,
    /// `I`, a multiple of 8.
    pub intermediate: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`].
    pub experts: usize,
    /// The activation.
    pub kind: ActivationKind,
    /// Gate/up rows of `W_e` (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// 0 (default), or the contiguous grouped GEMM's raster, band and interleave fields.
    pub tile_order: u32,
    /// `[experts]` prefix-sum ends (device data, clamped by the kernel).
    pub offsets: &'a dyn DevicePtr<i32>,
    /// `[tokens * top_k]`: `t * top_k + j` of each row (device data, checked by the kernel),
    /// or `None`: `x` holds the routed rows in order.
    pub source_of: Option<&'a dyn DevicePtr<i32>>,
    /// `[tokens, hidden]`, or `[tokens * top_k, hidden]` without `source_of`.
    pub x: &'a dyn DevicePtr<bf16>,
    /// `[experts, W, hidden]`, `W = 2I` gated, `I` for `Relu2`.
    pub w: &'a dyn DevicePtr<bf16>,
    /// `[tokens * top_k, intermediate]` out.
    pub h: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens * top_k, W]` out (the backward's input), or `None`.
    pub h_pre: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[1]` error bits (`ffi::MOEFUSE_MOE_ERROR_SOURCE`), or `None`.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a> GateUpFused<'a> {
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
        check_range(kernel, "hidden", d as i128, 8, i32::MAX as i128)?;
        check_range(kernel, "intermediate", i as i128, 8, 1 << 28)?;
        check_multiple(kernel, "hidden", d, 8)?;
        check_multiple(kernel, "intermediate", i, 8)?;
        let tk = extent(kernel, "tokens * top_k", &[t, k])?;
        check_range(kernel, "tokens * top_k", tk as i128, 0, i32::MAX as i128)?;
        let width = if self.kind.is_gated() { 2 * i } else { i };
        let (activation, alpha, limit) = self.kind.raw(kernel)?;
        let tile_order = i32::try_from(self.tile_order)
            .ok()
            .filter(|o| o & !0x100_ff03 == 0 && o & 3 != 3)
            .ok_or_else(|| KernelError::Inconsistent {
                kernel: kernel.clone(),
                why: "tile_order: raster 0-2, band bits 8-15, interleave bit 24",
            })?;
        let offsets = b.read("offsets", self.offsets, e, 4)?;
        let x_rows = if self.source_of.is_some() { t } else { tk };
        let source_of = b.read_opt("source_of", self.source_of, tk, 4)?;
        let x = b.read("x", self.x, extent(kernel, "x", &[x_rows, d])?, ROW_ALIGN)?;
        let w = b.read("w", self.w, extent(kernel, "w", &[e, width, d])?, ROW_ALIGN)?;
        let h = b.write("h", self.h, extent(kernel, "h", &[tk, i])?, ROW_ALIGN)?;
        let h_pre = b.write_opt(
            "h_pre",
            self.h_pre,
            extent(kernel, "h_pre", &[tk, width])?,
            ROW_ALIGN,
        )?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::GateUpFused(ffi::MoefuseGateUpArgs {
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
            x: x as *const _,
            w: w as *const _,
            h: h as *mut _,
            h_pre: h_pre as *mut _,
            errors: errors as *mut u32,
        })))
    }
}
