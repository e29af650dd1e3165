//! Process bootstrap without MPI or a shared filesystem: each process's rank, and one
//! NVSHMEM unique id that every process of a job agrees on.
//!
//! 1. A launcher starts the job. `cargo xtask launch -n N -- program args` (or [`launch`](crate::launch)
//!    from Rust) serves a [`RendezvousServer`] on 127.0.0.1 and starts N children with the
//!    variables below. torchrun-style `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`LOCAL_WORLD_SIZE`
//!    work too, with the id given in `MOEFUSE_UNIQUE_ID`.
//! 2. Each child reads them with [`LaunchEnv::from_env`].
//! 3. [`exchange_unique_id`]: rank 0 makes the id and the others fetch it through the
//!    rendezvous ([`Rendezvous`], a blocking key-value client). Every rank gets the same
//!    text, ready for `UniqueId::from_hex` and `Runtime::init`.
//!
//! | variable | set by | meaning |
//! |---|---|---|
//! | `MOEFUSE_RANK`, `MOEFUSE_WORLD_SIZE` | launcher | this process's rank, the number of ranks |
//! | `MOEFUSE_LOCAL_RANK`, `MOEFUSE_LOCAL_WORLD_SIZE` | launcher | the same on this host (default: the global ones) |
//! | `MOEFUSE_RENDEZVOUS` | launcher | `host:port` of the job's rendezvous server |
//! | `MOEFUSE_JOB_ID` | launcher | random per launch, prefixes every key (default `default`) |
//! | `MOEFUSE_UNIQUE_ID` | you | the id in hex: used as it is, no rendezvous |
//! | `CUDA_VISIBLE_DEVICES` | launcher | entry `rank % G` of the launcher's own list, or `rank % G` |
//! | `MOEFUSE_LAUNCH_GPUS` | you | G when `--gpus` is not given (default 1: all ranks share a GPU) |
//! | `NVSHMEM_DISABLE_NVLS=1`, `NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` | launcher, unless set | NVLink multicast stays off |
//!
//! An empty variable counts as unset.
//!
//! The protocol is one request line over TCP, answered by one line; a connection carries
//! any number of requests. Keys are non-empty and hold no whitespace; a value is one line
//! (it may be empty or hold spaces). Keys are write-once, so a second `SET` cannot change
//! what some ranks have already read.
//!
//! | request | answer |
//! |---|---|
//! | `SET <key> <value>` | `OK`, or `ERR <why>` when the key is already set |
//! | `GET <key> [<timeout_ms>]` | `VALUE <value>` once the key exists; `ERR <why>` after the timeout (default 300 s) |
//! | anything else | `ERR <why>` |
//!
//! NOTES: xtask compiles this file through `#[path]` rather than depending on moefuse-comm,
//! whose build script needs the CUDA toolchain that `cargo xtask setup` installs. So this
//! file uses only std, tracing and `super::CommError`.

use super::CommError;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long [`exchange_unique_id`] waits for rank 0's id.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a client retries a refused connection (the server may still be starting).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request or answer line.
const MAX_LINE: u64 = 64 * 1024;
/// How often the launcher looks at its children.
pub(super) const POLL: Duration = Duration::from_millis(20);

/// Variables that keep NVLink multicast off in every child unless already set.
pub(super) const NO_MULTICAST: [(&str, &str); 3] = [
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
];

pub(super) fn err(msg: impl Into<String>) -> CommError {
    CommError::Bootstrap(msg.into())
}

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
    job_id: String,
    unique_id: Option<String>,
}

