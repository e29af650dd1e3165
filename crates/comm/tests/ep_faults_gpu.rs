//! GPU tests of what happens when expert-parallel calls go wrong (issue 15, communication
//! part): no rank may hang, every rank gets a typed error, and the next instance on the
//! same runtime works.
//!
//! With one PE (this process): misaligned operands refused before a launch, epochs that
//! survive a new instance, and a drop that waits for the kernels. With two PEs on the one
//! GPU (this binary relaunched through `moefuse_comm::launch`; each child sees
//! `MOEFUSE_RANK` and runs the scenario named by `MOEFUSE_TEST_SCENARIO`): a local error
//! inside dispatch on rank 1, a peer that never calls, configurations that differ, a
//! `Dispatch` dropped without combine, and a short `out` in combine (also in the pulled
//! exchange's slot combine). Each scenario ends with a new `ExpertParallel` on the same
//! runtime and a checked round trip.
//!
//! ```sh
//! cargo test -p moefuse-comm --test ep_faults_gpu             # SKIPPED without a GPU
//! ```

mod common;

use common::{e, one_pe, relaunch};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse_comm::{CommError, EpConfig, ExpertParallel, LaunchEnv, Library, Runtime};
use moefuse_testkit::{check_close, GpuSuite, Rng, BF16_REL_ERR};
use std::sync::Arc;
use std::time::{Duration, Instant};

const EXPERTS: usize = 16;
const TOP_K: usize = 4;
const HIDDEN: usize = 1024;
const MAX_TOKENS: usize = 512;
const TOKENS: usize = 300;

fn cfg(timeout: Duration) -> EpConfig {
    EpConfig {
        timeout,
        ..EpConfig::new(EXPERTS, TOP_K, HIDDEN, MAX_TOKENS)
    }
}

/// One rank's inputs: random rows, distinct random experts, weights summing to one.
struct Inputs {
    x_host: Vec<bf16>,
    x: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    ws: CudaSlice<f32>,
}

fn inputs(stream: &Arc<CudaStream>, seed: u64, tokens: usize) -> Result<Inputs, String> {
    let mut rng = Rng::new(seed);
    let x_host = rng.bf16_vec(tokens.max(1) * HIDDEN);
    let mut ids = Vec::with_capacity(tokens.max(1) * TOP_K);
    for _ in 0..tokens.max(1) {
        ids.extend(rng.distinct(EXPERTS, TOP_K));
    }
    let ws = vec![1.0 / TOP_K as f32; ids.len()];
    Ok(Inputs {
        x: stream.clone_htod(&x_host).map_err(e)?,
        ids: stream.clone_htod(&ids).map_err(e)?,
        ws: stream.clone_htod(&ws).map_err(e)?,
        x_host,
    })
}

/// A checked round trip with identity experts (`y = received x`): the combined output
/// must equal `x`, since the weights sum to one.
fn roundtrip(ep: &mut ExpertParallel, stream: &Arc<CudaStream>, seed: u64) -> Result<(), String> {
    let what = format!("round trip on rank {} (seed {seed})", ep.rank());
    let input = inputs(stream, seed ^ ep.rank() as u64, TOKENS)?;
    let mut y = stream
        .alloc_zeros::<bf16>(ep.recv_rows_capacity() * HIDDEN)
        .map_err(e)?;
    let mut out = stream.alloc_zeros::<bf16>(TOKENS * HIDDEN).map_err(e)?;
    let d = ep
        .dispatch(&input.x, &input.ids, &input.ws, TOKENS)
        .map_err(|x| format!("{what}: dispatch: {x}"))?;
    stream.memcpy_dtod(d.x(), &mut y).map_err(e)?;
    d.combine(&y, &mut out)
        .map_err(|x| format!("{what}: combine: {x}"))?;
    ep.synchronize().map_err(|x| format!("{what}: {x}"))?;
    let got: Vec<f32> = stream
        .clone_dtoh(&out)
        .map_err(e)?
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let want: Vec<f32> = input.x_host.iter().map(|v| v.to_f32()).collect();
    check_close(&got, &want, BF16_REL_ERR, &what).map(|_| ())
}

// ---- one PE ----

