//! GPU tests of the layer's modes and its plan/run structure: an Inference forward equals a
//! Training forward bit for bit (and holds nothing for a backward, which it refuses);
//! forward and backward are deterministic; an Inference forward graph replayed with new
//! device routing read in place equals eager; the layer reads the caller's weights as they
//! are at each call; a Training backward is unaffected by other layers using the shared
//! workspace in between; each layer's memory is what its plan predicts.

#![forbid(unsafe_code)]

mod layer_common;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use layer_common::{
    bits, bits32, build, cases, e, inputs, same_bits, to_bf, Built, Case, Inputs, Route,
};
use moefuse::gpu::{
    DecodePath, DeviceWeights, GateUpPath, LayerMemory, Mode, MoeLayer, MoePlan, MoeWorkspace,
    Routing,
};
use moefuse::MoeError;
use moefuse_testkit::{GpuSuite, Rng};
use std::sync::Arc;

/// A case's inputs on the device.
struct Dev {
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    logits: Option<CudaSlice<f32>>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
}

impl Dev {
    fn new(stream: &Arc<CudaStream>, case: &Case, inp: &Inputs) -> Result<Self, String> {
        // External routing only; a placeholder element otherwise (no zero-length buffer).
        fn or_one<T: Copy + Default>(v: &[T]) -> Vec<T> {
            if v.is_empty() {
                vec![T::default()]
            } else {
                v.to_vec()
            }
        }
        Ok(Dev {
            x: stream.clone_htod(&to_bf(&inp.x)).map_err(e)?,
            dy: stream.clone_htod(&to_bf(&inp.dy)).map_err(e)?,
            logits: match case.route {
                Route::Ours => Some(stream.clone_htod(&inp.logits).map_err(e)?),
                Route::ExternalLowerHalf => None,
            },
            ids: stream.clone_htod(&or_one(&inp.ids)).map_err(e)?,
            weights: stream.clone_htod(&or_one(&inp.weights)).map_err(e)?,
        })
    }

    fn routing(&self) -> Routing<'_> {
        match &self.logits {
            Some(l) => Routing::Logits(l),
            None => Routing::External {
                topk_ids: &self.ids,
                topk_weights: &self.weights,
            },
        }
    }
}

/// A case's device inputs and a Training layer with its weights and workspace.
struct Trained {
    t: usize,
    dev: Dev,
    built: Built,
}

fn trained(stream: &Arc<CudaStream>, case: &Case, seed: u64) -> Result<Trained, String> {
    let inp = inputs(case, seed)?;
    Ok(Trained {
        t: case.tokens,
        dev: Dev::new(stream, case, &inp)?,
        built: build(stream, case.cfg, case.tokens, &inp.w, Mode::Training)?,
    })
}

/// One forward of `layer` into a fresh poisoned `y`, returned as bits.
fn forward_bits(
    stream: &Arc<CudaStream>,
    layer: &mut MoeLayer,
    w: &DeviceWeights,
    dev: &Dev,
    t: usize,
    ws: &mut MoeWorkspace,
) -> Result<Vec<u16>, String> {
    let d = layer.config().hidden;
    let mut y = stream
        .clone_htod(&vec![moefuse_testkit::POISON_BF16; t * d])
        .map_err(e)?;
    layer
        .forward(&w.view(), &dev.x, t, dev.routing(), &mut y, ws)
        .map_err(e)?;
    Ok(bits(&stream.clone_dtoh(&y).map_err(e)?))
}

/// A backward of the last forward: dx and every gradient, as bits.
fn backward_bits(
    stream: &Arc<CudaStream>,
    layer: &mut MoeLayer,
    w: &DeviceWeights,
    dev: &Dev,
    t: usize,
    ws: &mut MoeWorkspace,
) -> Result<Vec<(&'static str, Vec<u32>)>, String> {
    let d = layer.config().hidden;
    let mut dx = stream.alloc_zeros::<bf16>(t * d).map_err(e)?;
    let mut g = layer.gradients().map_err(e)?;
    layer
        .backward(&w.view(), &dev.dy, &mut dx, &mut g, false, ws)
        .map_err(e)?;
    let wide = |v: Vec<u16>| v.into_iter().map(u32::from).collect::<Vec<_>>();
    let get16 = |b: &CudaSlice<bf16>| stream.clone_dtoh(b).map(|v| wide(bits(&v))).map_err(e);
    let get32 = |b: &CudaSlice<f32>| stream.clone_dtoh(b).map(|v| bits32(&v)).map_err(e);
    Ok(vec![
        ("dx", get16(&dx)?),
        ("d_gate_up", get16(&g.d_gate_up)?),
        ("d_down", get16(&g.d_down)?),
        ("d_topk_weights", get32(&g.d_topk_weights)?),
        ("d_logits", get32(&g.d_logits)?),
    ])
}

