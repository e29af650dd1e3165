//! GPU tests of the NVSHMEM runtime and expert-parallel dispatch/combine.
//!
//! With one PE (this process): the ring check (put/get/signal to itself), dispatch+combine
//! round trips against the host model (`SendPlan`/`ReceiveLayout`) for uniform, skewed,
//! half-unused-expert, empty-rank, top-1, top-16 and single-token routings, repeated calls,
//! a CUDA graph replayed with new routing, and typed errors for misuse. With N PEs on the
//! one GPU: the same binary relaunched N times through `moefuse_comm::launch` (each child
//! sees `MOEFUSE_RANK` and runs `rank_main`).
//!
//! Every rank can rebuild every other rank's inputs from the seed, so each checks its own
//! receive buffer row by row (origin, weight, bytes) and its combined output in full.

mod common;

use common::{e, one_pe, relaunch};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr};
use half::bf16;
use moefuse_comm::{
    quiet_on_stream, CommError, EpConfig, ExpertParallel, LaunchEnv, Library, ReceiveLayout,
    Runtime, SendPlan, Signal, SignalOp, Team, UniqueId,
};
use moefuse_testkit::{check_close, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Routing {
    Uniform,
    Skewed,
    LowerHalfOnly,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    top_k: usize,
    routing: Routing,
    /// Tokens of rank r: `tokens + 37 r`, or 0 for the last rank when `last_rank_empty`.
    tokens: usize,
    last_rank_empty: bool,
}

const EXPERTS: usize = 16;
const HIDDEN: usize = 1032;
const MAX_TOKENS: usize = 2048;

fn cases() -> Vec<Case> {
    let c = |name, top_k, routing, tokens, last_rank_empty| Case {
        name,
        top_k,
        routing,
        tokens,
        last_rank_empty,
    };
    vec![
        c("uniform", 4, Routing::Uniform, 1000, false),
        c("skewed", 4, Routing::Skewed, 1500, false),
        c(
            "lower_half_experts_only",
            2,
            Routing::LowerHalfOnly,
            700,
            false,
        ),
        c("last_rank_sends_nothing", 4, Routing::Uniform, 900, true),
        c("top1", 1, Routing::Uniform, 1200, false),
        c("top16_every_expert", 16, Routing::Uniform, 300, false),
        c("single_token", 4, Routing::Skewed, 1, false),
    ]
}

fn tokens_of(case: &Case, rank: usize, ranks: usize) -> usize {
    if case.last_rank_empty && rank == ranks - 1 {
        0
    } else {
        (case.tokens + 37 * rank).min(MAX_TOKENS)
    }
}

fn rank_rng(seed: u64, rank: usize, what: u64) -> Rng {
    Rng::new(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ what << 56)
}

/// Distinct experts per token and positive weights summing to 1.
fn routing(case: &Case, seed: u64, rank: usize, tokens: usize) -> (Vec<i32>, Vec<f32>) {
    let mut rng = rank_rng(seed, rank, 1);
    let k = case.top_k;
    let pool = if case.routing == Routing::LowerHalfOnly {
        EXPERTS / 2
    } else {
        EXPERTS
    };
    let (mut ids, mut ws) = (
        Vec::with_capacity(tokens * k),
        Vec::with_capacity(tokens * k),
    );
    for _ in 0..tokens {
        let mut chosen: Vec<i32> = Vec::with_capacity(k);
        while chosen.len() < k {
            let e = match case.routing {
                // Zipf-like: low expert ids far more likely than high ones.
                Routing::Skewed => {
                    let u = (rng.uniform() + 1.0) / 2.0;
                    ((pool as f32).powf(u * u * u) - 1.0) as usize % pool
                }
                _ => rng.below(pool),
            } as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        let raw: Vec<f32> = (0..k).map(|_| 0.05 + (rng.uniform() + 1.0) / 2.0).collect();
        let sum: f32 = raw.iter().sum();
        ids.extend(chosen);
        ws.extend(raw.iter().map(|w| w / sum));
    }
    (ids, ws)
}

fn tokens_x(seed: u64, rank: usize, tokens: usize) -> Vec<bf16> {
    rank_rng(seed, rank, 2).bf16_vec(tokens * HIDDEN)
}

/// The expert output the test writes for a received row: `x[token] · (slot + 1) / 4`.
fn expert_out(x_row: &[bf16], slot: usize) -> impl Iterator<Item = bf16> + '_ {
    let s = (slot + 1) as f32 * 0.25;
    x_row.iter().map(move |v| bf16::from_f32(v.to_f32() * s))
}

/// Copies `v` to the device (one default element when empty: no zero-size allocations).
fn upload<T: DeviceRepr + Clone + Default>(
    s: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>, String> {
    if v.is_empty() {
        return s.clone_htod(&[T::default()]).map_err(e);
    }
    s.clone_htod(v).map_err(e)
}

/// One dispatch → expert outputs → combine round trip of `case`, checked on this rank.
fn roundtrip(
    ep: &mut ExpertParallel,
    stream: &Arc<CudaStream>,
    case: &Case,
    seed: u64,
) -> Result<(), String> {
    let (me, ranks) = (ep.rank(), ep.placement().ranks());
    let place = ep.placement();
    let k = case.top_k;
    let what = |msg: String| format!("{} (rank {me}/{ranks}, seed {seed}): {msg}", case.name);
    // Every rank's inputs, rebuilt from the seed; the host model of the exchange.
    let inputs: Vec<(Vec<i32>, Vec<f32>, Vec<bf16>)> = (0..ranks)
        .map(|r| {
            let t = tokens_of(case, r, ranks);
            let (ids, ws) = routing(case, seed, r, t);
            (ids, ws, tokens_x(seed, r, t))
        })
        .collect();
    let plans = inputs
        .iter()
        .enumerate()
        .map(|(r, (ids, _, _))| {
            let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
            SendPlan::build(&place, r, &ids, k)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(e)?;
    let layout = ReceiveLayout::build(&place, me, &plans).map_err(e)?;
    let tokens = tokens_of(case, me, ranks);
    let (ids, ws, x) = &inputs[me];

    let x_d = upload(stream, x)?;
    let ids_d = upload(stream, ids)?;
    let ws_d = upload(stream, ws)?;
    let d = ep.dispatch(&x_d, &ids_d, &ws_d, tokens).map_err(e)?;

    // The receive side, row by row.
    let rows = layout.rows.len();
    let got_rows = d.received_rows().map_err(e)?;
    if got_rows != rows {
        return Err(what(format!(
            "received {got_rows} rows, the model says {rows}"
        )));
    }
    let offsets = stream.clone_dtoh(d.offsets()).map_err(e)?;
    if offsets != layout.offsets {
        return Err(what(format!(
            "offsets {offsets:?}, model {:?}",
            layout.offsets
        )));
    }
    let origin = stream.clone_dtoh(d.origin()).map_err(e)?;
    let weights = stream.clone_dtoh(d.weights()).map_err(e)?;
    let recv = stream.clone_dtoh(d.x()).map_err(e)?;
    let mut y = Vec::with_capacity(rows * HIDDEN);
    for (r, row) in layout.rows.iter().enumerate() {
        let o = &origin[3 * r..3 * r + 3];
        if o != [row.src as i32, row.token as i32, row.slot as i32] {
            return Err(what(format!("row {r}: origin {o:?}, model {row:?}")));
        }
        let (_, src_ws, src_x) = &inputs[row.src];
        let w = src_ws[row.token * k + row.slot];
        if weights[r] != w {
            return Err(what(format!("row {r}: weight {}, model {w}", weights[r])));
        }
        let want = &src_x[row.token * HIDDEN..(row.token + 1) * HIDDEN];
        if recv[r * HIDDEN..(r + 1) * HIDDEN] != *want {
            return Err(what(format!(
                "row {r} ({row:?}): bytes differ from the source token"
            )));
        }
        y.extend(expert_out(want, row.slot));
    }

    // Combine into a poisoned output; compare every element.
    let y_d = upload(stream, &y)?;
    let mut out_d = upload(stream, &vec![POISON_BF16; tokens * HIDDEN])?;
    d.combine(&y_d, &mut out_d).map_err(e)?;
    let out: Vec<f32> = stream
        .clone_dtoh(&out_d)
        .map_err(e)?
        .iter()
        .take(tokens * HIDDEN)
        .map(|v| v.to_f32())
        .collect();
    let mut want = vec![0f32; tokens * HIDDEN];
    for t in 0..tokens {
        let x_row = &x[t * HIDDEN..(t + 1) * HIDDEN];
        for j in 0..k {
            let w = ws[t * k + j];
            for (o, v) in want[t * HIDDEN..(t + 1) * HIDDEN]
                .iter_mut()
                .zip(expert_out(x_row, j))
            {
                *o += w * v.to_f32();
            }
        }
    }
    check_close(&out, &want, BF16_REL_ERR, &what("combined output".into()))?;
    let flags = ep.take_flags().map_err(e)?;
    if flags != Default::default() {
        return Err(what(format!("kernels raised {flags:?} on valid routing")));
    }
    Ok(())
}

/// Every case on one runtime, three seeds each (so epochs advance across calls).
fn all_cases(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    seed: u64,
) -> Result<Vec<String>, String> {
    let mut eps: Vec<(usize, ExpertParallel)> = Vec::new();
    let mut done = Vec::new();
    for case in cases() {
        if !eps.iter().any(|(k, _)| *k == case.top_k) {
            let cfg = EpConfig::new(EXPERTS, case.top_k, HIDDEN, MAX_TOKENS);
            eps.push((case.top_k, ExpertParallel::new(rt, stream, cfg).map_err(e)?));
        }
        let ep = &mut eps
            .iter_mut()
            .find(|(k, _)| *k == case.top_k)
            .expect("created")
            .1;
        for i in 0..3 {
            roundtrip(ep, stream, &case, seed.wrapping_add(i))?;
        }
        done.push(case.name.to_string());
    }
    Ok(done)
}

/// World and strided teams: sizes, numbering, translation back to world PEs, stream sync,
/// and a split outside the parent rejected before NVSHMEM sees it.
fn check_teams(
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    shares_gpu: bool,
) -> Result<(), String> {
    let (me, n) = (rt.rank(), rt.ranks());
    let world = Team::world(rt);
    if (world.rank(), world.size()) != (me, n) {
        return Err(format!(
            "world team {}/{} on rank {me}/{n}",
            world.rank(),
            world.size()
        ));
    }
    if shares_gpu {
        // NVSHMEM aborts team splits with several PEs per GPU: we must refuse instead.
        return match world.split_strided(0, 2, n.div_ceil(2)) {
            Err(CommError::Unsupported(_)) => Ok(()),
            other => Err(format!(
                "split with PEs sharing a GPU: {:?}",
                other.map(|t| t.is_some())
            )),
        };
    }
    let evens = world.split_strided(0, 2, n.div_ceil(2)).map_err(e)?;
    match (&evens, me % 2) {
        (Some(t), 0) => {
            if t.rank() != me / 2
                || t.size() != n.div_ceil(2)
                || t.world_pe(t.rank()).map_err(e)? != me
            {
                return Err(format!(
                    "even team: rank {} size {} on world rank {me}",
                    t.rank(),
                    t.size()
                ));
            }
            t.sync_on_stream(stream).map_err(e)?;
        }
        (None, 1) => {}
        (t, _) => return Err(format!("rank {me}: even-team membership {}", t.is_some())),
    }
    world.sync_on_stream(stream).map_err(e)?;
    stream.synchronize().map_err(e)?;
    match world.split_strided(0, 1, n + 1) {
        Err(CommError::Config { .. }) => Ok(()),
        other => Err(format!("oversized split: {:?}", other.map(|t| t.is_some()))),
    }
}

/// Stream-ordered put with signal, wait, and get around the ring.
fn check_stream_ops(rt: &Arc<Runtime>, stream: &Arc<CudaStream>) -> Result<(), String> {
    let (me, n) = (rt.rank(), rt.ranks());
    if rt.pes_sharing_gpu() > 1 {
        // NVSHMEM aborts host stream operations with several PEs per GPU: refused instead.
        let buf = rt.alloc::<f32>(16).map_err(e)?;
        let src = stream.clone_htod(&[0f32; 16]).map_err(e)?;
        return match buf.put_on_stream(stream, &src, 0, (me + 1) % n, None) {
            Err(CommError::Unsupported(_)) => Ok(()),
            other => Err(format!("put_on_stream sharing a GPU: {other:?}")),
        };
    }
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let len = 3001;
    let pattern = |r: usize| {
        (0..len)
            .map(|i| (r * 10_000 + i) as f32)
            .collect::<Vec<f32>>()
    };
    let buf = rt.alloc_zeroed::<f32>(len + 7, stream).map_err(e)?;
    let sig = rt.alloc_zeroed::<u64>(2, stream).map_err(e)?;
    let src = stream.clone_htod(&pattern(me)).map_err(e)?;
    let signal = Signal {
        buffer: &sig,
        index: 1,
        value: 5,
        op: SignalOp::Add,
    };
    buf.put_on_stream(stream, &src, 7, next, Some(signal))
        .map_err(e)?;
    sig.wait_ge_on_stream(stream, 1, 5).map_err(e)?;
    let mut mine = stream.alloc_zeros::<f32>(len).map_err(e)?;
    buf.get_on_stream(stream, &mut mine, 7, me).map_err(e)?;
    rt.barrier_on_stream(stream);
    let mut theirs = stream.alloc_zeros::<f32>(len).map_err(e)?;
    buf.get_on_stream(stream, &mut theirs, 7, next).map_err(e)?;
    quiet_on_stream(rt, stream).map_err(e)?;
    rt.barrier_on_stream(stream);
    if stream.clone_dtoh(&mine).map_err(e)? != pattern(prev) {
        return Err(format!("rank {me}: put_on_stream from {prev} did not land"));
    }
    if stream.clone_dtoh(&theirs).map_err(e)? != pattern(me) {
        return Err(format!(
            "rank {me}: get_on_stream from {next} read the wrong data"
        ));
    }
    match buf.put_on_stream(stream, &src, 8, next, None) {
        Err(CommError::BufferTooSmall { .. }) => {}
        other => return Err(format!("put past the end: {other:?}")),
    }
    match buf.put_on_stream(stream, &src, 0, n, None) {
        Err(CommError::Rank { .. }) => Ok(()),
        other => Err(format!("put to PE {n}: {other:?}")),
    }
}

fn stream_ops_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = one_pe(ctx)?;
    check_stream_ops(&s.rt, &s.stream)
}

fn teams_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = one_pe(ctx)?;
    check_teams(&s.rt, &s.stream, false)
}

fn ring_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = one_pe(ctx)?;
    s.rt.ring_check(&s.stream, 4099).map_err(e)
}

fn roundtrips_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = one_pe(ctx)?;
    let seed = Rng::fresh_seed();
    let done = all_cases(&s.rt, &s.stream, seed)?;
    println!("1 PE, seed {seed}: {}", done.join(", "));
    Ok(())
}

