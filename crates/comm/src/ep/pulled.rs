//! The pulled exchange's per-call handles ([`EpConfig::pull_rows`](crate::EpConfig)):
//! [`PullDispatch`] (what a forward's dispatch received and where its outputs go) and
//! [`PullBackward`] (the backward over the same rows).

use super::dispatch::{check_len, Dispatch};
use super::params::{EpParams, ABORT_COMBINE};
use super::{ExpertParallel, PulledState};
use crate::CommError;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

/// The received-row table of one [`ExpertParallel::dispatch_pull`]: where each expert-major
/// row lives (rank and token), its weight and origin, and where its expert output goes
/// (its token's slot at home); the rows themselves stay at their home ranks until the
/// matching [`PullDispatch::combine_slots`] (every rank must combine before it dispatches
/// again; dropping it without combining abandons the call, as [`Dispatch`]).
pub struct PullDispatch<'a> {
    inner: Dispatch<'a>,
}

impl<'a> PullDispatch<'a> {
    pub(super) fn new(inner: Dispatch<'a>) -> Self {
        PullDispatch { inner }
    }

    /// Prefix-sum ends of each local expert's rows, on the device.
    pub fn offsets(&self) -> &CudaSlice<i32> {
        self.inner.offsets()
    }

    /// Routing weight of each received row.
    pub fn weights(&self) -> &CudaSlice<f32> {
        self.inner.weights()
    }

    /// `(source rank, token, slot)` of each received row, `[rows, 3]`.
    pub fn origin(&self) -> &CudaSlice<i32> {
        self.inner.origin()
    }

    /// `source rank * max_tokens + token` of each received row: the row of
    /// [`PullDispatch::peer_rows`] it reads (`[recv_rows_capacity]`, the first
    /// `offsets[local_experts - 1]` valid).
    pub fn row_sources(&self) -> &CudaSlice<i32> {
        &self.inner.ep.local.recv_src
    }

    /// Every rank's copy of its rows (`[max_tokens, hidden]` each), as this device's
    /// load/store addresses: what [`PullDispatch::row_sources`] indexes.
    pub fn peer_rows(&self) -> &moefuse_kernels::PeerRows {
        self.inner
            .ep
            .peer_rows
            .as_ref()
            .expect("a pull exchange holds its peer rows (built in ExpertParallel::new)")
    }

    /// Where each received row's expert output goes: its token's slot on the token's home
    /// rank (`[recv_rows_capacity]` addresses, the first `offsets[local_experts - 1]` valid,
    /// `hidden` bf16 each), for the down GEMM's scattered store
    /// ([`DownScatter`](moefuse_kernels::DownScatter)); then [`PullDispatch::combine_slots`].
    pub fn row_destinations(&self) -> moefuse_kernels::ScatterRows<'_> {
        let ep = &*self.inner.ep;
        // SAFETY: the dispatch and expand kernels of this call (queued before any launch
        // that reads the table, on the same stream) write entry r of every received row as
        // the address of slot (token, slot) of y_slots on the token's home rank: symmetric
        // memory that lives as long as `ep`, `hidden` bf16 wide and 16-byte aligned, one
        // entry per (token, slot) pair, so no two overlap. The homes read y_slots only in
        // combine_slots, after every owner's signal that follows its down GEMM, and write
        // nothing there.
        unsafe {
            moefuse_kernels::ScatterRows::new(
                ep.runtime.context(),
                &ep.local.recv_dst,
                ep.cfg.hidden,
            )
        }
    }

    /// Rows received (synchronises; for tests and tools), as [`Dispatch::received_rows`].
    pub fn received_rows(&self) -> Result<usize, CommError> {
        self.inner.received_rows()
    }

    /// The combine after a down GEMM that stored every received row's output at its
    /// [`PullDispatch::row_destinations`]: tells every rank this one's rows have landed,
    /// waits for theirs, and sums this rank's tokens' slots, `out[t] = Σ_j w[t,j] ·
    /// y(t, j)` over the valid slots in slot order (fp32, bf16 out: the single-GPU layer's
    /// combine, so the same bits). `topk_ids` and `topk_weights` are the dispatch's
    /// routing (`[tokens, top_k]`). Collective; errors end the call for the peers too.
    ///
    /// ```no_run
    /// # fn demo(d: moefuse_comm::PullDispatch<'_>, ids: &cudarc::driver::CudaSlice<i32>,
    /// #         w: &cudarc::driver::CudaSlice<f32>, out: &mut cudarc::driver::CudaSlice<half::bf16>)
    /// #         -> Result<(), moefuse_comm::CommError> {
    /// // ... the down GEMM stored its rows at d.row_destinations() ...
    /// d.combine_slots(ids, w, out)?;
    /// # Ok(()) }
    /// ```
    pub fn combine_slots<I, W, O>(
        mut self,
        topk_ids: &I,
        topk_weights: &W,
        out: &mut O,
    ) -> Result<(), CommError>
    where
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        self.inner.finished = true;
        let result = self.launch_combine_slots(topk_ids, topk_weights, out);
        match &result {
            Ok(()) => {
                self.inner.ep.pulled = PulledState::Forward {
                    tokens: self.inner.tokens,
                }
            }
            Err(e) => self.inner.ep.abandon(ABORT_COMBINE, e),
        }
        result
    }

    fn launch_combine_slots<I, W, O>(
        &mut self,
        topk_ids: &I,
        topk_weights: &W,
        out: &mut O,
    ) -> Result<(), CommError>
    where
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        let (tokens, ep) = (self.inner.tokens, &mut *self.inner.ep);
        let sig = ep.base.comb_sig;
        ep.launch_slot_sum(tokens, topk_ids, Some(topk_weights), out, sig)
    }
}

