//! The expert-parallel layer's backward ([`EpMoeLayer::backward`]) and what a Training layer
//! keeps for it ([`Training`]).
//!
//! Per call: dy is sent to the experts' ranks by the forward's routing through the second
//! exchange (weights 1, so its combine is the plain per-token sum dx needs); on the expert
//! side `dy_w = w · dy` and `s = ⟨dy, y_e⟩` per received row (the single-GPU combine
//! backward with one slot per row), the down dgrad/wgrad, the activation backward and the
//! gate_up dgrad/wgrad on the saved rows; dx returns through the second exchange's combine;
//! `s` returns through the third (slot j's value in column j).
//!
//! With pulled rows ([`RowDelivery::Pull`](crate::RowDelivery)) the forward's own exchange
//! carries the backward ([`moefuse_comm::PullBackward`]): each home computes its tokens'
//! `d_topk_weights` from the expert outputs already in its slots and publishes dy; each
//! owner gathers `w · dy` and `x` of its received rows from the homes, runs the down
//! dgrad/wgrad, the activation backward and the gate_up wgrad on them, and its gate_up
//! dgrad stores every `dx` row into the token's slot at home, where the slots are summed.

use crate::error::need;
use crate::exchange::{ExchangeLayer, LocalWeights, Parts};
use crate::EpError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse::gpu::ActivationDesc;
use moefuse::gpu::{activation_backward, combine_backward, route_backward, DeviceErrors, Rows};
use moefuse::MoeConfig;
use moefuse_comm::{EpConfig, ExpertParallel, Runtime};
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use moefuse_kernels::{ColumnsToF32, DownScatter, Kernels, ScatterColumns, ScatterWeights};
use std::sync::Arc;

/// The gradients of one backward, on this rank: its experts' weight gradients
/// (`d_gate_up [E/N, W, D]`, `d_down [E/N, D, I]`), and per token slot `d_topk_weights
/// [max_tokens, k]`, plus `d_logits [max_tokens, E]` when the forward routed from logits
/// (the first `T·k` and `T·E` are this call's): the single-GPU layer's
/// [`Gradients`](moefuse::gpu::Gradients) over this rank's experts.
pub type EpGradients = moefuse::gpu::Gradients;

/// A Training layer's backward state.
pub(crate) struct Training {
    logits: CudaSlice<f32>,
    /// The local experts' part, both deliveries.
    local: LocalPart,
    /// What only the copied rows' backward needs; `None` when rows are pulled.
    copied: Option<Copied>,
}

/// The local experts' backward on the received rows: plans and buffers.
struct LocalPart {
    down_dgrad: GroupedPlan,
    down_wgrad: [GroupedPlan; 2],
    gate_up_wgrad: [GroupedPlan; 2],
    dy_perm: CudaSlice<bf16>,
    dh: CudaSlice<bf16>,
    d_h_pre: CudaSlice<bf16>,
    /// Pulled rows: the received rows' x, gathered from the homes (one element otherwise).
    x_rows: CudaSlice<bf16>,
}

/// The copied rows' backward exchanges and buffers.
struct Copied {
    dy_ep: ExpertParallel,
    s_ep: ExpertParallel,
    s_width: usize,
    gate_up_dgrad: GroupedPlan,
    identity: CudaSlice<i32>,
    ones: CudaSlice<f32>,
    s_zeros: CudaSlice<bf16>,
    dx_perm: CudaSlice<bf16>,
    s: CudaSlice<f32>,
    s_rows: CudaSlice<bf16>,
    s_home: CudaSlice<bf16>,
    /// The combine backward's error word (its identity rows never raise a bit).
    errors: DeviceErrors,
}