/// Captures dispatch + combine once, then replays the graph with new routing and inputs
/// written into the same buffers: each replay must match the host model and equal an
/// eager run on the same inputs bit for bit.
fn graph_replay_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let s = one_pe(ctx)?;
    let stream = &s.stream;
    let case = Case {
        name: "graph",
        top_k: 4,
        routing: Routing::Skewed,
        tokens: 1111,
        last_rank_empty: false,
    };
    let (t, k) = (case.tokens, case.top_k);
    let cfg = EpConfig::new(EXPERTS, k, HIDDEN, MAX_TOKENS);
    let mut ep = ExpertParallel::new(&s.rt, stream, cfg).map_err(e)?;
    let place = ep.placement();
    let seed = Rng::fresh_seed();
    let inputs = |seed: u64| {
        let (ids, ws) = routing(&case, seed, 0, t);
        (ids, ws, tokens_x(seed, 0, t))
    };
    // y is one fixed random matrix over the whole receive capacity; which of its rows each
    // token reads back depends on the routing.
    let y = Rng::new(seed ^ 7).bf16_vec(ep.recv_rows_capacity() * HIDDEN);
    let y_d = upload(stream, &y)?;
    let (ids, ws, x) = inputs(seed);
    let mut x_d = upload(stream, &x)?;
    let mut ids_d = upload(stream, &ids)?;
    let mut ws_d = upload(stream, &ws)?;
    let mut out_d = upload(stream, &vec![POISON_BF16; t * HIDDEN])?;

    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let captured = ep
        .dispatch(&x_d, &ids_d, &ws_d, t)
        .and_then(|d| d.combine(&y_d, &mut out_d));
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured.map_err(|x| format!("under capture: {x}"))?;
    let graph = graph.ok_or("capture produced no graph")?;

    for i in 0..4u64 {
        let seed = seed.wrapping_add(i);
        let what = format!("graph replay {i}, seed {seed}");
        let (ids, ws, x) = inputs(seed);
        stream.memcpy_htod(&x, &mut x_d).map_err(e)?;
        stream.memcpy_htod(&ids, &mut ids_d).map_err(e)?;
        stream.memcpy_htod(&ws, &mut ws_d).map_err(e)?;
        stream
            .memcpy_htod(&vec![POISON_BF16; t * HIDDEN], &mut out_d)
            .map_err(e)?;
        graph.launch().map_err(e)?;
        let replayed = stream.clone_dtoh(&out_d).map_err(e)?;
        // The model: row r of the receive layout carries (token, slot).
        let ids64: Vec<i64> = ids.iter().map(|&v| v as i64).collect();
        let plan = SendPlan::build(&place, 0, &ids64, k).map_err(e)?;
        let layout = ReceiveLayout::build(&place, 0, &[plan]).map_err(e)?;
        let mut want = vec![0f32; t * HIDDEN];
        for (r, row) in layout.rows.iter().enumerate() {
            let w = ws[row.token * k + row.slot];
            for (o, v) in want[row.token * HIDDEN..(row.token + 1) * HIDDEN]
                .iter_mut()
                .zip(&y[r * HIDDEN..(r + 1) * HIDDEN])
            {
                *o += w * v.to_f32();
            }
        }
        let got: Vec<f32> = replayed.iter().map(|v| v.to_f32()).collect();
        check_close(&got, &want, BF16_REL_ERR, &what)?;
        // Eager on the same inputs: identical bits.
        stream
            .memcpy_htod(&vec![POISON_BF16; t * HIDDEN], &mut out_d)
            .map_err(e)?;
        let d = ep.dispatch(&x_d, &ids_d, &ws_d, t).map_err(e)?;
        d.combine(&y_d, &mut out_d).map_err(e)?;
        let eager = stream.clone_dtoh(&out_d).map_err(e)?;
        if eager
            .iter()
            .map(|v| v.to_bits())
            .ne(replayed.iter().map(|v| v.to_bits()))
        {
            return Err(format!("{what}: eager and replayed outputs differ"));
        }
    }
    Ok(())
}

