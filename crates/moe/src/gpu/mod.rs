//! The layer's GPU kernels that are not GEMMs, on cudarc streams and device buffers.
//!
//! 1. [`route`] computes `topk_ids [T, k]` and `topk_weights [T, k]` from router logits
//!    `[T, E]` as [`reference::route`](crate::reference::route) defines them;
//!    [`route_backward`] computes `d_logits [T, E]` from `d_topk_weights [T, k]`.
//! 2. [`activation_forward`] computes `h [rows, I]` from `h_pre [rows, W]` (bf16, fp32
//!    math) for an [`ActivationDesc`]; [`activation_backward`] computes `d_h_pre [rows, W]`
//!    from `dh [rows, I]` and `h_pre`. [`Rows`] gives the row count on the host or in device
//!    memory (the last prefix-sum offset), so no call synchronises with the host.
//!
//! 3. [`permute`](fn@permute) lays routed (token, slot) pairs out expert-major (offsets for the grouped
//!    GEMM, `row_of`, `source_of`) and gathers `x` into those rows; [`combine`] sums expert
//!    outputs back to tokens with the routing weights in fp32; [`combine_backward`] gives
//!    the weighted upstream rows and `d_topk_weights`.
//! 4. [`decode_forward`] runs the whole expert MLP of up to [`DECODE_MAX_TOKENS`] tokens
//!    after routing (gate_up, activation, down, weighted combine) in two kernels that read
//!    each touched expert's weights once: the layer's small-batch path.
//! 5. [`MoeLayer`] is the whole layer, forward and backward, from these and the grouped
//!    GEMMs of `moefuse-grouped-gemm`, as plan → run: a host-only [`MoePlan`] validates and
//!    sizes everything once, a layer binds it to a stream in a [`Mode`] (Inference keeps
//!    nothing for a backward), each call borrows the caller's [`Weights`] and a
//!    [`MoeWorkspace`] that every layer on the stream shares.
//!
//! Every call checks sizes, buffer lengths and devices (every buffer's context is the
//! stream's) before anything is launched and returns a [`MoeError`] naming what is wrong;
//! outputs are caller-owned, so calls can be captured in CUDA graphs. Launches go through
//! `moefuse-kernels`' typed launch layer ([`moefuse_kernels::Kernels::launch`]), which checks
//! every buffer again (context, length, alignment) and alone calls into C; this crate
//! itself is safe Rust only. [`MoeLayer`] binds one [`Kernels`] handle (its grouped GEMM's) when it
//! is built; each free function binds one for its call (the ABI and architecture checks).
//!
//! What lives on the device (expert ids, `row_of`) cannot be checked on the host without a
//! synchronisation. The kernels bound every index they form from such data by the extent
//! of the buffer it addresses, skip the offending slot, and set a bit in a
//! [`DeviceErrors`] word; [`DeviceErrors::take`] (or [`MoeLayer::take_routing_errors`])
//! turns the bits into [`MoeError::InvalidDeviceRouting`] at the caller's next check. No
//! device data can make a kernel read or write outside its buffers. The kernels are one fat
//! object per file (SASS for each arch in `MOEFUSE_CUDA_ARCHS`).
//!
//! ```no_run
//! use moefuse::{gpu, MoeConfig};
//! let ctx = cudarc::driver::CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let cfg = MoeConfig::new(64, 64, 8, 2);
//! let logits = stream.clone_htod(&[0.5f32; 3 * 8])?;
//! let mut ids = stream.alloc_zeros::<i32>(3 * 2)?;
//! let mut weights = stream.alloc_zeros::<f32>(3 * 2)?;
//! gpu::route(&cfg, &stream, 3, &logits, None, &mut ids, &mut weights)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod activation;
mod buffers;
mod decode;
mod errors;
mod fused;
mod layer;
mod permute;
mod router;

