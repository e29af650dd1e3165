//! The whole MoE layer on one GPU, as plan → run over stages:
//!
//! 1. [`MoePlan::new`] validates the config and the token bound once and sizes every
//!    buffer, on the host (no device, no allocation).
//! 2. [`MoeLayer::new`] binds a plan to a stream in a [`Mode`]: it chooses the grouped GEMMs'
//!    variants, binds the one kernel handle every launch goes through, and allocates what
//!    the mode keeps ([`MoeLayer::memory`] reports it). The weights are not the layer's:
//!    each call borrows them as [`Weights`] views of buffers the caller owns and updates.
//! 3. [`MoeWorkspace`] is the caller's scratch of [`MoePlan::workspace_bytes`], shared by
//!    every layer on the stream.
//! 4. [`MoeLayer::forward`] and [`MoeLayer::backward`] check everything host-knowable, then
//!    run their stages; with profiling on ([`MoeLayer::set_profiling`]) an event follows
//!    each stage ([`MoeLayer::stage_times`]).
//!
//! Forward stages (rows R = T·k, expert-major):
//! 1. `route`: [`route`](super::route) from the caller's router logits `[T, E]` (fp32), or
//!    the caller's `topk_ids`/`topk_weights`;
//! 2. `permute+gather`: [`permute`](fn@super::permute): per-expert offsets, `row_of`, and
//!    `x_perm [R, D]` gathered from `x`;
//! 3. `gate_up gemm`: `h_pre [R, W] = x_perm · gate_upᵀ` per expert;
//! 4. `activation`: `h [R, I]`;
//! 5. `down gemm`: `y_e [R, D] = h · downᵀ`;
//! 6. `combine`: `y[t] = Σ_slot w · y_e[row]` in fp32 (deterministic).
//!
//! Few tokens ([`DecodePath`], `T ≤ 64`): `route`, then (Training only) the permutation
//! with the gather, then `decode (gate_up+down)`: stages 3–6 as two kernels that read each
//! touched expert's weights once ([`decode_forward`](crate::gpu::decode_forward)).
//!
//! Backward stages (`dy` read by token through `source_of`; `x regather` and `dy gather`
//! copy the rows only where the GEMMs cannot gather them, off sm_90a): `down dgrad`
//! (`dh_u = dy[t] · D_e`, unweighted) and `activation bwd (routed)` (from the saved `h_pre`:
//! `d_h_pre` of `w · dh_u`, `h_scaled = w · h`, `d_topk_weights = ⟨dh_u, h⟩`), on sm_90a one
//! kernel, `down dgrad+activation bwd (fused)`, whose epilogue does the second on the
//! first's tile so `dh_u` is never written; `down wgrad` (`d_down` from `dy` and
//! `h_scaled`); `gate_up dgrad` (`dx_perm`) and `gate_up wgrad` (`d_gate_up`); `dx combine`
//! sums `dx_perm` per token in a fixed order; with our router, `router bwd` gives
//! `d_logits`.
//!
//! Modes ([`LayerMemory`] has the table and the bytes): an Inference layer keeps no
//! backward state — its forward's `x_perm`, `h_pre`, `h`, `y_e` live in the workspace
//! (`x_perm`/`h` and `h_pre`/`y_e` share a region each), the caller's device routing is
//! read in place, and `backward` returns [`MoeError::NotTraining`]. A Training layer keeps
//! a copy of `x`, `h_pre`, the routing and (when it routed) the logits; everything else,
//! and its backward's scratch, lives in the workspace. Both modes run the same kernels on
//! the same values: an Inference forward's `y` equals a Training forward's bit for bit.
//!
//! Nothing synchronises with the host: the whole forward and the whole backward can be
//! captured in one CUDA graph each and replayed with new inputs, routing and weights in
//! the same buffers (the token count is fixed per capture).
//!
//! State: a backward uses the state of the last forward that returned `Ok`; a forward that
//! returns an error (whatever the stage) leaves none, and `backward` returns
//! [`MoeError::NoForward`] until a forward succeeds. The host cannot see graph replays, so
//! the device checks the rest: the permutation stamps its token count next to the error
//! word, and the backward's combines compare it with their own; a backward whose `T`
//! differs from the forward state on the device (e.g. a forward graph of one `T` replayed
//! after an eager forward of another) zeroes `d_topk_weights` and `dx` and raises the stale
//! bit that [`MoeLayer::take_routing_errors`] reports.
//!
//! Devices: every buffer a call takes (x, y, logits, routing, dy, dx, the gradients, the
//! weights and the workspace) must live in the layer's stream's context, else
//! [`MoeError::DeviceMismatch`] before anything is launched. The router's gate matrix
//! (`logits = x · Wrᵀ`) stays with the caller: the layer takes logits and returns
//! `d_logits`.

