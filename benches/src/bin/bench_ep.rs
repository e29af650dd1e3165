//! Expert-parallel dispatch and combine (moefuse-comm over NVSHMEM).
//!
//! `bench_ep --out DIR [--ranks N] [--tokens T] [--samples S]`: one PE by default; with
//! `--ranks N` the program relaunches itself as N ranks on this host through
//! `moefuse_comm::launch` (all on GPU 0 unless MOEFUSE_LAUNCH_GPUS says otherwise) and
//! rank 0 writes the records. Balanced random top-k routing; experts are the identity
//! (`y = received x`), so the combined output must equal `x` (weights sum to one): that
//! is checked once before timing. Each sample times dispatch (count with notify, dispatch,
//! and expand beyond one PE) and combine (send, and reduce beyond one PE) with CUDA
//! events; inputs rotate beyond 3× L2.
//! GB/s counts token payload per rank as DeepEP reports it: each token once per
//! destination rank it is sent to, `hidden · 2` bytes.

#![forbid(unsafe_code)]

use clap::Parser;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse_benches::{append, commit, ep_world, gpus_used, rotation, today, Error, Record};
use moefuse_comm::{EpConfig, ExpertParallel, Runtime};
use moefuse_testkit::{rel_err, to_f32, Rng, Stats};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Clone)]
struct Args {
    /// Folder for the JSON lines.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// Ranks to launch on this host (1: this process alone).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Timed samples.
    #[arg(long, default_value_t = 30)]
    samples: usize,
}

/// (name, experts, top_k, hidden)
const MODELS: &[(&str, usize, usize, usize)] = &[
    ("qwen3-30b-a3b", 128, 8, 2048),
    ("deepseek-v3", 256, 8, 7168),
];

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let Some((ctx, rt)) = ep_world("bench_ep", args.ranks)? else {
        return Ok(());
    };
    let rank = rt.rank();
    // NOTES: the context's per-thread default stream, and no other: a context that never
    // creates a stream of its own stays out of cudarc's multi-stream mode, so no per-buffer
    // events are recorded in the timed loop (the safe way to what disable_event_tracking did).
    let stream = ctx.per_thread_stream();
    let gpu = ctx.name()?;
    for &(model, experts, top_k, hidden) in MODELS {
        let cfg = EpConfig::new(experts, top_k, hidden, args.tokens);
        let recs = bench_model(&ctx, &rt, &stream, &args, cfg, model, &gpu)?;
        if rank == 0 {
            for r in &recs {
                println!("{}", r.line());
            }
            append(&args.out, "dispatch_combine", &recs)?;
        }
    }
    Ok(())
}

fn bench_model(
    ctx: &Arc<CudaContext>,
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    args: &Args,
    cfg: EpConfig,
    model: &str,
    gpu: &str,
) -> Result<Vec<Record>, Error> {
    let (t, k, d, e) = (args.tokens, cfg.top_k, cfg.hidden, cfg.experts);
    let (rank, ranks) = (rt.rank(), rt.ranks());
    let mut ep = ExpertParallel::new(rt, stream, cfg)?;
    let mut rng = Rng::new(0x5eed ^ rank as u64);
    // Balanced random routing: k distinct experts per token, weights summing to one.
    let mut ids = Vec::with_capacity(t * k);
    let mut ws = Vec::with_capacity(t * k);
    let mut sent_rows = 0usize;
    for _ in 0..t {
        let chosen = rng.distinct(e, k);
        let mut dests: Vec<usize> = chosen.iter().map(|&x| x as usize / (e / ranks)).collect();
        dests.sort_unstable();
        dests.dedup();
        sent_rows += dests.len();
        ids.extend(chosen);
        ws.extend(std::iter::repeat_n(1.0 / k as f32, k));
    }
    let sets = rotation(ctx, t * d * 2);
    let xs: Vec<Vec<bf16>> = (0..sets).map(|_| rng.bf16_vec(t * d)).collect();
    let xs_d: Vec<CudaSlice<bf16>> = xs
        .iter()
        .map(|x| stream.clone_htod(x))
        .collect::<Result<_, _>>()?;
    let ids_d = stream.clone_htod(&ids)?;
    let ws_d = stream.clone_htod(&ws)?;
    let mut out = stream.alloc_zeros::<bf16>(t * d)?;
    let mut y = stream.alloc_zeros::<bf16>(ep.recv_rows_capacity() * d)?;

    // Check once: identity experts give back x.
    {
        let dsp = ep.dispatch(&xs_d[0], &ids_d, &ws_d, t)?;
        stream.memcpy_dtod(dsp.x(), &mut y)?;
        dsp.combine(&y, &mut out)?;
    }
    // A peer's failure (deadline, abort) is a typed error here, not a hang.
    ep.synchronize()?;
    let got = to_f32(&stream.clone_dtoh(&out)?);
    let err = rel_err(&got, &to_f32(&xs[0]));
    if !moefuse_testkit::within(err, 1e-2) {
        return Err(format!("{model}: combine(dispatch(x)) differs from x: rel err {err}").into());
    }
    if ep.take_flags()? != Default::default() {
        return Err(format!("{model}: kernels flagged valid routing").into());
    }

    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (mut disp_us, mut comb_us) = (Vec::new(), Vec::new());
    for i in 0..(5 + args.samples) {
        let (a, b, c) = (
            ctx.new_event(timing)?,
            ctx.new_event(timing)?,
            ctx.new_event(timing)?,
        );
        a.record(stream)?;
        let dsp = ep.dispatch(&xs_d[i % sets], &ids_d, &ws_d, t)?;
        b.record(stream)?;
        dsp.combine(&y, &mut out)?;
        c.record(stream)?;
        c.synchronize()?;
        if i >= 5 {
            disp_us.push(a.elapsed_ms(&b)? as f64 * 1e3);
            comb_us.push(b.elapsed_ms(&c)? as f64 * 1e3);
        }
    }
    // Timings of calls that failed on some rank are not timings: refuse them.
    ep.synchronize()?;
    let bytes = (sent_rows * d * 2) as f64;
    let rec = |phase: &str, s: Stats| Record {
        suite: "dispatch_combine".into(),
        case: format!("{model}-t{t}-pe{ranks}-{phase}"),
        backend: "moefuse".into(),
        gpu: gpu.into(),
        gpus: Some(gpus_used(ranks)),
        median_us: s.median_us,
        iqr_us: s.iqr_us,
        tflops: None,
        gbps: Some(bytes / (s.median_us * 1e-6) / 1e9),
        rel_err: err,
        date: today(),
        commit: commit(),
    };
    Ok(vec![
        rec("dispatch", Stats::from_samples(disp_us)),
        rec("combine", Stats::from_samples(comb_us)),
    ])
}
