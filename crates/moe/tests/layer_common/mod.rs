//! What the GPU layer tests share: the cases, their inputs (bf16-exact, so the CPU
//! reference and the GPU see the same values), building a layer with its caller-owned
//! weights and workspace, and a bitwise comparison naming the first differing element.
#![allow(dead_code)]

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse::gpu::{
    ActivationBackwardPath, DecodePath, DeviceWeights, GateUpPath, Mode, MoeLayer, MoePlan,
    MoeWorkspace, Routing,
};
use moefuse::model::MoeWeights;
use moefuse::reference::RoutingInput;
use moefuse::{reference, Activation, GateUpLayout, MoeConfig, RouterKind};
use moefuse_testkit::{check_close, Rng, POISON_BF16};
use std::sync::Arc;

pub fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// Values exactly representable in bf16, so both sides see the same inputs.
pub fn bf_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.uniform() * scale).to_f32())
        .collect()
}

pub fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn f32s(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

#[derive(Clone, Copy)]
pub enum Route {
    Ours,
    /// External routing over the lower half of the experts only (the rest get no rows).
    ExternalLowerHalf,
}

pub struct Case {
    pub name: &'static str,
    pub cfg: MoeConfig,
    pub tokens: usize,
    pub route: Route,
}

pub fn cases() -> Vec<Case> {
    let base = MoeConfig::new(128, 192, 8, 2);
    let grouped = RouterKind::SigmoidGrouped {
        n_group: 4,
        topk_group: 2,
        routed_scaling_factor: 2.5,
        renormalize: true,
    };
    let c = |name, cfg, tokens, route| Case {
        name,
        cfg,
        tokens,
        route,
    };
    vec![
        c("swiglu_split_softmax", base, 300, Route::Ours),
        c(
            "geglu_interleaved_external_zero_experts",
            base.with_activation(Activation::GeGlu)
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::External),
            257,
            Route::ExternalLowerHalf,
        ),
        c(
            "swiglu_oai_interleaved_softmax_raw",
            base.with_activation(Activation::swiglu_oai())
                .with_gate_up_layout(GateUpLayout::Interleaved)
                .with_router(RouterKind::SoftmaxTopK { renormalize: false }),
            130,
            Route::Ours,
        ),
        c(
            "bounded_swiglu_grouped_sigmoid",
            MoeConfig::new(192, 128, 16, 4)
                // NOTES: a clamp inside the bulk of the pre-activations (limit 1.5 with
                // inputs of unit scale) flips for elements within bf16 rounding of the
                // limit, where the GPU's stored h_pre and the f32 reference disagree on
                // whether the clamp is active (zero vs full gradient): 2.2e-2 on d_gate_up
                // in one run. 3.0 keeps the clamp active on a few percent of elements.
                .with_activation(Activation::BoundedSwiGlu { limit: 3.0 })
                .with_router(grouped),
            199,
            Route::Ours,
        ),
        c(
            "relu2_top1",
            MoeConfig::new(128, 128, 8, 1).with_activation(Activation::Relu2),
            333,
            Route::Ours,
        ),
        c(
            "swiglu_top16_every_expert",
            MoeConfig::new(64, 64, 16, 16),
            40,
            Route::Ours,
        ),
        c("single_token", base, 1, Route::Ours),
    ]
    .into_iter()
    // NOTES: under compute-sanitizer (run.sh sanitize sets MOEFUSE_UNDER_SANITIZER) the
    // seven cases of each layer_modes test outlast racecheck's budget (90 s, then 150 s:
    // stopped in the first test's last case, 2026-12-03); three cases keep every stage
    // kind under the tool: the grouped path with softmax routing, top-1 ReLU², and the
    // decode path (one token). layer_gpu's racecheck ran all seven clean.
    .filter(|c| {
        std::env::var_os("MOEFUSE_UNDER_SANITIZER").is_none()
            || ["swiglu_split_softmax", "relu2_top1", "single_token"].contains(&c.name)
    })
    .collect()
}

pub struct Inputs {
    pub w: MoeWeights,
    pub x: Vec<f32>,
    pub logits: Vec<f32>,
    pub ids: Vec<i32>,
    pub weights: Vec<f32>,
    pub dy: Vec<f32>,
}

