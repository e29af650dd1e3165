//! The permutation and the combines of the launch layer (moe_abi.h): expert-major rows,
//! the fused gather of x, and the weighted sums back to tokens with their backward.

use crate::bind::{check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, moe_permute_workspace, KernelError};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_spec::{MAX_EXPERTS, MAX_TOP_K};

/// bf16 rows of `hidden % 8 == 0` elements move as 16-byte vectors.
const ROW_ALIGN: u64 = 16;

/// Permutation with the gather of x fused (moe_abi.h `moefuse_permute_args`). Launches even
/// for 0 tokens (it writes zero counts and offsets).
///
/// ```no_run
/// # use moefuse_kernels::{Kernels, Permute};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (t, e, k) = (4, 8, 2);
/// let ids = stream.alloc_zeros::<i32>(t * k)?;
/// let (mut counts, mut offsets) = (stream.alloc_zeros::<i32>(e)?, stream.alloc_zeros::<i32>(e)?);
/// let mut row_of = stream.alloc_zeros::<i32>(t * k)?;
/// let mut source_of = stream.alloc_zeros::<i32>(t * k)?;
/// let mut ws = stream.alloc_zeros::<i32>(moefuse_kernels::moe_permute_workspace(t, e) / 4)?;
/// kernels.launch(&stream, Permute { tokens: t, experts: e, top_k: k, hidden: 0, topk_ids: &ids,
///     x: None, counts: &mut counts, offsets: &mut offsets, row_of: &mut row_of,
///     source_of: &mut source_of, x_perm: None, workspace: &mut ws, flags: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Permute<'a> {
    /// Tokens.
    pub tokens: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`] (512).
    pub experts: usize,
    /// Slots per token, `1..=`[`MAX_TOP_K`] (16).
    pub top_k: usize,
    /// Row width of x (multiple of 8) when gathering; else ignored.
    pub hidden: usize,
    /// `[tokens, top_k]`.
    pub topk_ids: &'a dyn DevicePtr<i32>,
    /// `[tokens, hidden]`, with `x_perm`.
    pub x: Option<&'a dyn DevicePtr<bf16>>,
    /// `[experts]` out.
    pub counts: &'a mut dyn DevicePtrMut<i32>,
    /// `[experts]` prefix-sum ends out.
    pub offsets: &'a mut dyn DevicePtrMut<i32>,
    /// `[tokens * top_k]` out: each slot's expert-major row (-1: dropped).
    pub row_of: &'a mut dyn DevicePtrMut<i32>,
    /// `[tokens * top_k]` out.
    pub source_of: &'a mut dyn DevicePtrMut<i32>,
    /// `[tokens * top_k, hidden]` out, with `x`.
    pub x_perm: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// [`moe_permute_workspace`]`(tokens, experts)` bytes as int32.
    pub workspace: &'a mut dyn DevicePtrMut<i32>,
    /// `[2]` out: error bits (`ffi::MOEFUSE_MOE_ERROR_*`) and the tokens stamp combine checks.
    pub flags: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a> Permute<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, e, k) = (self.tokens, self.experts, self.top_k);
        check_range(kernel, "experts", e as i128, 1, MAX_EXPERTS as i128)?;
        check_range(kernel, "top_k", k as i128, 1, MAX_TOP_K as i128)?;
        let tk = extent(kernel, "tokens * top_k", &[t, k])?;
        check_range(kernel, "tokens * top_k", tk as i128, 0, i32::MAX as i128)?;
        if self.x.is_some() != self.x_perm.is_some() {
            return Err(KernelError::Inconsistent {
                kernel: kernel.clone(),
                why: "x and x_perm go together (the gather needs both)",
            });
        }
        let gather = self.x.is_some();
        let hidden = if gather { self.hidden } else { 0 };
        if gather {
            check_range(kernel, "hidden", hidden as i128, 1, i32::MAX as i128)?;
            check_multiple(kernel, "hidden", hidden, 8)?;
        }
        let ids = b.read("topk_ids", self.topk_ids, tk, 4)?;
        let x = b.read_opt("x", self.x, extent(kernel, "x", &[t, hidden])?, ROW_ALIGN)?;
        let counts = b.write("counts", self.counts, e, 4)?;
        let offsets = b.write("offsets", self.offsets, e, 4)?;
        let row_of = b.write("row_of", self.row_of, tk, 4)?;
        let source_of = b.write("source_of", self.source_of, tk, 4)?;
        let x_perm = b.write_opt(
            "x_perm",
            self.x_perm,
            extent(kernel, "x_perm", &[tk, hidden])?,
            ROW_ALIGN,
        )?;
        let ws = b.write(
            "workspace",
            self.workspace,
            moe_permute_workspace(t, e).div_ceil(4),
            4,
        )?;
        let flags = b.write_opt("flags", self.flags, 2, 4)?;
        Ok(Some(Call::Permute(ffi::MoefusePermuteArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            experts: to_i32(kernel, "experts", e)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", hidden)?,
            topk_ids: ids as *const i32,
            x: x as *const _,
            counts: counts as *mut i32,
            offsets: offsets as *mut i32,
            row_of: row_of as *mut i32,
            source_of: source_of as *mut i32,
            x_perm: x_perm as *mut _,
            workspace: ws as *mut i32,
            flags: flags as *mut u32,
        })))
    }
}

fn check_combine(
    kernel: &str,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    rows: usize,
) -> Result<(usize, usize), KernelError> {
    check_range(kernel, "top_k", top_k as i128, 1, MAX_TOP_K as i128)?;
    check_range(kernel, "hidden", hidden as i128, 1, i32::MAX as i128)?;
    check_multiple(kernel, "hidden", hidden, 8)?;
    check_range(kernel, "rows", rows as i128, 0, i32::MAX as i128)?;
    let tk = extent(kernel, "tokens * top_k", &[tokens, top_k])?;
    check_range(kernel, "tokens * top_k", tk as i128, 0, i32::MAX as i128)?;
    Ok((tk, extent(kernel, "rows * hidden", &[rows, hidden])?))
}

/// Combine: `out[t] = Σ_j w[t, j] · y[row_of[t, j]]` (moe_abi.h). `row_of` is device data
/// the kernel does not trust: entries outside `-1..rows` are skipped (and flagged in
/// `errors`), so `y` needs only its `rows` rows.
///
/// ```no_run
/// # use moefuse_kernels::{CombineForward, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let row_of = stream.alloc_zeros::<i32>(4 * 2)?;
/// let y = stream.alloc_zeros::<bf16>(8 * 64)?;
/// let mut out = stream.alloc_zeros::<bf16>(4 * 64)?;
/// // The permutation's flags: error bits, then its tokens stamp (two views of one buffer).
/// let mut flags = stream.alloc_zeros::<u32>(2)?;
/// let (mut bits, stamp) = flags.split_at_mut(1);
/// kernels.launch(&stream, CombineForward { tokens: 4, top_k: 2, hidden: 64, rows: 8,
///     row_of: &row_of, weights: None, y: &y, out: &mut out, errors: Some(&mut bits),
///     expect_tokens: Some(&stamp) })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CombineForward<'a> {
    /// Tokens (0: nothing is launched).
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Row width (multiple of 8).
    pub hidden: usize,
    /// Rows `y` holds.
    pub rows: usize,
    /// `[tokens * top_k]` expert-major rows (the permutation's).
    pub row_of: &'a dyn DevicePtr<i32>,
    /// `[tokens, top_k]`, or 1.
    pub weights: Option<&'a dyn DevicePtr<f32>>,
    /// `[rows, hidden]`.
    pub y: &'a dyn DevicePtr<bf16>,
    /// `[tokens, hidden]` out.
    pub out: &'a mut dyn DevicePtrMut<bf16>,
    /// `[1]` error bits (`ffi::MOEFUSE_MOE_ERROR_*`), or none.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` the permutation's tokens stamp (its `flags[1]`, e.g. the view
    /// `flags.split_at_mut(1).1` next to `errors`; the kernel reads it as `int32_t`, and a
    /// stamp is a token count, `<= i32::MAX`), or no check.
    pub expect_tokens: Option<&'a dyn DevicePtr<u32>>,
}

