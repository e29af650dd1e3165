//! Errors of the kernel layer: a non-OK ABI status with the library's message.

use crate::ffi;

/// The status a launcher returned (abi.h's `moefuse_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// An operand breaks the alignment rule.
    Misaligned,
    /// A problem the kernel cannot implement.
    InvalidProblem,
    /// The device is not the variant's architecture.
    ArchMismatch,
    /// The workspace is smaller than asked for.
    WorkspaceTooSmall,
    /// The CUDA runtime reported an error.
    CudaError,
    /// A bug in moefuse.
    Internal,
    /// A value this crate does not know (a library newer than its bindings).
    Unknown(i32),
}

impl Status {
    /// The status for a non-OK raw code.
    ///
    /// ```
    /// use moefuse_kernels::Status;
    /// assert_eq!(Status::from_raw(3), Status::ArchMismatch);
    /// ```
    pub fn from_raw(raw: ffi::MoefuseStatus) -> Self {
        match raw {
            ffi::MOEFUSE_STATUS_MISALIGNED => Status::Misaligned,
            ffi::MOEFUSE_STATUS_INVALID_PROBLEM => Status::InvalidProblem,
            ffi::MOEFUSE_STATUS_ARCH_MISMATCH => Status::ArchMismatch,
            ffi::MOEFUSE_STATUS_WORKSPACE_TOO_SMALL => Status::WorkspaceTooSmall,
            ffi::MOEFUSE_STATUS_CUDA_ERROR => Status::CudaError,
            ffi::MOEFUSE_STATUS_INTERNAL => Status::Internal,
            other => Status::Unknown(other),
        }
    }
}

/// Everything the kernel layer can fail with. Comparable and cloneable, so errors of the
/// crates above (which wrap it with `#[from]`) can be compared in tests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A launcher returned a non-OK status.
    #[error("kernel {variant} returned {status:?}: {message}")]
    Launch {
        /// The variant's name.
        variant: String,
        /// What the launcher returned.
        status: Status,
        /// `moefuse_last_error()` right after the call.
        message: String,
    },
    /// A workspace query refused the problem (the message says why).
    #[error("workspace query of {variant} refused the problem: {message}")]
    WorkspaceQuery {
        /// The variant's name.
        variant: String,
        /// `moefuse_last_error()` right after the query.
        message: String,
    },
    /// A variant was called through the entry of another operation kind.
    #[error("variant {variant} is not a {expected} GEMM")]
    WrongEntry {
        /// The variant's name.
        variant: String,
        /// The kind the call expected.
        expected: &'static str,
    },
    /// The device's architecture has no kernels in moefuse at all.
    #[error("unsupported GPU: compute capability {major}.{minor}; moefuse has kernels for 9.0 (sm_90a) and 10.0 (sm_100a)")]
    UnsupportedArch {
        /// Found major.
        major: i32,
        /// Found minor.
        minor: i32,
    },
    /// The device's architecture is supported but was not compiled into this build.
    #[error("this GPU needs {arch} kernels, but this build compiled [{built}]: rebuild with MOEFUSE_CUDA_ARCHS including {arch}")]
    ArchNotBuilt {
        /// Needed target.
        arch: &'static str,
        /// Targets compiled.
        built: String,
    },
    /// A variant compiled for another architecture than the handle's device.
    #[error("variant {variant} is for {variant_arch}, the device is {device_arch}")]
    VariantArch {
        /// The variant's name.
        variant: String,
        /// The variant's target.
        variant_arch: &'static str,
        /// The handle's device target.
        device_arch: &'static str,
    },
    /// A buffer or stream belongs to another CUDA context (another device) than the handle.
    #[error("kernel {kernel}: {operand} lives on device {found} (context {found_ctx:#x}), the launch is on device {expected} (context {expected_ctx:#x})")]
    WrongDevice {
        /// The kernel.
        kernel: String,
        /// Which operand (or `stream`).
        operand: &'static str,
        /// The handle's device ordinal.
        expected: usize,
        /// The operand's device ordinal.
        found: usize,
        /// The handle's `CUcontext`, as an address.
        expected_ctx: usize,
        /// The operand's `CUcontext`, as an address.
        found_ctx: usize,
    },
    /// A buffer holds fewer elements than the launch reads or writes.
    #[error("kernel {kernel}: {operand} holds {got} elements, the launch needs {needed}")]
    BufferTooSmall {
        /// The kernel.
        kernel: String,
        /// Which operand.
        operand: &'static str,
        /// Elements needed.
        needed: usize,
        /// Elements present.
        got: usize,
    },
    /// A device address breaks the kernel's alignment rule.
    #[error("kernel {kernel}: {operand} at {address:#x} is not {required}-byte aligned")]
    Misaligned {
        /// The kernel.
        kernel: String,
        /// Which operand.
        operand: &'static str,
        /// The address.
        address: u64,
        /// Required alignment in bytes.
        required: u64,
    },
    /// A size or count outside what the kernel implements (its host-side `can_implement`).
    #[error("kernel {kernel}: {what} = {value} is outside {min}..={max}")]
    OutOfRange {
        /// The kernel.
        kernel: String,
        /// Which size, and the rule when it is derived (e.g. `rows + 2 * tile rows`).
        what: &'static str,
        /// Its value.
        value: i128,
        /// Smallest accepted.
        min: i128,
        /// Largest accepted.
        max: i128,
    },
    /// A size that must be a multiple of a vector width (TMA: 16-byte rows).
    #[error("kernel {kernel}: {what} = {value} must be a multiple of {multiple}")]
    NotMultiple {
        /// The kernel.
        kernel: String,
        /// Which size.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The required multiple.
        multiple: usize,
    },
    /// A grouped launch's tile-order word that the variant does not take.
    #[error("kernel {kernel}: tile_order {word:#x}: {source}")]
    InvalidTileOrder {
        /// The kernel.
        kernel: String,
        /// The word.
        word: i32,
        /// The rule broken.
        #[source]
        source: moefuse_spec::TileOrderError,
    },
    /// Arguments that contradict each other (e.g. `x_perm` without `x`).
    #[error("kernel {kernel}: {why}")]
    Inconsistent {
        /// The kernel.
        kernel: String,
        /// The rule broken.
        why: &'static str,
    },
    /// A foreign device address the driver does not know as device memory.
    #[error("kernel {kernel}: {operand} at {address:#x} is not device memory: {source}")]
    NotDeviceMemory {
        /// The kernel.
        kernel: String,
        /// Which operand.
        operand: &'static str,
        /// The address.
        address: u64,
        /// The driver's answer.
        source: cudarc::driver::DriverError,
    },
    /// A foreign device address whose allocation ends before the operand's extent does.
    #[error("kernel {kernel}: {operand} needs {needed} bytes at {address:#x}, its allocation [{start:#x}, +{size}) ends first")]
    OutsideAllocation {
        /// The kernel.
        kernel: String,
        /// Which operand.
        operand: &'static str,
        /// The address.
        address: u64,
        /// Bytes the launch touches from it.
        needed: usize,
        /// Start of the allocation holding it.
        start: u64,
        /// Size of that allocation.
        size: usize,
    },
    /// A CUDA driver call failed.
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
    /// The linked library's ABI is not the one these bindings describe.
    #[error(
        "kernel library ABI version {found}, bindings expect {expected}: rebuild moefuse-kernels"
    )]
    AbiMismatch {
        /// From `moefuse_abi_version()`.
        found: u32,
        /// [`ffi::MOEFUSE_ABI_VERSION`].
        expected: u32,
    },
}
