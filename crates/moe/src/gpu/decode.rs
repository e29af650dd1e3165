//! The small-batch (decode) forward: for up to [`DECODE_MAX_TOKENS`] tokens the whole expert
//! MLP after routing — gate_up, activation, down, weighted combine — runs as two kernels
//! that stream each touched expert's weights from memory once (moe/decode.cu), instead of
//! the permutation, two grouped GEMMs with 128-row tiles for a handful of rows, the
//! activation and the combine. [`MoeLayer`](super::MoeLayer) takes this path by itself where
//! [`decode_preferred`] holds ([`MoeLayer::set_decode_path`](super::MoeLayer::set_decode_path)).

use super::{kernels_for, ActivationDesc, DeviceErrors};
use crate::{MoeConfig, MoeError};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{self as mk, Kernels};
use std::sync::Arc;

/// The most tokens one decode forward takes (the kernels' limit).
pub const DECODE_MAX_TOKENS: usize = mk::ffi::MOEFUSE_DECODE_MAX_TOKENS;
/// The most routed (token, slot) pairs one decode forward takes.
pub const DECODE_MAX_SLOTS: usize = mk::ffi::MOEFUSE_DECODE_MAX_SLOTS;

/// Routed rows per expert (`T·k / E`) up to which [`MoeLayer`](super::MoeLayer) prefers the
/// decode kernels to the grouped GEMMs. Measured on the H200 (docs/perf-notes.md): at 8
/// (Mixtral-8x7B, T = 32) the two paths tie (732 against 751 µs), at 16 (T = 64) the
/// grouped GEMMs win (738 against 1142 µs); at ≤ 4 (Qwen3-30B-A3B, DeepSeek-V3, every
/// T ≤ 64) the decode kernels win or tie.
pub const DECODE_MAX_ROWS_PER_EXPERT: usize = 8;

/// Whether the layer takes the decode path for `tokens` tokens by itself: the kernels can
/// run it ([`decode_applies`]) and the routing spreads at most
/// [`DECODE_MAX_ROWS_PER_EXPERT`] rows per expert on average.
///
/// ```
/// use moefuse::{gpu::decode_preferred, MoeConfig};
/// assert!(decode_preferred(&MoeConfig::new(2048, 768, 128, 8), 64));
/// let mixtral = MoeConfig::new(4096, 14336, 8, 2);
/// assert!(decode_preferred(&mixtral, 32) && !decode_preferred(&mixtral, 64));
/// ```
pub fn decode_preferred(cfg: &MoeConfig, tokens: usize) -> bool {
    decode_applies(cfg, tokens) && tokens * cfg.top_k <= DECODE_MAX_ROWS_PER_EXPERT * cfg.experts
}

/// Whether a config can run the decode kernels for `tokens` tokens: `1 ≤ tokens ≤ 64`,
/// `tokens · top_k ≤ 1024`, `hidden` and `intermediate` multiples of 32 (every valid
/// config's are: it asks multiples of 64).
///
/// ```
/// use moefuse::{gpu::decode_applies, MoeConfig};
/// let cfg = MoeConfig::new(2048, 768, 128, 8);
/// assert!(decode_applies(&cfg, 1) && decode_applies(&cfg, 64));
/// assert!(!decode_applies(&cfg, 65) && !decode_applies(&cfg, 0));
/// ```
pub fn decode_applies(cfg: &MoeConfig, tokens: usize) -> bool {
    let m = mk::DECODE_DIM_MULTIPLE;
    (1..=DECODE_MAX_TOKENS).contains(&tokens)
        && tokens * cfg.top_k <= DECODE_MAX_SLOTS
        && cfg.hidden % m == 0
        && cfg.intermediate % m == 0
}

/// The operands of one decode forward: `tokens` rows of `x [T, hidden]`, the routing
/// `topk_ids`/`topk_weights [T, top_k]` (device data: an id outside `0..experts` drops its
/// slot and raises a bit in the errors), and the expert weights `gate_up [E, W, hidden]`,
/// `down [E, hidden, I]`.
pub struct DecodeInputs<'a> {
    /// Tokens `T`, `1..=`[`DECODE_MAX_TOKENS`].
    pub tokens: usize,
    /// `[T, k]` expert ids.
    pub topk_ids: &'a dyn DevicePtr<i32>,
    /// `[T, k]` routing weights.
    pub topk_weights: &'a dyn DevicePtr<f32>,
    /// `[T, hidden]`.
    pub x: &'a dyn DevicePtr<bf16>,
    /// `[E, W, hidden]`.
    pub gate_up: &'a dyn DevicePtr<bf16>,
    /// `[E, hidden, I]`.
    pub down: &'a dyn DevicePtr<bf16>,
}