impl<'a> CombineForward<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, h) = (self.tokens, self.top_k, self.hidden);
        let (tk, rows) = check_combine(kernel, t, k, h, self.rows)?;
        let row_of = b.read("row_of", self.row_of, tk, 4)?;
        let weights = b.read_opt("weights", self.weights, tk, 4)?;
        let y = b.read("y", self.y, rows, ROW_ALIGN)?;
        let out = b.write("out", self.out, extent(kernel, "out", &[t, h])?, ROW_ALIGN)?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let expect = b.read_opt("expect_tokens", self.expect_tokens, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::Combine(ffi::MoefuseCombineArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", h)?,
            rows: to_i32(kernel, "rows", self.rows)?,
            row_of: row_of as *const i32,
            weights: weights as *const f32,
            y: y as *const _,
            out: out as *mut _,
            errors: errors as *mut u32,
            expect_tokens: expect as *const i32,
        })))
    }
}

/// Combine backward: `dy_perm` rows and `d_weights` (moe_abi.h); `y` and `dy_perm` hold
/// `rows` rows, and `row_of` is untrusted as for [`CombineForward`].
///
/// ```no_run
/// # use moefuse_kernels::{CombineBackward, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let row_of = stream.alloc_zeros::<i32>(8)?;
/// let (w, dy, y) = (stream.alloc_zeros::<f32>(8)?, stream.alloc_zeros::<bf16>(4 * 64)?, stream.alloc_zeros::<bf16>(8 * 64)?);
/// let (mut dy_perm, mut dw) = (stream.alloc_zeros::<bf16>(8 * 64)?, stream.alloc_zeros::<f32>(8)?);
/// kernels.launch(&stream, CombineBackward { tokens: 4, top_k: 2, hidden: 64, rows: 8,
///     row_of: &row_of, weights: &w, dy: &dy, y: &y, dy_perm: &mut dy_perm, d_weights: &mut dw,
///     errors: None, expect_tokens: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CombineBackward<'a> {
    /// Tokens (0: nothing is launched).
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Row width (multiple of 8).
    pub hidden: usize,
    /// Rows `y` and `dy_perm` hold.
    pub rows: usize,
    /// `[tokens * top_k]` expert-major rows (the permutation's).
    pub row_of: &'a dyn DevicePtr<i32>,
    /// `[tokens, top_k]`.
    pub weights: &'a dyn DevicePtr<f32>,
    /// `[tokens, hidden]`.
    pub dy: &'a dyn DevicePtr<bf16>,
    /// `[rows, hidden]`: the forward's expert outputs.
    pub y: &'a dyn DevicePtr<bf16>,
    /// `[rows, hidden]` out.
    pub dy_perm: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens, top_k]` out.
    pub d_weights: &'a mut dyn DevicePtrMut<f32>,
    /// `[1]` error bits, or none.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` the permutation's tokens stamp (as for [`CombineForward`]), or no check.
    pub expect_tokens: Option<&'a dyn DevicePtr<u32>>,
}

