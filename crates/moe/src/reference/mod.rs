//! The CPU reference of the MoE layer, f32 in and out, sums in f64, parallel with rayon:
//! the semantics every GPU kernel is tested against.
//!
//! * [`router`]: [`router_logits`], [`route`], [`route_backward`] (the routing checks and the
//!   weights live in [`model`](crate::model), shared with the GPU layer).
//! * [`permute`]: the expert-major [`Permutation`] of routed (token, slot) pairs.
//! * [`activation`]: scalar and row forms of each [`Activation`](crate::Activation).
//! * [`forward`] and [`backward`](fn@backward) / [`backward_into`] of the whole layer.
//!
//! ```
//! use moefuse::{model::MoeWeights, reference::{backward, forward, RoutingInput}, MoeConfig};
//! let cfg = MoeConfig::new(64, 64, 4, 2);                  // softmax top-2 router
//! let mut w = MoeWeights::zeros(&cfg, true);
//! w.router.as_mut().unwrap()[64] = 1.0;                     // expert 1 likes x[0]
//! let x = vec![0.5f32; 3 * 64];
//! let out = forward(&cfg, &w, &x, RoutingInput::Ours)?;
//! assert_eq!(&out.routing.topk_ids[..2], &[1, 0]);
//! let g = backward(&cfg, &w, &x, &out, &vec![1.0; 3 * 64])?;
//! assert!(g.d_router.is_some());
//! # Ok::<(), moefuse::MoeError>(())
//! ```

pub mod activation;
mod backward;
mod layer;
pub mod permute;
pub mod router;

pub use backward::{backward, backward_into, Gradients};
pub use layer::{forward, ForwardOutput, RoutingInput};
pub use permute::{permutation, Permutation};
pub use router::{route, route_backward, router_logits, Routing};
