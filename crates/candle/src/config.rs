//! Configs of the Hugging Face MoE blocks this crate loads ([`qwen3_moe_config`],
//! [`mixtral_config`]) and the flat expert-weight layout ([`FlatLayout`]) every part of the
//! crate shares.

use crate::MoeCandleError;
use moefuse::{Activation, GateUpLayout, MoeConfig, RouterKind};

/// Qwen3-MoE's block: SwiGLU experts (`silu(gate)·up`), a softmax top-k router whose
/// weights are renormalised over the chosen experts when `norm_topk_prob` (Qwen3's config
/// key of that name), our split gate/up layout. Arguments are the Hugging Face config's
/// `hidden_size`, `moe_intermediate_size`, `num_experts`, `num_experts_per_tok`.
///
/// ```
/// // Qwen3-30B-A3B
/// let cfg = moefuse_candle::qwen3_moe_config(2048, 768, 128, 8, true)?;
/// assert_eq!(cfg.router, moefuse::RouterKind::SoftmaxTopK { renormalize: true });
/// # Ok::<(), moefuse_candle::MoeCandleError>(())
/// ```
pub fn qwen3_moe_config(
    hidden: usize,
    moe_intermediate: usize,
    experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
) -> Result<MoeConfig, MoeCandleError> {
    let cfg = MoeConfig::new(hidden, moe_intermediate, experts, top_k)
        .with_activation(Activation::SwiGlu)
        .with_gate_up_layout(GateUpLayout::Split)
        .with_router(RouterKind::SoftmaxTopK {
            renormalize: norm_topk_prob,
        });
    cfg.validate()?;
    Ok(cfg)
}

/// Mixtral's block: SwiGLU experts (`w1` gate, `w3` up, `w2` down), softmax over all
/// experts, top-k (2 in Mixtral-8x7B), weights renormalised over the chosen experts (the
/// same as Mixtral's top-k of the logits followed by a softmax over those k). Arguments are
/// `hidden_size`, `intermediate_size`, `num_local_experts`, `num_experts_per_tok`.
///
/// ```
/// // Mixtral-8x7B
/// let cfg = moefuse_candle::mixtral_config(4096, 14336, 8, 2)?;
/// assert_eq!(cfg.top_k, 2);
/// # Ok::<(), moefuse_candle::MoeCandleError>(())
/// ```
pub fn mixtral_config(
    hidden: usize,
    intermediate: usize,
    experts: usize,
    top_k: usize,
) -> Result<MoeConfig, MoeCandleError> {
    qwen3_moe_config(hidden, intermediate, experts, top_k, true)
}

/// Where the two expert tensors sit in the one flat expert weight `[E·W·D + E·D·I]`: first
/// `gate_up [E, W, D]`, then `down [E, D, I]`, each row-major in moefuse's layout
/// ([`moefuse::model::MoeWeights`]: `W = 2I` for gated activations, gate/up column order
/// per [`GateUpLayout`]).
///
/// ```
/// let cfg = moefuse::MoeConfig::new(64, 128, 4, 2);
/// let l = moefuse_candle::FlatLayout::new(&cfg);
/// assert_eq!((l.gate_up, l.down, l.len()), (4 * 256 * 64, 4 * 64 * 128, 4 * 256 * 64 + 4 * 64 * 128));
/// assert_eq!(l.gate_up_shape(), [4, 256, 64]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatLayout {
    /// Elements of `gate_up [E, W, D]`, at offset 0.
    pub gate_up: usize,
    /// Elements of `down [E, D, I]`, at offset `gate_up`.
    pub down: usize,
    experts: usize,
    width: usize,
    hidden: usize,
    intermediate: usize,
}

impl FlatLayout {
    /// The layout of `cfg`'s expert weights (sizes only; `cfg` is not validated here).
    ///
    /// ```
    /// let l = moefuse_candle::FlatLayout::new(&moefuse::MoeConfig::new(64, 64, 2, 1));
    /// assert_eq!(l.down_shape(), [2, 64, 64]);
    /// ```
    pub fn new(cfg: &MoeConfig) -> Self {
        let (d, i, e, w) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.gate_up_width(),
        );
        FlatLayout {
            gate_up: e * w * d,
            down: e * d * i,
            experts: e,
            width: w,
            hidden: d,
            intermediate: i,
        }
    }

    /// Elements of the flat weight, `gate_up + down`.
    ///
    /// ```
    /// let l = moefuse_candle::FlatLayout::new(&moefuse::MoeConfig::new(64, 64, 1, 1));
    /// assert_eq!(l.len(), 128 * 64 + 64 * 64);
    /// ```
    pub fn len(&self) -> usize {
        self.gate_up + self.down
    }

    /// Whether the layout holds no element (never, for a valid config).
    ///
    /// ```
    /// assert!(!moefuse_candle::FlatLayout::new(&moefuse::MoeConfig::new(64, 64, 1, 1)).is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `[E, W, D]`.
    ///
    /// ```
    /// let l = moefuse_candle::FlatLayout::new(&moefuse::MoeConfig::new(64, 64, 2, 1));
    /// assert_eq!(l.gate_up_shape(), [2, 128, 64]);
    /// ```
    pub fn gate_up_shape(&self) -> [usize; 3] {
        [self.experts, self.width, self.hidden]
    }

    /// `[E, D, I]`.
    ///
    /// ```
    /// let l = moefuse_candle::FlatLayout::new(&moefuse::MoeConfig::new(128, 64, 2, 1));
    /// assert_eq!(l.down_shape(), [2, 128, 64]);
    /// ```
    pub fn down_shape(&self) -> [usize; 3] {
        [self.experts, self.hidden, self.intermediate]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moefuse::MoeError;

    #[test]
    fn configs_validate_and_carry_the_router() {
        let q = qwen3_moe_config(2048, 768, 128, 8, false).unwrap();
        assert_eq!(q.router, RouterKind::SoftmaxTopK { renormalize: false });
        assert_eq!(q.gate_up_layout, GateUpLayout::Split);
        let m = mixtral_config(4096, 14336, 8, 2).unwrap();
        assert_eq!(m.router, RouterKind::SoftmaxTopK { renormalize: true });
        assert!(matches!(
            qwen3_moe_config(100, 768, 128, 8, true),
            Err(MoeCandleError::Moe(MoeError::DimNotMultiple {
                what: "hidden",
                ..
            }))
        ));
        let l = FlatLayout::new(&q);
        assert_eq!(l.gate_up, 128 * 1536 * 2048);
        assert_eq!(l.down, 128 * 2048 * 768);
    }
}
