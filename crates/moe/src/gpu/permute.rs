//! Token permutation into expert-major rows (with the gather of `x` fused), the weighted
//! combine back to tokens, and the combine's backward, as
//! [`reference::permutation`](crate::reference::permutation) and the reference layer define
//! them: rows grouped by expert ascending, stable in token order within an expert.

use super::{check_buffer, check_max, elems, kernels_for, DeviceErrors, PermuteBuffers};
use crate::{MoeError, MAX_TOP_K};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{CombineBackward, CombineForward, Kernels, Permute};
use std::sync::Arc;

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
    let x = x.map(|x| x as &dyn DevicePtr<bf16>);
    let x_perm = x_perm.map(|p| p as &mut dyn DevicePtrMut<bf16>);
    permute_with(
        None, stream, tokens, experts, top_k, hidden, topk_ids, x, bufs, x_perm,
    )
}

/// [`permute`] through `kernels` (the layer's handle), or a handle bound for the call.
#[allow(clippy::too_many_arguments)]
pub(super) fn permute_with(
    kernels: Option<&Kernels>,
    stream: &Arc<CudaStream>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    topk_ids: &CudaSlice<i32>,
    x: Option<&dyn DevicePtr<bf16>>,
    bufs: &mut PermuteBuffers,
    x_perm: Option<&mut dyn DevicePtrMut<bf16>>,
) -> Result<(), MoeError> {
    check_max("tokens", tokens, bufs.max_tokens())?;
    if (experts, top_k) != (bufs.experts(), bufs.top_k()) {
        return Err(MoeError::ShapeMismatch {
            what: "permute buffers (experts x top_k)",
            expected: bufs.experts() * bufs.top_k(),
            found: experts.saturating_mul(top_k),
        });
    }
    bufs.check(stream)?;
    let pairs = tokens * top_k; // <= max_tokens·top_k <= i32::MAX (PermuteBuffers::sizes)
    check_buffer("topk_ids [T, k]", topk_ids, pairs, stream)?;
    let (x, x_perm) = match (x, x_perm) {
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
            (Some(x), Some(&mut *xp as &mut dyn DevicePtrMut<bf16>))
        }
        (None, None) => (None, None),
        _ => {
            return Err(MoeError::ShapeMismatch {
                what: "x and x_perm (both or neither)",
                expected: 2,
                found: 1,
            })
        }
    };
    let mut owned = None;
    // Launched even for 0 tokens: the kernel writes zero counts and offsets.
    kernels_for(kernels, &mut owned, stream)?.launch(
        stream,
        Permute {
            tokens,
            experts,
            top_k,
            hidden,
            topk_ids,
            x,
            counts: &mut bufs.counts,
            offsets: &mut bufs.offsets,
            row_of: &mut bufs.row_of,
            source_of: &mut bufs.source_of,
            x_perm,
            workspace: &mut bufs.workspace,
            flags: Some(&mut bufs.errors.words),
        },
    )?;
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
        None, stream, tokens, top_k, hidden, row_of, weights, y, out, errors, false,
    )
}

/// [`combine`], and with `stamp` the kernel also compares the permutation's tokens stamp
/// (`errors`' second word) with `tokens`: on a mismatch it zeroes `out` and raises the
/// stale bit (the layer's backward). Launches through `kernels` (the layer's handle), or
/// a handle bound for the call.
#[allow(clippy::too_many_arguments)]
pub(super) fn combine_impl(
    kernels: Option<&Kernels>,
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: Option<&CudaSlice<f32>>,
    y: &dyn DevicePtr<bf16>,
    out: &mut dyn DevicePtrMut<bf16>,
    errors: &mut DeviceErrors,
    stamp: bool,
) -> Result<(), MoeError> {
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
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    // The word's two u32 as views: [0] the error bits, [1] the permutation's tokens stamp.
    let (mut bits, tokens_stamp) = errors.words.split_at_mut(1);
    kernels.launch(
        stream,
        CombineForward {
            tokens,
            top_k,
            hidden,
            rows,
            row_of,
            weights: weights.map(|w| w as &dyn DevicePtr<f32>),
            y,
            out,
            errors: Some(&mut bits),
            expect_tokens: stamp.then_some(&tokens_stamp as &dyn DevicePtr<u32>),
        },
    )?;
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
        None, stream, tokens, top_k, hidden, row_of, weights, dy, y, dy_perm, d_weights, errors,
        false,
    )
}

