//! Process launch and rendezvous live in `moefuse-launch` (they are not NVSHMEM); this
//! module re-exports them and fixes the id exchange's error type to [`CommError`], so a
//! rank writes `exchange_unique_id(&env, || Ok(UniqueId::create(&lib)?.to_hex()))`.

use crate::CommError;
pub use moefuse_launch::{
    launch, LaunchEnv, LaunchError, LaunchEvent, LaunchSpec, OutputStream, Rendezvous,
    RendezvousServer, ServerLimits, Token, DEFAULT_LAUNCH_TIMEOUT,
};

/// The NVSHMEM unique id of this job, the same text on every rank
/// ([`moefuse_launch::exchange_unique_id`] with `make_id` returning [`CommError`]).
///
/// ```no_run
/// use moefuse_comm::{exchange_unique_id, LaunchEnv, Library, UniqueId};
/// let env = LaunchEnv::from_env()?.expect("run me under cargo xtask launch");
/// let lib = Library::load(None)?;
/// let hex = exchange_unique_id(&env, || Ok(UniqueId::create(&lib)?.to_hex()))?;
/// let id = UniqueId::from_hex(&hex)?;
/// # Ok::<(), moefuse_comm::CommError>(())
/// ```
pub fn exchange_unique_id(
    env: &LaunchEnv,
    make_id: impl FnOnce() -> Result<String, CommError>,
) -> Result<String, CommError> {
    moefuse_launch::exchange_unique_id(env, make_id)
}

/// Rank 0 computes a one-line value and every rank returns it
/// ([`moefuse_launch::broadcast_from_rank0`] with `make` returning [`CommError`]).
///
/// ```no_run
/// use moefuse_comm::{broadcast_from_rank0, LaunchEnv};
/// let env = LaunchEnv::from_env()?.expect("run me under cargo xtask launch");
/// let port = broadcast_from_rank0(&env, "my-port", || Ok("29500".to_string()))?;
/// # Ok::<(), moefuse_comm::CommError>(())
/// ```
pub fn broadcast_from_rank0(
    env: &LaunchEnv,
    key: &str,
    make: impl FnOnce() -> Result<String, CommError>,
) -> Result<String, CommError> {
    moefuse_launch::broadcast_from_rank0(env, key, make)
}