fn same_all(what: &str, a: &[(&str, Vec<u32>)], b: &[(&str, Vec<u32>)]) -> Result<(), String> {
    for ((name, x), (_, y)) in a.iter().zip(b) {
        same_bits(&format!("{what}: {name}"), y, x)?;
    }
    Ok(())
}

/// `memory()` is the plan's prediction plus the GEMM workspace.
fn memory_matches_plan(layer: &MoeLayer, plan: &MoePlan) -> Result<(), String> {
    let got = layer.memory();
    let want = plan.memory(layer.mode());
    if (LayerMemory {
        gemm_workspace: 0,
        ..got
    }) != want
        || got.gemm_workspace == 0
    {
        return Err(format!(
            "{} memory {got:?}, plan says {want:?}",
            layer.mode()
        ));
    }
    Ok(())
}

/// Per case: one set of caller weights and one workspace shared by a Training and an
/// Inference layer; the Inference forward equals the Training one bit for bit, keeps
/// nothing, refuses a backward; a Training backward run after the Inference forward reused
/// the workspace equals one run right after its own forward.
fn inference_matches_training(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let seed = Rng::fresh_seed();
    for (n, case) in cases().iter().enumerate() {
        let seed = seed.wrapping_add(n as u64);
        let what = |m: &str| format!("{} (seed {seed}): {m}", case.name);
        let Trained {
            t,
            dev,
            built:
                Built {
                    layer: mut train,
                    weights: w,
                    mut ws,
                },
        } = trained(&stream, case, seed)?;
        let plan = *train.plan();
        let mut infer = MoeLayer::new(&stream, &plan, Mode::Inference).map_err(e)?;
        memory_matches_plan(&train, &plan)?;
        memory_matches_plan(&infer, &plan)?;
        if infer.memory().saved_for_backward() != 0 || infer.memory().activations != 0 {
            return Err(what(&format!("inference keeps {}", infer.memory())));
        }
        let y_train = forward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        let grads_a = backward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        let y_infer = forward_bits(&stream, &mut infer, &w, &dev, t, &mut ws)?;
        same_bits(&what("inference y vs training y"), &y_infer, &y_train)?;
        forward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        forward_bits(&stream, &mut infer, &w, &dev, t, &mut ws)?; // clobbers the workspace
        let grads_b = backward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        same_all(
            &what("backward after a shared-workspace forward"),
            &grads_a,
            &grads_b,
        )?;
        let mut dx = stream.alloc_zeros::<bf16>(t * case.cfg.hidden).map_err(e)?;
        let mut g = train.gradients().map_err(e)?;
        match infer.backward(&w.view(), &dev.dy, &mut dx, &mut g, false, &mut ws) {
            Err(MoeError::NotTraining {
                mode: Mode::Inference,
            }) => {}
            other => return Err(what(&format!("backward after inference: {other:?}"))),
        }
        if !matches!(infer.gradients(), Err(MoeError::NotTraining { .. })) {
            return Err(what("gradients() of an inference layer"));
        }
        train.take_routing_errors().map_err(e)?;
        infer.take_routing_errors().map_err(e)?;
        println!("{} ok", case.name);
    }
    Ok(())
}

