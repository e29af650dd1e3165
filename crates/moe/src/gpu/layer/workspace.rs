//! [`MoeWorkspace`]: the caller's device scratch that layers share, and the views a pass
//! carves from it (or from a layer's saved state) for its four expert-major intermediates.

use super::plan::Layout;
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

    /// The slots of a two-region `layout` (the forward's) in this workspace. Checked by
    /// [`MoeWorkspace::check`] against the plan before the call.
    pub(super) fn slots(&mut self, layout: Layout<4>) -> SlotViews<'_, 4> {
        let regions = layout.regions();
        assert_eq!(regions.len(), 2, "the forward's layout has two regions");
        let (ra, rb) = self.buf.split_at_mut(regions[0]);
        SlotViews {
            bufs: vec![ra, rb],
            at: layout.at,
            lens: layout.lens,
        }
    }

    /// `f` on the slots of `layout` (up to six regions: the backward's) in this workspace.
    /// (cudarc splits a view by borrowing it, so the regions live in this call's frame.)
    pub(super) fn with_slots<const N: usize, R>(
        &mut self,
        layout: Layout<N>,
        f: impl FnOnce(SlotViews<'_, N>) -> R,
    ) -> R {
        let regions = layout.regions();
        assert!(regions.len() <= 6, "at most six regions");
        let len = |i: usize| regions.get(i).copied().unwrap_or(0);
        let mut v0 = self.buf.as_view_mut();
        let (r0, mut v1) = v0.split_at_mut(len(0));
        let (r1, mut v2) = v1.split_at_mut(len(1));
        let (r2, mut v3) = v2.split_at_mut(len(2));
        let (r3, mut v4) = v3.split_at_mut(len(3));
        let (r4, mut v5) = v4.split_at_mut(len(4));
        let (r5, _) = v5.split_at_mut(len(5));
        let mut bufs = vec![r0, r1, r2, r3, r4, r5];
        bufs.truncate(regions.len());
        f(SlotViews {
            bufs,
            at: layout.at,
            lens: layout.lens,
        })
    }

    /// [`MoeWorkspace::slots`] with slot `slot` in `own` instead (a layer's saved buffer),
    /// as long as `own` (the layout gives that slot no room in the workspace).
    pub(super) fn slots_with<'a>(
        &'a mut self,
        layout: Layout<4>,
        slot: usize,
        own: &'a mut CudaSlice<bf16>,
    ) -> SlotViews<'a, 4> {
        let mut views = self.slots(layout);
        views.at[slot] = views.bufs.len();
        views.lens[slot] = own.len();
        views.bufs.push(own.as_view_mut());
        views
    }
}

/// A pass's bf16 intermediates as views: each slot `s` is the first `lens[s]` elements of
/// buffer `at[s]`.
pub(super) struct SlotViews<'a, const N: usize> {
    bufs: Vec<CudaViewMut<'a, bf16>>,
    at: [usize; N],
    lens: [usize; N],
}

impl<'a, const N: usize> SlotViews<'a, N> {
    /// Slot `s`, to read.
    pub(super) fn get(&self, s: usize) -> CudaView<'_, bf16> {
        self.bufs[self.at[s]].slice(..self.lens[s])
    }

    /// Slot `s`, to write.
    pub(super) fn get_mut(&mut self, s: usize) -> CudaViewMut<'_, bf16> {
        let n = self.lens[s];
        self.bufs[self.at[s]].slice_mut(..n)
    }

    /// Slots `a` and `b` both to write (in two different buffers).
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

    /// Slot `src` to read and slot `dst` to write (in two different buffers).
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

    /// Slot `src` to read and slots `a`, `b` to write (three different buffers).
    pub(super) fn read_write2(
        &mut self,
        src: usize,
        [a, b]: [usize; 2],
    ) -> (CudaView<'_, bf16>, [CudaViewMut<'_, bf16>; 2]) {
        let idx = [self.at[src], self.at[a], self.at[b]];
        let lens = [self.lens[src], self.lens[a], self.lens[b]];
        assert!(
            idx[0] != idx[1] && idx[0] != idx[2] && idx[1] != idx[2],
            "slots {src} {a} {b} share a buffer"
        );
        let mut picked: Vec<Option<&mut CudaViewMut<'a, bf16>>> =
            self.bufs.iter_mut().map(Some).collect();
        let mut take = |i: usize| picked[i].take().expect("distinct buffers");
        let (r, wa, wb) = (take(idx[0]), take(idx[1]), take(idx[2]));
        (
            r.slice(..lens[0]),
            [wa.slice_mut(..lens[1]), wb.slice_mut(..lens[2])],
        )
    }
}
