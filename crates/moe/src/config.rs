//! The layer's configuration: sizes, activation, gate/up layout and router, with the rules
//! every implementation (CPU reference and GPU kernels) relies on.

use crate::MoeError;
use serde::{Deserialize, Serialize};

/// `hidden` and `intermediate` must be positive multiples of this.
pub const DIM_MULTIPLE: usize = 64;
/// The largest `hidden` or `intermediate` (2^20): far above any model's, and low enough that
/// every size the layer computes from a valid config (e.g. `E·2I·D`, `max_tokens·k·D`)
/// fits in `usize` and every per-row extent in the kernels' int32.
pub const MAX_DIM: usize = 1 << 20;
/// The largest expert count and top-k, defined once in `moefuse-spec` for the kernels, the
/// build and this crate alike.
pub use moefuse_spec::{MAX_EXPERTS, MAX_TOP_K};
/// The largest token count one call accepts.
pub const MAX_TOKENS: usize = 65536;

/// The expert MLP's activation, applied to each row of the gate_up projection.
///
/// Gated activations read a gate `g` and an up value `u` per output column `j`
/// (see [`GateUpLayout`]), so their gate_up projection has width `2·I`; [`Activation::Relu2`]
/// reads one value `x` per column and has width `I`. With `σ(x) = 1/(1+e^(−x))` and
/// `silu(x) = x·σ(x)`:
///
/// | variant | `h` |
/// |---|---|
/// | `SwiGlu` | `silu(g)·u` |
/// | `GeGlu` | `gelu_tanh(g)·u`, `gelu_tanh(x) = 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))` |
/// | `SwiGluOai` (gpt-oss) | `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`, `g'·σ(alpha·g')·(u' + 1)` |
/// | `BoundedSwiGlu` | `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`, `silu(g')·u'` |
/// | `Relu2` | `relu(x)²` |
///
/// Gradients: the exact derivatives of these formulas, except that the derivative with respect
/// to an input is zero where its clamp is active, i.e. where the input lies strictly beyond
/// the limit (`g > limit`, `u > limit` or `u < −limit`); at exactly `±limit` it passes.
/// `relu` has derivative 0 at 0 (so `Relu2`'s is `2·relu(x)`, continuous).
///
/// ```
/// use moefuse::Activation;
/// let act = Activation::swiglu_oai();
/// assert_eq!(act, Activation::SwiGluOai { alpha: 1.702, limit: 7.0 });
/// assert!(act.is_gated());
/// assert_eq!(Activation::Relu2.gate_up_width(128), 128);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Activation {
    /// `h = silu(g)·u`.
    SwiGlu,
    /// `h = gelu_tanh(g)·u`, `gelu_tanh(x) = 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))`.
    GeGlu,
    /// gpt-oss: `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`,
    /// `h = g'·σ(alpha·g')·(u' + 1)`. Defaults ([`Activation::swiglu_oai`]): alpha 1.702, limit 7.
    SwiGluOai {
        /// The sigmoid's slope (finite).
        alpha: f32,
        /// The clamp (finite, > 0).
        limit: f32,
    },
    /// `g' = min(g, limit)`, `u' = clamp(u, −limit, limit)`, `h = silu(g')·u'`.
    BoundedSwiGlu {
        /// The clamp (finite, > 0).
        limit: f32,
    },
    /// `h = relu(x)²`, not gated.
    Relu2,
}

impl Activation {
    /// gpt-oss's activation with its defaults: `SwiGluOai { alpha: 1.702, limit: 7.0 }`.
    ///
    /// ```
    /// assert!(matches!(moefuse::Activation::swiglu_oai(), moefuse::Activation::SwiGluOai { .. }));
    /// ```
    pub fn swiglu_oai() -> Self {
        Activation::SwiGluOai {
            alpha: 1.702,
            limit: 7.0,
        }
    }

    /// Whether the activation reads a (gate, up) pair per output column.
    ///
    /// ```
    /// assert!(moefuse::Activation::GeGlu.is_gated());
    /// assert!(!moefuse::Activation::Relu2.is_gated());
    /// ```
    pub fn is_gated(&self) -> bool {
        !matches!(self, Activation::Relu2)
    }

