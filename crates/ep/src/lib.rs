//! moefuse's expert-parallel MoE layer (the stream version): each of N ranks holds `E/N`
//! experts; a forward routes its own tokens, sends each token once to every rank that holds
//! one of its experts ([`moefuse_comm::ExpertParallel::dispatch`]), runs the local experts'
//! MLP on the received rows with moefuse's grouped GEMMs and activation, and brings the
//! weighted expert outputs back to the tokens' ranks ([`moefuse_comm::Dispatch::combine`],
//! fp32 sums in a fixed order: deterministic).
//!
//! This is the layer as separate kernels on one stream: communication and the GEMMs do not
//! overlap yet. It fixes the API (plan once, run many; the caller's weights borrowed) and
//! the numbers the fused, persistent version (issue 13) must beat. A Training layer
//! ([`EpMoeLayer::with_mode`]) also runs the backward: dy goes out by the same routing (a
//! second exchange, unweighted), the local experts' dgrad/wgrad run on the received rows,
//! dx comes back summed per token, and each slot's `d_topk_weights = ⟨dy, y_e⟩`, computed
//! where `y_e` lives, comes back through a third, 8- or 16-column exchange (slot j's value
//! in column j of its row, zeros elsewhere, so the per-token sum keeps each slot's value;
//! bf16 in transit).
//!
//! At one rank, [`EpMoeLayer`] is the single-GPU [`moefuse::gpu::MoeLayer`] itself (the
//! same kernels and bits, no exchange and no symmetric buffers): the exchanges only start
//! paying at two ranks (measured at one PE through the exchanges: forward 1422 µs against
//! the single-GPU layer's 1290, Qwen3-30B-A3B T = 8192).
//!
//! ```no_run
//! # fn demo(rt: &std::sync::Arc<moefuse_comm::Runtime>,
//! #         stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<(), moefuse_ep::EpError> {
//! use moefuse_ep::{EpMoeLayer, EpRouting, LocalWeights};
//! let cfg = moefuse::MoeConfig::new(2048, 768, 128, 8);
//! let mut layer = EpMoeLayer::new(rt, stream, cfg, 4096)?;
//! let local = layer.local_experts();
//! let gate_up = stream.alloc_zeros::<half::bf16>(local * cfg.gate_up_width() * 2048)?;
//! let down = stream.alloc_zeros::<half::bf16>(local * 2048 * 768)?;
//! let x = stream.alloc_zeros::<half::bf16>(4096 * 2048)?;
//! let logits = stream.alloc_zeros::<f32>(4096 * 128)?;
//! let mut y = stream.alloc_zeros::<half::bf16>(4096 * 2048)?;
//! let weights = LocalWeights { gate_up: gate_up.as_view(), down: down.as_view() };
//! layer.forward(&weights, &x, 4096, EpRouting::Logits(&logits), &mut y)?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod backward;
mod error;
mod exchange;
mod layer;
mod memory;

pub use backward::EpGradients;
pub use error::EpError;
pub use exchange::{EpRouting, LocalWeights, RowDelivery};
pub use layer::EpMoeLayer;
pub use memory::EpLayerMemory;
