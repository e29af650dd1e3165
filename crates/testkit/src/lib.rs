//! Helpers shared by moefuse's GPU tests, examples and benchmarks.
//!
//! 1. [`gpu`] opens device 0 or says why it cannot; [`GpuSuite`] runs named GPU tests under
//!    cargo's test harness and reports them as *ignored*, each with a printed
//!    `SKIPPED <test>: <reason>` line, when there is no GPU (never as passed).
//! 2. [`Rng`] draws reproducible random inputs; every failure message carries the seed.
//! 3. [`rel_err`] and [`unwritten`] compare results with a CPU reference.
//! 4. [`time_stream`] times work on a stream with CUDA events: warm-up, samples, median, IQR.
//! 5. [`cublas_rowmajor`] runs the cuBLAS baseline on the same row-major problem.
//!
//! ```no_run
//! use moefuse_testkit::GpuSuite;
//! GpuSuite::new().test("device_opens", |ctx| {
//!     assert!(ctx.name().is_ok());
//!     Ok(())
//! }).run();
//! ```

mod blas;
mod ranks;
mod suite;
mod timing;

pub use blas::cublas_rowmajor;
pub use ranks::relaunch;
pub use suite::{gpu, GpuSuite};
pub use timing::{time_stream, Stats};

use half::bf16;

/// Relative error bound for bf16 inputs with fp32 accumulation, against an f64 reference.
pub const BF16_REL_ERR: f64 = 1e-2;

/// The poison written into outputs before a kernel runs: a bf16 NaN, so an element the
/// kernel never wrote can never pass a comparison.
pub const POISON_BF16: bf16 = bf16::from_bits(0x7FC1);

/// SplitMix64: small, fast, reproducible from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A seed from the clock, so every run draws fresh inputs (print it on failure), or
    /// `MOEFUSE_TEST_SEED` where it is set, to replay a printed failure.
    ///
    /// ```
    /// let mut rng = moefuse_testkit::Rng::new(moefuse_testkit::Rng::fresh_seed());
    /// let _ = rng.next_u64();
    /// ```
    pub fn fresh_seed() -> u64 {
        if let Some(seed) = std::env::var("MOEFUSE_TEST_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return seed;
        }
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// `k` distinct integers uniform in `0..n`, in draw order (a token's experts, `k <= n`).
    ///
    /// ```
    /// let ids = moefuse_testkit::Rng::new(7).distinct(8, 3);
    /// assert_eq!(ids.len(), 3);
    /// assert!(ids.iter().all(|&e| (0..8).contains(&e)) && ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
    /// ```
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<i32> {
        assert!(k <= n, "distinct: {k} values out of {n}");
        let mut chosen = Vec::with_capacity(k);
        while chosen.len() < k {
            let x = self.below(n) as i32;
            if !chosen.contains(&x) {
                chosen.push(x);
            }
        }
        chosen
    }

    /// `len` bf16 values uniform in [-1, 1), drawn in parallel chunks (each chunk from
    /// its own generator seeded by this one, so the result depends only on the seed).
    pub fn bf16_vec(&mut self, len: usize) -> Vec<bf16> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 20;
        let seeds: Vec<u64> = (0..len.div_ceil(CHUNK)).map(|_| self.next_u64()).collect();
        let mut out = vec![bf16::ZERO; len];
        out.par_chunks_mut(CHUNK)
            .zip(seeds)
            .for_each(|(chunk, seed)| {
                let mut rng = Rng::new(seed);
                chunk
                    .iter_mut()
                    .for_each(|x| *x = bf16::from_f32(rng.uniform()));
            });
        out
    }
}

/// ‖got − want‖₂ / ‖want‖₂; NaN if any element of `got` is NaN (so poison never passes).
///
/// ```
/// let e = moefuse_testkit::rel_err(&[1.0, 2.0], &[1.0, 2.0]);
/// assert_eq!(e, 0.0);
/// assert!(moefuse_testkit::rel_err(&[f32::NAN], &[1.0]).is_nan());
/// ```
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_err: length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = g as f64 - w as f64;
        num += d * d;
        den += (w as f64) * (w as f64);
    }
    if den == 0.0 {
        return num.sqrt();
    }
    (num / den).sqrt()
}

/// True when `err` is a number below `bound` (NaN, from poison or overflow, never passes).
///
/// ```
/// assert!(moefuse_testkit::within(1e-3, 1e-2));
/// assert!(!moefuse_testkit::within(f64::NAN, 1e-2));
/// ```
pub fn within(err: f64, bound: f64) -> bool {
    err.partial_cmp(&bound) == Some(std::cmp::Ordering::Less)
}

/// How many elements still hold the poison (NaN), and the first such index.
///
/// ```
/// let v = [1.0, f32::NAN, f32::NAN];
/// assert_eq!(moefuse_testkit::unwritten(&v), (2, Some(1)));
/// ```
pub fn unwritten(got: &[f32]) -> (usize, Option<usize>) {
    let first = got.iter().position(|x| x.is_nan());
    (got.iter().filter(|x| x.is_nan()).count(), first)
}

/// The check every GPU test makes: no element still poison (NaN), then the relative error
/// below `bound`. The error message starts with `what` and names the first unwritten index.
///
/// ```
/// let e = moefuse_testkit::check_close(&[1.0, 2.0], &[1.0, 2.0], 1e-2, "case").unwrap();
/// assert_eq!(e, 0.0);
/// assert!(moefuse_testkit::check_close(&[f32::NAN, 2.0], &[1.0, 2.0], 1e-2, "case").is_err());
/// ```
pub fn check_close(got: &[f32], want: &[f32], bound: f64, what: &str) -> Result<f64, String> {
    let (missing, first) = unwritten(got);
    if missing > 0 {
        return Err(format!(
            "{what}: {missing} outputs never written (still poison), first at {first:?}"
        ));
    }
    let err = rel_err(got, want);
    if !within(err, bound) {
        return Err(format!("{what}: rel err {err:.3e} >= {bound:e}"));
    }
    Ok(err)
}

/// bf16 to f32, element-wise.
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// How many times longer than usual tests may wait for the GPU: `MOEFUSE_TEST_TIME_SCALE`
/// (a whole number ≥ 1, default 1). `run.sh sanitize` sets it, because kernels under
/// compute-sanitizer run many times slower and deadlines tuned for a plain run would fire.
///
/// ```
/// assert!(moefuse_testkit::time_scale() >= 1);
/// ```
pub fn time_scale() -> u32 {
    std::env::var("MOEFUSE_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(1)
        .max(1)
}

/// `n` seconds times [`time_scale`].
///
/// ```
/// assert!(moefuse_testkit::scaled_secs(2) >= std::time::Duration::from_secs(2));
/// ```
pub fn scaled_secs(n: u64) -> std::time::Duration {
    std::time::Duration::from_secs(n * u64::from(time_scale()))
}

/// Today's UTC date, `YYYY-MM-DD` (civil-from-days, no time-zone crate needed): the `date`
/// field of every benchmark's JSON lines.
///
/// ```
/// let d = moefuse_testkit::today();
/// assert_eq!(d.len(), 10);
/// assert!(d.as_str() >= "2026-01-01", "{d}");
/// ```
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}
