//! The layer's stages, one launch (or one copy) each, on checked buffers: what
//! [`MoeLayer::forward`](super::MoeLayer::forward) and
//! [`MoeLayer::backward`](super::MoeLayer::backward) list in order. Each stage re-checks
//! its own buffers (the free functions' checks), and the launch layer checks them once
//! more; the passes have checked everything host-knowable before the first stage runs.

use super::plan::{H, H_PRE, X_PERM};
use super::workspace::SlotViews;
use super::{MoePlan, Routing, Weights};
use crate::gpu::activation::activation_forward_with;
use crate::gpu::decode::{decode_forward_with, DecodeInputs, DecodeSaved};
use crate::gpu::fused::{gate_up_fused_with, GateUpInputs, GateUpRows};
use crate::gpu::permute::{combine_impl, permute_with};
use crate::gpu::router::{route_backward_with, route_with};
use crate::gpu::{ActivationDesc, DeviceErrors, PermuteBuffers, Rows};
use crate::MoeError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_grouped_gemm::{Gather, GatheredOperand, GroupedGemm, GroupedPlan};
use moefuse_kernels::{self as mk, Kernels};
use std::sync::Arc;

/// What every stage shares: the plan, the stream, the one kernel handle, the GEMMs and
/// the activation.
pub(super) struct Cx<'l> {
    pub(super) plan: &'l MoePlan,
    pub(super) stream: &'l Arc<CudaStream>,
    pub(super) gemm: &'l GroupedGemm,
    pub(super) act: &'l ActivationDesc,
}

/// The routing a forward runs on: the layer's buffers, or the caller's read in place.
pub(super) struct Routed<'a> {
    pub(super) ids: &'a CudaSlice<i32>,
    pub(super) weights: &'a CudaSlice<f32>,
    /// The layer routed from logits (the backward then gives `d_logits`).
    pub(super) routed: bool,
    /// The caller's device routing was read in place (Inference only).
    pub(super) in_place: bool,
}

