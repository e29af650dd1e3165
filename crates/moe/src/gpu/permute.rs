//! Token permutation into expert-major rows (with the gather of `x` fused), the weighted
//! combine back to tokens, and the combine's backward, as
//! [`reference::permutation`](crate::reference::permutation) and the reference layer define
//! them: rows grouped by expert ascending, stable in token order within an expert.

use super::{check_buffer, check_max, elems, prepare_device, to_i32, DeviceErrors};
use crate::{MoeError, MAX_EXPERTS, MAX_TOP_K};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{ffi, MoeArgs};
use std::ffi::c_void;
use std::sync::Arc;

/// Outputs and scratch of [`permute`], sized once for `max_tokens × top_k` rows.
///
/// The buffers are private, so their lengths are the ones [`PermuteBuffers::new`] chose;
/// [`permute`] still checks every length and device again on each call. Read them through
/// the accessors:
///
/// ```no_run
/// use moefuse::gpu::{permute, PermuteBuffers};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let ids = s.clone_htod(&[1i32, 0, 1, 2])?;               // 2 tokens, top-2
/// let mut bufs = PermuteBuffers::new(&s, 2, 4, 2)?;
/// permute::<cudarc::driver::CudaSlice<half::bf16>>(&s, 2, 4, 2, 64, &ids, None, &mut bufs, None)?;
/// assert_eq!(s.clone_dtoh(bufs.offsets())?, vec![1, 3, 4, 4]);
/// assert_eq!(s.clone_dtoh(bufs.row_of())?, vec![1, 0, 2, 3]);
/// bufs.errors_mut().take()?; // no id out of range, no duplicate
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// A buffer cannot be swapped for one of another length:
///
/// ```compile_fail
/// # let ctx = cudarc::driver::CudaContext::new(0).unwrap();
/// # let s = ctx.default_stream();
/// let mut bufs = moefuse::gpu::PermuteBuffers::new(&s, 2, 4, 2).unwrap();
/// bufs.row_of = s.alloc_zeros::<i32>(1).unwrap();
/// ```
pub struct PermuteBuffers {
    /// `[E]` rows per expert.
    pub(super) counts: CudaSlice<i32>,
    /// `[E]` prefix-sum ends (the grouped GEMM's offsets).
    pub(super) offsets: CudaSlice<i32>,
    /// `[T, k]` expert-major row of each (token, slot); -1 for an id outside `0..E`.
    pub(super) row_of: CudaSlice<i32>,
    /// `[T·k]` `token·k + slot` of each row.
    pub(super) source_of: CudaSlice<i32>,
    /// The permutation's error bits and its tokens stamp.
    pub(super) errors: DeviceErrors,
    workspace: CudaSlice<i32>,
    max_tokens: usize,
    experts: usize,
    top_k: usize,
}

