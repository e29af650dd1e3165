//! The layer's forward pass.

use super::activation::forward_row;
use super::permute::{permutation, Permutation};
use super::router::{dot, route, router_logits, rows_of, Routing};
use crate::model::{check_routing, expect_len, MoeWeights};
use crate::{MoeConfig, MoeError};
use rayon::prelude::*;

/// Where the forward pass's routing comes from.
///
/// ```
/// use moefuse::reference::RoutingInput;
/// let ids = [0, 1];
/// let ws = [0.7f32, 0.3];
/// let input = RoutingInput::External { topk_ids: &ids, topk_weights: &ws };
/// assert!(matches!(input, RoutingInput::External { .. }));
/// ```
#[derive(Debug, Clone, Copy)]
pub enum RoutingInput<'a> {
    /// The layer routes: `logits = x·routerᵀ`, then [`route`] with `config.router` and
    /// `weights.router_bias`. Needs `weights.router` and a router other than `External`.
    Ours,
    /// The caller's routing, `[T, k]` each; allowed with every router kind (the router
    /// weights are then unused and get no gradient).
    External {
        /// `[T, k]` expert ids, distinct within a token.
        topk_ids: &'a [i32],
        /// `[T, k]` routing weights.
        topk_weights: &'a [f32],
    },
}

/// The forward pass's output `y` and everything the backward pass reads.
///
/// ```
/// use moefuse::{model::MoeWeights, reference::{forward, RoutingInput}, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 2, 1).with_router(RouterKind::External);
/// let out = forward(&cfg, &MoeWeights::zeros(&cfg, false), &[1.0; 64],
///     RoutingInput::External { topk_ids: &[1], topk_weights: &[1.0] })?;
/// assert_eq!((out.tokens(), out.h_pre.len(), out.h.len(), out.y_e.len()), (1, 128, 64, 64));
/// # Ok::<(), moefuse::MoeError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// `[T, D]` the layer's output.
    pub y: Vec<f32>,
    /// `[T, E]` router logits, when the layer routed ([`RoutingInput::Ours`]).
    pub logits: Option<Vec<f32>>,
    /// `[T, k]` the routing used.
    pub routing: Routing,
    /// The expert-major row order (`rows = T·k`).
    pub permutation: Permutation,
    /// `[rows, W]` gate_up outputs, expert-major rows.
    pub h_pre: Vec<f32>,
    /// `[rows, I]` activation outputs.
    pub h: Vec<f32>,
    /// `[rows, D]` expert outputs, not yet weighted.
    pub y_e: Vec<f32>,
}

impl ForwardOutput {
    /// The token count `T`.
    ///
    /// ```
    /// # use moefuse::{model::MoeWeights, reference::{forward, RoutingInput}, MoeConfig, RouterKind};
    /// # let cfg = MoeConfig::new(64, 64, 2, 1).with_router(RouterKind::External);
    /// let out = forward(&cfg, &MoeWeights::zeros(&cfg, false), &[0.0; 128],
    ///     RoutingInput::External { topk_ids: &[1, 0], topk_weights: &[1.0, 1.0] })?;
    /// assert_eq!(out.tokens(), 2);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn tokens(&self) -> usize {
        self.routing.tokens()
    }
}