/// Two runs of forward + backward (Training) and of forward (Inference) give identical
/// bits in every output.
fn deterministic(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let seed = Rng::fresh_seed();
    for case in &cases() {
        let what = |m: &str| format!("{} (seed {seed}): {m}", case.name);
        let (inp, t) = (inputs(case, seed)?, case.tokens);
        let dev = Dev::new(&stream, case, &inp)?;
        for mode in [Mode::Training, Mode::Inference] {
            let Built {
                mut layer,
                weights: w,
                mut ws,
            } = build(&stream, case.cfg, t, &inp.w, mode)?;
            let y1 = forward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
            let g1 = match mode {
                Mode::Training => backward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?,
                Mode::Inference => Vec::new(),
            };
            let y2 = forward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
            same_bits(&what(&format!("{mode} y, run 2 vs 1")), &y2, &y1)?;
            if mode == Mode::Training {
                let g2 = backward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
                same_all(&what("backward run 2 vs 1"), &g1, &g2)?;
            }
        }
    }
    Ok(())
}

/// An Inference forward with device routing, captured once and replayed after new x, ids
/// and weights were written into the caller's buffers (the layer reads them in place):
/// equal to eager bit for bit, and to the reference's routing.
fn inference_graph_replay(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // A fresh handle on the primary context that never creates a stream of its own stays
    // out of cudarc's multi-stream mode (no per-buffer events enter the graph); capture
    // runs on the per-thread default stream.
    let ctx = &CudaContext::new(ctx.ordinal()).map_err(e)?;
    let stream = ctx.per_thread_stream();
    let case = &cases()[1];
    let (t, d) = (case.tokens, case.cfg.hidden);
    let seed = Rng::fresh_seed();
    let inp = inputs(case, seed)?;
    let mut dev = Dev::new(&stream, case, &inp)?;
    let Built {
        mut layer,
        weights: w,
        mut ws,
    } = build(&stream, case.cfg, t, &inp.w, Mode::Inference)?;
    let mut y = stream.alloc_zeros::<bf16>(t * d).map_err(e)?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let captured = layer.forward(&w.view(), &dev.x, t, dev.routing(), &mut y, &mut ws);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured.map_err(|x| format!("under capture: {x}"))?;
    let graph = graph.ok_or("no graph")?;
    for i in 1..4u64 {
        let next = inputs(case, seed.wrapping_add(i))?;
        stream.memcpy_htod(&to_bf(&next.x), &mut dev.x).map_err(e)?;
        stream.memcpy_htod(&next.ids, &mut dev.ids).map_err(e)?;
        stream
            .memcpy_htod(&next.weights, &mut dev.weights)
            .map_err(e)?;
        graph.launch().map_err(e)?;
        let replayed = bits(&stream.clone_dtoh(&y).map_err(e)?);
        let eager = forward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
        same_bits(
            &format!("replay {i} (seed {seed}) vs eager"),
            &replayed,
            &eager,
        )?;
        layer.take_routing_errors().map_err(e)?;
    }
    Ok(())
}

/// The layer borrows the weights: doubling `down` in the caller's buffer doubles `y`
/// exactly (a power-of-two scale commutes with every rounding on the way).
fn sees_weight_updates(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    let case = &cases()[0];
    let t = case.tokens;
    let inp = inputs(case, 7)?;
    let dev = Dev::new(&stream, case, &inp)?;
    let Built {
        mut layer,
        weights: mut w,
        mut ws,
    } = build(&stream, case.cfg, t, &inp.w, Mode::Inference)?;
    let y1 = forward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
    let doubled: Vec<f32> = inp.w.down.iter().map(|v| 2.0 * v).collect();
    stream
        .memcpy_htod(&to_bf(&doubled), &mut w.down)
        .map_err(e)?;
    let y2 = forward_bits(&stream, &mut layer, &w, &dev, t, &mut ws)?;
    let twice: Vec<u16> = y1
        .iter()
        .map(|&b| bf16::from_f32(2.0 * bf16::from_bits(b).to_f32()).to_bits())
        .collect();
    same_bits("y after doubling down vs 2·y", &y2, &twice)
}