    /// The gate_up projection's width `W` for an intermediate size `I`: `2·I` when gated, else `I`.
    ///
    /// ```
    /// assert_eq!(moefuse::Activation::SwiGlu.gate_up_width(64), 128);
    /// ```
    pub fn gate_up_width(&self, intermediate: usize) -> usize {
        if self.is_gated() {
            2 * intermediate
        } else {
            intermediate
        }
    }

    /// Checks the scalar parameters: `alpha` finite, `limit` finite and > 0.
    ///
    /// ```
    /// use moefuse::Activation;
    /// assert!(Activation::BoundedSwiGlu { limit: 0.0 }.validate().is_err());
    /// assert!(Activation::swiglu_oai().validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<(), MoeError> {
        let check_limit = |limit: f32| {
            if limit.is_finite() && limit > 0.0 {
                Ok(())
            } else {
                Err(MoeError::InvalidParameter {
                    what: "activation limit",
                    value: limit,
                    rule: "must be finite and > 0",
                })
            }
        };
        match *self {
            Activation::SwiGluOai { alpha, limit } => {
                if !alpha.is_finite() {
                    return Err(MoeError::InvalidParameter {
                        what: "activation alpha",
                        value: alpha,
                        rule: "must be finite",
                    });
                }
                check_limit(limit)
            }
            Activation::BoundedSwiGlu { limit } => check_limit(limit),
            Activation::SwiGlu | Activation::GeGlu | Activation::Relu2 => Ok(()),
        }
    }
}

/// Where gate and up values sit in a gated activation's gate_up row of width `2·I`.
/// Ignored for [`Activation::Relu2`] (one value per column, column `j` feeds `h[j]`).
///
/// * `Split`: columns `[0, I)` are the gates, `[I, 2I)` the ups: `g_j = row[j]`, `u_j = row[I + j]`.
/// * `Interleaved` (gpt-oss): `g_j = row[2j]`, `u_j = row[2j + 1]`.
///
/// ```
/// use moefuse::GateUpLayout;
/// assert_eq!(GateUpLayout::Split.columns(3, 64), (3, 67));
/// assert_eq!(GateUpLayout::Interleaved.columns(3, 64), (6, 7));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum GateUpLayout {
    /// Gates in `[0, I)`, ups in `[I, 2I)`.
    #[default]
    Split,
    /// Gate `j` at `2j`, up `j` at `2j + 1`.
    Interleaved,
}

impl GateUpLayout {
    /// The columns `(gate, up)` of output column `j` in a gated row, `intermediate` = `I`.
    ///
    /// ```
    /// assert_eq!(moefuse::GateUpLayout::Split.columns(0, 128), (0, 128));
    /// ```
    pub fn columns(&self, j: usize, intermediate: usize) -> (usize, usize) {
        match self {
            GateUpLayout::Split => (j, intermediate + j),
            GateUpLayout::Interleaved => (2 * j, 2 * j + 1),
        }
    }
}

/// How tokens choose experts. Slots are ordered by descending selection score (ties: lower
/// expert id first), so slot 0 holds each token's best expert.
///
/// * `SoftmaxTopK`: `p = softmax(logits)` over all `E` experts; the top-k experts by `p`
///   (ties → lower id; as softmax is strictly increasing this is the top-k by logit);
///   `weight = p_e`, divided by `Σ_{chosen} p` when `renormalize`.
/// * `SigmoidGrouped` (DeepSeek-V3): `s = sigmoid(logits)`; selection score
///   `s_e + bias[e]` (the bias, one per expert, gets no gradient; absent = 0); the experts form
///   `n_group` groups of `E/n_group` consecutive ids; a group's score is the sum of its top 2
///   selection scores; the `topk_group` best groups are kept (ties → lower group id); the top-k
///   experts by selection score among the kept groups are chosen (ties → lower id);
///   `weight = s_e` (no bias), divided by `Σ_{chosen} s` when `renormalize`, then times
///   `routed_scaling_factor`.
/// * `External`: the caller passes `topk_ids [T, k]` (i32) and `topk_weights [T, k]` (f32).
///
/// Backward treats the selection as constant: gradients flow through softmax / sigmoid,
/// the renormalisation and the scaling only.
///
/// ```
/// use moefuse::RouterKind;
/// let r = RouterKind::SigmoidGrouped { n_group: 8, topk_group: 4, routed_scaling_factor: 2.5, renormalize: true };
/// assert!(r.computes_routing());
/// assert!(!RouterKind::External.computes_routing());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum RouterKind {
    /// Softmax over all experts, then top-k.
    SoftmaxTopK {
        /// Divide the chosen weights by their sum.
        renormalize: bool,
    },
    /// DeepSeek-V3's biased, group-limited sigmoid router.
    SigmoidGrouped {
        /// Number of expert groups (divides `E`, `E/n_group ≥ 2`).
        n_group: usize,
        /// Groups kept per token (`1..=n_group`).
        topk_group: usize,
        /// Final scale of the weights (finite, > 0).
        routed_scaling_factor: f32,
        /// Divide the chosen weights by their sum before scaling.
        renormalize: bool,
    },
    /// Routing comes from the caller.
    External,
}