/// A row pointer 2 bytes off its 16-byte alignment would fault the kernels' vector loads
/// and kill the context (and, with peers, hang them): refused with a typed error.
fn misaligned_operands(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let pe = one_pe(ctx)?;
    let stream = &pe.stream;
    let mut ep =
        ExpertParallel::new(&pe.rt, stream, cfg(moefuse_testkit::scaled_secs(5))).map_err(e)?;
    let input = inputs(stream, 7, TOKENS + 1)?;
    let shifted = input.x.slice(1..);
    match ep.dispatch(&shifted, &input.ids, &input.ws, TOKENS) {
        Err(CommError::Misaligned {
            what: "x",
            align: 16,
            ..
        }) => {}
        Err(other) => return Err(format!("misaligned x: expected Misaligned, got {other}")),
        Ok(_) => return Err("a misaligned x was accepted".into()),
    }
    let y = stream
        .alloc_zeros::<bf16>(ep.recv_rows_capacity() * HIDDEN + 8)
        .map_err(e)?;
    let mut out = stream.alloc_zeros::<bf16>(TOKENS * HIDDEN + 8).map_err(e)?;
    let d = ep
        .dispatch(&input.x, &input.ids, &input.ws, TOKENS)
        .map_err(e)?;
    let mut out_view = out.slice_mut(4..);
    match d.combine(&y.slice(0..), &mut out_view) {
        Err(CommError::Misaligned {
            what: "out",
            align: 16,
            ..
        }) => {}
        Err(other) => return Err(format!("misaligned out: expected Misaligned, got {other}")),
        Ok(()) => return Err("a misaligned out was accepted".into()),
    }
    // The context survived and one PE stays usable after a refused call.
    roundtrip(&mut ep, stream, 11)
}

/// A new instance's epochs start above the old one's: before the fix every instance
/// restarted at 0, so a peer's late signal (epoch n) satisfied the new waits for 1..=n.
fn epochs_survive_a_new_instance(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let pe = one_pe(ctx)?;
    let stream = &pe.stream;
    let mut first =
        ExpertParallel::new(&pe.rt, stream, cfg(moefuse_testkit::scaled_secs(5))).map_err(e)?;
    let start = first.epoch().map_err(e)?;
    for i in 0..3 {
        roundtrip(&mut first, stream, 20 + i)?;
    }
    let end = first.epoch().map_err(e)?;
    if end != start + 3 {
        return Err(format!("3 calls moved the epoch from {start} to {end}"));
    }
    drop(first);
    let mut second =
        ExpertParallel::new(&pe.rt, stream, cfg(moefuse_testkit::scaled_secs(5))).map_err(e)?;
    let base = second.epoch().map_err(e)?;
    if base < end {
        return Err(format!(
            "the new instance starts at epoch {base}, below the old one's last ({end})"
        ));
    }
    roundtrip(&mut second, stream, 30)?;
    if second.epoch().map_err(e)? != base + 1 {
        return Err("the new instance's first call did not take the next epoch".into());
    }
    Ok(())
}

/// Dropping the instance waits for the kernels that use its symmetric memory (before the
/// fix it freed them at once, under the running kernels).
fn drop_waits_for_the_kernels(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys::CUevent_flags;
    let pe = one_pe(ctx)?;
    let stream = &pe.stream;
    let big = EpConfig {
        max_tokens: 8192,
        ..cfg(moefuse_testkit::scaled_secs(5))
    };
    let mut ep = ExpertParallel::new(&pe.rt, stream, big).map_err(e)?;
    let mut rng = Rng::new(5);
    let tokens = 8192;
    let x = stream
        .clone_htod(&rng.bf16_vec(tokens * HIDDEN))
        .map_err(e)?;
    let ids: Vec<i32> = (0..tokens)
        .flat_map(|_| rng.distinct(EXPERTS, TOP_K))
        .collect();
    let ids = stream.clone_htod(&ids).map_err(e)?;
    let ws = stream
        .clone_htod(&vec![0.25f32; tokens * TOP_K])
        .map_err(e)?;
    let y = stream
        .alloc_zeros::<bf16>(ep.recv_rows_capacity() * HIDDEN)
        .map_err(e)?;
    let mut out = stream.alloc_zeros::<bf16>(tokens * HIDDEN).map_err(e)?;
    for _ in 0..4 {
        let d = ep.dispatch(&x, &ids, &ws, tokens).map_err(e)?;
        d.combine(&y, &mut out).map_err(e)?;
    }
    let queued = stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(e)?;
    drop(ep);
    if !queued.is_complete() {
        return Err(
            "ExpertParallel was dropped (its memory freed) before its kernels ended".into(),
        );
    }
    Ok(())
}

