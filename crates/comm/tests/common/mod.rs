//! Helpers both expert-parallel GPU suites use: error text, and the process's one NVSHMEM
//! runtime with its stream.

use cudarc::driver::{CudaContext, CudaStream};
use moefuse_comm::{Library, Runtime, UniqueId};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// Any displayable error as the suites' `String` error.
pub fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// The process's one NVSHMEM runtime at 1 PE (NVSHMEM is initialised once per process) and
/// the one stream every buffer of the one-PE tests lives on.
pub struct OnePe {
    pub rt: Arc<Runtime>,
    pub stream: Arc<CudaStream>,
}

/// The shared one-PE runtime, initialised on first use; tests take turns through the lock.
pub fn one_pe(ctx: &Arc<CudaContext>) -> Result<MutexGuard<'static, OnePe>, String> {
    static PE: OnceLock<Result<Mutex<OnePe>, String>> = OnceLock::new();
    let cell = PE.get_or_init(|| {
        // SAFETY: every buffer of these tests lives on the one stream below, so cudarc need
        // not order uses across streams, and graph capture must not record its events.
        unsafe { ctx.disable_event_tracking() };
        let lib = Library::load(None).map_err(e)?;
        let id = UniqueId::create(&lib).map_err(e)?;
        let rt = Runtime::init(&lib, ctx, &id, 0, 1).map_err(e)?;
        let stream = ctx.new_stream().map_err(e)?;
        Ok(Mutex::new(OnePe { rt, stream }))
    });
    let m = cell.as_ref().map_err(|x| x.clone())?;
    Ok(m.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Runs this test binary again as `ranks` ranks ([`moefuse_testkit::relaunch`]) with `var`
/// set.
pub fn relaunch(
    ranks: usize,
    timeout: std::time::Duration,
    var: (&str, String),
    what: &str,
) -> Result<(), String> {
    moefuse_testkit::relaunch(ranks, timeout, &[var], what)
}
