//! The two collectives: [`ExpertParallel::dispatch`] and [`Dispatch::combine`].

use super::params::{self, EpParams, ABORT_COMBINE, ABORT_DISPATCH};
use super::pulled::PullDispatch;
use super::{cuda, ExpertParallel};
use crate::device_module::LaunchShape;
use crate::{Capacity, CommError};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

pub(super) fn check_len(what: &'static str, got: usize, needed: usize) -> Result<(), CommError> {
    if got < needed {
        return Err(CommError::BufferTooSmall { what, needed, got });
    }
    Ok(())
}

impl ExpertParallel {
    /// Sends `tokens` rows of `x` (`[tokens, hidden]` bf16, 16-byte aligned) to the owners
    /// of their experts (`topk_ids`, `topk_weights`: `[tokens, top_k]`). Collective. Errors
    /// before any launch when a buffer is short, misaligned or on another device, or
    /// `tokens` exceeds the capacity; with several ranks such an error also ends the call
    /// for the peers ([`CommError::PeerAborted`] there) and the instance refuses further
    /// calls. Returns the fault of an earlier call, if one is known.
    ///
    /// ```no_run
    /// # fn demo(ep: &mut moefuse_comm::ExpertParallel, x: &cudarc::driver::CudaSlice<half::bf16>,
    /// #         ids: &cudarc::driver::CudaSlice<i32>, w: &cudarc::driver::CudaSlice<f32>)
    /// #         -> Result<(), moefuse_comm::CommError> {
    /// let d = ep.dispatch(x, ids, w, 4096)?;
    /// let rows = d.received_rows()?; // synchronises; a peer's failure is an Err here
    /// # Ok(()) }
    /// ```
    pub fn dispatch<X, I, W>(
        &mut self,
        x: &X,
        topk_ids: &I,
        topk_weights: &W,
        tokens: usize,
    ) -> Result<Dispatch<'_>, CommError>
    where
        X: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        match self.launch_dispatch(x, topk_ids, topk_weights, tokens, false) {
            Ok(()) => Ok(Dispatch {
                ep: self,
                tokens,
                finished: false,
            }),
            Err(e) => {
                self.abandon(ABORT_DISPATCH, &e);
                Err(e)
            }
        }
    }

    /// The dispatch of an exchange built with [`EpConfig::pull_rows`](crate::EpConfig):
    /// `x`'s rows go once into this rank's symmetric copy and only their routing travels;
    /// each receiver gets the expert-major table of where its rows live
    /// ([`PullDispatch::row_sources`], [`PullDispatch::peer_rows`]) and reads them in place
    /// (the fused gate_up's [`GateUpRows::Peers`](moefuse_kernels::GateUpRows)). Collective;
    /// checks and failures as [`ExpertParallel::dispatch`].
    ///
    /// ```no_run
    /// # fn demo(ep: &mut moefuse_comm::ExpertParallel, x: &cudarc::driver::CudaSlice<half::bf16>,
    /// #         ids: &cudarc::driver::CudaSlice<i32>, w: &cudarc::driver::CudaSlice<f32>)
    /// #         -> Result<(), moefuse_comm::CommError> {
    /// let d = ep.dispatch_pull(x, ids, w, 4096)?;
    /// let (sources, peers) = (d.row_sources(), d.peer_rows());
    /// # Ok(()) }
    /// ```
    pub fn dispatch_pull<X, I, W>(
        &mut self,
        x: &X,
        topk_ids: &I,
        topk_weights: &W,
        tokens: usize,
    ) -> Result<PullDispatch<'_>, CommError>
    where
        X: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        match self.launch_dispatch(x, topk_ids, topk_weights, tokens, true) {
            Ok(()) => Ok(PullDispatch::new(Dispatch {
                ep: self,
                tokens,
                finished: false,
            })),
            Err(e) => {
                self.abandon(ABORT_DISPATCH, &e);
                Err(e)
            }
        }
    }

    fn launch_dispatch<X, I, W>(
        &mut self,
        x: &X,
        topk_ids: &I,
        topk_weights: &W,
        tokens: usize,
        pull: bool,
    ) -> Result<(), CommError>
    where
        X: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        self.check()?;
        self.pulled = super::PulledState::Idle;
        if pull != self.cfg.pull_rows {
            // The same on every rank (the configuration hash includes pull_rows).
            return Err(CommError::Unsupported(if pull {
                "dispatch_pull needs an exchange built with EpConfig::pull_rows".into()
            } else {
                "this exchange was built with EpConfig::pull_rows: its rows are read in place (dispatch_pull)".into()
            }));
        }
        let cap = Capacity {
            max_tokens: self.cfg.max_tokens,
            top_k: self.cfg.top_k,
            place: self.place,
        };
        cap.check_dispatch(tokens, self.cfg.top_k)?;
        let (k, d) = (self.cfg.top_k, self.cfg.hidden);
        check_len("x", x.len(), tokens * d)?;
        check_len("topk_ids", topk_ids.len(), tokens * k)?;
        check_len("topk_weights", topk_weights.len(), tokens * k)?;
        let s = self.stream.clone();
        let (xp, _xs) = x.device_ptr(&s);
        let (ip, _is) = topk_ids.device_ptr(&s);
        let (wp, _ws) = topk_weights.device_ptr(&s);
        self.operand("x", xp, 16, tokens * d)?;
        self.operand("topk_ids", ip, 4, tokens * k)?;
        self.operand("topk_weights", wp, 4, tokens * k)?;
        let p = EpParams {
            tokens: tokens as i32,
            x: xp,
            topk_ids: ip,
            topk_weights: wp,
            ..self.base
        };
        let chunks = tokens.div_ceil(params::CHUNK).max(1) as u32;
        let count_smem = super::setup::count_smem_bytes(&self.cfg, self.place.ranks()) as u32;
        let kn = &self.kernels;
        // SAFETY: `p` mirrors `moefuse_ep_params` (layout test); its buffers are owned by
        // `self` and sized from the config, the caller's were checked above (length,
        // alignment, device) and are kept alive by their guards until the launches are
        // queued (stream order does the rest).
        unsafe {
            self.module.launch(
                kn.count,
                &s,
                chunks,
                32 * params::COUNT_WARPS as u32,
                count_smem,
                &p,
            )?;
            // Behind count without a launch gap: dispatch loads its first rows while count
            // runs and waits for it in griddepcontrol.wait (ep.cu).
            let shape = LaunchShape {
                grid: self.grid,
                block: 256,
                smem: 0,
            };
            self.module.launch_dependent(kn.dispatch, &s, shape, &p)?;
            // One PE: dispatch wrote every expert-major row itself; nothing to expand.
            if self.place.ranks() > 1 {
                self.module.launch(kn.expand, &s, self.grid, 256, 0, &p)?;
            }
        }
        Ok(())
    }
}

