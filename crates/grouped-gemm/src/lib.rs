#![forbid(unsafe_code)]
//! Safe bf16 GEMMs for Mixture-of-Experts layers on Hopper (sm_90a) and Blackwell
//! (sm_100a), on cudarc streams and device buffers. Usable on its own.
//!
//! 1. Make a [`Gemm`] (dense) or [`GroupedGemm`] (MoE experts) for a context: it checks the
//!    GPU against the compiled kernels.
//! 2. Describe the problem with a [`GemmDesc`] or [`GroupedDesc`] (`forward`, `dgrad`,
//!    `wgrad`) and `plan` it: validation and the variant heuristic run on the host, with no
//!    allocation and no launch.
//! 3. Allocate the plan's `workspace_bytes()` and `run` on a stream; outputs and workspace
//!    are the caller's and grouped sizes come from device offsets, so runs need no host
//!    synchronisation and capture into CUDA graphs.
//! 4. [`mod@reference`] computes the same problems on the CPU, for tests.
//!
//! **Gathered rows.** On the contiguous (`_contig`, sm90a) variants one operand's rows can
//! be read through an index instead of a permuted copy ([`GroupedGemm::run_gathered`]): A of
//! a forward, dgrad or wgrad, or B of a wgrad, row `r` being row `index[r] / div` of a
//! smaller buffer. The MoE layer's backward reads `x` and `dy` this way.
//!
//! **Memory layout.** Row-major throughout: A `[m, k]`, B `[n, k]` ([`BLayout::Nk`], as
//! `nn.Linear` stores weights) or `[k, n]` ([`BLayout::Kn`]), D `[m, n]`; bf16 operands,
//! fp32 accumulation. `k` and `n` must be multiples of 8 (16-byte rows for TMA); `m` is
//! free, and `m = 0` is a no-op.
//!
//! ```no_run
//! use moefuse_grouped_gemm::{Gemm, GemmDesc};
//! use half::bf16;
//! let ctx = cudarc::driver::CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let (m, n, k) = (4096, 4096, 4096);
//! let a = stream.clone_htod(&vec![bf16::from_f32(1.0); m * k])?;
//! let b = stream.clone_htod(&vec![bf16::from_f32(1.0); n * k])?;
//! let mut d = stream.alloc_zeros::<bf16>(m * n)?;
//! let gemm = Gemm::new(&ctx)?;
//! let plan = gemm.plan(&GemmDesc::new(m, n, k))?;
//! gemm.run(&plan, &stream, &a, &b, &mut d, None)?;
//! stream.synchronize()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// The cudarc this crate is built against: its `CudaContext`, `CudaStream`, `CudaSlice`
/// and views are the types every call takes, so use these rather than a separately
/// versioned cudarc.
///
/// ```no_run
/// use moefuse_grouped_gemm::cudarc::driver::CudaContext;
/// let ctx = CudaContext::new(0)?;
/// let gemm = moefuse_grouped_gemm::Gemm::new(&ctx)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub use cudarc;

mod error;
mod gathered;
mod gemm;
mod grouped;
mod heuristics;
pub mod reference;

pub use error::{GemmError, Operand};
pub use gathered::{Gather, GatheredOperand};
pub use gemm::{BLayout, Gemm, GemmDesc, GemmPlan};
pub use grouped::{
    check_offsets, validate_offsets, GroupedDesc, GroupedGemm, GroupedOp, GroupedPlan,
};
/// The tile order and its fields are defined once, in `moefuse-spec` (`tile_order`), for
/// this crate, the launch layer and the C header alike.
pub use moefuse_spec::tile_order::{Raster, TileOrder, TileOrderError};
