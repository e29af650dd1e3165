//! [`MoeWorkspace`]: the caller's device scratch that layers share, and the views a pass
//! carves from it (or from a layer's saved state) for its four expert-major intermediates.

use super::plan::{regions, Slots};
use crate::gpu::check_device;
use crate::MoeError;
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut};
use half::bf16;
use std::sync::Arc;

/// Device scratch for [`MoeLayer::forward`](super::MoeLayer::forward) and
/// [`MoeLayer::backward`](super::MoeLayer::backward), owned by the caller. Nothing in it
/// outlives a call, so every layer whose calls are ordered on one stream can share one
/// workspace of the largest [`MoePlan::workspace_bytes`](super::MoePlan::workspace_bytes)
/// among their plans (layers on different streams need one each). A call checks the size
/// and the device before anything is launched.
///
/// ```no_run
/// use moefuse::{gpu::{Mode, MoePlan, MoeWorkspace}, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let plans = [MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192)?,
///              MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 1024)?];
/// let bytes = plans.iter().map(|p| p.workspace_bytes(Mode::Training)).max().unwrap_or(0);
/// let ws = MoeWorkspace::new(&stream, bytes)?; // one for every layer of the model
/// assert!(ws.bytes() >= bytes);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MoeWorkspace {
    buf: CudaSlice<bf16>,
}

impl MoeWorkspace {
    /// A zeroed workspace of at least `bytes` bytes on `stream`'s device.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let ws = moefuse::gpu::MoeWorkspace::new(&ctx.default_stream(), 1000)?;
    /// assert_eq!(ws.bytes(), 1000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self, MoeError> {
        Ok(MoeWorkspace {
            buf: stream.alloc_zeros(bytes.div_ceil(2).max(1))?,
        })
    }

    /// Its size in bytes.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// assert_eq!(moefuse::gpu::MoeWorkspace::new(&ctx.default_stream(), 7)?.bytes(), 8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn bytes(&self) -> usize {
        self.buf.len() * 2
    }

    /// At least `needed` bytes, in `stream`'s context.
    pub(super) fn check(&self, needed: usize, stream: &CudaStream) -> Result<(), MoeError> {
        if self.bytes() < needed {
            return Err(MoeError::WorkspaceTooSmall {
                needed,
                got: self.bytes(),
            });
        }
        check_device("workspace", &self.buf, stream)
    }

    /// The four slots of `lens` in two regions of this workspace (slots 0, 2 in A; 1, 3
    /// in B). Checked by [`MoeWorkspace::check`] against the plan before the call.
    pub(super) fn slots(&mut self, lens: Slots) -> SlotViews<'_> {
        let [a, _] = regions(&lens);
        let (ra, rb) = self.buf.split_at_mut(a);
        SlotViews {
            bufs: vec![ra, rb],
            at: [0, 1, 0, 1],
            lens,
        }
    }
}

/// A pass's four bf16 intermediates as views: each slot `s` is the first `lens[s]`
/// elements of buffer `at[s]`. From a workspace, slots share two buffers; from a layer's
/// saved state, each has its own.
pub(super) struct SlotViews<'a> {
    bufs: Vec<CudaViewMut<'a, bf16>>,
    at: [usize; 4],
    lens: Slots,
}

impl<'a> SlotViews<'a> {
    /// Four separate buffers, slot `s` in `bufs[s]`.
    pub(super) fn new(bufs: [&'a mut CudaSlice<bf16>; 4], lens: Slots) -> Self {
        SlotViews {
            bufs: bufs.into_iter().map(|b| b.as_view_mut()).collect(),
            at: [0, 1, 2, 3],
            lens,
        }
    }

    /// Slot `s`, to read.
    pub(super) fn get(&self, s: usize) -> CudaView<'_, bf16> {
        self.bufs[self.at[s]].slice(..self.lens[s])
    }

    /// Slot `s`, to write.
    pub(super) fn get_mut(&mut self, s: usize) -> CudaViewMut<'_, bf16> {
        let n = self.lens[s];
        self.bufs[self.at[s]].slice_mut(..n)
    }

    /// Slots `a` and `b` both to write (two different buffers: consecutive slots never
    /// share one).
    pub(super) fn pair_mut(
        &mut self,
        a: usize,
        b: usize,
    ) -> (CudaViewMut<'_, bf16>, CudaViewMut<'_, bf16>) {
        let (i, j) = (self.at[a], self.at[b]);
        assert_ne!(i, j, "slots {a} and {b} share a buffer");
        let (n_a, n_b) = (self.lens[a], self.lens[b]);
        let (lo, hi) = self.bufs.split_at_mut(i.max(j));
        let (x, y) = if i < j {
            (&mut lo[i], &mut hi[0])
        } else {
            (&mut hi[0], &mut lo[j])
        };
        (x.slice_mut(..n_a), y.slice_mut(..n_b))
    }

    /// Slot `src` to read and slot `dst` to write (two different buffers: consecutive
    /// slots never share one).
    pub(super) fn io(
        &mut self,
        src: usize,
        dst: usize,
    ) -> (CudaView<'_, bf16>, CudaViewMut<'_, bf16>) {
        let (i, j) = (self.at[src], self.at[dst]);
        assert_ne!(i, j, "slots {src} and {dst} share a buffer");
        let (n_src, n_dst) = (self.lens[src], self.lens[dst]);
        let (lo, hi) = self.bufs.split_at_mut(i.max(j));
        let (s, d) = if i < j {
            (&lo[i], &mut hi[0])
        } else {
            (&hi[0], &mut lo[j])
        };
        (s.slice(..n_src), d.slice_mut(..n_dst))
    }
}
