//! The fused stages on the GPU: [`gate_up_fused`] gathers the token rows of `x` inside the
//! gate_up GEMM's producer and applies the activation in its epilogue
//! (kernel/sm90_gate_up_fused.cuh; kernel/sm100_gate_up_fused.cuh on Blackwell), so no
//! `x_perm` copy is written and `h_pre` only when a backward needs it.
//! [`gate_up_fused_supported`] says whether the stream's device runs it,
//! [`gate_up_fused_auto`] whether the layer's automatic choices take it there.

use super::{kernels_for, ActivationDesc, DeviceErrors};
use crate::MoeError;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{self as mk, Kernels, VariantArch};
pub use moefuse_kernels::{GateUpRows, PeerRows};
use std::sync::Arc;

/// The routed rows and operands of one fused gate_up: the permutation's `offsets [experts]`
/// (device data the kernel bounds), where the `T * top_k` rows come from (`rows`: gathered
/// from `x [T, hidden]` by the permutation's `source_of`, already in expert-major order as
/// the permutation's `x_perm` (then the GEMM reads it by TMA and only the activation is
/// fused), or read in place from the ranks of an expert-parallel group), and the expert
/// weights `w [experts, W, hidden]` (`W = 2I` gated, `I` for `Relu2`).
pub struct GateUpInputs<'a> {
    /// Tokens `T`.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Experts.
    pub experts: usize,
    /// `D`, a multiple of 8.
    pub hidden: usize,
    /// `[experts]` prefix-sum ends (the permutation's).
    pub offsets: &'a dyn DevicePtr<i32>,
    /// Where the rows come from.
    pub rows: GateUpRows<'a>,
    /// `[experts, W, hidden]`.
    pub w: &'a dyn DevicePtr<bf16>,
}

/// Whether [`gate_up_fused`] (and the fused down dgrad behind
/// [`ActivationBackwardPath::Fused`](crate::gpu::ActivationBackwardPath::Fused)) runs on
/// `stream`'s device: compute capability 9.0 with the MoE kernels built for `sm_90a`, or 10.0
/// with them built for `sm_100a`.
///
/// ```no_run
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// println!("fused gate_up: {}", moefuse::gpu::gate_up_fused_supported(&ctx.default_stream())?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gate_up_fused_supported(stream: &Arc<CudaStream>) -> Result<bool, MoeError> {
    let kernels = Kernels::new(stream.context())?;
    Ok(fused_kernels_run_on(&kernels))
}

/// Whether the automatic choices ([`GateUpPath::Auto`](crate::gpu::GateUpPath::Auto),
/// [`ActivationBackwardPath::Auto`](crate::gpu::ActivationBackwardPath::Auto), the
/// expert-parallel layer's gate_up and pulled rows) may take the fused kernels on `stream`'s
/// device: on `sm_90a`, where they were verified and measured. The `sm_100a` twins are built
/// and their SASS checked, but no B200 has run them yet: there they run only when asked for
/// ([`MoeLayer::set_gate_up_path`](crate::gpu::MoeLayer::set_gate_up_path),
/// [`MoeLayer::set_activation_backward_path`](crate::gpu::MoeLayer::set_activation_backward_path),
/// or [`gate_up_fused`] itself).
///
/// ```no_run
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// println!("Auto may fuse: {}", moefuse::gpu::gate_up_fused_auto(&ctx.default_stream())?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gate_up_fused_auto(stream: &Arc<CudaStream>) -> Result<bool, MoeError> {
    let kernels = Kernels::new(stream.context())?;
    Ok(supported_by(&kernels))
}

/// Average routed rows per expert (`T·k/E`) up to which [`GateUpPath::Auto`](crate::gpu::GateUpPath::Auto)
/// takes the fused gather for fine-grained MoEs (at least [`FUSED_GATE_UP_MIN_EXPERTS`]
/// experts; the largest measured win: Qwen3-30B-A3B at T = 16384).
pub const FUSED_GATE_UP_MAX_ROWS_PER_EXPERT: usize = 1024;

/// Fewest experts for which [`GateUpPath::Auto`](crate::gpu::GateUpPath::Auto) takes the
/// fused gather at up to [`FUSED_GATE_UP_MAX_ROWS_PER_EXPERT`] rows per expert. Measured on
/// the H200 (2026-12-04, `bench_moe`, the three gate_up paths in one run each): the fused
/// gather is faster on the fine-grained shapes (Qwen3-30B-A3B at T = 8192 and 16384,
/// DeepSeek-V3 and GPT-OSS-120B at T = 8192; 256 to 1024 rows per expert), slower on
/// Mixtral-8x7B (E = 8) at 512–2048 rows per expert with the default tile order, and not
/// clearly faster with the m-first one ([`FUSED_GATE_UP_M_FIRST_ROWS_PER_EXPERT`]).
pub const FUSED_GATE_UP_MIN_EXPERTS: usize = 32;

