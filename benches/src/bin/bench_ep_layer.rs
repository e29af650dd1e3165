//! The expert-parallel MoE layer (`moefuse-ep`) forward and backward, Qwen3-30B-A3B shapes,
//! beside the single-GPU layer on the same inputs when run at one rank. CUDA events,
//! warm-up, median [IQR], rotating inputs; the EP forward is checked against the single-GPU
//! layer's output first (rel. err column). At `--ranks N` the program relaunches itself as N
//! ranks (one GPU each where there are N GPUs, all on GPU 0 otherwise: correct, but the
//! times are then time-sliced and mean nothing); rank 0 writes the JSON lines. Then, with
//! rows copied (`moefuse_ep_copy`) and pulled in place (`moefuse_ep_pull`, its
//! rel. err against the copied output) asked for explicitly (at one rank: the exchange
//! against this rank alone), the Inference forward, the Training forward and forward +
//! backward together (case suffix `fwdbwd`); at one rank the single-GPU layer's Inference
//! forward and forward + backward are timed the same way (backend `moefuse`).
//!
//! `.device-pack/run.sh bench_ep_layer --out $OUT [--tokens 8192] [--ranks 1]`

#![forbid(unsafe_code)]

use clap::Parser;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse::gpu::{Mode, MoeLayer, MoePlan, MoeWorkspace, Routing, Weights};
use moefuse::{MoeConfig, RouterKind};
use moefuse_benches::{append, commit, ep_world, gpus_used, rotation, today, Error, Record};
use moefuse_comm::Runtime;
use moefuse_ep::{EpMoeLayer, EpRouting, LocalWeights, RowDelivery};
use moefuse_testkit::{rel_err, time_stream, Rng, Stats};
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
    #[arg(long, default_value_t = 8192)]
    tokens: usize,
    /// Timed samples per phase.
    #[arg(long, default_value_t = 20)]
    samples: usize,
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let Some((ctx, rt)) = ep_world("bench_ep_layer", args.ranks)? else {
        return Ok(());
    };
    // One stream, the context's per-thread default: cudarc records no per-buffer events.
    let stream = ctx.per_thread_stream();
    let recs = bench(&ctx, &rt, &stream, &args)?;
    if rt.rank() == 0 {
        for r in &recs {
            println!("{}", r.line());
        }
        append(&args.out, "moe_ep", &recs)?;
    }
    Ok(())
}