pub use activation::{activation_backward, activation_forward, ActivationDesc, Rows};
pub use buffers::PermuteBuffers;
pub use decode::{
    decode_applies, decode_forward, decode_preferred, DecodeInputs, DecodeSaved,
    DECODE_MAX_ROWS_PER_EXPERT, DECODE_MAX_SLOTS, DECODE_MAX_TOKENS,
};
pub use errors::DeviceErrors;
pub use fused::{
    fused_activation_backward_preferred, gate_up_fused, gate_up_fused_auto,
    gate_up_fused_preferred, gate_up_fused_supported, GateUpInputs, GateUpRows, PeerRows,
    FUSED_ACTIVATION_BWD_MIN_HIDDEN, FUSED_GATE_UP_MAX_ROWS_PER_EXPERT, FUSED_GATE_UP_MIN_EXPERTS,
    FUSED_GATE_UP_M_FIRST_ROWS_PER_EXPERT,
};
pub use layer::{
    ActivationBackwardPath, DecodePath, DeviceWeights, GateUpPath, Gradients, LayerMemory, Mode,
    MoeLayer, MoePlan, MoeWorkspace, Routing, Weights, AUTO_FUSES_ACTIVATION_BACKWARD,
};
pub use permute::{combine, combine_backward, permute};
pub use router::{route, route_backward};

use crate::MoeError;
use cudarc::driver::{CudaStream, DeviceSlice};
use moefuse_kernels::Kernels;

/// `buffer` holds at least `needed` elements and lives in `stream`'s context.
pub(crate) fn check_buffer<T>(
    what: &'static str,
    buffer: &(impl DeviceSlice<T> + ?Sized),
    needed: usize,
    stream: &CudaStream,
) -> Result<(), MoeError> {
    if buffer.len() < needed {
        return Err(MoeError::BufferTooSmall {
            what,
            needed,
            got: buffer.len(),
        });
    }
    check_device(what, buffer, stream)
}

/// `buffer` lives in `stream`'s context (its allocation's stream's context is the same
/// CUDA context), else [`MoeError::DeviceMismatch`] with both device ordinals.
pub(crate) fn check_device<T>(
    what: &'static str,
    buffer: &(impl DeviceSlice<T> + ?Sized),
    stream: &CudaStream,
) -> Result<(), MoeError> {
    let (have, want) = (buffer.stream().context(), stream.context());
    if have.cu_ctx() != want.cu_ctx() || have.ordinal() != want.ordinal() {
        return Err(MoeError::DeviceMismatch {
            what,
            buffer: have.ordinal(),
            stream: want.ordinal(),
        });
    }
    Ok(())
}

/// A host slice of `got` elements holds `needed`, else [`MoeError::BufferTooSmall`].
pub(crate) fn check_len(what: &'static str, got: usize, needed: usize) -> Result<(), MoeError> {
    if got < needed {
        return Err(MoeError::BufferTooSmall { what, needed, got });
    }
    Ok(())
}

/// The product of `dims` (an element count), or [`MoeError::TooLarge`] naming `what` when
/// it overflows `usize`.
pub(crate) fn elems(what: &'static str, dims: &[usize]) -> Result<usize, MoeError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(MoeError::TooLarge {
            what,
            value: usize::MAX,
            max: usize::MAX,
        })
}

/// `value <= max`, else [`MoeError::TooLarge`].
pub(crate) fn check_max(what: &'static str, value: usize, max: usize) -> Result<(), MoeError> {
    if value > max {
        return Err(MoeError::TooLarge { what, value, max });
    }
    Ok(())
}

/// The kernel handle a call launches through: `shared` (the layer's, bound once), else one
/// bound now to `stream`'s context and kept in `owned` for the call ([`Kernels::new`]
/// checks the library's ABI and that this build compiled the device's architecture).
/// Called after a call's own checks, so those errors come first.
pub(crate) fn kernels_for<'k>(
    shared: Option<&'k Kernels>,
    owned: &'k mut Option<Kernels>,
    stream: &CudaStream,
) -> Result<&'k Kernels, MoeError> {
    match shared {
        Some(kernels) => Ok(kernels),
        None => Ok(owned.insert(Kernels::new(stream.context())?)),
    }
}