/// The stage context of a layer, from its fields (so the other fields stay free to borrow).
macro_rules! cx {
    ($layer:expr) => {
        $crate::gpu::layer::stages::Cx {
            plan: &$layer.plan,
            stream: &$layer.stream,
            gemm: &$layer.gemm,
            act: &$layer.act,
        }
    };
}

mod backward_path;
mod gemm_plans;
mod passes;
mod plan;
mod profile;
mod stages;
mod weights;
mod workspace;

pub use backward_path::{ActivationBackwardPath, AUTO_FUSES_ACTIVATION_BACKWARD};
pub use plan::{LayerMemory, Mode, MoePlan};
pub use weights::{DeviceWeights, Weights};
pub use workspace::MoeWorkspace;

use super::{ActivationDesc, PermuteBuffers};
use crate::MoeError;
use cudarc::driver::{CudaSlice, CudaStream};
use gemm_plans::GemmPlans;
use half::bf16;
use moefuse_grouped_gemm::GroupedGemm;
use plan::ForwardScratch;
use profile::Profile;
use std::sync::Arc;

/// When a [`MoeLayer`] forward takes the decode path ([`MoeLayer::set_decode_path`]).
///
/// ```
/// assert_ne!(moefuse::gpu::DecodePath::Auto, moefuse::gpu::DecodePath::Never);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodePath {
    /// Where [`decode_preferred`](crate::gpu::decode_preferred) holds (measured faster).
    #[default]
    Auto,
    /// Wherever the decode kernels can run ([`decode_applies`](crate::gpu::decode_applies)).
    Always,
    /// Never: the grouped-GEMM path for every `T`.
    Never,
}

/// How a [`MoeLayer`] forward runs the gate_up GEMM and the activation
/// ([`MoeLayer::set_gate_up_path`]). Every path gives the same `y` up to fp32 rounding of
/// `h_pre` (the fused paths activate the fp32 accumulators; the unfused one reads `h_pre`
/// rounded to bf16), and each path's Inference forward equals its Training forward bit for
/// bit.
///
/// ```
/// assert_eq!(moefuse::gpu::GateUpPath::default(), moefuse::gpu::GateUpPath::Auto);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GateUpPath {
    /// [`GateUpPath::FusedGather`] where the device runs it and
    /// [`gate_up_fused_preferred`](crate::gpu::gate_up_fused_preferred) holds (measured
    /// faster), else [`GateUpPath::Unfused`]: decided per call from `T`, the same in both
    /// modes.
    #[default]
    Auto,
    /// The permutation gathers `x_perm`, the grouped GEMM writes `h_pre`, then the
    /// activation kernel writes `h`.
    Unfused,
    /// The permutation gathers `x_perm`; one kernel (sm_90a) runs the GEMM over it with the
    /// activation in its epilogue, writing `h` (and `h_pre` only in Training).
    FusedActivation,
    /// One kernel (sm_90a) gathers the token rows of `x` in its producer (no `x_perm`),
    /// runs the GEMM and the activation.
    FusedGather,
}

impl GateUpPath {
    /// The workspace slots a forward on this path uses (`Auto` resolved before).
    fn scratch(self) -> ForwardScratch {
        match self {
            GateUpPath::Auto | GateUpPath::Unfused => ForwardScratch::Unfused,
            GateUpPath::FusedActivation => ForwardScratch::FusedActivation,
            GateUpPath::FusedGather => ForwardScratch::FusedGather,
        }
    }
}

/// How a forward call is routed.
pub enum Routing<'a> {
    /// Router logits `[T, E]` fp32; the layer's router (the config's kind) picks experts.
    Logits(&'a CudaSlice<f32>),
    /// The caller's routing on the host, checked before anything is launched (ids inside
    /// `0..E`, no expert twice in a token: a typed error otherwise), then copied to the
    /// device. Not for graph capture (a host-to-device copy of pageable memory).
    Host {
        /// Expert ids `[T, k]`.
        topk_ids: &'a [i32],
        /// Routing weights `[T, k]`.
        topk_weights: &'a [f32],
    },
    /// The caller's `topk_ids [T, k]` (int32) and `topk_weights [T, k]` (fp32) on the
    /// device: copied by a Training layer (its backward reads them), read in place by an
    /// Inference one. They cannot be checked before the launch without a host
    /// synchronisation: the permutation skips out-of-range ids and flags them, and
    /// [`MoeLayer::take_routing_errors`] reports them.
    External {
        /// Expert ids.
        topk_ids: &'a CudaSlice<i32>,
        /// Routing weights.
        topk_weights: &'a CudaSlice<f32>,
    },
}

