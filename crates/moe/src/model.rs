//! The layer's model, shared by both sides: the CPU [`reference`](crate::reference) and
//! the GPU layer ([`gpu::MoeLayer`](crate::gpu::MoeLayer)) take the same host weights
//! ([`MoeWeights`], uploaded with [`gpu::DeviceWeights::upload`](crate::gpu::DeviceWeights::upload))
//! and check routing given on the host by the same rules ([`check_routing`]).
//!
//! ```
//! use moefuse::{model::{check_routing, MoeWeights}, MoeConfig};
//! let cfg = MoeConfig::new(64, 64, 4, 2);
//! MoeWeights::zeros(&cfg, true).validate(&cfg)?;
//! check_routing(&[0, 3, 2, 1], cfg.top_k, cfg.experts)?;
//! # Ok::<(), moefuse::MoeError>(())
//! ```

use crate::{MoeConfig, MoeError};

/// The layer's parameters, f32, row-major. With `D = hidden`, `I = intermediate`,
/// `E = experts` and `W = gate_up_width()` (`2I` gated, `I` for `Relu2`):
///
/// * `router`: `[E, D]`, `logits[t, e] = Σ_d x[t, d]·router[e, d]` (`logits = x·routerᵀ`).
///   Needed when the CPU reference routes ([`RoutingInput::Ours`](crate::reference::RoutingInput::Ours));
///   the GPU layer takes router logits from the caller instead.
/// * `router_bias`: `[E]`, the `SigmoidGrouped` selection bias (no gradient); `None` = zeros.
/// * `gate_up`: `[E, W, D]`, expert `e`'s projection is the `[W, D]` block at `e·W·D`
///   ("N×K", output-major): `h_pre[w] = Σ_d x[d]·gate_up[e, w, d]` (`h_pre = x·gate_up[e]ᵀ`).
///   Column order of `W` per [`GateUpLayout`](crate::GateUpLayout).
/// * `down`: `[E, D, I]`, `y_e[d] = Σ_i h[i]·down[e, d, i]` (`y_e = h·down[e]ᵀ`).
///
/// ```
/// use moefuse::{model::MoeWeights, MoeConfig};
/// let cfg = MoeConfig::new(64, 128, 4, 2);
/// let w = MoeWeights::zeros(&cfg, true);
/// assert_eq!(w.gate_up.len(), 4 * 256 * 64);
/// assert_eq!(w.down.len(), 4 * 64 * 128);
/// assert!(w.validate(&cfg).is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MoeWeights {
    /// `[E, D]` router matrix, if the layer routes itself.
    pub router: Option<Vec<f32>>,
    /// `[E]` selection bias of the `SigmoidGrouped` router.
    pub router_bias: Option<Vec<f32>>,
    /// `[E, W, D]` gate_up projections.
    pub gate_up: Vec<f32>,
    /// `[E, D, I]` down projections.
    pub down: Vec<f32>,
}

impl MoeWeights {
    /// All-zero weights of `config`'s shapes; a zero router when `with_router`, no bias.
    ///
    /// ```
    /// let w = moefuse::model::MoeWeights::zeros(&moefuse::MoeConfig::new(64, 64, 2, 1), false);
    /// assert!(w.router.is_none());
    /// ```
    pub fn zeros(config: &MoeConfig, with_router: bool) -> Self {
        let (d, i, e, w) = (
            config.hidden,
            config.intermediate,
            config.experts,
            config.gate_up_width(),
        );
        MoeWeights {
            router: with_router.then(|| vec![0.0; e * d]),
            router_bias: None,
            gate_up: vec![0.0; e * w * d],
            down: vec![0.0; e * d * i],
        }
    }

    /// Checks every present tensor's length against `config`.
    ///
    /// ```
    /// let cfg = moefuse::MoeConfig::new(64, 64, 2, 1);
    /// let mut w = moefuse::model::MoeWeights::zeros(&cfg, false);
    /// w.down.pop();
    /// assert!(w.validate(&cfg).is_err());
    /// ```
    pub fn validate(&self, config: &MoeConfig) -> Result<(), MoeError> {
        let (d, i, e, w) = (
            config.hidden,
            config.intermediate,
            config.experts,
            config.gate_up_width(),
        );
        if let Some(r) = &self.router {
            expect_len("router [experts, hidden]", e * d, r.len())?;
        }
        if let Some(b) = &self.router_bias {
            expect_len("router_bias [experts]", e, b.len())?;
        }
        expect_len(
            "gate_up [experts, gate_up_width, hidden]",
            e * w * d,
            self.gate_up.len(),
        )?;
        expect_len(
            "down [experts, hidden, intermediate]",
            e * d * i,
            self.down.len(),
        )
    }
}

/// Checks routing ids `[T, k]`: every id in `0..experts`, no expert twice in a token.
///
/// ```
/// use moefuse::{model::check_routing, MoeError};
/// assert!(check_routing(&[0, 1, 1, 0], 2, 2).is_ok());
/// assert_eq!(
///     check_routing(&[0, 1, 1, 1], 2, 2),
///     Err(MoeError::DuplicateExpert { token: 1, first_slot: 0, slot: 1, id: 1 })
/// );
/// ```
pub fn check_routing(topk_ids: &[i32], top_k: usize, experts: usize) -> Result<(), MoeError> {
    if top_k == 0 || topk_ids.len() % top_k != 0 {
        return Err(MoeError::NotAMultiple {
            what: "topk_ids [tokens, top_k]",
            len: topk_ids.len(),
            multiple: top_k,
        });
    }
    for (token, ids) in topk_ids.chunks(top_k).enumerate() {
        for (slot, &id) in ids.iter().enumerate() {
            if id < 0 || id as usize >= experts {
                return Err(MoeError::ExpertIdOutOfRange {
                    token,
                    slot,
                    id,
                    experts,
                });
            }
            if let Some(first_slot) = ids[..slot].iter().position(|&o| o == id) {
                return Err(MoeError::DuplicateExpert {
                    token,
                    first_slot,
                    slot,
                    id,
                });
            }
        }
    }
    Ok(())
}

/// `found == expected`, or a [`MoeError::ShapeMismatch`] naming `what`.
pub(crate) fn expect_len(
    what: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), MoeError> {
    if expected == found {
        Ok(())
    } else {
        Err(MoeError::ShapeMismatch {
            what,
            expected,
            found,
        })
    }
}
