//! A Qwen3-30B-A3B-sized MoE layer (hidden 2048, intermediate 768, 128 experts, top-8,
//! softmax router, SwiGLU) on one GPU: plan once, upload the weights the caller owns, one
//! workspace shared by a Training and an Inference layer; forward and backward checked
//! against the CPU reference on a small batch, then timed at 8192 tokens with TFLOP/s and
//! each mode's memory printed.
//!
//! `cargo run --release -p moefuse --example qwen3_moe [tokens]`
//!
//! Without a GPU it prints why and runs the CPU reference of a small layer instead.

#![forbid(unsafe_code)]

use half::bf16;
use moefuse::gpu::{DeviceWeights, Mode, MoeLayer, MoePlan, MoeWorkspace, Routing};
use moefuse::model::MoeWeights;
use moefuse::reference::{self, RoutingInput};
use moefuse::MoeConfig;
use std::time::Instant;

/// SplitMix64 in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// `n` values exactly representable in bf16, scaled.
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| bf16::from_f32(self.next() * scale).to_f32())
            .collect()
    }
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn weights(cfg: &MoeConfig, rng: &mut Rng) -> MoeWeights {
    let (d, i, e, w) = (
        cfg.hidden,
        cfg.intermediate,
        cfg.experts,
        cfg.gate_up_width(),
    );
    let mut m = MoeWeights::zeros(cfg, true);
    m.gate_up = rng.vec(e * w * d, 1.7 / (d as f32).sqrt());
    m.down = rng.vec(e * d * i, 1.7 / (i as f32).sqrt());
    m.router = Some(rng.vec(e * d, 1.0 / (d as f32).sqrt()));
    m
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens: usize = std::env::args()
        .nth(1)
        .map(|t| t.parse())
        .transpose()?
        .unwrap_or(8192);
    let mut rng = Rng(0x5157_3330);
    // The testkit's probe turns "no driver" (cudarc panics) into a reason, quietly.
    let ctx = match moefuse_testkit::gpu() {
        Ok(ctx) => ctx,
        Err(why) => {
            println!("SKIPPED GPU: {why}; running the CPU reference of a small layer");
            let cfg = MoeConfig::new(256, 128, 16, 4);
            let w = weights(&cfg, &mut rng);
            let t = 64;
            let x = rng.vec(t * cfg.hidden, 1.0);
            let start = Instant::now();
            let fwd = reference::forward(&cfg, &w, &x, RoutingInput::Ours)?;
            let dy = rng.vec(t * cfg.hidden, 1.0);
            let g = reference::backward(&cfg, &w, &x, &fwd, &dy)?;
            println!(
            "CPU reference: {t} tokens, D={} I={} E={} top-{}: fwd+bwd {:.1} ms, |y| = {:.3}, |dx| = {:.3}",
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.top_k,
            start.elapsed().as_secs_f64() * 1e3,
            fwd.y.iter().map(|v| v * v).sum::<f32>().sqrt(),
            g.dx.iter().map(|v| v * v).sum::<f32>().sqrt()
        );
            return Ok(());
        }
    };
    let stream = ctx.new_stream()?;
    let cfg = MoeConfig::new(2048, 768, 128, 8);
    let (d, e, k, i) = (cfg.hidden, cfg.experts, cfg.top_k, cfg.intermediate);
    println!(
        "{}: Qwen3-30B-A3B MoE layer, D={d} I={i} E={e} top-{k}, {tokens} tokens",
        ctx.name()?
    );
    let w = weights(&cfg, &mut rng);
    let plan = MoePlan::new(cfg, tokens.max(64))?; // validates and sizes everything, host only
    let dw = DeviceWeights::upload(&stream, &cfg, &w)?; // the caller's; layers borrow views
    let mut layer = MoeLayer::new(&stream, &plan, Mode::Training)?;
    let mut infer = MoeLayer::new(&stream, &plan, Mode::Inference)?;
    // One workspace shared by both layers: what their paths need (the plan's
    // `workspace_bytes(mode)` is the bound that fits any device).
    let ws_bytes = layer.workspace_bytes().max(infer.workspace_bytes());
    let mut ws = MoeWorkspace::new(&stream, ws_bytes)?;
    for l in [&layer, &infer] {
        println!("memory, {}", l.memory());
    }
    println!(
        "shared workspace {:.1} MiB",
        ws.bytes() as f64 / (1u64 << 20) as f64
    );
    let router = w.router.clone().expect("router");
    let to_bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();

    // 1. A small batch against the CPU reference.
    let t = 64;
    let x = rng.vec(t * d, 1.0);
    let dy = rng.vec(t * d, 1.0);
    let fwd = reference::forward(&cfg, &w, &x, RoutingInput::Ours)?;
    let want = reference::backward(&cfg, &w, &x, &fwd, &dy)?;
    let logits = reference::router::router_logits(&cfg, &router, &x)?;
    let (x_d, dy_d, l_d) = (
        stream.clone_htod(&to_bf(&x))?,
        stream.clone_htod(&to_bf(&dy))?,
        stream.clone_htod(&logits)?,
    );
    let mut y_d = stream.alloc_zeros::<bf16>(t * d)?;
    let mut dx_d = stream.alloc_zeros::<bf16>(t * d)?;
    let mut grads = layer.gradients()?;
    let wv = dw.view();
    layer.forward(&wv, &x_d, t, Routing::Logits(&l_d), &mut y_d, &mut ws)?;
    layer.backward(&wv, &dy_d, &mut dx_d, &mut grads, false, &mut ws)?;
    let f = |v: Vec<bf16>| v.into_iter().map(|x| x.to_f32()).collect::<Vec<_>>();
    let y = f(stream.clone_dtoh(&y_d)?);
    let mut dx = f(stream.clone_dtoh(&dx_d)?);
    let dl = stream.clone_dtoh(&grads.d_logits)?;
    for tok in 0..t {
        for ex in 0..e {
            for c in 0..d {
                dx[tok * d + c] += dl[tok * e + ex] * router[ex * d + c];
            }
        }
    }
    let d_down = f(stream.clone_dtoh(&grads.d_down)?);
    println!(
        "check vs CPU reference ({t} tokens): rel err y {:.1e}, dx {:.1e}, d_down {:.1e}",
        rel(&y, &fwd.y),
        rel(&dx, &want.dx),
        rel(&d_down, &want.d_down)
    );

    // 2. Timing at `tokens`.
    let x_d = stream.clone_htod(&to_bf(&rng.vec(tokens * d, 1.0)))?;
    let dy_d = stream.clone_htod(&to_bf(&rng.vec(tokens * d, 1.0)))?;
    let l_d = stream.clone_htod(&rng.vec(tokens * e, 2.0))?;
    let mut y_d = stream.alloc_zeros::<bf16>(tokens * d)?;
    let mut dx_d = stream.alloc_zeros::<bf16>(tokens * d)?;
    let ev = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
    let (mut fwd_ms, mut bwd_ms, mut inf_ms) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..13 {
        let (a, b, c, d) = (ev()?, ev()?, ev()?, ev()?);
        a.record(&stream)?;
        layer.forward(&wv, &x_d, tokens, Routing::Logits(&l_d), &mut y_d, &mut ws)?;
        b.record(&stream)?;
        layer.backward(&wv, &dy_d, &mut dx_d, &mut grads, false, &mut ws)?;
        c.record(&stream)?;
        infer.forward(&wv, &x_d, tokens, Routing::Logits(&l_d), &mut y_d, &mut ws)?;
        d.record(&stream)?;
        d.synchronize()?;
        if it >= 3 {
            fwd_ms.push(a.elapsed_ms(&b)? as f64);
            bwd_ms.push(b.elapsed_ms(&c)? as f64);
            inf_ms.push(c.elapsed_ms(&d)? as f64);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (fm, bm, im) = (median(fwd_ms), median(bwd_ms), median(inf_ms));
    let flops = 6.0 * (tokens * k * d * i) as f64;
    println!(
        "forward {fm:.3} ms ({:.0} TFLOP/s), backward {bm:.3} ms ({:.0} TFLOP/s)  [useful FLOPs 6·T·k·D·I, x2 backward]",
        flops / fm / 1e9,
        2.0 * flops / bm / 1e9
    );
    println!(
        "inference forward {im:.3} ms ({:.0} TFLOP/s)",
        flops / im / 1e9
    );
    Ok(())
}