/// Gradients of one backward call, owned by the caller and reused across calls.
pub struct Gradients {
    /// `[E, W, D]` bf16.
    pub d_gate_up: CudaSlice<bf16>,
    /// `[E, D, I]` bf16.
    pub d_down: CudaSlice<bf16>,
    /// `[T_max, k]` fp32 (first `T·k` valid).
    pub d_topk_weights: CudaSlice<f32>,
    /// `[T_max, E]` fp32 when the layer routed (first `T·E` valid).
    pub d_logits: CudaSlice<f32>,
}

/// Routing and permutation, `O(T·k)`: the forward's own, read by the backward too.
struct RoutingState {
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    perm: PermuteBuffers,
    /// Training: `[R, ceil(I / 256)]` fp32, the fused down dgrad's per-block partials of
    /// `d_topk_weights`.
    dtw_partials: Option<CudaSlice<f32>>,
}

/// What a Training forward keeps for the backward (the backward recomputes `x_perm`
/// from `x`, `h` from `h_pre`, and needs no `y_e`).
struct Saved {
    /// `[T_max, E]` when the config routes.
    logits: Option<CudaSlice<f32>>,
    /// `[T_max, D]` copy of the forward's `x`.
    x: CudaSlice<bf16>,
    /// `[R, W]` pre-activation.
    h_pre: CudaSlice<bf16>,
    /// `0..T_max`: the rows that copy `x` (a gather with the identity permutation).
    identity: CudaSlice<i32>,
}

/// The host's facts about the last forward that returned `Ok`.
#[derive(Debug, Clone, Copy)]
struct LastForward {
    tokens: usize,
    /// The layer routed from logits (the backward gives `d_logits`).
    routed: bool,
    /// The caller's device routing was read in place (not in the layer's buffers).
    in_place: bool,
}

/// An MoE layer on one GPU, bound to a stream and a [`Mode`] (see the module docs).
///
/// ```no_run
/// use moefuse::gpu::{DeviceWeights, Mode, MoeLayer, MoePlan, MoeWorkspace, Routing};
/// use moefuse::{model::MoeWeights, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let cfg = MoeConfig::new(2048, 768, 128, 8);
/// let plan = MoePlan::new(cfg, 8192)?;                     // validates, sizes, host only
/// let weights = DeviceWeights::upload(&stream, &cfg, &MoeWeights::zeros(&cfg, false))?;
/// let mut ws = MoeWorkspace::new(&stream, plan.workspace_bytes(Mode::Training))?;
/// let mut layer = MoeLayer::new(&stream, &plan, Mode::Training)?;
/// let x = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// let logits = stream.alloc_zeros::<f32>(8192 * 128)?;
/// let mut y = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// layer.forward(&weights.view(), &x, 8192, Routing::Logits(&logits), &mut y, &mut ws)?;
/// let mut grads = layer.gradients()?;
/// let mut dx = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// layer.backward(&weights.view(), &y, &mut dx, &mut grads, false, &mut ws)?;
/// assert!(layer.memory().saved_for_backward() > 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MoeLayer {
    plan: MoePlan,
    mode: Mode,
    stream: Arc<CudaStream>,
    act: ActivationDesc,
    /// The grouped GEMMs, and through [`GroupedGemm::kernels`] the one kernel handle every
    /// launch of the layer goes through.
    gemm: GroupedGemm,
    gemms: GemmPlans,
    gemm_ws: CudaSlice<u8>,
    routing: RoutingState,
    /// `Some` in Training.
    saved: Option<Saved>,
    last: Option<LastForward>,
    profile: Profile,
    /// How the forward runs the gate_up GEMM and the activation.
    gate_up_path: GateUpPath,
    /// Where backwards run the routed activation backward.
    activation_backward_path: ActivationBackwardPath,
    /// When forwards run the decode kernels.
    decode_path: DecodePath,
}

