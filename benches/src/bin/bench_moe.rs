//! The MoE layer on one GPU: moefuse forward, backward and forward+backward.
//!
//! `bench_moe --out DIR [--models a,b] [--tokens 8192,16384] [--samples N]`. Balanced
//! random routing (k distinct uniform experts per token, softmax-renormalised weights over
//! random logits), given to the layer as external routing, as the PyTorch and LigerMoE
//! baselines (`benches/torch_moe.py`, `benches/ligermoe_moe.py`) get it; bf16 weights
//! N(0, 1/fan_in)-scaled uniform. Before timing, the first 16 tokens of the output are
//! checked against an f64 host computation of the same layer (their k experts only).
//! CUDA events, 3 warm-ups, median and IQR; activations rotate through input sets past 3×
//! L2. TFLOP/s by useful FLOPs: forward 6·T·k·D·I, backward twice that. Appends to
//! `DIR/moe.jsonl` (backend `moefuse`).
//!
//! Per model, one plan at the largest token count, the weights in the bench's own buffers
//! (the layers borrow views) and one workspace shared by a Training layer (timed) and an
//! Inference layer, whose `memory()` both print; the Inference forward must equal the
//! Training forward bit for bit (checked once per case, before timing).

#![forbid(unsafe_code)]

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use moefuse::gpu::{
    decode_applies, decode_preferred, DecodePath, GateUpPath, Mode, MoeLayer, MoePlan,
    MoeWorkspace, Routing, Weights,
};
use moefuse::{reference, Activation, GateUpLayout, MoeConfig, RouterKind};
use moefuse_benches::{append, commit, open_gpu, rotation, today, Error, Record};
use moefuse_testkit::{rel_err, time_stream, Rng, Stats};
use std::path::PathBuf;
use std::sync::Arc;

/// Routings the decode-size Inference forwards rotate through (at Qwen3-30B-A3B T = 1, 8
/// sets of 8 experts: 600 MB of weights between two reads of one set, 10× the H200's L2).
const ROUTE_SETS: usize = 8;

#[derive(Parser)]
struct Args {
    /// Folder for the JSON lines.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// Comma list of models (default: all).
    #[arg(long)]
    models: Option<String>,
    /// Comma list of token counts.
    #[arg(long, default_value = "8192,16384,1,32,128")]
    tokens: String,
    /// Timed samples per phase.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Also print per-stage times of one forward and backward.
    #[arg(long)]
    profile: bool,
}

/// (name, D, I, E, k, activation, layout)
fn models() -> Vec<(&'static str, MoeConfig)> {
    vec![
        ("qwen3-30b-a3b", MoeConfig::new(2048, 768, 128, 8)),
        ("mixtral-8x7b", MoeConfig::new(4096, 14336, 8, 2)),
        (
            "gpt-oss-120b",
            MoeConfig::new(2880, 2880, 128, 4)
                .with_activation(Activation::swiglu_oai())
                .with_gate_up_layout(GateUpLayout::Interleaved),
        ),
        ("deepseek-v3", MoeConfig::new(7168, 2048, 256, 8)),
    ]
    .into_iter()
    .map(|(n, c)| (n, c.with_router(RouterKind::External)))
    .collect()
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let Some(ctx) = open_gpu("bench_moe") else {
        return Ok(());
    };
    // Every buffer of this program lives on one stream: the per-thread default stream of a
    // context that never creates a stream of its own stays out of cudarc's multi-stream
    // mode, so cudarc records no per-buffer events in the timed loops (no opt-out needed).
    let stream = ctx.per_thread_stream();
    let gpu = ctx.name()?;
    let wanted: Option<Vec<String>> = args
        .models
        .as_ref()
        .map(|m| m.split(',').map(String::from).collect());
    let token_list: Vec<usize> = args
        .tokens
        .split(',')
        .map(|t| t.trim().parse())
        .collect::<Result<_, _>>()?;
    for (model, cfg) in models() {
        if wanted
            .as_ref()
            .is_some_and(|w| !w.iter().any(|m| m == model))
        {
            continue;
        }
        let max_t = *token_list.iter().max().unwrap_or(&1);
        let mut rng = Rng::new(0x6d6f65 ^ cfg.experts as u64);
        let (d, i, e, w) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.gate_up_width(),
        );
        let scale = |v: Vec<bf16>, s: f32| {
            v.into_iter()
                .map(|x| bf16::from_f32(x.to_f32() * s))
                .collect::<Vec<_>>()
        };
        let gate_up_h = scale(rng.bf16_vec(e * w * d), 1.7 / (d as f32).sqrt());
        let down_h = scale(rng.bf16_vec(e * d * i), 1.7 / (i as f32).sqrt());
        let gate_up = stream.clone_htod(&gate_up_h)?;
        let down = stream.clone_htod(&down_h)?;
        let plan = MoePlan::new(cfg, max_t)?;
        let (mut train, mut infer) = (
            MoeLayer::new(&stream, &plan, Mode::Training)?,
            MoeLayer::new(&stream, &plan, Mode::Inference)?,
        );
        // One workspace for both layers: what they need on every gate_up path the bench
        // forces (the plan's size fits any).
        let ws_bytes = workspace_for_every_path(&stream, [&mut train, &mut infer])?;
        let mut ws = MoeWorkspace::new(&stream, ws_bytes)?;
        for l in [&train, &infer] {
            println!("  {model} max_t{max_t} memory, {}", l.memory());
        }
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        println!(
            "  {model} max_t{max_t} workspace {:.1} MiB (the plan's bound: {:.1} MiB)",
            mib(ws_bytes),
            mib(plan.workspace_bytes(Mode::Training))
        );
        let mut layers = Layers {
            train,
            infer,
            weights: Weights::new(gate_up.as_view(), down.as_view()),
            ws: &mut ws,
        };
        for &t in &token_list {
            let recs = bench_case(
                &ctx,
                &stream,
                &mut layers,
                &gate_up_h,
                &down_h,
                model,
                t,
                &args,
                &gpu,
                &mut rng,
            )?;
            for r in &recs {
                println!("{}", r.line());
            }
            append(&args.out, "moe", &recs)?;
        }
    }
    Ok(())
}