impl PermuteBuffers {
    /// Buffers for up to `max_tokens` tokens over `experts` experts (`1..=512`) with
    /// `top_k` slots (`1..=16`); `max_tokens · top_k` rows must fit the kernels' int32.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 4096, 128, 8)?;
    /// assert_eq!(bufs.max_tokens(), 4096);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(
        stream: &Arc<CudaStream>,
        max_tokens: usize,
        experts: usize,
        top_k: usize,
    ) -> Result<Self, MoeError> {
        let (rows, ws_words) = Self::sizes(max_tokens, experts, top_k)?;
        Ok(PermuteBuffers {
            counts: stream.alloc_zeros(experts)?,
            offsets: stream.alloc_zeros(experts)?,
            row_of: stream.alloc_zeros(rows.max(1))?,
            source_of: stream.alloc_zeros(rows.max(1))?,
            errors: DeviceErrors::new(stream)?,
            workspace: stream.alloc_zeros(ws_words)?,
            max_tokens,
            experts,
            top_k,
        })
    }

    /// `(rows, workspace int32 words)` for a shape, checked: experts in `1..=512`, top_k in
    /// `1..=16`, `max_tokens · top_k <= i32::MAX`.
    fn sizes(max_tokens: usize, experts: usize, top_k: usize) -> Result<(usize, usize), MoeError> {
        if !(1..=MAX_EXPERTS).contains(&experts) {
            return Err(MoeError::ExpertsOutOfRange {
                experts,
                max: MAX_EXPERTS,
            });
        }
        if !(1..=MAX_TOP_K).contains(&top_k) {
            return Err(MoeError::TopKOutOfRange {
                top_k,
                experts,
                max: MAX_TOP_K,
            });
        }
        let rows = elems("permute rows (max_tokens x top_k)", &[max_tokens, top_k])?;
        to_i32("permute rows (max_tokens x top_k)", rows)?;
        let ws_bytes = moefuse_kernels::moe_permute_workspace(max_tokens, experts);
        Ok((rows, ws_bytes.div_ceil(4).max(1)))
    }

    /// Checks every buffer against the shape it was made for (length, and the context of
    /// `stream`): the last check before a launch writes through them.
    fn check(&self, stream: &CudaStream) -> Result<(), MoeError> {
        let (rows, ws_words) = Self::sizes(self.max_tokens, self.experts, self.top_k)?;
        check_buffer("permute counts [E]", &self.counts, self.experts, stream)?;
        check_buffer("permute offsets [E]", &self.offsets, self.experts, stream)?;
        check_buffer("permute row_of [T, k]", &self.row_of, rows, stream)?;
        check_buffer("permute source_of [T*k]", &self.source_of, rows, stream)?;
        check_buffer("permute workspace", &self.workspace, ws_words, stream)?;
        check_buffer("permute error word", &self.errors.words, 2, stream)
    }

    /// `[E]` rows per expert of the last permutation.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// assert_eq!(cudarc::driver::DeviceSlice::len(bufs.counts()), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn counts(&self) -> &CudaSlice<i32> {
        &self.counts
    }

    /// `[E]` int32 prefix-sum ends (the grouped GEMM's offsets) of the last permutation.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// let last = bufs.offsets().slice(3..); // the routed row count, on the device
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn offsets(&self) -> &CudaSlice<i32> {
        &self.offsets
    }

    /// `[max_tokens · k]`: the expert-major row of each (token, slot) of the last
    /// permutation (first `T·k` valid), -1 for an id outside `0..E`.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// assert_eq!(cudarc::driver::DeviceSlice::len(bufs.row_of()), 16);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn row_of(&self) -> &CudaSlice<i32> {
        &self.row_of
    }

    /// `[max_tokens · k]`: `token·k + slot` of each row of the last permutation.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// assert_eq!(cudarc::driver::DeviceSlice::len(bufs.source_of()), 16);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn source_of(&self) -> &CudaSlice<i32> {
        &self.source_of
    }

    /// The error word the permutation raises bits in (ids outside `0..E`, duplicates).
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let mut bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// bufs.errors_mut().take()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn errors_mut(&mut self) -> &mut DeviceErrors {
        &mut self.errors
    }

    /// The largest token count a call takes.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?;
    /// assert_eq!((bufs.max_tokens(), bufs.experts(), bufs.top_k()), (8, 4, 2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The expert count the buffers were made for.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// assert_eq!(moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?.experts(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// The slots per token the buffers were made for.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// assert_eq!(moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 8, 4, 2)?.top_k(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn top_k(&self) -> usize {
        self.top_k
    }
}

