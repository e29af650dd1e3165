//! `cargo xtask launch -n N [--gpus G] [--timeout SECS] -- <program> <args...>`: N ranks of
//! one job on this host, agreeing on an NVSHMEM unique id through a token-guarded
//! rendezvous this task serves on 127.0.0.1 (no MPI, no shared filesystem).
//!
//! The work is `moefuse_launch::launch` (crates/launch; its crate docs list the variables
//! each rank gets and the protocol). moefuse-launch is std-only, so xtask depends on it
//! without the CUDA toolchain moefuse-comm's build script needs.

use moefuse_launch as launcher;
use std::ffi::OsString;
use std::time::Duration;

/// Arguments of `cargo xtask launch`.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Number of processes (ranks).
    #[arg(short = 'n', long = "nprocs")]
    nprocs: usize,
    /// GPUs to spread the ranks over: CUDA_VISIBLE_DEVICES = rank % G (default:
    /// MOEFUSE_LAUNCH_GPUS, else 1, so every rank shares one GPU).
    #[arg(long)]
    gpus: Option<usize>,
    /// Kill every rank after this many seconds (0: never).
    #[arg(long, default_value_t = launcher::DEFAULT_LAUNCH_TIMEOUT.as_secs())]
    timeout: u64,
    /// Seconds the other ranks may run on after one fails, before they are killed.
    #[arg(long, default_value_t = 3)]
    grace: u64,
    /// The program and its arguments (after `--`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    command: Vec<OsString>,
}

/// Runs the job; fails naming the first rank that failed, or the timeout.
pub fn run(args: LaunchArgs) -> crate::Result<()> {
    let (program, rest) = args.command.split_first().expect("clap requires a program");
    let mut spec = launcher::LaunchSpec::new(args.nprocs, program, rest);
    spec.gpus = args.gpus;
    spec.timeout = (args.timeout > 0).then(|| Duration::from_secs(args.timeout));
    spec.grace = Duration::from_secs(args.grace);
    let n = args.nprocs;
    launcher::launch(&spec, |event| match event {
        launcher::LaunchEvent::Started { rendezvous, job_id } => eprintln!(
            "launch: {n} ranks of {}, rendezvous {rendezvous}, job {job_id}",
            program.to_string_lossy()
        ),
        launcher::LaunchEvent::Output { rank, stream, line } => match stream {
            launcher::OutputStream::Stdout => println!("[rank {rank}] {line}"),
            launcher::OutputStream::Stderr => eprintln!("[rank {rank}] {line}"),
        },
        launcher::LaunchEvent::Exited { rank, status } if !status.success() => {
            eprintln!("launch: rank {rank} exited: {status}")
        }
        launcher::LaunchEvent::Exited { .. } => {}
    })
    .map_err(|e| e.to_string())?;
    eprintln!("launch: all {n} ranks exited 0");
    Ok(())
}
