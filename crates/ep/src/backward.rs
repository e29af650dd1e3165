//! The expert-parallel layer's backward ([`EpMoeLayer::backward`]) and what a Training layer
//! keeps for it ([`Training`]).
//!
//! Per call: dy is sent to the experts' ranks by the forward's routing through the second
//! exchange (weights 1, so its combine is the plain per-token sum dx needs); on the expert
//! side `dy_w = w · dy` and `s = ⟨dy, y_e⟩` per received row (the single-GPU combine
//! backward with one slot per row), the down dgrad/wgrad, the activation backward and the
//! gate_up dgrad/wgrad on the saved rows; dx returns through the second exchange's combine;
//! `s` returns through the third (slot j's value in column j).

use crate::error::need;
use crate::exchange::{ExchangeLayer, LocalWeights};
use crate::EpError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse::gpu::{activation_backward, combine_backward, route_backward, DeviceErrors, Rows};
use moefuse::MoeConfig;
use moefuse_comm::{EpConfig, ExpertParallel, Runtime};
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use moefuse_kernels::{ColumnsToF32, Kernels, ScatterColumns};
use std::sync::Arc;

/// The gradients of one backward, on this rank: its experts' weight gradients
/// (`d_gate_up [E/N, W, D]`, `d_down [E/N, D, I]`), and per token slot `d_topk_weights
/// [max_tokens, k]`, plus `d_logits [max_tokens, E]` when the forward routed from logits
/// (the first `T·k` and `T·E` are this call's): the single-GPU layer's
/// [`Gradients`](moefuse::gpu::Gradients) over this rank's experts.
pub type EpGradients = moefuse::gpu::Gradients;