/// Average rows per expert from which the fused gate_up walks an expert's m-blocks first
/// (tile order band 16, m-first): with the default order (bands of 4 m-blocks, n-blocks
/// first) a large W_e (Mixtral-8x7B: 235 MB per expert) is read from DRAM once per band,
/// with m-first once per n-block column. Measured on the H200 (2026-12-04, Mixtral-8x7B
/// T = 8192, 2048 rows per expert, the fused gather forced): 8452 and 9611 µs m-first in
/// two runs, against 11086 and 11392 µs with the default order in two earlier runs. Against
/// the unfused path the same two runs disagree (8452 vs 8856 µs; 9611 vs 9551 µs, IQR
/// 830 µs), so [`GateUpPath::Auto`](crate::gpu::GateUpPath::Auto) does not take it there.
pub const FUSED_GATE_UP_M_FIRST_ROWS_PER_EXPERT: usize = 2048;

/// Whether the fused gather is the faster gate_up for `tokens` tokens of `cfg` (at least
/// [`FUSED_GATE_UP_MIN_EXPERTS`] experts, at most [`FUSED_GATE_UP_MAX_ROWS_PER_EXPERT`]
/// rows per expert on average); whether the device runs it is [`gate_up_fused_supported`].
///
/// ```
/// use moefuse::{gpu::gate_up_fused_preferred, MoeConfig};
/// assert!(gate_up_fused_preferred(&MoeConfig::new(2048, 768, 128, 8), 8192));
/// assert!(!gate_up_fused_preferred(&MoeConfig::new(4096, 14336, 8, 2), 8192));
/// ```
pub fn gate_up_fused_preferred(cfg: &crate::MoeConfig, tokens: usize) -> bool {
    cfg.experts >= FUSED_GATE_UP_MIN_EXPERTS
        && tokens * cfg.top_k <= FUSED_GATE_UP_MAX_ROWS_PER_EXPERT * cfg.experts
}

/// The tile order word of a fused gate_up over `rows` rows of `experts` experts: m-first in
/// bands of 16 from [`FUSED_GATE_UP_M_FIRST_ROWS_PER_EXPERT`] rows per expert, the
/// kernel's default (0) below; `MOEFUSE_GATE_UP_TILE_ORDER` overrides both.
fn tile_order_for(rows: usize, experts: usize) -> u32 {
    const M_FIRST_BAND_16: u32 = 1 | (16 << 8);
    match tile_order_override() {
        Some(word) => word,
        None if rows >= FUSED_GATE_UP_M_FIRST_ROWS_PER_EXPERT * experts => M_FIRST_BAND_16,
        None => 0,
    }
}

/// `MOEFUSE_GATE_UP_TILE_ORDER=<word>` (decimal or `0x` hex, the contiguous GEMM's tile
/// order word: raster bits 0-1, band bits 8-15, interleave bit 24) pins the fused
/// gate_up's tile order (benches, A/B) instead of [`tile_order_for`]'s. A word the
/// kernel refuses is a typed launch error. Read once per process (not per launch).
fn tile_order_override() -> Option<u32> {
    static WORD: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *WORD.get_or_init(|| {
        let word = std::env::var("MOEFUSE_GATE_UP_TILE_ORDER").ok();
        let parse = |w: &str| match w.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => w.parse().ok(),
        };
        word.as_deref().and_then(parse)
    })
}

/// Smallest `hidden` (the down dgrad's K) from which the routed activation backward in the
/// down dgrad's epilogue (`moefuse_moe_down_dgrad_fused`, sm_90a) measured faster, the rule
/// [`ActivationBackwardPath::Auto`](crate::gpu::ActivationBackwardPath::Auto) applies while
/// [`AUTO_FUSES_ACTIVATION_BACKWARD`](crate::gpu::AUTO_FUSES_ACTIVATION_BACKWARD) is on
/// (measured against the 1x1 dgrad; see there). The fused epilogue runs after each tile's
/// mainloop on the same warps, so it
/// pays off where the mainloop is long. Measured on an H100 (2026-12-06, `bench_moe
/// --profile`, T = 8192, backward medians in µs, fused vs the two kernels, alternating in
/// two device calls; docs/perf-notes.md, session 19): Qwen3-30B-A3B (D = 2048) 2831–2867 vs
/// 2753–2782 (slower); GPT-OSS-120B (D = 2880) 11418, 11548, 11450 vs 11522, 11487, 11630
/// (within noise); Mixtral-8x7B (D = 4096) 22252, 22984, 23274 vs 21980, 24035, 23332 (IQRs
/// 1.3–1.9 ms); DeepSeek-V3 (D = 7168) 35660, 35685 vs 37541, 37593 (−5 %).
/// [`ActivationBackwardPath`](crate::gpu::ActivationBackwardPath) and
/// `MOEFUSE_FUSED_ACTIVATION_BWD=on|off` override the rule.
///
/// ```
/// use moefuse::{gpu::fused_activation_backward_preferred, MoeConfig};
/// assert!(!fused_activation_backward_preferred(&MoeConfig::new(2048, 768, 128, 8)));
/// assert!(fused_activation_backward_preferred(&MoeConfig::new(7168, 2048, 256, 8)));
/// ```
pub const FUSED_ACTIVATION_BWD_MIN_HIDDEN: usize = 4096;

