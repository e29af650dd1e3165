//! The one error type of this crate: every check names the offending value.

use moefuse_kernels::KernelError;
use moefuse_spec::{TileOrder, TileOrderError};

/// Which operand a check is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The left operand, `[m, k]`.
    A,
    /// The right operand, `[n, k]` or `[k, n]`.
    B,
    /// The output, `[m, n]`.
    D,
    /// The device workspace.
    Workspace,
    /// The grouped problems' prefix-sum offsets.
    Offsets,
    /// The row index of a gathered operand ([`crate::GroupedGemm::run_gathered`]).
    RowIndex,
}

/// Everything a GEMM call can fail with; all host-knowable cases fail before any launch.
/// Comparable and cloneable (as [`KernelError`] is), so callers' error enums can derive both.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GemmError {
    /// A dimension is zero where the kernel needs work, or too large for 32-bit indexing.
    #[error("invalid shape m={m} n={n} k={k}: {why}")]
    InvalidShape {
        /// Rows.
        m: usize,
        /// Columns.
        n: usize,
        /// Inner dimension.
        k: usize,
        /// The rule broken.
        why: &'static str,
    },
    /// A leading dimension is not a multiple of 8 elements (16 bytes, the TMA rule).
    #[error("operand {operand:?}: {dim} = {value} must be a multiple of {required} elements (16-byte rows for TMA)")]
    Misaligned {
        /// Operand.
        operand: Operand,
        /// Which dimension sets the row pitch.
        dim: &'static str,
        /// Its value.
        value: usize,
        /// The required multiple.
        required: usize,
    },
    /// A buffer holds fewer elements than the problem reads or writes.
    #[error("operand {operand:?}: buffer has {got} elements, the problem needs {needed}")]
    BufferTooSmall {
        /// Operand.
        operand: Operand,
        /// Elements needed.
        needed: usize,
        /// Elements present.
        got: usize,
    },
    /// Group offsets that are not non-decreasing within `0..=rows` (see `check_offsets`).
    #[error("offsets[{group}] = {end} is invalid: previous end {previous}, rows {rows} (ends must be non-decreasing and <= rows)")]
    InvalidOffsets {
        /// The first bad group.
        group: usize,
        /// Its end.
        end: i64,
        /// The previous group's end.
        previous: i64,
        /// Capacity of the row-indexed buffers.
        rows: usize,
    },
    /// No compiled variant implements the request (e.g. an override names an unknown one).
    #[error("no compiled variant for {what}")]
    NoVariant {
        /// What was asked for.
        what: String,
    },
    /// A tile order the chosen variant does not implement (a swizzle above 8, or prefetch
    /// or interleave, for a ptr-array variant; a width that is not a power of two).
    #[error("{order:?} for variant {variant}: {source}")]
    InvalidTileOrder {
        /// The requested order.
        order: TileOrder,
        /// The variant it was checked against (`any` before a variant is chosen).
        variant: String,
        /// The rule broken.
        #[source]
        source: TileOrderError,
    },
    /// The plan belongs to another device or layout than the call.
    #[error("plan mismatch: {0}")]
    PlanMismatch(&'static str),
    /// The kernel layer refused the launch on the host (architecture, device, size, limit,
    /// alignment: see [`KernelError`]) or the library failed it.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
}