pub fn inputs(case: &Case, seed: u64) -> Result<Inputs, String> {
    let cfg = &case.cfg;
    let (t, d, i, ex, k, wdt) = (
        case.tokens,
        cfg.hidden,
        cfg.intermediate,
        cfg.experts,
        cfg.top_k,
        cfg.gate_up_width(),
    );
    let mut rng = Rng::new(seed);
    let mut w = MoeWeights::zeros(cfg, matches!(case.route, Route::Ours));
    w.gate_up = bf_vec(&mut rng, ex * wdt * d, 1.0 / (d as f32).sqrt() * 2.0);
    w.down = bf_vec(&mut rng, ex * d * i, 1.0 / (i as f32).sqrt() * 2.0);
    if let Some(r) = w.router.as_mut() {
        *r = bf_vec(&mut rng, ex * d, 1.0);
    }
    if matches!(cfg.router, RouterKind::SigmoidGrouped { .. }) {
        w.router_bias = Some(bf_vec(&mut rng, ex, 0.1));
    }
    let x = bf_vec(&mut rng, t * d, 1.0);
    let logits = match &w.router {
        Some(r) => reference::router::router_logits(cfg, r, &x).map_err(e)?,
        None => Vec::new(),
    };
    // External routing: k distinct experts from the lower half, weights summing to one.
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    if matches!(case.route, Route::ExternalLowerHalf) {
        for _ in 0..t {
            let chosen = rng.distinct(ex / 2, k);
            let raw: Vec<f32> = (0..k).map(|_| 0.1 + (rng.uniform() + 1.0) / 2.0).collect();
            let s: f32 = raw.iter().sum();
            ids.extend(chosen);
            weights.extend(raw.iter().map(|v| v / s));
        }
    }
    let dy = bf_vec(&mut rng, t * d, 1.0);
    Ok(Inputs {
        w,
        x,
        logits,
        ids,
        weights,
        dy,
    })
}

/// A layer with its caller-owned weights (bf16 copies of `w`) and a workspace of exactly
/// the plan's size.
pub struct Built {
    pub layer: MoeLayer,
    pub weights: DeviceWeights,
    pub ws: MoeWorkspace,
}

pub fn build(
    stream: &Arc<CudaStream>,
    cfg: MoeConfig,
    max_tokens: usize,
    w: &MoeWeights,
    mode: Mode,
) -> Result<Built, String> {
    let plan = MoePlan::new(cfg, max_tokens).map_err(e)?;
    Ok(Built {
        layer: MoeLayer::new(stream, &plan, mode).map_err(e)?,
        weights: DeviceWeights::upload(stream, &cfg, w).map_err(e)?,
        ws: MoeWorkspace::new(stream, plan.workspace_bytes(mode)).map_err(e)?,
    })
}

/// Equal bits, else an error naming `what`, the first differing index and both values.
pub fn same_bits<T: Copy + PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, want {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: first difference at [{i}]: {:?} vs {:?}",
            got[i], want[i]
        )),
    }
}

/// bf16 as raw bits (NaN-safe bitwise comparison).
pub fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// f32 as raw bits.
pub fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub const REL: f64 = 2e-2;

/// The rounding scale of `d_topk_weights[s] = ⟨dy[t], y_e⟩` per slot `s = t·k + j` (f64,
/// from the reference's own terms; 0 for a dropped slot): the larger of the two ways the
/// dot is computed, `sqrt(Σ_d (dy[t, d] · y_e[row(s), d])²)` (over D) and
/// `sqrt(Σ_i (g[i] · h[row(s), i])²)` with `g = dy[t] · D_e` (over I: the GPU's down dgrad
/// forms it as `⟨dy·D_e, h⟩` from bf16 `h`). A random walk of per-term roundings gives an
/// error of that scale whatever the dot itself is: when the terms cancel, the dot is far
/// smaller and a bound relative to the dot alone fails on correct results (seed
/// 1796398844076663834 gave 3.4e-2 on a T = 1, k = 2 case). The I-side terms can be far
/// larger than the D-side ones, as `y_e = h·D_eᵀ` itself cancels: with the D side alone,
/// `swiglu_top16_every_expert_t64` (D = I = 64) failed 2 runs in 7 on the H200 at 2.02e-2
/// (seeds 1796526014972188235, 1796529664537685677).
pub fn dot_scales(
    fwd: &reference::ForwardOutput,
    dy: &[f32],
    down: &[f32],
    d: usize,
    i: usize,
) -> Vec<f64> {
    fwd.permutation
        .row_of
        .iter()
        .enumerate()
        .map(|(s, &row)| {
            if row < 0 {
                return 0.0;
            }
            let t = s / fwd.routing.top_k;
            let e = fwd.routing.topk_ids[s] as usize;
            let row = row as usize;
            let ye = &fwd.y_e[row * d..(row + 1) * d];
            let g = &dy[t * d..(t + 1) * d];
            let over_d = g
                .iter()
                .zip(ye)
                .map(|(a, b)| (f64::from(*a) * f64::from(*b)).powi(2))
                .sum::<f64>();
            let d_e = &down[e * d * i..(e + 1) * d * i];
            let h = &fwd.h[row * i..(row + 1) * i];
            let over_i = (0..i)
                .map(|c| {
                    let gc: f64 = (0..d)
                        .map(|r| f64::from(g[r]) * f64::from(d_e[r * i + c]))
                        .sum();
                    (gc * f64::from(h[c])).powi(2)
                })
                .sum::<f64>();
            over_d.max(over_i).sqrt()
        })
        .collect()
}

