//! Bounds the kernels are written for. `kernels/include/moefuse/abi.h` states the same
//! numbers for C callers.

/// Most experts a layer may have (the router keeps one score per expert in shared memory,
/// the contiguous grouped GEMM schedules at most this many groups).
///
/// ```
/// assert_eq!(moefuse_spec::MAX_EXPERTS, 512);
/// ```
pub const MAX_EXPERTS: usize = 512;

/// Most experts one token may be routed to (`top_k`); also at most [`MAX_EXPERTS`].
///
/// ```
/// assert!(moefuse_spec::MAX_TOP_K <= moefuse_spec::MAX_EXPERTS);
/// ```
pub const MAX_TOP_K: usize = 16;