/// A Training layer's backward state.
pub(crate) struct Training {
    dy_ep: ExpertParallel,
    s_ep: ExpertParallel,
    s_width: usize,
    down_dgrad: GroupedPlan,
    gate_up_dgrad: GroupedPlan,
    down_wgrad: [GroupedPlan; 2],
    gate_up_wgrad: [GroupedPlan; 2],
    logits: CudaSlice<f32>,
    identity: CudaSlice<i32>,
    ones: CudaSlice<f32>,
    s_zeros: CudaSlice<bf16>,
    dy_perm: CudaSlice<bf16>,
    dh: CudaSlice<bf16>,
    d_h_pre: CudaSlice<bf16>,
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
        m.add_exchange(self.dy_ep.memory());
        m.add_exchange(self.s_ep.memory());
        let bf16s = self.s_zeros.len()
            + self.dy_perm.len()
            + self.dh.len()
            + self.d_h_pre.len()
            + self.dx_perm.len()
            + self.s_rows.len()
            + self.s_home.len();
        let words = self.logits.len() + self.identity.len() + self.ones.len() + self.s.len();
        m.layer += 2 * bf16s + 4 * words;
    }

    pub(crate) fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        gemm: &GroupedGemm,
        c: &MoeConfig,
        max_tokens: usize,
        local: usize,
        rows: usize,
    ) -> Result<Self, EpError> {
        let (d, i, w, k, e) = (
            c.hidden,
            c.intermediate,
            c.gate_up_width(),
            c.top_k,
            c.experts,
        );
        // The values' exchange: one column per slot, rows of 16 bytes at least.
        let s_width = k.div_ceil(8) * 8;
        let dy_ep = ExpertParallel::new(runtime, stream, EpConfig::new(e, k, d, max_tokens))?;
        let s_ep = ExpertParallel::new(runtime, stream, EpConfig::new(e, k, s_width, max_tokens))?;
        if dy_ep.recv_rows_capacity() != rows || s_ep.recv_rows_capacity() != rows {
            return Err(EpError::Config(
                "the backward's exchanges hold another row count than the forward's".into(),
            ));
        }
        let wgrad = |n: usize, kk: usize| -> Result<[GroupedPlan; 2], EpError> {
            let (desc, _) = GroupedDesc::wgrad_for(local, rows, n, kk, BLayout::Nk);
            Ok([
                gemm.plan(&desc)?,
                gemm.plan(&GroupedDesc { beta: 1.0, ..desc })?,
            ])
        };
        let z16 = |n: usize| stream.alloc_zeros::<bf16>(n.max(1));
        let z32 = |n: usize| stream.alloc_zeros::<f32>(n.max(1));
        let slots = max_tokens * k;
        let identity: Vec<i32> = (0..rows as i32).collect();
        Ok(Training {
            down_dgrad: gemm.plan(&GroupedDesc::dgrad(local, rows, d, i, BLayout::Nk))?,
            gate_up_dgrad: gemm.plan(&GroupedDesc::dgrad(local, rows, w, d, BLayout::Nk))?,
            down_wgrad: wgrad(d, i)?,
            gate_up_wgrad: wgrad(w, d)?,
            logits: z32(max_tokens * e)?,
            identity: stream.clone_htod(&identity)?,
            ones: stream.clone_htod(&vec![1f32; slots.max(1)])?,
            s_zeros: z16(max_tokens * s_width)?,
            dy_perm: z16(rows * d)?,
            dh: z16(rows * i)?,
            d_h_pre: z16(rows * w)?,
            dx_perm: z16(rows * d)?,
            s: z32(rows)?,
            s_rows: z16(rows * s_width)?,
            s_home: z16(max_tokens * s_width)?,
            errors: DeviceErrors::new(stream)?,
            dy_ep,
            s_ep,
            s_width,
        })
    }

    pub(crate) fn plans(&self) -> impl Iterator<Item = &GroupedPlan> {
        [&self.down_dgrad, &self.gate_up_dgrad]
            .into_iter()
            .chain(self.down_wgrad.iter())
            .chain(self.gate_up_wgrad.iter())
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
    /// logits. Collective; needs a Training layer and a forward that returned `Ok`.
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
        let (tr, ids, gws) = (parts.train, parts.ids, parts.gemm_ws);
        // The forward's received rows, weights, offsets and origins, still in its exchange's
        // buffers (the backward's own exchanges leave them alone).
        let (x_recv, w_recv) = (parts.ep.received_x(), parts.ep.received_weights());
        let (offsets, origin) = (parts.ep.received_offsets(), parts.ep.received_origin());
        let kernels: &Kernels = gemm.kernels();
        let acc = usize::from(accumulate);
        let s = &stream;
        let count = offsets.slice(local - 1..);

        // dy out by the forward's routing, unweighted (its combine is dx's plain sum).
        let dd = tr.dy_ep.dispatch(dy, ids, &tr.ones, t)?;
        combine_backward(
            s,
            rows,
            1,
            d,
            &tr.identity,
            w_recv,
            dd.x(),
            parts.y_e,
            &mut tr.dy_perm,
            &mut tr.s,
            &mut tr.errors,
        )?;
        let off = offsets;
        gemm.run(
            &tr.down_dgrad,
            s,
            off,
            &tr.dy_perm,
            &weights.down,
            &mut tr.dh,
            gws,
        )?;
        gemm.run(
            &tr.down_wgrad[acc],
            s,
            off,
            &tr.dy_perm,
            parts.h,
            &mut grads.d_down,
            gws,
        )?;
        let live = Rows::from_device(&count, rows);
        activation_backward(act, s, live, parts.h_pre, &tr.dh, &mut tr.d_h_pre)?;
        let gu = &weights.gate_up;
        gemm.run(
            &tr.gate_up_dgrad,
            s,
            off,
            &tr.d_h_pre,
            gu,
            &mut tr.dx_perm,
            gws,
        )?;
        let d_gu = &mut grads.d_gate_up;
        gemm.run(
            &tr.gate_up_wgrad[acc],
            s,
            off,
            &tr.d_h_pre,
            x_recv,
            d_gu,
            gws,
        )?;
        dd.combine(&tr.dx_perm, dx)?;

        // Each slot's ⟨dy, y_e⟩ back: slot j's value in column j of its row.
        let origin_slot = origin.slice(2..);
        kernels.launch(
            s,
            ScatterColumns {
                rows,
                width: tr.s_width,
                col_stride: 3,
                count: Some(&count),
                col_of: &origin_slot,
                values: &tr.s,
                out: &mut tr.s_rows,
                errors: None,
            },
        )?;
        let ds = tr.s_ep.dispatch(&tr.s_zeros, ids, &tr.ones, t)?;
        ds.combine(&tr.s_rows, &mut tr.s_home)?;
        kernels.launch(
            s,
            ColumnsToF32 {
                rows: t,
                width: tr.s_width,
                cols: k,
                input: &tr.s_home,
                out: &mut grads.d_topk_weights,
            },
        )?;
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
