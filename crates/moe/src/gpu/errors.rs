//! [`DeviceErrors`]: the error word kernels raise bits in when device-resident data they
//! cannot trust (expert ids, `row_of`, the permutation's token count) is invalid.

use crate::MoeError;
use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut};
use moefuse_kernels::ffi;
use std::sync::Arc;

/// Three `u32` words in device memory: `[0]` the error bits the permutation and combine
/// kernels raise (`MOEFUSE_MOE_ERROR_*` in `moe_abi.h`), `[1]` the token count of the last
/// permutation (the stamp the layer's backward compares with its own), `[2]` the decode
/// forward's unit counter (zero after every forward).
///
/// Kernels only ever set bits (never clear them) and skip the offending slot, so a bad
/// device value never leads to an access outside a buffer. Reading the word needs a host
/// synchronisation, so it is left to the caller: [`DeviceErrors::take`] after a forward,
/// a backward, or a whole replayed graph reports everything raised since the last take.
///
/// ```no_run
/// use moefuse::gpu::{combine, DeviceErrors};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let s = ctx.default_stream();
/// let row_of = s.clone_htod(&[1i32 << 20])?;            // 1 token, top-1, a bad row
/// let y = s.clone_htod(&vec![half::bf16::ONE; 64])?;    // 1 row
/// let mut out = s.alloc_zeros::<half::bf16>(64)?;
/// let mut errors = DeviceErrors::new(&s)?;
/// combine(&s, 1, 1, 64, &row_of, None, &y, &mut out, &mut errors)?; // slot skipped
/// assert!(matches!(errors.take(), Err(moefuse::MoeError::InvalidDeviceRouting {
///     row_out_of_range: true, .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceErrors {
    pub(super) words: CudaSlice<u32>,
}

impl DeviceErrors {
    /// The `u32` words it holds (the layout above); the layer's memory plan counts them.
    pub(crate) const WORDS: usize = 3;
    /// The index of the decode forward's unit counter among the words.
    const UNIT_COUNTER: usize = 2;

    /// A cleared error word on `stream`'s device.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let errors = moefuse::gpu::DeviceErrors::new(&ctx.default_stream())?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, MoeError> {
        Ok(DeviceErrors {
            words: stream.alloc_zeros(Self::WORDS)?,
        })
    }

    /// The words the decode forward takes: the error bits and the permutation stamp
    /// before [`Self::UNIT_COUNTER`], and the unit counter from it on.
    pub(crate) fn split_for_decode(&mut self) -> (CudaViewMut<'_, u32>, CudaViewMut<'_, u32>) {
        self.words.split_at_mut(Self::UNIT_COUNTER)
    }

    /// Reads and clears the error bits (synchronises the word's stream, so not under graph
    /// capture): `Ok` when none were raised, else [`MoeError::InvalidDeviceRouting`]
    /// naming each kind raised since the last take.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let mut errors = moefuse::gpu::DeviceErrors::new(&ctx.default_stream())?;
    /// errors.take()?; // nothing launched, nothing raised
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn take(&mut self) -> Result<(), MoeError> {
        let stream = self.words.stream().clone();
        let bits = stream
            .clone_dtoh(&self.words.slice(0..1))?
            .first()
            .copied()
            .unwrap_or(0);
        stream.memset_zeros(&mut self.words.slice_mut(0..1))?;
        Self::decode(bits)
    }

    /// The typed error of a raw error word (`Ok` for 0).
    fn decode(bits: u32) -> Result<(), MoeError> {
        if bits == 0 {
            return Ok(());
        }
        Err(MoeError::InvalidDeviceRouting {
            out_of_range: bits & ffi::MOEFUSE_MOE_ERROR_EXPERT_ID != 0,
            duplicate: bits & ffi::MOEFUSE_MOE_ERROR_DUPLICATE != 0,
            row_out_of_range: bits & ffi::MOEFUSE_MOE_ERROR_ROW != 0,
            stale_forward: bits & ffi::MOEFUSE_MOE_ERROR_STALE != 0,
            source_out_of_range: bits & ffi::MOEFUSE_MOE_ERROR_SOURCE != 0,
        })
    }

    /// The stream the word was allocated on.
    ///
    /// ```no_run
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let errors = moefuse::gpu::DeviceErrors::new(&ctx.default_stream())?;
    /// assert_eq!(errors.stream().context().ordinal(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.words.stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bit_has_its_field() {
        assert_eq!(DeviceErrors::decode(0), Ok(()));
        let all = DeviceErrors::decode(31).unwrap_err();
        assert_eq!(
            all,
            MoeError::InvalidDeviceRouting {
                out_of_range: true,
                duplicate: true,
                row_out_of_range: true,
                stale_forward: true,
                source_out_of_range: true,
            }
        );
        assert_eq!(
            DeviceErrors::decode(ffi::MOEFUSE_MOE_ERROR_ROW),
            Err(MoeError::InvalidDeviceRouting {
                out_of_range: false,
                duplicate: false,
                row_out_of_range: true,
                stale_forward: false,
                source_out_of_range: false,
            })
        );
        let msg = all.to_string();
        for part in [
            "outside 0..experts",
            "twice",
            "row_of",
            "token count",
            "source_of",
        ] {
            assert!(msg.contains(part), "{msg:?} lacks {part:?}");
        }
    }
}