impl Training {
    /// The backward's two exchanges and its own buffers into `m`.
    pub(crate) fn add_memory(&self, m: &mut crate::EpLayerMemory) {
        let l = &self.local;
        let mut bf16s = l.dy_perm.len() + l.dh.len() + l.d_h_pre.len() + l.x_rows.len();
        let mut words = self.logits.len();
        if let Some(c) = &self.copied {
            m.add_exchange(c.dy_ep.memory());
            m.add_exchange(c.s_ep.memory());
            bf16s += c.s_zeros.len() + c.dx_perm.len() + c.s_rows.len() + c.s_home.len();
            words += c.identity.len() + c.ones.len() + c.s.len();
        }
        m.layer += 2 * bf16s + 4 * words;
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        gemm: &GroupedGemm,
        c: &MoeConfig,
        max_tokens: usize,
        local: usize,
        rows: usize,
        pulled: bool,
    ) -> Result<Self, EpError> {
        let (d, i, w, e) = (c.hidden, c.intermediate, c.gate_up_width(), c.experts);
        let wgrad = |n: usize, kk: usize| -> Result<[GroupedPlan; 2], EpError> {
            let (desc, _) = GroupedDesc::wgrad_for(local, rows, n, kk, BLayout::Nk);
            Ok([
                gemm.plan(&desc)?,
                gemm.plan(&GroupedDesc { beta: 1.0, ..desc })?,
            ])
        };
        let z16 = |n: usize| stream.alloc_zeros::<bf16>(n.max(1));
        let copied = if pulled {
            None
        } else {
            Some(Copied::new(
                runtime, stream, gemm, c, max_tokens, local, rows,
            )?)
        };
        Ok(Training {
            logits: stream.alloc_zeros::<f32>((max_tokens * e).max(1))?,
            local: LocalPart {
                down_dgrad: gemm.plan(&GroupedDesc::dgrad(local, rows, d, i, BLayout::Nk))?,
                down_wgrad: wgrad(d, i)?,
                gate_up_wgrad: wgrad(w, d)?,
                dy_perm: z16(rows * d)?,
                dh: z16(rows * i)?,
                d_h_pre: z16(rows * w)?,
                x_rows: z16(if pulled { rows * d } else { 1 })?,
            },
            copied,
        })
    }

    pub(crate) fn plans(&self) -> impl Iterator<Item = &GroupedPlan> {
        [&self.local.down_dgrad]
            .into_iter()
            .chain(self.copied.iter().map(|c| &c.gate_up_dgrad))
            .chain(self.local.down_wgrad.iter())
            .chain(self.local.gate_up_wgrad.iter())
    }

    pub(crate) fn save_logits(
        &mut self,
        s: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), EpError> {
        s.memcpy_dtod(&logits.slice(..n), &mut self.logits.slice_mut(..n))?;
        Ok(())
    }
}

impl Copied {
    fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        gemm: &GroupedGemm,
        c: &MoeConfig,
        max_tokens: usize,
        local: usize,
        rows: usize,
    ) -> Result<Self, EpError> {
        let (d, w, k, e) = (c.hidden, c.gate_up_width(), c.top_k, c.experts);
        // The values' exchange: one column per slot, rows of 16 bytes at least.
        let s_width = k.div_ceil(8) * 8;
        let dy_ep = ExpertParallel::new(runtime, stream, EpConfig::new(e, k, d, max_tokens))?;
        let s_ep = ExpertParallel::new(runtime, stream, EpConfig::new(e, k, s_width, max_tokens))?;
        if dy_ep.recv_rows_capacity() != rows || s_ep.recv_rows_capacity() != rows {
            return Err(EpError::Config(
                "the backward's exchanges hold another row count than the forward's".into(),
            ));
        }
        let z16 = |n: usize| stream.alloc_zeros::<bf16>(n.max(1));
        let slots = max_tokens * k;
        let identity: Vec<i32> = (0..rows as i32).collect();
        Ok(Copied {
            gate_up_dgrad: gemm.plan(&GroupedDesc::dgrad(local, rows, w, d, BLayout::Nk))?,
            identity: stream.clone_htod(&identity)?,
            ones: stream.clone_htod(&vec![1f32; slots.max(1)])?,
            s_zeros: z16(max_tokens * s_width)?,
            dx_perm: z16(rows * d)?,
            s: stream.alloc_zeros::<f32>(rows.max(1))?,
            s_rows: z16(rows * s_width)?,
            s_home: z16(max_tokens * s_width)?,
            errors: DeviceErrors::new(stream)?,
            dy_ep,
            s_ep,
            s_width,
        })
    }
}

impl ExchangeLayer {
    /// Gradient buffers for this layer's backward (zeroed).
    pub fn gradients(&self) -> Result<EpGradients, EpError> {
        let c = self.config();
        let (local, s) = (self.local_experts(), self.stream());
        let t = self.max_tokens();
        Ok(EpGradients {
            d_gate_up: s.alloc_zeros(local * c.gate_up_width() * c.hidden)?,
            d_down: s.alloc_zeros(local * c.hidden * c.intermediate)?,
            d_topk_weights: s.alloc_zeros((t * c.top_k).max(1))?,
            d_logits: s.alloc_zeros((t * c.experts).max(1))?,
        })
    }

