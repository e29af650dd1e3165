//! [`MoeLayer::forward`] and [`MoeLayer::backward`]: the layer's stages in order, each
//! launched through the layer's one kernel handle (see the parent module's docs).

use super::{MoeLayer, Routing};
use crate::gpu::activation::{activation_backward_with, activation_forward_with};
use crate::gpu::permute::{combine_backward_impl, combine_impl, permute_with};
use crate::gpu::router::{route_backward_with, route_with};
use crate::gpu::{check_buffer, check_len, Gradients, Rows};
use crate::{MoeError, RouterKind};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

impl MoeLayer {
    /// `y [T, D] = MoE(x [T, D])` (bf16), routed per `routing`. Keeps what the backward needs.
    pub fn forward<X, Y>(
        &mut self,
        x: &X,
        tokens: usize,
        routing: Routing<'_>,
        y: &mut Y,
    ) -> Result<(), MoeError>
    where
        X: DevicePtr<bf16>,
        Y: DevicePtrMut<bf16>,
    {
        // Whatever happens below, the state of an earlier forward is gone.
        self.forwarded = false;
        let (d, e, k) = (self.cfg.hidden, self.cfg.experts, self.cfg.top_k);
        self.cfg.check_tokens(tokens)?;
        if tokens > self.max_tokens {
            return Err(MoeError::TokensOutOfRange {
                tokens,
                max: self.max_tokens,
            });
        }
        let s = self.stream.clone();
        // tokens <= 65536, k <= 16, D, E bounded by validate(): no product overflows.
        check_buffer("x [T, D]", x, tokens * d, &s)?;
        check_buffer("y [T, D]", y, tokens * d, &s)?;
        match &routing {
            Routing::Logits(logits) => {
                if matches!(self.cfg.router, RouterKind::External) {
                    return Err(MoeError::ExternalRouter);
                }
                check_buffer("logits [T, E]", *logits, tokens * e, &s)?;
            }
            Routing::Host {
                topk_ids,
                topk_weights,
            } => {
                check_len("topk_ids [T, k]", topk_ids.len(), tokens * k)?;
                check_len("topk_weights [T, k]", topk_weights.len(), tokens * k)?;
                crate::reference::router::check_routing(&topk_ids[..tokens * k], k, e)?;
            }
            Routing::External {
                topk_ids,
                topk_weights,
            } => {
                check_buffer("topk_ids [T, k]", *topk_ids, tokens * k, &s)?;
                check_buffer("topk_weights [T, k]", *topk_weights, tokens * k, &s)?;
            }
        }
        if let Some(ev) = self.profile.as_mut() {
            ev.clear();
        }
        Self::mark(&mut self.profile, &s, "start")?;
        let kernels = Some(self.gemm.kernels());
        let sv = &mut self.saved;
        match routing {
            Routing::Logits(logits) => {
                s.memcpy_dtod(
                    &logits.slice(..tokens * e),
                    &mut sv.logits.slice_mut(..tokens * e),
                )?;
                let bias = self.bias.as_ref().map(|b| b as &dyn DevicePtr<f32>);
                route_with(
                    kernels,
                    &self.cfg,
                    &s,
                    tokens,
                    &sv.logits,
                    bias,
                    &mut sv.ids,
                    &mut sv.weights,
                )?;
                sv.routed = true;
            }
            Routing::Host {
                topk_ids,
                topk_weights,
            } => {
                s.memcpy_htod(&topk_ids[..tokens * k], &mut sv.ids.slice_mut(..tokens * k))?;
                s.memcpy_htod(
                    &topk_weights[..tokens * k],
                    &mut sv.weights.slice_mut(..tokens * k),
                )?;
                sv.routed = false;
            }
            Routing::External {
                topk_ids,
                topk_weights,
            } => {
                s.memcpy_dtod(
                    &topk_ids.slice(..tokens * k),
                    &mut sv.ids.slice_mut(..tokens * k),
                )?;
                s.memcpy_dtod(
                    &topk_weights.slice(..tokens * k),
                    &mut sv.weights.slice_mut(..tokens * k),
                )?;
                sv.routed = false;
            }
        }
        sv.tokens = tokens;
        Self::mark(&mut self.profile, &s, "route")?;
        permute_with(
            kernels,
            &s,
            tokens,
            e,
            k,
            d,
            &sv.ids,
            Some(x as &dyn DevicePtr<bf16>),
            &mut sv.perm,
            Some(&mut sv.x_perm),
        )?;
        Self::mark(&mut self.profile, &s, "permute+gather")?;
        let ws = &mut self.scratch.workspace;
        let gemm = &self.gemm;
        gemm.run(
            &self.plans.gate_up,
            &s,
            &sv.perm.offsets,
            &sv.x_perm,
            &self.gate_up,
            &mut sv.h_pre,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "gate_up gemm")?;
        let rows_cap = self.max_tokens * k;
        let last = sv.perm.offsets.slice(e - 1..);
        activation_forward_with(
            kernels,
            &self.act,
            &s,
            Rows::from_device(&last, rows_cap),
            &sv.h_pre,
            &mut sv.h,
        )?;
        Self::mark(&mut self.profile, &s, "activation")?;
        gemm.run(
            &self.plans.down,
            &s,
            &sv.perm.offsets,
            &sv.h,
            &self.down,
            &mut sv.y_e,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "down gemm")?;
        combine_impl(
            kernels,
            &s,
            tokens,
            k,
            d,
            &sv.perm.row_of,
            Some(&sv.weights),
            &sv.y_e,
            y,
            &mut sv.perm.errors,
            false,
        )?;
        Self::mark(&mut self.profile, &s, "combine")?;
        self.forwarded = true;
        Ok(())
    }

