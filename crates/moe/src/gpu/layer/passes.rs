//! [`MoeLayer::forward`] and [`MoeLayer::backward`]: every host-knowable check first, then
//! the stages in order, each wrapped by the profiler (see the parent module's docs).

use super::plan::{DH, DX_PERM, DY_PERM, D_H_PRE, H, H_PRE, H_SCALED, X_AGAIN, X_PERM, Y_E};
use super::{
    GateUpPath, LastForward, Mode, MoeLayer, MoeWorkspace, Routing, RoutingState, Saved, Weights,
};
use crate::gpu::{check_buffer, check_len, DecodeSaved, Gradients};
use crate::{model::check_routing, MoeError, RouterKind};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use half::bf16;
use moefuse_grouped_gemm::GatheredOperand::{A, B};

impl MoeLayer {
    /// `y [T, D] = MoE(x [T, D])` (bf16) with the caller's `weights`, routed per
    /// `routing`, on the layer's stream. Every shape, buffer, device and host routing is
    /// checked before anything is launched. Training keeps what the backward needs (in
    /// the layer); Inference keeps nothing, its intermediates live in `workspace`.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{DeviceWeights, Mode, MoeLayer, MoePlan, MoeWorkspace, Routing},
    /// #     model::MoeWeights, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let stream = ctx.new_stream()?;
    /// let cfg = MoeConfig::new(128, 64, 8, 2);
    /// let plan = MoePlan::new(cfg, 32)?;
    /// let weights = DeviceWeights::upload(&stream, &cfg, &MoeWeights::zeros(&cfg, false))?;
    /// let mut ws = MoeWorkspace::new(&stream, plan.workspace_bytes(Mode::Inference))?;
    /// let mut layer = MoeLayer::new(&stream, &plan, Mode::Inference)?;
    /// let x = stream.alloc_zeros::<half::bf16>(32 * 128)?;
    /// let logits = stream.alloc_zeros::<f32>(32 * 8)?;
    /// let mut y = stream.alloc_zeros::<half::bf16>(32 * 128)?;
    /// layer.forward(&weights.view(), &x, 32, Routing::Logits(&logits), &mut y, &mut ws)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn forward<X, Y>(
        &mut self,
        weights: &Weights<'_>,
        x: &X,
        tokens: usize,
        routing: Routing<'_>,
        y: &mut Y,
        workspace: &mut MoeWorkspace,
    ) -> Result<(), MoeError>
    where
        X: DevicePtr<bf16>,
        Y: DevicePtrMut<bf16>,
    {
        // Whatever happens below, the state of an earlier forward is gone.
        self.last = None;
        self.check_forward(weights, x, tokens, &routing, &*y, workspace)?;
        if self.takes_decode_path(tokens) {
            return self.forward_decode(weights, x, tokens, routing, y, workspace);
        }
        let (t, w, keep) = (tokens, weights, self.mode == Mode::Training);
        let (path, layout) = (self.gate_up_path_for(t), self.forward_layout_for(t));
        let (cx, cfg) = (cx!(self), self.plan.config());
        let [gate_up_plan, down_plan] = self.gemms.forward.for_tokens(cfg, t);
        let RoutingState {
            ids,
            weights: wts,
            perm,
            ..
        } = &mut self.routing;
        // Training keeps h_pre in the layer (and a copy of x); everything else is scratch.
        let (mut acts, logits, saved_x) = match &mut self.saved {
            Some(Saved {
                logits,
                x: sx,
                h_pre,
                identity,
            }) => (
                workspace.slots_with(layout, H_PRE, h_pre),
                logits.as_mut(),
                Some((sx, &*identity)),
            ),
            None => (workspace.slots(layout), None, None),
        };
        let (p, s, gws) = (&mut self.profile, cx.stream, &mut self.gemm_ws);
        p.begin(s)?;
        if let Some((sx, identity)) = saved_x {
            let copy = cx.gather_rows(t, 1, identity, x, sx, &mut perm.errors, false);
            p.stage(s, "save x", copy)?;
        }
        let r = p.stage(s, "route", cx.route(t, routing, w, ids, wts, logits, keep))?;
        // FusedGather (sm_90a): x is gathered inside the gate_up GEMM (no x_perm). Both
        // fused paths run the activation in the GEMM's epilogue.
        let in_gemm = path == GateUpPath::FusedGather;
        let mut x_perm = acts.get_mut(X_PERM);
        let x_perm = (!in_gemm).then_some(&mut x_perm as &mut dyn DevicePtrMut<bf16>);
        let permute = cx.permute(t, r.ids, x, perm, x_perm);
        p.stage(
            s,
            if in_gemm { "permute" } else { "permute+gather" },
            permute,
        )?;
        if path != GateUpPath::Unfused {
            let gate_up = cx.gate_up_fused_slots(t, x, in_gemm, keep, w, perm, &mut acts);
            p.stage(s, "gate_up+activation (fused)", gate_up)?;
        } else {
            let off = &perm.offsets;
            let (x_perm, mut h_pre) = acts.io(X_PERM, H_PRE);
            let gate_up = cx.gemm(gate_up_plan, off, &x_perm, &w.gate_up, &mut h_pre, gws);
            p.stage(s, "gate_up gemm", gate_up)?;
            let (h_pre, mut h) = acts.io(H_PRE, H);
            p.stage(s, "activation", cx.activation(off, &h_pre, &mut h))?;
        }
        let off = &perm.offsets;
        let (h, mut y_e) = acts.io(H, Y_E);
        p.stage(
            s,
            "down gemm",
            cx.gemm(down_plan, off, &h, &w.down, &mut y_e, gws),
        )?;
        let (row_of, errors, y_e) = (&perm.row_of, &mut perm.errors, acts.get(Y_E));
        let combine = cx.combine(t, row_of, Some(r.weights), &y_e, y, errors, false);
        p.stage(s, "combine", combine)?;
        let (routed, in_place) = (r.routed, r.in_place);
        self.last = Some(LastForward {
            tokens: t,
            routed,
            in_place,
        });
        Ok(())
    }

    /// The forward of few tokens (see [`MoeLayer::decode_path`]): (Training) the copy of
    /// `x`, route, then (Training) the permutation, then the two decode kernels, which in
    /// Training also write the `h_pre` rows the backward reads. The slot-major `h` they
    /// pass between them lives in the workspace.
    fn forward_decode(
        &mut self,
        w: &Weights<'_>,
        x: &dyn DevicePtr<bf16>,
        t: usize,
        routing: Routing<'_>,
        y: &mut dyn DevicePtrMut<bf16>,
        workspace: &mut MoeWorkspace,
    ) -> Result<(), MoeError> {
        let (cx, layout) = (cx!(self), self.forward_layout_for(t));
        let keep = self.mode == Mode::Training;
        let RoutingState {
            ids,
            weights: wts,
            perm,
            ..
        } = &mut self.routing;
        let (mut saved, logits) = match &mut self.saved {
            Some(Saved {
                logits,
                x: sx,
                h_pre,
                identity,
            }) => (Some((sx, h_pre, &*identity)), logits.as_mut()),
            None => (None, None),
        };
        let mut scratch = workspace.slots(layout);
        let mut h = scratch.get_mut(H);
        let (p, s) = (&mut self.profile, cx.stream);
        p.begin(s)?;
        if let Some((sx, _, identity)) = &mut saved {
            let copy = cx.gather_rows(t, 1, identity, x, &mut **sx, &mut perm.errors, false);
            p.stage(s, "save x", copy)?;
        }
        let r = p.stage(s, "route", cx.route(t, routing, w, ids, wts, logits, keep))?;
        // Training: the permutation (its rows are the backward's) and h_pre at those rows.
        let saved = match saved {
            Some((_, h_pre, _)) => {
                let permute = cx.permute(t, r.ids, x, perm, None);
                p.stage(s, "permute", permute)?;
                Some(DecodeSaved {
                    row_of: &perm.row_of,
                    h_pre: &mut *h_pre,
                    h: None,
                    y_e: None,
                })
            }
            None => None,
        };
        let errors = &mut perm.errors;
        let decode = cx.decode(t, x, w, r.ids, r.weights, &mut h, y, saved, errors);
        p.stage(s, "decode (gate_up+down)", decode)?;
        let (routed, in_place) = (r.routed, r.in_place);
        self.last = Some(LastForward {
            tokens: t,
            routed,
            in_place,
        });
        Ok(())
    }

    /// Gradients of the last forward for `dy [T, D]`, with the `weights` that forward
    /// used: `dx [T, D]` (from the experts; the router matrix's share `d_logits · Wr` is
    /// the caller's), and into `grads` the weight gradients (added to their content when
    /// `accumulate`), `d_topk_weights`, and `d_logits` when the layer routed. Needs a
    /// Training layer ([`MoeError::NotTraining`]) and a forward that returned `Ok`
    /// ([`MoeError::NoForward`]); everything is checked before anything is launched.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{DeviceWeights, Mode, MoeLayer, MoePlan, MoeWorkspace, Routing},
    /// #     model::MoeWeights, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let stream = ctx.new_stream()?;
    /// # let cfg = MoeConfig::new(128, 64, 8, 2);
    /// # let plan = MoePlan::new(cfg, 32)?;
    /// # let weights = DeviceWeights::upload(&stream, &cfg, &MoeWeights::zeros(&cfg, false))?;
    /// # let mut ws = MoeWorkspace::new(&stream, plan.workspace_bytes(Mode::Training))?;
    /// # let (x, logits) = (stream.alloc_zeros::<half::bf16>(32 * 128)?, stream.alloc_zeros::<f32>(32 * 8)?);
    /// # let (mut y, mut dx) = (stream.alloc_zeros::<half::bf16>(32 * 128)?, stream.alloc_zeros::<half::bf16>(32 * 128)?);
    /// let mut layer = MoeLayer::new(&stream, &plan, Mode::Training)?;
    /// let mut grads = layer.gradients()?;
    /// layer.forward(&weights.view(), &x, 32, Routing::Logits(&logits), &mut y, &mut ws)?;
    /// layer.backward(&weights.view(), &y, &mut dx, &mut grads, false, &mut ws)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn backward<G, X>(
        &mut self,
        weights: &Weights<'_>,
        dy: &G,
        dx: &mut X,
        grads: &mut Gradients,
        accumulate: bool,
        workspace: &mut MoeWorkspace,
    ) -> Result<(), MoeError>
    where
        G: DevicePtr<bf16>,
        X: DevicePtrMut<bf16>,
    {
        let last = self.check_backward(weights, dy, &*dx, grads, workspace)?;
        let fused = self.fuses_activation_backward();
        let uses = self
            .backward_scratch()
            .ok_or(MoeError::NotTraining { mode: self.mode })?;
        let (t, w, acc) = (last.tokens, weights, usize::from(accumulate));
        let (cx, p, gws) = (cx!(self), &mut self.profile, &mut self.gemm_ws);
        let (Some(g), Some(sv)) = (&self.gemms.backward, &self.saved) else {
            return Err(MoeError::NotTraining { mode: self.mode });
        };
        let RoutingState {
            ids,
            weights: wts,
            perm,
            dtw_partials,
        } = &mut self.routing;
        let (k, s) = (self.plan.config().top_k, cx.stream);
        let layout = self.plan.backward_layout(uses);
        p.begin(s)?;
        workspace.with_slots(layout, |mut sc| -> Result<(), MoeError> {
            let row_of = &perm.row_of;
            if !g.gather_x {
                let mut x_perm = sc.get_mut(X_AGAIN);
                let regather =
                    cx.gather_rows(t, k, row_of, &sv.x, &mut x_perm, &mut perm.errors, true);
                p.stage(s, "x regather", regather)?;
            }
            if !g.gather_dy {
                let mut dy_perm = sc.get_mut(DY_PERM);
                let gather = cx.gather_rows(t, k, row_of, dy, &mut dy_perm, &mut perm.errors, true);
                p.stage(s, "dy gather", gather)?;
            }
            match dtw_partials {
                Some(partials) if fused => {
                    let (mut d_h_pre, mut h_scaled) = sc.pair_mut(D_H_PRE, H_SCALED);
                    let (dtw, hp, wd) = (&mut grads.d_topk_weights, &sv.h_pre, &w.down);
                    let (dh_pre, hs) = (&mut d_h_pre, &mut h_scaled);
                    let f =
                        cx.down_dgrad_fused(perm, t, dy, wd, hp, wts, dh_pre, hs, partials, dtw);
                    p.stage(s, "down dgrad+activation bwd (fused)", f)?;
                }
                _ => {
                    let (dy_perm, mut dh) = sc.io(DY_PERM, DH);
                    let (off, src, plan) = (&perm.offsets, &perm.source_of, &g.down_dgrad);
                    let dgrad = if g.gather_dy {
                        cx.gemm_gathered(plan, off, dy, &w.down, A, src, t, &mut dh, gws)
                    } else {
                        cx.gemm(plan, off, &dy_perm, &w.down, &mut dh, gws)
                    };
                    p.stage(s, "down dgrad", dgrad)?;
                    let (dh, [mut d_h_pre, mut h_scaled]) = sc.read_write2(DH, [D_H_PRE, H_SCALED]);
                    let (dtw, hp, hs) = (&mut grads.d_topk_weights, &sv.h_pre, &mut h_scaled);
                    let act =
                        cx.activation_backward_routed(perm, t, hp, wts, &dh, &mut d_h_pre, hs, dtw);
                    p.stage(s, "activation bwd (routed)", act)?;
                }
            }
            let (off, src) = (&perm.offsets, &perm.source_of);
            let (dy_perm, h_scaled) = (sc.get(DY_PERM), sc.get(H_SCALED));
            let (d_down, d_gate_up) = (&mut grads.d_down, &mut grads.d_gate_up);
            let plan = &g.down_wgrad[acc];
            let wgrad = if g.gather_dy {
                cx.gemm_gathered(plan, off, dy, &h_scaled, A, src, t, d_down, gws)
            } else {
                cx.gemm(plan, off, &dy_perm, &h_scaled, d_down, gws)
            };
            p.stage(s, "down wgrad", wgrad)?;
            let (d_h_pre, mut dx_perm) = sc.io(D_H_PRE, DX_PERM);
            let (plan, wg) = (&g.gate_up_dgrad, &w.gate_up);
            let dgrad = cx.gemm(plan, off, &d_h_pre, wg, &mut dx_perm, gws);
            p.stage(s, "gate_up dgrad", dgrad)?;
            let (d_h_pre, x_perm) = (sc.get(D_H_PRE), sc.get(X_AGAIN));
            let (plan, x) = (&g.gate_up_wgrad[acc], &sv.x);
            let wgrad = if g.gather_x {
                cx.gemm_gathered(plan, off, &d_h_pre, x, B, src, t, d_gate_up, gws)
            } else {
                cx.gemm(plan, off, &d_h_pre, &x_perm, d_gate_up, gws)
            };
            p.stage(s, "gate_up wgrad", wgrad)?;
            let errors = &mut perm.errors;
            let dx_combine = cx.combine(t, &perm.row_of, None, &sc.get(DX_PERM), dx, errors, true);
            p.stage(s, "dx combine", dx_combine)?;
            Ok(())
        })?;
        if let (true, Some(logits)) = (last.routed, &sv.logits) {
            let (dtw, dl) = (&grads.d_topk_weights, &mut grads.d_logits);
            p.stage(s, "router bwd", cx.route_backward(t, logits, ids, dtw, dl))?;
        }
        Ok(())
    }

    /// Everything [`MoeLayer::forward`] can check on the host, in argument order.
    fn check_forward(
        &self,
        weights: &Weights<'_>,
        x: &dyn DeviceSlice<bf16>,
        tokens: usize,
        routing: &Routing<'_>,
        y: &dyn DeviceSlice<bf16>,
        workspace: &MoeWorkspace,
    ) -> Result<(), MoeError> {
        let (s, plan) = (&self.stream, &self.plan);
        let c = plan.config();
        let (d, e, k) = (c.hidden, c.experts, c.top_k);
        plan.check_tokens(tokens)?;
        weights.check(plan, s)?;
        // tokens <= 65536, k <= 16, D, E bounded by validate(): no product overflows.
        check_buffer("x [T, D]", x, tokens * d, s)?;
        check_buffer("y [T, D]", y, tokens * d, s)?;
        match routing {
            Routing::Logits(logits) => {
                if matches!(c.router, RouterKind::External) {
                    return Err(MoeError::ExternalRouter);
                }
                check_buffer("logits [T, E]", *logits, tokens * e, s)?;
            }
            Routing::Host {
                topk_ids,
                topk_weights,
            } => {
                check_len("topk_ids [T, k]", topk_ids.len(), tokens * k)?;
                check_len("topk_weights [T, k]", topk_weights.len(), tokens * k)?;
                check_routing(&topk_ids[..tokens * k], k, e)?;
            }
            Routing::External {
                topk_ids,
                topk_weights,
            } => {
                check_buffer("topk_ids [T, k]", *topk_ids, tokens * k, s)?;
                check_buffer("topk_weights [T, k]", *topk_weights, tokens * k, s)?;
            }
        }
        // The layer's need covers every T; the call's own slots are checked too, so that a
        // path rule and the bound can never disagree into a short split.
        let call = self.forward_layout_for(tokens).bytes();
        workspace.check(self.workspace_bytes().max(call), s)
    }

    /// Everything [`MoeLayer::backward`] can check on the host; the last forward's facts.
    fn check_backward(
        &self,
        weights: &Weights<'_>,
        dy: &dyn DeviceSlice<bf16>,
        dx: &dyn DeviceSlice<bf16>,
        grads: &Gradients,
        workspace: &MoeWorkspace,
    ) -> Result<LastForward, MoeError> {
        if self.mode != Mode::Training {
            return Err(MoeError::NotTraining { mode: self.mode });
        }
        let last = self.last.ok_or(MoeError::NoForward)?;
        let (s, plan, t) = (&self.stream, &self.plan, last.tokens);
        let c = plan.config();
        let (d, e, k) = (c.hidden, c.experts, c.top_k);
        weights.check(plan, s)?;
        check_buffer("dy [T, D]", dy, t * d, s)?;
        check_buffer("dx [T, D]", dx, t * d, s)?;
        let (gate_up, down) = (weights.gate_up.len(), weights.down.len());
        check_buffer("d_gate_up [E, W, D]", &grads.d_gate_up, gate_up, s)?;
        check_buffer("d_down [E, D, I]", &grads.d_down, down, s)?;
        check_buffer("d_topk_weights [T, k]", &grads.d_topk_weights, t * k, s)?;
        if last.routed {
            check_buffer("d_logits [T, E]", &grads.d_logits, t * e, s)?;
        }
        workspace.check(self.workspace_bytes(), s)?;
        Ok(last)
    }
}