impl Default for RouterKind {
    /// `SoftmaxTopK { renormalize: true }`.
    fn default() -> Self {
        RouterKind::SoftmaxTopK { renormalize: true }
    }
}

impl RouterKind {
    /// Whether the layer computes routing itself from router logits (all but `External`).
    ///
    /// ```
    /// assert!(moefuse::RouterKind::default().computes_routing());
    /// ```
    pub fn computes_routing(&self) -> bool {
        !matches!(self, RouterKind::External)
    }
}

/// The MoE layer's shape and behaviour: `D = hidden`, `I = intermediate`, `E = experts`,
/// `k = top_k`. Build with [`MoeConfig::new`] (SwiGLU, split layout, renormalised softmax
/// router) and the `with_*` methods; [`MoeConfig::validate`] checks the rules:
///
/// * `hidden` and `intermediate` are positive multiples of 64, at most 2^20 ([`MAX_DIM`]);
/// * `1 ≤ experts ≤ 512`; `1 ≤ top_k ≤ 16` and `top_k ≤ experts`;
/// * grouped router: `n_group ≥ 1` divides `experts`, `experts/n_group ≥ 2`,
///   `1 ≤ topk_group ≤ n_group`, `top_k ≤ topk_group·(experts/n_group)`,
///   `routed_scaling_factor` finite and > 0;
/// * activation parameters: see [`Activation::validate`].
///
/// Token counts (`1..=65536`) are checked per call by [`MoeConfig::check_tokens`].
///
/// ```
/// use moefuse::{Activation, GateUpLayout, MoeConfig};
/// let cfg = MoeConfig::new(2880, 2880, 128, 4)
///     .with_activation(Activation::swiglu_oai())
///     .with_gate_up_layout(GateUpLayout::Interleaved);
/// cfg.validate()?;
/// assert_eq!(cfg.gate_up_width(), 5760);
/// # Ok::<(), moefuse::MoeError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Model width `D`.
    pub hidden: usize,
    /// Expert MLP width `I`.
    pub intermediate: usize,
    /// Number of experts `E`.
    pub experts: usize,
    /// Experts per token `k`.
    pub top_k: usize,
    /// The expert MLP's activation.
    pub activation: Activation,
    /// Gate/up column order of gated activations.
    pub gate_up_layout: GateUpLayout,
    /// How tokens choose experts.
    pub router: RouterKind,
}

impl MoeConfig {
    /// A config with SwiGLU, the split gate/up layout and a renormalised softmax top-k router.
    /// Not validated: call [`MoeConfig::validate`].
    ///
    /// ```
    /// let cfg = moefuse::MoeConfig::new(128, 64, 8, 2);
    /// assert_eq!(cfg.activation, moefuse::Activation::SwiGlu);
    /// ```
    pub fn new(hidden: usize, intermediate: usize, experts: usize, top_k: usize) -> Self {
        MoeConfig {
            hidden,
            intermediate,
            experts,
            top_k,
            activation: Activation::SwiGlu,
            gate_up_layout: GateUpLayout::Split,
            router: RouterKind::default(),
        }
    }

    /// Replaces the activation.
    ///
    /// ```
    /// let cfg = moefuse::MoeConfig::new(64, 64, 4, 1).with_activation(moefuse::Activation::Relu2);
    /// assert_eq!(cfg.gate_up_width(), 64);
    /// ```
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Replaces the gate/up layout.
    ///
    /// ```
    /// use moefuse::{GateUpLayout, MoeConfig};
    /// let cfg = MoeConfig::new(64, 64, 4, 1).with_gate_up_layout(GateUpLayout::Interleaved);
    /// assert_eq!(cfg.gate_up_layout, GateUpLayout::Interleaved);
    /// ```
    pub fn with_gate_up_layout(mut self, layout: GateUpLayout) -> Self {
        self.gate_up_layout = layout;
        self
    }

