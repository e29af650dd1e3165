//! Process launch and rendezvous for moefuse jobs on one host, without MPI or a shared
//! filesystem: each process's rank, and one value (the NVSHMEM unique id) that every
//! process of a job agrees on. Nothing here touches CUDA or NVSHMEM.
//!
//! 1. A launcher starts the job. `cargo xtask launch -n N -- program args` (or [`launch`]
//!    from Rust) serves a [`RendezvousServer`] on 127.0.0.1, guarded by a fresh random
//!    [`Token`], and starts N children with the variables below. torchrun-style
//!    `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`LOCAL_WORLD_SIZE` work too, with the id given in
//!    `MOEFUSE_UNIQUE_ID` (or a rendezvous and its token given by the caller).
//! 2. Each child reads them with [`LaunchEnv::from_env`].
//! 3. [`exchange_unique_id`]: rank 0 makes the id and the others fetch it through the
//!    rendezvous ([`Rendezvous`], a blocking key-value client that proves the token first).
//!    Every rank gets the same text, ready for `moefuse_comm::UniqueId::from_hex`.
//! 4. The launcher forwards every rank's lines, names the first rank that fails and stops
//!    the others (and everything they started); a launch has a deadline by default
//!    ([`DEFAULT_LAUNCH_TIMEOUT`]).
//!
//! | variable | set by | meaning |
//! |---|---|---|
//! | `MOEFUSE_RANK`, `MOEFUSE_WORLD_SIZE` | launcher | this process's rank, the number of ranks |
//! | `MOEFUSE_LOCAL_RANK`, `MOEFUSE_LOCAL_WORLD_SIZE` | launcher | the same on this host (default: the global ones) |
//! | `MOEFUSE_RENDEZVOUS` | launcher | `host:port` of the job's rendezvous server |
//! | `MOEFUSE_RENDEZVOUS_TOKEN` | launcher | the job's secret; required with `MOEFUSE_RENDEZVOUS` |
//! | `MOEFUSE_JOB_ID` | launcher | random per launch, prefixes every key (default `default`) |
//! | `MOEFUSE_UNIQUE_ID` | you | the id in hex: used as it is, no rendezvous |
//! | `CUDA_VISIBLE_DEVICES` | launcher | entry `rank % G` of the launcher's own list, or `rank % G` |
//! | `MOEFUSE_LAUNCH_GPUS` | you | G when `--gpus` is not given (default 1: all ranks share a GPU) |
//! | `NVSHMEM_DISABLE_NVLS=1`, `NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` | launcher, unless set | NVLink multicast stays off |
//!
//! An empty variable counts as unset.
//!
//! The protocol is one request line over TCP, answered by one line. The first line of a
//! connection must be `AUTH <token>` (answered `OK`; anything else closes the connection);
//! then a connection carries any number of requests. Keys are non-empty and hold no
//! whitespace; a value is one line (it may be empty or hold spaces). Keys are write-once,
//! so a second `SET` cannot change what some ranks have already read.
//!
//! | request | answer |
//! |---|---|
//! | `AUTH <token>` (first line only) | `OK`, or `ERR <why>` and the connection closes |
//! | `SET <key> <value>` | `OK`, or `ERR <why>` when the key is already set or a cap is reached |
//! | `GET <key> [<timeout_ms>]` | `VALUE <value>` once the key exists; `ERR <why>` after the timeout (default 300 s, at most [`ServerLimits::max_wait`]) |
//! | anything else | `ERR <why>` |
//!
//! The server caps its connections, keys and stored bytes, and drops a connection that
//! does not authenticate within [`ServerLimits::auth_timeout`] or sends nothing for
//! [`ServerLimits::idle_timeout`] ([`ServerLimits`]).
//!
//! ```
//! use moefuse_launch::{Rendezvous, RendezvousServer, Token};
//! use std::time::Duration;
//! let token = Token::generate()?;
//! let server = RendezvousServer::start("127.0.0.1:0", token.clone())?;
//! let mut client = Rendezvous::connect(server.addr(), &token)?;
//! client.set("job/answer", "42")?;
//! assert_eq!(client.get("job/answer", Duration::from_secs(1))?, "42");
//! # Ok::<(), moefuse_launch::LaunchError>(())
//! ```

mod env;
mod launcher;
mod rendezvous;
mod token;

pub use env::{broadcast_from_rank0, exchange_unique_id, LaunchEnv};
pub use launcher::{launch, LaunchEvent, LaunchSpec, OutputStream, DEFAULT_LAUNCH_TIMEOUT};
pub use rendezvous::{Rendezvous, RendezvousServer, ServerLimits};
pub use token::Token;

/// Everything launching and bootstrapping can report.
///
/// ```
/// let e = moefuse_launch::LaunchError::LaunchTimeout { secs: 5, running: vec![1] };
/// assert!(e.to_string().contains("5 s"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// Process bootstrap failed: a malformed launch variable (named), or a rendezvous request
    /// (address, key and what went wrong).
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// A launched rank exited unsuccessfully; the launcher then stopped the others.
    #[error(
        "rank {rank} of {world_size} failed first ({status}); ranks still running were stopped"
    )]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// Ranks launched.
        world_size: usize,
        /// Its exit status or signal.
        status: String,
    },
    /// A launch ran past its timeout and the ranks still running were killed.
    #[error("the launch timed out after {secs} s; killed ranks {running:?}, still running")]
    LaunchTimeout {
        /// The timeout.
        secs: u64,
        /// The ranks killed.
        running: Vec<usize>,
    },
}

pub(crate) fn err(msg: impl Into<String>) -> LaunchError {
    LaunchError::Bootstrap(msg.into())
}