    /// Gradients of the last forward for `dy [T, D]` (this rank's tokens): `dx [T, D]`, and
    /// into `grads` the local experts' weight gradients (added to their content when
    /// `accumulate`), `d_topk_weights`, and `d_logits` when the forward routed from
    /// logits. Collective; needs a Training layer and a forward that returned `Ok` (with
    /// pulled rows, one backward per forward: the backward reuses the forward's slots).
    pub fn backward<G, X>(
        &mut self,
        weights: &LocalWeights<'_>,
        dy: &G,
        dx: &mut X,
        grads: &mut EpGradients,
        accumulate: bool,
    ) -> Result<(), EpError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        let last = self.last.ok_or_else(|| {
            EpError::Config("backward needs a Training layer and a successful forward".into())
        })?;
        let c = *self.config();
        let (t, d, k) = (last.tokens, c.hidden, c.top_k);
        need("dy [T, D]", dy.len(), t * d)?;
        need("dx [T, D]", dx.len(), t * d)?;
        need("d_topk_weights [T, k]", grads.d_topk_weights.len(), t * k)?;
        need("d_logits [T, E]", grads.d_logits.len(), t * c.experts)?;
        let local = self.local_experts();
        need(
            "d_gate_up",
            grads.d_gate_up.len(),
            local * c.gate_up_width() * d,
        )?;
        need("d_down", grads.d_down.len(), local * d * c.intermediate)?;
        let rows = self.recv_rows_capacity();
        let stream = self.stream().clone();
        let (parts, gemm, act) = self.backward_parts().ok_or_else(|| {
            EpError::Config("backward needs a layer built in Mode::Training".into())
        })?;
        let acc = usize::from(accumulate);
        let mut parts = parts;
        let ctx = Ctx {
            gemm,
            act,
            weights,
            s: &stream,
            cfg: c,
            t,
            rows,
            local,
            acc,
        };
        if parts.train.copied.is_some() {
            ctx.copied(&mut parts, dy, dx, grads)?;
        } else {
            ctx.pulled(&mut parts, dy, dx, grads)?;
        }
        let (tr, ids, s) = (&parts.train, parts.ids, &stream);
        if last.routed {
            route_backward(
                &c,
                s,
                t,
                &tr.logits,
                ids,
                &grads.d_topk_weights,
                &mut grads.d_logits,
            )?;
        }
        Ok(())
    }
}

/// What both backwards read.
struct Ctx<'a, 'w> {
    gemm: &'a GroupedGemm,
    act: &'a ActivationDesc,
    weights: &'a LocalWeights<'w>,
    s: &'a Arc<CudaStream>,
    cfg: MoeConfig,
    t: usize,
    rows: usize,
    local: usize,
    acc: usize,
}

impl Ctx<'_, '_> {
    /// The local experts' part, on the received rows (whichever way they came): `dh = dy_w ·
    /// W_down`, `dW_down (+)= dy_wᵀ · h`, the activation backward into `d_h_pre`, and
    /// `dW_gate_up (+)= d_h_preᵀ · x` over `x_rows` (`None`: the pulled rows' `tr.x_rows`).
    #[allow(clippy::too_many_arguments)]
    fn local_experts(
        &self,
        tr: &mut LocalPart,
        h: &CudaSlice<bf16>,
        h_pre: &CudaSlice<bf16>,
        offsets: &CudaSlice<i32>,
        x_rows: Option<&CudaSlice<bf16>>,
        grads: &mut EpGradients,
        gws: &mut CudaSlice<u8>,
    ) -> Result<(), EpError> {
        let (gemm, s, acc) = (self.gemm, self.s, self.acc);
        let down = &self.weights.down;
        gemm.run(
            &tr.down_dgrad,
            s,
            offsets,
            &tr.dy_perm,
            down,
            &mut tr.dh,
            gws,
        )?;
        let d_down = &mut grads.d_down;
        gemm.run(&tr.down_wgrad[acc], s, offsets, &tr.dy_perm, h, d_down, gws)?;
        let count = offsets.slice(self.local - 1..);
        let live = Rows::from_device(&count, self.rows);
        activation_backward(self.act, s, live, h_pre, &tr.dh, &mut tr.d_h_pre)?;
        let x = x_rows.unwrap_or(&tr.x_rows);
        let d_gate_up = &mut grads.d_gate_up;
        gemm.run(
            &tr.gate_up_wgrad[acc],
            s,
            offsets,
            &tr.d_h_pre,
            x,
            d_gate_up,
            gws,
        )?;
        Ok(())
    }

