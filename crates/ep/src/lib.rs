//! moefuse's expert-parallel MoE layer: each of N ranks holds `E/N`
//! experts; a forward routes its own tokens, sends each token once to every rank that holds
//! one of its experts ([`moefuse_comm::ExpertParallel::dispatch`]), runs the local experts'
//! MLP on the received rows with moefuse's grouped GEMMs and activation, and brings the
//! weighted expert outputs back to the tokens' ranks ([`moefuse_comm::Dispatch::combine`],
//! fp32 sums in a fixed order: deterministic).
//!
//! Two row deliveries ([`RowDelivery`]). Copied rows (the default): separate dispatch and
//! combine kernels around the GEMMs, communication and the GEMMs do not overlap. Pulled
//! rows (one NVLink domain, sm_90a): the dispatch moves only routing, the fused gate_up's
//! producer reads every received row at its home rank over NVLink, and the down GEMM's
//! epilogue stores every output row into its token's slot at home, so the transfers happen
//! inside the GEMMs, overlapped with their MMAs; the backward works the same way over the
//! same exchange. Neither is yet the persistent warp-specialized kernel of the design note
//! (docs/design-ep-persistent.md).
//!
//! A Training layer ([`EpMoeLayer::with_mode`]) also runs the backward. With copied rows: dy
//! goes out by the same routing (a second exchange, unweighted), the local experts'
//! dgrad/wgrad run on the received rows, dx comes back summed per token, and each slot's
//! `d_topk_weights = ⟨dy, y_e⟩`, computed where `y_e` lives, comes back through a third, 8-
//! or 16-column exchange (slot j's value in column j of its row, zeros elsewhere, so the
//! per-token sum keeps each slot's value; bf16 in transit). With pulled rows: the homes
//! compute `d_topk_weights` from the expert outputs in their slots (fp32), the owners
//! gather `w · dy` and `x` from the homes, and every `dx` row goes into its token's slot at
//! home ([`moefuse_comm::PullBackward`]).
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
