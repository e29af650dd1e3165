//! The rank side of a launched job: where this process sits ([`LaunchEnv`]), and values
//! every rank agrees on ([`exchange_unique_id`], [`broadcast_from_rank0`]).

use crate::rendezvous::{check_key, EXCHANGE_TIMEOUT};
use crate::{err, LaunchError, Rendezvous, Token};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where this process sits in a launched job, read from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// The rank among the processes on this host.
    pub local_rank: usize,
    /// The number of processes on this host.
    pub local_world_size: usize,
    rendezvous: Option<SocketAddr>,
    token: Option<Token>,
    job_id: String,
    unique_id: Option<String>,
}

impl LaunchEnv {
    /// Reads the process environment: `MOEFUSE_RANK` and friends, else torchrun's `RANK` and
    /// friends; `None` when neither is set (not launched).
    ///
    /// ```
    /// if let Some(env) = moefuse_launch::LaunchEnv::from_env()? {
    ///     assert!(env.rank < env.world_size);
    /// }
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn from_env() -> Result<Option<Self>, LaunchError> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`LaunchEnv::from_env`] over any lookup of variables (tests pass a map).
    ///
    /// ```
    /// use std::collections::HashMap;
    /// let vars = HashMap::from([("RANK", "1"), ("WORLD_SIZE", "2")]);
    /// let env = moefuse_launch::LaunchEnv::from_lookup(|k| vars.get(k).map(|v| v.to_string()))?
    ///     .expect("launched");
    /// assert_eq!((env.rank, env.world_size, env.local_rank), (1, 2, 1));
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn from_lookup(
        mut lookup: impl FnMut(&str) -> Option<String>,
    ) -> Result<Option<Self>, LaunchError> {
        let mut var = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let names = if var("MOEFUSE_RANK").is_some() {
            [
                "MOEFUSE_RANK",
                "MOEFUSE_WORLD_SIZE",
                "MOEFUSE_LOCAL_RANK",
                "MOEFUSE_LOCAL_WORLD_SIZE",
            ]
        } else if var("RANK").is_some() {
            ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]
        } else {
            return Ok(None);
        };
        let mut number = |name: &str| -> Result<Option<usize>, LaunchError> {
            var(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| err(format!("{name}=`{v}` is not a non-negative integer")))
                })
                .transpose()
        };
        let rank = number(names[0])?.expect("checked above");
        let world_size = number(names[1])?
            .ok_or_else(|| err(format!("{} is set but {} is not", names[0], names[1])))?;
        let local_rank = number(names[2])?.unwrap_or(rank);
        let local_world_size = number(names[3])?.unwrap_or(world_size);
        if rank >= world_size {
            return Err(err(format!(
                "{}={rank} is outside {}={world_size}",
                names[0], names[1]
            )));
        }
        if local_rank >= local_world_size || local_world_size > world_size {
            return Err(err(format!(
                "{}={local_rank}, {}={local_world_size} do not fit {}={world_size}",
                names[2], names[3], names[1]
            )));
        }
        let rendezvous = var("MOEFUSE_RENDEZVOUS")
            .map(|v| {
                v.to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| err(format!("MOEFUSE_RENDEZVOUS=`{v}` is not a host:port")))
            })
            .transpose()?;
        let token = var("MOEFUSE_RENDEZVOUS_TOKEN")
            .map(|t| Token::parse(&t).map_err(|e| err(format!("MOEFUSE_RENDEZVOUS_TOKEN: {e}"))))
            .transpose()?;
        if rendezvous.is_some() && token.is_none() {
            return Err(err(
                "MOEFUSE_RENDEZVOUS is set but MOEFUSE_RENDEZVOUS_TOKEN is not: the rendezvous \
                 answers only clients that show the job's token (cargo xtask launch sets both)",
            ));
        }
        let job_id = var("MOEFUSE_JOB_ID").unwrap_or_else(|| "default".into());
        check_key(&job_id).map_err(|why| err(format!("MOEFUSE_JOB_ID=`{job_id}`: {why}")))?;
        let unique_id = var("MOEFUSE_UNIQUE_ID");
        if let Some(id) = &unique_id {
            check_hex(id).map_err(|why| err(format!("MOEFUSE_UNIQUE_ID: {why}")))?;
        }
        Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            rendezvous,
            token,
            job_id,
            unique_id,
        }))
    }

    /// The rendezvous server's address (`MOEFUSE_RENDEZVOUS`), if any.
    ///
    /// ```
    /// # let env = moefuse_launch::LaunchEnv::from_lookup(|k| {
    /// #     ["RANK", "WORLD_SIZE"].iter().position(|n| *n == k).map(|i| i.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.rendezvous(), None);
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn rendezvous(&self) -> Option<SocketAddr> {
        self.rendezvous
    }

    /// The job id that prefixes this job's keys (`MOEFUSE_JOB_ID`, default `default`).
    ///
    /// ```
    /// # let env = moefuse_launch::LaunchEnv::from_lookup(|k| {
    /// #     ["RANK", "WORLD_SIZE"].iter().position(|n| *n == k).map(|i| i.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.job_id(), "default");
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// The id given in `MOEFUSE_UNIQUE_ID`, if any (checked to be hex digits).
    ///
    /// ```
    /// # let vars = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MOEFUSE_UNIQUE_ID", "00ff")];
    /// # let env = moefuse_launch::LaunchEnv::from_lookup(|k| {
    /// #     vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.unique_id(), Some("00ff"));
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn unique_id(&self) -> Option<&str> {
        self.unique_id.as_deref()
    }
}

