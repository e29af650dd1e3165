//! Relaunching a GPU test binary as N ranks (the multi-PE tests of `moefuse-comm` and
//! `moefuse-ep`).

use std::ffi::OsString;
use std::time::Duration;

/// Runs this test binary again as `ranks` ranks through `moefuse-launch` (GPUs from
/// `MOEFUSE_LAUNCH_GPUS`, else all on GPU 0), each with the variables `env` set, echoing
/// every rank's lines as `[rank r] line`; a failure carries `what` and all the lines. The
/// children find themselves launched through `moefuse_launch::LaunchEnv::from_env`.
///
/// ```no_run
/// let seed = 7u64;
/// moefuse_testkit::relaunch(2, std::time::Duration::from_secs(60),
///     &[("MOEFUSE_TEST_SEED", seed.to_string())], "2 PEs")?;
/// # Ok::<(), String>(())
/// ```
pub fn relaunch(
    ranks: usize,
    timeout: Duration,
    env: &[(&str, String)],
    what: &str,
) -> Result<(), String> {
    let me = std::env::current_exe().map_err(|x| x.to_string())?;
    let mut spec = moefuse_launch::LaunchSpec::new(ranks, me, Vec::<String>::new());
    spec.timeout = Some(timeout);
    spec.env.extend(
        env.iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v))),
    );
    let mut log = Vec::new();
    let result = moefuse_launch::launch(&spec, |event| {
        if let moefuse_launch::LaunchEvent::Output { rank, line, .. } = event {
            println!("[rank {rank}] {line}");
            log.push(format!("[rank {rank}] {line}"));
        }
    });
    result.map_err(|x| format!("{what}: {x}\n{}", log.join("\n")))
}
