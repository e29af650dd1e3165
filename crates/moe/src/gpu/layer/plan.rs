//! [`MoePlan`]: the layer's shape validated once and every buffer sized from it, on the
//! host; [`Mode`] and the [`LayerMemory`] a layer of each mode holds.

use crate::gpu::{DeviceErrors, PermuteBuffers};
use crate::{MoeConfig, MoeError};
use std::fmt;

/// What a [`MoeLayer`](super::MoeLayer) keeps between its forward and a backward.
///
/// * `Inference`: nothing. The forward's expert-major intermediates live in the shared
///   [`MoeWorkspace`](super::MoeWorkspace) and are dead when the forward returns;
///   [`backward`](super::MoeLayer::backward) returns [`MoeError::NotTraining`].
/// * `Training`: what the backward reads (see [`LayerMemory`] for the exact list and
///   [`MoePlan::memory`] for the bytes).
///
/// ```
/// use moefuse::gpu::Mode;
/// assert_eq!(Mode::Inference.to_string(), "inference");
/// assert!(Mode::Training.saves_for_backward());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Forward only: nothing is saved for a backward.
    Inference,
    /// Forward saves what the backward needs.
    Training,
}

impl Mode {
    /// Whether a forward in this mode saves state for a backward.
    ///
    /// ```
    /// assert!(!moefuse::gpu::Mode::Inference.saves_for_backward());
    /// ```
    pub fn saves_for_backward(self) -> bool {
        self == Mode::Training
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Inference => "inference",
            Mode::Training => "training",
        })
    }
}

/// Device memory a layer holds (bytes), per kind; the weights are the caller's and the
/// workspace is shared, so neither is counted.
///
/// What each mode keeps, with today's unfused kernels (`R = max_tokens · top_k` rows,
/// bf16 intermediates):
///
/// | field | Inference | Training |
/// |---|---|---|
/// | `activations` | 0 | `x [T, D]` and `h_pre [R, W]` (bf16): `(T·D + R·W)·2` |
/// | `logits` | 0 | router logits `[T, E]` f32 when the layer routes (`Routing::Logits`) |
/// | `routing` | ids, weights `[T, k]`, the permutation (`row_of`, `source_of`, offsets, scratch): `O(T·k)` | the same plus `T` identity rows (the copy of `x`); the backward reads it |
/// | `gemm_workspace` | the forward GEMMs' (device-queried, a few hundred bytes per expert) | forward and backward GEMMs' |
///
/// The backward recomputes the rest: its GEMMs read `x` and `dy` through `source_of` (on
/// sm90a; elsewhere, or with `MOEFUSE_BACKWARD_GATHER=off`, `x_perm` and `dy_perm` are
/// regathered into the workspace), `h` from `h_pre` (in the routed activation backward),
/// and no `y_e` at all:
/// `d_topk_weights = ⟨dy · D_e, h⟩` (= `⟨dy, y_e⟩`).
///
/// ```
/// use moefuse::gpu::{Mode, MoePlan};
/// let plan = MoePlan::new(moefuse::MoeConfig::new(2048, 768, 128, 8), 8192)?;
/// let m = plan.memory(Mode::Training);
/// assert_eq!(m.activations, (8192 * 2048 + 65536 * 1536) * 2); // 224 MiB
/// assert_eq!(plan.memory(Mode::Inference).saved_for_backward(), 0);
/// # Ok::<(), moefuse::MoeError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerMemory {
    /// The mode the layer was built for.
    pub mode: Mode,
    /// Expert-major activations saved for the backward (Training only).
    pub activations: usize,
    /// Router logits saved for the router backward (Training, routing configs only).
    pub logits: usize,
    /// Routing and permutation state, `O(T·k)`: the forward's own; in Training the
    /// backward reads it too.
    pub routing: usize,
    /// The grouped GEMMs' workspace (0 in [`MoePlan::memory`]: its size is queried from
    /// the device when the layer is built).
    pub gemm_workspace: usize,
}