/// The layer's forward pass on `x [T, D]`:
///
/// 1. routing (`[T, k]` ids and weights) from `routing` ([`RoutingInput`]);
/// 2. the [`Permutation`] of the `T·k` (token, slot) pairs into expert-major rows;
/// 3. per row `r` of expert `e` holding token `t`: `h_pre[r] = x[t]·gate_up[e]ᵀ` (`W`),
///    `h[r] = act(h_pre[r])` (`I`), `y_e[r] = h[r]·down[e]ᵀ` (`D`), each dot product
///    accumulated in f64 and rounded to f32;
/// 4. `y[t] = Σ_slot w[t, slot]·y_e[row(t, slot)]` in f32, slot order, starting from 0
///    (`acc = acc + w·y_e`, no fused multiply-add).
///
/// Every shape and the routing are checked before anything is computed.
///
/// ```
/// use moefuse::{model::MoeWeights, reference::{forward, RoutingInput}, Activation, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 2, 1).with_activation(Activation::Relu2).with_router(RouterKind::External);
/// let mut w = MoeWeights::zeros(&cfg, false);
/// w.gate_up[64 * 64] = 1.0;          // expert 1: h_pre[0] = x[0]
/// w.down[64 * 64] = 1.0;             // expert 1: y_e[0] = h[0]
/// let mut x = vec![0.0f32; 64];
/// x[0] = 3.0;
/// let out = forward(&cfg, &w, &x, RoutingInput::External { topk_ids: &[1], topk_weights: &[0.5] })?;
/// assert_eq!(out.y[0], 4.5);          // 0.5 · relu(3)²
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn forward(
    config: &MoeConfig,
    weights: &MoeWeights,
    x: &[f32],
    routing: RoutingInput<'_>,
) -> Result<ForwardOutput, MoeError> {
    config.validate()?;
    weights.validate(config)?;
    let (d, i_len, e_count, k) = (
        config.hidden,
        config.intermediate,
        config.experts,
        config.top_k,
    );
    let w_len = config.gate_up_width();
    let tokens = rows_of("x [tokens, hidden]", x.len(), d)?;
    config.check_tokens(tokens)?;

    let (logits, routing) = match routing {
        RoutingInput::Ours => {
            if !config.router.computes_routing() {
                return Err(MoeError::ExternalRouter);
            }
            let router = weights.router.as_deref().ok_or(MoeError::MissingRouter)?;
            let logits = router_logits(config, router, x)?;
            let routing = route(config, &logits, weights.router_bias.as_deref())?;
            (Some(logits), routing)
        }
        RoutingInput::External {
            topk_ids,
            topk_weights,
        } => {
            expect_len("topk_ids [tokens, top_k]", tokens * k, topk_ids.len())?;
            expect_len(
                "topk_weights [tokens, top_k]",
                tokens * k,
                topk_weights.len(),
            )?;
            check_routing(topk_ids, k, e_count)?;
            let routing = Routing {
                top_k: k,
                topk_ids: topk_ids.to_vec(),
                topk_weights: topk_weights.to_vec(),
            };
            (None, routing)
        }
    };
    let perm = permutation(&routing.topk_ids, k, e_count)?;
    let rows = perm.rows();
    let expert_of = perm.expert_of_rows();
    tracing::debug!(tokens, rows, experts = e_count, "moefuse reference forward");

    // h_pre[r] = x[t]·gate_up[e]ᵀ
    let mut h_pre = vec![0f32; rows * w_len];
    h_pre
        .par_chunks_mut(w_len)
        .zip(perm.source_of.par_iter().zip(&expert_of))
        .for_each(|(out, (&src, &e))| {
            let xt = &x[src as usize / k * d..][..d];
            let we = &weights.gate_up[e * w_len * d..][..w_len * d];
            for (o, wrow) in out.iter_mut().zip(we.chunks(d)) {
                *o = dot(xt, wrow) as f32;
            }
        });

    // h[r] = act(h_pre[r])
    let mut h = vec![0f32; rows * i_len];
    h.par_chunks_mut(i_len)
        .zip(h_pre.par_chunks(w_len))
        .for_each(|(out, pre)| forward_row(config.activation, config.gate_up_layout, pre, out));

    // y_e[r] = h[r]·down[e]ᵀ
    let mut y_e = vec![0f32; rows * d];
    y_e.par_chunks_mut(d)
        .zip(h.par_chunks(i_len).zip(&expert_of))
        .for_each(|(out, (hr, &e))| {
            let de = &weights.down[e * d * i_len..][..d * i_len];
            for (o, drow) in out.iter_mut().zip(de.chunks(i_len)) {
                *o = dot(hr, drow) as f32;
            }
        });

    // y[t] = Σ_slot w·y_e, f32, slot order.
    let mut y = vec![0f32; tokens * d];
    y.par_chunks_mut(d).enumerate().for_each(|(t, out)| {
        for slot in 0..k {
            let pair = t * k + slot;
            let w = routing.topk_weights[pair];
            let ye = &y_e[perm.row_of[pair] as usize * d..][..d];
            for (o, &v) in out.iter_mut().zip(ye) {
                *o += w * v;
            }
        }
    });

    Ok(ForwardOutput {
        y,
        logits,
        routing,
        permutation: perm,
        h_pre,
        h,
        y_e,
    })
}