/// Permutes `tokens` routed tokens (`topk_ids [T, k]`) into `bufs` on `stream`, and when
/// `x_perm` is given gathers `x [T, D]` into it (`[T·k, D]` bf16, row `row_of[t, j]` =
/// `x[t]`). No host synchronisation: ids outside `0..E` (slot dropped) and duplicates are
/// raised in `bufs`' [`DeviceErrors`] and reported by `bufs.errors_mut().take()`.
///
/// ```no_run
/// use moefuse::gpu::{permute, PermuteBuffers};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let ids = s.clone_htod(&[1i32, 0, 1, 2])?;               // 2 tokens, top-2
/// let mut bufs = PermuteBuffers::new(&s, 2, 4, 2)?;
/// permute::<cudarc::driver::CudaSlice<half::bf16>>(&s, 2, 4, 2, 64, &ids, None, &mut bufs, None)?;
/// assert_eq!(s.clone_dtoh(bufs.offsets())?, vec![1, 3, 4, 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn permute<X>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    topk_ids: &CudaSlice<i32>,
    x: Option<&X>,
    bufs: &mut PermuteBuffers,
    x_perm: Option<&mut CudaSlice<bf16>>,
) -> Result<(), MoeError>
where
    X: DevicePtr<bf16>,
{
    check_max("tokens", tokens, bufs.max_tokens)?;
    if (experts, top_k) != (bufs.experts, bufs.top_k) {
        return Err(MoeError::ShapeMismatch {
            what: "permute buffers (experts x top_k)",
            expected: bufs.experts * bufs.top_k,
            found: experts.saturating_mul(top_k),
        });
    }
    bufs.check(stream)?;
    let pairs = tokens * top_k; // <= max_tokens·top_k <= i32::MAX (PermuteBuffers::sizes)
    check_buffer("topk_ids [T, k]", topk_ids, pairs, stream)?;
    let gather = match (x, x_perm) {
        (Some(x), Some(xp)) => {
            if hidden == 0 || hidden % 8 != 0 {
                return Err(MoeError::NotAMultiple {
                    what: "hidden",
                    len: hidden,
                    multiple: 8,
                });
            }
            check_buffer("x [T, D]", x, elems("x [T, D]", &[tokens, hidden])?, stream)?;
            let n = elems("x_perm [T*k, D]", &[pairs, hidden])?;
            check_buffer("x_perm [T*k, D]", xp, n, stream)?;
            Some((x, xp))
        }
        (None, None) => None,
        _ => {
            return Err(MoeError::ShapeMismatch {
                what: "x and x_perm (both or neither)",
                expected: 2,
                found: 1,
            })
        }
    };
    let hidden_i32 = if gather.is_some() {
        to_i32("hidden", hidden)?
    } else {
        0
    };
    prepare_device(stream)?;
    let (ids_p, _g0) = topk_ids.device_ptr(stream);
    let (counts_p, _g1) = bufs.counts.device_ptr_mut(stream);
    let (offsets_p, _g2) = bufs.offsets.device_ptr_mut(stream);
    let (row_p, _g3) = bufs.row_of.device_ptr_mut(stream);
    let (src_p, _g4) = bufs.source_of.device_ptr_mut(stream);
    let (ws_p, _g5) = bufs.workspace.device_ptr_mut(stream);
    let (flags_p, _g6) = bufs.errors.words.device_ptr_mut(stream);
    let (x_guard, xp_guard) = match gather {
        Some((x, xp)) => (Some(x.device_ptr(stream)), Some(xp.device_ptr_mut(stream))),
        None => (None, None),
    };
    let args = ffi::MoefusePermuteArgs {
        tokens: to_i32("tokens", tokens)?,
        experts: to_i32("experts", experts)?,
        top_k: to_i32("top_k", top_k)?,
        hidden: hidden_i32,
        topk_ids: ids_p as *const i32,
        x: x_guard.as_ref().map_or(0, |g| g.0) as *const c_void,
        counts: counts_p as *mut i32,
        offsets: offsets_p as *mut i32,
        row_of: row_p as *mut i32,
        source_of: src_p as *mut i32,
        x_perm: xp_guard.as_ref().map_or(0, |g| g.0) as *mut c_void,
        workspace: ws_p as *mut i32,
        flags: flags_p as *mut u32,
    };
    // SAFETY: every buffer was checked on this call to hold what moe_abi.h says the kernel
    // touches for `tokens` tokens (ids T·k, row_of/source_of T·k, counts/offsets E, x T·D,
    // x_perm T·k·D, workspace moefuse_moe_permute_workspace(max_tokens, E) >= that of
    // `tokens`, flags 2 words) and to live in the stream's context; ids out of 0..E are
    // skipped by the kernel, so no device value forms an address outside them; the guards
    // keep the buffers ordered on `stream` until the launch is queued; the context is current.
    unsafe {
        moefuse_kernels::launch_moe(MoeArgs::Permute(&args), stream.cu_stream() as *mut c_void)?
    };
    Ok(())
}