impl ExpertParallel {
    /// slots_signal then combine_slots for `tokens` tokens over the signal row `sig`: the
    /// forward's (comb_sig, `weights` given) or the backward's (bwd_comb_sig, weights 1).
    fn launch_slot_sum<I, W, O>(
        &mut self,
        tokens: usize,
        topk_ids: &I,
        weights: Option<&W>,
        out: &mut O,
        sig: u64,
    ) -> Result<(), CommError>
    where
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        self.check()?;
        let (k, d) = (self.cfg.top_k, self.cfg.hidden);
        check_len("topk_ids", topk_ids.len(), tokens * k)?;
        check_len("out", out.len(), tokens * d)?;
        let s = self.stream.clone();
        let (ip, _is) = topk_ids.device_ptr(&s);
        let (op, _os) = out.device_ptr_mut(&s);
        self.operand("topk_ids", ip, 4, tokens * k)?;
        self.operand("out", op, 16, tokens * d)?;
        let mut wp = 0;
        let _wg = match weights {
            Some(w) => {
                check_len("topk_weights", w.len(), tokens * k)?;
                let (p, guard) = w.device_ptr(&s);
                self.operand("topk_weights", p, 4, tokens * k)?;
                wp = p;
                Some(guard)
            }
            None => None,
        };
        let p = EpParams {
            tokens: tokens as i32,
            topk_ids: ip,
            topk_weights: wp,
            out: op,
            comb_sig: sig,
            ..self.base
        };
        // SAFETY: `p` mirrors `moefuse_ep_params`; slots_signal touches only the epoch, the
        // fault words and the signal row `sig` (one of this instance's); combine_slots reads
        // this rank's y_slots (symmetric, owned by `self`) and the caller's ids, weights and
        // out, checked above and kept alive by their guards until the launches are queued.
        unsafe {
            self.module
                .launch(self.kernels.slots_signal, &s, 1, 32, 0, &p)?;
            self.module
                .launch(self.kernels.combine_slots, &s, self.grid, 256, 0, &p)?;
        }
        Ok(())
    }
}

/// The backward of a pulled forward ([`ExpertParallel::backward_pull`]): every home has
/// published its dy (and computed its tokens' `d_topk_weights` from the forward's slots),
/// this rank has gathered `w · dy` and `x` of every row it received; the dgrad that follows
/// stores each received row's `dx` row at [`PullBackward::row_destinations`], and
/// [`PullBackward::combine`] sums them at home. Dropping it without combining abandons the
/// call (the peers' combine fails with [`CommError::PeerAborted`] instead of waiting).
pub struct PullBackward<'a> {
    ep: &'a mut ExpertParallel,
    tokens: usize,
    finished: bool,
}