impl LayerMemory {
    /// Bytes kept for a backward: activations, logits and routing in Training, 0 in
    /// Inference.
    ///
    /// ```
    /// # use moefuse::gpu::{Mode, MoePlan};
    /// let plan = MoePlan::new(moefuse::MoeConfig::new(64, 64, 4, 2), 16)?;
    /// let m = plan.memory(Mode::Training);
    /// assert_eq!(m.saved_for_backward(), m.activations + m.logits + m.routing);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn saved_for_backward(&self) -> usize {
        match self.mode {
            Mode::Inference => 0,
            Mode::Training => self.activations + self.logits + self.routing,
        }
    }

    /// Everything the layer holds.
    ///
    /// ```
    /// # use moefuse::gpu::{Mode, MoePlan};
    /// let plan = MoePlan::new(moefuse::MoeConfig::new(64, 64, 4, 2), 16)?;
    /// let m = plan.memory(Mode::Inference);
    /// assert_eq!(m.total(), m.routing);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn total(&self) -> usize {
        self.activations + self.logits + self.routing + self.gemm_workspace
    }
}

impl fmt::Display for LayerMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "{}: {:.1} MiB saved for the backward (activations {:.1}, logits {:.1}, routing {:.2}), \
             GEMM workspace {:.2} MiB, total {:.1} MiB",
            self.mode,
            mib(self.saved_for_backward()),
            mib(self.activations),
            mib(self.logits),
            mib(self.routing),
            mib(self.gemm_workspace),
            mib(self.total())
        )
    }
}

/// Where one pass keeps its expert-major bf16 intermediates: slot `s` holds `lens[s]`
/// elements in workspace region `at[s]`. Slots that share a region are never live at
/// once (each is dead before the next one in its region is written).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Layout<const N: usize> {
    pub(super) lens: [usize; N],
    pub(super) at: [usize; N],
}

impl<const N: usize> Layout<N> {
    /// Element counts of the regions: each the largest slot it holds.
    pub(super) fn regions(&self) -> Vec<usize> {
        let count = self.at.iter().max().map_or(0, |m| m + 1);
        let mut r = vec![0; count];
        for (len, at) in self.lens.iter().zip(self.at) {
            r[at] = r[at].max(*len);
        }
        r
    }

    /// Bytes of all regions.
    pub(super) fn bytes(&self) -> usize {
        self.regions().iter().sum::<usize>() * 2
    }
}

/// The forward's intermediates (regions: `x_perm`/`h`, `h_pre`/`y_e`). In Training
/// `h_pre` is the layer's saved buffer instead of its workspace slot.
pub(super) const X_PERM: usize = 0;
pub(super) const H_PRE: usize = 1;
pub(super) const H: usize = 2;
pub(super) const Y_E: usize = 3;
/// The backward's scratch: `x_perm` regathered from the saved `x` and the unweighted
/// `dy_perm` (both only where the GEMMs cannot read them through `source_of`; the
/// workspace keeps room for them, as the plan does not know the device), `dx_perm` (in
/// `dy_perm`'s region), `dh = dy · D_e`, `h_scaled = w · h`, `d_h_pre`.
pub(super) const X_AGAIN: usize = 0;
pub(super) const DY_PERM: usize = 1;
pub(super) const DH: usize = 2;
pub(super) const H_SCALED: usize = 3;
pub(super) const D_H_PRE: usize = 4;
pub(super) const DX_PERM: usize = 5;

/// Which of the backward's copies a layer's paths skip: what sizes its scratch
/// ([`MoePlan::backward_layout`]). [`BackwardScratch::ALL`] is every slot (any device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BackwardScratch {
    /// The gate_up wgrad reads `x` through `source_of`: no `x_perm` regather.
    pub(super) gathers_x: bool,
    /// The down dgrad and wgrad read `dy` through `source_of`: no `dy_perm`.
    pub(super) gathers_dy: bool,
    /// The down dgrad's epilogue runs the activation backward: no `dh`.
    pub(super) fuses_activation: bool,
}

impl BackwardScratch {
    /// No copy skipped: the scratch every device and path fits in.
    pub(super) const ALL: Self = BackwardScratch {
        gathers_x: false,
        gathers_dy: false,
        fuses_activation: false,
    };
}