/// Whether the fused down dgrad (routed activation backward in its epilogue) is the faster
/// backward for `cfg` (`hidden >= `[`FUSED_ACTIVATION_BWD_MIN_HIDDEN`]); whether the device
/// runs it is [`gate_up_fused_supported`] (the same sm_90a or sm_100a build).
///
/// ```
/// use moefuse::{gpu::fused_activation_backward_preferred, MoeConfig};
/// assert!(fused_activation_backward_preferred(&MoeConfig::new(4096, 14336, 8, 2)));
/// ```
pub fn fused_activation_backward_preferred(cfg: &crate::MoeConfig) -> bool {
    cfg.hidden >= FUSED_ACTIVATION_BWD_MIN_HIDDEN
}

/// The `sm_90a` fused kernels (gate_up, down dgrad) run here and Auto may take them.
pub(super) fn supported_by(kernels: &Kernels) -> bool {
    kernels.arch() == VariantArch::Sm90a && mk::built_archs().contains(&VariantArch::Sm90a.name())
}

/// The fused kernels (gate_up, down dgrad) run here (`sm_90a` or `sm_100a`, built).
pub(super) fn fused_kernels_run_on(kernels: &Kernels) -> bool {
    let arch = kernels.arch();
    matches!(arch, VariantArch::Sm90a | VariantArch::Sm100a)
        && mk::built_archs().contains(&arch.name())
}

/// `h [T·k, I] = act(x[source_of / top_k] · W_eᵀ)` per expert (and `h_pre [T·k, W]`, the
/// pre-activation, when given) on `stream`: the permutation's gather, the gate_up GEMM and
/// [`activation_forward`](super::activation_forward) in one kernel, fp32 accumulators
/// activated before rounding. Rows past `offsets[E-1]` are not written. A bad `source_of`
/// entry reads token 0 and raises a bit in `errors` ([`DeviceErrors::take`]).
///
/// ```no_run
/// use moefuse::gpu::{gate_up_fused, ActivationDesc, DeviceErrors, GateUpInputs, GateUpRows};
/// use moefuse::{Activation, GateUpLayout};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let (t, k, d, i, e) = (16, 2, 128, 64, 4);
/// let (x, w) = (s.alloc_zeros::<half::bf16>(t * d)?, s.alloc_zeros::<half::bf16>(e * 2 * i * d)?);
/// let (offsets, source_of) = (s.clone_htod(&[8i32, 16, 24, 32])?, s.alloc_zeros::<i32>(t * k)?);
/// let mut h = s.alloc_zeros::<half::bf16>(t * k * i)?;
/// let mut errors = DeviceErrors::new(&s)?;
/// let desc = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, i);
/// let inputs = GateUpInputs { tokens: t, top_k: k, experts: e, hidden: d, offsets: &offsets,
///     rows: GateUpRows::Gather { x: &x, source_of: &source_of }, w: &w };
/// gate_up_fused(&desc, &s, inputs, &mut h, None, &mut errors)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn gate_up_fused(
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    inputs: GateUpInputs<'_>,
    h: &mut dyn DevicePtrMut<bf16>,
    h_pre: Option<&mut dyn DevicePtrMut<bf16>>,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError> {
    gate_up_fused_with(None, desc, stream, inputs, h, h_pre, errors)
}

/// [`gate_up_fused`] through `kernels` (the layer's handle), or a handle bound for the call.
pub(super) fn gate_up_fused_with(
    kernels: Option<&Kernels>,
    desc: &ActivationDesc,
    stream: &Arc<CudaStream>,
    inputs: GateUpInputs<'_>,
    h: &mut dyn DevicePtrMut<bf16>,
    h_pre: Option<&mut dyn DevicePtrMut<bf16>>,
    errors: &mut DeviceErrors,
) -> Result<(), MoeError> {
    desc.validate()?;
    let (kind, layout) = desc.kernel_kind();
    let mut owned = None;
    let kernels = kernels_for(kernels, &mut owned, stream)?;
    kernels.launch(
        stream,
        mk::GateUpFused {
            tokens: inputs.tokens,
            top_k: inputs.top_k,
            hidden: inputs.hidden,
            intermediate: desc.intermediate,
            experts: inputs.experts,
            kind,
            layout,
            tile_order: tile_order_for(inputs.tokens * inputs.top_k, inputs.experts),
            offsets: inputs.offsets,
            rows: inputs.rows,
            w: inputs.w,
            h,
            h_pre: h_pre.map(|p| p as &mut dyn DevicePtrMut<bf16>),
            errors: Some(&mut errors.words),
        },
    )?;
    Ok(())
}