/// `out[t] = Σ_j w[t, j] · y[row_of[t, j]]` (fp32, slot order, then bf16) for `tokens`
/// tokens; `weights` `None` sums unweighted (the backward's dx).
///
/// `row_of` lives on the device and is not trusted: the kernel bounds every entry by the
/// rows `y` holds (`y.len() / hidden`). A slot whose entry is -1 (the permutation's
/// dropped slot) is skipped; any other entry outside `0..rows` is skipped too and raises
/// the row bit in `errors`, which [`DeviceErrors::take`] reports as
/// [`MoeError::InvalidDeviceRouting`] with `row_out_of_range`. No host synchronisation.
///
/// ```no_run
/// # use moefuse::gpu::{combine, DeviceErrors};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// let row_of = s.clone_htod(&[1i32, 0])?;              // 1 token, top-2
/// let w = s.clone_htod(&[0.25f32, 0.75])?;
/// let y = s.clone_htod(&vec![half::bf16::ONE; 2 * 64])?;
/// let mut out = s.alloc_zeros::<half::bf16>(64)?;
/// let mut errors = DeviceErrors::new(&s)?;
/// combine(&s, 1, 2, 64, &row_of, Some(&w), &y, &mut out, &mut errors)?;
/// errors.take()?; // both rows were inside y
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn combine<Y, O>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: Option<&CudaSlice<f32>>,
    y: &Y,
    out: &mut O,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError>
where
    Y: DevicePtr<bf16>,
    O: DevicePtrMut<bf16>,
{
    combine_impl(
        stream, tokens, top_k, hidden, row_of, weights, y, out, errors, false,
    )
}

/// [`combine`], and with `stamp` the kernel also compares the permutation's tokens stamp
/// (`errors`' second word) with `tokens`: on a mismatch it zeroes `out` and raises the
/// stale bit (the layer's backward).
#[allow(clippy::too_many_arguments)]
pub(super) fn combine_impl<Y, O>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: Option<&CudaSlice<f32>>,
    y: &Y,
    out: &mut O,
    errors: &mut DeviceErrors,
    stamp: bool,
) -> Result<(), MoeError>
where
    Y: DevicePtr<bf16>,
    O: DevicePtrMut<bf16>,
{
    let shape = check_rows(tokens, top_k, hidden)?;
    check_buffer("row_of [T, k]", row_of, shape.pairs, stream)?;
    if let Some(w) = weights {
        check_buffer("weights [T, k]", w, shape.pairs, stream)?;
    }
    check_buffer("y [T*k, D]", y, shape.pair_elems, stream)?;
    check_buffer("out [T, D]", out, shape.token_elems, stream)?;
    check_buffer("error word", &errors.words, 2, stream)?;
    if tokens == 0 {
        return Ok(());
    }
    let rows = rows_of(y.len(), hidden);
    prepare_device(stream)?;
    let (r, _g0) = row_of.device_ptr(stream);
    let wg = weights.map(|w| w.device_ptr(stream));
    let (yp, _g2) = y.device_ptr(stream);
    let (op, _g3) = out.device_ptr_mut(stream);
    let (ep, _g4) = errors.words.device_ptr_mut(stream);
    let args = ffi::MoefuseCombineArgs {
        tokens: shape.tokens,
        top_k: shape.top_k,
        hidden: shape.hidden,
        rows,
        row_of: r as *const i32,
        weights: wg.as_ref().map_or(0, |g| g.0) as *const f32,
        y: yp as *const c_void,
        out: op as *mut c_void,
        errors: ep as *mut u32,
        expect_tokens: if stamp {
            (ep + 4) as *const i32
        } else {
            std::ptr::null()
        },
    };
    // SAFETY: row_of and weights hold T·k, out T rows of D, y `rows` rows of D (rows =
    // y.len() / D, and the kernel skips every row_of entry outside 0..rows, so no device
    // value forms an address outside y), errors 2 words; all in the stream's context
    // (checked above); the guards keep them ordered on `stream`; the context is current.
    unsafe {
        moefuse_kernels::launch_moe(MoeArgs::Combine(&args), stream.cu_stream() as *mut c_void)?
    };
    Ok(())
}