impl ExpertParallel {
    /// The backward's exchange after a pulled forward (its `combine_slots` done, no
    /// dispatch since), for this rank's `dy` (`[tokens, hidden]` bf16, the forward's
    /// tokens) and the forward's `topk_ids`: writes this rank's `d_weights[t, j] = ⟨dy[t],
    /// y_e(t, j)⟩` (`[tokens, top_k]` fp32, 0 for invalid slots), and, for every row this
    /// rank received in the forward, `dy_rows[r] = w_r · dy[token]` and `x_rows[r] =
    /// x[token]` (`[recv_rows_capacity, hidden]` bf16 each), read at the tokens' homes.
    /// Collective; one backward per forward.
    ///
    /// ```no_run
    /// # fn demo(ep: &mut moefuse_comm::ExpertParallel, dy: &cudarc::driver::CudaSlice<half::bf16>,
    /// #         ids: &cudarc::driver::CudaSlice<i32>, dw: &mut cudarc::driver::CudaSlice<f32>,
    /// #         dy_rows: &mut cudarc::driver::CudaSlice<half::bf16>, x_rows: &mut cudarc::driver::CudaSlice<half::bf16>,
    /// #         dx: &mut cudarc::driver::CudaSlice<half::bf16>) -> Result<(), moefuse_comm::CommError> {
    /// let b = ep.backward_pull(dy, ids, 4096, dw, dy_rows, x_rows)?;
    /// // ... dgrad rows stored at b.row_destinations() ...
    /// b.combine(ids, dx)?;
    /// # Ok(()) }
    /// ```
    pub fn backward_pull<G, I, W, R, X>(
        &mut self,
        dy: &G,
        topk_ids: &I,
        tokens: usize,
        d_weights: &mut W,
        dy_rows: &mut R,
        x_rows: &mut X,
    ) -> Result<PullBackward<'_>, CommError>
    where
        G: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtrMut<f32>,
        R: DevicePtrMut<bf16>,
        X: DevicePtrMut<bf16>,
    {
        match self.launch_backward(dy, topk_ids, tokens, d_weights, dy_rows, x_rows) {
            Ok(()) => Ok(PullBackward {
                ep: self,
                tokens,
                finished: false,
            }),
            Err(e) => {
                // The peers wait for this rank's dy (bwd_sig, this epoch): tell them.
                self.abandon(ABORT_COMBINE, &e);
                Err(e)
            }
        }
    }

    fn launch_backward<G, I, W, R, X>(
        &mut self,
        dy: &G,
        topk_ids: &I,
        tokens: usize,
        d_weights: &mut W,
        dy_rows: &mut R,
        x_rows: &mut X,
    ) -> Result<(), CommError>
    where
        G: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtrMut<f32>,
        R: DevicePtrMut<bf16>,
        X: DevicePtrMut<bf16>,
    {
        self.check()?;
        match std::mem::replace(&mut self.pulled, PulledState::Idle) {
            PulledState::Forward { tokens: t } if t == tokens => {}
            PulledState::Forward { tokens: t } => {
                return Err(CommError::Unsupported(format!(
                    "backward_pull of {tokens} tokens after a forward of {t}"
                )))
            }
            PulledState::Idle => {
                return Err(CommError::Unsupported(
                    "backward_pull needs a pulled forward (dispatch_pull, combine_slots) and no backward since".into(),
                ))
            }
        }
        let (k, d, rows) = (self.cfg.top_k, self.cfg.hidden, self.recv_rows_capacity());
        check_len("dy", dy.len(), tokens * d)?;
        check_len("topk_ids", topk_ids.len(), tokens * k)?;
        check_len("d_weights", d_weights.len(), tokens * k)?;
        check_len("dy_rows", dy_rows.len(), rows * d)?;
        check_len("x_rows", x_rows.len(), rows * d)?;
        let s = self.stream.clone();
        let (gp, _gs) = dy.device_ptr(&s);
        let (ip, _is) = topk_ids.device_ptr(&s);
        let (wp, _ws) = d_weights.device_ptr_mut(&s);
        let (rp, _rs) = dy_rows.device_ptr_mut(&s);
        let (xp, _xs) = x_rows.device_ptr_mut(&s);
        self.operand("dy", gp, 16, tokens * d)?;
        self.operand("topk_ids", ip, 4, tokens * k)?;
        self.operand("d_weights", wp, 4, tokens * k)?;
        self.operand("dy_rows", rp, 16, rows * d)?;
        self.operand("x_rows", xp, 16, rows * d)?;
        let p = EpParams {
            tokens: tokens as i32,
            x: gp,
            topk_ids: ip,
            d_weights: wp,
            dy_rows: rp,
            x_rows: xp,
            ..self.base
        };
        // SAFETY: `p` mirrors `moefuse_ep_params`; bwd_publish reads dy, the ids and this
        // rank's y_slots and writes dy_home and d_weights; bwd_gather reads the peers'
        // dy_home and x_home (symmetric, owned by the instances of every rank) through the
        // forward's recv_src and writes the received rows' dy_rows and x_rows (at most
        // recv_rows_capacity rows, checked above). The caller's buffers were checked and
        // are kept alive by their guards until the launches are queued.
        unsafe {
            self.module
                .launch(self.kernels.bwd_publish, &s, self.grid, 256, 0, &p)?;
            self.module
                .launch(self.kernels.bwd_gather, &s, self.grid, 256, 0, &p)?;
        }
        Ok(())
    }
}

