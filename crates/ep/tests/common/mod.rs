//! What the expert-parallel GPU tests share: one PE in this process, N PEs as children of
//! this binary (`moefuse_testkit::relaunch`, one seed for all of them), and the child's
//! side of joining them.

use cudarc::driver::{CudaContext, CudaStream};
use moefuse_comm::{LaunchEnv, Library, Runtime, UniqueId};
use moefuse_testkit::Rng;
use std::sync::Arc;

pub fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// A one-PE runtime on `ctx` and a stream of its own.
pub fn one_pe(ctx: &Arc<CudaContext>) -> Result<(Arc<Runtime>, Arc<CudaStream>), String> {
    let lib = Library::load(None).map_err(e)?;
    let id = UniqueId::create(&lib).map_err(e)?;
    let rt = Runtime::init(&lib, ctx, &id, 0, 1).map_err(e)?;
    Ok((rt, ctx.new_stream().map_err(e)?))
}

/// This binary relaunched as `n` ranks on one GPU (time-sliced contexts), all with one
/// fresh seed, each killed after `secs` (scaled).
pub fn n_pes(n: usize, secs: u64) -> Result<(), String> {
    let seed = Rng::fresh_seed();
    moefuse_testkit::relaunch(
        n,
        moefuse_testkit::scaled_secs(secs),
        &[("MOEFUSE_TEST_SEED", seed.to_string())],
        &format!("{n} PEs, seed {seed}"),
    )
}

/// A child of [`n_pes`]: its runtime, the per-thread default stream (no stream of our own
/// on the context: cudarc then records no per-buffer events, which must not enter a
/// captured graph) and the job's seed.
pub fn join() -> Result<(Arc<Runtime>, Arc<CudaStream>, u64), String> {
    let env = LaunchEnv::from_env().map_err(e)?.ok_or("not launched")?;
    let seed: u64 = std::env::var("MOEFUSE_TEST_SEED")
        .map_err(e)?
        .parse()
        .map_err(e)?;
    let ctx = CudaContext::new(0).map_err(e)?;
    let lib = Library::load(None).map_err(e)?;
    let rt = Runtime::join_launched(&lib, &ctx, &env).map_err(e)?;
    Ok((rt, ctx.per_thread_stream(), seed))
}
