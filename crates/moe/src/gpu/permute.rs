//! Token permutation into expert-major rows (with the gather of `x` fused), the weighted
//! combine back to tokens, and the combine's backward, as
//! [`reference::permutation`](crate::reference::permutation) and the reference layer define
//! them: rows grouped by expert ascending, stable in token order within an expert.

use super::{check_buffer, check_len, check_max, prepare_device};
use crate::MoeError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{ffi, MoeArgs};
use std::ffi::c_void;
use std::sync::Arc;

/// Outputs and scratch of [`permute`], sized once for `max_tokens × top_k` rows.
pub struct PermuteBuffers {
    /// `[E]` rows per expert.
    pub counts: CudaSlice<i32>,
    /// `[E]` prefix-sum ends (the grouped GEMM's offsets).
    pub offsets: CudaSlice<i32>,
    /// `[T, k]` expert-major row of each (token, slot); -1 for an id outside `0..E`.
    pub row_of: CudaSlice<i32>,
    /// `[T·k]` `token·k + slot` of each row.
    pub source_of: CudaSlice<i32>,
    /// Bit 1: an id outside `0..E`; bit 2: a token named one expert twice. Never cleared
    /// by the kernels.
    pub flags: CudaSlice<u32>,
    workspace: CudaSlice<i32>,
    max_tokens: usize,
    experts: usize,
    top_k: usize,
}

impl PermuteBuffers {
    /// Buffers for up to `max_tokens` tokens over `experts` experts with `top_k` slots.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let bufs = moefuse::gpu::PermuteBuffers::new(&ctx.default_stream(), 4096, 128, 8)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(
        stream: &Arc<CudaStream>,
        max_tokens: usize,
        experts: usize,
        top_k: usize,
    ) -> Result<Self, MoeError> {
        // SAFETY-free: a pure size query of the C library.
        let ws_bytes = moefuse_kernels::moe_permute_workspace(max_tokens, experts);
        let rows = (max_tokens * top_k).max(1);
        Ok(PermuteBuffers {
            counts: stream.alloc_zeros(experts.max(1))?,
            offsets: stream.alloc_zeros(experts.max(1))?,
            row_of: stream.alloc_zeros(rows)?,
            source_of: stream.alloc_zeros(rows)?,
            flags: stream.alloc_zeros(1)?,
            workspace: stream.alloc_zeros(ws_bytes.div_ceil(4).max(1))?,
            max_tokens,
            experts,
            top_k,
        })
    }
}

