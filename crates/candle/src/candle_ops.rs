//! The same MoE block written with candle's own ops — the baseline [`MoeOp`](crate::MoeOp)
//! is tested (and later benchmarked) against, and a readable statement of what it computes.
//!
//! 1. `p = softmax(logits)` over the experts (f32); the top-k experts by sorting the logits
//!    (descending; softmax keeps the order); `w = p[top-k]`, divided by its sum when the
//!    router renormalises.
//! 2. Per expert `e` with tokens `S_e` (their ids read to the host once): `x_e = x[S_e]`,
//!    `h = silu(x_e·gate_upᵀ[gate]) ⊙ (x_e·gate_upᵀ[up])`, `y_e = h·down[e]ᵀ`.
//! 3. `y = Σ_e index_add(S_e, w_e·y_e)` accumulated in f32, returned in `x`'s dtype.
//!
//! Every step is a candle op with a backward, so candle's autograd gives the gradients of
//! `x`, the logits and the flat expert weight. Supports the `SoftmaxTopK` router and the
//! `SwiGlu` activation (both gate/up layouts): the Qwen3-MoE and Mixtral blocks.

use crate::block::{down_view, gate_up_view};
use crate::config::FlatLayout;
use crate::error::expect_shape;
use crate::MoeCandleError;
use candle::{DType, Tensor, D};
use moefuse::{Activation, GateUpLayout, MoeConfig, RouterKind};

/// The top-k routing of `logits [T, E]` by candle ops: `(ids [T, k] u32, weights [T, k]
/// f32)`, slots in descending logit order, weights differentiable w.r.t. the logits.
///
/// ```
/// use candle::{Device, Tensor};
/// let cfg = moefuse::MoeConfig::new(64, 64, 3, 2); // softmax top-2, renormalised
/// let logits = Tensor::new(&[[0f32, 2.0, 1.0]], &Device::Cpu)?;
/// let (ids, w) = moefuse_candle::candle_ops::route(&cfg, &logits)?;
/// assert_eq!(ids.to_vec2::<u32>()?, vec![vec![1, 2]]);
/// let w = w.to_vec2::<f32>()?;
/// assert!((w[0][0] + w[0][1] - 1.0).abs() < 1e-6 && w[0][0] > w[0][1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn route(cfg: &MoeConfig, logits: &Tensor) -> Result<(Tensor, Tensor), MoeCandleError> {
    let RouterKind::SoftmaxTopK { renormalize } = cfg.router else {
        return Err(MoeCandleError::Unsupported {
            what: format!(
                "the candle-ops block routes with SoftmaxTopK only, not {:?}",
                cfg.router
            ),
        });
    };
    let logits = logits.to_dtype(DType::F32)?;
    let p = candle_nn::ops::softmax(&logits, D::Minus1)?;
    let ids = logits
        .arg_sort_last_dim(false)?
        .narrow(1, 0, cfg.top_k)?
        .contiguous()?;
    let mut w = p.gather(&ids, 1)?;
    if renormalize {
        w = w.broadcast_div(&w.sum_keepdim(1)?)?;
    }
    Ok((ids, w))
}

/// `y [T, D]` of `x [T, D]`, `logits [T, E]` and the flat `experts` weight
/// ([`FlatLayout`]), by candle ops (see the module docs). Reads the routing to the host
/// (one synchronisation).
///
/// ```
/// use candle::{Device, Tensor};
/// let cfg = moefuse::MoeConfig::new(64, 64, 2, 1);
/// let x = Tensor::ones((2, 64), candle::DType::F32, &Device::Cpu)?;
/// let logits = Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &Device::Cpu)?;
/// let w = Tensor::zeros(moefuse_candle::FlatLayout::new(&cfg).len(), candle::DType::F32, &Device::Cpu)?;
/// let y = moefuse_candle::candle_ops::forward(&cfg, &x, &logits, &w)?;
/// assert_eq!(y.dims(), &[2, 64]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn forward(
    cfg: &MoeConfig,
    x: &Tensor,
    logits: &Tensor,
    experts: &Tensor,
) -> Result<Tensor, MoeCandleError> {
    cfg.validate()?;
    if cfg.activation != Activation::SwiGlu {
        return Err(MoeCandleError::Unsupported {
            what: format!(
                "the candle-ops block has SwiGlu experts only, not {:?}",
                cfg.activation
            ),
        });
    }
    let (d, i, k) = (cfg.hidden, cfg.intermediate, cfg.top_k);
    let layout = FlatLayout::new(cfg);
    let t = x.dims().first().copied().unwrap_or(0);
    expect_shape("x [T, D]", x.dims(), &[t, d])?;
    expect_shape("logits [T, E]", logits.dims(), &[t, cfg.experts])?;
    expect_shape("experts", experts.dims(), &[layout.len()])?;
    let (ids, w) = route(cfg, logits)?;
    let (gate_up, down) = (gate_up_view(experts, layout)?, down_view(experts, layout)?);
    let w_flat = w.flatten_all()?;
    // Per expert: its tokens and their (token, slot) pair indices, in token order.
    let mut members: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); cfg.experts];
    for (tok, row) in ids.to_vec2::<u32>()?.iter().enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            let m = &mut members[e as usize];
            m.0.push(tok as u32);
            m.1.push((tok * k + slot) as u32);
        }
    }
    let mut y = Tensor::zeros((t, d), DType::F32, x.device())?;
    for (e, (toks, pairs)) in members.iter().enumerate() {
        if toks.is_empty() {
            continue;
        }
        let n = toks.len();
        let toks = Tensor::from_vec(toks.clone(), n, x.device())?;
        let pairs = Tensor::from_vec(pairs.clone(), n, x.device())?;
        let xe = x.index_select(&toks, 0)?;
        let h_pre = xe.matmul(&gate_up.get(e)?.t()?)?;
        let (g, u) = match cfg.gate_up_layout {
            GateUpLayout::Split => (h_pre.narrow(1, 0, i)?, h_pre.narrow(1, i, i)?),
            GateUpLayout::Interleaved => {
                let pairs = h_pre.reshape((n, i, 2))?;
                (
                    pairs.narrow(2, 0, 1)?.squeeze(2)?,
                    pairs.narrow(2, 1, 1)?.squeeze(2)?,
                )
            }
        };
        let h = (g.silu()? * u)?;
        let ye = h.matmul(&down.get(e)?.t()?)?.to_dtype(DType::F32)?;
        let we = w_flat.index_select(&pairs, 0)?.unsqueeze(1)?;
        y = y.index_add(&toks, &ye.broadcast_mul(&we)?, 0)?;
    }
    Ok(y.to_dtype(x.dtype())?)
}
