//! The layer's backward pass: gradients of every input and parameter from `dy`.
//!
//! Intermediates (`dh`, `dh_pre`, `d_topk_weights`, `d_logits`) stay in f64; every sum is
//! accumulated in f64 and the outputs are rounded once to f32.

use super::activation::backward_row;
use super::layer::ForwardOutput;
use super::permute::permutation;
use super::router::{dot, route_backward_f64, rows_of};
use crate::model::{expect_len, MoeWeights};
use crate::{MoeConfig, MoeError};
use rayon::prelude::*;

/// The gradients of the layer, f32, row-major, shapes as in [`MoeWeights`] and
/// [`forward`](super::forward):
///
/// * `dx [T, D]`: through the experts, plus `d_logits·router` when the layer routed.
/// * `d_gate_up [E, W, D]`, `d_down [E, D, I]`: the expert weight gradients; an expert with
///   no rows gets zero (or, when accumulating, keeps its value).
/// * `d_topk_weights [T, k]`: `⟨dy[t], y_e[row(t, slot)]⟩`.
/// * `d_logits [T, E]` and `d_router [E, D] = d_logitsᵀ·x`: when the layer routed
///   ([`RoutingInput::Ours`](super::RoutingInput::Ours)), else `None`.
///
/// ```
/// let cfg = moefuse::MoeConfig::new(64, 64, 4, 2);
/// let g = moefuse::reference::Gradients::zeros(&cfg, 3);
/// assert_eq!((g.dx.len(), g.d_topk_weights.len(), g.d_down.len()), (192, 6, 4 * 64 * 64));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// `[T, D]` gradient of `x`.
    pub dx: Vec<f32>,
    /// `[E, W, D]` gradient of `gate_up`.
    pub d_gate_up: Vec<f32>,
    /// `[E, D, I]` gradient of `down`.
    pub d_down: Vec<f32>,
    /// `[T, k]` gradient of the routing weights.
    pub d_topk_weights: Vec<f32>,
    /// `[T, E]` gradient of the router logits, when the layer routed.
    pub d_logits: Option<Vec<f32>>,
    /// `[E, D]` gradient of the router matrix, when the layer routed.
    pub d_router: Option<Vec<f32>>,
}

impl Gradients {
    /// Zero gradients for `tokens` tokens (`d_logits`, `d_router`: `None`), the starting
    /// point of gradient accumulation with [`backward_into`].
    ///
    /// ```
    /// let g = moefuse::reference::Gradients::zeros(&moefuse::MoeConfig::new(64, 64, 2, 1), 1);
    /// assert!(g.d_router.is_none() && g.d_gate_up.iter().all(|&v| v == 0.0));
    /// ```
    pub fn zeros(config: &MoeConfig, tokens: usize) -> Self {
        let (d, i, e, k, w) = (
            config.hidden,
            config.intermediate,
            config.experts,
            config.top_k,
            config.gate_up_width(),
        );
        Gradients {
            dx: vec![0.0; tokens * d],
            d_gate_up: vec![0.0; e * w * d],
            d_down: vec![0.0; e * d * i],
            d_topk_weights: vec![0.0; tokens * k],
            d_logits: None,
            d_router: None,
        }
    }
}

/// The backward pass: gradients from `dy [T, D]`, given the forward's inputs and `saved`
/// output. See [`Gradients`] for what each holds; routing selection is held constant.
///
/// ```
/// use moefuse::{model::MoeWeights, reference::{backward, forward, RoutingInput}, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 2, 1).with_router(RouterKind::External);
/// let w = MoeWeights::zeros(&cfg, false);
/// let x = vec![1.0f32; 64];
/// let out = forward(&cfg, &w, &x, RoutingInput::External { topk_ids: &[0], topk_weights: &[1.0] })?;
/// let g = backward(&cfg, &w, &x, &out, &vec![1.0; 64])?;
/// assert!(g.dx.iter().all(|&v| v == 0.0)); // zero weights: zero gradient
/// assert!(g.d_logits.is_none());
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn backward(
    config: &MoeConfig,
    weights: &MoeWeights,
    x: &[f32],
    saved: &ForwardOutput,
    dy: &[f32],
) -> Result<Gradients, MoeError> {
    let tokens = rows_of("x [tokens, hidden]", x.len(), config.hidden)?;
    let mut grads = Gradients::zeros(config, tokens);
    backward_into(config, weights, x, saved, dy, &mut grads, false)?;
    Ok(grads)
}