fn check_hex(id: &str) -> Result<(), String> {
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        let head: String = id.chars().take(16).collect();
        Err(format!("`{head}…` is not hex digits"))
    } else {
        Ok(())
    }
}

/// The NVSHMEM unique id of this job, the same text on every rank: `MOEFUSE_UNIQUE_ID` when
/// given; else `make_id()` on rank 0, sent to the others through the rendezvous (one rank
/// alone needs none).
///
/// Collective: every rank calls it the same number of times in the same order; the n-th
/// call of a process uses the key `<job>/nvshmem-unique-id/<n>`, so a process may
/// initialise NVSHMEM again (as a test binary running test after test does).
///
/// `make_id`'s error type is the caller's (`moefuse_comm` passes `CommError`), as long as
/// it converts from [`LaunchError`].
///
/// ```no_run
/// use moefuse_launch::{exchange_unique_id, LaunchEnv, LaunchError};
/// let env = LaunchEnv::from_env()?.expect("run me under cargo xtask launch");
/// // moefuse_comm: `|| Ok(UniqueId::create(&lib)?.to_hex())`
/// let hex = exchange_unique_id(&env, || Ok::<_, LaunchError>("00ff".repeat(64)))?;
/// # Ok::<(), moefuse_launch::LaunchError>(())
/// ```
pub fn exchange_unique_id<E: From<LaunchError>>(
    env: &LaunchEnv,
    make_id: impl FnOnce() -> Result<String, E>,
) -> Result<String, E> {
    static EXCHANGES: AtomicUsize = AtomicUsize::new(0);
    if let Some(id) = &env.unique_id {
        return Ok(id.clone());
    }
    let n = EXCHANGES.fetch_add(1, Ordering::Relaxed);
    let id = broadcast_from_rank0(env, &format!("nvshmem-unique-id/{n}"), make_id)?;
    check_hex(&id).map_err(|why| E::from(err(format!("unique id from rank 0: {why}"))))?;
    Ok(id)
}

/// Rank 0 computes a one-line value and every rank returns it: rank 0 `SET`s it under
/// `<job>/<key>`, the others `GET` it (waiting up to 300 s). With one rank, no rendezvous.
///
/// ```no_run
/// use moefuse_launch::{broadcast_from_rank0, LaunchEnv, LaunchError};
/// let env = LaunchEnv::from_env()?.expect("run me under cargo xtask launch");
/// let port = broadcast_from_rank0(&env, "my-port", || Ok::<_, LaunchError>("29500".into()))?;
/// # Ok::<(), moefuse_launch::LaunchError>(())
/// ```
pub fn broadcast_from_rank0<E: From<LaunchError>>(
    env: &LaunchEnv,
    key: &str,
    make: impl FnOnce() -> Result<String, E>,
) -> Result<String, E> {
    if env.world_size == 1 {
        return make();
    }
    let addr = env.rendezvous.ok_or_else(|| {
        E::from(err(format!(
            "rank {} of {}: MOEFUSE_RENDEZVOUS is not set; start the job with `cargo xtask \
             launch` (or, for the NVSHMEM id, export one MOEFUSE_UNIQUE_ID to every rank)",
            env.rank, env.world_size
        )))
    })?;
    let token = env
        .token
        .as_ref()
        .ok_or_else(|| E::from(err("MOEFUSE_RENDEZVOUS_TOKEN is not set")))?;
    let key = format!("{}/{key}", env.job_id);
    let mut client = Rendezvous::connect(addr, token)?;
    if env.rank == 0 {
        let value = make()?;
        client.set(&key, &value)?;
        Ok(value)
    } else {
        Ok(client.get(&key, EXCHANGE_TIMEOUT)?)
    }
}