// ---- two PEs ----

/// Launches this binary as 2 ranks running `scenario`.
fn two_pes(scenario: &str) -> Result<(), String> {
    relaunch(
        2,
        moefuse_testkit::scaled_secs(120),
        ("MOEFUSE_TEST_SCENARIO", scenario.to_string()),
        &format!("2 PEs, {scenario}"),
    )
}

/// What a rank of `two_pes` works with.
struct Rank {
    rt: Arc<Runtime>,
    stream: Arc<CudaStream>,
    me: usize,
}

impl Rank {
    fn join() -> Result<Self, String> {
        let env = LaunchEnv::from_env().map_err(e)?.ok_or("not launched")?;
        let ctx = CudaContext::new(0).map_err(e)?;
        // SAFETY: one stream for every buffer of the rank.
        unsafe { ctx.disable_event_tracking() };
        let lib = Library::load(None).map_err(e)?;
        let rt = Runtime::join_launched(&lib, &ctx, &env).map_err(e)?;
        let stream = ctx.new_stream().map_err(e)?;
        Ok(Rank {
            rt,
            stream,
            me: env.rank,
        })
    }

    fn ep(&self, cfg: EpConfig) -> Result<ExpertParallel, String> {
        ExpertParallel::new(&self.rt, &self.stream, cfg)
            .map_err(|x| format!("rank {}: new: {x}", self.me))
    }

    /// The acceptance of every scenario: a new instance on the same runtime works.
    fn next_layer_works(&self, old_epoch: u64) -> Result<(), String> {
        let mut ep = self.ep(cfg(moefuse_testkit::scaled_secs(10)))?;
        let base = ep.epoch().map_err(e)?;
        if base < old_epoch {
            return Err(format!(
                "rank {}: new epoch base {base} < old epoch {old_epoch}",
                self.me
            ));
        }
        roundtrip(&mut ep, &self.stream, 99)?;
        roundtrip(&mut ep, &self.stream, 100)?;
        println!(
            "rank {}: the next layer works (epochs from {base})",
            self.me
        );
        Ok(())
    }
}

/// Checks that `got` is the typed error a peer failure gives, naming `peer`, and came
/// within `limit`.
fn peer_failure(
    got: Result<(), CommError>,
    peer: usize,
    t0: Instant,
    limit: Duration,
) -> Result<String, String> {
    let waited = t0.elapsed();
    let named = match &got {
        Err(CommError::PeerAborted { peer: p, .. })
        | Err(CommError::PeerTimeout { peer: p, .. }) => *p,
        other => {
            return Err(format!(
                "expected PeerAborted/PeerTimeout naming rank {peer}, got {other:?}"
            ))
        }
    };
    if named != peer {
        return Err(format!("the error names rank {named}, not {peer}: {got:?}"));
    }
    if waited > limit {
        return Err(format!(
            "the error came after {waited:?}, past {limit:?}: {got:?}"
        ));
    }
    Ok(format!("{} after {waited:?}", got.unwrap_err()))
}

/// Rank 1 fails inside dispatch (more tokens than the capacity): both ranks get a typed
/// error within the deadline, and both go on with a new instance.
fn peer_error_in_dispatch(rank: &Rank) -> Result<(), String> {
    let timeout = moefuse_testkit::scaled_secs(5);
    let mut ep = rank.ep(cfg(timeout))?;
    roundtrip(&mut ep, &rank.stream, 1)?;
    let t0 = Instant::now();
    if rank.me == 1 {
        let big = inputs(&rank.stream, 2, MAX_TOKENS + 1)?;
        match ep.dispatch(&big.x, &big.ids, &big.ws, MAX_TOKENS + 1) {
            Err(CommError::Capacity { .. }) => {}
            Err(other) => return Err(format!("rank 1: expected Capacity, got {other}")),
            Ok(_) => return Err("rank 1: an over-capacity dispatch was accepted".into()),
        }
        match ep.synchronize() {
            Err(CommError::Poisoned { .. }) => {}
            other => {
                return Err(format!(
                    "rank 1 after its abort: expected Poisoned, got {other:?}"
                ))
            }
        }
    } else {
        let input = inputs(&rank.stream, 3, TOKENS)?;
        let d = ep
            .dispatch(&input.x, &input.ids, &input.ws, TOKENS)
            .map_err(e)?;
        let got = d.received_rows().map(|_| ());
        println!("rank 0: {}", peer_failure(got, 1, t0, timeout)?);
    }
    // Both: the instance refuses further calls with a typed error, at once.
    let input = inputs(&rank.stream, 4, TOKENS)?;
    if ep.dispatch(&input.x, &input.ids, &input.ws, TOKENS).is_ok() {
        return Err(format!(
            "rank {}: a failed instance accepted another dispatch",
            rank.me
        ));
    }
    let old = ep.epoch().map_err(e)?;
    drop(ep);
    rank.next_layer_works(old)
}