impl LaunchEnv {
    /// Reads the process environment: `MOEFUSE_RANK` and friends, else torchrun's `RANK` and
    /// friends; `None` when neither is set (not launched).
    ///
    /// ```
    /// if let Some(env) = moefuse_comm::LaunchEnv::from_env()? {
    ///     assert!(env.rank < env.world_size);
    /// }
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn from_env() -> Result<Option<Self>, CommError> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`LaunchEnv::from_env`] over any lookup of variables (tests pass a map).
    ///
    /// ```
    /// use std::collections::HashMap;
    /// let vars = HashMap::from([("RANK", "1"), ("WORLD_SIZE", "2")]);
    /// let env = moefuse_comm::LaunchEnv::from_lookup(|k| vars.get(k).map(|v| v.to_string()))?
    ///     .expect("launched");
    /// assert_eq!((env.rank, env.world_size, env.local_rank), (1, 2, 1));
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn from_lookup(
        mut lookup: impl FnMut(&str) -> Option<String>,
    ) -> Result<Option<Self>, CommError> {
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
        let mut number = |name: &str| -> Result<Option<usize>, CommError> {
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
            job_id,
            unique_id,
        }))
    }

    /// The rendezvous server's address (`MOEFUSE_RENDEZVOUS`), if any.
    ///
    /// ```
    /// # let env = moefuse_comm::LaunchEnv::from_lookup(|k| {
    /// #     ["RANK", "WORLD_SIZE"].iter().position(|n| *n == k).map(|i| i.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.rendezvous(), None);
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn rendezvous(&self) -> Option<SocketAddr> {
        self.rendezvous
    }

    /// The job id that prefixes this job's keys (`MOEFUSE_JOB_ID`, default `default`).
    ///
    /// ```
    /// # let env = moefuse_comm::LaunchEnv::from_lookup(|k| {
    /// #     ["RANK", "WORLD_SIZE"].iter().position(|n| *n == k).map(|i| i.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.job_id(), "default");
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// The id given in `MOEFUSE_UNIQUE_ID`, if any (checked to be hex digits).
    ///
    /// ```
    /// # let vars = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MOEFUSE_UNIQUE_ID", "00ff")];
    /// # let env = moefuse_comm::LaunchEnv::from_lookup(|k| {
    /// #     vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())
    /// # })?.unwrap();
    /// assert_eq!(env.unique_id(), Some("00ff"));
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn unique_id(&self) -> Option<&str> {
        self.unique_id.as_deref()
    }
}

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err("a key must be non-empty, without whitespace".into())
    } else {
        Ok(())
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
    static EXCHANGES: AtomicUsize = AtomicUsize::new(0);
    if let Some(id) = &env.unique_id {
        return Ok(id.clone());
    }
    let n = EXCHANGES.fetch_add(1, Ordering::Relaxed);
    let id = broadcast_from_rank0(env, &format!("nvshmem-unique-id/{n}"), make_id)?;
    check_hex(&id).map_err(|why| err(format!("unique id from rank 0: {why}")))?;
    Ok(id)
}

/// Rank 0 computes a one-line value and every rank returns it: rank 0 `SET`s it under
/// `<job>/<key>`, the others `GET` it (waiting up to 300 s). With one rank, no rendezvous.
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
    if env.world_size == 1 {
        return make();
    }
    let addr = env.rendezvous.ok_or_else(|| {
        err(format!(
            "rank {} of {}: MOEFUSE_RENDEZVOUS is not set; start the job with `cargo xtask \
             launch` (or, for the NVSHMEM id, export one MOEFUSE_UNIQUE_ID to every rank)",
            env.rank, env.world_size
        ))
    })?;
    let key = format!("{}/{key}", env.job_id);
    let mut client = Rendezvous::connect(addr)?;
    if env.rank == 0 {
        let value = make()?;
        client.set(&key, &value)?;
        Ok(value)
    } else {
        client.get(&key, EXCHANGE_TIMEOUT)
    }
}

