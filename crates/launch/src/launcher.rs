//! The launcher side: N ranks of one job on this host (`cargo xtask launch`, or [`launch`]
//! from Rust), each with the variables the crate docs list and a job-scoped rendezvous
//! server guarded by a fresh token; output forwarded per rank; the first failing rank named
//! and the others stopped, with everything they started.

use crate::{err, LaunchError, RendezvousServer, Token};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// How often the launcher looks at its children.
const POLL: Duration = Duration::from_millis(20);

/// Variables that keep NVLink multicast off in every child unless already set.
const NO_MULTICAST: [(&str, &str); 3] = [
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
];

/// The deadline [`LaunchSpec::new`] gives a launch: a hung job (a rank waiting on a dead
/// peer) is killed after 30 minutes, not never.
pub const DEFAULT_LAUNCH_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// What [`launch`] starts: `nprocs` copies of `program args` on this host.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The number of processes (ranks).
    pub nprocs: usize,
    /// The program (a path, or a name looked up in `PATH`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// G of `CUDA_VISIBLE_DEVICES = rank % G`; `None`: `MOEFUSE_LAUNCH_GPUS`, else 1.
    pub gpus: Option<usize>,
    /// Kill every rank after this long; `None`: no limit (default
    /// [`DEFAULT_LAUNCH_TIMEOUT`]).
    pub timeout: Option<Duration>,
    /// How long the others may run on after a rank fails before they are killed.
    pub grace: Duration,
    /// More variables for every child (set last, so they win).
    pub env: Vec<(OsString, OsString)>,
}

impl LaunchSpec {
    /// `nprocs` ranks of `program args`, [`DEFAULT_LAUNCH_TIMEOUT`], a 3 s grace period.
    ///
    /// ```
    /// let spec = moefuse_launch::LaunchSpec::new(2, "sh", ["-c", "echo $MOEFUSE_RANK"]);
    /// assert_eq!(spec.nprocs, 2);
    /// ```
    pub fn new(
        nprocs: usize,
        program: impl Into<OsString>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        LaunchSpec {
            nprocs,
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            gpus: None,
            timeout: Some(DEFAULT_LAUNCH_TIMEOUT),
            grace: Duration::from_secs(3),
            env: Vec::new(),
        }
    }
}

/// Which of a child's pipes a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// What [`launch`] reports while it runs, in order.
#[derive(Debug)]
pub enum LaunchEvent {
    /// The rendezvous is up and every rank has been started.
    Started {
        /// The rendezvous address the children got.
        rendezvous: SocketAddr,
        /// The job id the children got.
        job_id: String,
    },
    /// A line a rank wrote (without its line break).
    Output {
        /// The rank.
        rank: usize,
        /// Its pipe.
        stream: OutputStream,
        /// The text.
        line: String,
    },
    /// A rank exited.
    Exited {
        /// The rank.
        rank: usize,
        /// How.
        status: ExitStatus,
    },
}

/// Kills and reaps whatever is still running when dropped (on every early return).
struct Ranks(Vec<Option<Child>>);

impl Ranks {
    /// Stops every running rank and the processes below it, then kills them all (a rank
    /// may be a wrapper such as `cargo run` or `sh`, whose program would otherwise keep its
    /// GPU).
    fn kill_all(&mut self) {
        let roots: Vec<u32> = self.0.iter().flatten().map(Child::id).collect();
        kill_trees(&roots);
        for child in self.0.iter_mut().flatten() {
            let _ = child.kill(); // the root itself, also where `kill` is missing
        }
    }

    fn running(&self) -> Vec<usize> {
        (0..self.0.len()).filter(|&r| self.0[r].is_some()).collect()
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
        for child in self.0.iter_mut().flatten() {
            let _ = child.wait();
        }
    }
}

/// Sends `signal` (`-STOP`, `-KILL`) to `pids` through kill(1).
fn signal(signal: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(signal)
        .args(pids.iter().map(u32::to_string))
        .stderr(Stdio::null())
        .status();
}

