//! Routing: router logits, top-k selection and weights ([`route`]), the gradient of the
//! weights with respect to the logits ([`route_backward`]), and the routing checks.
//!
//! Scores and weights are computed in f64 from the f32 logits and rounded once to f32.
//!
//! Non-finite logits are routed, as torch.topk ranks them: the selection orders (score,
//! id) pairs by one strict total order, NaN above every number (`+inf` included), equal
//! scores (two NaNs, `+0` and `-0`) to the lower id ([`ranks_before`]). Weights follow
//! IEEE arithmetic: a NaN or `+inf` logit makes its token's softmax weights NaN, a `-inf`
//! logit has weight 0. The GPU router (`kernels/moe/router.cu`) implements the same order
//! and the same formulas.

use super::activation::sigmoid;
use crate::model::{check_routing, expect_len};
use crate::{MoeConfig, MoeError, RouterKind};
use rayon::prelude::*;

/// A routing decision for `T` tokens: `topk_ids [T, k]` and `topk_weights [T, k]`,
/// row-major, slot `s` of token `t` at `t·k + s`.
///
/// ```
/// use moefuse::reference::Routing;
/// let r = Routing { top_k: 2, topk_ids: vec![0, 3, 1, 2], topk_weights: vec![0.5; 4] };
/// assert_eq!(r.tokens(), 2);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token `k`.
    pub top_k: usize,
    /// `[T, k]` expert ids; within a token, distinct.
    pub topk_ids: Vec<i32>,
    /// `[T, k]` routing weights.
    pub topk_weights: Vec<f32>,
}

impl Routing {
    /// The token count `T` (`topk_ids.len() / k`).
    ///
    /// ```
    /// let r = moefuse::reference::Routing { top_k: 1, topk_ids: vec![2], topk_weights: vec![1.0] };
    /// assert_eq!(r.tokens(), 1);
    /// ```
    pub fn tokens(&self) -> usize {
        self.topk_ids.len() / self.top_k.max(1)
    }
}

/// Router logits `[T, E] = x [T, D] · routerᵀ` (`router` is `[E, D]` row-major), accumulated
/// in f64 and rounded to f32.
///
/// ```
/// use moefuse::{reference::router_logits, MoeConfig};
/// let cfg = MoeConfig::new(64, 64, 2, 1);
/// let router: Vec<f32> = (0..128).map(|i| if i < 64 { 1.0 } else { -0.5 }).collect();
/// assert_eq!(router_logits(&cfg, &router, &[1.0; 64])?, vec![64.0, -32.0]);
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn router_logits(config: &MoeConfig, router: &[f32], x: &[f32]) -> Result<Vec<f32>, MoeError> {
    config.validate()?;
    let (d, e) = (config.hidden, config.experts);
    let tokens = rows_of("x [tokens, hidden]", x.len(), d)?;
    config.check_tokens(tokens)?;
    expect_len("router [experts, hidden]", e * d, router.len())?;
    let mut logits = vec![0f32; tokens * e];
    logits
        .par_chunks_mut(e)
        .zip(x.par_chunks(d))
        .for_each(|(out, xt)| {
            for (o, w) in out.iter_mut().zip(router.chunks(d)) {
                *o = dot(xt, w) as f32;
            }
        });
    Ok(logits)
}