/// The combine's backward: `dy_perm[row] = w[t, j] · dy[t]` (bf16) and
/// `d_weights[t, j] = ⟨dy[t], y[row]⟩` (fp32) for every routed (t, j).
///
/// As in [`combine`], `row_of` is bounded on the device by the rows both `y` and `dy_perm`
/// hold: an entry outside them is skipped (its `d_weights` is 0, no `dy_perm` row is
/// written) and raises the row bit in `errors`.
///
/// ```no_run
/// # use moefuse::gpu::{combine_backward, DeviceErrors};
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// let row_of = s.clone_htod(&[0i32])?;                 // 1 token, top-1
/// let w = s.clone_htod(&[1.0f32])?;
/// let dy = s.clone_htod(&vec![half::bf16::ONE; 64])?;
/// let y = s.clone_htod(&vec![half::bf16::ONE; 64])?;
/// let mut dy_perm = s.alloc_zeros::<half::bf16>(64)?;
/// let mut dw = s.alloc_zeros::<f32>(1)?;
/// let mut errors = DeviceErrors::new(&s)?;
/// combine_backward(&s, 1, 1, 64, &row_of, &w, &dy, &y, &mut dy_perm, &mut dw, &mut errors)?;
/// errors.take()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn combine_backward<G, Y, P>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    dy: &G,
    y: &Y,
    dy_perm: &mut P,
    d_weights: &mut CudaSlice<f32>,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError>
where
    G: DevicePtr<bf16>,
    Y: DevicePtr<bf16>,
    P: DevicePtrMut<bf16>,
{
    combine_backward_impl(
        stream, tokens, top_k, hidden, row_of, weights, dy, y, dy_perm, d_weights, errors, false,
    )
}

/// [`combine_backward`], and with `stamp` the kernel compares the permutation's tokens
/// stamp with `tokens` (on a mismatch: `d_weights` zeroed, no `dy_perm` row written, the
/// stale bit raised).
#[allow(clippy::too_many_arguments)]
pub(super) fn combine_backward_impl<G, Y, P>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    dy: &G,
    y: &Y,
    dy_perm: &mut P,
    d_weights: &mut CudaSlice<f32>,
    errors: &mut DeviceErrors,
    stamp: bool,
) -> Result<(), MoeError>
where
    G: DevicePtr<bf16>,
    Y: DevicePtr<bf16>,
    P: DevicePtrMut<bf16>,
{
    let shape = check_rows(tokens, top_k, hidden)?;
    check_buffer("row_of [T, k]", row_of, shape.pairs, stream)?;
    check_buffer("weights [T, k]", weights, shape.pairs, stream)?;
    check_buffer("dy [T, D]", dy, shape.token_elems, stream)?;
    check_buffer("y [T*k, D]", y, shape.pair_elems, stream)?;
    check_buffer("dy_perm [T*k, D]", dy_perm, shape.pair_elems, stream)?;
    check_buffer("d_weights [T, k]", d_weights, shape.pairs, stream)?;
    check_buffer("error word", &errors.words, 2, stream)?;
    if tokens == 0 {
        return Ok(());
    }
    let rows = rows_of(y.len().min(dy_perm.len()), hidden);
    prepare_device(stream)?;
    let (r, _g0) = row_of.device_ptr(stream);
    let (w, _g1) = weights.device_ptr(stream);
    let (g, _g2) = dy.device_ptr(stream);
    let (yp, _g3) = y.device_ptr(stream);
    let (dp, _g4) = dy_perm.device_ptr_mut(stream);
    let (dw, _g5) = d_weights.device_ptr_mut(stream);
    let (ep, _g6) = errors.words.device_ptr_mut(stream);
    let args = ffi::MoefuseCombineBwdArgs {
        tokens: shape.tokens,
        top_k: shape.top_k,
        hidden: shape.hidden,
        rows,
        row_of: r as *const i32,
        weights: w as *const f32,
        dy: g as *const c_void,
        y: yp as *const c_void,
        dy_perm: dp as *mut c_void,
        d_weights: dw as *mut f32,
        errors: ep as *mut u32,
        expect_tokens: if stamp {
            (ep + 4) as *const i32
        } else {
            std::ptr::null()
        },
    };
    // SAFETY: as for combine_impl: rows = min(y, dy_perm) / D and the kernel skips every
    // row_of entry outside 0..rows, so neither y nor dy_perm is addressed past its end;
    // row_of, weights and d_weights hold T·k, dy T rows of D, errors 2 words, all in the
    // stream's context; the guards keep them ordered on `stream`; the context is current.
    unsafe {
        moefuse_kernels::launch_moe(
            MoeArgs::CombineBackward(&args),
            stream.cu_stream() as *mut c_void,
        )?
    };
    Ok(())
}