/// [`combine_backward`], and with `stamp` the kernel compares the permutation's tokens
/// stamp with `tokens` (on a mismatch: `d_weights` zeroed, no `dy_perm` row written, the
/// stale bit raised). Launches through `kernels` (the layer's handle), or a handle bound
/// for the call.
#[allow(clippy::too_many_arguments)]
pub(super) fn combine_backward_impl(
    kernels: Option<&Kernels>,
    stream: &Arc<CudaStream>,
    tokens: usize,
    top_k: usize,
    hidden: usize,
    row_of: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    dy: &dyn DevicePtr<bf16>,
    y: &dyn DevicePtr<bf16>,
    dy_perm: &mut dyn DevicePtrMut<bf16>,
    d_weights: &mut CudaSlice<f32>,
    errors: &mut DeviceErrors,
    stamp: bool,
) -> Result<(), MoeError> {
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
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    let (mut bits, tokens_stamp) = errors.words.split_at_mut(1);
    kernels.launch(
        stream,
        CombineBackward {
            tokens,
            top_k,
            hidden,
            rows,
            row_of,
            weights,
            dy,
            y,
            dy_perm,
            d_weights,
            errors: Some(&mut bits),
            expect_tokens: stamp.then_some(&tokens_stamp as &dyn DevicePtr<u32>),
        },
    )?;
    Ok(())
}

/// A combine's element counts, checked (no product overflows); the kernels' int32 limits
/// are the launch layer's to check.
#[derive(Debug, PartialEq)]
struct CombineShape {
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
        pairs,
        pair_elems: elems("tokens x top_k x hidden", &[pairs, hidden])?,
        token_elems: elems("tokens x hidden", &[tokens, hidden])?,
    })
}

/// The rows of `hidden` a buffer of `len` elements holds, clamped to the kernels' int32 (a
/// smaller bound is still a bound, and row_of entries are int32 anyway).
fn rows_of(len: usize, hidden: usize) -> usize {
    (len / hidden).min(i32::MAX as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_sizes_never_wrap() {
        // 2^63 + 8 as hidden: T·k·D wraps in u64 (to 16); it is refused, not wrapped.
        let huge = (1usize << 63) + 8;
        assert!(matches!(
            check_rows(4, 2, huge),
            Err(MoeError::TooLarge {
                what: "tokens x top_k x hidden",
                ..
            })
        ));
        // Past int32 but no overflow: exact counts (the launch layer refuses the int32).
        let big = check_rows(1 << 40, 2, 64).unwrap();
        assert_eq!((big.pairs, big.token_elems), (1 << 41, 1 << 46));
        let s = check_rows(3, 2, 64).unwrap();
        assert_eq!((s.pairs, s.pair_elems, s.token_elems), (6, 384, 192));
        assert!(matches!(
            check_rows(3, 17, 64),
            Err(MoeError::TooLarge { what: "top_k", .. })
        ));
        assert!(matches!(
            check_rows(3, 0, 64),
            Err(MoeError::NotAMultiple { .. })
        ));
        assert!(matches!(
            check_rows(3, 2, 60),
            Err(MoeError::NotAMultiple { len: 60, .. })
        ));
    }

    #[test]
    fn row_bound_is_the_buffer_and_fits_int32() {
        assert_eq!(rows_of(640, 64), 10);
        assert_eq!(rows_of(639, 64), 9);
        assert_eq!(rows_of(usize::MAX, 8), i32::MAX as usize);
    }
}
