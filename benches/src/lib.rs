//! Shared plumbing of the benchmark programs: the JSON-lines record of DEVELOPERS.md,
//! interleaved CUDA-event timing of several backends, and input-set rotation beyond L2.

#![forbid(unsafe_code)]

pub mod cases;

use cudarc::driver::{CudaContext, CudaStream};
use moefuse_testkit::Stats;
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// One benchmark result, one JSON line in `benches/results/<suite>.jsonl`.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Suite, e.g. `gemm`.
    pub suite: String,
    /// Case, e.g. `dense-8192-bnk`.
    pub case: String,
    /// `moefuse` or the baseline's name.
    pub backend: String,
    /// GPU name.
    pub gpu: String,
    /// GPUs the run used, for the multi-process (expert-parallel) suites.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<usize>,
    /// Median time.
    pub median_us: f64,
    /// Interquartile range.
    pub iqr_us: f64,
    /// Useful TFLOP/s at the median.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tflops: Option<f64>,
    /// Achieved GB/s at the median (memory-bound suites).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    /// Relative error against the CPU reference, checked before timing.
    pub rel_err: f64,
    /// UTC date of the run.
    pub date: String,
    /// Commit the binaries were built from (`MOEFUSE_COMMIT`).
    pub commit: String,
}

impl Record {
    /// One console line: case, median [IQR], rate, error.
    ///
    /// ```
    /// let r = moefuse_benches::Record { suite: "s".into(), case: "c".into(), backend: "moefuse".into(),
    ///     gpu: "g".into(), gpus: None, median_us: 10.0, iqr_us: 1.0, tflops: Some(5.0), gbps: None,
    ///     rel_err: 1e-3, date: "d".into(), commit: "x".into() };
    /// assert!(r.line().contains("5.0 TFLOP/s"));
    /// ```
    pub fn line(&self) -> String {
        let rate = match (self.tflops, self.gbps) {
            (Some(t), _) => format!("{t:>7.1} TFLOP/s"),
            (None, Some(g)) => format!("{g:>7.1} GB/s"),
            _ => "-".into(),
        };
        format!(
            "{:<40} {:>10.1} us [IQR {:>7.1}] {rate}  rel_err {:.1e}",
            self.case, self.median_us, self.iqr_us, self.rel_err
        )
    }
}

/// Appends records to `<dir>/<suite>.jsonl`.
pub fn append(dir: &Path, suite: &str, records: &[Record]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{suite}.jsonl")))?;
    for r in records {
        writeln!(
            f,
            "{}",
            serde_json::to_string(r).expect("records serialise")
        )?;
    }
    Ok(())
}

pub use moefuse_testkit::today;

/// The commit the binaries came from (`MOEFUSE_COMMIT`, set by the device pack's run.sh).
pub fn commit() -> String {
    std::env::var("MOEFUSE_COMMIT").unwrap_or_else(|_| "unknown".into())
}

/// How many input sets to rotate so that one pass touches at least 3× the L2 cache.
pub fn rotation(ctx: &Arc<CudaContext>, bytes_per_set: usize) -> usize {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE;
    let l2 = ctx
        .attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .unwrap_or(64 << 20) as usize;
    (3 * l2).div_ceil(bytes_per_set.max(1)).clamp(1, 64)
}

/// Device 0 for benchmark `name`, or `None` after printing `SKIPPED <name>: <reason>`.
pub fn open_gpu(name: &str) -> Option<Arc<CudaContext>> {
    match moefuse_testkit::gpu() {
        Ok(ctx) => Some(ctx),
        Err(why) => {
            println!("SKIPPED {name}: {why}");
            None
        }
    }
}

/// Boxed error for benchmark programs.
pub type Error = Box<dyn std::error::Error>;

/// A GPU context and the NVSHMEM runtime of this rank on it.
pub type EpWorld = (Arc<CudaContext>, Arc<moefuse_comm::Runtime>);

/// The NVSHMEM world of an expert-parallel bench: as a launched rank, join the job; at
/// `ranks > 1` and not launched, relaunch this program as `ranks` ranks (their lines echoed
/// with the rank) and return `None`; at one rank, a 1-PE runtime in this process. `None`
/// also when there is no GPU (the skip line is printed).
pub fn ep_world(name: &str, ranks: usize) -> Result<Option<EpWorld>, Error> {
    use moefuse_comm::{launch, LaunchEnv, LaunchEvent, LaunchSpec};
    use moefuse_comm::{Library, Runtime, UniqueId};
    let launched = LaunchEnv::from_env()?;
    if launched.is_none() && ranks > 1 {
        let argv: Vec<String> = std::env::args().skip(1).collect();
        let spec = LaunchSpec::new(ranks, std::env::current_exe()?, argv);
        launch(&spec, |event| {
            if let LaunchEvent::Output { rank, line, .. } = event {
                println!("[rank {rank}] {line}");
            }
        })?;
        return Ok(None);
    }
    let Some(ctx) = open_gpu(name) else {
        return Ok(None);
    };
    let lib = Library::load(None)?;
    let rt = match &launched {
        Some(env) => Runtime::join_launched(&lib, &ctx, env)?,
        None => Runtime::init(&lib, &ctx, &UniqueId::create(&lib)?, 0, 1)?,
    };
    Ok(Some((ctx, rt)))
}

/// GPUs an expert-parallel run of `ranks` ranks uses: the launcher puts rank r on GPU
/// `r % G` with `G` from `MOEFUSE_LAUNCH_GPUS` (default 1, every rank on one GPU).
///
/// ```
/// assert_eq!(moefuse_benches::gpus_used(1), 1);
/// ```
pub fn gpus_used(ranks: usize) -> usize {
    let g = std::env::var("MOEFUSE_LAUNCH_GPUS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&g| g >= 1)
        .unwrap_or(1);
    g.min(ranks.max(1))
}

/// A backend under test: runs its `i`-th call on the stream.
pub type Backend<'a> = Box<dyn FnMut(usize) -> Result<(), Error> + 'a>;

/// Times `backends` interleaved (one sample of each in turn, so clocks and neighbours
/// affect all alike): `warmup` calls each, then `samples` event-timed calls each.
pub fn time_interleaved(
    stream: &Arc<CudaStream>,
    backends: &mut [Backend<'_>],
    warmup: usize,
    samples: usize,
) -> Result<Vec<Stats>, Error> {
    let ctx = stream.context();
    for b in backends.iter_mut() {
        for i in 0..warmup {
            b(i)?;
        }
    }
    stream.synchronize()?;
    let mut us = vec![Vec::with_capacity(samples); backends.len()];
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    for s in 0..samples {
        for (b, times) in backends.iter_mut().zip(us.iter_mut()) {
            let (start, end) = (ctx.new_event(timing)?, ctx.new_event(timing)?);
            start.record(stream)?;
            b(warmup + s)?;
            end.record(stream)?;
            end.synchronize()?;
            times.push(start.elapsed_ms(&end)? as f64 * 1e3);
        }
    }
    Ok(us.into_iter().map(Stats::from_samples).collect())
}