/// Dot products checked against their rounding scale: every element within
/// `bound · max(|want|, scale)` (so a well-conditioned dot is held to `bound` relative,
/// a cancelling one to `bound` of its terms' scale); a NaN on one side only fails.
pub fn check_dots(
    got: &[f32],
    want: &[f32],
    scale: &[f64],
    bound: f64,
    what: &str,
) -> Result<f64, String> {
    let mut worst = 0f64;
    for (s, ((&g, &w), &q)) in got.iter().zip(want).zip(scale).enumerate() {
        if g.is_nan() != w.is_nan() {
            return Err(format!("{what}: element {s} is {g}, want {w}"));
        }
        let tol = f64::from(w).abs().max(q);
        let err = (f64::from(g) - f64::from(w)).abs();
        let ratio = if tol > 0.0 { err / tol } else { err };
        if !moefuse_testkit::within(ratio, bound) {
            return Err(format!(
                "{what}: element {s} is {g}, want {w} (error {err:.3e}, scale {q:.3e}: {ratio:.3e} >= {bound:e})"
            ));
        }
        worst = worst.max(ratio);
    }
    Ok(worst)
}

/// The decode path (`decode`) or the grouped-GEMM path.
fn set_decode(layer: &mut MoeLayer, decode: bool) {
    layer.set_decode_path(if decode {
        DecodePath::Always
    } else {
        DecodePath::Never
    });
}

