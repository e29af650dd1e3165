//! [`MoeError`]: everything the layer rejects, with the offending values.

/// Everything the moefuse layer rejects, each variant carrying the offending values.
///
/// Configuration errors come from [`MoeConfig::validate`](crate::MoeConfig::validate); the
/// others from the per-call checks (token count, tensor lengths, routing) that run before
/// anything is computed.
///
/// ```
/// use moefuse::{MoeConfig, MoeError};
/// let err = MoeConfig::new(100, 128, 8, 2).validate().unwrap_err();
/// assert_eq!(err, MoeError::DimNotMultiple { what: "hidden", value: 100, multiple: 64 });
/// assert_eq!(err.to_string(), "hidden = 100 must be a positive multiple of 64");
/// ```
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum MoeError {
    /// `hidden` or `intermediate` is zero or not a multiple of 64.
    #[error("{what} = {value} must be a positive multiple of {multiple}")]
    DimNotMultiple {
        /// `"hidden"` or `"intermediate"`.
        what: &'static str,
        /// The configured value.
        value: usize,
        /// The required multiple (64).
        multiple: usize,
    },
    /// The expert count is outside `1..=max`.
    #[error("experts = {experts} is out of range: need 1 <= experts <= {max}")]
    ExpertsOutOfRange {
        /// The configured expert count.
        experts: usize,
        /// The largest supported count (512).
        max: usize,
    },
    /// `top_k` is outside `1..=min(max, experts)`.
    #[error("top_k = {top_k} is out of range: need 1 <= top_k <= min({max}, experts = {experts})")]
    TopKOutOfRange {
        /// The configured top-k.
        top_k: usize,
        /// The configured expert count.
        experts: usize,
        /// The largest supported top-k (16).
        max: usize,
    },
    /// The grouped router's `n_group` is zero or does not divide the expert count.
    #[error("n_group = {n_group} must be >= 1 and divide experts = {experts}")]
    InvalidGroupCount {
        /// The configured group count.
        n_group: usize,
        /// The configured expert count.
        experts: usize,
    },
    /// A group holds fewer than two experts (the group score sums the top 2).
    #[error("experts / n_group = {experts} / {n_group} = {per_group}: each group needs at least 2 experts (its score is the sum of its top 2)")]
    GroupTooSmall {
        /// The configured expert count.
        experts: usize,
        /// The configured group count.
        n_group: usize,
        /// Experts per group.
        per_group: usize,
    },
    /// The grouped router's `topk_group` is outside `1..=n_group`.
    #[error(
        "topk_group = {topk_group} is out of range: need 1 <= topk_group <= n_group = {n_group}"
    )]
    TopkGroupOutOfRange {
        /// The configured number of kept groups.
        topk_group: usize,
        /// The configured group count.
        n_group: usize,
    },
    /// The kept groups hold fewer experts than `top_k`.
    #[error("top_k = {top_k} exceeds the experts in the kept groups: topk_group {topk_group} x {per_group} experts per group")]
    TopKExceedsKeptGroups {
        /// The configured top-k.
        top_k: usize,
        /// The configured number of kept groups.
        topk_group: usize,
        /// Experts per group.
        per_group: usize,
    },
    /// A scalar parameter (activation alpha or limit, routed scaling factor) breaks its rule.
    #[error("{what} = {value} is invalid: {rule}")]
    InvalidParameter {
        /// Which parameter.
        what: &'static str,
        /// Its value.
        value: f32,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The call's token count is outside `1..=max`.
    #[error("tokens = {tokens} is out of range: need 1 <= tokens <= {max}")]
    TokensOutOfRange {
        /// The call's token count.
        tokens: usize,
        /// The largest supported count (65536).
        max: usize,
    },
    /// A tensor's length is not a whole number of rows.
    #[error("{what} has {len} elements, not a multiple of {multiple}")]
    NotAMultiple {
        /// Which tensor.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The row length it must be a multiple of.
        multiple: usize,
    },
    /// A tensor has the wrong number of elements.
    #[error("{what} has {found} elements, expected {expected}")]
    ShapeMismatch {
        /// Which tensor, with its shape in words.
        what: &'static str,
        /// The required element count.
        expected: usize,
        /// The element count given.
        found: usize,
    },
    /// A routed expert id is negative or `>= experts`.
    #[error("topk_ids[token {token}, slot {slot}] = {id} is out of range 0..{experts}")]
    ExpertIdOutOfRange {
        /// The token.
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The offending id.
        id: i32,
        /// The expert count.
        experts: usize,
    },
    /// A token routes to the same expert twice.
    #[error("token {token} routes to expert {id} twice (slots {first_slot} and {slot})")]
    DuplicateExpert {
        /// The token.
        token: usize,
        /// The first slot holding the expert.
        first_slot: usize,
        /// The later slot holding it again.
        slot: usize,
        /// The expert id.
        id: i32,
    },
    /// A value that must be finite is NaN or infinite.
    #[error("{what}[{index}] = {value} is not finite")]
    NonFinite {
        /// Which tensor.
        what: &'static str,
        /// The flat index of the first offending element.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A tensor saved by the forward pass disagrees with the rest of what was saved.
    #[error("saved forward state is inconsistent: {what}")]
    InconsistentSaved {
        /// What disagrees.
        what: &'static str,
    },
    /// Routing was asked of the layer, but the weights carry no router matrix.
    #[error("routing input is Ours but the weights have no router matrix")]
    MissingRouter,
    /// Routing was asked of the layer, but the configured router is `External`.
    #[error(
        "the configured router is External: pass RoutingInput::External (topk ids and weights)"
    )]
    ExternalRouter,
    /// A selection bias was given to a router that has none (only `SigmoidGrouped` uses it).
    #[error("a router bias was given, but only the SigmoidGrouped router uses one")]
    UnexpectedRouterBias,
    /// A device buffer holds fewer elements than the call needs.
    #[error("{what} holds {got} elements, the call needs {needed}")]
    BufferTooSmall {
        /// Which buffer, with its shape in words.
        what: &'static str,
        /// The elements the call reads or writes.
        needed: usize,
        /// The buffer's length.
        got: usize,
    },
    /// A size is beyond what the kernels index.
    #[error("{what} = {value} exceeds the kernels' limit {max}")]
    TooLarge {
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The largest accepted.
        max: usize,
    },
    /// A device buffer lives on another device than the stream.
    #[error("{what} is on device {buffer}, the stream on device {stream}")]
    DeviceMismatch {
        /// Which buffer.
        what: &'static str,
        /// The buffer's device ordinal.
        buffer: usize,
        /// The stream's device ordinal.
        stream: usize,
    },
    /// The kernel layer refused a launch on the host (the device's architecture not built,
    /// a buffer of another context, too short or misaligned, a size outside what the kernel
    /// implements) or the library failed it; the [`KernelError`](moefuse_kernels::KernelError)
    /// names the kernel, the operand and the offending values.
    #[error(transparent)]
    Kernel(#[from] moefuse_kernels::KernelError),
    /// A grouped GEMM of the layer rejected its problem or failed to launch.
    #[error("grouped GEMM: {0}")]
    Gemm(#[from] moefuse_grouped_gemm::GemmError),
    /// Device-resident routing state the kernels found invalid (they skipped the offending
    /// slots and raised bits in a [`DeviceErrors`](crate::gpu::DeviceErrors) word; see
    /// `DeviceErrors::take` and `MoeLayer::take_routing_errors`).
    #[error("device routing was invalid:{}{}{}{}{}",
        if *out_of_range { " expert ids outside 0..experts (slots dropped);" } else { "" },
        if *duplicate { " a token naming one expert twice;" } else { "" },
        if *row_out_of_range { " row_of entries outside the rows of y (slots skipped);" } else { "" },
        if *stale_forward { " a backward whose token count differs from the permutation's (the forward state is stale, e.g. a graph replayed after an eager forward of another T; outputs zeroed)" } else { "" },
        if *source_out_of_range { " source_of entries outside 0..tokens*top_k (token 0 read instead)" } else { "" })]
    InvalidDeviceRouting {
        /// Some id was outside `0..experts`.
        out_of_range: bool,
        /// Some token named one expert twice.
        duplicate: bool,
        /// Some `row_of` entry was outside `-1..rows` of the buffer it indexes.
        row_out_of_range: bool,
        /// A combine compared the permutation's token count stamp with its own and they
        /// differed.
        stale_forward: bool,
        /// The fused gate_up met a `source_of` entry outside `0..tokens * top_k`.
        source_out_of_range: bool,
    },
    /// A backward (or its gradient buffers) was asked of a layer that keeps nothing for
    /// one.
    #[error("backward needs a layer built with Mode::Training; this one is in {mode} mode and saves nothing for a backward")]
    NotTraining {
        /// The layer's mode.
        mode: crate::gpu::Mode,
    },
    /// The caller's workspace is smaller than the layer's plan asks.
    #[error("the workspace holds {got} bytes, the plan needs {needed} (MoePlan::workspace_bytes)")]
    WorkspaceTooSmall {
        /// Bytes the plan needs in the layer's mode.
        needed: usize,
        /// Bytes the workspace holds.
        got: usize,
    },
    /// A feature this device or build does not run was asked for.
    #[error("unsupported here: {what}")]
    Unsupported {
        /// What was asked.
        what: &'static str,
    },
    /// The layer was asked for a backward before any forward.
    #[error("backward called before any forward")]
    NoForward,
    /// The CUDA driver reported an error.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}