/// [`backward`] into caller-owned `grads`, which must have the shapes of
/// [`Gradients::zeros`]`(config, T)` (`d_logits`, `d_router` may be `None`: they are
/// allocated when the layer routed).
///
/// `dx`, `d_topk_weights` and `d_logits` are always overwritten. When `accumulate`, the
/// weight gradients `d_gate_up`, `d_down` and `d_router` are added (in f32, element-wise:
/// exactly `old + backward(..)`) to the values already there (gradient accumulation across micro-batches; a `None` `d_router` counts as zeros,
/// and it is left as it is when the routing was external); otherwise they are overwritten
/// (`d_logits` and `d_router` become `None` when the routing was external).
///
/// ```
/// use moefuse::{model::MoeWeights, reference::{backward_into, forward, Gradients, RoutingInput}, Activation, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 1, 1).with_activation(Activation::Relu2).with_router(RouterKind::External);
/// let mut w = MoeWeights::zeros(&cfg, false);
/// w.gate_up[0] = 1.0;
/// w.down[0] = 1.0;
/// let x = vec![1.0f32; 64];
/// let out = forward(&cfg, &w, &x, RoutingInput::External { topk_ids: &[0], topk_weights: &[1.0] })?;
/// let mut g = Gradients::zeros(&cfg, 1);
/// backward_into(&cfg, &w, &x, &out, &vec![1.0; 64], &mut g, true)?;
/// backward_into(&cfg, &w, &x, &out, &vec![1.0; 64], &mut g, true)?;
/// assert_eq!(g.d_down[0], 2.0); // h[0] = 1 twice
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn backward_into(
    config: &MoeConfig,
    weights: &MoeWeights,
    x: &[f32],
    saved: &ForwardOutput,
    dy: &[f32],
    grads: &mut Gradients,
    accumulate: bool,
) -> Result<(), MoeError> {
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
    let rows = tokens * k;
    check_saved(config, weights, saved, tokens)?;
    expect_len("dy [tokens, hidden]", tokens * d, dy.len())?;
    expect_len("grads.dx [tokens, hidden]", tokens * d, grads.dx.len())?;
    expect_len(
        "grads.d_gate_up [experts, gate_up_width, hidden]",
        e_count * w_len * d,
        grads.d_gate_up.len(),
    )?;
    expect_len(
        "grads.d_down [experts, hidden, intermediate]",
        e_count * d * i_len,
        grads.d_down.len(),
    )?;
    expect_len(
        "grads.d_topk_weights [tokens, top_k]",
        rows,
        grads.d_topk_weights.len(),
    )?;
    if let Some(v) = &grads.d_logits {
        expect_len(
            "grads.d_logits [tokens, experts]",
            tokens * e_count,
            v.len(),
        )?;
    }
    if let Some(v) = &grads.d_router {
        expect_len("grads.d_router [experts, hidden]", e_count * d, v.len())?;
    }
    tracing::debug!(tokens, rows, accumulate, "moefuse reference backward");

    let perm = &saved.permutation;
    let routing = &saved.routing;
    let expert_of = perm.expert_of_rows();
    let token_of: Vec<usize> = perm.source_of.iter().map(|&s| s as usize / k).collect();
    let weight_of: Vec<f64> = perm
        .source_of
        .iter()
        .map(|&s| f64::from(routing.topk_weights[s as usize]))
        .collect();

    // d_topk_weights[t, s] = ⟨dy[t], y_e[row]⟩
    let dw: Vec<f64> = (0..rows)
        .into_par_iter()
        .map(|pair| {
            let row = perm.row_of[pair] as usize;
            dot(&dy[pair / k * d..][..d], &saved.y_e[row * d..][..d])
        })
        .collect();
    for (o, &v) in grads.d_topk_weights.iter_mut().zip(&dw) {
        *o = v as f32;
    }

    // dh[r] = (w·dy[t])·down[e], then dh_pre[r] = act'(h_pre[r]) ⊙ dh[r]
    let mut dh_pre = vec![0f64; rows * w_len];
    dh_pre
        .par_chunks_mut(w_len)
        .enumerate()
        .for_each(|(r, out)| {
            let (t, e, w) = (token_of[r], expert_of[r], weight_of[r]);
            let mut dh = vec![0f64; i_len];
            let de = &weights.down[e * d * i_len..][..d * i_len];
            for (&g, drow) in dy[t * d..][..d].iter().zip(de.chunks(i_len)) {
                let c = w * f64::from(g);
                for (a, &v) in dh.iter_mut().zip(drow) {
                    *a += c * f64::from(v);
                }
            }
            let pre = &saved.h_pre[r * w_len..][..w_len];
            backward_row(config.activation, config.gate_up_layout, pre, &dh, out);
        });

    // d_down[e, d, :] = Σ_r (w·dy[t, d])·h[r]
    grads
        .d_down
        .par_chunks_mut(i_len)
        .enumerate()
        .for_each(|(ed, out)| {
            let (e, dd) = (ed / d, ed % d);
            let mut acc = vec![0f64; i_len];
            for r in perm.expert_rows(e) {
                let c = weight_of[r] * f64::from(dy[token_of[r] * d + dd]);
                for (a, &v) in acc.iter_mut().zip(&saved.h[r * i_len..][..i_len]) {
                    *a += c * f64::from(v);
                }
            }
            store(out, &acc, accumulate);
        });

    // d_gate_up[e, w, :] = Σ_r dh_pre[r, w]·x[t]
    grads
        .d_gate_up
        .par_chunks_mut(d)
        .enumerate()
        .for_each(|(ew, out)| {
            let (e, ww) = (ew / w_len, ew % w_len);
            let mut acc = vec![0f64; d];
            for r in perm.expert_rows(e) {
                let c = dh_pre[r * w_len + ww];
                for (a, &v) in acc.iter_mut().zip(&x[token_of[r] * d..][..d]) {
                    *a += c * f64::from(v);
                }
            }
            store(out, &acc, accumulate);
        });

    // Router: d_logits from d_topk_weights; d_router = d_logitsᵀ·x.
    let d_logits = saved
        .logits
        .as_ref()
        .map(|l| route_backward_f64(config, l, &routing.topk_ids, &dw));

    // dx[t] = Σ_slot dh_pre[row]·gate_up[e] (+ d_logits[t]·router)
    let router = weights.router.as_deref();
    grads.dx.par_chunks_mut(d).enumerate().for_each(|(t, out)| {
        let mut acc = vec![0f64; d];
        for slot in 0..k {
            let r = perm.row_of[t * k + slot] as usize;
            let we = &weights.gate_up[expert_of[r] * w_len * d..][..w_len * d];
            for (&c, wrow) in dh_pre[r * w_len..][..w_len].iter().zip(we.chunks(d)) {
                for (a, &v) in acc.iter_mut().zip(wrow) {
                    *a += c * f64::from(v);
                }
            }
        }
        if let (Some(dl), Some(router)) = (&d_logits, router) {
            for (&c, rrow) in dl[t * e_count..][..e_count].iter().zip(router.chunks(d)) {
                for (a, &v) in acc.iter_mut().zip(rrow) {
                    *a += c * f64::from(v);
                }
            }
        }
        store(out, &acc, false);
    });

    match d_logits {
        Some(dl) => {
            let mut d_router = match grads.d_router.take() {
                Some(v) if accumulate => v,
                _ => vec![0f32; e_count * d],
            };
            d_router.par_chunks_mut(d).enumerate().for_each(|(e, out)| {
                let mut acc = vec![0f64; d];
                for t in 0..tokens {
                    let c = dl[t * e_count + e];
                    if c != 0.0 {
                        for (a, &v) in acc.iter_mut().zip(&x[t * d..][..d]) {
                            *a += c * f64::from(v);
                        }
                    }
                }
                store(out, &acc, accumulate);
            });
            grads.d_router = Some(d_router);
            grads.d_logits = Some(dl.into_iter().map(|v| v as f32).collect());
        }
        None => {
            grads.d_logits = None;
            if !accumulate {
                grads.d_router = None;
            }
        }
    }
    Ok(())
}