impl Cx<'_> {
    fn kernels(&self) -> Option<&Kernels> {
        Some(self.gemm.kernels())
    }

    /// Routing into `ids`/`weights` from logits, the host, or the caller's device buffers.
    /// `saved_logits` (Training with a routing config) receives a copy of the logits for
    /// the router backward; without it the router reads the caller's logits. Device
    /// routing is copied when `keep` (Training: the backward reads it after the caller
    /// may have moved on) and read in place otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn route<'a>(
        &self,
        t: usize,
        routing: Routing<'a>,
        w: &Weights<'_>,
        ids: &'a mut CudaSlice<i32>,
        weights: &'a mut CudaSlice<f32>,
        saved_logits: Option<&mut CudaSlice<f32>>,
        keep: bool,
    ) -> Result<Routed<'a>, MoeError> {
        let (s, cfg) = (self.stream, self.plan.config());
        let (e, k) = (cfg.experts, cfg.top_k);
        let (mut routed, mut in_place) = (false, false);
        match routing {
            Routing::Logits(logits) => {
                let bias = w.router_bias.as_ref().map(|b| b as &dyn DevicePtr<f32>);
                let logits: &dyn DevicePtr<f32> = match saved_logits {
                    Some(saved) => {
                        s.memcpy_dtod(&logits.slice(..t * e), &mut saved.slice_mut(..t * e))?;
                        &*saved
                    }
                    None => logits,
                };
                route_with(self.kernels(), cfg, s, t, logits, bias, ids, weights)?;
                routed = true;
            }
            Routing::Host {
                topk_ids,
                topk_weights,
            } => {
                s.memcpy_htod(&topk_ids[..t * k], &mut ids.slice_mut(..t * k))?;
                s.memcpy_htod(&topk_weights[..t * k], &mut weights.slice_mut(..t * k))?;
            }
            Routing::External {
                topk_ids,
                topk_weights,
            } if !keep => {
                in_place = true;
                return Ok(Routed {
                    ids: topk_ids,
                    weights: topk_weights,
                    routed,
                    in_place,
                });
            }
            Routing::External {
                topk_ids,
                topk_weights,
            } => {
                s.memcpy_dtod(&topk_ids.slice(..t * k), &mut ids.slice_mut(..t * k))?;
                s.memcpy_dtod(
                    &topk_weights.slice(..t * k),
                    &mut weights.slice_mut(..t * k),
                )?;
            }
        }
        Ok(Routed {
            ids,
            weights,
            routed,
            in_place,
        })
    }

    /// The permutation of `ids` into `perm`, with `x` gathered into `x_perm`.
    pub(super) fn permute(
        &self,
        t: usize,
        ids: &CudaSlice<i32>,
        x: &dyn DevicePtr<bf16>,
        perm: &mut PermuteBuffers,
        x_perm: Option<&mut dyn DevicePtrMut<bf16>>,
    ) -> Result<(), MoeError> {
        let c = self.plan.config();
        let (e, k, d) = (c.experts, c.top_k, c.hidden);
        let s = self.stream;
        let x = x_perm.is_some().then_some(x);
        permute_with(self.kernels(), s, t, e, k, d, ids, x, perm, x_perm)
    }

    /// The fused gate_up: the GEMM with the activation in its epilogue over the rows of `x`
    /// gathered by `perm`'s `source_of` inside it (`gather`), or over `x` = `x_perm`
    /// (already gathered); `h` always, `h_pre` when the backward needs it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gate_up_fused(
        &self,
        t: usize,
        x: &dyn DevicePtr<bf16>,
        gather: bool,
        w: &Weights<'_>,
        perm: &mut PermuteBuffers,
        h: &mut dyn DevicePtrMut<bf16>,
        h_pre: Option<&mut dyn DevicePtrMut<bf16>>,
    ) -> Result<(), MoeError> {
        let c = self.plan.config();
        let inputs = GateUpInputs {
            tokens: t,
            top_k: c.top_k,
            experts: c.experts,
            hidden: c.hidden,
            offsets: &perm.offsets,
            rows: if gather {
                GateUpRows::Gather {
                    x,
                    source_of: &perm.source_of,
                }
            } else {
                GateUpRows::InOrder { x }
            },
            w: &w.gate_up,
        };
        let errors = &mut perm.errors;
        gate_up_fused_with(
            self.kernels(),
            self.act,
            self.stream,
            inputs,
            h,
            h_pre,
            errors,
        )
    }

    /// [`Cx::gate_up_fused`] on the forward's slots: `h` into slot `H`, `h_pre` into slot
    /// `H_PRE` when `keep` (the layer's saved buffer), and with `gather` off the rows from
    /// slot `X_PERM` (the permutation gathered them; `h` then sits in another region).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gate_up_fused_slots(
        &self,
        t: usize,
        x: &dyn DevicePtr<bf16>,
        gather: bool,
        keep: bool,
        w: &Weights<'_>,
        perm: &mut PermuteBuffers,
        acts: &mut SlotViews<'_, 4>,
    ) -> Result<(), MoeError> {
        match (gather, keep) {
            (true, true) => {
                let (mut h_pre, mut h) = acts.pair_mut(H_PRE, H);
                self.gate_up_fused(t, x, true, w, perm, &mut h, Some(&mut h_pre))
            }
            (true, false) => self.gate_up_fused(t, x, true, w, perm, &mut acts.get_mut(H), None),
            (false, true) => {
                let (x_perm, [mut h_pre, mut h]) = acts.read_write2(X_PERM, [H_PRE, H]);
                self.gate_up_fused(t, &x_perm, false, w, perm, &mut h, Some(&mut h_pre))
            }
            (false, false) => {
                let (x_perm, mut h) = acts.io(X_PERM, H);
                self.gate_up_fused(t, &x_perm, false, w, perm, &mut h, None)
            }
        }
    }

    /// The decode kernels: `y` from `x` and the routing, `h` their slot-major scratch, the
    /// expert-major copies into `saved` (Training).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode(
        &self,
        t: usize,
        x: &dyn DevicePtr<bf16>,
        w: &Weights<'_>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        h: &mut dyn DevicePtrMut<bf16>,
        y: &mut dyn DevicePtrMut<bf16>,
        saved: Option<DecodeSaved<'_>>,
        errors: &mut DeviceErrors,
    ) -> Result<(), MoeError> {
        let inputs = DecodeInputs {
            tokens: t,
            topk_ids: ids,
            topk_weights: weights,
            x,
            gate_up: &w.gate_up,
            down: &w.down,
        };
        let (k, c, s) = (self.kernels(), self.plan.config(), self.stream);
        decode_forward_with(k, c, s, inputs, h, y, saved, errors)
    }

    /// One grouped GEMM over the expert-major rows `offsets` delimits.
    pub(super) fn gemm<A, B, D>(
        &self,
        plan: &GroupedPlan,
        offsets: &CudaSlice<i32>,
        a: &A,
        b: &B,
        d: &mut D,
        workspace: &mut CudaSlice<u8>,
    ) -> Result<(), MoeError>
    where
        A: DevicePtr<bf16>,
        B: DevicePtr<bf16>,
        D: DevicePtrMut<bf16>,
    {
        Ok(self
            .gemm
            .run(plan, self.stream, offsets, a, b, d, workspace)?)
    }

    /// A grouped GEMM with one operand read as `source`'s token rows through the permutation
    /// (`source_of[r] / top_k`, `tokens` rows): the backward's GEMMs over `x` and `dy` without
    /// their permuted copies.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_gathered<A, B, D>(
        &self,
        plan: &GroupedPlan,
        offsets: &CudaSlice<i32>,
        a: &A,
        b: &B,
        operand: GatheredOperand,
        source_of: &CudaSlice<i32>,
        tokens: usize,
        d: &mut D,
        workspace: &mut CudaSlice<u8>,
    ) -> Result<(), MoeError>
    where
        A: DevicePtr<bf16>,
        B: DevicePtr<bf16>,
        D: DevicePtrMut<bf16>,
    {
        let gather = Gather {
            operand,
            div: self.plan.config().top_k,
            source_rows: tokens,
        };
        let (s, ws) = (self.stream, workspace);
        Ok(self
            .gemm
            .run_gathered(plan, s, offsets, a, b, source_of, gather, d, ws)?)
    }

    /// The routed rows, read on the device from the last offset (no host synchronisation).
    fn rows<'o>(&self, last: &'o dyn DevicePtr<i32>) -> Rows<'o> {
        Rows::from_device(last, self.plan.rows())
    }

    /// `h = act(h_pre)` over the routed rows.
    pub(super) fn activation(
        &self,
        offsets: &CudaSlice<i32>,
        h_pre: &dyn DevicePtr<bf16>,
        h: &mut dyn DevicePtrMut<bf16>,
    ) -> Result<(), MoeError> {
        let last = offsets.slice(self.plan.config().experts - 1..);
        let rows = self.rows(&last);
        activation_forward_with(self.kernels(), self.act, self.stream, rows, h_pre, h)
    }

    /// `out[t] = Σ_slot w · rows[row_of[t, slot]]` (unweighted without `weights`); with
    /// `stamp`, checked on the device against the permutation's token count.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn combine(
        &self,
        t: usize,
        row_of: &CudaSlice<i32>,
        weights: Option<&CudaSlice<f32>>,
        rows: &dyn DevicePtr<bf16>,
        out: &mut dyn DevicePtrMut<bf16>,
        errors: &mut DeviceErrors,
        stamp: bool,
    ) -> Result<(), MoeError> {
        let c = self.plan.config();
        let (k, d, s) = (c.top_k, c.hidden, self.stream);
        combine_impl(
            self.kernels(),
            s,
            t,
            k,
            d,
            row_of,
            weights,
            rows,
            out,
            errors,
            stamp,
        )
    }

    /// `dst[row_of[t·k + j]] = src[t]` for the `t` tokens (`k` slots each; `k = 1` with
    /// the identity rows copies `src`); with `stamp`, checked on the device against the
    /// permutation's token count.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather_rows(
        &self,
        t: usize,
        k: usize,
        row_of: &CudaSlice<i32>,
        src: &dyn DevicePtr<bf16>,
        dst: &mut dyn DevicePtrMut<bf16>,
        errors: &mut DeviceErrors,
        stamp: bool,
    ) -> Result<(), MoeError> {
        let d = self.plan.config().hidden;
        let rows = dst.len() / d;
        let (mut bits, tokens_stamp) = errors.words.split_at_mut(1);
        self.gemm.kernels().launch(
            self.stream,
            mk::GatherRows {
                tokens: t,
                top_k: k,
                hidden: d,
                rows,
                row_of,
                src,
                dst,
                errors: Some(&mut bits),
                expect_tokens: stamp.then_some(&tokens_stamp as &dyn DevicePtr<u32>),
            },
        )?;
        Ok(())
    }

    /// The routed activation backward over the routed rows: `d_h_pre` of `w · dh_u`,
    /// `d_topk_weights[s] = ⟨dh_u, h⟩` and `h_scaled = w · h` (`h` recomputed from `h_pre`).
    /// `d_topk_weights` is zeroed first: a slot no row names (a dropped expert id) gets 0,
    /// and so does every slot when the permutation is another call's (the kernel checks
    /// the tokens stamp, writes nothing and raises the stale bit).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn activation_backward_routed(
        &self,
        perm: &mut PermuteBuffers,
        t: usize,
        h_pre: &dyn DevicePtr<bf16>,
        weights: &CudaSlice<f32>,
        dh_u: &dyn DevicePtr<bf16>,
        d_h_pre: &mut dyn DevicePtrMut<bf16>,
        h_scaled: &mut dyn DevicePtrMut<bf16>,
        d_topk_weights: &mut CudaSlice<f32>,
    ) -> Result<(), MoeError> {
        let c = self.plan.config();
        let slots = t * c.top_k;
        let (kind, layout) = self.act.kernel_kind();
        let last = perm.offsets.slice(c.experts - 1..);
        let mut d_weights = d_topk_weights.slice_mut(..slots);
        self.stream.memset_zeros(&mut d_weights)?;
        let (mut bits, tokens_stamp) = perm.errors.words.split_at_mut(1);
        self.gemm.kernels().launch(
            self.stream,
            mk::ActivationBackwardRouted {
                kind,
                layout,
                intermediate: c.intermediate,
                max_rows: self.plan.rows(),
                total_rows: Some(&last),
                h_pre,
                dh_u,
                source_of: &perm.source_of,
                top_k: c.top_k,
                weights: &weights.slice(..slots),
                d_h_pre,
                d_weights: &mut d_weights,
                h_scaled,
                errors: Some(&mut bits),
                expect_tokens: Some(&tokens_stamp),
            },
        )?;
        Ok(())
    }

    /// The down dgrad with the routed activation backward in its epilogue (sm_90a): from
    /// `dy`'s token rows (gathered by `source_of`) and the down weights, `d_h_pre`,
    /// `h_scaled` and `d_topk_weights` as [`Cx::activation_backward_routed`] gives them from
    /// the unfused dgrad's `dh_u`, which is never written. `partials` (`[R,
    /// ceil(I / 256)]` fp32) is the kernel's scratch. `d_topk_weights` is zeroed first, and
    /// the tokens stamp is checked as there.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn down_dgrad_fused(
        &self,
        perm: &mut PermuteBuffers,
        t: usize,
        dy: &dyn DevicePtr<bf16>,
        down: &dyn DevicePtr<bf16>,
        h_pre: &dyn DevicePtr<bf16>,
        weights: &CudaSlice<f32>,
        d_h_pre: &mut dyn DevicePtrMut<bf16>,
        h_scaled: &mut dyn DevicePtrMut<bf16>,
        partials: &mut CudaSlice<f32>,
        d_topk_weights: &mut CudaSlice<f32>,
    ) -> Result<(), MoeError> {
        let c = self.plan.config();
        let slots = t * c.top_k;
        let (kind, layout) = self.act.kernel_kind();
        let mut d_weights = d_topk_weights.slice_mut(..slots);
        self.stream.memset_zeros(&mut d_weights)?;
        let (mut bits, tokens_stamp) = perm.errors.words.split_at_mut(1);
        self.gemm.kernels().launch(
            self.stream,
            mk::DownDgradFused {
                tokens: t,
                top_k: c.top_k,
                hidden: c.hidden,
                intermediate: c.intermediate,
                experts: c.experts,
                kind,
                layout,
                tile_order: 0,
                offsets: &perm.offsets,
                source_of: &perm.source_of,
                weights,
                dy,
                w: down,
                h_pre,
                d_h_pre,
                h_scaled,
                partials,
                d_weights: &mut d_weights,
                errors: Some(&mut bits),
                expect_tokens: Some(&tokens_stamp),
            },
        )?;
        Ok(())
    }

    /// `d_logits` from `d_topk_weights` through the router (the selection held constant).
    pub(super) fn route_backward(
        &self,
        t: usize,
        logits: &CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        d_topk_weights: &CudaSlice<f32>,
        d_logits: &mut CudaSlice<f32>,
    ) -> Result<(), MoeError> {
        let (k, c, s) = (self.kernels(), self.plan.config(), self.stream);
        route_backward_with(k, c, s, t, logits, ids, d_topk_weights, d_logits)
    }
}