/// The workspace `layers` need on every gate_up path `bench_case` forces (a layer's own
/// size is its current path's: the fused gather needs no `x_perm`, so a layer sized on it
/// refuses the unfused paths with `WorkspaceTooSmall`). Leaves each layer on `Auto`.
fn workspace_for_every_path(
    stream: &Arc<CudaStream>,
    layers: [&mut MoeLayer; 2],
) -> Result<usize, Error> {
    let fused_ok = moefuse::gpu::gate_up_fused_supported(stream)?;
    let mut bytes = 0;
    for layer in layers {
        for path in [
            GateUpPath::Auto,
            GateUpPath::FusedGather,
            GateUpPath::FusedActivation,
            GateUpPath::Unfused,
        ] {
            if path == GateUpPath::Auto || path == GateUpPath::Unfused || fused_ok {
                layer.set_gate_up_path(path)?;
                bytes = bytes.max(layer.workspace_bytes());
            }
        }
        layer.set_gate_up_path(GateUpPath::Auto)?;
    }
    Ok(bytes)
}

/// One model's layers (Training, timed; Inference, checked), its weights and workspace.
struct Layers<'a> {
    train: MoeLayer,
    infer: MoeLayer,
    weights: Weights<'a>,
    ws: &'a mut MoeWorkspace,
}

/// Balanced random routing: ids and softmax-renormalised weights.
fn routing(rng: &mut Rng, t: usize, e: usize, k: usize) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut ws) = (Vec::with_capacity(t * k), Vec::with_capacity(t * k));
    for _ in 0..t {
        let chosen = rng.distinct(e, k);
        let l: Vec<f32> = (0..k).map(|_| rng.uniform().exp()).collect();
        let s: f32 = l.iter().sum();
        ids.extend(chosen);
        ws.extend(l.iter().map(|v| v / s));
    }
    (ids, ws)
}

/// y for the first `n` tokens in f64 from the bf16 weights (only their experts).
#[allow(clippy::too_many_arguments)]
fn host_check(
    cfg: &MoeConfig,
    gate_up: &[bf16],
    down: &[bf16],
    x: &[bf16],
    ids: &[i32],
    ws: &[f32],
    n: usize,
) -> Vec<f32> {
    let d = cfg.hidden;
    let mut y = vec![0f32; n * d];
    // One thread per token: the big models' experts make this seconds of f64 work.
    std::thread::scope(|scope| {
        for (t, y_t) in y.chunks_mut(d).enumerate() {
            scope.spawn(move || one_token(cfg, gate_up, down, x, ids, ws, t, y_t));
        }
    });
    y
}