/// Misuse is rejected before any launch with a typed error.
fn misuse_one_pe(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = one_pe(ctx)?;
    let stream = &s.stream;
    let base = EpConfig::new(EXPERTS, 4, HIDDEN, 64);
    for (bad, what) in [
        (
            EpConfig {
                hidden: 1030,
                ..base
            },
            "hidden",
        ),
        (EpConfig { top_k: 17, ..base }, "top_k"),
        (
            EpConfig {
                experts: 1024,
                ..base
            },
            "experts",
        ),
        (
            EpConfig {
                max_tokens: 0,
                ..base
            },
            "max_tokens",
        ),
    ] {
        match ExpertParallel::new(&s.rt, stream, bad) {
            Err(CommError::Config { what: w, .. }) if w == what => {}
            Err(other) => return Err(format!("{what}: expected Config, got {other}")),
            Ok(_) => return Err(format!("{what}: accepted {bad:?}")),
        }
    }
    // A second runtime in the same process is refused.
    let lib = Library::load(None).map_err(e)?;
    let id = UniqueId::create(&lib).map_err(e)?;
    match Runtime::init(&lib, s.rt.context(), &id, 0, 1) {
        Err(CommError::AlreadyInitialised) => {}
        other => return Err(format!("second init: {:?}", other.map(|_| ()))),
    }
    let mut ep = ExpertParallel::new(&s.rt, stream, base).map_err(e)?;
    let x = upload(stream, &vec![bf16::ONE; 65 * HIDDEN])?;
    let ids = upload(stream, &vec![0i32; 65 * 4])?;
    let ws = upload(stream, &vec![0.25f32; 65 * 4])?;
    match ep.dispatch(&x, &ids, &ws, 65) {
        Err(CommError::Capacity {
            needed: 65,
            capacity: 64,
            ..
        }) => {}
        Err(other) => return Err(format!("65 tokens: expected Capacity, got {other}")),
        Ok(_) => return Err("65 tokens accepted by a 64-token exchange".into()),
    }
    let short = upload(stream, &[0i32; 10])?;
    match ep.dispatch(&x, &short, &ws, 64) {
        Err(CommError::BufferTooSmall {
            what: "topk_ids", ..
        }) => {}
        Err(other) => return Err(format!("short ids: expected BufferTooSmall, got {other}")),
        Ok(_) => return Err("short topk_ids accepted".into()),
    }
    // Out-of-range and repeated experts are flagged by the kernels, never written out of
    // bounds; combine must still finish.
    let mut bad_ids = vec![0i32, 1, 2, 3];
    bad_ids.extend([5, 5, 99, -1]);
    let ids = upload(stream, &bad_ids)?;
    let d = ep.dispatch(&x, &ids, &ws, 2).map_err(e)?;
    let y = upload(stream, &vec![bf16::ONE; 8 * HIDDEN])?;
    let mut out = upload(stream, &vec![POISON_BF16; 2 * HIDDEN])?;
    d.combine(&y, &mut out).map_err(e)?;
    let flags = ep.take_flags().map_err(e)?;
    if !(flags.bad_expert_id && flags.duplicate_expert) {
        return Err(format!("bad routing not flagged: {flags:?}"));
    }
    if ep.take_flags().map_err(e)? != Default::default() {
        return Err("take_flags did not clear the flags".into());
    }
    Ok(())
}