/// The received rows of one [`ExpertParallel::dispatch`], to be given back to
/// [`Dispatch::combine`] (every rank must combine before it dispatches again). Dropping it
/// without combining abandons the call: the peers' combine fails with
/// [`CommError::PeerAborted`] instead of waiting.
pub struct Dispatch<'a> {
    pub(super) ep: &'a mut ExpertParallel,
    pub(super) tokens: usize,
    pub(super) finished: bool,
}

impl Dispatch<'_> {
    /// Expert-major received rows, `[recv_rows_capacity, hidden]` bf16; the first
    /// `offsets[local_experts - 1]` are valid, grouped by local expert.
    pub fn x(&self) -> &CudaSlice<bf16> {
        &self.ep.local.recv_x
    }

    /// Prefix-sum ends of each local expert's rows (the grouped GEMM's offsets), on the device.
    pub fn offsets(&self) -> &CudaSlice<i32> {
        &self.ep.local.recv_offsets
    }

    /// Routing weight of each received row.
    pub fn weights(&self) -> &CudaSlice<f32> {
        &self.ep.local.recv_w
    }

    /// `(source rank, token, slot)` of each received row, `[rows, 3]`.
    pub fn origin(&self) -> &CudaSlice<i32> {
        &self.ep.local.recv_origin
    }

    /// Rows received (synchronises the stream, bounded by the deadlines; for tests and
    /// tools). A peer's failure during the dispatch is returned here as a typed error.
    pub fn received_rows(&self) -> Result<usize, CommError> {
        self.ep.synchronize()?;
        let status = self
            .ep
            .stream
            .clone_dtoh(&self.ep.local.status)
            .map_err(cuda)?;
        Ok(status[0] as usize)
    }

    /// Reduces the expert outputs `y` (`[rows, hidden]` bf16, in [`Dispatch::x`]'s row order)
    /// back to this rank's tokens: `out[t] = Σ_slot w[t, slot] · y(t, slot)`, `[tokens,
    /// hidden]` bf16 (both 16-byte aligned). Collective; an error here ends the call for
    /// the peers too (as in dispatch).
    pub fn combine<Y, O>(mut self, y: &Y, out: &mut O) -> Result<(), CommError>
    where
        Y: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
    {
        self.finished = true;
        let result = self.launch_combine(y, out);
        if let Err(e) = &result {
            self.ep.abandon(ABORT_COMBINE, e);
        }
        result
    }

    fn launch_combine<Y, O>(&mut self, y: &Y, out: &mut O) -> Result<(), CommError>
    where
        Y: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
    {
        let ep = &mut *self.ep;
        ep.check()?;
        let d = ep.cfg.hidden;
        check_len("out", out.len(), self.tokens * d)?;
        let s = ep.stream.clone();
        let (yp, _ys) = y.device_ptr(&s);
        let (op, _os) = out.device_ptr_mut(&s);
        ep.operand("y", yp, 16, y.len())?;
        ep.operand("out", op, 16, self.tokens * d)?;
        let p = EpParams {
            tokens: self.tokens as i32,
            // Rows past the end of `y` are skipped and flagged (recv_overflow).
            recv_rows_cap: ep.base.recv_rows_cap.min((y.len() / d) as i64),
            y: yp,
            out: op,
            ..ep.base
        };
        // SAFETY: as in dispatch; `y` and `out` were checked and are kept alive by their guards.
        unsafe {
            ep.module
                .launch(ep.kernels.combine_send, &s, ep.grid, 256, 0, &p)?;
            // One PE: combine_send wrote `out` itself (one partial per token).
            if ep.place.ranks() > 1 {
                ep.module
                    .launch(ep.kernels.combine_reduce, &s, ep.grid, 256, 0, &p)?;
            }
        }
        Ok(())
    }
}

impl Drop for Dispatch<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let cause = CommError::Poisoned {
                cause: "a Dispatch was dropped without combine".into(),
            };
            self.ep.abandon(ABORT_COMBINE, &cause);
        }
    }
}