/// A blocking client of a [`RendezvousServer`] (the protocol is in the module docs).
#[derive(Debug)]
pub struct Rendezvous {
    addr: SocketAddr,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Rendezvous {
    /// Connects, retrying a refused connection for up to 10 s.
    ///
    /// ```
    /// use moefuse_comm::{Rendezvous, RendezvousServer};
    /// use std::time::Duration;
    /// let server = RendezvousServer::start("127.0.0.1:0")?;
    /// let mut client = Rendezvous::connect(server.addr())?;
    /// client.set("job/answer", "42")?;
    /// assert_eq!(client.get("job/answer", Duration::from_secs(1))?, "42");
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn connect(addr: SocketAddr) -> Result<Self, CommError> {
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(stream) => break stream,
                Err(e)
                    if e.kind() == std::io::ErrorKind::ConnectionRefused
                        && Instant::now() < deadline =>
                {
                    thread::sleep(Duration::from_millis(100))
                }
                Err(e) => return Err(err(format!("rendezvous {addr}: cannot connect: {e}"))),
            }
        };
        let _ = stream.set_nodelay(true);
        let writer = stream
            .try_clone()
            .map_err(|e| err(format!("rendezvous {addr}: {e}")))?;
        tracing::debug!(%addr, "rendezvous connected");
        Ok(Rendezvous {
            addr,
            reader: BufReader::new(stream),
            writer,
        })
    }

    /// Stores `value` under `key`; fails if the key is already set.
    ///
    /// ```
    /// # use moefuse_comm::{Rendezvous, RendezvousServer};
    /// # let server = RendezvousServer::start("127.0.0.1:0")?;
    /// let mut client = Rendezvous::connect(server.addr())?;
    /// client.set("job/x", "one")?;
    /// assert!(client.set("job/x", "two").is_err()); // write-once
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), CommError> {
        if value.contains(['\n', '\r']) {
            return Err(self.fail("SET", key, "the value holds a line break"));
        }
        match self.request("SET", key, &format!("SET {key} {value}"), None)? {
            answer if answer == "OK" => Ok(()),
            answer => Err(self.fail("SET", key, &answer)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for some process to set it.
    ///
    /// ```
    /// # use moefuse_comm::{Rendezvous, RendezvousServer};
    /// # use std::time::Duration;
    /// # let server = RendezvousServer::start("127.0.0.1:0")?;
    /// let mut client = Rendezvous::connect(server.addr())?;
    /// let missing = client.get("job/never", Duration::from_millis(10));
    /// assert!(missing.unwrap_err().to_string().contains("job/never"));
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<String, CommError> {
        let ms = timeout.as_millis().max(1);
        match self.request("GET", key, &format!("GET {key} {ms}"), Some(timeout))? {
            answer if answer.starts_with("VALUE ") => Ok(answer["VALUE ".len()..].to_string()),
            answer => Err(self.fail("GET", key, &answer)),
        }
    }

    fn request(
        &mut self,
        verb: &str,
        key: &str,
        line: &str,
        wait: Option<Duration>,
    ) -> Result<String, CommError> {
        check_key(key).map_err(|why| self.fail(verb, key, &why))?;
        // The server answers a GET by its timeout; the socket's is a backstop.
        let backstop = wait.unwrap_or_default() + Duration::from_secs(30);
        let io = |e: std::io::Error| e.to_string();
        let answer = self
            .reader
            .get_ref()
            .set_read_timeout(Some(backstop))
            .map_err(io)
            .and_then(|()| writeln!(self.writer, "{line}").map_err(io))
            .and_then(|()| read_line(&mut self.reader).map_err(io))
            .and_then(|answer| answer.ok_or_else(|| "the server closed the connection".into()));
        let answer = answer.map_err(|why| self.fail(verb, key, &why))?;
        tracing::debug!(addr = %self.addr, verb, key, answer = %answer, "rendezvous");
        Ok(answer)
    }

    fn fail(&self, verb: &str, key: &str, why: &str) -> CommError {
        err(format!("rendezvous {}: {verb} {key}: {why}", self.addr))
    }
}

/// One line without its line break; `None` at end of stream.
fn read_line(reader: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    reader.take(MAX_LINE).read_until(b'\n', &mut buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    if buf.pop() != Some(b'\n') {
        return Err(std::io::Error::other("line too long or cut off"));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

#[derive(Default)]
struct Store {
    state: Mutex<(HashMap<String, String>, bool)>, // (values, stopped)
    changed: Condvar,
}

impl Store {
    fn answer(&self, line: &str) -> String {
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("SET"), Some(key), value) => {
                if let Err(why) = check_key(key) {
                    return format!("ERR {why}");
                }
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if state.0.contains_key(key) {
                    return format!("ERR {key} is already set (keys are write-once)");
                }
                state
                    .0
                    .insert(key.to_string(), value.unwrap_or("").to_string());
                self.changed.notify_all();
                "OK".into()
            }
            (Some("GET"), Some(key), timeout) => {
                let timeout = match timeout.map(str::parse::<u64>) {
                    None => EXCHANGE_TIMEOUT,
                    Some(Ok(ms)) => Duration::from_millis(ms),
                    Some(Err(_)) => return "ERR GET <key> [<timeout_ms>]".into(),
                };
                let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                let (state, _) = self
                    .changed
                    .wait_timeout_while(state, timeout, |(values, stopped)| {
                        !values.contains_key(key) && !*stopped
                    })
                    .unwrap_or_else(|p| p.into_inner());
                match state.0.get(key) {
                    Some(value) => format!("VALUE {value}"),
                    None if state.1 => "ERR the rendezvous server stopped".into(),
                    None => format!("ERR {key} not set within {} ms", timeout.as_millis()),
                }
            }
            _ => "ERR expected SET <key> <value> or GET <key> [<timeout_ms>]".into(),
        }
    }

    fn serve(&self, stream: TcpStream) {
        let Ok(mut writer) = stream.try_clone() else {
            return;
        };
        let mut reader = BufReader::new(stream);
        while let Ok(Some(line)) = read_line(&mut reader) {
            let answer = self.answer(&line);
            if writeln!(writer, "{answer}").is_err() {
                break;
            }
        }
    }
}

/// The key-value store of one job, served on a TCP port by background threads until dropped.
#[derive(Debug)]
pub struct RendezvousServer {
    addr: SocketAddr,
    store: Arc<Store>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store")
    }
}

impl RendezvousServer {
    /// Binds `addr` (port 0: the OS picks one) and starts serving.
    ///
    /// ```
    /// let server = moefuse_comm::RendezvousServer::start("127.0.0.1:0")?;
    /// assert_ne!(server.addr().port(), 0);
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn start(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self, CommError> {
        let listener = TcpListener::bind(&addr)
            .map_err(|e| err(format!("rendezvous: cannot listen on {addr:?}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| err(format!("rendezvous: {e}")))?;
        let store = Arc::new(Store::default());
        let shared = Arc::clone(&store);
        let accept = thread::Builder::new()
            .name("rendezvous".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.state.lock().unwrap_or_else(|p| p.into_inner()).1 {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let store = Arc::clone(&shared);
                    thread::spawn(move || store.serve(stream));
                }
            })
            .map_err(|e| err(format!("rendezvous: cannot start a thread: {e}")))?;
        tracing::debug!(%addr, "rendezvous serving");
        Ok(RendezvousServer {
            addr,
            store,
            accept: Some(accept),
        })
    }

    /// The address clients connect to.
    ///
    /// ```
    /// let server = moefuse_comm::RendezvousServer::start("127.0.0.1:0")?;
    /// assert!(server.addr().ip().is_loopback());
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RendezvousServer {
    /// Stops accepting, and answers pending `GET`s with an error.
    fn drop(&mut self) {
        self.store.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.store.changed.notify_all();
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
            if let Some(accept) = self.accept.take() {
                let _ = accept.join();
            }
        }
    }
}