    /// Replaces the router.
    ///
    /// ```
    /// use moefuse::{MoeConfig, RouterKind};
    /// let cfg = MoeConfig::new(64, 64, 4, 1).with_router(RouterKind::External);
    /// assert!(cfg.validate().is_ok());
    /// ```
    pub fn with_router(mut self, router: RouterKind) -> Self {
        self.router = router;
        self
    }

    /// The gate_up projection's width `W`: `2·I` for gated activations, `I` for `Relu2`.
    ///
    /// ```
    /// assert_eq!(moefuse::MoeConfig::new(64, 192, 4, 1).gate_up_width(), 384);
    /// ```
    pub fn gate_up_width(&self) -> usize {
        self.activation.gate_up_width(self.intermediate)
    }

    /// Checks every rule listed on [`MoeConfig`], returning the first one broken.
    ///
    /// ```
    /// use moefuse::{MoeConfig, MoeError};
    /// assert_eq!(
    ///     MoeConfig::new(64, 64, 4, 5).validate(),
    ///     Err(MoeError::TopKOutOfRange { top_k: 5, experts: 4, max: 16 })
    /// );
    /// ```
    pub fn validate(&self) -> Result<(), MoeError> {
        for (what, value) in [("hidden", self.hidden), ("intermediate", self.intermediate)] {
            if value == 0 || value % DIM_MULTIPLE != 0 {
                return Err(MoeError::DimNotMultiple {
                    what,
                    value,
                    multiple: DIM_MULTIPLE,
                });
            }
            if value > MAX_DIM {
                return Err(MoeError::TooLarge {
                    what,
                    value,
                    max: MAX_DIM,
                });
            }
        }
        let experts = self.experts;
        if !(1..=MAX_EXPERTS).contains(&experts) {
            return Err(MoeError::ExpertsOutOfRange {
                experts,
                max: MAX_EXPERTS,
            });
        }
        if self.top_k == 0 || self.top_k > MAX_TOP_K || self.top_k > experts {
            return Err(MoeError::TopKOutOfRange {
                top_k: self.top_k,
                experts,
                max: MAX_TOP_K,
            });
        }
        if let RouterKind::SigmoidGrouped {
            n_group,
            topk_group,
            routed_scaling_factor,
            ..
        } = self.router
        {
            if n_group == 0 || experts % n_group != 0 {
                return Err(MoeError::InvalidGroupCount { n_group, experts });
            }
            let per_group = experts / n_group;
            if per_group < 2 {
                return Err(MoeError::GroupTooSmall {
                    experts,
                    n_group,
                    per_group,
                });
            }
            if topk_group == 0 || topk_group > n_group {
                return Err(MoeError::TopkGroupOutOfRange {
                    topk_group,
                    n_group,
                });
            }
            if self.top_k > topk_group * per_group {
                return Err(MoeError::TopKExceedsKeptGroups {
                    top_k: self.top_k,
                    topk_group,
                    per_group,
                });
            }
            if !(routed_scaling_factor.is_finite() && routed_scaling_factor > 0.0) {
                return Err(MoeError::InvalidParameter {
                    what: "routed_scaling_factor",
                    value: routed_scaling_factor,
                    rule: "must be finite and > 0",
                });
            }
        }
        self.activation.validate()
    }

    /// Checks one call's token count: `1 ≤ tokens ≤ 65536`.
    ///
    /// ```
    /// let cfg = moefuse::MoeConfig::new(64, 64, 4, 1);
    /// assert!(cfg.check_tokens(65536).is_ok());
    /// assert!(cfg.check_tokens(0).is_err());
    /// ```
    pub fn check_tokens(&self, tokens: usize) -> Result<(), MoeError> {
        if (1..=MAX_TOKENS).contains(&tokens) {
            Ok(())
        } else {
            Err(MoeError::TokensOutOfRange {
                tokens,
                max: MAX_TOKENS,
            })
        }
    }
}
