//! CPU tests of the process bootstrap: launch-variable parsing, the rendezvous protocol (its
//! token, caps and timeouts), and whole launches of this test binary as N ranks
//! (`rank_child` is a rank's body; in the parent test run it returns at once).

use moefuse_launch::{
    broadcast_from_rank0, exchange_unique_id, launch, LaunchEnv, LaunchError, LaunchEvent,
    LaunchSpec, OutputStream, Rendezvous, RendezvousServer, ServerLimits, Token,
};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn env_of(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, LaunchError> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LaunchEnv::from_lookup(|k| map.get(k).cloned())
}

fn launched(vars: &[(&str, &str)]) -> LaunchEnv {
    env_of(vars)
        .unwrap_or_else(|e| panic!("{vars:?}: {e}"))
        .unwrap_or_else(|| panic!("{vars:?}: not launched"))
}

/// A server with a fresh token (kept beside it for the clients).
struct Server {
    inner: RendezvousServer,
    token: Token,
}

impl Server {
    fn addr(&self) -> std::net::SocketAddr {
        self.inner.addr()
    }
}

fn server() -> Server {
    server_with(ServerLimits::default())
}

fn server_with(limits: ServerLimits) -> Server {
    let token = Token::generate().unwrap();
    let inner = RendezvousServer::start_with("127.0.0.1:0", token.clone(), limits).unwrap();
    Server { inner, token }
}

fn connect(server: &Server) -> Rendezvous {
    Rendezvous::connect(server.addr(), &server.token).unwrap()
}

fn hex_id(tag: &str) -> String {
    let hex: String = tag.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{hex:0>256}")
}

// ---- launch variables ----

#[test]
fn not_launched_is_none() {
    assert_eq!(env_of(&[]).unwrap(), None);
    assert_eq!(
        env_of(&[("MOEFUSE_RANK", ""), ("WORLD_SIZE", "4")]).unwrap(),
        None
    );
}

#[test]
fn moefuse_variables() {
    let env = launched(&[
        ("MOEFUSE_RANK", "5"),
        ("MOEFUSE_WORLD_SIZE", "8"),
        ("MOEFUSE_LOCAL_RANK", "1"),
        ("MOEFUSE_LOCAL_WORLD_SIZE", "4"),
        ("MOEFUSE_RENDEZVOUS", "127.0.0.1:4567"),
        ("MOEFUSE_RENDEZVOUS_TOKEN", &"5a".repeat(16)),
        ("MOEFUSE_JOB_ID", "job7"),
        ("RANK", "0"), // ours win over torchrun's
    ]);
    assert_eq!(
        (
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size
        ),
        (5, 8, 1, 4)
    );
    assert_eq!(env.rendezvous(), Some("127.0.0.1:4567".parse().unwrap()));
    assert_eq!((env.job_id(), env.unique_id()), ("job7", None));
}

#[test]
fn local_ranks_default_to_global_ones() {
    let env = launched(&[("MOEFUSE_RANK", "2"), ("MOEFUSE_WORLD_SIZE", "3")]);
    assert_eq!((env.local_rank, env.local_world_size), (2, 3));
    assert_eq!((env.job_id(), env.rendezvous()), ("default", None));
}

#[test]
fn torchrun_variables_with_a_given_id() {
    let id = hex_id("torch");
    let env = launched(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MOEFUSE_UNIQUE_ID", &id),
    ]);
    assert_eq!(
        (
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size
        ),
        (3, 4, 1, 2)
    );
    assert_eq!(env.unique_id(), Some(id.as_str()));
}