/// A combine's sizes, checked: the int32 fields of its arguments and the element counts
/// of its buffers (no product overflows).
struct CombineShape {
    tokens: i32,
    top_k: i32,
    hidden: i32,
    /// `T·k`.
    pairs: usize,
    /// `T·k·D`.
    pair_elems: usize,
    /// `T·D`.
    token_elems: usize,
}

fn check_rows(tokens: usize, top_k: usize, hidden: usize) -> Result<CombineShape, MoeError> {
    check_max("top_k", top_k, MAX_TOP_K)?;
    if top_k == 0 || hidden == 0 || hidden % 8 != 0 {
        return Err(MoeError::NotAMultiple {
            what: "hidden (and top_k >= 1)",
            len: hidden,
            multiple: 8,
        });
    }
    let pairs = elems("tokens x top_k", &[tokens, top_k])?;
    Ok(CombineShape {
        tokens: to_i32("tokens", tokens)?,
        top_k: to_i32("top_k", top_k)?,
        hidden: to_i32("hidden", hidden)?,
        pairs,
        pair_elems: elems("tokens x top_k x hidden", &[pairs, hidden])?,
        token_elems: elems("tokens x hidden", &[tokens, hidden])?,
    })
}

/// The rows of `hidden` a buffer of `len` elements holds, as the kernels' int32 (clamped:
/// a smaller bound is still a bound, and row_of entries are int32 anyway).
fn rows_of(len: usize, hidden: usize) -> i32 {
    i32::try_from(len / hidden).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_sizes_never_wrap() {
        // 2^63 + 8 as hidden: T·k·D wraps in u64 and `as i32` gives 8; both are refused.
        let huge = (1usize << 63) + 8;
        assert!(matches!(
            check_rows(4, 2, huge),
            Err(MoeError::TooLarge { .. })
        ));
        assert!(matches!(
            check_rows(1 << 40, 2, 64),
            Err(MoeError::TooLarge { what: "tokens", .. })
        ));
        let s = check_rows(3, 2, 64).unwrap();
        assert_eq!((s.tokens, s.top_k, s.hidden), (3, 2, 64));
        assert_eq!((s.pairs, s.pair_elems, s.token_elems), (6, 384, 192));
        assert!(matches!(
            check_rows(3, 17, 64),
            Err(MoeError::TooLarge { what: "top_k", .. })
        ));
    }

    #[test]
    fn row_bound_is_the_buffer_and_fits_int32() {
        assert_eq!(rows_of(640, 64), 10);
        assert_eq!(rows_of(639, 64), 9);
        assert_eq!(rows_of(usize::MAX, 8), i32::MAX);
    }

    #[test]
    fn permute_sizes_are_checked() {
        assert!(matches!(
            PermuteBuffers::sizes(usize::MAX / 2, 8, 4),
            Err(MoeError::TooLarge { .. })
        ));
        assert!(matches!(
            PermuteBuffers::sizes(1 << 28, 8, 16),
            Err(MoeError::TooLarge { .. })
        ));
        assert!(matches!(
            PermuteBuffers::sizes(16, 0, 1),
            Err(MoeError::ExpertsOutOfRange { .. })
        ));
        assert!(matches!(
            PermuteBuffers::sizes(16, 8, 17),
            Err(MoeError::TopKOutOfRange { .. })
        ));
        assert_eq!(PermuteBuffers::sizes(512, 8, 2).unwrap(), (1024, 16));
    }
}