/// Permutes `tokens` routed tokens (`topk_ids [T, k]`) into `bufs` on `stream`, and when
/// `x_perm` is given gathers `x [T, D]` into it (`[T·k, D]` bf16, row `row_of[t, j]` =
/// `x[t]`). No host synchronisation.
///
/// ```no_run
/// use moefuse::gpu::{permute, PermuteBuffers};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let ids = s.clone_htod(&[1i32, 0, 1, 2])?;               // 2 tokens, top-2
/// let mut bufs = PermuteBuffers::new(&s, 2, 4, 2)?;
/// permute::<cudarc::driver::CudaSlice<half::bf16>>(&s, 2, 4, 2, 64, &ids, None, &mut bufs, None)?;
/// assert_eq!(s.clone_dtoh(&bufs.offsets)?, vec![1, 3, 4, 4]);
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
    check_max("experts", experts, 512)?;
    check_max("top_k", top_k, 16)?;
    check_max("tokens", tokens, bufs.max_tokens)?;
    if (experts, top_k) != (bufs.experts, bufs.top_k) || experts == 0 || top_k == 0 {
        return Err(MoeError::ShapeMismatch {
            what: "permute buffers (experts x top_k)",
            expected: bufs.experts * bufs.top_k,
            found: experts * top_k,
        });
    }
    check_buffer("topk_ids [T, k]", topk_ids, tokens * top_k, stream)?;
    let gather = match (x, x_perm) {
        (Some(x), Some(xp)) => {
            if hidden == 0 || hidden % 8 != 0 {
                return Err(MoeError::NotAMultiple {
                    what: "hidden",
                    len: hidden,
                    multiple: 8,
                });
            }
            if x.len() < tokens * hidden {
                return Err(MoeError::BufferTooSmall {
                    what: "x [T, D]",
                    needed: tokens * hidden,
                    got: x.len(),
                });
            }
            check_buffer("x_perm [T*k, D]", xp, tokens * top_k * hidden, stream)?;
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
    prepare_device(stream)?;
    let (ids_p, _g0) = topk_ids.device_ptr(stream);
    let (counts_p, _g1) = bufs.counts.device_ptr_mut(stream);
    let (offsets_p, _g2) = bufs.offsets.device_ptr_mut(stream);
    let (row_p, _g3) = bufs.row_of.device_ptr_mut(stream);
    let (src_p, _g4) = bufs.source_of.device_ptr_mut(stream);
    let (ws_p, _g5) = bufs.workspace.device_ptr_mut(stream);
    let (flags_p, _g6) = bufs.flags.device_ptr_mut(stream);
    let (x_guard, xp_guard) = match gather {
        Some((x, xp)) => (Some(x.device_ptr(stream)), Some(xp.device_ptr_mut(stream))),
        None => (None, None),
    };
    let args = ffi::MoefusePermuteArgs {
        tokens: tokens as i32,
        experts: experts as i32,
        top_k: top_k as i32,
        hidden: hidden as i32,
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
    // SAFETY: every buffer was checked to hold what abi.h says the kernel touches for
    // `tokens` tokens (ids T·k, row_of/source_of T·k, counts/offsets E, x T·D, x_perm T·k·D,
    // workspace moefuse_moe_permute_workspace(max_tokens, E) >= that of `tokens`); the guards
    // keep them ordered on `stream` until the launch is queued; the context is current.
    unsafe {
        moefuse_kernels::launch_moe(MoeArgs::Permute(&args), stream.cu_stream() as *mut c_void)?
    };
    Ok(())
}

/// `out[t] = Σ_j w[t, j] · y[row_of[t, j]]` (fp32, slot order, then bf16) for `tokens`
/// tokens; `weights` `None` sums unweighted (the backward's dx).
///
/// ```no_run
/// # use moefuse::gpu::combine;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// let row_of = s.clone_htod(&[1i32, 0])?;              // 1 token, top-2
/// let w = s.clone_htod(&[0.25f32, 0.75])?;
/// let y = s.clone_htod(&vec![half::bf16::ONE; 2 * 64])?;
/// let mut out = s.alloc_zeros::<half::bf16>(64)?;
/// combine(&s, 1, 2, 64, &row_of, Some(&w), &y, &mut out)?;
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
) -> Result<(), MoeError>
where
    Y: DevicePtr<bf16>,
    O: DevicePtrMut<bf16>,
{
    check_rows(top_k, hidden)?;
    check_buffer("row_of [T, k]", row_of, tokens * top_k, stream)?;
    if let Some(w) = weights {
        check_buffer("weights [T, k]", w, tokens * top_k, stream)?;
    }
    check_len("y [T*k, D]", y.len(), tokens * top_k * hidden)?;
    check_len("out [T, D]", out.len(), tokens * hidden)?;
    if tokens == 0 {
        return Ok(());
    }
    prepare_device(stream)?;
    let (r, _g0) = row_of.device_ptr(stream);
    let wg = weights.map(|w| w.device_ptr(stream));
    let (yp, _g2) = y.device_ptr(stream);
    let (op, _g3) = out.device_ptr_mut(stream);
    let args = ffi::MoefuseCombineArgs {
        tokens: tokens as i32,
        top_k: top_k as i32,
        hidden: hidden as i32,
        _pad: 0,
        row_of: r as *const i32,
        weights: wg.as_ref().map_or(0, |g| g.0) as *const f32,
        y: yp as *const c_void,
        out: op as *mut c_void,
    };
    // SAFETY: row_of and weights hold T·k, y at least T·k rows (every row_of entry is a row
    // of the permutation, < T·k), out T rows of D; guards keep them on `stream`.
    unsafe {
        moefuse_kernels::launch_moe(MoeArgs::Combine(&args), stream.cu_stream() as *mut c_void)?
    };
    Ok(())
}

/// The combine's backward: `dy_perm[row] = w[t, j] · dy[t]` (bf16) and
/// `d_weights[t, j] = ⟨dy[t], y[row]⟩` (fp32) for every routed (t, j).
///
/// ```no_run
/// # use moefuse::gpu::combine_backward;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let s = ctx.default_stream();
/// let row_of = s.clone_htod(&[0i32])?;                 // 1 token, top-1
/// let w = s.clone_htod(&[1.0f32])?;
/// let dy = s.clone_htod(&vec![half::bf16::ONE; 64])?;
/// let y = s.clone_htod(&vec![half::bf16::ONE; 64])?;
/// let mut dy_perm = s.alloc_zeros::<half::bf16>(64)?;
/// let mut dw = s.alloc_zeros::<f32>(1)?;
/// combine_backward(&s, 1, 1, 64, &row_of, &w, &dy, &y, &mut dy_perm, &mut dw)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn combine_backward<G, Y>(
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    dy: &G,
    y: &Y,
    dy_perm: &mut CudaSlice<bf16>,
    d_weights: &mut CudaSlice<f32>,
) -> Result<(), MoeError>
where
    G: DevicePtr<bf16>,
    Y: DevicePtr<bf16>,
{
    check_rows(top_k, hidden)?;
    check_buffer("row_of [T, k]", row_of, tokens * top_k, stream)?;
    check_buffer("weights [T, k]", weights, tokens * top_k, stream)?;
    check_len("dy [T, D]", dy.len(), tokens * hidden)?;
    check_len("y [T*k, D]", y.len(), tokens * top_k * hidden)?;
    check_buffer("dy_perm [T*k, D]", dy_perm, tokens * top_k * hidden, stream)?;
    check_buffer("d_weights [T, k]", d_weights, tokens * top_k, stream)?;
    if tokens == 0 {
        return Ok(());
    }
    prepare_device(stream)?;
    let (r, _g0) = row_of.device_ptr(stream);
    let (w, _g1) = weights.device_ptr(stream);
    let (g, _g2) = dy.device_ptr(stream);
    let (yp, _g3) = y.device_ptr(stream);
    let (dp, _g4) = dy_perm.device_ptr_mut(stream);
    let (dw, _g5) = d_weights.device_ptr_mut(stream);
    let args = ffi::MoefuseCombineBwdArgs {
        tokens: tokens as i32,
        top_k: top_k as i32,
        hidden: hidden as i32,
        _pad: 0,
        row_of: r as *const i32,
        weights: w as *const f32,
        dy: g as *const c_void,
        y: yp as *const c_void,
        dy_perm: dp as *mut c_void,
        d_weights: dw as *mut f32,
    };
    // SAFETY: as for combine; dy_perm holds T·k rows and d_weights T·k floats.
    unsafe {
        moefuse_kernels::launch_moe(
            MoeArgs::CombineBackward(&args),
            stream.cu_stream() as *mut c_void,
        )?
    };
    Ok(())
}

fn check_rows(top_k: usize, hidden: usize) -> Result<(), MoeError> {
    check_max("top_k", top_k, 16)?;
    if top_k == 0 || hidden == 0 || hidden % 8 != 0 {
        return Err(MoeError::NotAMultiple {
            what: "hidden (and top_k >= 1)",
            len: hidden,
            multiple: 8,
        });
    }
    Ok(())
}
