//! Every rank of a launched job agrees on one id, made by rank 0 (a fake NVSHMEM unique id:
//! no GPU needed).
//!
//! ```sh
//! cargo build -p moefuse-launch --example rendezvous_echo
//! cargo xtask launch -n 3 -- target/debug/examples/rendezvous_echo            # exit 0
//! cargo xtask launch -n 3 -- target/debug/examples/rendezvous_echo --fail 1   # rank 1 fails
//! ```
//!
//! Each rank prints `rank R of N: id <hex>`; `--fail R` makes rank R exit 3 after the
//! exchange. Started without a launcher, it says SKIPPED and exits 0.

use moefuse_launch::{exchange_unique_id, LaunchEnv};
use std::process::ExitCode;

fn main() -> ExitCode {
    let fail: Option<usize> = std::env::args()
        .skip_while(|a| a != "--fail")
        .nth(1)
        .and_then(|r| r.parse().ok());
    let env = match LaunchEnv::from_env() {
        Ok(Some(env)) => env,
        Ok(None) => {
            println!("SKIPPED rendezvous_echo: not started by a launcher (cargo xtask launch)");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("rendezvous_echo: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A stand-in for `UniqueId::create(&lib)?.to_hex()`: 256 hex digits, new per job.
    let fake_id = || {
        let hex: String = env.job_id().bytes().map(|b| format!("{b:02x}")).collect();
        Ok::<_, moefuse_launch::LaunchError>(format!("{hex:0>256}"))
    };
    match exchange_unique_id(&env, fake_id) {
        Ok(id) => println!("rank {} of {}: id {id}", env.rank, env.world_size),
        Err(e) => {
            eprintln!("rendezvous_echo: {e}");
            return ExitCode::FAILURE;
        }
    }
    if fail == Some(env.rank) {
        eprintln!("rank {} fails on purpose (--fail)", env.rank);
        return ExitCode::from(3);
    }
    ExitCode::SUCCESS
}