/// Kills `roots` and every process below them without racing their forks: SIGSTOP first,
/// again on each newly found descendant until a `/proc` walk finds none (a stopped process
/// cannot fork, so the last walk is complete), then SIGKILL to all. NOTES: a single
/// snapshot then kill (the old way) misses a child forked between the two, which then
/// outlives the job; a process group kill would miss a child that changed its group.
fn kill_trees(roots: &[u32]) {
    let mut tree: Vec<u32> = roots.to_vec();
    signal("-STOP", &tree);
    for _ in 0..64 {
        let found: Vec<u32> = descendants(&tree)
            .into_iter()
            .filter(|p| !tree.contains(p))
            .collect();
        if found.is_empty() {
            break;
        }
        signal("-STOP", &found);
        tree.extend(found);
    }
    signal("-KILL", &tree);
    // A stopped process killed while stopped still dies; nothing more to resume.
}

/// Every process below any of `roots`, from the parent ids in `/proc/*/stat` (none off Linux).
fn descendants(roots: &[u32]) -> Vec<u32> {
    let parent_of = |p: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let pairs: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter_map(|p| Some((p, parent_of(p)?)))
        .collect();
    let mut tree = roots.to_vec();
    let mut at = 0;
    while at < tree.len() {
        let parent = tree[at];
        for &(p, _) in pairs.iter().filter(|&&(_, pp)| pp == parent) {
            if !tree.contains(&p) {
                tree.push(p);
            }
        }
        at += 1;
    }
    tree.split_off(roots.len())
}

/// `CUDA_VISIBLE_DEVICES` for each `rank % G`: entries of the launcher's own list, else `0..G`.
fn gpu_ids(
    gpus: Option<usize>,
    var: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>, LaunchError> {
    let g = match gpus {
        Some(g) => g,
        None => match var("MOEFUSE_LAUNCH_GPUS").filter(|v| !v.is_empty()) {
            Some(v) => v.trim().parse().map_err(|_| {
                err(format!(
                    "MOEFUSE_LAUNCH_GPUS=`{v}` is not a non-negative integer"
                ))
            })?,
            None => 1,
        },
    };
    if g == 0 {
        return Err(err(
            "the GPU count (--gpus, MOEFUSE_LAUNCH_GPUS) must be at least 1",
        ));
    }
    match var("CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty()) {
        None => Ok((0..g).map(|i| i.to_string()).collect()),
        Some(list) => {
            let ids: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
            if ids.len() < g {
                return Err(err(format!(
                    "{g} GPUs asked for, but the launcher's CUDA_VISIBLE_DEVICES=`{list}` lists {}",
                    ids.len()
                )));
            }
            Ok(ids[..g].to_vec())
        }
    }
}

fn new_job_id() -> String {
    use std::hash::BuildHasher;
    let seed = (std::process::id(), std::time::SystemTime::now());
    let hash = std::collections::hash_map::RandomState::new().hash_one(seed);
    format!("{hash:016x}")
}

fn forward(
    rank: usize,
    stream: OutputStream,
    pipe: impl Read + Send + 'static,
    tx: &mpsc::Sender<LaunchEvent>,
) {
    let tx = tx.clone();
    thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut buf = Vec::new();
        while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
            while matches!(buf.last(), Some(b'\n' | b'\r')) {
                buf.pop();
            }
            let line = String::from_utf8_lossy(&buf).into_owned();
            buf.clear();
            if tx.send(LaunchEvent::Output { rank, stream, line }).is_err() {
                break;
            }
        }
    });
}

