//! [`EpError`]: what the expert-parallel layer reports, each before any launch where the
//! host can know it.

/// Errors of the expert-parallel layer.
///
/// ```
/// let e = moefuse_ep::EpError::Shape { what: "x", needed: 8, got: 4 };
/// assert!(e.to_string().contains("x"));
/// ```
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// A buffer holds fewer elements than the call needs.
    #[error("{what}: needs {needed} elements, holds {got}")]
    Shape {
        /// Which buffer.
        what: &'static str,
        /// Elements needed.
        needed: usize,
        /// Elements held.
        got: usize,
    },
    /// More tokens than the layer was built for.
    #[error("{tokens} tokens, the layer holds at most {max}")]
    TooManyTokens {
        /// Tokens asked.
        tokens: usize,
        /// The layer's `max_tokens`.
        max: usize,
    },
    /// The configuration does not fit the world (experts not divisible by the ranks, a
    /// layer shape the kernels do not take).
    #[error("configuration: {0}")]
    Config(String),
    /// The layer's kernels (routing, activation) refused or failed.
    #[error(transparent)]
    Moe(#[from] moefuse::MoeError),
    /// A kernel of the launch layer refused or failed.
    #[error(transparent)]
    Kernel(#[from] moefuse_kernels::KernelError),
    /// A grouped GEMM refused or failed.
    #[error(transparent)]
    Gemm(#[from] moefuse_grouped_gemm::GemmError),
    /// The exchange refused or failed (a peer's failure included).
    #[error(transparent)]
    Comm(#[from] moefuse_comm::CommError),
    /// The CUDA driver reported an error.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
}

/// `got >= needed` elements, else [`EpError::Shape`] naming `what`.
pub(crate) fn need(what: &'static str, got: usize, needed: usize) -> Result<(), EpError> {
    if got < needed {
        return Err(EpError::Shape { what, needed, got });
    }
    Ok(())
}