impl<'a> CombineBackward<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, h) = (self.tokens, self.top_k, self.hidden);
        let (tk, rows) = check_combine(kernel, t, k, h, self.rows)?;
        let row_of = b.read("row_of", self.row_of, tk, 4)?;
        let weights = b.read("weights", self.weights, tk, 4)?;
        let dy = b.read("dy", self.dy, extent(kernel, "dy", &[t, h])?, ROW_ALIGN)?;
        let y = b.read("y", self.y, rows, ROW_ALIGN)?;
        let dy_perm = b.write("dy_perm", self.dy_perm, rows, ROW_ALIGN)?;
        let dw = b.write("d_weights", self.d_weights, tk, 4)?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let expect = b.read_opt("expect_tokens", self.expect_tokens, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::CombineBackward(ffi::MoefuseCombineBwdArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", h)?,
            rows: to_i32(kernel, "rows", self.rows)?,
            row_of: row_of as *const i32,
            weights: weights as *const f32,
            dy: dy as *const _,
            y: y as *const _,
            dy_perm: dy_perm as *mut _,
            d_weights: dw as *mut f32,
            errors: errors as *mut u32,
            expect_tokens: expect as *const i32,
        })))
    }
}

/// Rows of a token-major matrix copied to their expert-major places: `dst[row_of[t * top_k +
/// j]] = src[t]` for every slot whose row is in `0..rows` (`moefuse_moe_combine_bwd` in
/// gather mode: no weights, no dot products). The backward uses it for the unweighted
/// `dy_perm` and to regather `x_perm` from `x`. Untrusted `row_of` as for
/// [`CombineBackward`].
///
/// ```no_run
/// # use moefuse_kernels::{GatherRows, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let row_of = stream.clone_htod(&[0i32, 1, 2, 3, 4, 5, 6, 7])?;
/// let src = stream.alloc_zeros::<bf16>(4 * 64)?;
/// let mut dst = stream.alloc_zeros::<bf16>(8 * 64)?;
/// kernels.launch(&stream, GatherRows { tokens: 4, top_k: 2, hidden: 64, rows: 8,
///     row_of: &row_of, src: &src, dst: &mut dst, errors: None, expect_tokens: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GatherRows<'a> {
    /// Tokens (0: nothing is launched).
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Row width (multiple of 8).
    pub hidden: usize,
    /// Rows `dst` holds.
    pub rows: usize,
    /// `[tokens * top_k]` expert-major rows (the permutation's).
    pub row_of: &'a dyn DevicePtr<i32>,
    /// `[tokens, hidden]`.
    pub src: &'a dyn DevicePtr<bf16>,
    /// `[rows, hidden]` out.
    pub dst: &'a mut dyn DevicePtrMut<bf16>,
    /// `[1]` error bits, or none.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
    /// `[1]` the permutation's tokens stamp, or no check.
    pub expect_tokens: Option<&'a dyn DevicePtr<u32>>,
}

impl<'a> GatherRows<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, h) = (self.tokens, self.top_k, self.hidden);
        let (tk, rows) = check_combine(kernel, t, k, h, self.rows)?;
        let row_of = b.read("row_of", self.row_of, tk, 4)?;
        let src = b.read("src", self.src, extent(kernel, "src", &[t, h])?, ROW_ALIGN)?;
        let dst = b.write("dst", self.dst, rows, ROW_ALIGN)?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        let expect = b.read_opt("expect_tokens", self.expect_tokens, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::CombineBackward(ffi::MoefuseCombineBwdArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", h)?,
            rows: to_i32(kernel, "rows", self.rows)?,
            row_of: row_of as *const i32,
            weights: std::ptr::null(),
            dy: src as *const _,
            y: std::ptr::null(),
            dy_perm: dst as *mut _,
            d_weights: std::ptr::null_mut(),
            errors: errors as *mut u32,
            expect_tokens: expect as *const i32,
        })))
    }
}