#[test]
fn malformed_values_name_the_variable() {
    let r = ("MOEFUSE_RANK", "0");
    let w = ("MOEFUSE_WORLD_SIZE", "2");
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("MOEFUSE_RANK", "x"), w], "MOEFUSE_RANK"),
        (&[r, ("MOEFUSE_WORLD_SIZE", "-1")], "MOEFUSE_WORLD_SIZE"),
        (&[r], "MOEFUSE_WORLD_SIZE"),
        (
            &[("MOEFUSE_RANK", "2"), w],
            "MOEFUSE_RANK=2 is outside MOEFUSE_WORLD_SIZE=2",
        ),
        (&[r, w, ("MOEFUSE_LOCAL_RANK", "2")], "MOEFUSE_LOCAL_RANK"),
        (
            &[r, w, ("MOEFUSE_LOCAL_WORLD_SIZE", "3")],
            "MOEFUSE_LOCAL_WORLD_SIZE",
        ),
        (
            &[r, w, ("MOEFUSE_RENDEZVOUS", "no port")],
            "MOEFUSE_RENDEZVOUS",
        ),
        (&[r, w, ("MOEFUSE_JOB_ID", "a b")], "MOEFUSE_JOB_ID"),
        (&[r, w, ("MOEFUSE_UNIQUE_ID", "xyz")], "MOEFUSE_UNIQUE_ID"),
        (&[("RANK", "1"), ("WORLD_SIZE", "one")], "WORLD_SIZE"),
    ];
    for (vars, named) in cases {
        match env_of(vars) {
            Err(LaunchError::Bootstrap(msg)) => {
                assert!(
                    msg.contains(named),
                    "{vars:?}: `{msg}` does not name {named}"
                )
            }
            other => panic!("{vars:?}: expected a Bootstrap error, got {other:?}"),
        }
    }
}

// ---- the rendezvous protocol ----

#[test]
fn set_then_get_on_one_connection() {
    let server = server();
    let mut client = connect(&server);
    client.set("j/a", "1").unwrap();
    client.set("j/spaces", " two  words ").unwrap();
    client.set("j/empty", "").unwrap();
    let second = Duration::from_secs(1);
    assert_eq!(client.get("j/a", second).unwrap(), "1");
    assert_eq!(client.get("j/spaces", second).unwrap(), " two  words ");
    assert_eq!(client.get("j/empty", second).unwrap(), "");
    let mut other = connect(&server);
    assert_eq!(other.get("j/a", second).unwrap(), "1");
}

#[test]
fn get_waits_for_a_later_set() {
    let server = server();
    let (addr, token) = (server.addr(), server.token.clone());
    let waiter = std::thread::spawn(move || {
        Rendezvous::connect(addr, &token)
            .unwrap()
            .get("j/late", Duration::from_secs(20))
    });
    std::thread::sleep(Duration::from_millis(200));
    connect(&server).set("j/late", "here").unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), "here");
}

#[test]
fn errors_name_the_address_the_key_and_the_reason() {
    let server = server();
    let addr = server.addr().to_string();
    let mut client = connect(&server);
    let t0 = Instant::now();
    let missing = client
        .get("j/never", Duration::from_millis(100))
        .unwrap_err()
        .to_string();
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "returned early: {missing}"
    );
    for part in [addr.as_str(), "GET j/never", "not set within 100 ms"] {
        assert!(missing.contains(part), "`{missing}` lacks `{part}`");
    }
    client.set("j/once", "a").unwrap();
    let again = client.set("j/once", "b").unwrap_err().to_string();
    assert!(
        again.contains("SET j/once") && again.contains("write-once"),
        "{again}"
    );
    assert_eq!(client.get("j/once", Duration::from_secs(1)).unwrap(), "a");
    for (key, value) in [("", "v"), ("a b", "v"), ("k", "two\nlines")] {
        let e = client.set(key, value).unwrap_err();
        assert!(
            matches!(e, LaunchError::Bootstrap(_)),
            "{key:?}={value:?}: {e}"
        );
    }
    // The connection still works after refused requests.
    assert_eq!(client.get("j/once", Duration::from_secs(1)).unwrap(), "a");
}

#[test]
fn malformed_requests_get_an_err_line() {
    let server = server();
    let mut stream = TcpStream::connect(server.addr()).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    writeln!(stream, "AUTH {}", server.token.as_str()).unwrap();
    let mut answer = String::new();
    reader.read_line(&mut answer).unwrap();
    assert_eq!(answer, "OK\n");
    for request in ["HELLO", "GET", "GET k soon", "SET", "set k v", "AUTH again"] {
        writeln!(stream, "{request}").unwrap();
        let mut answer = String::new();
        reader.read_line(&mut answer).unwrap();
        assert!(answer.starts_with("ERR "), "{request:?} got {answer:?}");
    }
    writeln!(stream, "SET k v\r").unwrap(); // CRLF clients work too
    let mut answer = String::new();
    reader.read_line(&mut answer).unwrap();
    assert_eq!(answer, "OK\n");
}