impl MoeLayer {
    /// A layer of `plan` on `stream` in `mode`: binds the kernels (ABI and architecture
    /// checked once), plans the grouped GEMMs the mode runs, and allocates what the mode
    /// keeps ([`MoePlan::memory`] plus the GEMM workspace).
    ///
    /// ```no_run
    /// use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192)?;
    /// let layer = MoeLayer::new(&ctx.new_stream()?, &plan, Mode::Inference)?;
    /// assert_eq!(layer.memory().saved_for_backward(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(stream: &Arc<CudaStream>, plan: &MoePlan, mode: Mode) -> Result<Self, MoeError> {
        let cfg = *plan.config();
        let (e, k, max_t) = (cfg.experts, cfg.top_k, plan.max_tokens());
        let gemm = GroupedGemm::new(stream.context())?;
        let gemms = GemmPlans::new(&gemm, plan, mode)?;
        let ws = gemms.all().iter().map(|p| p.workspace_bytes()).max();
        let routing = RoutingState {
            ids: stream.alloc_zeros(plan.rows())?,
            weights: stream.alloc_zeros(plan.rows())?,
            perm: PermuteBuffers::new(stream, max_t, e, k)?,
            dtw_partials: match mode {
                Mode::Inference => None,
                Mode::Training => Some(stream.alloc_zeros(plan.dtw_partials_len())?),
            },
        };
        let saved = match mode {
            Mode::Inference => None,
            Mode::Training => {
                let [x, h_pre] = plan.saved_lens();
                let identity: Vec<i32> = (0..max_t as i32).collect();
                Some(Saved {
                    logits: match cfg.router.computes_routing() {
                        true => Some(stream.alloc_zeros(max_t * e)?),
                        false => None,
                    },
                    x: stream.alloc_zeros(x)?,
                    h_pre: stream.alloc_zeros(h_pre)?,
                    identity: stream.clone_htod(&identity)?,
                })
            }
        };
        Ok(MoeLayer {
            plan: *plan,
            mode,
            stream: stream.clone(),
            act: ActivationDesc::from_config(&cfg),
            gemm_ws: stream.alloc_zeros(ws.unwrap_or(0).max(256))?,
            gemm,
            gemms,
            routing,
            saved,
            last: None,
            profile: Profile::default(),
            gate_up_path: GateUpPath::Auto,
            activation_backward_path: ActivationBackwardPath::Auto,
            decode_path: DecodePath::Auto,
        })
    }

    /// When forwards take the decode path ([`decode_forward`](crate::gpu::decode_forward)'s
    /// two kernels after routing, instead of the permutation, two grouped GEMMs, the
    /// activation and the combine; a Training layer still runs the permutation, whose rows
    /// the backward reads, and the decode kernels write the expert-major copies it keeps).
    /// [`DecodePath::Auto`] (the default) takes it where
    /// [`decode_preferred`](crate::gpu::decode_preferred) holds. Both modes take the same
    /// path for the same `T`, so an Inference forward still equals a Training one bit for
    /// bit.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{DecodePath, Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert_eq!(layer.decode_path(), DecodePath::Auto);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_path(&self) -> DecodePath {
        self.decode_path
    }

    /// Sets when forwards take the decode path; see [`MoeLayer::decode_path`].
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{DecodePath, Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let mut layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Training)?;
    /// layer.set_decode_path(DecodePath::Never); // the grouped-GEMM path for every T
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_decode_path(&mut self, path: DecodePath) {
        self.decode_path = path;
    }

    /// The gate_up path a forward of `tokens` tokens runs ([`GateUpPath::Auto`] resolved).
    fn gate_up_path_for(&self, tokens: usize) -> GateUpPath {
        match self.gate_up_path {
            GateUpPath::Auto => {
                let fused = crate::gpu::fused::supported_by(self.gemm.kernels())
                    && crate::gpu::gate_up_fused_preferred(self.plan.config(), tokens);
                if fused {
                    GateUpPath::FusedGather
                } else {
                    GateUpPath::Unfused
                }
            }
            path => path,
        }
    }

    /// The workspace slots of a forward of `tokens` tokens: its gate_up path's (the decode
    /// kernels keep only `h`, as the gathering GEMM's path does).
    fn forward_layout_for(&self, tokens: usize) -> plan::Layout<4> {
        let scratch = if self.takes_decode_path(tokens) {
            ForwardScratch::FusedGather
        } else {
            self.gate_up_path_for(tokens).scratch()
        };
        self.plan.forward_layout(scratch, self.mode)
    }

    /// Whether a forward of `tokens` tokens takes the decode path.
    fn takes_decode_path(&self, tokens: usize) -> bool {
        let cfg = self.plan.config();
        match self.decode_path {
            DecodePath::Auto => crate::gpu::decode_preferred(cfg, tokens),
            DecodePath::Always => crate::gpu::decode_applies(cfg, tokens),
            DecodePath::Never => false,
        }
    }

    /// How the forward runs the gate_up GEMM and the activation ([`GateUpPath`];
    /// [`GateUpPath::Auto`] by default).
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{GateUpPath, Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// println!("gate_up: {:?}", layer.gate_up_path());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gate_up_path(&self) -> GateUpPath {
        self.gate_up_path
    }

    /// Chooses how the forward runs the gate_up GEMM and the activation. A fused path
    /// where the device cannot run it ([`gate_up_fused_supported`](crate::gpu::gate_up_fused_supported))
    /// is [`MoeError::Unsupported`].
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{GateUpPath, Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let mut layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// layer.set_gate_up_path(GateUpPath::Unfused)?;
    /// assert_eq!(layer.gate_up_path(), GateUpPath::Unfused);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_gate_up_path(&mut self, path: GateUpPath) -> Result<(), MoeError> {
        let fused = matches!(path, GateUpPath::FusedActivation | GateUpPath::FusedGather);
        if fused && !crate::gpu::fused::fused_kernels_run_on(self.gemm.kernels()) {
            return Err(MoeError::Unsupported {
                what: "the fused gate_up needs an sm_90a or sm_100a device and a build with its kernels",
            });
        }
        self.gate_up_path = path;
        Ok(())
    }

    /// The configuration.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert_eq!(layer.config(), plan.config());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn config(&self) -> &crate::MoeConfig {
        self.plan.config()
    }

    /// The plan the layer was built from.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert_eq!(layer.plan().max_tokens(), 8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn plan(&self) -> &MoePlan {
        &self.plan
    }

    /// The mode the layer was built for.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Training)?;
    /// assert_eq!(layer.mode(), Mode::Training);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The device memory the layer holds, counted from its buffers (see [`LayerMemory`]:
    /// Inference keeps nothing for a backward).
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Training)?;
    /// println!("{}", layer.memory()); // training: 229.0 MiB saved for the backward, ...
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn memory(&self) -> LayerMemory {
        let r = &self.routing;
        let (activations, logits, identity) = match &self.saved {
            Some(sv) => (
                (sv.x.len() + sv.h_pre.len()) * 2,
                sv.logits.as_ref().map_or(0, |l| l.len() * 4),
                sv.identity.len() * 4,
            ),
            None => (0, 0, 0),
        };
        LayerMemory {
            mode: self.mode,
            activations,
            logits,
            routing: r.ids.len() * 4
                + r.weights.len() * 4
                + r.perm.device_bytes()
                + identity
                + r.dtw_partials.as_ref().map_or(0, |p| p.len() * 4),
            gemm_workspace: self.gemm_ws.len(),
        }
    }

    /// The workspace bytes this layer's calls need: [`MoePlan::workspace_bytes`] less the
    /// copies its paths skip. Forward: no `x_perm` where the gate_up GEMM gathers `x`
    /// ([`GateUpPath::FusedGather`], Qwen3-30B-A3B at T = 8192 in Inference: 352 MiB
    /// against the plan's 512 MiB), no `h_pre` in the workspace where the GEMM's epilogue
    /// activates or Training saves it. Backward (on sm_90a the GEMMs read `x` and `dy`
    /// through the permutation): no `x_perm` regather and no `dy_perm`, with the fused
    /// activation backward no `dh` (Qwen3 at T = 8192 in Training: 640 MiB against 896).
    /// It covers every `T` up to the plan's `max_tokens` and follows the paths: ask again
    /// after [`MoeLayer::set_gate_up_path`] or [`MoeLayer::set_activation_backward_path`]
    /// (a call with a smaller workspace is [`MoeError::WorkspaceTooSmall`] before anything
    /// is launched).
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan, MoeWorkspace}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let stream = ctx.default_stream();
    /// let plan = MoePlan::new(MoeConfig::new(2048, 768, 128, 8), 8192)?;
    /// let layer = MoeLayer::new(&stream, &plan, Mode::Training)?;
    /// assert!(layer.workspace_bytes() <= plan.workspace_bytes(Mode::Training));
    /// let ws = MoeWorkspace::new(&stream, layer.workspace_bytes())?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn workspace_bytes(&self) -> usize {
        // The path depends on T through one threshold on rows per expert, so the two ends
        // of 1..=max_tokens take every path a call can take (and the decode path keeps
        // less than any of them).
        let forward = [1, self.plan.max_tokens()]
            .map(|t| self.forward_layout_for(t).bytes())
            .into_iter()
            .max()
            .unwrap_or(0);
        match self.backward_scratch() {
            Some(uses) => forward.max(self.plan.backward_layout(uses).bytes()),
            None => forward,
        }
    }

    /// Which backward copies this layer's paths skip (`None` in Inference).
    fn backward_scratch(&self) -> Option<plan::BackwardScratch> {
        let b = self.gemms.backward.as_ref()?;
        Some(plan::BackwardScratch {
            gathers_x: b.gather_x,
            gathers_dy: b.gather_dy,
            fuses_activation: self.fuses_activation_backward(),
        })
    }

    /// Records a CUDA event after every stage of the following calls (not under graph
    /// capture), for [`MoeLayer::stage_times`].
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let mut layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// layer.set_profiling(true);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_profiling(&mut self, on: bool) {
        self.profile.set(on);
    }

    /// Milliseconds per stage of the last forward or backward when profiling (synchronises
    /// the stream), in order: e.g. `route`, `permute+gather`, `gate_up gemm`, `activation`,
    /// `down gemm`, `combine`.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert!(layer.stage_times()?.is_empty()); // profiling off
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stage_times(&self) -> Result<Vec<(&'static str, f32)>, MoeError> {
        self.profile.times()
    }

    /// Zeroed gradient buffers for this layer (reuse them across calls); Training only.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig, MoeError};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert!(matches!(layer.gradients(), Err(MoeError::NotTraining { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gradients(&self) -> Result<Gradients, MoeError> {
        if self.mode != Mode::Training {
            return Err(MoeError::NotTraining { mode: self.mode });
        }
        let c = self.plan.config();
        let (d, i, e, k, w) = (
            c.hidden,
            c.intermediate,
            c.experts,
            c.top_k,
            c.gate_up_width(),
        );
        let (s, max_t) = (&self.stream, self.plan.max_tokens());
        Ok(Gradients {
            d_gate_up: s.alloc_zeros::<bf16>(e * w * d)?,
            d_down: s.alloc_zeros::<bf16>(e * d * i)?,
            d_topk_weights: s.alloc_zeros::<f32>(max_t * k)?,
            d_logits: s.alloc_zeros::<f32>(max_t * e)?,
        })
    }

    /// The routing of the last forward, `topk_ids [T, k]` and `topk_weights [T, k]` in the
    /// layer's buffers; `None` before a forward and when the last one read the caller's
    /// device routing in place (Inference with [`Routing::External`]).
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert!(layer.routing().is_none()); // no forward yet
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn routing(&self) -> Option<(&CudaSlice<i32>, &CudaSlice<f32>)> {
        match self.last {
            Some(l) if !l.in_place => Some((&self.routing.ids, &self.routing.weights)),
            _ => None,
        }
    }

    /// Reports (and clears) what the kernels flagged in device-side state since the last
    /// call, as [`MoeError::InvalidDeviceRouting`]: ids outside `0..E` (those slots were
    /// dropped), a token naming one expert twice, or a backward run against forward state
    /// of another token count (`stale_forward`: its `dx` and `d_topk_weights` were
    /// zeroed). Synchronises the stream; call it after a forward, a backward or a replayed
    /// graph whenever routing comes from the device or graphs of several `T` are mixed.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let mut layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// layer.take_routing_errors()?; // nothing run, nothing flagged
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn take_routing_errors(&mut self) -> Result<(), MoeError> {
        self.routing.perm.errors_mut().take()
    }

    /// Per-expert prefix-sum offsets of the last forward.
    ///
    /// ```no_run
    /// # use moefuse::{gpu::{Mode, MoeLayer, MoePlan}, MoeConfig};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let plan = MoePlan::new(MoeConfig::new(64, 64, 4, 2), 8)?;
    /// let layer = MoeLayer::new(&ctx.default_stream(), &plan, Mode::Inference)?;
    /// assert_eq!(cudarc::driver::DeviceSlice::len(layer.offsets()), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn offsets(&self) -> &CudaSlice<i32> {
        self.routing.perm.offsets()
    }
}