/// Checks the saved forward tensors against `config` and the token count.
fn check_saved(
    config: &MoeConfig,
    weights: &MoeWeights,
    saved: &ForwardOutput,
    tokens: usize,
) -> Result<(), MoeError> {
    let (d, i_len, e_count, k) = (
        config.hidden,
        config.intermediate,
        config.experts,
        config.top_k,
    );
    let rows = tokens * k;
    expect_len("saved.y [tokens, hidden]", tokens * d, saved.y.len())?;
    expect_len("saved.routing.top_k", k, saved.routing.top_k)?;
    expect_len(
        "saved.routing.topk_ids [tokens, top_k]",
        rows,
        saved.routing.topk_ids.len(),
    )?;
    expect_len(
        "saved.routing.topk_weights [tokens, top_k]",
        rows,
        saved.routing.topk_weights.len(),
    )?;
    expect_len(
        "saved.permutation.counts [experts]",
        e_count,
        saved.permutation.counts.len(),
    )?;
    expect_len(
        "saved.permutation.offsets [experts]",
        e_count,
        saved.permutation.offsets.len(),
    )?;
    expect_len(
        "saved.permutation.row_of [tokens·top_k]",
        rows,
        saved.permutation.row_of.len(),
    )?;
    expect_len(
        "saved.permutation.source_of [tokens·top_k]",
        rows,
        saved.permutation.source_of.len(),
    )?;
    expect_len(
        "saved.h_pre [rows, gate_up_width]",
        rows * config.gate_up_width(),
        saved.h_pre.len(),
    )?;
    expect_len("saved.h [rows, intermediate]", rows * i_len, saved.h.len())?;
    expect_len("saved.y_e [rows, hidden]", rows * d, saved.y_e.len())?;
    if permutation(&saved.routing.topk_ids, k, e_count)? != saved.permutation {
        return Err(MoeError::InconsistentSaved {
            what: "permutation (does not match saved.routing)",
        });
    }
    if let Some(l) = &saved.logits {
        expect_len("saved.logits [tokens, experts]", tokens * e_count, l.len())?;
        if !config.router.computes_routing() {
            return Err(MoeError::ExternalRouter);
        }
        if weights.router.is_none() {
            return Err(MoeError::MissingRouter);
        }
    }
    Ok(())
}

/// Writes the f64 sums `acc`, rounded to f32, into `out`, or adds them in f32 when
/// `accumulate` (so accumulating equals adding [`backward`]'s output element-wise).
fn store(out: &mut [f32], acc: &[f64], accumulate: bool) {
    for (o, &a) in out.iter_mut().zip(acc) {
        if accumulate {
            *o += a as f32;
        } else {
            *o = a as f32;
        }
    }
}