/// Runs a job: serves a rendezvous on 127.0.0.1, starts `spec.nprocs` ranks with the
/// variables of the module docs, reports their lines and exits to `on_event`, and waits.
///
/// When a rank fails (non-zero exit or a signal), the others get `spec.grace` to finish,
/// then are killed, and the answer is [`LaunchError::RankFailed`] naming the first failure.
/// Past `spec.timeout` every rank is killed: [`LaunchError::LaunchTimeout`]. Killing a rank
/// kills the processes it started too (stopped, found through `/proc`, then killed).
///
/// ```no_run
/// use moefuse_launch::{launch, LaunchEvent, LaunchSpec};
/// let spec = LaunchSpec::new(2, "sh", ["-c", "echo rank $MOEFUSE_RANK"]);
/// launch(&spec, |event| {
///     if let LaunchEvent::Output { rank, line, .. } = event {
///         eprintln!("[rank {rank}] {line}");
///     }
/// })?;
/// # Ok::<(), moefuse_launch::LaunchError>(())
/// ```
pub fn launch(spec: &LaunchSpec, mut on_event: impl FnMut(LaunchEvent)) -> Result<(), LaunchError> {
    if spec.nprocs == 0 {
        return Err(err("a launch needs at least one process"));
    }
    let parent = |name: &str| std::env::var(name).ok();
    let gpus = gpu_ids(spec.gpus, parent)?;
    let token = Token::generate()?;
    let server = RendezvousServer::start("127.0.0.1:0", token.clone())?;
    let job_id = new_job_id();
    let (tx, rx) = mpsc::channel();
    let mut ranks = Ranks(Vec::with_capacity(spec.nprocs));
    for rank in 0..spec.nprocs {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (name, value) in NO_MULTICAST {
            if std::env::var_os(name).is_none() {
                cmd.env(name, value);
            }
        }
        let n = spec.nprocs.to_string();
        cmd.env("MOEFUSE_RANK", rank.to_string())
            .env("MOEFUSE_WORLD_SIZE", &n)
            .env("MOEFUSE_LOCAL_RANK", rank.to_string())
            .env("MOEFUSE_LOCAL_WORLD_SIZE", &n)
            .env("MOEFUSE_RENDEZVOUS", server.addr().to_string())
            .env("MOEFUSE_RENDEZVOUS_TOKEN", token.as_str())
            .env("MOEFUSE_JOB_ID", &job_id)
            .env("CUDA_VISIBLE_DEVICES", &gpus[rank % gpus.len()])
            .envs(spec.env.iter().map(|(k, v)| (k, v)));
        let mut child = cmd.spawn().map_err(|e| {
            err(format!(
                "cannot start {:?} for rank {rank}: {e}",
                spec.program
            ))
        })?;
        forward(
            rank,
            OutputStream::Stdout,
            child.stdout.take().expect("piped"),
            &tx,
        );
        forward(
            rank,
            OutputStream::Stderr,
            child.stderr.take().expect("piped"),
            &tx,
        );
        ranks.0.push(Some(child));
    }
    drop(tx);
    on_event(LaunchEvent::Started {
        rendezvous: server.addr(),
        job_id,
    });

    let deadline = spec.timeout.map(|t| Instant::now() + t);
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut kill_at: Option<Instant> = None;
    let mut timed_out: Option<Vec<usize>> = None;
    let mut killing = false;
    let mut exits = Vec::new();
    while !ranks.running().is_empty() {
        match rx.recv_timeout(POLL) {
            Ok(event) => on_event(event),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => thread::sleep(POLL),
        }
        for rank in ranks.running() {
            let child = ranks.0[rank].as_mut().expect("running");
            let status = child
                .try_wait()
                .map_err(|e| err(format!("waiting for rank {rank}: {e}")))?;
            if let Some(status) = status {
                ranks.0[rank] = None;
                exits.push(LaunchEvent::Exited { rank, status });
                if !status.success() && !killing && failure.is_none() {
                    failure = Some((rank, status));
                    kill_at = Some(Instant::now() + spec.grace);
                }
            }
        }
        let now = Instant::now();
        if timed_out.is_none() && deadline.is_some_and(|d| now >= d) {
            timed_out = Some(ranks.running());
            (killing, kill_at) = (true, Some(now));
        }
        if kill_at.is_some_and(|k| now >= k) {
            (killing, kill_at) = (true, None);
            ranks.kill_all();
        }
        exits.drain(..).for_each(&mut on_event);
    }
    // Output still in the pipes; a grandchild holding a pipe open does not hold us long.
    let drain_until = Instant::now() + Duration::from_secs(1);
    while let Ok(event) = rx.recv_timeout(drain_until.saturating_duration_since(Instant::now())) {
        on_event(event);
    }
    match (failure, timed_out) {
        (Some((rank, status)), _) => Err(LaunchError::RankFailed {
            rank,
            world_size: spec.nprocs,
            status: status.to_string(),
        }),
        (None, Some(running)) => Err(LaunchError::LaunchTimeout {
            secs: spec.timeout.unwrap_or_default().as_secs(),
            running,
        }),
        (None, None) => Ok(()),
    }
}