/// Rank 1 never makes the call (a dead or stuck peer): rank 0 gets PeerTimeout after the
/// deadline, not a hang.
fn dead_peer(rank: &Rank) -> Result<(), String> {
    let timeout = moefuse_testkit::scaled_secs(2);
    let mut ep = rank.ep(cfg(timeout))?;
    if rank.me == 1 {
        std::thread::sleep(2 * timeout + moefuse_testkit::scaled_secs(1));
    } else {
        let input = inputs(&rank.stream, 5, TOKENS)?;
        let t0 = Instant::now();
        let d = ep
            .dispatch(&input.x, &input.ids, &input.ws, TOKENS)
            .map_err(e)?;
        let got = d.received_rows().map(|_| ());
        if !matches!(got, Err(CommError::PeerTimeout { .. })) {
            return Err(format!("rank 0: expected PeerTimeout, got {got:?}"));
        }
        if t0.elapsed() < timeout {
            return Err(format!(
                "rank 0 gave up after {:?}, before the deadline",
                t0.elapsed()
            ));
        }
        println!(
            "rank 0: {}",
            peer_failure(got, 1, t0, timeout + moefuse_testkit::scaled_secs(5))?
        );
    }
    let old = ep.epoch().map_err(e)?;
    drop(ep);
    rank.next_layer_works(old)
}

/// Rank 1 sizes its buffers for twice the tokens: before the fix rank 0's writes would
/// land past rank 1's buffers (or the reverse); now both get ConfigMismatch.
fn config_mismatch(rank: &Rank) -> Result<(), String> {
    let mut mine = cfg(moefuse_testkit::scaled_secs(5));
    if rank.me == 1 {
        mine.max_tokens *= 2;
    }
    match ExpertParallel::new(&rank.rt, &rank.stream, mine) {
        Err(CommError::ConfigMismatch { peer, .. }) if peer == 1 - rank.me => {}
        Err(other) => {
            return Err(format!(
                "rank {}: expected ConfigMismatch, got {other}",
                rank.me
            ))
        }
        Ok(_) => {
            return Err(format!(
                "rank {}: mismatched configurations were accepted",
                rank.me
            ))
        }
    }
    // An invalid configuration on one rank: that rank gets Config, its peer ConfigMismatch.
    let mut mine = cfg(moefuse_testkit::scaled_secs(5));
    if rank.me == 1 {
        mine.hidden = 1030;
    }
    match (rank.me, ExpertParallel::new(&rank.rt, &rank.stream, mine)) {
        (1, Err(CommError::Config { what: "hidden", .. })) => {}
        (0, Err(CommError::ConfigMismatch { peer: 1, .. })) => {}
        (me, other) => {
            return Err(format!(
                "rank {me}: invalid hidden on rank 1: {:?}",
                other.map(|_| ())
            ))
        }
    }
    rank.next_layer_works(0)
}

/// Rank 1 abandons the combine (`short_out`: an `out` too short; otherwise: the Dispatch
/// dropped without combine): rank 0's combine ends with PeerAborted, not a hang.
fn bad_combine(rank: &Rank, short_out: bool) -> Result<(), String> {
    let timeout = moefuse_testkit::scaled_secs(5);
    let mut ep = rank.ep(cfg(timeout))?;
    let input = inputs(&rank.stream, 6 + rank.me as u64, TOKENS)?;
    let y = rank
        .stream
        .alloc_zeros::<bf16>(ep.recv_rows_capacity() * HIDDEN)
        .map_err(e)?;
    let t0 = Instant::now();
    let d = ep
        .dispatch(&input.x, &input.ids, &input.ws, TOKENS)
        .map_err(e)?;
    if rank.me == 1 {
        if short_out {
            let mut out = rank.stream.alloc_zeros::<bf16>(HIDDEN).map_err(e)?;
            match d.combine(&y, &mut out) {
                Err(CommError::BufferTooSmall { what: "out", .. }) => {}
                other => return Err(format!("rank 1: short out: {other:?}")),
            }
        } else {
            drop(d);
        }
        match ep.synchronize() {
            Err(CommError::Poisoned { .. }) => {}
            other => return Err(format!("rank 1 after abandoning combine: {other:?}")),
        }
    } else {
        let mut out = rank
            .stream
            .alloc_zeros::<bf16>(TOKENS * HIDDEN)
            .map_err(e)?;
        d.combine(&y, &mut out).map_err(e)?;
        println!(
            "rank 0: {}",
            peer_failure(ep.synchronize(), 1, t0, timeout)?
        );
    }
    let old = ep.epoch().map_err(e)?;
    drop(ep);
    rank.next_layer_works(old)
}