/// One forward + backward of `case` on the GPU against the reference.
///
/// With `decode`, the layer takes the decode path wherever it
/// can run (`T <= 64`, [`DecodePath::Always`]), else the grouped-GEMM path at every `T`.
/// `max_tokens`: the layer's plan (the forward's GEMMs take the band of the call's rows per
/// expert, the backward's the plan's); `None` plans for the case's tokens plus 17.
pub fn check_case(
    stream: &Arc<CudaStream>,
    case: &Case,
    seed: u64,
    decode: bool,
    gate_up: GateUpPath,
    activation_backward: ActivationBackwardPath,
    max_tokens: Option<usize>,
) -> Result<(), String> {
    let cfg = case.cfg;
    let max_tokens = max_tokens.unwrap_or(case.tokens + 17);
    let (t, d, ex, k) = (case.tokens, cfg.hidden, cfg.experts, cfg.top_k);
    let what = |m: &str| format!("{} (seed {seed}): {m}", case.name);
    let inp = inputs(case, seed)?;
    let routing_in = match case.route {
        Route::Ours => RoutingInput::Ours,
        Route::ExternalLowerHalf => RoutingInput::External {
            topk_ids: &inp.ids,
            topk_weights: &inp.weights,
        },
    };
    let fwd = reference::forward(&cfg, &inp.w, &inp.x, routing_in).map_err(e)?;
    let grads = reference::backward(&cfg, &inp.w, &inp.x, &fwd, &inp.dy).map_err(e)?;

    let Built {
        mut layer,
        weights: dw,
        ws,
    } = build(stream, cfg, max_tokens, &inp.w, Mode::Training)?;
    set_decode(&mut layer, decode);
    layer.set_gate_up_path(gate_up).map_err(e)?;
    layer
        .set_activation_backward_path(activation_backward)
        .map_err(e)?;
    // Exactly what the layer's paths need (below the plan's size on sm_90a).
    drop(ws);
    let mut ws = MoeWorkspace::new(stream, layer.workspace_bytes()).map_err(e)?;
    let wv = dw.view();
    let x_d = stream.clone_htod(&to_bf(&inp.x)).map_err(e)?;
    let dy_d = stream.clone_htod(&to_bf(&inp.dy)).map_err(e)?;
    let mut y_d = stream.clone_htod(&vec![POISON_BF16; t * d]).map_err(e)?;
    let logits_d: CudaSlice<f32>;
    let (ids_d, w_d);
    let routing = match case.route {
        Route::Ours => {
            logits_d = stream.clone_htod(&inp.logits).map_err(e)?;
            Routing::Logits(&logits_d)
        }
        Route::ExternalLowerHalf => {
            ids_d = stream.clone_htod(&inp.ids).map_err(e)?;
            w_d = stream.clone_htod(&inp.weights).map_err(e)?;
            Routing::External {
                topk_ids: &ids_d,
                topk_weights: &w_d,
            }
        }
    };
    layer
        .forward(&wv, &x_d, t, routing, &mut y_d, &mut ws)
        .map_err(e)?;
    let (ids, _) = layer.routing().ok_or(what("no routing in the layer"))?;
    let ids = stream.clone_dtoh(ids).map_err(e)?;
    if ids[..t * k] != fwd.routing.topk_ids[..] {
        return Err(what("routing differs from the reference"));
    }
    let y = f32s(&stream.clone_dtoh(&y_d).map_err(e)?);
    check_close(&y, &fwd.y, REL, &what("y"))?;

    let mut g = layer.gradients().map_err(e)?;
    let mut dx_d = stream.clone_htod(&vec![POISON_BF16; t * d]).map_err(e)?;
    layer
        .backward(&wv, &dy_d, &mut dx_d, &mut g, false, &mut ws)
        .map_err(e)?;
    let mut dx = f32s(&stream.clone_dtoh(&dx_d).map_err(e)?);
    let d_gate_up = f32s(&stream.clone_dtoh(&g.d_gate_up).map_err(e)?);
    let d_down = f32s(&stream.clone_dtoh(&g.d_down).map_err(e)?);
    let dtw = stream.clone_dtoh(&g.d_topk_weights).map_err(e)?;
    check_dots(
        &dtw[..t * k],
        &grads.d_topk_weights,
        &dot_scales(&fwd, &inp.dy, &inp.w.down, d, case.cfg.intermediate),
        REL,
        &what("d_topk_weights"),
    )?;
    check_close(&d_down, &grads.d_down, REL, &what("d_down"))?;
    check_close(&d_gate_up, &grads.d_gate_up, REL, &what("d_gate_up"))?;
    if let (Some(want_dl), Some(router)) = (&grads.d_logits, &inp.w.router) {
        let dl = stream.clone_dtoh(&g.d_logits).map_err(e)?;
        // Top-1 with renormalisation: the weight is p/p = 1, so d_logits is exactly zero
        // (the reference's is rounding noise): compare absolutely there.
        let zero = want_dl.iter().all(|v| v.abs() < 1e-6);
        if zero {
            let worst = dl[..t * ex].iter().fold(0f32, |m, v| m.max(v.abs()));
            if !moefuse_testkit::within(f64::from(worst), 1e-5) {
                return Err(what(&format!(
                    "d_logits must be ~0, max |d_logits| = {worst}"
                )));
            }
        } else {
            // The router backward itself, on the GPU's own d_topk_weights (checked above):
            // d_logits = p (g - <p, g>) cancels when g is nearly constant across a token's
            // experts, so against the reference's d_logits the bf16 error of g is amplified
            // (7.7e-2 on one token, seed 1796288097000233052). Many tokens average that out.
            let own = reference::route_backward(&cfg, &inp.logits, &fwd.routing, &dtw[..t * k])
                .map_err(e)?;
            check_close(
                &dl[..t * ex],
                &own,
                REL,
                &what("d_logits (router backward)"),
            )?;
            if t >= 32 {
                check_close(&dl[..t * ex], want_dl, REL, &what("d_logits"))?;
            }
        }
        // The router matrix's share of dx is the caller's: add it before comparing.
        for tok in 0..t {
            for ei in 0..ex {
                let gl = dl[tok * ex + ei];
                for c in 0..d {
                    dx[tok * d + c] += gl * router[ei * d + c];
                }
            }
        }
    }
    check_close(&dx, &grads.dx, REL, &what("dx"))?;

    // Accumulate: a second backward adds the same weight gradients.
    layer
        .backward(&wv, &dy_d, &mut dx_d, &mut g, true, &mut ws)
        .map_err(e)?;
    let twice = f32s(&stream.clone_dtoh(&g.d_down).map_err(e)?);
    let want: Vec<f32> = grads.d_down.iter().map(|v| 2.0 * v).collect();
    check_close(&twice, &want, REL, &what("d_down accumulated twice"))?;
    Ok(())
}

