//! A GPU test suite on libtest-mimic: real pass/fail on a GPU, *ignored* plus a printed
//! reason without one, so a skipped test is never counted as passed.

use cudarc::driver::CudaContext;
use libtest_mimic::{Arguments, Failed, Trial};
use std::sync::Arc;

type TestFn = Box<dyn FnOnce(&Arc<CudaContext>) -> Result<(), String> + Send>;

/// Device 0, or the reason there is none (no driver, no device).
///
/// ```no_run
/// match moefuse_testkit::gpu() {
///     Ok(ctx) => println!("{}", ctx.name().unwrap()),
///     Err(why) => println!("no GPU: {why}"),
/// }
/// ```
pub fn gpu() -> Result<Arc<CudaContext>, String> {
    // NOTES: cudarc panics when libcuda cannot be loaded at all; catch that and turn it
    // into a reason, since "no driver" is the normal state of CI machines.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| {
        CudaContext::device_count().and_then(|n| {
            if n < 1 {
                return Ok(None);
            }
            CudaContext::new(0).map(Some)
        })
    });
    std::panic::set_hook(hook);
    match opened {
        Ok(Ok(Some(ctx))) => Ok(ctx),
        Ok(Ok(None)) => Err("the CUDA driver reports no device".into()),
        Ok(Err(e)) => Err(format!("CUDA driver error: {e}")),
        Err(_) => Err("no CUDA driver (libcuda.so could not be loaded)".into()),
    }
}

/// Named GPU tests, run with cargo's test arguments.
#[derive(Default)]
pub struct GpuSuite {
    tests: Vec<(String, TestFn)>,
}

impl GpuSuite {
    /// An empty suite.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a test; it fails when `f` returns `Err` or panics.
    pub fn test(
        mut self,
        name: &str,
        f: impl FnOnce(&Arc<CudaContext>) -> Result<(), String> + Send + 'static,
    ) -> Self {
        self.tests.push((name.to_string(), Box::new(f)));
        self
    }

    /// Runs the suite and exits the process with the harness's code.
    pub fn run(self) -> ! {
        let args = Arguments::from_args();
        let device = gpu();
        let trials = self
            .tests
            .into_iter()
            .map(|(name, f)| match &device {
                Ok(ctx) => {
                    let ctx = ctx.clone();
                    Trial::test(name, move || f(&ctx).map_err(Failed::from))
                }
                Err(why) => {
                    println!("SKIPPED {name}: {why}");
                    Trial::test(name, || Ok(())).with_ignored_flag(true)
                }
            })
            .collect();
        libtest_mimic::run(&args, trials).exit()
    }
}