#[allow(clippy::too_many_arguments)]
fn one_token(
    cfg: &MoeConfig,
    gate_up: &[bf16],
    down: &[bf16],
    x: &[bf16],
    ids: &[i32],
    ws: &[f32],
    t: usize,
    y: &mut [f32],
) {
    let (d, i, k, w) = (cfg.hidden, cfg.intermediate, cfg.top_k, cfg.gate_up_width());
    {
        let xr: Vec<f64> = x[t * d..(t + 1) * d].iter().map(|v| v.to_f64()).collect();
        for j in 0..k {
            let ex = ids[t * k + j] as usize;
            let h_pre: Vec<f32> = (0..w)
                .map(|r| {
                    let row = &gate_up[(ex * w + r) * d..(ex * w + r + 1) * d];
                    // Rounded to bf16 like the GPU's stored h_pre.
                    bf16::from_f64(row.iter().zip(&xr).map(|(a, b)| a.to_f64() * b).sum()).to_f32()
                })
                .collect();
            let mut h = vec![0f32; i];
            reference::activation::forward_row(cfg.activation, cfg.gate_up_layout, &h_pre, &mut h);
            let h: Vec<f64> = h.iter().map(|&v| bf16::from_f32(v).to_f64()).collect();
            for c in 0..d {
                let row = &down[(ex * d + c) * i..(ex * d + c + 1) * i];
                let v: f64 = row.iter().zip(&h).map(|(a, b)| a.to_f64() * b).sum();
                y[c] += (ws[t * k + j] as f64 * bf16::from_f64(v).to_f64()) as f32;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn bench_case(
    ctx: &Arc<cudarc::driver::CudaContext>,
    stream: &Arc<CudaStream>,
    layers: &mut Layers<'_>,
    gate_up_h: &[bf16],
    down_h: &[bf16],
    model: &str,
    t: usize,
    args: &Args,
    gpu: &str,
    rng: &mut Rng,
) -> Result<Vec<Record>, Error> {
    let Layers {
        train: layer,
        infer,
        weights: wv,
        ws: work,
    } = layers;
    let cfg = *layer.config();
    let (d, e, k) = (cfg.hidden, cfg.experts, cfg.top_k);
    let sets = rotation(ctx, t * d * 2 * 4);
    let mut xs: Vec<CudaSlice<bf16>> = Vec::new();
    let mut x0 = Vec::new();
    for s in 0..sets {
        let x = rng.bf16_vec(t * d);
        if s == 0 {
            x0 = x.clone();
        }
        xs.push(stream.clone_htod(&x)?);
    }
    // Decode sizes read only the touched experts' weights, which a repeated routing would
    // find in L2 from the call before: the Inference forwards there rotate through
    // ROUTE_SETS routings (set 0 is the checked one), as the other inputs rotate beyond L2.
    let route_sets = if decode_applies(&cfg, t) {
        ROUTE_SETS
    } else {
        1
    };
    let mut routes = Vec::with_capacity(route_sets);
    for _ in 0..route_sets {
        let (ids, ws) = routing(rng, t, e, k);
        routes.push((stream.clone_htod(&ids)?, stream.clone_htod(&ws)?, ids, ws));
    }
    let (ids, ws) = (&routes[0].2, &routes[0].3);
    let dy = stream.clone_htod(&rng.bf16_vec(t * d))?;
    let mut y = stream.alloc_zeros::<bf16>(t * d)?;
    let mut dx = stream.alloc_zeros::<bf16>(t * d)?;
    let mut grads = layer.gradients()?;
    let ext_set = |i: usize| Routing::External {
        topk_ids: &routes[i % route_sets].0,
        topk_weights: &routes[i % route_sets].1,
    };
    let ext = || ext_set(0);

    layer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
    let bits = |v: Vec<bf16>| v.into_iter().map(bf16::to_bits).collect::<Vec<_>>();
    let y_train = bits(stream.clone_dtoh(&y)?);
    infer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
    if bits(stream.clone_dtoh(&y)?) != y_train {
        return Err(format!("{model} t{t}: the inference forward differs from training").into());
    }
    let n = t.min(16);
    let got: Vec<f32> = stream.clone_dtoh(&y)?[..n * d]
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let want = host_check(&cfg, gate_up_h, down_h, &x0, ids, ws, n);
    let err = rel_err(&got, &want);
    if !moefuse_testkit::within(err, 2e-2) {
        return Err(
            format!("{model} t{t}: output differs from the host check: rel err {err}").into(),
        );
    }

    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let (mut f_us, mut b_us, mut fb_us) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..(3 + args.samples) {
        let x = &xs[s % sets];
        let (a, b, c) = (
            ctx.new_event(timing)?,
            ctx.new_event(timing)?,
            ctx.new_event(timing)?,
        );
        a.record(stream)?;
        layer.forward(wv, x, t, ext(), &mut y, work)?;
        b.record(stream)?;
        layer.backward(wv, &dy, &mut dx, &mut grads, false, work)?;
        c.record(stream)?;
        c.synchronize()?;
        if s >= 3 {
            f_us.push(a.elapsed_ms(&b)? as f64 * 1e3);
            b_us.push(b.elapsed_ms(&c)? as f64 * 1e3);
            fb_us.push(a.elapsed_ms(&c)? as f64 * 1e3);
        }
    }
    // The forward alone, per layer: Inference (what a server runs) and, where the device
    // runs them, the fused gate_up paths (opt-in, Training and Inference) beside the default.
    let time_forward = |l: &mut MoeLayer, work: &mut MoeWorkspace, y: &mut CudaSlice<bf16>| {
        time_stream(stream, 3, args.samples, |s| -> Result<(), Error> {
            Ok(l.forward(wv, &xs[s % sets], t, ext_set(s), y, work)?)
        })
    };
    let infer_us = time_forward(infer, work, &mut y)?;
    // The Inference forward captured as CUDA graphs, one per routing set, and replayed the
    // way a decode loop runs them: each sample launches every set's graph back to back
    // between two events (the host enqueues ahead of the device, so one launch's host
    // latency is shared by ROUTE_SETS replays) and counts time / sets. The graphs read the
    // captured x (the weights dominate at decode sizes) and their routing in place; the last
    // replay is checked against an eager forward of the same routing.
    let time_graph = |l: &mut MoeLayer, work: &mut MoeWorkspace, y: &mut CudaSlice<bf16>| {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let mut graphs = Vec::with_capacity(route_sets);
        for i in 0..route_sets {
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let captured = l.forward(wv, &xs[0], t, ext_set(i), y, work);
            let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
            captured?;
            graphs.push(graph.ok_or("bench_moe: the capture made no graph")?);
        }
        let batch = time_stream(stream, 3, args.samples, |_| -> Result<(), Error> {
            for g in &graphs {
                g.launch()?;
            }
            Ok(())
        })?;
        let us = Stats {
            median_us: batch.median_us / route_sets as f64,
            iqr_us: batch.iqr_us / route_sets as f64,
            samples: batch.samples,
        };
        let replayed = bits(stream.clone_dtoh(y)?);
        l.forward(wv, &xs[0], t, ext_set(route_sets - 1), y, work)?;
        if bits(stream.clone_dtoh(y)?) != replayed {
            return Err(Error::from(format!(
                "{model} t{t}: the replayed graph differs from an eager forward"
            )));
        }
        Ok::<Stats, Error>(us)
    };
    let graph_us = time_graph(infer, work, &mut y)?;
    // Where the decode kernels can run, the path the layer did not pick, same run: the
    // grouped GEMMs where it decodes, the decode kernels where it does not.
    let other_path = if decode_applies(&cfg, t) {
        let (other, name) = if decode_preferred(&cfg, t) {
            (DecodePath::Never, "moefuse_grouped_path")
        } else {
            (DecodePath::Always, "moefuse_decode_path")
        };
        infer.set_decode_path(other);
        let timed = time_forward(infer, work, &mut y).and_then(|eager| {
            // The timed calls rotated x: check the first input's output.
            infer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
            let got: Vec<f32> = stream.clone_dtoh(&y)?[..n * d]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            Ok((
                eager,
                time_graph(infer, work, &mut y)?,
                rel_err(&got, &want),
            ))
        });
        infer.set_decode_path(DecodePath::Auto);
        Some((name, timed?))
    } else {
        None
    };
    // Each gate_up path forced (the default, Auto, picks one by shape): checked against the
    // host, timed as a Training and an Inference forward, profiled with --profile.
    let mut fused = Vec::new();
    let paths = [
        (GateUpPath::FusedGather, "moefuse_fused_gate_up"),
        (GateUpPath::FusedActivation, "moefuse_fused_activation"),
        (GateUpPath::Unfused, "moefuse_unfused"),
    ];
    let fused_ok = moefuse::gpu::gate_up_fused_supported(stream)?;
    for (path, backend) in paths {
        // At decode sizes the layer runs the decode kernels, whatever the gate_up path.
        if (path != GateUpPath::Unfused && !fused_ok) || decode_preferred(&cfg, t) {
            continue;
        }
        layer.set_gate_up_path(path)?;
        layer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
        let got: Vec<f32> = stream.clone_dtoh(&y)?[..n * d]
            .iter()
            .map(|v| v.to_f32())
            .collect();
        let fused_err = rel_err(&got, &want);
        let us = time_forward(layer, work, &mut y);
        infer.set_gate_up_path(path)?;
        let infer_fused_us = time_forward(infer, work, &mut y);
        infer.set_gate_up_path(GateUpPath::Auto)?;
        if args.profile {
            layer.set_profiling(true);
            layer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
            let f = layer.stage_times()?;
            layer.set_profiling(false);
            let show: Vec<String> = f
                .iter()
                .map(|(n, ms)| format!("{n} {:.0}", ms * 1e3))
                .collect();
            println!(
                "  {model} t{t} {path:?} stages (us): fwd [{}]",
                show.join(", ")
            );
        }
        layer.set_gate_up_path(GateUpPath::Auto)?;
        if !moefuse_testkit::within(fused_err, 2e-2) {
            return Err(format!(
                "{model} t{t}: {path:?} output differs from the host check: {fused_err}"
            )
            .into());
        }
        fused.push((backend, "fwd", us?, fused_err));
        fused.push((backend, "fwd-infer", infer_fused_us?, fused_err));
    }
    if args.profile {
        layer.set_profiling(true);
        layer.forward(wv, &xs[0], t, ext(), &mut y, work)?;
        let f = layer.stage_times()?;
        layer.backward(wv, &dy, &mut dx, &mut grads, false, work)?;
        let b = layer.stage_times()?;
        layer.set_profiling(false);
        let show = |v: Vec<(&str, f32)>| {
            v.iter()
                .map(|(n, ms)| format!("{n} {:.0}", ms * 1e3))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("  {model} t{t} stages (us): fwd [{}]", show(f));
        println!("  {model} t{t} stages (us): bwd [{}]", show(b));
    }
    let fwd_flops = 6.0 * (t * k * d * cfg.intermediate) as f64;
    let rec_as = |backend: &str, phase: &str, st: Stats, flops: f64| Record {
        suite: "moe".into(),
        case: format!("{model}-t{t}-{phase}"),
        backend: backend.into(),
        gpu: gpu.into(),
        gpus: None,
        median_us: st.median_us,
        iqr_us: st.iqr_us,
        tflops: Some(flops / (st.median_us * 1e-6) / 1e12),
        gbps: None,
        rel_err: err,
        date: today(),
        commit: commit(),
    };
    let rec = |phase: &str, st: Stats, flops: f64| rec_as("moefuse", phase, st, flops);
    let mut out = vec![
        rec("fwd", Stats::from_samples(f_us), fwd_flops),
        rec("bwd", Stats::from_samples(b_us), 2.0 * fwd_flops),
        rec("fwdbwd", Stats::from_samples(fb_us), 3.0 * fwd_flops),
        rec("fwd-infer", infer_us, fwd_flops),
        rec("fwd-infer-graph", graph_us, fwd_flops),
    ];
    for (backend, phase, us, fused_err) in fused {
        let mut r = rec_as(backend, phase, us, fwd_flops);
        r.rel_err = fused_err;
        out.push(r);
    }
    if let Some((name, (eager, graph, other_err))) = other_path {
        for (phase, st) in [("fwd-infer", eager), ("fwd-infer-graph", graph)] {
            let mut r = rec_as(name, phase, st, fwd_flops);
            r.rel_err = other_err;
            out.push(r);
        }
    }
    // Decode sizes are bound by the expert weights: the forwards' effective streaming rate
    // (bytes of the experts the routing touches / time).
    if decode_applies(&cfg, t) {
        // Mean over the routing sets the timed forwards rotate through.
        let touched = routes
            .iter()
            .map(|r| r.2.iter().collect::<std::collections::BTreeSet<_>>().len())
            .sum::<usize>() as f64
            / route_sets as f64;
        let bytes = touched * ((cfg.gate_up_width() * d + d * cfg.intermediate) * 2) as f64;
        for r in out.iter_mut().filter(|r| !r.case.ends_with("bwd")) {
            r.gbps = Some(bytes / (r.median_us * 1e-6) / 1e9);
        }
        println!(
            "  {model} t{t}: {touched:.1} experts touched, {:.1} MB of weights (floor {:.1} us at 4.3 TB/s)",
            bytes / 1e6,
            bytes / 4.3e12 * 1e6
        );
    }
    Ok(out)
}
