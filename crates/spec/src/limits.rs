//! Bounds the kernels are written for. `cargo xtask gen-spec` writes them into
//! `crates/kernels/cuda/include/moefuse/spec.h` (`MOEFUSE_SPEC_MAX_EXPERTS`, ...) for the C
//! side, and `abi.h`'s comments state the same numbers for C callers.

/// Most experts a layer may have (the router keeps one score per expert in shared memory,
/// the permutation and the expert-parallel notify kernel one count per expert).
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

/// Most groups the contiguous grouped GEMM (`Schedule::Contiguous`, `..._contig` variants)
/// takes: its group table lives in shared memory (`kMaxGroups` of
/// `sm90/contiguous_grouped_gemm.cuh`). Every expert count the layer allows fits.
///
/// ```
/// assert!(moefuse_spec::CONTIGUOUS_MAX_GROUPS >= moefuse_spec::MAX_EXPERTS);
/// ```
pub const CONTIGUOUS_MAX_GROUPS: usize = 512;

/// Most groups of a K-grouped (wgrad) launch with `beta == 0`: `zero_empty_groups` puts one
/// group per `blockIdx.y`, which CUDA caps at 65535.
///
/// ```
/// assert_eq!(moefuse_spec::ZERO_EMPTY_GROUPS_MAX, 65_535);
/// ```
pub const ZERO_EMPTY_GROUPS_MAX: usize = 65_535;

// The limits nest: every expert count the layer allows fits every kernel that schedules one
// group per expert, and the router keeps one top-k slot per lane of a warp.
const _: () = assert!(MAX_TOP_K <= MAX_EXPERTS && MAX_TOP_K <= 32);
const _: () = assert!(MAX_EXPERTS <= CONTIGUOUS_MAX_GROUPS);
const _: () = assert!(CONTIGUOUS_MAX_GROUPS <= ZERO_EMPTY_GROUPS_MAX);