impl PullBackward<'_> {
    /// The forward's per-local-expert row ends (the received rows' grouping), on the device.
    pub fn offsets(&self) -> &CudaSlice<i32> {
        &self.ep.local.recv_offsets
    }

    /// Where each received row's `dx` row goes: its token's slot on the token's home rank
    /// (the forward's table; `hidden` bf16 each), for the dgrad's scattered store
    /// ([`DownScatter`](moefuse_kernels::DownScatter)).
    pub fn row_destinations(&self) -> moefuse_kernels::ScatterRows<'_> {
        let ep = &*self.ep;
        // SAFETY: as PullDispatch::row_destinations (the same table, still this call's:
        // no dispatch since the forward). Every home read its slots in bwd_publish before
        // raising the signal that this rank's bwd_gather waited for, and this rank's dgrad
        // follows that gather on its stream, so the slots are free to be overwritten; the
        // homes read them again only in combine, after every owner's signal.
        unsafe {
            moefuse_kernels::ScatterRows::new(
                ep.runtime.context(),
                &ep.local.recv_dst,
                ep.cfg.hidden,
            )
        }
    }

    /// After the dgrad stored every received row's `dx` row at its destination: tells
    /// every rank, waits for theirs, and sums each of this rank's tokens' valid slots (by
    /// the forward's `topk_ids`) in slot order (fp32, bf16 out) into `dx` (`[tokens,
    /// hidden]`; zeros for a token routed nowhere). Collective.
    ///
    /// ```no_run
    /// # fn demo(b: moefuse_comm::PullBackward<'_>, ids: &cudarc::driver::CudaSlice<i32>,
    /// #         dx: &mut cudarc::driver::CudaSlice<half::bf16>) -> Result<(), moefuse_comm::CommError> {
    /// b.combine(ids, dx)?;
    /// # Ok(()) }
    /// ```
    pub fn combine<I, O>(mut self, topk_ids: &I, dx: &mut O) -> Result<(), CommError>
    where
        I: DevicePtr<i32>,
        O: DevicePtrMut<bf16>,
    {
        self.finished = true;
        let result = self.launch_combine(topk_ids, dx);
        if let Err(e) = &result {
            self.ep.abandon(ABORT_COMBINE, e);
        }
        result
    }

    fn launch_combine<I, O>(&mut self, topk_ids: &I, dx: &mut O) -> Result<(), CommError>
    where
        I: DevicePtr<i32>,
        O: DevicePtrMut<bf16>,
    {
        let sig = self.ep.base.bwd_comb_sig;
        let no_weights: Option<&CudaSlice<f32>> = None;
        self.ep
            .launch_slot_sum(self.tokens, topk_ids, no_weights, dx, sig)
    }
}

impl Drop for PullBackward<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let cause = CommError::Poisoned {
                cause: "a PullBackward was dropped without combine".into(),
            };
            self.ep.abandon(ABORT_COMBINE, &cause);
        }
    }
}