    /// Copied rows: dy out and dx back through the second exchange, the values through the
    /// third.
    fn copied<G, X>(
        &self,
        parts: &mut Parts<'_>,
        dy: &G,
        dx: &mut X,
        grads: &mut EpGradients,
    ) -> Result<(), EpError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        let (tr, ids, gws) = (&mut *parts.train, parts.ids, &mut *parts.gemm_ws);
        let Some(cp) = tr.copied.as_mut() else {
            return Err(EpError::Config(
                "a pulled layer has no copied backward".into(),
            ));
        };
        let lp = &mut tr.local;
        let (gemm, weights, s) = (self.gemm, self.weights, self.s);
        let (t, rows, local) = (self.t, self.rows, self.local);
        let (d, k) = (self.cfg.hidden, self.cfg.top_k);
        // The forward's received rows, weights, offsets and origins, still in its exchange's
        // buffers (the backward's own exchanges leave them alone).
        let (x_recv, w_recv) = (parts.ep.received_x(), parts.ep.received_weights());
        let (offsets, origin) = (parts.ep.received_offsets(), parts.ep.received_origin());
        let kernels: &Kernels = gemm.kernels();
        let count = offsets.slice(local - 1..);

        // dy out by the forward's routing, unweighted (its combine is dx's plain sum).
        let dd = cp.dy_ep.dispatch(dy, ids, &cp.ones, t)?;
        combine_backward(
            s,
            rows,
            1,
            d,
            &cp.identity,
            w_recv,
            dd.x(),
            parts.y_e,
            &mut lp.dy_perm,
            &mut cp.s,
            &mut cp.errors,
        )?;
        self.local_experts(lp, parts.h, parts.h_pre, offsets, Some(x_recv), grads, gws)?;
        gemm.run(
            &cp.gate_up_dgrad,
            s,
            offsets,
            &lp.d_h_pre,
            &weights.gate_up,
            &mut cp.dx_perm,
            gws,
        )?;
        dd.combine(&cp.dx_perm, dx)?;

        // Each slot's ⟨dy, y_e⟩ back: slot j's value in column j of its row.
        let origin_slot = origin.slice(2..);
        kernels.launch(
            s,
            ScatterColumns {
                rows,
                width: cp.s_width,
                col_stride: 3,
                count: Some(&count),
                col_of: &origin_slot,
                values: &cp.s,
                out: &mut cp.s_rows,
                errors: None,
            },
        )?;
        let ds = cp.s_ep.dispatch(&cp.s_zeros, ids, &cp.ones, t)?;
        ds.combine(&cp.s_rows, &mut cp.s_home)?;
        kernels.launch(
            s,
            ColumnsToF32 {
                rows: t,
                width: cp.s_width,
                cols: k,
                input: &cp.s_home,
                out: &mut grads.d_topk_weights,
            },
        )?;
        Ok(())
    }

    /// Pulled rows: the forward's own exchange carries dy out (gathered by this rank from
    /// the homes, with x), the values stay home (computed from the slots there), and each
    /// dx row goes into its token's slot at home through the gate_up dgrad's store.
    fn pulled<G, X>(
        &self,
        parts: &mut Parts<'_>,
        dy: &G,
        dx: &mut X,
        grads: &mut EpGradients,
    ) -> Result<(), EpError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        let (tr, ids, gws) = (&mut *parts.train, parts.ids, &mut *parts.gemm_ws);
        let (gemm, weights, s) = (self.gemm, self.weights, self.s);
        let (t, rows, local) = (self.t, self.rows, self.local);
        let (d, w) = (self.cfg.hidden, self.cfg.gate_up_width());
        // d_topk_weights at home, w · dy and x of every received row here.
        let lp = &mut tr.local;
        let b = parts.ep.backward_pull(
            dy,
            ids,
            t,
            &mut grads.d_topk_weights,
            &mut lp.dy_perm,
            &mut lp.x_rows,
        )?;
        let offsets = b.offsets();
        self.local_experts(lp, parts.h, parts.h_pre, offsets, None, grads, gws)?;
        // dx = d_h_pre · W_gate_up, each row stored into its token's slot at home.
        let dst = b.row_destinations();
        let dgrad = DownScatter {
            rows,
            experts: local,
            hidden: d,
            intermediate: w,
            weights: ScatterWeights::InByOut,
            offsets,
            h: &lp.d_h_pre,
            w: &weights.gate_up,
            dst: &dst,
        };
        gemm.kernels().launch(s, dgrad)?;
        drop(dst);
        Ok(b.combine(ids, dx)?)
    }
}
