//! moefuse's MoE layer on candle [`Tensor`](candle::Tensor)s: a [`CustomOp3`](candle::CustomOp3)
//! with forward and backward, so candle's autograd and optimizers train it.
//!
//! # Walkthrough
//!
//! 1. **Config.** A [`moefuse::MoeConfig`]: [`qwen3_moe_config`] or [`mixtral_config`] for
//!    the Hugging Face blocks (SwiGLU experts, softmax top-k router, renormalised as
//!    Qwen3's `norm_topk_prob` / Mixtral's top-2).
//! 2. **Weights.** A [`MoeBlock`] holds two candle [`Var`](candle::Var)s: the router
//!    `[E, D]` and the experts as one flat Var `[E·W·D + E·D·I]` (`gate_up [E, W, D]` then
//!    `down [E, D, I]` in moefuse's layouts, see [`FlatLayout`]). Load them from a
//!    safetensors checkpoint with HF names through candle-nn's `VarBuilder`
//!    ([`load_qwen3_moe`], [`load_mixtral`]) or build them yourself ([`MoeBlock::new`]).
//! 3. **Forward.** `block.forward(&x)` ([`candle::Module`]): candle computes the router
//!    logits `x·routerᵀ` (so the router trains through candle), then [`MoeOp`] runs the
//!    experts on (x, logits, flat weight): on the CPU with moefuse's f32 reference, on CUDA
//!    (feature `cuda`) with moefuse's fused layer on candle's stream (bf16).
//! 4. **Backward and step.** `loss.backward()` reaches the op's backward, which returns
//!    `(dx, d_logits, d_experts)`; an optimizer (candle-nn's `AdamW`, `SGD`) updates the
//!    Vars in place and the next forward reads the new weights.
//!
//! [`candle_ops`] has the same block written with candle's own ops, the baseline the op
//! is tested against.
//!
//! ```
//! use candle::{DType, Device, Module, Tensor, Var};
//! use candle_nn::{AdamW, Optimizer};
//! use moefuse_candle::{qwen3_moe_config, FlatLayout, MoeBlock};
//! let dev = Device::Cpu; // Device::new_cuda(0)? with the `cuda` feature (bf16 experts)
//! let cfg = qwen3_moe_config(64, 64, 8, 2, true)?;
//! let block = MoeBlock::new(cfg,
//!     Var::randn(0f32, 0.1, (8, 64), &dev)?,
//!     Var::randn(0f32, 0.05, FlatLayout::new(&cfg).len(), &dev)?)?;
//! let mut opt = AdamW::new_lr(block.vars(), 1e-3)?;
//! let x = Tensor::randn(0f32, 1.0, (16, 64), &dev)?;
//! let target = Tensor::randn(0f32, 0.1, (16, 64), &dev)?;
//! for _ in 0..3 {
//!     let loss = (block.forward(&x)? - &target)?.sqr()?.mean_all()?;
//!     opt.backward_step(&loss)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Devices
//!
//! The default build has the CPU path only, so CI needs neither a GPU nor nvcc. The `cuda`
//! feature turns on candle's CUDA backend (its build compiles candle-kernels with nvcc for
//! `CUDA_COMPUTE_CAP`) and the GPU path; candle and moefuse share one cudarc, so the op
//! hands the layer views of candle's device buffers without copies (the weight gradient is
//! copied once from the layer's two buffers into the flat gradient).

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod block;
pub mod candle_ops;
mod config;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod hf;
mod op;

pub use block::MoeBlock;
pub use config::{mixtral_config, qwen3_moe_config, FlatLayout};
pub use error::MoeCandleError;
pub use hf::{load_hf, load_mixtral, load_qwen3_moe, HfNaming};
pub use op::MoeOp;
