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

/// Everything the kernel layer can fail with.
#[derive(Debug, thiserror::Error)]
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