/// Which of the forward's intermediates sit in the workspace, by the gate_up path a call
/// takes ([`MoePlan::forward_layout`]); the decode kernels use `FusedGather`'s (`h` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ForwardScratch {
    /// `x_perm`, then the GEMM's `h_pre` (Inference) and the activation's `h`, then `y_e`:
    /// every slot, the bound of [`MoePlan::workspace_bytes`].
    Unfused,
    /// `x_perm`, then `h` from the GEMM's epilogue, then `y_e`.
    FusedActivation,
    /// `h` from the gathering GEMM, then `y_e`.
    FusedGather,
}

/// A validated layer shape with every buffer sized, computed on the host with no device,
/// no allocation and no launch ([`MoePlan::new`]). One plan serves any number of layers
/// ([`MoeLayer::new`](super::MoeLayer::new)) and sizes the workspace they share
/// ([`MoePlan::workspace_bytes`]).
///
/// ```
/// use moefuse::{gpu::{Mode, MoePlan}, MoeConfig, MoeError};
/// let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192)?;
/// assert_eq!(plan.rows(), 65536);
/// assert_eq!(plan.workspace_bytes(Mode::Inference), 65536 * (2048 + 2048) * 2); // 512 MiB
/// assert!(matches!(MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 0),
///     Err(MoeError::TokensOutOfRange { tokens: 0, .. })));
/// # Ok::<(), MoeError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoePlan {
    cfg: MoeConfig,
    max_tokens: usize,
    rows: usize,
    permute_words: usize,
}

impl MoePlan {
    /// Checks `cfg` ([`MoeConfig::validate`]) and `1 <= max_tokens <= 65536`
    /// ([`MoeConfig::check_tokens`]), and sizes the buffers of a layer taking up to
    /// `max_tokens` tokens per call.
    ///
    /// ```
    /// use moefuse::{gpu::MoePlan, MoeConfig, MoeError};
    /// assert_eq!(MoePlan::new(MoeConfig::new(64, 64, 4, 5), 16).unwrap_err(),
    ///     MoeError::TopKOutOfRange { top_k: 5, experts: 4, max: 16 });
    /// ```
    pub fn new(cfg: MoeConfig, max_tokens: usize) -> Result<Self, MoeError> {
        cfg.validate()?;
        cfg.check_tokens(max_tokens)?;
        // validate(): E <= 512, k <= 16, D, I <= 2^20, W <= 2^21; max_tokens <= 2^16: no
        // size below overflows usize.
        let (rows, permute_words) = PermuteBuffers::sizes(max_tokens, cfg.experts, cfg.top_k)?;
        Ok(MoePlan {
            cfg,
            max_tokens,
            rows,
            permute_words,
        })
    }

    /// The configuration.
    ///
    /// ```
    /// # use moefuse::{gpu::MoePlan, MoeConfig};
    /// assert_eq!(MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?.config().experts, 4);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The largest token count a call takes.
    ///
    /// ```
    /// # use moefuse::{gpu::MoePlan, MoeConfig};
    /// assert_eq!(MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?.max_tokens(), 8);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// `R = max_tokens · top_k`, the rows every expert-major buffer holds.
    ///
    /// ```
    /// # use moefuse::{gpu::MoePlan, MoeConfig};
    /// assert_eq!(MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?.rows(), 16);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes of the [`MoeWorkspace`](super::MoeWorkspace) a layer of this plan needs in
    /// `mode`. Its content is scratch within one call, so every layer on one stream can
    /// share one workspace of the largest size their plans ask.
    ///
    /// Inference holds the forward's `x_perm`/`h` and `h_pre`/`y_e` there:
    /// `R·(max(D, I) + max(W, D))·2` bytes. Training's forward uses the same (its `h_pre`
    /// is saved in the layer instead) and its backward `R·(2D + 2I + W)·2`: `x_perm`
    /// regathered from the saved `x`, `dy_perm` then `dx_perm`, `dh`, `w·h` and `d_h_pre`;
    /// the larger of the two. This fits every device and path; a layer whose GEMMs read `x`
    /// and `dy` through the permutation (sm_90a) needs less:
    /// [`MoeLayer::workspace_bytes`](super::MoeLayer::workspace_bytes).
    ///
    /// ```
    /// # use moefuse::{gpu::{Mode, MoePlan}, MoeConfig};
    /// let plan = MoePlan::new(MoeConfig::new(128, 64, 8, 2), 10)?; // D 128, I 64, W 128
    /// assert_eq!(plan.workspace_bytes(Mode::Inference), 20 * (128 + 128) * 2);
    /// assert_eq!(plan.workspace_bytes(Mode::Training), 20 * (2 * 128 + 2 * 64 + 128) * 2);
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn workspace_bytes(&self, mode: Mode) -> usize {
        let forward = self
            .forward_layout(ForwardScratch::Unfused, Mode::Inference)
            .bytes();
        match mode {
            Mode::Inference => forward,
            Mode::Training => forward.max(self.backward_layout(BackwardScratch::ALL).bytes()),
        }
    }

