//! CPU tests of the process bootstrap: launch-variable parsing, the rendezvous protocol, and
//! whole launches of this test binary as N ranks (`rank_child` is a rank's body; in the
//! parent test run it returns at once).

use moefuse_comm::{
    broadcast_from_rank0, exchange_unique_id, launch, CommError, LaunchEnv, LaunchEvent,
    LaunchSpec, OutputStream, Rendezvous, RendezvousServer,
};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn env_of(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, CommError> {
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
            Err(CommError::Bootstrap(msg)) => {
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
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let mut client = Rendezvous::connect(server.addr()).unwrap();
    client.set("j/a", "1").unwrap();
    client.set("j/spaces", " two  words ").unwrap();
    client.set("j/empty", "").unwrap();
    let second = Duration::from_secs(1);
    assert_eq!(client.get("j/a", second).unwrap(), "1");
    assert_eq!(client.get("j/spaces", second).unwrap(), " two  words ");
    assert_eq!(client.get("j/empty", second).unwrap(), "");
    let mut other = Rendezvous::connect(server.addr()).unwrap();
    assert_eq!(other.get("j/a", second).unwrap(), "1");
}

#[test]
fn get_waits_for_a_later_set() {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr();
    let waiter = std::thread::spawn(move || {
        Rendezvous::connect(addr)
            .unwrap()
            .get("j/late", Duration::from_secs(20))
    });
    std::thread::sleep(Duration::from_millis(200));
    Rendezvous::connect(addr)
        .unwrap()
        .set("j/late", "here")
        .unwrap();
    assert_eq!(waiter.join().unwrap().unwrap(), "here");
}

#[test]
fn errors_name_the_address_the_key_and_the_reason() {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let mut client = Rendezvous::connect(server.addr()).unwrap();
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
            matches!(e, CommError::Bootstrap(_)),
            "{key:?}={value:?}: {e}"
        );
    }
    // The connection still works after refused requests.
    assert_eq!(client.get("j/once", Duration::from_secs(1)).unwrap(), "a");
}

#[test]
fn malformed_requests_get_an_err_line() {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let mut stream = TcpStream::connect(server.addr()).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    for request in ["HELLO", "GET", "GET k soon", "SET", "set k v"] {
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
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let mut client = Rendezvous::connect(server.addr()).unwrap();
    let waiter = std::thread::spawn(move || client.get("j/never", Duration::from_secs(60)));
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    drop(server);
    let e = waiter.join().unwrap().unwrap_err().to_string();
    assert!(e.contains("stopped"), "{e}");
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
    let got = exchange_unique_id(&env, || panic!("no id is made when one is given")).unwrap();
    assert_eq!(got, id);
}

#[test]
fn one_rank_alone_makes_its_own_id() {
    let env = launched(&[("MOEFUSE_RANK", "0"), ("MOEFUSE_WORLD_SIZE", "1")]);
    assert_eq!(
        exchange_unique_id(&env, || Ok(hex_id("solo"))).unwrap(),
        hex_id("solo")
    );
    let bad = exchange_unique_id(&env, || Ok("not hex".into()))
        .unwrap_err()
        .to_string();
    assert!(bad.contains("not hex digits"), "{bad}");
}

#[test]
fn several_ranks_without_a_rendezvous_are_told_what_to_set() {
    let env = launched(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
    let e = exchange_unique_id(&env, || panic!("rank 1 makes no id"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("MOEFUSE_UNIQUE_ID") && e.contains("cargo xtask launch"),
        "{e}"
    );
}

#[test]
fn ranks_in_threads_receive_rank_0s_value() {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let r = rank.to_string();
                let vars = [
                    ("MOEFUSE_RANK", r.as_str()),
                    ("MOEFUSE_WORLD_SIZE", "4"),
                    ("MOEFUSE_RENDEZVOUS", addr.as_str()),
                    ("MOEFUSE_JOB_ID", "threads"),
                ];
                let env = launched(&vars);
                broadcast_from_rank0(&env, "value", || {
                    assert_eq!(rank, 0, "only rank 0 makes the value");
                    Ok("from rank 0".into())
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
    let first = exchange_unique_id(&env, || Ok(hex_id(&format!("{}a", env.job_id())))).unwrap();
    let second = exchange_unique_id(&env, || Ok(hex_id(&format!("{}b", env.job_id())))).unwrap();
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
) -> (Result<(), CommError>, Vec<LaunchEvent>) {
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
        Err(CommError::RankFailed {
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
        matches!(result, Err(CommError::RankFailed { rank: 2, .. })),
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
        Err(CommError::LaunchTimeout { secs: 2, running }) => assert_eq!(running, [0]),
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
        Err(CommError::Bootstrap(msg)) => {
            assert!(
                msg.contains("/nonexistent/moefuse-rank") && msg.contains("rank 0"),
                "{msg}"
            )
        }
        other => panic!("expected a Bootstrap error, got {other:?}"),
    }
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
        matches!(result, Err(CommError::LaunchTimeout { .. })),
        "{result:?}"
    );
    let pid = pid.expect("the rank printed its child's pid");
    // Gone, or a zombie waiting for a reaper that is not ours.
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            !stat
                .rsplit_once(')')
                .unwrap()
                .1
                .trim_start()
                .starts_with('Z')
        })
    };
    let t0 = Instant::now();
    while alive() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(), "sleep {pid}, started by the rank, outlived it");
}