/// Routes `T` tokens from their logits `[T, E]` by `config.router` (see [`RouterKind`]):
/// ids and weights `[T, k]`, slots in descending selection score, ties to the lower id.
/// `bias` (`[E]`) is the `SigmoidGrouped` selection bias (`None` = zeros, finite); other
/// routers take none. Logits may be NaN or infinite (see the module docs: NaN ranks first,
/// like torch.topk, and poisons its token's weights).
///
/// ```
/// use moefuse::{reference::route, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 4, 3).with_router(RouterKind::SoftmaxTopK { renormalize: false });
/// let r = route(&cfg, &[f32::NEG_INFINITY, f32::NAN, 1.0, f32::INFINITY], None)?;
/// assert_eq!(r.topk_ids, vec![1, 3, 2]); // NaN above +inf above every number
/// assert!(r.topk_weights.iter().all(|w| w.is_nan()));
/// # Ok::<(), moefuse::MoeError>(())
/// ```
///
/// ```
/// use moefuse::{reference::route, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 4, 2).with_router(RouterKind::SoftmaxTopK { renormalize: true });
/// let r = route(&cfg, &[0.0, 2.0, 1.0, 2.0], None)?;
/// assert_eq!(r.topk_ids, vec![1, 3]); // tie between 1 and 3: both kept, lower id first
/// assert_eq!(r.topk_weights, vec![0.5, 0.5]);
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn route(
    config: &MoeConfig,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> Result<Routing, MoeError> {
    let tokens = check_route_inputs(config, logits, bias)?;
    let (e, k) = (config.experts, config.top_k);
    let mut topk_ids = vec![0i32; tokens * k];
    let mut topk_weights = vec![0f32; tokens * k];
    topk_ids
        .par_chunks_mut(k)
        .zip(topk_weights.par_chunks_mut(k))
        .zip(logits.par_chunks(e))
        .for_each(|((ids, ws), l)| route_token(config.router, k, l, bias, ids, ws));
    Ok(Routing {
        top_k: k,
        topk_ids,
        topk_weights,
    })
}

/// The gradient of the routing weights with respect to the logits: from
/// `d_topk_weights [T, k]` to `d_logits [T, E]`, with the selection in `routing` held
/// constant. Softmax: `∂L/∂l_i = p_i (g_i − Σ_j g_j p_j)` with `g = ∂L/∂p` (non-zero only on
/// the chosen experts, through the renormalisation if any). Sigmoid: `∂L/∂l_i =
/// ∂L/∂s_i · s_i(1 − s_i)` on the chosen experts, zero elsewhere; the bias gets no gradient.
///
/// ```
/// use moefuse::{reference::{route, route_backward}, MoeConfig, RouterKind};
/// let cfg = MoeConfig::new(64, 64, 2, 1).with_router(RouterKind::SoftmaxTopK { renormalize: false });
/// let logits = [0.0f32, 0.0];
/// let r = route(&cfg, &logits, None)?; // expert 0, weight p_0 = 0.5
/// let d = route_backward(&cfg, &logits, &r, &[1.0])?;
/// assert_eq!(d, vec![0.25, -0.25]); // p_0 (1 − p_0), −p_0 p_1
/// # Ok::<(), moefuse::MoeError>(())
/// ```
pub fn route_backward(
    config: &MoeConfig,
    logits: &[f32],
    routing: &Routing,
    d_topk_weights: &[f32],
) -> Result<Vec<f32>, MoeError> {
    let tokens = check_route_inputs(config, logits, None)?;
    let k = config.top_k;
    if routing.top_k != k {
        return Err(MoeError::ShapeMismatch {
            what: "routing top_k",
            expected: k,
            found: routing.top_k,
        });
    }
    expect_len(
        "topk_ids [tokens, top_k]",
        tokens * k,
        routing.topk_ids.len(),
    )?;
    expect_len(
        "d_topk_weights [tokens, top_k]",
        tokens * k,
        d_topk_weights.len(),
    )?;
    check_routing(&routing.topk_ids, k, config.experts)?;
    let dw: Vec<f64> = d_topk_weights.iter().map(|&v| f64::from(v)).collect();
    let d = route_backward_f64(config, logits, &routing.topk_ids, &dw);
    Ok(d.into_iter().map(|v| v as f32).collect())
}

/// [`route_backward`] on checked inputs, in f64 (the layer's backward keeps it in f64).
pub(crate) fn route_backward_f64(
    config: &MoeConfig,
    logits: &[f32],
    topk_ids: &[i32],
    d_topk_weights: &[f64],
) -> Vec<f64> {
    let (e, k) = (config.experts, config.top_k);
    let mut d_logits = vec![0f64; logits.len()];
    d_logits
        .par_chunks_mut(e)
        .zip(logits.par_chunks(e))
        .zip(topk_ids.par_chunks(k).zip(d_topk_weights.par_chunks(k)))
        .for_each(|((dl, l), (ids, dw))| match config.router {
            RouterKind::SoftmaxTopK { renormalize } => {
                let p = softmax(l);
                // g = ∂L/∂p on the chosen experts.
                let mut g = vec![0f64; e];
                let chosen = ids.iter().map(|&id| id as usize);
                if renormalize {
                    let z: f64 = chosen.clone().map(|i| p[i]).sum();
                    let c: f64 = chosen.clone().zip(dw).map(|(i, &d)| d * p[i] / z).sum();
                    chosen.zip(dw).for_each(|(i, &d)| g[i] = (d - c) / z);
                } else {
                    chosen.zip(dw).for_each(|(i, &d)| g[i] = d);
                }
                let gp: f64 = g.iter().zip(&p).map(|(a, b)| a * b).sum();
                for ((o, &pi), &gi) in dl.iter_mut().zip(&p).zip(&g) {
                    *o = pi * (gi - gp);
                }
            }
            RouterKind::SigmoidGrouped {
                routed_scaling_factor,
                renormalize,
                ..
            } => {
                let rsf = f64::from(routed_scaling_factor);
                let s: Vec<f64> = ids
                    .iter()
                    .map(|&id| sigmoid(f64::from(l[id as usize])))
                    .collect();
                let z: f64 = s.iter().sum();
                let c: f64 = s.iter().zip(dw).map(|(si, d)| d * si / z).sum();
                for ((&id, &si), &d) in ids.iter().zip(&s).zip(dw) {
                    let ds = if renormalize {
                        rsf * (d - c) / z
                    } else {
                        rsf * d
                    };
                    dl[id as usize] = ds * si * (1.0 - si);
                }
            }
            RouterKind::External => unreachable!("checked by check_route_inputs"),
        });
    d_logits
}

/// Validates a routing call and returns the token count.
fn check_route_inputs(
    config: &MoeConfig,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> Result<usize, MoeError> {
    config.validate()?;
    let e = config.experts;
    let tokens = rows_of("logits [tokens, experts]", logits.len(), e)?;
    config.check_tokens(tokens)?;
    match (config.router, bias) {
        (RouterKind::External, _) => return Err(MoeError::ExternalRouter),
        (RouterKind::SoftmaxTopK { .. }, Some(_)) => return Err(MoeError::UnexpectedRouterBias),
        (_, Some(b)) => {
            expect_len("router_bias [experts]", e, b.len())?;
            check_finite("router_bias", b)?;
        }
        _ => {}
    }
    Ok(tokens)
}

/// Routes one token: fills its `k` ids and weights.
fn route_token(
    router: RouterKind,
    k: usize,
    l: &[f32],
    bias: Option<&[f32]>,
    ids: &mut [i32],
    ws: &mut [f32],
) {
    let e = l.len();
    let mut chosen = Vec::with_capacity(k);
    let weights: Vec<f64> = match router {
        RouterKind::SoftmaxTopK { renormalize } => {
            let logit: Vec<f64> = l.iter().map(|&v| f64::from(v)).collect();
            top_k_desc(&logit, 0..e, k, &mut chosen);
            let p = softmax(l);
            let z: f64 = if renormalize {
                chosen.iter().map(|&i| p[i]).sum()
            } else {
                1.0
            };
            chosen.iter().map(|&i| p[i] / z).collect()
        }
        RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling_factor,
            renormalize,
        } => {
            let s: Vec<f64> = l.iter().map(|&v| sigmoid(f64::from(v))).collect();
            let sel: Vec<f64> = match bias {
                Some(b) => s
                    .iter()
                    .zip(b)
                    .map(|(si, &bi)| si + f64::from(bi))
                    .collect(),
                None => s.clone(),
            };
            let per_group = e / n_group;
            let mut top2 = Vec::with_capacity(2);
            let group_score: Vec<f64> = (0..n_group)
                .map(|g| {
                    top_k_desc(&sel, g * per_group..(g + 1) * per_group, 2, &mut top2);
                    top2.iter().map(|&i| sel[i]).sum()
                })
                .collect();
            let mut kept = Vec::with_capacity(topk_group);
            top_k_desc(&group_score, 0..n_group, topk_group, &mut kept);
            kept.sort_unstable();
            let candidates = kept
                .iter()
                .flat_map(|&g| g * per_group..(g + 1) * per_group);
            top_k_desc(&sel, candidates, k, &mut chosen);
            let z: f64 = if renormalize {
                chosen.iter().map(|&i| s[i]).sum()
            } else {
                1.0
            };
            let rsf = f64::from(routed_scaling_factor);
            chosen.iter().map(|&i| s[i] / z * rsf).collect()
        }
        RouterKind::External => unreachable!("checked by check_route_inputs"),
    };
    for ((id, w), (&c, &wc)) in ids
        .iter_mut()
        .zip(ws.iter_mut())
        .zip(chosen.iter().zip(&weights))
    {
        *id = c as i32;
        *w = wc as f32;
    }
}

/// Whether candidate `a` ranks before candidate `b` (`a != b`) by `score`: the routers'
/// strict total order, torch.topk's. NaN ranks above every number, `+inf` included; among
/// numbers the higher score first; equal scores (two NaNs, `+0` and `-0`) to the lower id.
///
/// ```
/// use moefuse::reference::router::ranks_before;
/// let s = [1.0, f64::NAN, f64::INFINITY, f64::NAN, 1.0];
/// assert!(ranks_before(&s, 1, 2) && ranks_before(&s, 1, 3) && !ranks_before(&s, 3, 1));
/// assert!(ranks_before(&s, 2, 0) && ranks_before(&s, 0, 4) && !ranks_before(&s, 4, 0));
/// ```
pub fn ranks_before(score: &[f64], a: usize, b: usize) -> bool {
    let (x, y) = (score[a], score[b]);
    match (x.is_nan(), y.is_nan()) {
        (true, true) => a < b,
        (true, false) => true,
        (false, true) => false,
        (false, false) => x > y || (x == y && a < b),
    }
}

/// The `k` best of `candidates` by `score` in the [`ranks_before`] order, best first.
fn top_k_desc(
    score: &[f64],
    candidates: impl Iterator<Item = usize>,
    k: usize,
    out: &mut Vec<usize>,
) {
    out.clear();
    for c in candidates {
        if out.len() == k && !ranks_before(score, c, out[k - 1]) {
            continue;
        }
        let at = out
            .iter()
            .position(|&o| ranks_before(score, c, o))
            .unwrap_or(out.len());
        out.insert(at, c);
        out.truncate(k);
    }
}

/// `softmax(l)` in f64, max-subtracted.
fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let ex: Vec<f64> = l.iter().map(|&v| (f64::from(v) - m).exp()).collect();
    let z: f64 = ex.iter().sum();
    ex.into_iter().map(|v| v / z).collect()
}

/// `Σ a_i b_i` in f64.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

/// The number of rows of length `row` in a tensor of `len` elements.
pub(crate) fn rows_of(what: &'static str, len: usize, row: usize) -> Result<usize, MoeError> {
    if len % row != 0 {
        return Err(MoeError::NotAMultiple {
            what,
            len,
            multiple: row,
        });
    }
    Ok(len / row)
}

/// Every element finite, or a [`MoeError::NonFinite`] naming the first that is not.
pub(crate) fn check_finite(what: &'static str, v: &[f32]) -> Result<(), MoeError> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(MoeError::NonFinite {
            what,
            index,
            value: v[index],
        }),
        None => Ok(()),
    }
}