/// Forward + backward captured once, replayed with new x, logits (so new routing), dy and
/// weights written into the caller's buffers: equal to eager bit for bit; `decode` as for
/// [`check_case`].
pub fn graph_replay_case(ctx: &Arc<CudaContext>, case: &Case, decode: bool) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // A fresh handle on the device's primary context that never creates a stream of its
    // own stays out of cudarc's multi-stream mode, so cudarc records no per-buffer events
    // (which must not enter the captured graph); capture runs on the per-thread default
    // stream (the legacy stream cannot be captured). No tracking opt-out is needed.
    let ctx = &CudaContext::new(ctx.ordinal()).map_err(e)?;
    let stream = ctx.per_thread_stream();
    let (t, d) = (case.tokens, case.cfg.hidden);
    let seed = Rng::fresh_seed();
    let inp = inputs(case, seed)?;
    let Built {
        mut layer,
        weights: mut dw,
        mut ws,
    } = build(&stream, case.cfg, t, &inp.w, Mode::Training)?;
    set_decode(&mut layer, decode);
    let mut x_d = stream.clone_htod(&to_bf(&inp.x)).map_err(e)?;
    let mut l_d = stream.clone_htod(&inp.logits).map_err(e)?;
    let mut dy_d = stream.clone_htod(&to_bf(&inp.dy)).map_err(e)?;
    let mut y_d = stream.alloc_zeros::<bf16>(t * d).map_err(e)?;
    let mut dx_d = stream.alloc_zeros::<bf16>(t * d).map_err(e)?;
    let mut g = layer.gradients().map_err(e)?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let wv = dw.view();
    let captured = layer
        .forward(&wv, &x_d, t, Routing::Logits(&l_d), &mut y_d, &mut ws)
        .and_then(|_| layer.backward(&wv, &dy_d, &mut dx_d, &mut g, false, &mut ws));
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured.map_err(|x| format!("under capture: {x}"))?;
    let graph = graph.ok_or("no graph")?;
    for i in 1..4u64 {
        let inp = inputs(case, seed.wrapping_add(i))?;
        stream.memcpy_htod(&to_bf(&inp.x), &mut x_d).map_err(e)?;
        stream.memcpy_htod(&inp.logits, &mut l_d).map_err(e)?;
        stream.memcpy_htod(&to_bf(&inp.dy), &mut dy_d).map_err(e)?;
        // A weight update in place (the layer borrows the buffers, the graph reads them).
        stream
            .memcpy_htod(&to_bf(&inp.w.gate_up), &mut dw.gate_up)
            .map_err(e)?;
        stream
            .memcpy_htod(&to_bf(&inp.w.down), &mut dw.down)
            .map_err(e)?;
        graph.launch().map_err(e)?;
        let (y1, dx1, dw1) = (
            stream.clone_dtoh(&y_d).map_err(e)?,
            stream.clone_dtoh(&dx_d).map_err(e)?,
            stream.clone_dtoh(&g.d_gate_up).map_err(e)?,
        );
        let wv = dw.view();
        layer
            .forward(&wv, &x_d, t, Routing::Logits(&l_d), &mut y_d, &mut ws)
            .map_err(e)?;
        layer
            .backward(&wv, &dy_d, &mut dx_d, &mut g, false, &mut ws)
            .map_err(e)?;
        let what = |m: &str| format!("replay {i} (seed {seed}): {m} differs from eager");
        let y2 = stream.clone_dtoh(&y_d).map_err(e)?;
        same_bits(&what("y"), &bits(&y1), &bits(&y2))?;
        let dx2 = stream.clone_dtoh(&dx_d).map_err(e)?;
        same_bits(&what("dx"), &bits(&dx1), &bits(&dx2))?;
        let dw2 = stream.clone_dtoh(&g.d_gate_up).map_err(e)?;
        same_bits(&what("d_gate_up"), &bits(&dw1), &bits(&dw2))?;
        // The replay saw the new weights: y matches the reference of this iteration.
        let want = reference::forward(&case.cfg, &inp.w, &inp.x, RoutingInput::Ours).map_err(e)?;
        check_close(&f32s(&y2), &want.y, REL, &what("y vs reference"))?;
    }
    Ok(())
}