    /// The memory a layer of this plan holds in `mode` (see [`LayerMemory`]), without the
    /// GEMM workspace, which [`MoeLayer::memory`](super::MoeLayer::memory) adds. Training
    /// saves `x [T_max, D]` and `h_pre [R, W]` (bf16) and, when the layer routes, the
    /// logits; the backward recomputes the rest.
    ///
    /// ```
    /// # use moefuse::{gpu::{Mode, MoePlan}, MoeConfig, RouterKind};
    /// let cfg = MoeConfig::new(64, 64, 4, 2).with_router(RouterKind::External);
    /// let m = MoePlan::new(cfg, 16)?.memory(Mode::Training);
    /// assert_eq!((m.activations, m.logits), ((16 * 64 + 32 * 128) * 2, 0));
    /// # Ok::<(), moefuse::MoeError>(())
    /// ```
    pub fn memory(&self, mode: Mode) -> LayerMemory {
        let (r, e) = (self.rows, self.cfg.experts);
        let training = mode == Mode::Training;
        let activations = if training {
            let [x, h_pre] = self.saved_lens();
            (x + h_pre) * 2
        } else {
            0
        };
        let logits = if training && self.cfg.router.computes_routing() {
            self.max_tokens * e * 4
        } else {
            0
        };
        // ids, weights, row_of, source_of [R] (4 bytes each); counts, offsets [E]; the
        // DeviceErrors words (error bits, tokens stamp, the decode unit counter); the
        // permutation's scratch; in Training the identity rows that save x ([T_max] i32).
        let identity = if training { self.max_tokens * 4 } else { 0 };
        // Training: the fused down dgrad's d_topk_weights partials.
        let partials = if training {
            self.dtw_partials_len() * 4
        } else {
            0
        };
        let routing = 4 * r * 4
            + 2 * e * 4
            + 4 * DeviceErrors::WORDS
            + self.permute_words * 4
            + identity
            + partials;
        LayerMemory {
            mode,
            activations,
            logits,
            routing,
            gemm_workspace: 0,
        }
    }

    /// fp32 elements of the fused down dgrad's `d_topk_weights` partials: one per routed
    /// row and 256-column block of `I` (`moefuse_kernels::DOWN_DGRAD_COLUMN_BLOCK`).
    pub(super) fn dtw_partials_len(&self) -> usize {
        self.rows
            * self
                .cfg
                .intermediate
                .div_ceil(moefuse_kernels::DOWN_DGRAD_COLUMN_BLOCK)
    }

    /// The element counts of what Training saves: `x [T_max, D]`, `h_pre [R, W]`.
    pub(super) fn saved_lens(&self) -> [usize; 2] {
        let (r, d, _, w) = self.dims();
        [self.max_tokens * d, r * w]
    }

