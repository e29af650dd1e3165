//! moefuse's Mixture-of-Experts layer: its configuration, its typed errors, and a complete
//! CPU reference of forward and backward that the GPU kernels are tested against.
//!
//! # The layer
//!
//! With `x [T, D]` (`T` tokens, `D = hidden`), `E` experts of intermediate size `I`, and
//! `k = top_k` experts per token:
//!
//! 1. **Route.** `logits [T, E] = x·routerᵀ` (`router [E, D]`), then a [`RouterKind`] picks
//!    `topk_ids [T, k]` and `topk_weights [T, k]` (softmax top-k, DeepSeek-V3's grouped
//!    sigmoid, or routing supplied by the caller). Slots are ordered by descending score,
//!    ties to the lower expert id; a token never routes to one expert twice.
//! 2. **Permute.** The `T·k` (token, slot) pairs are sorted into expert-major rows, stable
//!    in token order; `offsets [E]` are the int32 prefix-sum ends the grouped GEMM takes
//!    ([`reference::Permutation`]).
//! 3. **Expert MLP.** For row `r` (token `t`, expert `e`): `h_pre = x[t]·gate_up[e]ᵀ` with
//!    `gate_up [E, W, D]` (`W = 2I` for gated activations, in the [`GateUpLayout`]'s column
//!    order; `W = I` for `Relu2`), `h = act(h_pre)` ([`Activation`]), `y_e = h·down[e]ᵀ`
//!    with `down [E, D, I]`.
//! 4. **Combine.** `y[t] = Σ_slot topk_weights[t, slot]·y_e[row(t, slot)]`, in f32, in slot
//!    order.
//!
//! The backward pass returns `dx`, `d_gate_up`, `d_down`, `d_topk_weights`, and when the
//! layer routed itself `d_logits` and `d_router` (the selection is held constant; gradients
//! flow through softmax / sigmoid, renormalisation and scaling). Weight gradients can be
//! accumulated across micro-batches ([`reference::backward_into`]).
//!
//! # On the GPU
//!
//! [`gpu`] holds the layer on cudarc streams and device buffers, tested against this
//! crate's CPU reference: its kernels one by one (router, permutation, activation,
//! combine) and [`gpu::MoeLayer`], the whole layer as plan → run over stages:
//!
//! 1. [`gpu::MoePlan::new`] validates a config and a token bound once and sizes every
//!    buffer on the host; [`gpu::MoePlan::workspace_bytes`] sizes the shared scratch.
//! 2. [`gpu::MoeLayer::new`] binds a plan to a stream in a [`gpu::Mode`]: `Inference`
//!    keeps nothing for a backward, `Training` what the backward reads
//!    ([`gpu::MoeLayer::memory`]).
//! 3. Each [`forward`](gpu::MoeLayer::forward) and [`backward`](gpu::MoeLayer::backward)
//!    borrows the caller's weights ([`gpu::Weights`]) and a [`gpu::MoeWorkspace`] that
//!    every layer on the stream shares.
//!
//! The host weights ([`model::MoeWeights`]) and the routing rules
//! ([`model::check_routing`]) are the [`model`]'s, shared by both sides.
//!
//! # Using it
//!
//! 1. Build a [`MoeConfig`] and [`validate`](MoeConfig::validate) it ([`MoeError`] names
//!    the broken rule).
//! 2. Fill [`model::MoeWeights`] (all tensors row-major f32, layouts on the type).
//! 3. Run [`reference::forward`], keep its [`reference::ForwardOutput`], and run
//!    [`reference::backward`] with `dy`.
//!
//! ```
//! use moefuse::{model::MoeWeights, reference::{backward, forward, RoutingInput}, Activation,
//!     GateUpLayout, MoeConfig, RouterKind};
//! let cfg = MoeConfig::new(64, 128, 8, 2)
//!     .with_activation(Activation::swiglu_oai())
//!     .with_gate_up_layout(GateUpLayout::Interleaved)
//!     .with_router(RouterKind::SigmoidGrouped {
//!         n_group: 4, topk_group: 2, routed_scaling_factor: 2.5, renormalize: true });
//! cfg.validate()?;
//! let mut w = MoeWeights::zeros(&cfg, true);
//! for (i, v) in w.gate_up.iter_mut().enumerate() { *v = ((i % 7) as f32 - 3.0) * 0.01; }
//! for (i, v) in w.down.iter_mut().enumerate() { *v = ((i % 5) as f32 - 2.0) * 0.01; }
//! for (i, v) in w.router.as_mut().unwrap().iter_mut().enumerate() { *v = ((i % 11) as f32 - 5.0) * 0.01; }
//! let x: Vec<f32> = (0..4 * 64).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
//! let out = forward(&cfg, &w, &x, RoutingInput::Ours)?;
//! let g = backward(&cfg, &w, &x, &out, &vec![1.0; x.len()])?;
//! assert_eq!((out.y.len(), g.dx.len(), g.d_router.unwrap().len()), (256, 256, 8 * 64));
//! # Ok::<(), moefuse::MoeError>(())
//! ```

#![deny(missing_docs)]
#![forbid(unsafe_code)]

/// The CUDA driver bindings this crate's device API is written in (cudarc), re-exported so
/// callers allocate buffers, streams and views with the very version [`gpu`] takes.
pub use cudarc;

mod config;
mod error;
pub mod gpu;
pub mod model;
pub mod reference;

pub use config::{
    Activation, GateUpLayout, MoeConfig, RouterKind, DIM_MULTIPLE, MAX_DIM, MAX_EXPERTS,
    MAX_TOKENS, MAX_TOP_K,
};
pub use error::MoeError;