#[test]
fn dropping_the_server_ends_pending_gets() {
    let server = server();
    let mut client = connect(&server);
    let waiter = std::thread::spawn(move || client.get("j/never", Duration::from_secs(60)));
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    drop(server);
    let e = waiter.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("stopped"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

// ---- the rendezvous's token, caps and timeouts ----

/// Sends raw lines on a fresh connection and returns each answer ("" at end of stream).
fn raw(server: &Server, lines: &[String]) -> Vec<String> {
    let mut stream = TcpStream::connect(server.addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut answers = Vec::new();
    for line in lines {
        if writeln!(stream, "{line}").is_err() {
            answers.push(String::new());
            continue;
        }
        let mut answer = String::new();
        let _ = reader.read_line(&mut answer);
        answers.push(answer.trim_end().to_string());
    }
    answers
}

#[test]
fn a_client_without_the_token_can_neither_read_nor_write() {
    let server = server();
    connect(&server)
        .set("job/nvshmem-unique-id/0", "00ff")
        .unwrap();
    // Before the fix anyone on the host could GET the id or pre-SET another job's key.
    let wrong = Token::generate().unwrap();
    let e = Rendezvous::connect(server.addr(), &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("authentication failed"), "{e}");
    let answers = raw(
        &server,
        &[
            "GET job/nvshmem-unique-id/0 10".into(),
            "SET job/x 1".into(),
        ],
    );
    assert!(
        answers[0].starts_with("ERR authentication failed"),
        "{answers:?}"
    );
    assert_eq!(
        answers[1], "",
        "the connection must close after a failed AUTH: {answers:?}"
    );
    let answers = raw(
        &server,
        &[format!("AUTH {}", wrong.as_str()), "SET job/x 1".into()],
    );
    assert!(answers[0].starts_with("ERR"), "{answers:?}");
    assert_eq!(answers[1], "", "{answers:?}");
    // The right token, in another case, works; nothing was written by the others.
    let upper = Token::parse(&server.token.as_str().to_ascii_uppercase()).unwrap();
    let mut ok = Rendezvous::connect(server.addr(), &upper).unwrap();
    assert!(ok.get("job/x", Duration::from_millis(10)).is_err());
    assert_eq!(
        ok.get("job/nvshmem-unique-id/0", Duration::from_secs(1))
            .unwrap(),
        "00ff"
    );
}

#[test]
fn a_rendezvous_address_needs_its_token() {
    let r = ("MOEFUSE_RANK", "0");
    let w = ("MOEFUSE_WORLD_SIZE", "2");
    match env_of(&[r, w, ("MOEFUSE_RENDEZVOUS", "127.0.0.1:4567")]) {
        Err(LaunchError::Bootstrap(msg)) => {
            assert!(msg.contains("MOEFUSE_RENDEZVOUS_TOKEN"), "{msg}")
        }
        other => panic!("a rendezvous without a token was accepted: {other:?}"),
    }
    match env_of(&[r, w, ("MOEFUSE_RENDEZVOUS_TOKEN", "abc")]) {
        Err(LaunchError::Bootstrap(msg)) => assert!(msg.contains("32 to 128 hex"), "{msg}"),
        other => panic!("a malformed token was accepted: {other:?}"),
    }
}

#[test]
fn connections_beyond_the_cap_are_refused_and_seats_come_back() {
    let server = server_with(ServerLimits {
        max_connections: 2,
        ..Default::default()
    });
    let a = connect(&server);
    let b = connect(&server);
    assert_eq!(server.inner.connections(), 2);
    let e = Rendezvous::connect(server.addr(), &server.token)
        .unwrap_err()
        .to_string();
    assert!(e.contains("too many connections"), "{e}");
    drop((a, b));
    let t0 = Instant::now();
    while server.inner.connections() > 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = connect(&server);
    c.set("j/after", "1").unwrap();
}

#[test]
fn silent_connections_are_closed() {
    let server = server_with(ServerLimits {
        auth_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(500),
        ..Default::default()
    });
    // Never authenticates: closed after auth_timeout (before the fix: a thread forever).
    let t0 = Instant::now();
    let mut silent = TcpStream::connect(server.addr()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut silent, &mut rest);
    assert!(rest.starts_with("ERR authentication failed"), "{rest:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Authenticated, then idle: closed after idle_timeout.
    let mut idle = connect(&server);
    std::thread::sleep(Duration::from_millis(1200));
    let e = idle.set("j/late", "1").unwrap_err().to_string();
    assert!(
        e.contains("closed") || e.contains("reset") || e.contains("pipe"),
        "{e}"
    );
    let t0 = Instant::now();
    while server.inner.connections() > 0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(server.inner.connections(), 0);
}

#[test]
fn the_store_and_waits_are_bounded() {
    let server = server_with(ServerLimits {
        max_keys: 2,
        max_bytes: 64,
        max_wait: Duration::from_millis(200),
        ..Default::default()
    });
    let mut c = connect(&server);
    c.set("j/a", "1").unwrap();
    let e = c.set("j/big", &"x".repeat(100)).unwrap_err().to_string();
    assert!(e.contains("full"), "{e}");
    c.set("j/b", "2").unwrap();
    let e = c.set("j/c", "3").unwrap_err().to_string();
    assert!(e.contains("full"), "{e}");
    // A GET asking for an hour waits max_wait.
    let t0 = Instant::now();
    let e = c
        .get("j/never", Duration::from_secs(3600))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not set within 200 ms"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

// ---- the id exchange ----

#[test]
fn a_given_id_needs_no_rendezvous() {
    let id = hex_id("given");
    let env = launched(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MOEFUSE_UNIQUE_ID", &id),
    ]);
    let got = exchange_unique_id::<LaunchError>(&env, || panic!("no id is made when one is given"))
        .unwrap();
    assert_eq!(got, id);
}

#[test]
fn one_rank_alone_makes_its_own_id() {
    let env = launched(&[("MOEFUSE_RANK", "0"), ("MOEFUSE_WORLD_SIZE", "1")]);
    assert_eq!(
        exchange_unique_id(&env, || Ok::<_, LaunchError>(hex_id("solo"))).unwrap(),
        hex_id("solo")
    );
    let bad = exchange_unique_id(&env, || Ok::<_, LaunchError>("not hex".into()))
        .unwrap_err()
        .to_string();
    assert!(bad.contains("not hex digits"), "{bad}");
}

#[test]
fn several_ranks_without_a_rendezvous_are_told_what_to_set() {
    let env = launched(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
    let e = exchange_unique_id::<LaunchError>(&env, || panic!("rank 1 makes no id"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("MOEFUSE_UNIQUE_ID") && e.contains("cargo xtask launch"),
        "{e}"
    );
}

#[test]
fn ranks_in_threads_receive_rank_0s_value() {
    let server = server();
    let addr = server.addr().to_string();
    let token = server.token.as_str().to_string();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            let (addr, token) = (addr.clone(), token.clone());
            std::thread::spawn(move || {
                let r = rank.to_string();
                let vars = [
                    ("MOEFUSE_RANK", r.as_str()),
                    ("MOEFUSE_WORLD_SIZE", "4"),
                    ("MOEFUSE_RENDEZVOUS", addr.as_str()),
                    ("MOEFUSE_RENDEZVOUS_TOKEN", token.as_str()),
                    ("MOEFUSE_JOB_ID", "threads"),
                ];
                let env = launched(&vars);
                broadcast_from_rank0(&env, "value", || {
                    assert_eq!(rank, 0, "only rank 0 makes the value");
                    Ok::<_, LaunchError>("from rank 0".into())
                })
            })
        })
        .collect();
    for (rank, handle) in ranks.into_iter().enumerate() {
        assert_eq!(
            handle.join().unwrap().unwrap(),
            "from rank 0",
            "rank {rank}"
        );
    }
}

// ---- whole launches: this binary's `rank_child` test as N ranks ----

/// A rank's body, run when a launch below starts this binary with MOEFUSE_TEST_CHILD=1:
/// two exchanges (as two NVSHMEM inits in one process would), one line of results, then
/// exit 0, or 3 on the rank named by MOEFUSE_TEST_FAIL, or hang on MOEFUSE_TEST_HANG's.
#[test]
fn rank_child() {
    if std::env::var_os("MOEFUSE_TEST_CHILD").is_none() {
        return;
    }
    let env = LaunchEnv::from_env().unwrap().expect("started by launch");
    let first = exchange_unique_id(&env, || {
        Ok::<_, LaunchError>(hex_id(&format!("{}a", env.job_id())))
    })
    .unwrap();
    let second = exchange_unique_id(&env, || {
        Ok::<_, LaunchError>(hex_id(&format!("{}b", env.job_id())))
    })
    .unwrap();
    let var = |name| std::env::var(name).unwrap_or_default();
    println!(
        "RESULT {} {} {} {} {first} {second}",
        env.rank,
        env.world_size,
        var("CUDA_VISIBLE_DEVICES"),
        var("NVSHMEM_DISABLE_NVLS"),
    );
    eprintln!("rank {} says goodbye on stderr", env.rank);
    let rank = Some(env.rank.to_string());
    if std::env::var("MOEFUSE_TEST_HANG").ok() == rank {
        std::thread::sleep(Duration::from_secs(600));
    }
    std::process::exit(if std::env::var("MOEFUSE_TEST_FAIL").ok() == rank {
        3
    } else {
        0
    });
}

/// Launches `n` ranks of `rank_child` with extra variables; returns the result and events.
fn launch_children(
    n: usize,
    vars: &[(&str, &str)],
    adjust: impl FnOnce(&mut LaunchSpec),
) -> (Result<(), LaunchError>, Vec<LaunchEvent>) {
    let exe = std::env::current_exe().unwrap();
    let mut spec = LaunchSpec::new(
        n,
        exe,
        ["--exact", "rank_child", "--nocapture", "--test-threads=1"],
    );
    spec.env.push(("MOEFUSE_TEST_CHILD".into(), "1".into()));
    for (k, v) in vars {
        spec.env.push((k.into(), v.into()));
    }
    spec.timeout = Some(Duration::from_secs(120));
    adjust(&mut spec);
    let mut events = Vec::new();
    let result = launch(&spec, |e| events.push(e));
    (result, events)
}

/// Each rank's `RESULT` fields after the rank.
fn results(events: &[LaunchEvent]) -> BTreeMap<usize, Vec<String>> {
    let mut out = BTreeMap::new();
    for event in events {
        if let LaunchEvent::Output {
            rank,
            stream: OutputStream::Stdout,
            line,
        } = event
        {
            // libtest writes `test rank_child ... ` before the child's own output.
            if let Some((_, rest)) = line.split_once("RESULT ") {
                let fields: Vec<String> = rest.split(' ').map(String::from).collect();
                assert_eq!(fields[0], rank.to_string(), "rank {rank} printed {line:?}");
                assert!(
                    out.insert(*rank, fields[1..].to_vec()).is_none(),
                    "rank {rank} twice"
                );
            }
        }
    }
    out
}

#[test]
fn three_ranks_agree_on_one_id() {
    let (result, events) = launch_children(3, &[], |spec| spec.gpus = Some(2));
    result.unwrap_or_else(|e| panic!("{e}; events: {events:#?}"));
    assert!(
        matches!(events[0], LaunchEvent::Started { .. }),
        "{:?}",
        events[0]
    );
    let got = results(&events);
    assert_eq!(
        got.keys().copied().collect::<Vec<_>>(),
        [0, 1, 2],
        "{events:#?}"
    );
    let parent_cvd = std::env::var("CUDA_VISIBLE_DEVICES").is_ok();
    let parent_nvls = std::env::var("NVSHMEM_DISABLE_NVLS").is_ok();
    for (rank, f) in &got {
        let (world, cvd, nvls, first, second) = (&f[0], &f[1], &f[2], &f[3], &f[4]);
        assert_eq!(world, "3", "rank {rank}");
        if !parent_cvd {
            assert_eq!(
                *cvd,
                (rank % 2).to_string(),
                "rank {rank}: CUDA_VISIBLE_DEVICES"
            );
        }
        if !parent_nvls {
            assert_eq!(nvls, "1", "rank {rank}: NVSHMEM_DISABLE_NVLS");
        }
        assert_eq!(first.len(), 256, "rank {rank}: {first}");
        assert_eq!(
            first, &got[&0][3],
            "rank {rank}: first id differs from rank 0's"
        );
        assert_eq!(
            second, &got[&0][4],
            "rank {rank}: second id differs from rank 0's"
        );
        assert_ne!(first, second, "rank {rank}: both exchanges gave one id");
    }
    for rank in 0..3 {
        let said_goodbye = events.iter().any(|e| {
            matches!(e, LaunchEvent::Output { rank: r, stream: OutputStream::Stderr, line }
                if *r == rank && line.contains("goodbye"))
        });
        let exited_0 = events.iter().any(|e| {
            matches!(e, LaunchEvent::Exited { rank: r, status } if *r == rank && status.success())
        });
        assert!(said_goodbye && exited_0, "rank {rank}: {events:#?}");
    }
}

#[test]
fn a_failing_rank_fails_the_launch_and_is_named() {
    let (result, events) = launch_children(3, &[("MOEFUSE_TEST_FAIL", "1")], |_| {});
    match result {
        Err(LaunchError::RankFailed {
            rank: 1,
            world_size: 3,
            status,
        }) => {
            assert!(status.contains('3'), "{status}")
        }
        other => panic!("expected rank 1 to fail, got {other:?}; events: {events:#?}"),
    }
    assert_eq!(
        results(&events).len(),
        3,
        "every rank got through the exchange"
    );
}

#[test]
fn a_failure_stops_the_ranks_still_running() {
    let t0 = Instant::now();
    let vars = [("MOEFUSE_TEST_FAIL", "2"), ("MOEFUSE_TEST_HANG", "0")];
    let (result, events) =
        launch_children(3, &vars, |spec| spec.grace = Duration::from_millis(200));
    assert!(
        matches!(result, Err(LaunchError::RankFailed { rank: 2, .. })),
        "{result:?}; events: {events:#?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn the_timeout_kills_every_rank() {
    let t0 = Instant::now();
    let (result, events) = launch_children(2, &[("MOEFUSE_TEST_HANG", "0")], |spec| {
        spec.timeout = Some(Duration::from_secs(2))
    });
    match result {
        Err(LaunchError::LaunchTimeout { secs: 2, running }) => assert_eq!(running, [0]),
        other => panic!("expected a timeout, got {other:?}; events: {events:#?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_program_that_cannot_start_is_named() {
    let spec = LaunchSpec::new(2, "/nonexistent/moefuse-rank", ["x"]);
    match launch(&spec, |_| {}) {
        Err(LaunchError::Bootstrap(msg)) => {
            assert!(
                msg.contains("/nonexistent/moefuse-rank") && msg.contains("rank 0"),
                "{msg}"
            )
        }
        other => panic!("expected a Bootstrap error, got {other:?}"),
    }
}

/// Alive and not a zombie (a zombie waits for a reaper that is not ours).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit_once(')')
            .unwrap()
            .1
            .trim_start()
            .starts_with('Z')
    })
}

fn wait_gone(pids: &[u32]) -> Vec<u32> {
    let t0 = Instant::now();
    while pids.iter().any(|&p| alive(p)) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    pids.iter().copied().filter(|&p| alive(p)).collect()
}

#[test]
fn killing_a_rank_kills_what_it_started() {
    let mut spec = LaunchSpec::new(1, "sh", ["-c", "sleep 300 & echo $!; wait"]);
    spec.timeout = Some(Duration::from_secs(1));
    let mut pid = None;
    let result = launch(&spec, |e| {
        if let LaunchEvent::Output { line, .. } = e {
            pid = line.trim().parse::<u32>().ok();
        }
    });
    assert!(
        matches!(result, Err(LaunchError::LaunchTimeout { .. })),
        "{result:?}"
    );
    let pid = pid.expect("the rank printed its child's pid");
    assert_eq!(
        wait_gone(&[pid]),
        [] as [u32; 0],
        "sleep {pid}, started by the rank, outlived it"
    );
}

#[test]
fn a_rank_that_keeps_forking_leaves_nothing_behind() {
    // Each loop forks a subshell that forks a sleeper: children appear continuously, the
    // race a single /proc snapshot loses.
    let script = "while :; do (sleep 300 & echo $!; wait) & echo $!; sleep 0.01; done";
    let mut spec = LaunchSpec::new(4, "sh", ["-c", script]);
    spec.timeout = Some(Duration::from_secs(1));
    let mut pids = Vec::new();
    let result = launch(&spec, |e| {
        if let LaunchEvent::Output { line, .. } = e {
            pids.extend(line.trim().parse::<u32>().ok());
        }
    });
    assert!(
        matches!(result, Err(LaunchError::LaunchTimeout { .. })),
        "{result:?}"
    );
    assert!(
        pids.len() > 10,
        "the ranks forked only {} times",
        pids.len()
    );
    let left = wait_gone(&pids);
    assert!(
        left.is_empty(),
        "processes started by the ranks outlived them: {left:?}"
    );
}

#[test]
fn a_launch_has_a_deadline_by_default() {
    let spec = LaunchSpec::new(2, "true", Vec::<String>::new());
    assert_eq!(spec.timeout, Some(moefuse_launch::DEFAULT_LAUNCH_TIMEOUT));
    assert!(moefuse_launch::DEFAULT_LAUNCH_TIMEOUT <= Duration::from_secs(3600));
    launch(&spec, |_| {}).unwrap();
}