/// The fused gate_up paths (opt-in, sm_90a) against the default stages: y and every
/// gradient within the bf16 bound (h_pre is not rounded before the activation when fused,
/// so not bit for bit); a fused Inference forward equals a fused Training forward bit for
/// bit; both fused paths give the same bits.
fn fused_gate_up_matches_unfused(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.new_stream().map_err(e)?;
    if !moefuse::gpu::gate_up_fused_supported(&stream).map_err(e)? {
        println!("no fused gate_up for this device or build (sm_90a, sm_100a); nothing to compare");
        return Ok(());
    }
    let seed = Rng::fresh_seed();
    let as_f32 = |v: &[u32], wide: bool| -> Vec<f32> {
        v.iter()
            .map(|&b| {
                if wide {
                    f32::from_bits(b)
                } else {
                    bf16::from_bits(b as u16).to_f32()
                }
            })
            .collect()
    };
    for (n, case) in cases().iter().enumerate() {
        let seed = seed.wrapping_add(n as u64);
        let what = |m: &str| format!("{} (seed {seed}): {m}", case.name);
        let Trained {
            t,
            dev,
            built:
                Built {
                    layer: mut train,
                    weights: w,
                    mut ws,
                },
        } = trained(&stream, case, seed)?;
        let plan = *train.plan();
        // The fused gate_up is a stage of the grouped path: keep every T on it.
        train.set_decode_path(DecodePath::Never);
        train.set_gate_up_path(GateUpPath::Unfused).map_err(e)?;
        let y_plain = forward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        let g_plain = backward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
        let mut fused_y = Vec::new();
        for path in [GateUpPath::FusedActivation, GateUpPath::FusedGather] {
            let what = |m: &str| what(&format!("{path:?}: {m}"));
            train.set_gate_up_path(path).map_err(e)?;
            let y_fused = forward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
            let g_fused = backward_bits(&stream, &mut train, &w, &dev, t, &mut ws)?;
            let y32 = |v: &[u16]| {
                v.iter()
                    .map(|&b| bf16::from_bits(b).to_f32())
                    .collect::<Vec<_>>()
            };
            moefuse_testkit::check_close(&y32(&y_fused), &y32(&y_plain), 2e-2, &what("fused y"))?;
            let max_abs = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = g_plain
                .iter()
                .find(|(name, _)| *name == "d_topk_weights")
                .map_or(1.0, |(_, v)| max_abs(&as_f32(v, true)));
            for ((name, a), (_, b)) in g_fused.iter().zip(&g_plain) {
                let wide = name.starts_with("d_topk") || name.starts_with("d_logits");
                let (a, b) = (as_f32(a, wide), as_f32(b, wide));
                // A gradient that is zero in exact arithmetic (d_logits when the layer did
                // not route, or of a renormalised top-1 weight, which is constant 1) holds
                // rounding noise on both paths: its relative error means nothing. Both
                // must stay at noise level instead.
                let noise = 1e-4 * scale;
                if max_abs(&b) <= noise {
                    if max_abs(&a) > noise {
                        return Err(what(&format!(
                            "fused {name}: max {} where the default path gives noise",
                            max_abs(&a)
                        )));
                    }
                    continue;
                }
                moefuse_testkit::check_close(&a, &b, 2e-2, &what(&format!("fused {name}")))?;
            }
            let mut infer = MoeLayer::new(&stream, &plan, Mode::Inference).map_err(e)?;
            infer.set_decode_path(DecodePath::Never);
            infer.set_gate_up_path(path).map_err(e)?;
            let y_infer = forward_bits(&stream, &mut infer, &w, &dev, t, &mut ws)?;
            same_bits(
                &what("fused inference y vs fused training y"),
                &y_infer,
                &y_fused,
            )?;
            infer.take_routing_errors().map_err(e)?;
            fused_y.push(y_fused);
        }
        // The same GEMM over the same rows in the same order: gathering them in the
        // producer or reading x_perm changes no bit.
        same_bits(
            &what("FusedGather y vs FusedActivation y"),
            &fused_y[1],
            &fused_y[0],
        )?;
        train.set_gate_up_path(GateUpPath::Unfused).map_err(e)?;
        train.take_routing_errors().map_err(e)?;
        println!("{} ok", case.name);
    }
    Ok(())
}

fn main() {
    GpuSuite::new()
        .test(
            "moe_layer_inference_matches_training",
            inference_matches_training,
        )
        .test("moe_layer_deterministic", deterministic)
        .test("moe_layer_inference_graph_replay", inference_graph_replay)
        .test("moe_layer_sees_weight_updates", sees_weight_updates)
        .test(
            "moe_layer_fused_gate_up_matches_unfused",
            fused_gate_up_matches_unfused,
        )
        .run()
}
