//! [`MoeCandleError`]: everything this crate rejects, with the offending values; turned into
//! a [`candle::Error`] at the candle boundary ([`CustomOp3`](candle::CustomOp3), `Module`).

use candle::DType;
use moefuse::MoeError;

/// Everything the candle adapter rejects. Each variant carries what is wrong (which
/// tensor, expected vs found); errors of moefuse and candle keep their type.
///
/// At the candle boundary (the op's forward and backward, [`Module::forward`](candle::Module))
/// it becomes a [`candle::Error`]: a wrapped candle error is unwrapped again, anything else
/// is [`candle::Error::wrap`]ped.
///
/// ```
/// use moefuse_candle::MoeCandleError;
/// let err = MoeCandleError::Shape { what: "x [T, D]", expected: vec![4, 64], found: vec![4, 32] };
/// assert_eq!(err.to_string(), "x [T, D]: expected shape [4, 64], found [4, 32]");
/// let c: candle::Error = err.into();
/// assert!(c.to_string().contains("x [T, D]"));
/// ```
#[derive(thiserror::Error, Debug)]
pub enum MoeCandleError {
    /// The layer's own rules (config, token count, routing, device buffers).
    #[error(transparent)]
    Moe(#[from] MoeError),
    /// An error from a candle operation.
    #[error(transparent)]
    Candle(#[from] candle::Error),
    /// A CUDA driver error on the GPU path.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] moefuse::cudarc::driver::DriverError),
    /// A tensor of the wrong shape.
    #[error("{what}: expected shape {expected:?}, found {found:?}")]
    Shape {
        /// Which tensor, with its dimension names.
        what: &'static str,
        /// The shape the config asks for.
        expected: Vec<usize>,
        /// The tensor's shape.
        found: Vec<usize>,
    },
    /// A tensor of a dtype this path does not take.
    #[error("{what}: dtype {found:?} is not supported here, expected {expected}")]
    DType {
        /// Which tensor.
        what: &'static str,
        /// What this path takes (e.g. "bf16 on CUDA").
        expected: &'static str,
        /// The tensor's dtype.
        found: DType,
    },
    /// The op's inputs live on different devices, or on one this crate has no path for.
    #[error("{what}: {detail}")]
    Device {
        /// Which tensor or operation.
        what: &'static str,
        /// What the devices were.
        detail: String,
    },
    /// A tensor the op reads directly is not contiguous.
    #[error("{what} must be contiguous")]
    NotContiguous {
        /// Which tensor.
        what: &'static str,
    },
    /// The config asks for something this adapter (or its candle-ops block) does not do.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What, and what to use instead.
        what: String,
    },
}

impl From<MoeCandleError> for candle::Error {
    fn from(e: MoeCandleError) -> Self {
        match e {
            MoeCandleError::Candle(c) => c,
            other => candle::Error::wrap(other),
        }
    }
}

/// `Ok` when `found == expected`, else [`MoeCandleError::Shape`].
pub(crate) fn expect_shape(
    what: &'static str,
    found: &[usize],
    expected: &[usize],
) -> Result<(), MoeCandleError> {
    if found == expected {
        Ok(())
    } else {
        Err(MoeCandleError::Shape {
            what,
            expected: expected.to_vec(),
            found: found.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candle_errors_come_back_unwrapped_and_ours_are_wrapped() {
        let inner = candle::Error::Msg("boom".into());
        let back: candle::Error = MoeCandleError::from(inner).into();
        assert!(matches!(back, candle::Error::Msg(ref m) if m == "boom"));
        let ours: candle::Error = MoeCandleError::Moe(MoeError::ExternalRouter).into();
        assert!(ours
            .to_string()
            .contains(&MoeError::ExternalRouter.to_string()));
        assert!(expect_shape("w", &[3], &[3]).is_ok());
        assert!(matches!(
            expect_shape("w", &[3], &[4]),
            Err(MoeCandleError::Shape { what: "w", .. })
        ));
    }
}