    /// Gradients of the last forward for `dy [T, D]`: `dx [T, D]` (from the experts; the
    /// router matrix's share `d_logits · Wr` is the caller's), and into `grads` the weight
    /// gradients (added to their content when `accumulate`), `d_topk_weights`, and
    /// `d_logits` when the layer routed.
    pub fn backward<G, X>(
        &mut self,
        dy: &G,
        dx: &mut X,
        grads: &mut Gradients,
        accumulate: bool,
    ) -> Result<(), MoeError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        if !self.forwarded {
            return Err(MoeError::NoForward);
        }
        let (d, e, k) = (self.cfg.hidden, self.cfg.experts, self.cfg.top_k);
        let s = self.stream.clone();
        let kernels = Some(self.gemm.kernels());
        let sv = &mut self.saved;
        let t = sv.tokens;
        check_buffer("dy [T, D]", dy, t * d, &s)?;
        check_buffer("dx [T, D]", dx, t * d, &s)?;
        check_buffer(
            "d_gate_up [E, W, D]",
            &grads.d_gate_up,
            self.gate_up.len(),
            &s,
        )?;
        check_buffer("d_down [E, D, I]", &grads.d_down, self.down.len(), &s)?;
        check_buffer("d_topk_weights [T, k]", &grads.d_topk_weights, t * k, &s)?;
        if sv.routed {
            check_buffer("d_logits [T, E]", &grads.d_logits, t * e, &s)?;
        }
        if let Some(ev) = self.profile.as_mut() {
            ev.clear();
        }
        Self::mark(&mut self.profile, &s, "start")?;
        let sc = &mut self.scratch;
        combine_backward_impl(
            kernels,
            &s,
            t,
            k,
            d,
            &sv.perm.row_of,
            &sv.weights,
            dy,
            &sv.y_e,
            &mut sc.dy_perm,
            &mut grads.d_topk_weights,
            &mut sv.perm.errors,
            true,
        )?;
        Self::mark(&mut self.profile, &s, "combine bwd")?;
        let gemm = &self.gemm;
        let off = &sv.perm.offsets;
        let ws = &mut sc.workspace;
        let acc = usize::from(accumulate);
        gemm.run(
            &self.plans.down_dgrad,
            &s,
            off,
            &sc.dy_perm,
            &self.down,
            &mut sc.dh,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "down dgrad")?;
        gemm.run(
            &self.plans.down_wgrad[acc],
            &s,
            off,
            &sc.dy_perm,
            &sv.h,
            &mut grads.d_down,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "down wgrad")?;
        let rows_cap = self.max_tokens * k;
        let last = off.slice(e - 1..);
        activation_backward_with(
            kernels,
            &self.act,
            &s,
            Rows::from_device(&last, rows_cap),
            &sv.h_pre,
            &sc.dh,
            &mut sc.d_h_pre,
        )?;
        Self::mark(&mut self.profile, &s, "activation bwd")?;
        gemm.run(
            &self.plans.gate_up_dgrad,
            &s,
            off,
            &sc.d_h_pre,
            &self.gate_up,
            &mut sc.dx_perm,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "gate_up dgrad")?;
        gemm.run(
            &self.plans.gate_up_wgrad[acc],
            &s,
            off,
            &sc.d_h_pre,
            &sv.x_perm,
            &mut grads.d_gate_up,
            ws,
        )?;
        Self::mark(&mut self.profile, &s, "gate_up wgrad")?;
        combine_impl(
            kernels,
            &s,
            t,
            k,
            d,
            &sv.perm.row_of,
            None,
            &sc.dx_perm,
            dx,
            &mut sv.perm.errors,
            true,
        )?;
        Self::mark(&mut self.profile, &s, "dx combine")?;
        if sv.routed {
            route_backward_with(
                kernels,
                &self.cfg,
                &s,
                t,
                &sv.logits,
                &sv.ids,
                &grads.d_topk_weights,
                &mut grads.d_logits,
            )?;
            Self::mark(&mut self.profile, &s, "router bwd")?;
        }
        Ok(())
    }
}
