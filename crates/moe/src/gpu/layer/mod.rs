//! The whole MoE layer on one GPU: [`MoeLayer::forward`] and [`MoeLayer::backward`] on a
//! caller's stream, built from the grouped GEMMs of `moefuse-grouped-gemm` and this crate's
//! router, permutation, activation and combine kernels.
//!
//! Forward (rows R = tokens · top_k, expert-major):
//! 1. routing: [`route`](super::route) from the caller's router logits `[T, E]` (fp32), or
//!    the caller's `topk_ids`/`topk_weights`;
//! 2. [`permute`](super::permute): per-expert offsets, `row_of`, and `x_perm [R, D]`
//!    gathered from `x`;
//! 3. gate_up grouped GEMM: `h_pre [R, W] = x_perm · gate_upᵀ` per expert;
//! 4. activation: `h [R, I]`;
//! 5. down grouped GEMM: `y_e [R, D] = h · downᵀ`;
//! 6. [`combine`](super::combine): `y[t] = Σ_slot w · y_e[row]` in fp32 (deterministic).
//!
//! Backward: [`combine_backward`](super::combine_backward) gives `dy_perm = w · dy[t]` and
//! `d_topk_weights = ⟨dy[t], y_e[row]⟩`; down dgrad `dh`, down wgrad `d_down`; the
//! activation backward recomputes the activation from the stored `h_pre`; gate_up dgrad
//! `dx_perm` and wgrad `d_gate_up`; `dx` is the unweighted combine of `dx_perm`; with our
//! router, [`route_backward`](super::route_backward) gives `d_logits`.
//!
//! Nothing synchronises with the host: the whole forward and the whole backward can be
//! captured in one CUDA graph each and replayed with new inputs and routing (the token
//! count is fixed per capture).
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
//! Devices: every buffer a call takes (x, y, logits, routing, dy, dx, the gradients, and the
//! weights given to [`MoeLayer::with_device_weights`]) must live in the layer's stream's
//! context, else [`MoeError::DeviceMismatch`] before anything is launched. The router's
//! gate matrix (`logits = x · Wrᵀ`) stays with the caller: the layer takes logits and
//! returns `d_logits`.
//!
//! Kernels: the layer launches everything through one `moefuse_kernels::Kernels` handle,
//! its grouped GEMM's, bound (ABI and architecture checked) once in
//! [`MoeLayer::with_device_weights`]. The forward and backward passes live in `passes`.

mod passes;

use super::{check_device, ActivationDesc, PermuteBuffers};
use crate::{reference::MoeWeights, MoeConfig, MoeError};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm, GroupedPlan};
use std::sync::Arc;

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
    /// device. They cannot be checked before the launch without a host synchronisation:
    /// the permutation skips out-of-range ids and flags them, and
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

struct Plans {
    gate_up: GroupedPlan,
    down: GroupedPlan,
    down_dgrad: GroupedPlan,
    gate_up_dgrad: GroupedPlan,
    /// [beta = 0, beta = 1] (accumulate).
    down_wgrad: [GroupedPlan; 2],
    gate_up_wgrad: [GroupedPlan; 2],
}

/// Everything the forward keeps for the backward, sized for `max_tokens`.
struct Saved {
    tokens: usize,
    routed: bool,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    perm: PermuteBuffers,
    x_perm: CudaSlice<bf16>,
    h_pre: CudaSlice<bf16>,
    h: CudaSlice<bf16>,
    y_e: CudaSlice<bf16>,
}

/// Backward scratch.
struct Scratch {
    dy_perm: CudaSlice<bf16>,
    dh: CudaSlice<bf16>,
    d_h_pre: CudaSlice<bf16>,
    dx_perm: CudaSlice<bf16>,
    workspace: CudaSlice<u8>,
}

/// An MoE layer with its expert weights on one GPU (see the module docs).
///
/// ```no_run
/// use moefuse::{gpu::{MoeLayer, Routing}, reference::MoeWeights, MoeConfig};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let cfg = MoeConfig::new(2048, 768, 128, 8);
/// let mut layer = MoeLayer::new(&stream, cfg, 8192, &MoeWeights::zeros(&cfg, false))?;
/// let x = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// let logits = stream.alloc_zeros::<f32>(8192 * 128)?;
/// let mut y = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// layer.forward(&x, 8192, Routing::Logits(&logits), &mut y)?;
/// let mut grads = layer.gradients()?;
/// let mut dx = stream.alloc_zeros::<half::bf16>(8192 * 2048)?;
/// layer.backward(&y, &mut dx, &mut grads, false)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MoeLayer {
    cfg: MoeConfig,
    max_tokens: usize,
    stream: Arc<CudaStream>,
    act: ActivationDesc,
    gate_up: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
    bias: Option<CudaSlice<f32>>,
    /// The grouped GEMMs, and through [`GroupedGemm::kernels`] the one kernel handle every
    /// launch of the layer goes through.
    gemm: GroupedGemm,
    plans: Plans,
    saved: Saved,
    scratch: Scratch,
    forwarded: bool,
    /// Stage events of the last call when profiling (`set_profiling`).
    profile: Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
}