/// N ranks of this binary through the launcher and its unique-id rendezvous: on one GPU
/// (time-sliced contexts, no MPS) by default, or spread over `MOEFUSE_LAUNCH_GPUS` GPUs.
fn n_pes(n: usize) -> Result<(), String> {
    let seed = Rng::fresh_seed();
    relaunch(
        n,
        moefuse_testkit::scaled_secs(100),
        ("MOEFUSE_TEST_SEED", seed.to_string()),
        &format!("{n} PEs, seed {seed}"),
    )
}

/// A child of `n_pes`: join the job, then the ring check and every round trip.
fn rank_main() -> Result<(), String> {
    let env = LaunchEnv::from_env().map_err(e)?.ok_or("not launched")?;
    let seed: u64 = std::env::var("MOEFUSE_TEST_SEED")
        .map_err(e)?
        .parse()
        .map_err(e)?;
    let ctx = CudaContext::new(0).map_err(e)?;
    // SAFETY: as in `shared`: one stream for every buffer.
    unsafe { ctx.disable_event_tracking() };
    let lib = Library::load(None).map_err(e)?;
    let rt = Runtime::join_launched(&lib, &ctx, &env).map_err(e)?;
    let stream = ctx.new_stream().map_err(e)?;
    rt.ring_check(&stream, 4099).map_err(e)?;
    println!("ring check ok; {} PEs share this GPU", rt.pes_sharing_gpu());
    // Every rank of `n_pes` runs on GPU 0.
    check_teams(&rt, &stream, rt.pes_sharing_gpu() > 1)?;
    println!("teams ok");
    check_stream_ops(&rt, &stream)?;
    println!("stream ops ok");
    let done = all_cases(&rt, &stream, seed)?;
    println!("round trips ok: {}", done.join(", "));
    Ok(())
}

fn main() {
    if std::env::var_os("MOEFUSE_RANK").is_some() {
        std::process::exit(match rank_main() {
            Ok(()) => 0,
            Err(msg) => {
                eprintln!("{msg}");
                1
            }
        });
    }
    GpuSuite::new()
        .test("ring_check_one_pe", ring_one_pe)
        .test("teams_one_pe", teams_one_pe)
        .test("stream_ops_one_pe", stream_ops_one_pe)
        .test("dispatch_combine_one_pe", roundtrips_one_pe)
        .test("graph_replay_one_pe", graph_replay_one_pe)
        .test("misuse_is_rejected", misuse_one_pe)
        .test("dispatch_combine_2_pes_one_gpu", |_| n_pes(2))
        .test("dispatch_combine_4_pes_one_gpu", |_| n_pes(4))
        .run()
}