    /// `x_perm [R, D]`, `h_pre [R, W]`, `h [R, I]`, `y_e [R, D]` in two regions, each slot
    /// as long as the forward of `scratch` in `mode` needs it in the workspace: no `x_perm`
    /// where the GEMM gathers `x`, `h_pre` only for the unfused activation in Inference
    /// (Training writes it into the layer's saved buffer, [`MoeWorkspace::slots_with`]).
    /// The fused activation reads `x_perm` while it writes `h`, so there `h` and `y_e` trade
    /// regions.
    ///
    /// [`MoeWorkspace::slots_with`]: super::MoeWorkspace
    pub(super) fn forward_layout(&self, scratch: ForwardScratch, mode: Mode) -> Layout<4> {
        let (r, d, i, w) = self.dims();
        let unfused = scratch == ForwardScratch::Unfused;
        let h_pre = if unfused && mode == Mode::Inference {
            r * w
        } else {
            0
        };
        let x_perm = if scratch == ForwardScratch::FusedGather {
            0
        } else {
            r * d
        };
        Layout {
            lens: [x_perm, h_pre, r * i, r * d],
            at: if scratch == ForwardScratch::FusedActivation {
                [0, 1, 1, 0]
            } else {
                [0, 1, 0, 1]
            },
        }
    }

    /// `x_perm`, `dy_perm`, `dh`, `h_scaled`, `d_h_pre`, `dx_perm` (in `dy_perm`'s region),
    /// each as long as the paths in `uses` need it (0 for a slot the backward never touches).
    pub(super) fn backward_layout(&self, uses: BackwardScratch) -> Layout<6> {
        let (r, d, i, w) = self.dims();
        let keep = |on: bool, len: usize| if on { len } else { 0 };
        Layout {
            lens: [
                keep(!uses.gathers_x, r * d),
                keep(!uses.gathers_dy, r * d),
                keep(!uses.fuses_activation, r * i),
                r * i,
                r * w,
                r * d,
            ],
            at: [0, 1, 2, 3, 4, 1],
        }
    }

    /// `1 <= tokens <= max_tokens`, else [`MoeError::TokensOutOfRange`].
    pub(super) fn check_tokens(&self, tokens: usize) -> Result<(), MoeError> {
        self.cfg.check_tokens(tokens)?;
        if tokens > self.max_tokens {
            return Err(MoeError::TokensOutOfRange {
                tokens,
                max: self.max_tokens,
            });
        }
        Ok(())
    }

    fn dims(&self) -> (usize, usize, usize, usize) {
        let c = &self.cfg;
        (self.rows, c.hidden, c.intermediate, c.gate_up_width())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Activation, RouterKind};

    const MIB: usize = 1 << 20;

    #[test]
    fn plan_rejects_what_the_config_and_token_rules_reject() {
        let ok = MoeConfig::new(128, 64, 8, 2);
        assert_eq!(
            MoePlan::new(MoeConfig::new(100, 64, 8, 2), 8),
            Err(MoeError::DimNotMultiple {
                what: "hidden",
                value: 100,
                multiple: 64
            })
        );
        assert_eq!(
            MoePlan::new(MoeConfig::new(128, 64, 513, 2), 8),
            Err(MoeError::ExpertsOutOfRange {
                experts: 513,
                max: 512
            })
        );
        assert_eq!(
            MoePlan::new(ok, 65537),
            Err(MoeError::TokensOutOfRange {
                tokens: 65537,
                max: 65536
            })
        );
        let bad_act = ok.with_activation(Activation::BoundedSwiGlu { limit: -1.0 });
        assert!(matches!(
            MoePlan::new(bad_act, 8),
            Err(MoeError::InvalidParameter { .. })
        ));
        let plan = MoePlan::new(ok, 8).unwrap();
        assert_eq!(
            plan.check_tokens(9),
            Err(MoeError::TokensOutOfRange { tokens: 9, max: 8 })
        );
        assert_eq!(
            plan.check_tokens(0),
            Err(MoeError::TokensOutOfRange {
                tokens: 0,
                max: 65536
            })
        );
        assert_eq!(plan.check_tokens(8), Ok(()));
    }