impl MoeLayer {
    /// A layer for `cfg` taking up to `max_tokens` tokens per call, its weights rounded to
    /// bf16 from `weights` (the reference layout: gate_up `[E, W, D]`, down `[E, D, I]`), all
    /// work on `stream`.
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: MoeConfig,
        max_tokens: usize,
        weights: &MoeWeights,
    ) -> Result<Self, MoeError> {
        cfg.validate()?;
        cfg.check_tokens(max_tokens)?;
        weights.validate(&cfg)?;
        let bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let gate_up = stream.clone_htod(&bf(&weights.gate_up))?;
        let down = stream.clone_htod(&bf(&weights.down))?;
        let bias = match &weights.router_bias {
            Some(b) => Some(stream.clone_htod(b)?),
            None => None,
        };
        Self::with_device_weights(stream, cfg, max_tokens, gate_up, down, bias)
    }

    /// Like [`MoeLayer::new`] with weights already on the device (bf16 `[E, W, D]` and
    /// `[E, D, I]`; the sigmoid router's `[E]` bias, if any).
    pub fn with_device_weights(
        stream: &Arc<CudaStream>,
        cfg: MoeConfig,
        max_tokens: usize,
        gate_up: CudaSlice<bf16>,
        down: CudaSlice<bf16>,
        bias: Option<CudaSlice<f32>>,
    ) -> Result<Self, MoeError> {
        cfg.validate()?;
        cfg.check_tokens(max_tokens)?;
        let (d, i, e, k, w) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.top_k,
            cfg.gate_up_width(),
        );
        let shape = |what, expected: usize, found: usize| {
            if expected == found {
                Ok(())
            } else {
                Err(MoeError::ShapeMismatch {
                    what,
                    expected,
                    found,
                })
            }
        };
        // validate(): E <= 512, W <= 2^21, D, I <= 2^20, max_tokens·k <= 2^20, so none of
        // these products overflows.
        shape("gate_up [E, W, D]", e * w * d, gate_up.len())?;
        shape("down [E, D, I]", e * d * i, down.len())?;
        check_device("gate_up [E, W, D]", &gate_up, stream)?;
        check_device("down [E, D, I]", &down, stream)?;
        if let Some(b) = &bias {
            shape("router bias [E]", e, b.len())?;
            check_device("router bias [E]", b, stream)?;
        }
        let rows = max_tokens * k;
        let ctx: Arc<CudaContext> = stream.context().clone();
        let gemm = GroupedGemm::new(&ctx)?;
        let hint = |mut desc: GroupedDesc| {
            desc.rows_per_group_hint = Some(rows.div_ceil(e));
            desc
        };
        let plan = |desc: GroupedDesc| gemm.plan(&hint(desc));
        let wgrad = |n: usize, kk: usize| -> Result<[GroupedPlan; 2], MoeError> {
            let (desc, swap) = GroupedDesc::wgrad_for(e, rows, n, kk, BLayout::Nk);
            debug_assert!(swap);
            Ok([plan(desc)?, plan(GroupedDesc { beta: 1.0, ..desc })?])
        };
        let plans = Plans {
            gate_up: plan(GroupedDesc::forward(e, rows, w, d, BLayout::Nk))?,
            down: plan(GroupedDesc::forward(e, rows, d, i, BLayout::Nk))?,
            down_dgrad: plan(GroupedDesc::dgrad(e, rows, d, i, BLayout::Nk))?,
            gate_up_dgrad: plan(GroupedDesc::dgrad(e, rows, w, d, BLayout::Nk))?,
            down_wgrad: wgrad(d, i)?,
            gate_up_wgrad: wgrad(w, d)?,
        };
        for p in [
            &plans.gate_up,
            &plans.down,
            &plans.down_wgrad[0],
            &plans.gate_up_wgrad[0],
        ] {
            tracing::debug!(variant = %p.variant(), "moe layer grouped GEMM");
        }
        let ws = [
            &plans.gate_up,
            &plans.down,
            &plans.down_dgrad,
            &plans.gate_up_dgrad,
            &plans.down_wgrad[0],
            &plans.down_wgrad[1],
            &plans.gate_up_wgrad[0],
            &plans.gate_up_wgrad[1],
        ]
        .iter()
        .map(|p| p.workspace_bytes())
        .max()
        .unwrap_or(0);
        let z16 = |n: usize| stream.alloc_zeros::<bf16>(n.max(1));
        let saved = Saved {
            tokens: 0,
            routed: false,
            ids: stream.alloc_zeros::<i32>(rows)?,
            weights: stream.alloc_zeros::<f32>(rows)?,
            logits: stream.alloc_zeros::<f32>(max_tokens * e)?,
            perm: PermuteBuffers::new(stream, max_tokens, e, k)?,
            x_perm: z16(rows * d)?,
            h_pre: z16(rows * w)?,
            h: z16(rows * i)?,
            y_e: z16(rows * d)?,
        };
        let scratch = Scratch {
            dy_perm: z16(rows * d)?,
            dh: z16(rows * i)?,
            d_h_pre: z16(rows * w)?,
            dx_perm: z16(rows * d)?,
            workspace: stream.alloc_zeros::<u8>(ws.max(256))?,
        };
        Ok(MoeLayer {
            act: ActivationDesc::from_config(&cfg),
            cfg,
            max_tokens,
            stream: stream.clone(),
            gate_up,
            down,
            bias,
            gemm,
            plans,
            saved,
            scratch,
            forwarded: false,
            profile: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// Records a CUDA event after every stage of the following calls (not under graph
    /// capture), for [`MoeLayer::stage_times`].
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(Vec::new);
    }

    /// Milliseconds per stage of the last forward or backward when profiling (synchronises
    /// the stream), in order: e.g. `permute`, `gate_up`, `activation`, `down`, `combine`.
    pub fn stage_times(&self) -> Result<Vec<(&'static str, f32)>, MoeError> {
        let Some(events) = &self.profile else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for pair in events.windows(2) {
            pair[1].1.synchronize()?;
            out.push((pair[1].0, pair[0].1.elapsed_ms(&pair[1].1)?));
        }
        Ok(out)
    }

    fn mark(
        profile: &mut Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
        stream: &Arc<CudaStream>,
        stage: &'static str,
    ) -> Result<(), MoeError> {
        if let Some(events) = profile {
            let ev = stream
                .context()
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            ev.record(stream)?;
            events.push((stage, ev));
        }
        Ok(())
    }

    /// Zeroed gradient buffers for this layer (reuse them across calls).
    pub fn gradients(&self) -> Result<Gradients, MoeError> {
        let (d, i, e, k, w) = (
            self.cfg.hidden,
            self.cfg.intermediate,
            self.cfg.experts,
            self.cfg.top_k,
            self.cfg.gate_up_width(),
        );
        let s = &self.stream;
        Ok(Gradients {
            d_gate_up: s.alloc_zeros::<bf16>(e * w * d)?,
            d_down: s.alloc_zeros::<bf16>(e * d * i)?,
            d_topk_weights: s.alloc_zeros::<f32>(self.max_tokens * k)?,
            d_logits: s.alloc_zeros::<f32>(self.max_tokens * e)?,
        })
    }

    /// The routing of the last forward: `topk_ids [T, k]`, `topk_weights [T, k]`.
    pub fn routing(&self) -> (&CudaSlice<i32>, &CudaSlice<f32>) {
        (&self.saved.ids, &self.saved.weights)
    }

    /// Reports (and clears) what the kernels flagged in device-side state since the last
    /// call, as [`MoeError::InvalidDeviceRouting`]: ids outside `0..E` (those slots were
    /// dropped), a token naming one expert twice, or a backward run against forward state
    /// of another token count (`stale_forward`: its `dx` and `d_topk_weights` were
    /// zeroed). Synchronises the stream; call it after a forward, a backward or a replayed
    /// graph whenever routing comes from the device or graphs of several `T` are mixed.
    pub fn take_routing_errors(&mut self) -> Result<(), MoeError> {
        self.saved.perm.errors_mut().take()
    }

    /// Per-expert prefix-sum offsets of the last forward.
    pub fn offsets(&self) -> &CudaSlice<i32> {
        self.saved.perm.offsets()
    }
}