fn bench(
    ctx: &Arc<CudaContext>,
    rt: &Arc<Runtime>,
    stream: &Arc<CudaStream>,
    args: &Args,
) -> Result<Vec<Record>, Error> {
    let cfg = MoeConfig::new(2048, 768, 128, 8).with_router(RouterKind::External);
    let (t, d, i, e, k, w) = (
        args.tokens,
        cfg.hidden,
        cfg.intermediate,
        cfg.experts,
        cfg.top_k,
        cfg.gate_up_width(),
    );
    let (rank, ranks) = (rt.rank(), rt.ranks());
    let mut rng = Rng::new(0x6570 ^ rank as u64);
    // Every rank draws all experts' weights from one seed and keeps its own.
    let mut wrng = Rng::new(0x7765);
    let scale = |v: Vec<bf16>, s: f32| {
        v.into_iter()
            .map(|x| bf16::from_f32(x.to_f32() * s))
            .collect::<Vec<_>>()
    };
    let gate_up_h = scale(wrng.bf16_vec(e * w * d), 1.7 / (d as f32).sqrt());
    let down_h = scale(wrng.bf16_vec(e * d * i), 1.7 / (i as f32).sqrt());
    let mut layer = EpMoeLayer::with_mode(rt, stream, cfg, t, Mode::Training)?;
    let (local, e0) = (layer.local_experts(), layer.first_expert());
    println!(
        "  rank {} of {}: memory, {}",
        rt.rank(),
        rt.ranks(),
        layer.memory()
    );
    let gate_up = stream.clone_htod(&gate_up_h[e0 * w * d..(e0 + local) * w * d])?;
    let down = stream.clone_htod(&down_h[e0 * d * i..(e0 + local) * d * i])?;
    let lw = LocalWeights {
        gate_up: gate_up.as_view(),
        down: down.as_view(),
    };
    let sets = rotation(ctx, t * d * 2 * 4);
    let xs: Vec<CudaSlice<bf16>> = (0..sets)
        .map(|_| stream.clone_htod(&rng.bf16_vec(t * d)))
        .collect::<Result<_, _>>()?;
    let (mut ids, mut wts) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
    for _ in 0..t {
        ids.extend(rng.distinct(e, k));
        let raw: Vec<f32> = (0..k).map(|_| rng.uniform().exp()).collect();
        let sum: f32 = raw.iter().sum();
        wts.extend(raw.iter().map(|v| v / sum));
    }
    let (ids_d, wts_d) = (stream.clone_htod(&ids)?, stream.clone_htod(&wts)?);
    let dy = stream.clone_htod(&rng.bf16_vec(t * d))?;
    let (mut y, mut dx) = (
        stream.alloc_zeros::<bf16>(t * d)?,
        stream.alloc_zeros::<bf16>(t * d)?,
    );
    let mut grads = layer.gradients()?;
    let ext = || EpRouting::External {
        topk_ids: &ids_d,
        topk_weights: &wts_d,
    };

    // At one rank: the single-GPU layer on the same inputs, its output the check.
    let mut err = None;
    let (mut single, mut ep_times, mut single_own) = (None, None, None);
    if ranks == 1 {
        let plan = MoePlan::new(cfg, t)?;
        let mut ws = MoeWorkspace::new(stream, plan.workspace_bytes(Mode::Training))?;
        let mut one = MoeLayer::new(stream, &plan, Mode::Training)?;
        let weights = Weights::new(gate_up.as_view(), down.as_view());
        let mut g1 = one.gradients()?;
        let routing = || Routing::External {
            topk_ids: &ids_d,
            topk_weights: &wts_d,
        };
        one.forward(&weights, &xs[0], t, routing(), &mut y, &mut ws)?;
        let want: Vec<f32> = stream.clone_dtoh(&y)?.iter().map(|v| v.to_f32()).collect();
        layer.forward(&lw, &xs[0], t, ext(), &mut y)?;
        let got: Vec<f32> = stream.clone_dtoh(&y)?.iter().map(|v| v.to_f32()).collect();
        let e1 = rel_err(&got, &want);
        if !moefuse_testkit::within(e1, 2e-2) {
            return Err(
                format!("EP forward differs from the single-GPU layer: rel err {e1}").into(),
            );
        }
        err = Some(e1);
        // The two layers alternate, three rounds each, so that clock and thermal drift
        // over the run do not favour whichever is timed first; each reports its round
        // with the middle median.
        let (mut sf, mut sb, mut ef, mut eb) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            sf.push(time_stream(
                stream,
                3,
                args.samples,
                |s| -> Result<(), Error> {
                    Ok(one.forward(&weights, &xs[s % sets], t, routing(), &mut y, &mut ws)?)
                },
            )?);
            sb.push(time_stream(
                stream,
                3,
                args.samples,
                |_| -> Result<(), Error> {
                    Ok(one.backward(&weights, &dy, &mut dx, &mut g1, false, &mut ws)?)
                },
            )?);
            ef.push(time_stream(
                stream,
                3,
                args.samples,
                |s| -> Result<(), Error> {
                    Ok(layer.forward(&lw, &xs[s % sets], t, ext(), &mut y)?)
                },
            )?);
            eb.push(time_stream(
                stream,
                3,
                args.samples,
                |_| -> Result<(), Error> {
                    Ok(layer.backward(&lw, &dy, &mut dx, &mut grads, false)?)
                },
            )?);
        }
        single = Some((middle(sf), middle(sb)));
        ep_times = Some((middle(ef), middle(eb)));
        // The single-GPU layer also timed exactly as the two deliveries below are (its own
        // loops, not interleaved with the EP layer's): the Inference forward and forward +
        // backward.
        let mut inf = MoeLayer::new(stream, &plan, Mode::Inference)?;
        let fi = time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            Ok(inf.forward(&weights, &xs[s % sets], t, routing(), &mut y, &mut ws)?)
        })?;
        drop(inf);
        let tfb = time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            one.forward(&weights, &xs[s % sets], t, routing(), &mut y, &mut ws)?;
            Ok(one.backward(&weights, &dy, &mut dx, &mut g1, false, &mut ws)?)
        })?;
        single_own = Some((fi, tfb));
    }
    let (f, b) = match ep_times {
        Some(fb) => fb,
        None => (
            time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
                Ok(layer.forward(&lw, &xs[s % sets], t, ext(), &mut y)?)
            })?,
            time_stream(stream, 3, args.samples, |_| -> Result<(), Error> {
                Ok(layer.backward(&lw, &dy, &mut dx, &mut grads, false)?)
            })?,
        ),
    };
    let flops = 6.0 * (t * k * d * i) as f64;
    let gpu = ctx.name()?;
    let rec = |backend: &str, phase: &str, st: Stats, fl: f64| Record {
        suite: "moe_ep".into(),
        case: format!("qwen3-30b-a3b-t{t}-ep{ranks}-{phase}"),
        backend: backend.into(),
        gpu: gpu.clone(),
        gpus: Some(gpus_used(ranks)),
        median_us: st.median_us,
        iqr_us: st.iqr_us,
        tflops: Some(fl / (st.median_us * 1e-6) / 1e12),
        gbps: None,
        rel_err: err.unwrap_or(f64::NAN),
        date: today(),
        commit: commit(),
    };
    let mut out = vec![
        rec("moefuse_ep", "fwd", f, flops),
        rec("moefuse_ep", "bwd", b, 2.0 * flops),
    ];
    // Both deliveries asked for explicitly (at one rank: the exchange against this rank
    // alone, what it costs over the single-GPU layer): the Inference forward (the pulled
    // output checked against the copied one), the Training forward, and forward + backward
    // together (a pulled backward consumes its forward's slots: one backward per forward).
    drop(layer);
    let mut outputs = Vec::new();
    for (delivery, backend) in [
        (RowDelivery::Copy, "moefuse_ep_copy"),
        (RowDelivery::Pull, "moefuse_ep_pull"),
    ] {
        let mut l = EpMoeLayer::with_delivery(rt, stream, cfg, t, Mode::Inference, delivery)?;
        l.forward(&lw, &xs[0], t, ext(), &mut y)?;
        outputs.push(
            stream
                .clone_dtoh(&y)?
                .iter()
                .map(|v| v.to_f32())
                .collect::<Vec<_>>(),
        );
        println!("  rank {rank}: {delivery:?} rows, memory {}", l.memory());
        let fi = time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            Ok(l.forward(&lw, &xs[s % sets], t, ext(), &mut y)?)
        })?;
        drop(l);
        let mut tl = EpMoeLayer::with_delivery(rt, stream, cfg, t, Mode::Training, delivery)?;
        let mut tg = tl.gradients()?;
        let tf = time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            Ok(tl.forward(&lw, &xs[s % sets], t, ext(), &mut y)?)
        })?;
        let tfb = time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            tl.forward(&lw, &xs[s % sets], t, ext(), &mut y)?;
            Ok(tl.backward(&lw, &dy, &mut dx, &mut tg, false)?)
        })?;
        let e_vs_copy = rel_err(&outputs[outputs.len() - 1], &outputs[0]);
        for (phase, st, fl) in [
            ("fwd-inference", fi, flops),
            ("fwd", tf, flops),
            ("fwdbwd", tfb, 3.0 * flops),
        ] {
            let mut r = rec(backend, phase, st, fl);
            r.rel_err = e_vs_copy;
            out.push(r);
        }
    }
    if let Some((f1, b1)) = single {
        out.push(rec("moefuse", "fwd", f1, flops));
        out.push(rec("moefuse", "bwd", b1, 2.0 * flops));
        if let Some((fi, tfb)) = single_own {
            out.push(rec("moefuse", "fwd-inference", fi, flops));
            out.push(rec("moefuse", "fwdbwd", tfb, 3.0 * flops));
        }
    }
    Ok(out)
}

/// The round whose median is the middle one.
fn middle(mut rounds: Vec<Stats>) -> Stats {
    rounds.sort_by(|a, b| a.median_us.total_cmp(&b.median_us));
    rounds.swap_remove(rounds.len() / 2)
}
