//! [`PermuteBuffers`]: the permutation's outputs (counts, offsets, `row_of`, `source_of`),
//! its scratch and its [`DeviceErrors`] word, sized once for a layer's largest call.

use super::{check_buffer, check_max, elems, DeviceErrors};
use crate::{MoeError, MAX_EXPERTS, MAX_TOP_K};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// Outputs and scratch of [`permute`](fn@super::permute), sized once for `max_tokens × top_k` rows.
///
/// The buffers are private, so their lengths are the ones [`PermuteBuffers::new`] chose;
/// [`permute`](fn@super::permute) still checks every length and device again on each call
/// (and the launch layer once more, with alignment). Read them through
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
    /// Scratch of `moefuse_moe_permute_workspace(max_tokens, E)` bytes.
    pub(super) workspace: CudaSlice<i32>,
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
    pub(super) fn sizes(
        max_tokens: usize,
        experts: usize,
        top_k: usize,
    ) -> Result<(usize, usize), MoeError> {
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
        check_max("permute rows (max_tokens x top_k)", rows, i32::MAX as usize)?;
        let ws_bytes = moefuse_kernels::moe_permute_workspace(max_tokens, experts);
        Ok((rows, ws_bytes.div_ceil(4).max(1)))
    }

    /// Bytes of device memory the buffers hold.
    pub(crate) fn device_bytes(&self) -> usize {
        4 * (self.counts.len()
            + self.offsets.len()
            + self.row_of.len()
            + self.source_of.len()
            + self.errors.words.len()
            + self.workspace.len())
    }

    /// Checks every buffer against the shape it was made for (length, and the context of
    /// `stream`): the last check before a launch writes through them.
    pub(super) fn check(&self, stream: &CudaStream) -> Result<(), MoeError> {
        let (rows, ws_words) = Self::sizes(self.max_tokens, self.experts, self.top_k)?;
        check_buffer("permute counts [E]", &self.counts, self.experts, stream)?;
        check_buffer("permute offsets [E]", &self.offsets, self.experts, stream)?;
        check_buffer("permute row_of [T, k]", &self.row_of, rows, stream)?;
        check_buffer("permute source_of [T*k]", &self.source_of, rows, stream)?;
        check_buffer("permute workspace", &self.workspace, ws_words, stream)?;
        check_buffer(
            "permute error words",
            &self.errors.words,
            DeviceErrors::WORDS,
            stream,
        )
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

#[cfg(test)]
mod tests {
    use super::*;

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