    /// Qwen3-30B-A3B at T = 8192 (the numbers docs/design-moe-next.md quotes).
    #[test]
    fn qwen3_memory_per_mode() {
        let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192).unwrap();
        let r = 65536;
        assert_eq!(plan.rows(), r);
        let train = plan.memory(Mode::Training);
        // Saved: x [8192, 2048] (32 MiB) and h_pre [R, 1536] (192 MiB), bf16.
        assert_eq!(train.activations, 224 * MIB);
        assert_eq!(train.logits, 4 * MIB);
        // ids, weights, row_of, source_of: 4 × 256 KiB; counts, offsets: 1 KiB; 12 bytes;
        // permute scratch: 32 chunks × 128 experts × 4 bytes; in Training the identity rows
        // (32 KiB) and the d_topk_weights partials (R × 3 blocks of 256 columns, fp32).
        let routing = 4 * r * 4 + 1024 + 12 + 32 * 128 * 4;
        assert_eq!(train.routing, routing + 8192 * 4 + r * 3 * 4);
        assert_eq!(train.saved_for_backward(), 228 * MIB + train.routing);
        assert!(
            train.saved_for_backward() <= 260_000_000,
            "issue 12's memory target"
        );
        let inf = plan.memory(Mode::Inference);
        assert_eq!((inf.activations, inf.logits), (0, 0));
        assert_eq!(inf.saved_for_backward(), 0);
        assert_eq!(inf.routing, routing);
        assert_eq!(inf.total(), inf.routing);
        // The workspace: two regions of R·2048 bf16 for the forward; the backward's five
        // regions R·(2·2048 + 2·768 + 1536).
        assert_eq!(plan.workspace_bytes(Mode::Inference), 512 * MIB);
        assert_eq!(plan.workspace_bytes(Mode::Training), 896 * MIB);
        let text = train.to_string();
        assert!(text.starts_with("training: 229.8 MiB saved"), "{text}");
    }

    #[test]
    fn mode_errors_name_the_mode_and_sizes() {
        let e = MoeError::NotTraining {
            mode: Mode::Inference,
        };
        assert!(e.to_string().contains("in inference mode"), "{e}");
        let e = MoeError::WorkspaceTooSmall {
            needed: 2048,
            got: 10,
        };
        assert_eq!(
            e.to_string(),
            "the workspace holds 10 bytes, the plan needs 2048 (MoePlan::workspace_bytes)"
        );
        assert!(Mode::Training.saves_for_backward() && !Mode::Inference.saves_for_backward());
    }

    #[test]
    fn external_routing_saves_no_logits() {
        let cfg = MoeConfig::new(128, 64, 8, 2).with_router(RouterKind::External);
        let plan = MoePlan::new(cfg, 10).unwrap();
        assert_eq!(plan.memory(Mode::Training).logits, 0);
        // x [10, 128] and h_pre [20, 128].
        assert_eq!(
            plan.memory(Mode::Training).activations,
            (10 * 128 + 20 * 128) * 2
        );
    }

    #[test]
    fn workspace_regions_hold_every_slot() {
        // Wide intermediate (I > D) and Relu2 (W = I): the regions follow the larger slot.
        for cfg in [
            MoeConfig::new(64, 256, 4, 2),
            MoeConfig::new(256, 64, 4, 2),
            MoeConfig::new(128, 192, 4, 1).with_activation(Activation::Relu2),
        ] {
            let plan = MoePlan::new(cfg, 7).unwrap();
            let fwd = plan.forward_layout(ForwardScratch::Unfused, Mode::Inference);
            let bwd = plan.backward_layout(BackwardScratch::ALL);
            let mut layouts = vec![(fwd.lens.to_vec(), fwd.at.to_vec(), fwd.regions())];
            for scratch in [
                ForwardScratch::Unfused,
                ForwardScratch::FusedActivation,
                ForwardScratch::FusedGather,
            ] {
                for mode in [Mode::Inference, Mode::Training] {
                    let l = plan.forward_layout(scratch, mode);
                    // Every path fits in the plan's bound.
                    assert!(l.bytes() <= fwd.bytes(), "{scratch:?} {mode:?}");
                    layouts.push((l.lens.to_vec(), l.at.to_vec(), l.regions()));
                }
            }
            layouts.push((bwd.lens.to_vec(), bwd.at.to_vec(), bwd.regions()));
            for (lens, at, regions) in &layouts {
                for (len, a) in lens.iter().zip(at) {
                    assert!(regions[*a] >= *len);
                }
                // Never more than the slots apart.
                assert!(regions.iter().sum::<usize>() <= lens.iter().sum());
            }
            assert_eq!(plan.workspace_bytes(Mode::Inference), fwd.bytes());
            assert_eq!(
                plan.workspace_bytes(Mode::Training),
                fwd.bytes().max(bwd.bytes())
            );
        }
        let plan = MoePlan::new(MoeConfig::new(64, 256, 4, 2), 7).unwrap();
        // D 64, I 256, W 512, R 14: forward A = max(D, I), B = max(W, D).
        assert_eq!(plan.workspace_bytes(Mode::Inference), 14 * (256 + 512) * 2);
        // Backward: 2D + 2I + W = 128 + 512 + 512.
        assert_eq!(
            plan.workspace_bytes(Mode::Training),
            14 * (128 + 512 + 512) * 2
        );
    }

    #[test]
    fn forward_scratch_follows_the_gate_up_path() {
        // Qwen3-30B-A3B at T = 8192: R = 65536, D 2048, I 768, W 1536.
        let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192).unwrap();
        let bytes = |s, m| plan.forward_layout(s, m).bytes();
        let r = 65536 * 2;
        // x_perm | h, then h_pre | y_e: 512 MiB.
        assert_eq!(
            bytes(ForwardScratch::Unfused, Mode::Inference),
            r * (2048 + 2048)
        );
        // The gathering GEMM: h, then y_e: 352 MiB, in both modes (Training's h_pre is saved).
        for m in [Mode::Inference, Mode::Training] {
            assert_eq!(bytes(ForwardScratch::FusedGather, m), r * (768 + 2048));
            // x_perm | y_e, then h.
            assert_eq!(bytes(ForwardScratch::FusedActivation, m), r * (2048 + 768));
        }
        // Training's unfused forward writes h_pre into the saved buffer.
        assert_eq!(
            bytes(ForwardScratch::Unfused, Mode::Training),
            r * (2048 + 2048)
        );
        // Mixtral-8x7B (W = 28672 > D): Training's forward leaves h_pre out of the workspace.
        let plan = MoePlan::new(MoeConfig::new(4096, 14336, 8, 2), 16).unwrap();
        let (inf, train) = (
            plan.forward_layout(ForwardScratch::Unfused, Mode::Inference),
            plan.forward_layout(ForwardScratch::Unfused, Mode::Training),
        );
        assert_eq!(inf.bytes(), 32 * (14336 + 28672) * 2);
        assert_eq!(train.bytes(), 32 * (14336 + 4096) * 2);
    }

    #[test]
    fn backward_scratch_drops_the_copies_the_paths_skip() {
        // Qwen3-30B-A3B at T = 8192: R = 65536, D 2048, I 768, W 1536.
        let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192).unwrap();
        let bytes = |x, dy, act| {
            let uses = BackwardScratch {
                gathers_x: x,
                gathers_dy: dy,
                fuses_activation: act,
            };
            plan.backward_layout(uses).bytes()
        };
        let r = 65536 * 2;
        assert_eq!(bytes(false, false, false), r * (2 * 2048 + 2 * 768 + 1536));
        // x gathered: no regathered x_perm (dy_perm's region still holds dx_perm).
        assert_eq!(bytes(true, false, false), r * (2048 + 2 * 768 + 1536));
        assert_eq!(bytes(true, true, false), r * (2048 + 2 * 768 + 1536));
        // The fused activation backward: no dh either.
        assert_eq!(bytes(true, true, true), r * (2048 + 768 + 1536));
        // Any subset of the slots fits in the worst case's regions.
        let all = plan.backward_layout(BackwardScratch::ALL).regions();
        for x in [false, true] {
            for act in [false, true] {
                let some = bytes(x, true, act);
                assert!(some <= all.iter().sum::<usize>() * 2);
            }
        }
    }
}