/// The expert-major copies a training forward keeps for its backward, at the rows
/// `row_of [T·k]` of the permutation gives each slot (the layer keeps only `h_pre`).
pub struct DecodeSaved<'a> {
    /// `[T·k]` expert-major row of each slot (the permutation's).
    pub row_of: &'a dyn DevicePtr<i32>,
    /// `[T·k, W]` pre-activation.
    pub h_pre: &'a mut dyn DevicePtrMut<bf16>,
    /// `[T·k, I]` activation, if wanted.
    pub h: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[T·k, hidden]` unweighted expert outputs, if wanted.
    pub y_e: Option<&'a mut dyn DevicePtrMut<bf16>>,
}

/// `y[t] = Σ_j w[t,j] · bf16(act(x[t] · W_eᵀ) · D_eᵀ)` (`e = topk_ids[t, j]`; fp32 sum in
/// slot order, as the layer's combine) for `cfg` on `stream`, with `h [T·k, I]` as
/// scratch; with `saved`, the expert-major copies too. Deterministic. `errors` gets the
/// routing bits ([`DeviceErrors::take`]).
///
/// ```no_run
/// use moefuse::gpu::{decode_forward, DecodeInputs, DeviceErrors};
/// use moefuse::MoeConfig;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let cfg = MoeConfig::new(128, 64, 4, 2);
/// let x = s.alloc_zeros::<half::bf16>(128)?;
/// let gate_up = s.alloc_zeros::<half::bf16>(4 * 128 * 128)?;
/// let down = s.alloc_zeros::<half::bf16>(4 * 128 * 64)?;
/// let (ids, w) = (s.clone_htod(&[1i32, 2])?, s.clone_htod(&[0.6f32, 0.4])?);
/// let (mut h, mut y) = (s.alloc_zeros::<half::bf16>(2 * 64)?, s.alloc_zeros::<half::bf16>(128)?);
/// let mut errors = DeviceErrors::new(&s)?;
/// let inputs = DecodeInputs { tokens: 1, topk_ids: &ids, topk_weights: &w, x: &x,
///     gate_up: &gate_up, down: &down };
/// decode_forward(&cfg, &s, inputs, &mut h, &mut y, None, &mut errors)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn decode_forward(
    cfg: &MoeConfig,
    stream: &Arc<CudaStream>,
    inputs: DecodeInputs<'_>,
    h: &mut dyn DevicePtrMut<bf16>,
    y: &mut dyn DevicePtrMut<bf16>,
    saved: Option<DecodeSaved<'_>>,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError> {
    decode_forward_with(None, cfg, stream, inputs, h, y, saved, errors)
}

/// [`decode_forward`] through `kernels` (the layer's handle), or a handle bound for the
/// call.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_forward_with(
    kernels: Option<&Kernels>,
    cfg: &MoeConfig,
    stream: &Arc<CudaStream>,
    inputs: DecodeInputs<'_>,
    h: &mut dyn DevicePtrMut<bf16>,
    y: &mut dyn DevicePtrMut<bf16>,
    saved: Option<DecodeSaved<'_>>,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError> {
    cfg.validate()?;
    let desc = ActivationDesc::new(cfg.activation, cfg.gate_up_layout, cfg.intermediate);
    let (kind, layout) = desc.kernel_kind();
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    type Out<'o> = Option<&'o mut dyn DevicePtrMut<bf16>>;
    let (row_of, h_pre_rows, h_rows, y_e_rows): (Option<&dyn DevicePtr<i32>>, Out, Out, Out) =
        match saved {
            Some(s) => (
                Some(s.row_of as &dyn DevicePtr<i32>),
                Some(s.h_pre as &mut dyn DevicePtrMut<bf16>),
                s.h.map(|h| &mut *h as &mut dyn DevicePtrMut<bf16>),
                s.y_e.map(|y| &mut *y as &mut dyn DevicePtrMut<bf16>),
            ),
            None => (None, None, None, None),
        };
    let (mut bits, mut unit_counter) = errors.split_for_decode();
    kernels.launch(
        stream,
        mk::DecodeForward {
            tokens: inputs.tokens,
            top_k: cfg.top_k,
            hidden: cfg.hidden,
            intermediate: cfg.intermediate,
            experts: cfg.experts,
            kind,
            layout,
            topk_ids: inputs.topk_ids,
            topk_weights: inputs.topk_weights,
            x: inputs.x,
            w_gate_up: inputs.gate_up,
            w_down: inputs.down,
            h,
            y,
            row_of,
            h_pre_rows,
            h_rows,
            y_e_rows,
            errors: Some(&mut bits),
            unit_counter: Some(&mut unit_counter),
        },
    )?;
    Ok(())
}
