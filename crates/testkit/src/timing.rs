//! CUDA-event timing: warm-up, then one event pair per sample, median and IQR.

use cudarc::driver::{CudaStream, DriverError};
use std::sync::Arc;

/// Summary of timed samples, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Median.
    pub median_us: f64,
    /// Interquartile range (p75 − p25).
    pub iqr_us: f64,
    /// Number of samples.
    pub samples: usize,
}

impl Stats {
    /// Median, IQR and count of `us` (sorted internally).
    ///
    /// ```
    /// let s = moefuse_testkit::Stats::from_samples(vec![4.0, 1.0, 3.0, 2.0, 5.0]);
    /// assert_eq!(s.median_us, 3.0);
    /// assert_eq!(s.iqr_us, 2.0);
    /// ```
    pub fn from_samples(mut us: Vec<f64>) -> Self {
        us.sort_by(f64::total_cmp);
        let q = |p: f64| {
            let x = p * (us.len() - 1) as f64;
            let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
            us[lo] + (us[hi] - us[lo]) * (x - lo as f64)
        };
        Stats {
            median_us: q(0.5),
            iqr_us: q(0.75) - q(0.25),
            samples: us.len(),
        }
    }
}

/// Runs `f(i)` `warmup` times, then `samples` times between two events each, on `stream`.
/// `i` counts calls so the caller can rotate through input sets larger than L2.
pub fn time_stream<E>(
    stream: &Arc<CudaStream>,
    warmup: usize,
    samples: usize,
    mut f: impl FnMut(usize) -> Result<(), E>,
) -> Result<Stats, E>
where
    E: From<DriverError>,
{
    let ctx = stream.context();
    for i in 0..warmup {
        f(i)?;
    }
    let mut us = Vec::with_capacity(samples);
    for i in 0..samples {
        let start = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        f(warmup + i)?;
        end.record(stream)?;
        end.synchronize()?;
        us.push(start.elapsed_ms(&end)? as f64 * 1e3);
    }
    Ok(Stats::from_samples(us))
}