/// The pulled exchange (`EpConfig::pull_rows`): rank 1 abandons the slot combine (an `out`
/// too short) after a dispatch that moved only routing: rank 0's combine_slots, waiting for
/// rank 1's signal, ends with PeerAborted within the deadline instead of a hang, and both
/// go on with a new (copying) instance.
fn short_out_in_pulled_combine(rank: &Rank) -> Result<(), String> {
    let timeout = moefuse_testkit::scaled_secs(5);
    let mut ep = rank.ep(cfg(timeout).pulled())?;
    let input = inputs(&rank.stream, 16 + rank.me as u64, TOKENS)?;
    let t0 = Instant::now();
    let d = ep
        .dispatch_pull(&input.x, &input.ids, &input.ws, TOKENS)
        .map_err(e)?;
    // No down GEMM here: the slots hold whatever they held, and the check is the protocol.
    if rank.me == 1 {
        let mut out = rank.stream.alloc_zeros::<bf16>(HIDDEN).map_err(e)?;
        match d.combine_slots(&input.ids, &input.ws, &mut out) {
            Err(CommError::BufferTooSmall { what: "out", .. }) => {}
            other => return Err(format!("rank 1: short out: {other:?}")),
        }
        match ep.synchronize() {
            Err(CommError::Poisoned { .. }) => {}
            other => return Err(format!("rank 1 after abandoning combine_slots: {other:?}")),
        }
    } else {
        let mut out = rank
            .stream
            .alloc_zeros::<bf16>(TOKENS * HIDDEN)
            .map_err(e)?;
        d.combine_slots(&input.ids, &input.ws, &mut out)
            .map_err(e)?;
        println!(
            "rank 0 (pulled): {}",
            peer_failure(ep.synchronize(), 1, t0, timeout)?
        );
    }
    let old = ep.epoch().map_err(e)?;
    drop(ep);
    rank.next_layer_works(old)
}

fn rank_main(scenario: &str) -> Result<(), String> {
    let rank = Rank::join()?;
    match scenario {
        "peer_error_in_dispatch" => peer_error_in_dispatch(&rank),
        "dead_peer" => dead_peer(&rank),
        "config_mismatch" => config_mismatch(&rank),
        "dispatch_dropped_without_combine" => bad_combine(&rank, false),
        "short_out_in_combine" => bad_combine(&rank, true),
        "short_out_in_pulled_combine" => short_out_in_pulled_combine(&rank),
        other => Err(format!("unknown scenario {other}")),
    }
}

fn main() {
    if std::env::var_os("MOEFUSE_RANK").is_some() {
        let scenario = std::env::var("MOEFUSE_TEST_SCENARIO").unwrap_or_default();
        std::process::exit(match rank_main(&scenario) {
            Ok(()) => 0,
            Err(msg) => {
                eprintln!("{scenario}: {msg}");
                1
            }
        });
    }
    let mut suite = GpuSuite::new()
        .test(
            "misaligned_operands_are_refused_one_pe",
            misaligned_operands,
        )
        .test(
            "epochs_survive_a_new_instance_one_pe",
            epochs_survive_a_new_instance,
        )
        .test(
            "drop_waits_for_the_kernels_one_pe",
            drop_waits_for_the_kernels,
        );
    for scenario in [
        "peer_error_in_dispatch",
        "dead_peer",
        "config_mismatch",
        "dispatch_dropped_without_combine",
        "short_out_in_combine",
        "short_out_in_pulled_combine",
    ] {
        suite = suite.test(&format!("{scenario}_2_pes_one_gpu"), move |_| {
            two_pes(scenario)
        });
    }
    suite.run()
}
